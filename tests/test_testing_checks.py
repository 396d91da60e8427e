"""Each check of loopprobe.testing passes where its statement holds and fails, with the
figures in the message, on a model built to violate it (planted user-model bugs included)."""

from __future__ import annotations

import pytest
import torch
from _testing_family import batch, loop, loss, recur

import loopprobe as lp
import loopprobe.testing as lpt

f64 = torch.float64


def x_for(model):
    return batch(model, torch.Generator().manual_seed(0))


def test_per_visit_updates_sum_to_the_tied_gradient_of_plain_autograd():
    m = loop(R=3, K=2)
    errors = lpt.check_updates_sum_to_tied_gradient(m, x_for(m), loss)
    assert set(errors) == {"blocks.0", "blocks.1"} and max(errors.values()) < 1e-12


def test_a_shared_weight_used_outside_its_module_call_breaks_the_sum_and_is_named():
    m = loop(R=4, bug="bypass")
    with pytest.raises(AssertionError, match=r"'blocks.0'.*do not sum.*\n.*rtol=1e-06"):
        lpt.check_updates_sum_to_tied_gradient(m, x_for(m), loss)


def test_kappa_lies_in_zero_to_R_with_converged_estimates():
    m = loop(R=4)
    rep = lpt.check_kappa_in_range(m, x_for(m), loss)
    assert 1 <= rep.kappa <= 4 and rep.converged


def test_kappa_from_unconverged_estimates_fails_with_the_reason():
    m = loop(R=4)
    with pytest.raises(AssertionError, match=r"did not converge.*\n.*not converged after up to 2"):
        lpt.check_kappa_in_range(m, x_for(m), loss, max_iter=2)


def test_probing_a_sane_model_leaves_it_unchanged():
    m = loop(R=3)
    m.inp.weight.grad = torch.ones_like(m.inp.weight)  # a .grad that must survive
    lpt.check_probe_leaves_model_unchanged(m, x_for(m), loss)


def test_a_block_reinitialised_at_every_visit_is_blamed_on_the_model():
    m = loop(R=3, bug="reinit")
    x = x_for(m)
    for check in (lpt.check_probe_leaves_model_unchanged, lpt.check_first_order_change):
        with pytest.raises(AssertionError, match=r"own forward changes.*\n.*fc1.weight: value"):
            check(m, x, loss)


def test_a_probe_that_leaves_a_hook_behind_is_reported_as_a_loopprobe_bug(monkeypatch):
    real = lp.bound_check

    def leaky(probe, *args, **kwargs):
        probe.model.out.register_forward_hook(lambda *a: None)
        return real(probe, *args, **kwargs)

    monkeypatch.setattr(lp, "bound_check", leaky)
    m = loop(R=3)
    with pytest.raises(AssertionError, match=r"out: 0 hooks -> 1.*\n.*loopprobe bug"):
        lpt.check_probe_leaves_model_unchanged(m, x_for(m), loss)


def test_a_small_step_changes_F_as_the_tied_JVP_says():
    m = loop(R=4)
    chk = lpt.check_first_order_change(m, x_for(m), loss)
    assert abs(chk.dF_true / chk.dF_first - 1) < 1e-4


def test_straight_through_quantised_weights_break_the_first_order_identity():
    m = loop(R=4, bug="ste")
    with pytest.raises(AssertionError, match=r"first-order.*\n.*relative difference 0\.\d+ > rtol"):
        lpt.check_first_order_change(m, x_for(m), loss)


def test_the_bound_holds_with_a_stated_constant_and_fails_for_a_wrong_residual_scale():
    good, bad = loop(R=8), loop(R=8, bug="scale")
    chk = lpt.check_bound(good, x_for(good), loss, C_max=1e-3)
    assert chk.C < 1e-3
    with pytest.raises(AssertionError, match=r"exceeds the stated bound\n.*dF/F = .* > C_max"):
        lpt.check_bound(bad, x_for(bad), loss, C_max=1e-3)


def test_deeploop_keeps_the_bound_flat_in_R_and_deepnorm_or_a_wrong_scale_do_not():
    sweep = lpt.check_bound_slope(lambda R: loop(R=R), x_for, loss, max_slope=0.15)
    assert abs(sweep.slope) < 0.15 and sweep.C_ratio < 1.2
    for bad in ({"p": 0.25}, {"bug": "scale"}):
        with pytest.raises(
            AssertionError, match=r"slope of dF/F in R is 0\.9.*\n.*R = \[2, 4, 8\]"
        ):
            lpt.check_bound_slope(lambda R, b=bad: loop(R=R, **b), x_for, loss, max_slope=0.15)


def test_a_slope_check_on_a_bare_model_asks_for_the_family():
    with pytest.raises(TypeError, match="check_bound_slope: .* pass a factory R -> model"):
        lpt.check_bound_slope(loop(R=2), None, loss, max_slope=0.15)


def test_increment_growth_is_flat_for_scaled_post_norm_and_grows_for_plain_pre_norm():
    g = lpt.check_increment_growth(lambda R: loop(R=R), x_for, band=(-0.15, 0.15))
    assert g.shape == (3,)
    with pytest.raises(AssertionError, match=r"growth exponent 0\.6\d+ outside \[-0.15, 0.15\]"):
        lpt.check_increment_growth(
            lambda R: loop(R=R, p=0.0, bug="prenorm"), x_for, band=(-0.15, 0.15)
        )


def test_a_contracting_recurrence_has_a_fixed_point_with_radius_below_one():
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(0), dtype=f64)
    rho = lpt.check_fixed_point_contracts(recur(0.9), x, "cell", input_arg=1)
    assert 0 < rho.value < 0.9
    with pytest.raises(AssertionError, match="no fixed point reached\n.*residual"):
        lpt.check_fixed_point_contracts(recur(3.0), x, "cell", input_arg=1)


def test_a_stated_radius_below_the_measured_one_fails_with_the_eigenvalues():
    W = torch.diag(torch.tensor([0.8, 0.3, 0.1], dtype=f64))
    one, zero = torch.ones(3, dtype=f64), torch.zeros(3, dtype=f64)
    rm = lp.RoundMap(step=lambda h, x: W @ h + x, x=one, h0=zero, rounds=3)
    assert abs(lpt.check_fixed_point_contracts(rm).value - 0.8) < 1e-8
    with pytest.raises(AssertionError, match=r"spectral radius .* is 0.8 >= 0.5\n.*\[0.8, 0.3"):
        lpt.check_fixed_point_contracts(rm, max_rho=0.5)


def test_a_kappa_R_that_is_not_the_bodys_largest_kappa_j_fails(monkeypatch):
    import dataclasses

    real = lp.visit_alignment
    monkeypatch.setattr(
        lp,
        "visit_alignment",
        lambda *a, **k: dataclasses.replace(r := real(*a, **k), kappa=r.kappa * 0.9),
    )
    m = loop(R=3, K=2)
    with pytest.raises(AssertionError, match=r"kappa_R is not the largest kappa_j.*\n.*'blocks.0'"):
        lpt.check_kappa_in_range(m, x_for(m), loss)
