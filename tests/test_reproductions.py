"""Issue 17's analysis: the criteria on planted data with a known answer, the cached studies'
verdicts as the README states them, and the report section that reads them (no training)."""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np
import pandas as pd
import pytest

from loopprobe import report
from loopprobe.cli import main
from studies.lr_transfer.analysis import LR_RUNS, lr_claim, lr_contrast, lr_drift
from studies.reachability.analysis import reach_claims, reach_summary

STUDIES = pathlib.Path(__file__).resolve().parents[1] / "studies"
LR_DIR, REACH_DIR = STUDIES / "lr_transfer", STUDIES / "reachability"
GRID = [2.0 ** (k / 2) for k in range(-19, -7)]  # run 2's half-octave grid


def planted_cells(opt: dict, seeds=range(8), noise=0.005, a=0.04, rng_seed=0) -> pd.DataFrame:
    """LR cells arm, N, lr, seed, loss = a (log2 lr - opt)^2 + per-seed level + noise."""
    rng = np.random.default_rng(rng_seed)
    rows = []
    for (arm, N), o in opt.items():
        for s in seeds:
            for lr in GRID:
                loss = a * (math.log2(lr) - o) ** 2 + 3 + 0.1 * s + noise * rng.normal()
                rows.append({"arm": arm, "N": N, "lr": lr, "seed": s, "loss": loss,
                             "diverged": False})  # fmt: skip
    return pd.DataFrame(rows)


def as_predicted(drift_sqrt: float, drift_n: float, drift_mup: float) -> pd.DataFrame:
    return planted_cells({("1/sqrt(N)", 1): -6.5, ("1/sqrt(N)", 8): -6.5 + drift_sqrt,
                          ("1/N", 1): -6.5, ("1/N", 8): -6.5 + drift_n,
                          ("loop-mup", 1): -6.0, ("loop-mup", 8): -6.0 + drift_mup})  # fmt: skip


def test_the_predicted_pattern_is_called_holds_and_the_rules_differ():
    cells = as_predicted(-1.5, 0.0, 0.0)
    t = lr_drift(cells, half_width=4, n_boot=300).set_index("arm")
    assert t.loc["1/sqrt(N)", "drift"] == pytest.approx(-1.5, abs=0.1)
    assert list(t.loc[["1/sqrt(N)", "1/N", "loop-mup"], "verdict"]) == ["drifts", "stays", "stays"]
    assert lr_claim(t.reset_index()) == "HOLDS"
    c = lr_contrast(cells, half_width=4, n_boot=300)
    assert c["contrast"] == pytest.approx(-1.5, abs=0.1)
    assert c["verdict"] == "differ as predicted"


def test_every_rule_drifting_alike_fails_the_claim_and_the_contrast():
    cells = as_predicted(-1.0, -1.0, -1.0)
    t = lr_drift(cells, half_width=4, n_boot=300)
    assert set(t["verdict"]) == {"drifts"}
    assert lr_claim(t) == "FAILS"
    c = lr_contrast(cells, half_width=4, n_boot=300)
    assert abs(c["contrast"]) < 0.1 and c["verdict"] == "do not differ as predicted"


def test_a_drift_at_the_margin_is_undecided_not_a_verdict():
    # planted drift -0.75 (the margin itself): any interval around it straddles the margin
    cells = planted_cells({("1/sqrt(N)", 1): -6.5, ("1/sqrt(N)", 8): -7.25, ("1/N", 1): -6.5,
                           ("1/N", 8): -6.5}, seeds=range(4), noise=0.02)  # fmt: skip
    t = lr_drift(cells, half_width=4, n_boot=300).set_index("arm")
    assert t.loc["1/sqrt(N)", "verdict"] == "undecided" and t.loc["1/N", "verdict"] == "stays"
    assert lr_claim(t.reset_index()) == "UNDECIDED"
    c = lr_contrast(cells, half_width=4, n_boot=300)
    assert c["ci_low"] < -0.75 < c["ci_high"] and c["verdict"] == "undecided"


def test_a_diverged_cell_is_missing_not_a_high_loss():
    cells = as_predicted(-1.5, 0.0, 0.0)
    # at the optimum of 1/N, N = 8 of one seed: a huge loss would pull the vertex away
    hit = (cells["arm"] == "1/N") & (cells["N"] == 8) & (cells["seed"] == 0)
    row = hit & (np.log2(cells["lr"]) == -6.5)
    cells.loc[row, ["loss", "diverged"]] = [50.0, True]
    t = lr_drift(cells, half_width=4, n_boot=200).set_index("arm")
    assert t.loc["1/N", "drift"] == pytest.approx(0.0, abs=0.1)


def reach_runs(dep_none=0.0, dep_recall=2.0, reached_internal=4) -> pd.DataFrame:
    rows = []
    for recall in ("none", "add", "internal"):
        for outer in (False, True):
            for seed in range(4):
                reached = outer and (recall != "internal" or seed < reached_internal)
                dep = dep_none if recall == "none" else dep_recall
                rows.append({"task": "t", "recall": recall, "outer_norm": outer, "seed": seed,
                             "converged": reached, "spectral_radius": 0.5 if reached else 1.01,
                             "input_dependence": dep if reached else math.nan, "acc_R4": 0.7,
                             "acc_R8": 0.7, "acc_R16": 0.7, "steps": 100, "train_loss": 0.3,
                             "stop": "plateau"})  # fmt: skip
    return pd.DataFrame(rows)


def claims(runs) -> dict:
    return dict(zip(*reach_claims(runs)[["claim", "verdict"]].T.values, strict=True))


def test_reachability_claims_on_planted_runs():
    a, b = (
        "A: recall + outer norm reliably reach a fixed point",
        "B: without recall the fixed point does not depend on the input",
    )
    assert claims(reach_runs()) == {a: "holds", b: "not tested (zero by construction)"}
    assert claims(reach_runs(reached_internal=2))[a] == "fails"  # 2/4 <= 50 %
    assert claims(reach_runs(reached_internal=3))[a] == "undecided"  # 75 %: between
    assert claims(reach_runs(dep_none=1e-3))[b] == "fails"  # input dependence without recall
    assert claims(reach_runs(dep_recall=1e-6))[b] == "fails"  # none with recall


def test_reach_summary_counts_reached_runs_and_takes_dependence_only_where_reached():
    s = reach_summary(reach_runs(reached_internal=3)).set_index(["recall", "outer_norm"])
    assert s.loc[("internal", True), "reached"] == 3
    assert s.loc[("internal", False), "reached"] == 0
    assert math.isnan(s.loc[("add", False), "dep_median"])
    assert s.loc[("add", True), "dep_min"] == 2.0


# ------------------------------------------------------------------ the cached studies


def test_the_cached_lr_runs_give_the_committed_drift_tables():
    for run, spec in LR_RUNS.items():
        path = LR_DIR / spec["cells"]
        if not path.exists():
            continue
        t = lr_drift(pd.read_csv(path), half_width=spec["half_width"])
        suffix = "" if run == 1 else str(run)
        saved = pd.read_csv(LR_DIR / f"lr_transfer_drift{suffix}.csv").set_index("arm")
        for r in t.to_dict("records"):
            assert r["drift"] == pytest.approx(saved.loc[r["arm"], "drift"], abs=1e-3)
            assert r["ci_low"] == pytest.approx(saved.loc[r["arm"], "ci_low"], abs=1e-3)
            assert r["verdict"] == saved.loc[r["arm"], "verdict"]


def test_the_cached_reachability_runs_give_the_readme_verdicts():
    runs = pd.read_csv(REACH_DIR / "reachability_study.csv")
    got = reach_claims(runs)
    # A: 6/8 and 4/8 at the cap fail (<= 50 %), but the misses' own contraction rates reach
    # tol within 2x the iterations in 75 % of runs: the verdict flips with the cap
    assert got["verdict"].iloc[0].startswith("undecided (flips with the iteration cap: fails")
    assert "add 6/8, internal 4/8" in got["measured"].iloc[0]
    assert "add 75%, internal 75%" in got["measured"].iloc[0]
    # B: ||dh*/dx|| = 0 without recall is an identity (T never reads x), not evidence
    assert got["verdict"].iloc[1] == "not tested (zero by construction)"


def test_the_report_section_reads_the_verdict_table_and_states_the_verdicts(tmp_path):
    out = tmp_path / "r"
    code = main(["report", "--sections", "reproductions", "--out", str(out), "--no-progress",
                 "--studies", str(STUDIES)])  # fmt: skip
    assert code == 0
    sec = json.loads((out / "results.json").read_text())["sections"]["reproductions"]
    assert sec["status"] == "ok"
    claims_seen = {v["claim"].split(" [tested: ")[0]: v["verdict"]
                   for v in sec["values"]["verdicts"]}  # fmt: skip  (issue 39.7's scope)
    assert claims_seen["B: without recall the fixed point does not depend on the input"] == (
        report.verdicts.UNKNOWN
    )
    assert any(c.startswith("run 1, 1/sqrt(N)") for c in claims_seen)
    # run 2 (README): the pre-stated contrast between 1/sqrt(N) and 1/N does not hold
    assert claims_seen["run 2: 1/√N moves the optimum more than 1/N does"] == report.verdicts.FAILS


def test_the_report_section_is_skipped_without_a_verdict_table_and_for_a_user_model(
    tmp_path, monkeypatch
):
    cfg = report.ReportConfig.quick()
    from dataclasses import replace

    from loopprobe.report.config import Context, Skip
    from loopprobe.report.sections_repro import reproductions_section

    monkeypatch.chdir(tmp_path)  # no ./studies here
    with pytest.raises(Skip, match="no study verdicts .*`python -m studies`"):
        reproductions_section(Context(cfg=cfg))
    with pytest.raises(ValueError, match="--studies .*: no verdicts.csv there"):
        reproductions_section(Context(cfg=replace(cfg, studies=str(tmp_path))))
    user = report.UserModel("m:f", None, None, None, "loss")
    with pytest.raises(Skip, match="not a --model diagnostic"):
        reproductions_section(Context(cfg=cfg, user=user))


def test_one_seed_gives_no_lr_verdict_however_narrow_its_interval():
    # one seed: the bootstrap resamples that one seed, so the interval has zero width and
    # classify() would call it decisively
    cells = as_predicted(-1.5, 0.0, 0.0)
    t = lr_drift(cells[cells["seed"] == 0], half_width=4, n_boot=100)
    assert (t["ci_high"] - t["ci_low"]).max() == pytest.approx(0.0, abs=1e-12)
    assert list(t["verdict"]) == ["undecided (1 seeds, 4 needed)"] * 3
    assert lr_claim(t) == "UNDECIDED"
    t.loc[:, "verdict"] = ["drifts", "stays", "stays"]  # even if the verdicts were decisive
    assert lr_claim(t) == "UNDECIDED"


def test_one_run_per_arm_gives_no_reachability_verdict():
    runs = reach_runs()
    one = runs[runs["seed"] == 0]
    got = dict(zip(*reach_claims(one)[["claim", "verdict"]].T.values, strict=True))
    a, b = sorted(got)
    assert got[a] == "undecided (add: 1 runs, internal: 1 runs; 4 needed)"
    assert got[b] == "undecided (1 reached without recall, 2 with; 4 each needed)"


def test_a_claim_a_verdict_that_flips_with_the_iteration_cap_is_undecided():
    runs = reach_runs(reached_internal=2)  # 2/4 internal at the cap: fails
    misses = runs["outer_norm"] & ~runs["converged"].astype(bool)
    runs = runs.assign(tol=1e-6, max_iter=300, residual=1e-5, rate=0.99)
    # 1e-5 * 0.99^k <= 1e-6 needs k = 230 more: within 2x the cap
    got = claims(runs)["A: recall + outer norm reliably reach a fixed point"]
    assert got.startswith("undecided (flips with the iteration cap: fails at the cap, holds")
    runs.loc[misses, "rate"] = 0.999  # needs 2301 more: beyond 2x, the verdict stands
    assert claims(runs)["A: recall + outer norm reliably reach a fixed point"] == "fails"
