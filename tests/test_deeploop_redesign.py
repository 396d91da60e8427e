"""Issue 39.1: the DeepLoop redesign's driver and analysis on planted cells.

Each arm at its own tuned lr (bracketed or not, the pilot's lr agreeing or not), the p-sweep's
instability outcome (a loss rise) and its boundary across R, and the driver's resume from the
committed CSV (a finished cell is never trained twice).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from studies.deeploop import redesign as rd
from studies.deeploop import redesign_analysis as ra

FLOOR = 3.11


def lr_cells(best: dict, gain: dict, seeds=range(6), rates=(1e-3, 3e-3, 1e-2)) -> pd.DataFrame:
    """Final rows: arm at R has loss 2.3 + gain[(arm, R)] + 0.05 * octaves-from-best^2 + noise;
    ``best[(arm, R)]`` is its best rate."""
    rng = np.random.default_rng(0)
    rows = []
    for s in seeds:
        noise = 0.003 * rng.normal()
        for (arm, R), b in best.items():
            for lr in rates:
                loss = 2.3 + gain.get((arm, R), 0.0) + 0.05 * math.log2(lr / b) ** 2 + noise
                rows.append({"arm": arm, "p": np.nan, "R": R, "lr": lr, "seed": s,
                             "step": 1000, "final": True, "val_loss": loss})  # fmt: skip
    return pd.DataFrame(rows)


BEST = {(a, R): 3e-3 for a in rd.ARMS for R in (1, 3)}


def test_each_arm_at_its_tuned_lr_recovers_a_planted_gain_and_neutrality():
    gain = {("deeploop", 3): -0.05, ("deeploop", 1): 0.0}
    cells = lr_cells(BEST, gain)
    t = ra.tuned(cells, FLOOR)
    assert (t["lr"] == 3e-3).all() and t["bracketed"].all()
    res = ra.lr_study(cells, cells, FLOOR).set_index(["baseline", "R"])
    assert res.loc[("post", 3), "verdict"] == "holds"
    assert res.loc[("post", 3), "diff"] == pytest.approx(-0.05, abs=1e-9)
    assert res.loc[("post", 1), "verdict"] == "holds"  # neutral within ±0.016


def test_an_arm_tuned_at_the_edge_of_its_rates_leaves_its_comparisons_undecided():
    best = {**BEST, ("post", 3): 1e-3 / 4}  # post's optimum below its smallest rate
    cells = lr_cells(best, {("deeploop", 3): -0.05})
    res = ra.lr_study(cells, cells, FLOOR).set_index(["baseline", "R"])
    assert res.loc[("post", 3), "verdict"] == "undecided"
    assert "not bracketed for ['post']" in res.loc[("post", 3), "reason"]
    assert res.loc[("deepnorm", 3), "verdict"] == "holds"


def test_a_verdict_that_flips_with_the_pilot_optimum_is_undecided():
    cells = lr_cells(BEST, {("deeploop", 3): -0.05})
    pilot = lr_cells({**BEST, ("deeploop", 3): 1e-2 * 4}, {})  # pilot says deeploop at 1e-2
    pilot = pilot[pilot["seed"] < 2]
    res = ra.lr_study(cells, pilot, FLOOR).set_index(["baseline", "R"])
    # at 1e-2 (2 octaves from its best) deeploop loses 0.2 > its 0.05 gain: verdict flips
    assert res.loc[("post", 3), "verdict_pilot_lr"] == "fails"
    assert res.loc[("post", 3), "verdict"] == "undecided"
    assert "depends on the lr choice" in res.loc[("post", 3), "reason"]


def test_loss_rise_sees_a_spike_after_warmup_and_not_a_falling_loss():
    falling = list(np.linspace(5.0, 2.0, 200))
    assert rd.loss_rise(falling, start=10) == 0.0
    spike = falling[:100] + [5.0] * 30 + falling[100:]  # 1.5 nats above the min
    assert rd.loss_rise(spike, start=10) > ra.RISE
    assert rd.loss_rise(spike[:5], start=0) != rd.loss_rise(spike[:5], start=0)  # NaN: short


def psweep(unstable_below: dict, seeds=3, Rs=ra.PSWEEP_RS) -> pd.DataFrame:
    """Final rows: at R, every seed unstable (rise 1.0) at p < unstable_below[R], else 0.1."""
    rows = []
    for R in Rs:
        for p in ra.P_GRID:
            for s in range(seeds):
                bad = p < unstable_below[R]
                rows.append({"arm": "postp", "p": p, "R": R, "seed": s, "step": 1000,
                             "final": True, "val_loss": 3.2 if bad else 2.3, "diverged": False,
                             "rise": 1.0 if bad else 0.1})  # fmt: skip
    return pd.DataFrame(rows)


def test_psweep_boundary_near_half_holds_and_everything_stable_fails():
    per_r, v, why = ra.psweep_verdicts(ra.psweep_table(psweep(dict.fromkeys(ra.PSWEEP_RS, 0.4))))
    assert v == "holds" and (per_r["p_star"] == 0.45).all(), why
    per_r, v, why = ra.psweep_verdicts(ra.psweep_table(psweep(dict.fromkeys(ra.PSWEEP_RS, 0.0))))
    assert v == "fails" and (per_r["p_star"] == 0.0).all(), why
    part = psweep(dict.fromkeys(ra.PSWEEP_RS, 0.4), Rs=(2, 4))
    per_r, v, why = ra.psweep_verdicts(ra.psweep_table(part))
    assert v == "undecided" and why == "running: 30 of 60 cells"


def test_the_driver_appends_each_cell_and_resumes_without_retraining(tmp_path):
    out = str(tmp_path / "cells.csv")
    calls = []

    def fake(cell):
        calls.append(cell["lr"])
        return [{"step": 1, "val_loss": 2.0, "final": True, "cpu_s": 0.0}]

    cells = rd.lr_cells({**rd.PILOT, "Rs": (1,), "seeds": (0,)}, lambda arm, R: (1e-3, 1e-2))
    assert rd.run_cells(cells[:2], fake, out) == 2
    assert rd.run_cells(cells, fake, out) == len(cells) - 2  # the first two are in the CSV
    assert len(calls) == len(cells) and len(pd.read_csv(out)) == len(cells)
    assert rd.run_cells(cells, fake, out, stop_at=0.0) == 0


def test_redesign_verdicts_judge_only_complete_parts_and_say_how_far_the_rest_got(tmp_path):
    full = psweep(dict.fromkeys(ra.PSWEEP_RS, 0.4))
    full.to_csv(tmp_path / "deeploop_psweep.csv", index=False)
    rows, notes = ra.redesign_verdicts(tmp_path)
    assert [(c.split(":")[0], v) for c, v, _ in rows] == [("p-sweep across R = 2..16", "holds")]
    full[full["R"] < 8].to_csv(tmp_path / "deeploop_psweep.csv", index=False)
    lr = lr_cells(BEST, {})
    lr[lr["seed"] < 3].to_csv(tmp_path / "deeploop_lr_study.csv", index=False)
    rows, notes = ra.redesign_verdicts(tmp_path)
    assert rows == []
    assert "running: 30 of 60 cells" in notes[0]
    assert notes[1] == f"DeepLoop redesign lr study: running, {len(lr) // 2} of 108 cells"


def test_trend_table_pairs_deeploop_and_post_at_their_tuned_lr_per_budget():
    study = lr_cells(BEST, {("deeploop", 1): 0.1})
    trend = []
    for steps, gain in ((4000, 0.05), (8000, 0.0)):
        t = lr_cells({k: v for k, v in BEST.items() if k[1] == 1 and k[0] != "deepnorm"},
                     {("deeploop", 1): gain}, seeds=range(3), rates=(3e-3,))  # fmt: skip
        trend.append(t.assign(steps=steps))
    out = ra.trend_table(pd.concat(trend, ignore_index=True), study).set_index("steps")
    assert list(out.index) == [1000, 4000, 8000] and (out["seeds"] == 3).all()
    assert out["diff"].to_numpy() == pytest.approx([0.1, 0.05, 0.0], abs=1e-9)


# ------------------------------------------------------------------ second redesign

BEST7 = {(a, R): 3e-3 for a in rd.ARMS for R in (1, 3, 7)}


def test_backbone_check_uses_the_lr_study_tuned_rates_and_sets_the_learned_verdict_beside():
    study = lr_cells(BEST, {("deeploop", 3): -0.05})
    # on the backbone deeploop would win at R = 1 at 1e-2, but its tuned rate is 3e-3 there
    bb = lr_cells({**BEST, ("deeploop", 1): 1e-2 * 2}, {("deeploop", 3): 0.05},
                  rates=(3e-3, 1e-2))  # fmt: skip
    bb.loc[(bb["arm"] == "deeploop") & (bb["R"] == 1) & (bb["lr"] == 1e-2), "val_loss"] -= 0.5
    t = ra.backbone_check(bb, study, FLOOR).set_index(["baseline", "R"])
    assert t.loc[("post", 3), "verdict"] == "fails" and t.loc[("post", 3), "diff"] > 0
    assert t.loc[("post", 3), "learned_verdict"] == "holds"
    assert t.loc[("post", 3), "learned_diff"] == pytest.approx(-0.05, abs=1e-9)
    # deeploop at its study rate 3e-3, not its backbone best: 0.05 * log2(3e-3 / 2e-2)^2 worse
    assert t.loc[("post", 1), "diff"] == pytest.approx(0.05 * math.log2(3e-3 / 2e-2) ** 2, abs=1e-9)


def _second_redesign_tree(tmp_path, gains: dict):
    """An old pilot (3e-3, seeds 0-2, R 1/3/7), the R = 7 pilot grid (seeds 0-1), the lr study at
    R = 1 and 3 and at R = 7 (rates 1e-3, 3e-3, 1e-2 around the pilot optimum 3e-3)."""
    old = lr_cells(BEST7, {}, seeds=range(3), rates=(3e-3,))
    old.to_csv(tmp_path / "deeploop_pilot.csv", index=False)
    b7 = {k: v for k, v in BEST7.items() if k[1] == 7}
    lr_cells(b7, {}, seeds=range(2), rates=(3e-4, 1e-3, 1e-2)).to_csv(
        tmp_path / "deeploop_lr_pilot.csv", index=False)  # fmt: skip
    study = lr_cells(BEST7, gains)
    study.to_csv(tmp_path / "deeploop_lr_study.csv", index=False)
    return study


def test_second_redesign_judges_r7_and_the_whole_claim_only_when_its_cells_are_complete(tmp_path):
    gains = {("deeploop", 3): -0.05, ("deeploop", 7): -0.05, ("deepnorm", 3): -0.1}
    study = _second_redesign_tree(tmp_path, gains)
    rows, notes = ra.redesign_verdicts(tmp_path)
    got = {c.split(",")[0] + "," + c.split(",")[1]: v for c, v, _ in rows}
    assert got == {
        "vs post, each arm at its tuned lr: neutral at R = 1": "holds",
        "vs deepnorm, each arm at its tuned lr: neutral at R = 1": "fails",
        "R = 7, vs post": "holds",
        "R = 7, vs deepnorm": "holds",
        "whole claim, vs post": "holds",
        "whole claim, vs deepnorm": "fails",
    }
    assert notes == []
    whole = [m for c, _, m in rows if c.startswith("whole claim, vs deepnorm")][0]
    assert "R=3 improves fails" in whole and "R=7 improves holds" in whole
    part = study[(study["R"] < 7) | (study["seed"] < 5)]
    part.to_csv(tmp_path / "deeploop_lr_study.csv", index=False)
    rows, notes = ra.redesign_verdicts(tmp_path)
    assert len(rows) == 2 and notes == ["DeepLoop second redesign, R = 7 lr study: running, "
                                        "45 of 54 cells"]  # fmt: skip
    pilot = pd.read_csv(tmp_path / "deeploop_lr_pilot.csv")
    pilot[pilot["seed"] == 0].to_csv(tmp_path / "deeploop_lr_pilot.csv", index=False)
    rows, notes = ra.redesign_verdicts(tmp_path)
    assert len(rows) == 2 and "R = 7 lr pilot: running, 18 of 27" in notes[0]


def test_second_redesign_backbone_rows_wait_for_all_36_cells(tmp_path):
    study = _second_redesign_tree(tmp_path, {("deeploop", 3): -0.05})
    bb = lr_cells(BEST, {("deeploop", 3): 0.05}, rates=(3e-3,))
    bb[bb["seed"] < 5].to_csv(tmp_path / "deeploop_backbone.csv", index=False)
    rows, notes = ra.redesign_verdicts(tmp_path)
    assert not [c for c, _, _ in rows if c.startswith("seed's backbone")]
    assert "backbone: running, 30 of 36 cells" in notes[0]
    bb.to_csv(tmp_path / "deeploop_backbone.csv", index=False)
    rows, notes = ra.redesign_verdicts(tmp_path)
    bbrows = {c.split(",")[1].strip(): (v, m) for c, v, m in rows if c.startswith("seed's")}
    verdict, measured = bbrows["vs post"]
    assert verdict == "fails" and "differs from learned positions" in measured
    assert "(R=1 holds +0.000, R=3 holds -0.050)" in measured and len(study) == 162


def test_r7_grid_extension_adds_one_rate_beyond_an_end_optimum_and_waits_for_its_cells(tmp_path):
    gains = {("deeploop", 7): -0.05}
    _second_redesign_tree(tmp_path, gains)
    study = lr_cells({**BEST7, ("post", 7): 6e-4}, gains)  # post's best below its rates
    study.to_csv(tmp_path / "deeploop_lr_study.csv", index=False)
    pilot = ra.pilot_cells(tmp_path)
    assert ra.extension_rates(study, pilot) == {("post", 7): (3e-4,)}
    rows, notes = ra.redesign_verdicts(tmp_path)
    assert not [c for c, _, _ in rows if c.startswith("R = 7")]
    assert notes == ["DeepLoop second redesign, R = 7 grid extension (addendum): running, "
                     "0 of 6 cells"]  # fmt: skip
    more = lr_cells({("post", 7): 6e-4}, {}, rates=(3e-4,))
    pd.concat([study, more]).to_csv(tmp_path / "deeploop_lr_study.csv", index=False)
    assert ra.extension_rates(pd.concat([study, more]), pilot) == {("post", 7): (3e-4,)}
    rows, notes = ra.redesign_verdicts(tmp_path)
    r7 = {c.split(",")[1].strip(): (v, m) for c, v, m in rows if c.startswith("R = 7")}
    assert notes == [] and r7["vs post"][0] == "holds"  # 1e-3 bracketed by 3e-4 and 3e-3
    assert r7["vs post"][1].endswith("(addendum) for post (0.0003)")


def test_r7_grid_extension_is_one_step_an_optimum_at_the_new_end_stays_unbracketed(tmp_path):
    _second_redesign_tree(tmp_path, {})
    best = {**BEST7, ("post", 7): 2e-4}  # below even the added rate
    study = pd.concat([lr_cells(best, {}), lr_cells({("post", 7): 2e-4}, {}, rates=(3e-4,))])
    study.to_csv(tmp_path / "deeploop_lr_study.csv", index=False)
    assert ra.extension_rates(study, ra.pilot_cells(tmp_path)) == {("post", 7): (3e-4,)}
    rows, notes = ra.redesign_verdicts(tmp_path)
    verdict, measured = [(v, m) for c, v, m in rows if c.startswith("R = 7, vs post")][0]
    assert notes == [] and verdict == "undecided (optimum not bracketed for ['post'])"
    assert measured.endswith("(addendum) for post (0.0003)")
