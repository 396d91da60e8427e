"""``x-transformers`` (lucidrains) looped LMs, probed unchanged.

What its code does (``x_transformers/x_transformers.py``, 2.31.10):

- ``TransformerWrapper(looped=True, max_looped_steps=R)``: ``forward`` runs the whole
  ``attn_layers`` (a ``Decoder``: pre- and post-norm, attention, feed-forward) R times,
  ``x = attended`` feeding the next step: a round. After every step it applies the exit
  gate ``exit_gate`` (a ``Linear(dim, 1)``; its logits only feed the halting loss, not the
  returned logits) and, in train mode (``looped_pred_all_logits`` defaults to
  ``self.training``), the head ``to_logits``, whose per-step logits are discarded; the
  returned logits are ``to_logits`` of the last step, called once more.
- ``Decoder(weight_tie_layers=True, depth=R)``: ``depth`` is set to 1 and
  ``layers_execute_order = (0, 1) * R``: one attention entry and one feed-forward entry
  of ``attn_layers.layers`` executed R times each, alternately. Each entry is a
  ``ModuleList`` (norms, block, residual) that the loop unpacks, so the modules called are
  the pre-norm ``layers.k.0.0`` and the block ``layers.k.1`` (the residual owns nothing).
  Attention here is plain einsum attention (no ``F.scaled_dot_product_attention``).

Expected visit tables: looped, ``attn_layers`` R visits all reaching the logits, the exit
gate R visits none reaching them, ``to_logits`` R + 1 visits of which only the last
reaches them. Weight-tied: four sublayers (two pre-norms, attention, feed-forward), each
with R visits, all reaching the logits.
"""

from __future__ import annotations

import numpy as np
import pytest
from _oracles import counting_calls
from realmodels import EXACT, LANCZOS, PLAIN, XT_TIED_BLOCKS, make_xt_looped, make_xt_weight_tied

import loopprobe.testing as lpt

R = 3


# --------------------------------------------------------------------------- looped=True


def test_looped_visit_table_is_the_decoder_per_step_plus_the_per_step_gate_and_head():
    case = make_xt_looped(R)
    m = case.model
    with (
        counting_calls(m.attn_layers) as body,
        counting_calls(m.exit_gate) as gate,
        counting_calls(m.to_logits) as head,
    ):
        m(case.inputs)
    assert (len(body), len(gate), len(head)) == (R, R, R + 1)  # the code, read independently
    table = case.probe().visit_table(case.inputs).set_index("sublayer")
    assert sorted(table.index) == ["attn_layers", "exit_gate", "to_logits"]
    assert table.loc["attn_layers", "parameters"] == sum(
        p.numel() for p in m.attn_layers.parameters()
    )
    counts = table[["visits", "grad_visible", "no_grad_visits"]].astype(int)
    assert counts.loc["attn_layers"].tolist() == [R, R, 0]
    assert counts.loc["exit_gate"].tolist() == [R, 0, 0]
    assert counts.loc["to_logits"].tolist() == [R + 1, 1, 0]


def test_looped_gate_and_head_are_listed_as_heads_and_the_decoder_as_the_body():
    case = make_xt_looped(R)
    table = case.probe().visit_table(case.inputs).set_index("sublayer")
    assert table.role.to_dict() == {"attn_layers": "body", "exit_gate": "head", "to_logits": "head"}


def test_looped_sum_of_per_visit_updates_is_the_tied_gradient():
    make_xt_looped(R).check(lpt.check_updates_sum_to_tied_gradient, loss=True, rtol=EXACT)


def test_looped_each_per_visit_update_is_an_explicitly_untied_copy():
    compared = len(
        make_xt_looped(R).check(lpt.check_updates_match_untied_copy, loss=True, rtol=EXACT)
    )
    assert compared == R + 1  # the decoder's R visits and the head's last one


def test_looped_one_visit_sensitivity_is_the_top_singular_value_of_the_dense_jacobian():
    make_xt_looped(R).check(lpt.check_sensitivity_matches_dense_jacobian, output=True, **LANCZOS)


def test_looped_kappa_lies_between_zero_and_the_gradient_visible_visits():
    rep = make_xt_looped(R).check(
        lpt.check_kappa_in_range, loss=True, output=True, slack=1e-9, **LANCZOS
    )
    assert rep.sublayers.set_index("sublayer").R_g["attn_layers"] == R


def test_looped_increments_run_with_finite_norms():
    inc = make_xt_looped(R).increments()
    assert np.isfinite(inc.inc_norm).all() and len(inc.inc_norm) == len(inc.visits) > 0


def test_looped_spectral_radius_of_the_replayed_decoder_round_is_the_dense_one():
    make_xt_looped(R).check(lpt.check_spectral_radius_matches_dense, "attn_layers")


def test_looped_probing_leaves_the_model_bit_identical():
    make_xt_looped(R).check(
        lpt.check_probe_leaves_model_unchanged,
        loss=True,
        output=True,
        round_module="attn_layers",
        **PLAIN,
    )


# --------------------------------------------------------------------------- weight_tie_layers


def test_weight_tied_visit_table_is_two_norms_attention_and_feedforward_each_visited_depth_times():
    case = make_xt_weight_tied(R)
    m = case.model
    assert m.attn_layers.layers_execute_order == (0, 1) * R
    with counting_calls(m.get_submodule(XT_TIED_BLOCKS[1])) as attn:
        m(case.inputs)
    assert len(attn) == R
    table = case.probe().visit_table(case.inputs)
    assert list(table.sublayer) == list(XT_TIED_BLOCKS)
    assert list(table.visits) == [R] * 4 and list(table.grad_visible) == [R] * 4


def test_weight_tied_sum_of_per_visit_updates_is_the_tied_gradient():
    make_xt_weight_tied(R).check(lpt.check_updates_sum_to_tied_gradient, loss=True, rtol=EXACT)


def test_weight_tied_each_per_visit_update_is_an_explicitly_untied_copy():
    compared = len(
        make_xt_weight_tied(R).check(lpt.check_updates_match_untied_copy, loss=True, rtol=EXACT)
    )
    assert compared == 4 * R


def test_weight_tied_one_visit_sensitivity_is_the_top_singular_value_of_the_dense_jacobian():
    make_xt_weight_tied(R).check(
        lpt.check_sensitivity_matches_dense_jacobian, output=True, **LANCZOS
    )


def test_weight_tied_kappa_lies_between_zero_and_depth():
    rep = make_xt_weight_tied(R).check(
        lpt.check_kappa_in_range, loss=True, output=True, slack=1e-9, **LANCZOS
    )
    assert list(rep.sublayers.R_g) == [R] * 4


def test_weight_tied_increments_run_with_finite_norms():
    inc = make_xt_weight_tied(R).increments()
    assert np.isfinite(inc.inc_norm).all() and len(inc.inc_norm) == len(inc.visits) > 0
    assert len(inc.visits) == 4 * R


@pytest.mark.parametrize("block", [XT_TIED_BLOCKS[1], XT_TIED_BLOCKS[3]])
def test_weight_tied_blocks_are_residual_branches_not_rounds(block):
    import loopprobe as lp

    case = make_xt_weight_tied(R)
    with pytest.raises(ValueError, match="does not receive the output"):
        lp.replay_round(case.model, case.inputs, block)


def test_weight_tied_probing_leaves_the_model_bit_identical():
    make_xt_weight_tied(R).check(
        lpt.check_probe_leaves_model_unchanged, loss=True, output=True, **PLAIN
    )
