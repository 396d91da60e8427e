"""Hugging Face HRM-Text (``transformers.HrmTextForCausalLM``), probed unchanged.

What its code does (``transformers/models/hrm_text/modeling_hrm_text.py``, 5.24.0):
two stacks of decoder layers, ``model.L_module`` and ``model.H_module`` (each ends in a
weightless float32 RMSNorm). ``HrmTextModel.forward`` runs ``H_cycles`` high cycles; in
each, the L stack is called ``L_cycles`` times on ``z_L + z_H`` and then the H stack once
on ``z_H + z_L``: nested loops whose inner loop re-enters the same module. Only the
trailing ``L_bp_cycles_padded[h]`` L calls of cycle h carry gradient (the ``[2]`` default
is left-padded with 1s to ``H_cycles`` entries); the others run under ``torch.no_grad()``.

Expected visit table (H = L = 2, bp = [1, 2]): ``model.L_module`` with H * L = 4 visits,
of which 1 runs under no_grad and 3 reach F; ``model.H_module`` with H = 2 visits, both
reaching F (the logits read z_H of the last cycle, which reads every earlier state).
M = 6, M_g = 5. Neither stack's call r + 1 receives call r's output (the other stack's
state is added in between), so neither is a round by itself: ``replay_round`` refuses.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _oracles import counting_calls
from realmodels import EXACT, LANCZOS, PLAIN, make_hrm_text

import loopprobe as lp
import loopprobe.testing as lpt
from loopprobe.estimate.updates import per_visit_updates

H, L = 2, 2
LOW, HIGH = "model.L_module", "model.H_module"


def test_visit_table_has_the_low_stack_nested_in_the_high_cycles_with_leading_no_grad_calls():
    case = make_hrm_text(H, L)
    bp = case.model.model.L_bp_cycles_padded
    assert bp == [1, 2]
    no_grad = sum(L - b for b in bp)
    with (
        counting_calls(case.model.get_submodule(LOW)) as low,
        counting_calls(case.model.get_submodule(HIGH)) as high,
    ):
        case.model(case.inputs)
    assert (len(low), low.count(False), high) == (H * L, no_grad, [True] * H)
    table = case.probe().visit_table(case.inputs, output=case.output)
    assert list(table.sublayer) == [LOW, HIGH]
    assert list(table.visits) == [H * L, H]
    assert list(table.no_grad_visits) == [no_grad, 0]
    assert list(table.grad_visible) == [H * L - no_grad, H]
    assert (table.attrs["M"], table.attrs["M_g"]) == (H * L + H, H * L + H - no_grad)


def test_sum_of_per_visit_updates_is_the_tied_gradient_of_each_stack():
    make_hrm_text(H, L).check(lpt.check_updates_sum_to_tied_gradient, loss=True, rtol=EXACT)


def test_each_per_visit_update_is_the_gradient_of_an_explicitly_untied_copy():
    compared = len(
        make_hrm_text(H, L).check(lpt.check_updates_match_untied_copy, loss=True, rtol=EXACT)
    )
    assert compared == H * L - 1 + H  # every gradient-visible visit; the no_grad one is zero


def test_one_visit_sensitivity_is_the_top_singular_value_of_the_dense_jacobian():
    # The stacks' RMSNorm computes in float32 inside a float64 model: both sides carry
    # float32 roundoff (about 1e-7 relative), hence the looser tolerance.
    make_hrm_text(H, L).check(
        lpt.check_sensitivity_matches_dense_jacobian, output=True, rtol=1e-5, **LANCZOS
    )


def test_kappa_of_each_stack_lies_between_zero_and_its_gradient_visible_visits():
    rep = make_hrm_text(H, L).check(
        lpt.check_kappa_in_range, loss=True, output=True, slack=1e-9, **LANCZOS
    )
    assert list(rep.sublayers.R_g) == [H * L - 1, H]


def test_increments_of_the_state_returning_stacks_need_the_choice_and_then_run():
    # H_module(z_H, z_L) returns the new z_H; its next visit reads z_H only after HRM adds
    # the input injection, so no chain tells state from increment: loopprobe asks.
    with pytest.raises(ValueError, match="increment='delta' if it returns the updated stream"):
        lp.increments(make_hrm_text(H, L).probe(), make_hrm_text(H, L).inputs)
    inc = make_hrm_text(H, L).increments("delta")
    assert np.isfinite(inc.inc_norm).all()
    assert len(inc.visits) == H * L + H


@pytest.mark.parametrize("stack", [LOW, HIGH])
def test_replay_round_refuses_a_stack_whose_calls_do_not_chain(stack):
    case = make_hrm_text(H, L)
    with pytest.raises(ValueError, match=f"call 1 of '{stack}' does not receive the output"):
        lp.replay_round(case.model, case.inputs, stack)


def test_probing_leaves_the_model_bit_identical():
    make_hrm_text(H, L).check(
        lpt.check_probe_leaves_model_unchanged, loss=True, output=True, increment="delta", **PLAIN
    )


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_hf_gradient_checkpointing_leaves_visits_and_per_visit_updates_unchanged(use_reentrant):
    # HF-style checkpointing wraps each decoder layer inside the stacks (the recompute in
    # backward calls it again); the visits are the same visits, with the same G.
    plain, ckpt = make_hrm_text(H, L), make_hrm_text(H, L)
    ckpt.model.gradient_checkpointing_enable({"use_reentrant": use_reentrant})
    assert ckpt.model.is_gradient_checkpointing
    a = plain.probe().visit_table(plain.inputs, output=plain.output)
    b = ckpt.probe().visit_table(ckpt.inputs, output=ckpt.output)
    cols = ["sublayer", "visits", "grad_visible", "no_grad_visits"]
    assert b[cols].values.tolist() == a[cols].values.tolist()
    up_a = per_visit_updates(plain.probe(), plain.inputs, plain.loss_fn)
    up_b = per_visit_updates(ckpt.probe(), ckpt.inputs, ckpt.loss_fn)
    for j in range(2):
        assert up_b.visible[j].tolist() == up_a.visible[j].tolist()
        torch.testing.assert_close(up_b.G[j], up_a.G[j], rtol=1e-12, atol=1e-16)
