"""Issue 30.2: the LR-edge study's analysis on planted cells with a known edge per N.

A planted group (scaling, N, seed) has a true edge t (log2 lr): every grid lr below t is
stable (a parabola in log2 lr, well below the floor) except the smallest ones, which never
left the floor (too slow to learn), and every lr above t is on the floor or NaN.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from studies.lr_edge import analysis as le
from studies.lr_edge import run as lr_edge_run

FLOOR = 3.11
GRID = [k / 2 for k in range(-20, -1)]  # log2 lr, half octaves 2^-10 .. 2^-1.5
NS = (1, 2, 4, 8, 16)


def cells(slope: dict, seeds=range(6), noise=0.2, a=-3.3, nan_above=False, rng_seed=0, jitter=None):
    """Cells whose true log2 edge is ``a + (slope[scaling] + jitter[seed]) * log2 N + noise *
    normal``; the N = 1 cells are shared (scaling ``both``, their edge is ``a`` + noise)."""
    rng = np.random.default_rng(rng_seed)
    rows = []
    for s in seeds:
        for N in NS:
            for sc in ("both",) if N == 1 else le.SCALINGS:
                b = 0.0 if N == 1 else slope[sc] + (jitter or {}).get(s, 0.0)
                t = a + b * math.log2(N) + noise * rng.normal()
                best = t - 2.0
                for x in GRID:
                    if x > t:
                        loss = math.nan if nan_above else FLOOR + 0.02
                    elif x < best - 3.0:
                        loss = FLOOR + 0.05  # too small to leave the floor in the budget
                    else:
                        loss = 2.6 + 0.02 * (x - best) ** 2
                    rows.append({"scaling": sc, "N": N, "lr": 2.0**x, "seed": s,
                                 "loss": loss, "cpu_s": 1.0})  # fmt: skip
    return pd.DataFrame(rows)


def run(c: pd.DataFrame):
    e = le.edges(c, FLOOR)
    s = le.slopes(e)
    return e, s.set_index("scaling"), le.verdict(e, s)


def test_planted_minus_half_and_zero_slopes_hold_and_are_recovered():
    e, s, (v, why) = run(cells({"1/sqrt(N)": -0.5, "1/N": 0.0}))
    assert v == "holds", why
    assert s.loc["1/sqrt(N)", "slope"] == pytest.approx(-0.5, abs=0.08)
    assert s.loc["1/N", "slope"] == pytest.approx(0.0, abs=0.08)
    assert s.loc["1/sqrt(N)", "ci_high"] < -0.2 and s.loc["1/N", "ci_low"] > -0.3
    assert (s["n_seeds"] == 6).all() and (s["censored"] == 0).all()


def test_planted_flat_edges_under_both_scalings_fail():
    _, s, (v, why) = run(cells({"1/sqrt(N)": 0.0, "1/N": 0.0}))
    assert v == "fails" and "excludes its predicted" in why
    assert s.loc["1/sqrt(N)", "ci_low"] > -0.5


def test_planted_minus_half_under_both_scalings_fails_on_the_1_over_n_interval():
    _, s, (v, _) = run(cells({"1/sqrt(N)": -0.5, "1/N": -0.5}))
    assert v == "fails" and s.loc["1/N", "ci_high"] < 0


def test_one_seed_is_undecided_whatever_its_slopes():
    _, _, (v, why) = run(cells({"1/sqrt(N)": -0.5, "1/N": 0.0}, seeds=[3]))
    assert v == "undecided" and "minimum" in why
    _, _, (v, _) = run(cells({"1/sqrt(N)": -0.5, "1/N": 0.0}, seeds=range(le.MIN_SEEDS - 1)))
    assert v == "undecided"


def test_noisy_edges_with_few_seeds_are_undecided_and_report_the_half_width():
    jitter = {0: 0.5, 1: -0.5, 2: 0.5, 3: -0.5}  # per-seed slopes -0.25 +- 0.5: sd 0.58
    c = cells({"1/sqrt(N)": -0.25, "1/N": -0.25}, seeds=range(4), noise=0.0, jitter=jitter)
    _, s, (v, why) = run(c)
    assert s.loc["1/N", "slope"] == pytest.approx(-0.25, abs=0.05)
    assert v == "undecided" and "contains both" in why
    assert f"{s.loc['1/N', 'half_width']:.3f}" in why and s.loc["1/N", "half_width"] > 0.5


def test_the_edge_is_bracketed_by_the_largest_stable_and_the_smallest_failing_lr_above_best():
    c = cells({"1/sqrt(N)": -0.5, "1/N": 0.0}, seeds=[0], noise=0.0, a=-4.1)
    e = le.edges(c, FLOOR).set_index(["scaling", "N"])
    row = e.loc[("1/N", 4)]  # true edge -4.1: stable up to -4.5, failing from -4.0
    assert (row["lo"], row["hi"], row["log2_edge"]) == (-4.5, -4.0, -4.25)
    assert row["best_log2_lr"] == -6.0  # the parabola's vertex t - 2 is off-grid: -6.1 -> -6.0
    row = e.loc[("1/sqrt(N)", 16)]  # true edge -6.1: bracket [-6.5, -6.0]
    assert (row["lo"], row["hi"]) == (-6.5, -6.0)
    # the failing small lrs below the best never count as the edge
    assert (e["lo"] > -9.0).all()


def test_nan_losses_fail_a_run_that_never_fails_is_censored_and_n1_counts_for_both():
    c = cells({"1/sqrt(N)": -0.5, "1/N": 0.0}, nan_above=True, seeds=[0], noise=0.0)
    e = le.edges(c, FLOOR)
    assert not e["censored"].any()
    one = e[e["N"] == 1].set_index("scaling")
    assert set(one.index) == set(le.SCALINGS)
    assert one.loc["1/N", "log2_edge"] == one.loc["1/sqrt(N)", "log2_edge"]
    stable = c.assign(loss=np.where(np.isnan(c["loss"]), 2.9, c["loss"]))  # nothing fails
    e2 = le.edges(stable, FLOOR)
    assert e2["censored"].all() and e2["log2_edge"].isna().all()
    _, _, (v, why) = run(stable)
    assert v == "undecided" and "minimum" in why


def test_a_stable_lr_above_the_first_failure_is_flagged_and_does_not_move_the_edge():
    c = cells({"1/sqrt(N)": -0.5, "1/N": 0.0}, seeds=[0], noise=0.0, a=-4.1)
    lucky = (c["scaling"] == "1/N") & (c["N"] == 4) & np.isclose(np.log2(c["lr"]), -3.0)
    c.loc[lucky, "loss"] = 2.9
    row = le.edges(c, FLOOR).set_index(["scaling", "N"]).loc[("1/N", 4)]
    assert (row["lo"], row["hi"], bool(row["non_monotone"])) == (-4.5, -4.0, True)


def test_the_slope_is_the_mean_of_per_seed_least_squares_slopes_with_a_t_interval():
    c = cells({"1/sqrt(N)": -0.5, "1/N": 0.0}, noise=0.4, rng_seed=5)
    e = le.edges(c, FLOOR)
    per = []
    for _, g in e[e["scaling"] == "1/sqrt(N)"].groupby("seed"):
        per.append(np.polyfit(np.log2(g["N"].to_numpy(float)), g["log2_edge"].to_numpy(), 1)[0])
    s = le.slopes(e).set_index("scaling")
    ci = stats.ttest_1samp(per, 0.0).confidence_interval(0.95)
    assert s.loc["1/sqrt(N)", "slope"] == pytest.approx(np.mean(per), rel=1e-12)
    assert (s.loc["1/sqrt(N)", "ci_low"], s.loc["1/sqrt(N)", "ci_high"]) == pytest.approx(
        (ci.low, ci.high), rel=1e-9
    )


def test_identical_seeds_keep_the_grids_resolution_in_the_interval():
    c = cells({"1/sqrt(N)": -0.5, "1/N": 0.0}, noise=0.0, a=-3.3)
    s = le.slopes(le.edges(c, FLOOR)).set_index("scaling")
    # every seed the same: a t interval from the seeds alone would have zero width
    assert s.loc["1/sqrt(N)", "sd"] == pytest.approx(0.5 / math.sqrt(12 * 10))
    assert s.loc["1/sqrt(N)", "half_width"] > 0.03
    assert s.loc["1/sqrt(N)", "ci_low"] <= -0.5 <= s.loc["1/sqrt(N)", "ci_high"]
    assert s.loc["1/N", "ci_low"] <= 0.0 <= s.loc["1/N", "ci_high"]
    assert s.loc["1/N", "boot_low"] <= 0.0 <= s.loc["1/N", "boot_high"]


def test_missing_columns_raise_a_clear_error():
    with pytest.raises(ValueError, match="lack columns"):
        le.edges(pd.DataFrame({"N": [1], "lr": [0.1]}), FLOOR)


def test_a_study_cell_trains_and_the_summary_and_figure_come_from_the_cells(tmp_path):
    mod = lr_edge_run
    cfg = {**mod.BASE, "d": 16, "seq": 8, "batch": 2, "eval_batches": 2, "steps": 3,
           "seed": 0, "lr": 1e-3}  # fmt: skip
    out = {sc: mod.edge_cell({**cfg, "scaling": sc, "N": 2}) for sc in le.SCALINGS}
    for r in out.values():
        assert math.isfinite(r["loss"]) and r["steps_done"] == 3 and r["cpu_s"] >= 0
    assert out["1/N"]["loss"] != out["1/sqrt(N)"]["loss"]  # eps differs at N = 2
    c = cells({"1/sqrt(N)": -0.5, "1/N": 0.0})
    text = le.summary_markdown(c, FLOOR)
    assert "**verdict: holds**" in text and "CPU-minutes" in text
    le.figure(c, str(tmp_path / "f.png"), FLOOR)
    assert (tmp_path / "f.png").stat().st_size > 10_000


def test_the_refinement_adds_one_cell_at_the_midpoint_of_each_octave_bracket():
    mod = lr_edge_run
    octave = [k for k in GRID if k == int(k)]
    full = cells({"1/sqrt(N)": -0.5, "1/N": 0.0}, seeds=[0], noise=0.0, a=-3.3)
    c = full[np.isin(np.log2(full["lr"]), octave)]
    base = [{"scaling": sc, "N": N, "seed": 0} for N in NS for sc in ("both", *le.SCALINGS)]
    fine = mod.refine_cells(c, base)
    got = {(f["scaling"], f["N"]): math.log2(f["lr"]) for f in fine}
    assert len(fine) == 9 and ("both", 1) in got and ("1/N", 1) not in got  # N = 1 run once
    e = le.edges(c).set_index(["scaling", "N"])
    for (sc, N), x in got.items():
        row = e.loc[("1/N" if sc == "both" else sc, N)]
        assert row["hi"] - row["lo"] == 1.0 and x == pytest.approx(row["lo"] + 0.5, abs=1e-5)
    assert got[("1/sqrt(N)", 16)] == pytest.approx(-5.5, abs=1e-5)  # true edge -5.3: [-6, -5]
    # the refined cells (the planted losses at those lrs) halve every bracket around the edge
    keys = {(f["scaling"], f["N"], round(f["lr"], 6)) for f in fine}
    extra = full[[(r.scaling, r.N, round(r.lr, 6)) in keys for r in full.itertuples()]]
    e2 = le.edges(pd.concat([c, extra]), FLOOR).set_index(["scaling", "N"])
    assert ((e2["hi"] - e2["lo"]) == 0.5).all()
    assert (e2.loc[("1/sqrt(N)", 16), "lo"], e2.loc[("1/sqrt(N)", 16), "hi"]) == (-5.5, -5.0)


def test_the_study_command_runs_as_its_page_says(tmp_path, monkeypatch):
    # the resumable command of docs/studies/lr_edge.md (here its --quick smoke size); its
    # parser once lacked --task-pilot, so every run but --analyze died on an AttributeError
    mod = lr_edge_run
    out = tmp_path / "cells.csv"
    argv = ["lr_edge_study.py", "--quick", "--cache", str(tmp_path / "c"), "--out", str(out)]
    monkeypatch.setattr("sys.argv", [*argv, "--figure", str(tmp_path / "f.png")])
    mod.main()
    cells_run = pd.read_csv(out)
    assert len(cells_run) > 0 and np.isfinite(cells_run["loss"]).all()
