"""kappa's error bound (issue 29.1): certified against dense Jacobians, and what it costs."""

from __future__ import annotations

import pytest
import torch
from _small_steps import exact_small_step_kappa, family_member
from test_sensitivity import dense_blocks, top_sv
from thirdparty_models import ForLoopModel, SharedBlockModel, make, randn

import loopprobe as lp
from loopprobe.estimate.alignment import kappa_interval, visit_alignment
from loopprobe.linalg import norm_bounds, operator_norm, operator_norm_krylov

EPS = float(torch.finfo(torch.float64).eps)


def mse(target: torch.Tensor):
    return lambda out, inputs: ((out - target) ** 2).sum()


def brute_kappas(model, x, target, K: int, R: int) -> list[float]:
    """kappa_j of every block from an explicitly untied copy: dense Jacobians, exact G."""
    twin = model.untied()
    J = dense_blocks(twin, x, [f"steps.{i}." for i in range(K * R)])
    grads = torch.autograd.grad(mse(target)(twin(x), x), list(twin.steps.parameters()))
    n = len(list(twin.steps[0].parameters()))
    G = [torch.cat([g.reshape(-1) for g in grads[i * n : (i + 1) * n]]) for i in range(K * R)]
    out = []
    for j in range(K):
        Js, Gs = J[j::K], G[j::K]
        num = top_sv(sum(Js)) * float(sum(Gs).norm())
        out.append(num / (R * max(top_sv(a) for a in Js) * max(float(g.norm()) for g in Gs)))
    return out


@pytest.mark.parametrize("tol", [1e-2, 1e-4, 1e-6])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kappa_error_is_within_its_certified_bound_against_dense_jacobians(tol, seed):
    model = make(ForLoopModel, seed=seed, K=2, R=3)
    x, target = randn(3, 5, seed=seed + 1), randn(3, 5, seed=seed + 7)
    rep = visit_alignment(lp.attach(model), x, mse(target), max_iter=80, tol=tol)
    assert rep.converged, rep.reason
    assert rep.tol == tol and 0 <= rep.kappa_err <= tol
    brute = brute_kappas(model, x, target, K=2, R=3)
    for row, exact in zip(rep.sublayers.itertuples(), brute, strict=True):
        assert row.kappa_lo <= exact <= row.kappa_hi
        assert abs(row.kappa - exact) <= row.kappa_err <= tol
    assert rep.kappa_lo <= max(brute) <= rep.kappa_hi
    assert abs(rep.kappa - max(brute)) <= rep.kappa_err


def test_visits_that_cannot_be_the_max_stop_early_and_keep_a_true_interval():
    model = make(ForLoopModel, seed=0, K=2, R=3)
    x, target = randn(3, 5), randn(3, 5, seed=7)
    probe = lp.attach(model)
    loose = visit_alignment(probe, x, mse(target), max_iter=80, tol=1e-2)
    tight = visit_alignment(probe, x, mse(target), max_iter=80, tol=1e-6)
    assert loose.visits.iterations.sum() < tight.visits.iterations.sum()
    assert loose.kappa_err <= 1e-2 and tight.kappa_err <= 1e-6
    twin = model.untied()
    J = dense_blocks(twin, x, [f"steps.{i}." for i in range(6)])
    for rep in (loose, tight):
        for row in rep.visits.itertuples():
            exact = top_sv(J[row.r * 2 + row.j])
            assert row.U_lo <= exact <= row.U_hi < float("inf")
        for j in (0, 1):  # the visit with the largest norm ran longest
            mine = rep.visits[rep.visits.j == j]
            top = mine.U_norm.idxmax()
            assert mine.iterations[top] == mine.iterations.max()


def test_a_shared_block_kappa_is_certified_and_each_visit_on_request():
    model = make(SharedBlockModel, R=4)
    x, target = randn(4, 6), randn(4, 3, seed=3)
    rep = visit_alignment(lp.attach(model), x, mse(target), tol=1e-6, each_visit=True)
    assert rep.converged and rep.kappa_err <= 1e-6
    for row in rep.visits.itertuples():
        assert row.U_hi <= row.U_norm * (1 + 1e-6)


def test_kappa_interval_widens_with_the_tied_and_the_max_visit_intervals():
    exact = kappa_interval((1.4, 1.4), [(1.0, 1.0), (0.5, 0.5)], 3.0, [1.5, 1.0], 0.0)
    assert exact == pytest.approx((1.4, 1.4))  # 1.4 * 3 / (2 * 1 * 1.5)
    lo, hi = kappa_interval((1.0, 1.1), [(1.0, 1.2), (0.5, 0.6)], 3.0, [1.5, 1.0], 0.0)
    assert lo == pytest.approx(1.0 / 1.2) and hi == pytest.approx(1.1)
    # a visit whose interval lies below the largest lower end does not move the interval
    assert kappa_interval((1.0, 1.1), [(1.0, 1.2), (0.5, 0.9)], 3.0, [1.5, 1.0], 0.0) == (lo, hi)
    assert kappa_interval((1.0, 1.0), [(1.0, 1.0)], 2.0, [2.0], 0.0) == (1.0, 1.0)  # R = 1
    assert kappa_interval((9.0, 9.0), [(1.0, 1.0), (1.0, 1.0)], 2.0, [1.0, 1.0], 0.0)[1] == 2.0


def test_the_tied_norms_upper_end_is_the_sum_of_the_visits_when_that_is_smaller():
    # ||sum_r U_r|| <= sum_r hi_r: an uncertified tied estimate still gives a finite interval
    inf = float("inf")
    lo, hi = kappa_interval((1.4, inf), [(1.0, 1.01), (0.5, 0.52)], 3.0, [1.5, 1.0], 0.0)
    assert lo == pytest.approx(1.4 * 2 / (2 * 1.01)) and hi == pytest.approx(1.53 * 2 / 2)
    assert kappa_interval((1.4, 1.45), [(1.0, 1.01), (0.5, 0.52)], 3.0, [1.5, 1.0], 0.0)[1] == (
        pytest.approx(1.45)
    )


def test_norm_bounds_hold_the_top_singular_value_once_the_residual_is_trusted():
    g = torch.Generator().manual_seed(0)
    A = torch.randn(40, 30, generator=g, dtype=torch.float64)
    s = float(torch.linalg.matrix_norm(A, 2))
    for it in range(1, 30):
        (est,) = operator_norm_krylov(
            lambda v, i: v @ A.T, lambda u, i: u @ A, torch.randn(1, 30, generator=g,
            dtype=torch.float64), max_iter=it, tol=0.0, subset=True,
        )  # fmt: skip
        lo, hi = norm_bounds(est.value, est.residual, EPS)
        assert lo <= s <= hi
    assert norm_bounds(float("nan"), float("nan"), EPS) == (0.0, float("inf"))


def test_a_stop_rule_replaces_the_tolerance_in_both_solvers():
    A = torch.diag(torch.linspace(1, 2, 20, dtype=torch.float64))
    v0 = torch.ones(2, 20, dtype=torch.float64)
    seen = []

    def stop(idx, sigma, res):
        seen.append(idx.tolist())
        return (idx == 0) | (res < 1e-3)

    for solver in (operator_norm_krylov, operator_norm):
        seen.clear()
        first, second = solver(
            lambda v, i=None: v @ A, lambda u, i=None: u @ A, v0, max_iter=200, tol=0.0,
            subset=True, stop=stop,
        )  # fmt: skip
        assert first.iterations == 1 and first.converged  # told to stop at once
        assert second.converged and second.residual < 1e-3 and second.iterations > 1
        assert seen[0] == [0, 1] and all(s == [1] for s in seen[1:])


def test_kappa_tolerance_must_be_positive():
    model = make(ForLoopModel, K=2, R=2)
    x, target = randn(3, 5), randn(3, 5, seed=7)
    with pytest.raises(ValueError, match="tol=0.0"):
        visit_alignment(lp.attach(model), x, mse(target), tol=0.0)


def test_narrow_products_give_the_numbers_of_products_over_every_visit():
    # Issue 29.2: a visit operator's products carry offsets at the visits (r, .) only.
    model = make(ForLoopModel, K=2, R=3)
    x = randn(3, 5)
    probe = lp.attach(model)
    kw = {"max_iter": 12, "tol": 0.0, "warm_visits": False}
    narrow = lp.sensitivity_norms(probe, x, **kw)
    every = lp.sensitivity_norms(probe, x, narrow=False, **kw)
    pairs = zip(narrow.visit_norms, every.visit_norms, strict=True)
    for a, b in [*pairs, *zip(narrow.tied_norms.values(), every.tied_norms.values(), strict=True)]:
        assert a.value == pytest.approx(b.value, rel=1e-12, abs=0)
        assert a.iterations == b.iterations == 12


def test_a_restricted_jacobian_transposes_only_its_visits_and_matches_the_whole_one():
    from loopprobe.differentiate.jacobian import VisitJacobian

    model = make(ForLoopModel, K=2, R=3)
    x = randn(3, 5)
    probe = lp.attach(model)
    visits = [v for v in probe.visits(x) if v.grad_visible]
    jac = VisitJacobian(probe, x, visits)
    ks = [k for k, v in enumerate(visits) if v.r == 1]
    sub = jac.restricted(ks)
    w = randn(jac.vjp_fn() and jac.F0.numel(), seed=5)
    whole, part = jac.transpose_all(w), sub.transpose_all(w)
    assert len(part) == len(ks) == 2
    for k, t in zip(ks, part, strict=True):
        torch.testing.assert_close(t, whole[k], rtol=1e-12, atol=1e-14)
    twin = model.untied()
    J = dense_blocks(twin, x, [f"steps.{i}." for i in range(6)])
    for k, t in zip(ks, part, strict=True):
        torch.testing.assert_close(t, J[visits[k].r * 2 + visits[k].j].T @ w)


def aligned(seed: int, R: int = 3) -> ForLoopModel:
    """A ForLoopModel whose blocks are near the identity: its visits are aligned."""
    model = make(ForLoopModel, seed=seed, K=2, R=R)
    with torch.no_grad():
        for layer in model.layers:
            layer.fc2.weight.mul_(0.05)
            layer.fc2.bias.mul_(0.05)
    return model


@pytest.mark.parametrize("R", [3, 5])
@pytest.mark.parametrize(("tol", "least"), [(1e-2, 1), (1e-4, 0), (1e-6, 0)])
def test_warm_started_kappa_holds_the_dense_kappa_where_the_visits_bound_the_tied_norm(
    tol, least, R
):
    # issue 29.1: the tied operator starts from its visits' top vectors and may stop on the
    # upper end sum_r hi_r (triangle inequality) before its own residual is tight. At R 5 the
    # visits r = 0..2 start from the line through the two visits after them.
    binding = 0
    for seed in (0, 1, 2):
        model = aligned(seed, R)
        x, target = randn(3, 5, seed=seed + 1), randn(3, 5, seed=seed + 7)
        rep = visit_alignment(
            lp.attach(model), x, mse(target), max_iter=80, tol=tol, warm_visits=True
        )
        assert rep.converged and rep.kappa_err <= tol, rep.reason
        brute = brute_kappas(model, x, target, K=2, R=R)
        for row, exact in zip(rep.sublayers.itertuples(), brute, strict=True):
            assert row.kappa_lo <= exact <= row.kappa_hi
            assert abs(row.kappa - exact) <= row.kappa_err
            tied = rep.sensitivity.tied_norms[row.j]
            own = norm_bounds(tied.value, tied.residual, EPS)[1]
            binding += own > rep.visits[rep.visits.j == row.j].U_hi.sum()
    # at 1e-2 the new upper end held an interval at R 3: it is exercised (at R 5 the tied
    # operators of these models converge past it)
    assert binding >= (least if R == 3 else 0)


def test_a_visit_that_missed_its_top_singular_value_is_caught_not_reported_as_converged():
    # A Krylov run can settle on a lower singular value with a tiny residual (seen on a
    # float32 LoopedGPT, d 32, R 8: one visit at 0.05493 against its neighbours' 0.05616);
    # the visits' upper ends then undercut the tied norm's certified lower end.
    import dataclasses

    from loopprobe.estimate.alignment import _report, visits_contradict

    model = make(ForLoopModel, seed=0, K=2, R=3)
    x, target = randn(3, 5, seed=1), randn(3, 5, seed=7)
    rep = visit_alignment(lp.attach(model), x, mse(target), max_iter=80, tol=1e-6)
    assert rep.converged, rep.reason
    sens = rep.sensitivity
    mine = [k for k, v in enumerate(sens.visits) if v.j == 0]
    top = max(mine, key=lambda k: sens.visit_norms[k].value)
    norms = list(sens.visit_norms)
    norms[top] = dataclasses.replace(norms[top], value=norms[top].value * 0.5)  # a lower one
    bad = _report(rep.updates, dataclasses.replace(sens, visit_norms=norms), None, 1e-6)
    assert not bad.converged and "missed its top singular value" in bad.reason
    assert bad.kappa_err == float("inf")
    frame = bad.to_frame()  # the tidy frame says it too, not only the report object
    assert frame.attrs["converged"] is False and frame.attrs["reason"] == bad.reason
    assert rep.to_frame().attrs["converged"] is True
    assert rep.to_frame().attrs["kappa_R_err"] == rep.kappa_err <= 1e-6
    row = bad.sublayers.set_index("sublayer").loc["layers.0"]
    assert not row.converged and bool(bad.sublayers.set_index("sublayer").loc["layers.1"].converged)
    assert row.kappa_lo <= row.kappa_hi  # the tied norm's own upper end, not the visits' sum
    assert visits_contradict((2.5, 2.6), [(1.0, 1.1), (1.2, 1.3)], EPS)
    assert not visits_contradict((2.3, 2.6), [(1.0, 1.1), (1.2, 1.3)], EPS)


def test_an_operator_still_beaten_after_the_restarts_is_named_and_not_converged(monkeypatch):
    from loopprobe.estimate import sensitivity_runs

    monkeypatch.setattr(sensitivity_runs, "REPAIR_ROUNDS", 0)  # no restart: what is left
    model, x, y = family_member(4, "lp", 0)
    rep = lp.visit_alignment(
        lp.attach(model), x, lambda out, inp: 0.5 * (out - y).pow(2).sum(),
        method="lanczos", max_iter=30,
    )  # fmt: skip
    assert not rep.converged and not rep.sensitivity.converged
    assert "missed its top singular value" in rep.reason
    assert "W r=" in rep.reason or "W (tied)" in rep.reason  # named, not a position


@pytest.mark.parametrize("kind", ["lp", "plain"])
@pytest.mark.parametrize("R", [2, 4, 8])
def test_a_cluster_of_equal_top_singular_values_is_repaired_within_the_certified_bound(R, kind):
    # Aligned visits of a small step x + eps W x (eps 1e-6): each U_r has a cluster of d
    # top singular values split by ~1e-6. Single starts settled inside it, so kappa at R 2
    # came out 1.9999972 with a certified interval below the exact 1.9999987 (a wrong number
    # marked converged), and at R 4, 8 the tied norm's lower end beat the visits' sum (not
    # converged). Restarts from each other's top vectors make them consistent.
    model, x, y = family_member(R, kind, 0)
    exact = exact_small_step_kappa(model, x, y, R)
    rep = lp.visit_alignment(
        lp.attach(model), x, lambda out, inp: 0.5 * (out - y).pow(2).sum(),
        method="lanczos", max_iter=30,
    )  # fmt: skip
    assert "missed its top" not in rep.reason  # the restarts resolved every operator
    assert rep.kappa_lo <= exact <= rep.kappa_hi, (rep.kappa_lo, exact, rep.kappa_hi)
    assert abs(rep.kappa - exact) <= rep.kappa_err
    if kind == "lp":  # the proofs_check statement's model: converged within 30 iterations
        assert rep.converged and rep.kappa_err <= 1e-6, rep.reason
    else:  # the plain twin at R 4 ends at a bound of 1.04e-6: honestly not converged
        assert rep.converged == (rep.kappa_err <= 1e-6), rep.reason
