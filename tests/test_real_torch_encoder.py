"""torch's own ``nn.TransformerEncoderLayer`` looped R times, as a researcher writes it.

``realmodels.LoopedEncoder``: embedding, one pre-norm ``nn.TransformerEncoderLayer``
(``nn.MultiheadAttention``, hence ``F.scaled_dot_product_attention``) called R times by a
for-loop, a final LayerNorm and a linear head. The same weights are built plain and with
``torch.utils.checkpoint`` around each call (``use_reentrant=False`` and ``True``): the
recompute in backward calls the layer again, but it is the same visit.

Expected visit table: one sublayer ``layer`` with R visits, all reaching the logits, the
same for all three variants; each call maps the stream to the next: a round.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _oracles import counting_calls
from realmodels import EXACT, LANCZOS, PLAIN, make_torch_encoder

import loopprobe as lp
import loopprobe.testing as lpt
from loopprobe.estimate.updates import per_visit_updates

R = 3
CHECKPOINTING = [None, "non_reentrant", "reentrant"]


@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
def test_visit_table_is_one_layer_visited_R_times_with_or_without_checkpointing(checkpointing):
    case = make_torch_encoder(R, checkpointing)
    with counting_calls(case.model.layer) as calls:
        case.model(case.inputs)
    assert len(calls) == R  # forward only: the recompute happens in backward
    table = case.probe().visit_table(case.inputs)
    assert list(table.sublayer) == ["layer"]
    assert (int(table.visits[0]), int(table.grad_visible[0]), int(table.no_grad_visits[0])) == (
        R,
        R,
        0,
    )


def test_sum_of_per_visit_updates_is_the_tied_gradient():
    make_torch_encoder(R).check(lpt.check_updates_sum_to_tied_gradient, loss=True, rtol=EXACT)


def test_each_per_visit_update_is_the_gradient_of_an_explicitly_untied_copy():
    compared = len(
        make_torch_encoder(R).check(lpt.check_updates_match_untied_copy, loss=True, rtol=EXACT)
    )
    assert compared == R


@pytest.mark.parametrize("checkpointing", CHECKPOINTING[1:])
def test_checkpointed_per_visit_updates_equal_the_plain_models(checkpointing):
    plain, ckpt = make_torch_encoder(R), make_torch_encoder(R, checkpointing)
    a = per_visit_updates(plain.probe(), plain.inputs, plain.loss_fn)
    b = per_visit_updates(ckpt.probe(), ckpt.inputs, ckpt.loss_fn)
    assert [v.r for v in b.visits] == [v.r for v in a.visits] == list(range(R))
    torch.testing.assert_close(b.G[0], a.G[0], rtol=1e-12, atol=1e-14)
    assert b.visible[0].tolist() == [True] * R


def test_one_visit_sensitivity_is_the_top_singular_value_of_the_dense_jacobian():
    make_torch_encoder(R).check(
        lpt.check_sensitivity_matches_dense_jacobian, output=True, **LANCZOS
    )


def test_kappa_lies_between_zero_and_R():
    rep = make_torch_encoder(R).check(
        lpt.check_kappa_in_range, loss=True, output=True, slack=1e-9, **LANCZOS
    )
    assert list(rep.sublayers.R_g) == [R]


@pytest.mark.parametrize("checkpointing", CHECKPOINTING[1:])
def test_checkpointed_kappa_equals_the_plain_models(checkpointing):
    plain, ckpt = make_torch_encoder(R), make_torch_encoder(R, checkpointing)
    a = lp.visit_alignment(plain.probe(), plain.inputs, plain.loss_fn, method="lanczos")
    b = lp.visit_alignment(ckpt.probe(), ckpt.inputs, ckpt.loss_fn, method="lanczos")
    assert b.kappa == pytest.approx(a.kappa, rel=1e-8)


def test_increments_run_with_finite_norms():
    inc = make_torch_encoder(R).increments()
    assert np.isfinite(inc.inc_norm).all() and len(inc.inc_norm) == len(inc.visits) > 0
    assert len(inc.visits) == R


def test_spectral_radius_of_the_replayed_layer_round_is_the_dense_one():
    make_torch_encoder(R).check(lpt.check_spectral_radius_matches_dense, "layer")


@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
def test_probing_leaves_the_model_bit_identical(checkpointing):
    make_torch_encoder(R, checkpointing).check(
        lpt.check_probe_leaves_model_unchanged,
        loss=True,
        output=True,
        round_module="layer",
        **PLAIN,
    )


def test_increments_of_a_layer_that_returns_the_updated_stream_are_output_minus_input():
    # nn.TransformerEncoderLayer returns x + sa(x) + ff(...): the stream, not an increment.
    # Brute force: the layer's own inputs and outputs, recorded by a plain forward hook.
    case = make_torch_encoder(R)
    seen = []
    h = case.model.layer.register_forward_hook(lambda m, a, out: seen.append(out - a[0]))
    try:
        with torch.no_grad():
            case.model(case.inputs)
    finally:
        h.remove()
    brute = torch.stack([d.norm() for d in seen]).numpy()
    explicit = lp.increments(case.probe(), case.inputs, increment="delta")
    np.testing.assert_allclose(explicit.inc_norm, brute, rtol=1e-12)
    # Unasked, loopprobe must measure the same increments or refuse to guess; cosines of
    # the states themselves (what increment="output" measures here) are not increments.
    try:
        default = lp.increments(case.probe(), case.inputs)
    except ValueError as e:
        assert "increment=" in str(e)
    else:
        np.testing.assert_allclose(default.inc_norm, brute, rtol=1e-12)
