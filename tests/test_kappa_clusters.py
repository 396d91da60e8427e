"""kappa on clusters of nearly equal top singular values: never converged outside its interval.

Small steps ``x + eps W x`` (eps 1e-6, d 8, float64) give every visit ``U_r`` a cluster of d
top singular values split by ~1e-6 relative, the width of the default bound: a Krylov run
can settle on a lower member with a small residual, and its upper end is then wrong (the
caveat of :func:`loopprobe.linalg.norm_bounds`). The family of
``benchmarks/bench_kappa_clusters.py``; the exact kappa from dense Jacobians of an untied twin.
"""

from __future__ import annotations

import pytest
from _small_steps import exact_small_step_kappa, family_member

import loopprobe as lp


@pytest.mark.parametrize("warm", [False, True])
@pytest.mark.parametrize(
    ("R", "kind", "seed"),
    [
        (3, "lp", 1),  # cold: converged with the exact kappa 2.0e-8 above the interval
        (3, "lp", 2),  # largest visit on the second member: needs the second start
        (2, "plain", 1),
        (5, "lp", 0),
        (8, "plain", 2),
    ],
)
def test_kappa_on_a_top_cluster_is_inside_its_interval_or_not_converged(R, kind, seed, warm):
    model, x, y = family_member(R, kind, seed)
    exact = exact_small_step_kappa(model, x, y, R)
    rep = lp.visit_alignment(
        lp.attach(model), x, lambda out, inp: 0.5 * (out - y).pow(2).sum(),
        method="lanczos", max_iter=30, warm_visits=warm,
    )  # fmt: skip
    inside = rep.kappa_lo <= exact <= rep.kappa_hi
    assert inside or not rep.converged, (rep.kappa_lo, exact, rep.kappa_hi)
    if rep.converged:  # the interval holds it, so the reported error bound does too
        assert abs(rep.kappa - exact) <= rep.kappa_err


def squared_error(y):
    return lambda out, inp: 0.5 * (out - y).pow(2).sum()


def test_the_first_two_cold_cases_converge_inside_their_intervals():
    # Not converged would pass the test above trivially: these two must also converge. At
    # 825bdab seed 1 converged outside its interval and seed 2 did not converge; with the
    # resume after a repair but no second start, seed 2 converged outside (7.6e-7 below).
    for seed in (1, 2):
        model, x, y = family_member(3, "lp", seed)
        exact = exact_small_step_kappa(model, x, y, 3)
        rep = lp.visit_alignment(
            lp.attach(model), x, squared_error(y), method="lanczos", max_iter=30,
            warm_visits=False,
        )  # fmt: skip
        assert rep.converged, rep.reason
        assert rep.kappa_lo <= exact <= rep.kappa_hi, (seed, rep.kappa_lo, exact, rep.kappa_hi)


def test_a_second_start_runs_only_where_a_cluster_is_seen(monkeypatch):
    # The cost guard: on a model without a top cluster (third-party for-loop, float64) no
    # visit gets a second start; on the cluster family the largest visit does.
    from thirdparty_models import ForLoopModel, make, randn

    from loopprobe.estimate import sensitivity

    seen = []
    real = sensitivity.second_starts
    monkeypatch.setattr(
        sensitivity, "second_starts", lambda run, v0, vec, found, rows, *a: (
            seen.append(list(rows)), real(run, v0, vec, found, rows, *a))
    )  # fmt: skip
    model = make(ForLoopModel).double()
    x = randn(4, 5)
    lp.visit_alignment(lp.attach(model), x, lambda out, inp: out.pow(2).sum())
    assert seen == [[]]
    model, x, y = family_member(3, "lp", 2)
    lp.visit_alignment(lp.attach(model), x, squared_error(y), method="lanczos", max_iter=30)
    assert len(seen) == 2 and len(seen[1]) == 1
