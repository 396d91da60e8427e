"""Issue 27, items 4 and 5: the LR-transfer contrast under three vertex estimators, the claims
the cached studies already decide (1/N against 1/sqrt(N) at N = 8, outer norm and recall
against reachability), on planted data with a known answer and on the committed CSVs."""

from __future__ import annotations

import math
import pathlib

import numpy as np
import pandas as pd
import pytest

from studies.lr_transfer.analysis import (
    LR_RUNS,
    lr_contrast_sensitivity,
    lr_divergence,
    lr_loop_cost,
    lr_rule_gap,
)
from studies.optimum import (
    best_loss_gap,
    contrast_interval,
    vertex,
    vertex_fixed,
    vertex_quartic,
)
from studies.reachability.analysis import reach_outer_norm_effect

STUDIES = pathlib.Path(__file__).resolve().parents[1] / "studies"
LR_DIR, REACH_DIR = STUDIES / "lr_transfer", STUDIES / "reachability"
X = np.arange(-19, -7) / 2  # run 2's half-octave grid, log2 lr


def cells(opt: dict, level: dict | None = None, seeds=range(8), noise=0.004, rng_seed=0):
    """arm, N, lr, seed, loss = 0.04 (log2 lr - opt)^2 + level + a per-seed offset shared by
    every curve (1 nat wide, so only a paired comparison sees a small gap) + noise."""
    rng = np.random.default_rng(rng_seed)
    offset = {s: rng.uniform(0, 1) for s in seeds}
    rows = []
    for (arm, N), o in opt.items():
        for s in seeds:
            for x in X:
                loss = 0.04 * (x - o) ** 2 + (level or {}).get((arm, N), 2.6) + offset[s]
                rows.append({"arm": arm, "N": N, "lr": 2.0**x, "seed": s, "K": 1,
                             "loss": loss + noise * rng.normal(), "diverged": False})  # fmt: skip
    return pd.DataFrame(rows)


def rules(drift_sqrt: float, drift_n: float, **kw) -> pd.DataFrame:
    return cells({("1/sqrt(N)", 1): -6.5, ("1/sqrt(N)", 8): -6.5 + drift_sqrt,
                  ("1/N", 1): -6.5, ("1/N", 8): -6.5 + drift_n}, **kw)  # fmt: skip


# ------------------------------------------------------------------ the vertex estimators


@pytest.mark.parametrize("v", [-8.3, -6.5, -6.1, -5.2])
def test_every_vertex_estimator_finds_a_planted_parabolas_vertex_to_a_tenth_of_an_octave(v):
    y = 0.03 * (X - v) ** 2 + 2.6 + 0.002 * np.sin(7 * X)  # a small deterministic ripple
    assert vertex(X, y, 4) == pytest.approx(v, abs=0.1)
    assert vertex_quartic(X, y) == pytest.approx(v, abs=0.1)
    assert vertex_fixed(X, y, centre=v + 0.5, half_width=4) == pytest.approx(v, abs=0.1)


def test_the_quartic_vertex_finds_an_asymmetric_minimum_and_refuses_one_at_the_grid_end():
    def f(x):
        return 0.02 * (x + 6) ** 2 + 0.004 * (x + 6) ** 3 + 0.001 * (x + 6) ** 4

    dense = np.linspace(X[0], X[-1], 100001)
    true = dense[np.argmin(f(dense))]  # about -6.0, but not a parabola's vertex
    assert vertex_quartic(X, f(X)) == pytest.approx(true, abs=1e-3)
    assert abs(vertex(X, f(X), 4) - true) > 1e-3  # the parabola through 9 points misses it
    assert math.isnan(vertex_quartic(X, 2.6 - 0.05 * X))  # monotone: optimum off the grid
    u = (X + 6.75) / 1.5
    assert math.isnan(vertex_quartic(X, u**3 - u))  # a local minimum, but the left end is lower
    assert math.isnan(vertex_quartic(X, 2.6 + 0.01 * (X + 11) ** 2))  # minimum left of it
    assert math.isnan(vertex_quartic(X[:5], X[:5] ** 2))  # five points: interpolation


def test_the_fixed_window_does_not_follow_the_argmin_and_refuses_a_vertex_outside_it():
    y = 0.03 * (X + 6.5) ** 2 + 2.6
    spiked = y.copy()
    spiked[0] = 2.0  # a far, spurious minimum: the argmin window moves to it, a fixed one not
    assert math.isnan(vertex(X, spiked, 4)) or abs(vertex(X, spiked, 4) + 6.5) > 1
    assert vertex_fixed(X, spiked, centre=-6.5, half_width=4) == pytest.approx(-6.5, abs=1e-6)
    assert math.isnan(vertex_fixed(X, y, centre=-4.0, half_width=2))  # vertex left of -5
    with pytest.raises(ValueError, match="half_width"):
        vertex_fixed(X, y, centre=-6.5, half_width=0)


def test_the_contrast_takes_the_estimator_it_is_given():
    c = rules(-1.5, 0.0)
    for est in (None, vertex_quartic, lambda x, y: vertex_fixed(x, y, -7.0, 5)):
        got = contrast_interval(c, "arm", "1/sqrt(N)", "1/N", n_boot=100, half_width=4,
                                estimator=est)  # fmt: skip
        assert got["contrast"] == pytest.approx(-1.5, abs=0.1)
    const = contrast_interval(c, "arm", "1/sqrt(N)", "1/N", n_boot=20,
                              estimator=lambda x, y: 0.0)  # fmt: skip
    assert const["contrast"] == 0.0 and const["ci_low"] == const["ci_high"] == 0.0


# ------------------------------------------------------------------ the sensitivity table


def test_a_planted_difference_is_called_as_predicted_under_every_estimator():
    t, statement = lr_contrast_sensitivity(rules(-1.5, 0.0), half_width=4, n_boot=200)
    assert list(t["verdict"]) == ["differ as predicted"] * 3
    assert t["contrast"].to_numpy() == pytest.approx([-1.5] * 3, abs=0.1)
    assert not t["excludes_bound"].any()
    assert statement == "under every vertex estimator: the rules differ as predicted"


def test_a_planted_equality_excludes_the_bound_under_every_estimator():
    t, statement = lr_contrast_sensitivity(rules(-0.5, -0.5), half_width=4, n_boot=200)
    assert list(t["verdict"]) == ["do not differ as predicted"] * 3
    assert t["excludes_bound"].all()
    assert statement == ("under every vertex estimator: the predicted contrast -1.5 is "
                         "excluded; the rules do not differ as predicted")  # fmt: skip


def test_an_estimator_that_loses_its_vertex_decides_nothing():
    # 1/sqrt(N)'s N = 8 optimum 3 octaves left of the pooled argmin: outside the fixed window
    t, statement = lr_contrast_sensitivity(rules(-2.5, 0.0), half_width=2, n_boot=200)
    fixed = t.set_index("estimator").loc["fixed window"]
    assert fixed["verdict"].startswith("undecided (no vertex in")
    assert not fixed["excludes_bound"]
    assert "estimator-dependent" in statement


# ------------------------------------------------------------------ loss at the optimum


def test_a_planted_loss_gap_is_recovered_and_its_interval_is_paired():
    level = {("1/sqrt(N)", 8): 2.65, ("1/N", 8): 2.6}
    c = rules(-0.5, -0.5, level=level, seeds=range(12))
    g = best_loss_gap(c, "arm", ("1/sqrt(N)", 8), ("1/N", 8), n_boot=500)
    assert g["gap"] == pytest.approx(0.05, abs=0.005)
    # the seed offsets span 1 nat: only the paired resample gives an interval this narrow
    assert g["ci_low"] > 0.04 and g["ci_high"] < 0.06
    assert g["lr_a"] == pytest.approx(2.0**-7, rel=1e-9)  # the sample's best grid rate
    assert lr_rule_gap(c, n_boot=300)["verdict"] == "1/N better"
    flipped = rules(-0.5, -0.5, level={("1/sqrt(N)", 8): 2.6, ("1/N", 8): 2.65})
    assert lr_rule_gap(flipped, n_boot=300)["verdict"] == "1/sqrt(N) better"
    # a gap of 0.015 nats under 0.05 of noise: positive here, but its interval holds 0
    small = rules(-0.5, -0.5, noise=0.05, level={("1/sqrt(N)", 8): 2.615, ("1/N", 8): 2.6})
    g = lr_rule_gap(small, n_boot=300)
    assert g["gap"] > 0 and g["ci_low"] < 0 < g["ci_high"]
    assert g["verdict"] == "undecided"


def test_the_loop_cost_is_the_n8_minus_n1_loss_at_each_optimum():
    level = {("1/sqrt(N)", 1): 2.6, ("1/sqrt(N)", 8): 2.8, ("1/N", 1): 2.6, ("1/N", 8): 2.7}
    t = lr_loop_cost(rules(-1.0, 0.0, level=level), n_boot=200).set_index("arm")
    assert t.loc["1/sqrt(N)", "gap"] == pytest.approx(0.2, abs=0.005)
    assert t.loc["1/N", "gap"] == pytest.approx(0.1, abs=0.005)
    assert (t["ci_low"] > 0).all()


def test_divergence_counts_flagged_and_non_finite_cells_once_per_training():
    c = rules(0.0, 0.0)
    # 1/N's N = 1 cells repeat 1/sqrt(N)'s (same K, N, lr, seed): make them bit-identical
    n1 = (c["arm"] == "1/N") & (c["N"] == 1)
    c.loc[n1, "loss"] = c.loc[(c["arm"] == "1/sqrt(N)") & (c["N"] == 1), "loss"].to_numpy()
    assert lr_divergence(c) == {"rows": 4 * 8 * 12, "trainings": 3 * 8 * 12, "diverged": 0}
    c.loc[c.index[-1], "diverged"] = True
    c.loc[c.index[-2], "loss"] = math.inf
    assert lr_divergence(c)["diverged"] == 2


# ------------------------------------------------------------------ reachability factors


def reach(counts: dict) -> pd.DataFrame:
    """counts[(recall, outer_norm)] = (reached, runs)."""
    rows = []
    for (recall, outer), (k, n) in counts.items():
        rows += [{"task": "t", "recall": recall, "outer_norm": outer, "seed": s,
                  "converged": s < k} for s in range(n)]  # fmt: skip
    return pd.DataFrame(rows)


def test_planted_reached_counts_give_the_exact_fisher_p():
    t = reach_outer_norm_effect(reach({("none", True): (4, 4), ("none", False): (0, 4),
                                       ("add", True): (4, 4)})).set_index("comparison")  # fmt: skip
    on = t.loc["outer norm on vs off"]
    assert (on["with"], on["without"]) == ("8/8", "0/4")
    # 8/8 vs 0/4: this table has probability 1/C(12, 4) = 1/495; every other one is likelier
    assert on["p"] == pytest.approx(1 / 495, rel=1e-9) and on["verdict"] == "differs"
    t = reach_outer_norm_effect(
        reach(
            {
                ("add", True): (4, 4),
                ("add", False): (0, 4),
                ("none", True): (2, 4),
                ("none", False): (0, 4),
            }
        )
    )
    rec = t.set_index("comparison").loc["with outer norm: recall (add, internal) vs none"]
    # 4/4 vs 2/4: 0, 1 or 2 misses among recall's 4 with probabilities 6, 16, 6 in 28; two-sided
    # p sums the tables no likelier than this one: 12/28 (one-sided would give 6/28)
    assert rec["p"] == pytest.approx(12 / 28, rel=1e-9)
    t = reach_outer_norm_effect(
        reach(
            {
                ("add", True): (2, 4),
                ("add", False): (2, 4),
                ("none", True): (2, 4),
                ("none", False): (2, 4),
            }
        )
    )
    assert list(t["p"]) == [1.0, 1.0] and set(t["verdict"]) == {"no difference detected"}


def test_too_few_runs_give_no_reachability_factor_verdict():
    t = reach_outer_norm_effect(reach({("add", True): (2, 2), ("add", False): (0, 2)}))
    assert t["verdict"].iloc[0] == "undecided (2 runs, 4 needed)"
    assert math.isnan(t["p"].iloc[0])


# ------------------------------------------------------------------ the committed studies


def test_the_committed_run2_contrast_depends_on_the_vertex_estimator():
    spec = LR_RUNS[2]
    t, statement = lr_contrast_sensitivity(pd.read_csv(LR_DIR / spec["cells"]),
                                           half_width=spec["half_width"])  # fmt: skip
    t = t.set_index("estimator")
    want = {"argmin window (pre-stated)": (-0.006, -0.494, 0.264, "do not differ as predicted"),
            "quartic": (-0.229, -0.899, 0.110, "undecided"),
            "fixed window": (-0.405, -1.310, 0.282,
                             "undecided (no vertex in 12% of resamples)")}  # fmt: skip
    for name, (c, lo, hi, verdict) in want.items():
        r = t.loc[name]
        assert (r["contrast"], r["ci_low"], r["ci_high"]) == pytest.approx((c, lo, hi), abs=1e-3)
        assert r["verdict"] == verdict
    assert t.loc["fixed window", "window"] == "log2 lr -6.50 ± 4 points"
    assert t.loc["fixed window", "boot_valid"] == pytest.approx(0.878, abs=1e-3)
    assert statement == (
        "under every vertex estimator: nothing; estimator-dependent: the predicted contrast "
        "-1.5 is excluded (argmin window (pre-stated) and quartic only); the rules do not "
        "differ as predicted (argmin window (pre-stated) only)"
    )


def test_the_committed_runs_decide_the_loss_claims():
    run2 = pd.read_csv(LR_DIR / LR_RUNS[2]["cells"])
    g = lr_rule_gap(run2)
    assert (g["gap"], g["ci_low"], g["ci_high"]) == pytest.approx((0.039, 0.014, 0.064),
                                                                  abs=1e-3)  # fmt: skip
    assert g["verdict"] == "1/N better" and g["seeds"] == 12
    cost = lr_loop_cost(run2).set_index("arm")
    assert cost["gap"].to_dict() == pytest.approx(
        {"1/N": 0.160, "1/sqrt(N)": 0.199, "loop-mup": 0.165}, abs=1e-3
    )
    assert cost["ci_low"].to_dict() == pytest.approx(
        {"1/N": 0.126, "1/sqrt(N)": 0.165, "loop-mup": 0.133}, abs=1e-3
    )
    assert lr_divergence(run2) == {"rows": 864, "trainings": 720, "diverged": 0}
    run1 = pd.read_csv(LR_DIR / LR_RUNS[1]["cells"])
    assert lr_divergence(run1) == {"rows": 336, "trainings": 280, "diverged": 0}
    assert lr_rule_gap(run1)["verdict"] == "undecided"  # 0.056 [-0.023, 0.110], 8 seeds


def test_the_committed_reachability_runs_separate_outer_norm_from_recall():
    t = reach_outer_norm_effect(pd.read_csv(REACH_DIR / "reachability_study.csv"))
    t = t.set_index("comparison")
    on = t.loc["outer norm on vs off"]
    assert (on["with"], on["without"], on["verdict"]) == ("17/24", "0/24", "differs")
    assert on["p"] == pytest.approx(1.631e-7, rel=1e-3)
    rec = t.loc["with outer norm: recall (add, internal) vs none"]
    assert (rec["with"], rec["without"]) == ("10/16", "7/8")
    assert rec["p"] == pytest.approx(0.352, abs=1e-3)
    assert rec["verdict"] == "no difference detected"


def test_the_verdicts_state_the_decided_claims_and_the_sensitivity():
    from loopprobe import report
    from studies.verdicts import collect

    _, pairs, notes = collect(STUDIES)
    v = {x.claim.split(" [tested: ")[0]: x.to_dict() for _, x in pairs}  # issue 39.7's scope
    V = report.verdicts
    assert v["run 2, N = 8: 1/N gives a lower loss than 1/√N"]["verdict"] == V.HOLDS
    assert v["outer norm is what makes fixed points reachable"]["verdict"] == V.HOLDS
    assert v["with outer norm on, recall does not change reachability"]["verdict"] == V.UNKNOWN
    bound = [c for c in v if "the stability bound's prediction" in c]
    assert len(bound) == 1 and v[bound[0]]["verdict"] == V.UNKNOWN
    pre = v["run 2: 1/√N moves the optimum more than 1/N does"]
    assert pre["verdict"] == V.FAILS and "quartic vertex: -0.23 [-0.90, +0.11]" in pre["why"]
    tested = [n for n in notes if "what was tested" in n]
    assert len(tested) == 1
    assert "0 of 1000 trainings (2 runs, 1200 cells) diverged" in tested[0]
    assert "1/N +0.16 [+0.13, +0.19]" in tested[0]
    assert "The paper’s claim is untested at this scale" in tested[0]
