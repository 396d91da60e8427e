"""The LR-vs-L redesign (no gate): its resumable seed-major driver (studies.lr_l.redesign) with
a planted cell function, and its verdict (studies.lr_l.analysis.redesign_claim) on planted
cells."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

import studies.lr_edge.run as lr_edge_run
from studies.lr_l import analysis as lr_l
from studies.lr_l import redesign as rd


def planted_cells(center, seeds=rd.SEEDS, xs=rd.GRID, noise=0.01, rng=0):
    """Cells as the driver writes them: loss = 2 + 0.2 (log2 lr - center(L, N))^2 + noise."""
    g = np.random.default_rng(rng)
    rows = [{**rd.BASE, "L": L, "N": N, "lr": rd.lr_of(x), "seed": s,
             "loss": 2 + 0.2 * (x - center(L, N)) ** 2 + noise * g.standard_normal()}
            for s in seeds for L in rd.LS for N in rd.NS for x in xs]  # fmt: skip
    return pd.DataFrame(rows)


def loop_mup(L, N):  # the claim: flat in N, half an octave lower at L = 2
    return -6.0 - 0.5 * (L - 1)


def test_the_grid_is_the_registered_half_octave_grid():
    assert len(rd.GRID) == 13 and rd.GRID[0] == -9 and rd.GRID[-1] == -3
    assert np.allclose(np.diff(rd.GRID), 0.5)
    assert rd.grid(rd.load("/nonexistent.csv")) == list(rd.GRID)
    assert len(rd.todo(rd.load("/nonexistent.csv"))) == 8 * 13  # seed 100's whole grid first


def test_an_arm_at_the_top_edge_adds_two_rates_above_for_every_arm_before_the_next_seed():
    done = planted_cells(lambda L, N: -2.0 if (L, N) == (2, 8) else -6.0, seeds=[100])
    xs = rd.grid(done)
    assert xs == list(rd.GRID) + [-2.5, -2.0]
    nxt = rd.todo(done)
    assert {c["seed"] for c in nxt} == {100} and len(nxt) == 8 * 2
    assert {c["lr"] for c in nxt} == {rd.lr_of(-2.5), rd.lr_of(-2.0)}
    # interior everywhere: no extension, and the next cells are seed 101's
    flat = planted_cells(loop_mup, seeds=[100])
    assert rd.grid(flat) == list(rd.GRID)
    assert {c["seed"] for c in rd.todo(flat)} == {101}
    # the bottom edge, twice over: the extension itself extends again once it is run
    low = planted_cells(lambda L, N: -12.0, seeds=[100])
    assert rd.grid(low)[:2] == [-10.0, -9.5]
    low2 = pd.concat([low, planted_cells(lambda L, N: -12.0, seeds=[100], xs=[-10.0, -9.5])])
    assert rd.grid(low2)[:4] == [-11.0, -10.5, -10.0, -9.5]


def test_the_driver_resumes_seed_major_and_skips_the_cells_already_written(tmp_path, monkeypatch):
    calls = []

    def fake(cfg):
        calls.append((cfg["L"], cfg["N"], cfg["lr"], cfg["seed"]))
        x = math.log2(cfg["lr"])
        return {
            "loss": 2 + 0.2 * (x - loop_mup(cfg["L"], cfg["N"])) ** 2,
            "train_loss": 2.0,
            "acc": 0.3,
            "diverged": False,
            "error": None,
            "steps_done": 200,
            "cpu_s": 0.0,
        }

    monkeypatch.setattr(lr_edge_run, "transfer_cell", fake)
    out = tmp_path / "cells.csv"
    partial = planted_cells(loop_mup, seeds=[100]).head(50)
    for row in partial.to_dict("records"):
        rd.append({**row, "train_loss": 2.0, "acc": 0.3, "diverged": False, "steps_done": 200,
                   "cpu_s": 0.0}, str(out))  # fmt: skip
    rd.main(["--out", str(out)])
    df = pd.read_csv(out)
    assert len(df) == 4 * 8 * 13 and len(calls) == 4 * 8 * 13 - 50
    assert not df.duplicated(rd.KEY).any()
    assert (np.diff(df["seed"].to_numpy()) >= 0).all()  # seed-major
    n_before = len(calls)
    rd.main(["--out", str(out)])  # a rerun has nothing to do
    assert len(calls) == n_before and len(pd.read_csv(out)) == len(df)


def test_redesign_claim_holds_on_a_planted_loop_mup_truth_and_is_undecided_below_four_seeds():
    v, why = lr_l.redesign_claim(planted_cells(loop_mup))
    assert v == "holds", why
    assert "L contrast d=32 -0.5" in why
    v2, why2 = lr_l.redesign_claim(planted_cells(loop_mup, seeds=[100, 101]))
    assert v2 == "undecided (2 of 4 seeds run)"
    assert "would give undecided (2 complete seeds < 3)" in why2
    v3, why3 = lr_l.redesign_claim(planted_cells(loop_mup, seeds=[100, 101, 102]))
    assert v3 == "undecided (3 of 4 seeds run)" and "would give holds" in why3
    half = planted_cells(loop_mup, seeds=[100])  # seed 100 still running: L = 2 not yet run
    assert lr_l.redesign_claim(half[half["L"] == 1])[0] == "undecided (0 of 4 seeds run)"


def test_redesign_claim_fails_on_a_planted_drift_of_two_octaves():
    v, why = lr_l.redesign_claim(planted_cells(lambda L, N: -7.0 + 2 * (N == 8)))
    assert v == "fails", why
    assert "drift d=32 L=1" in why


def test_a_non_finite_loss_counts_as_a_uniform_byte():
    cells = planted_cells(loop_mup)
    cells.loc[(cells["N"] == 8) & (cells["lr"] == rd.lr_of(-6.0)), "loss"] = np.nan
    cells.loc[(cells["N"] == 4) & (cells["lr"] == rd.lr_of(-6.0)), "loss"] = np.inf
    opt = lr_l.estimate(cells, math.log(256))["optima"].set_index(["L", "N"])["opt_log2_lr"]
    assert np.isfinite(opt).all()
    assert (abs(opt.loc[1, 8] + 6.0) > 0.2) and (abs(opt.loc[1, 4] + 6.0) > 0.2)
    with pytest.raises(ValueError):
        lr_l.redesign_claim(cells.drop(columns=["loss"]))


def test_the_judge_uses_the_redesign_once_its_cells_exist(tmp_path):
    from loopprobe.report.verdicts import HOLDS, UNKNOWN
    from studies import judges

    pilot = tmp_path / "lr_l" / "lr_l_pilot.csv"
    pilot.parent.mkdir()
    pilot.write_text(open(lr_l_pilot_csv()).read())
    (v,) = judges.lr_l(pilot)[1]
    assert v.claim.startswith("LR vs L: ") and v.verdict == UNKNOWN
    planted_cells(loop_mup).assign(cpu_s=1.0).to_csv(pilot.with_name("redesign.csv"), index=False)
    (v,) = judges.lr_l(pilot)[1]
    assert v.claim.startswith("LR vs L (redesign, no gate): ") and v.verdict == HOLDS
    one = planted_cells(loop_mup, seeds=[100]).assign(cpu_s=1.0)
    one.to_csv(pilot.with_name("redesign.csv"), index=False)
    (v,) = judges.lr_l(pilot)[1]
    assert v.verdict == UNKNOWN and v.why == "undecided (1 of 4 seeds run)"
    assert "seed 100 only, no interval" in v.measured and "[" not in v.measured


def lr_l_pilot_csv() -> str:
    from studies.lr_l.run import PILOT_CSV

    return PILOT_CSV
