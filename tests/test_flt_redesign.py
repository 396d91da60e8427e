"""Issue 39.6: the FLT redesign's driver, control rule and per-layer oscillation diagnostic."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from studies.flt import redesign as rd
from studies.flt import run as flt_run

FLOOR = 3.11


def series_cell(arm, seed, norms, *, R=12, lr=3e-2, collapse=None, other=None, rms=None):
    """Record rows every 10 of 300 steps, layer 0's per-step gradient norms ``norms`` (300
    values, steps 0..299) split across the rows as the driver writes them (row 0: step 0;
    row t: steps t-9..t; row 300: steps 291..299); layer 1's are ``other`` (default: a
    monotone ramp, which never oscillates). Held-out loss: trains to 2.5, back on the floor
    from ``collapse``."""
    other = np.linspace(1.0, 2.0, 300) if other is None else other
    rows = []
    for t in range(0, 301, 10):
        lo, hi = (0, 1) if t == 0 else (t - 9, min(t, 299) + 1)
        loss = max(2.5, 5.5 - 0.04 * t)
        if collapse is not None and t >= collapse:
            loss = FLOOR + 0.02
        rows.append({"arm": arm, "R": R, "lr": lr, "seed": seed, "step": t, "val_loss": loss,
                     "gnorm_0": " ".join(f"{v:.6g}" for v in norms[lo:hi]),
                     "gnorm_1": " ".join(f"{v:.6g}" for v in other[lo:hi]),
                     "stream_rms_last": 1.0 if rms is None else rms(t), "n_oscillating": 0,
                     "diverged": False, "cpu_s": 1.0})  # fmt: skip
    return pd.DataFrame(rows)


def alternating(n=300):
    return 1.0 + 0.1 * (-1.0) ** np.arange(n)


def test_sign_flips_matches_a_loop_over_consecutive_differences():
    rng = np.random.default_rng(0)
    for _ in range(200):
        x = rng.normal(size=rng.integers(3, 15))
        d = [x[i + 1] - x[i] for i in range(len(x) - 1)]
        slow = sum((d[i] > 0) != (d[i - 1] > 0) for i in range(1, len(d)))
        assert rd.sign_flips(x) == slow
    assert rd.sign_flips(np.arange(11.0)) == 0 and rd.sign_flips(alternating(11)) == 9


def test_an_alternating_layer_fires_from_step_10_and_a_monotone_one_never():
    osc = rd.grad_oscillation(series_cell("lt", 0, alternating()))
    assert list(osc["grad_osc"]) == [0] + [1] * 30  # layer 0 only; the ramp never
    both = rd.grad_oscillation(series_cell("lt", 0, alternating(), other=alternating()))
    assert both["grad_osc"].iloc[1:].eq(2).all()
    calm = rd.grad_oscillation(series_cell("lt", 0, np.linspace(2.0, 1.0, 300)))
    assert calm["grad_osc"].eq(0).all()
    flat = rd.grad_oscillation(series_cell("lt", 0, np.zeros(300), other=np.ones(300)))
    assert flat["grad_osc"].eq(0).all()  # no change is no sign change (a frozen layer)


def test_the_window_is_the_last_eleven_steps_and_fires_above_half_of_nine_flips():
    x = np.linspace(1.0, 4.0, 300)  # monotone, but steps 150..160 zig-zag
    zig = x.copy()
    zig[150:161] += 0.5 * (-1.0) ** np.arange(11)
    fired = rd.grad_oscillation(series_cell("lt", 0, zig)).set_index("step")["grad_osc"]
    assert fired[fired > 0].index.tolist() == [160]  # the one window that holds 150..160
    for n_flips, fires in ((4, False), (5, True)):  # 9 pairs: more than half is 5
        signs = np.ones(10)  # 10 differences whose sign changes after each of the first n
        for k in range(n_flips):
            signs[k + 1 :] *= -1
        w = 6.0 + np.r_[0.0, np.cumsum(signs * 0.1)]
        assert rd.sign_flips(w) == n_flips
        y = x.copy()
        y[150:161] = w
        got = rd.grad_oscillation(series_cell("lt", 0, y)).set_index("step")["grad_osc"]
        assert bool(got.loc[160]) is fires


def test_cells_without_per_layer_norms_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="gnorm_<k>.*version >= 2"):
        rd.grad_oscillation(
            series_cell("lt", 0, alternating()).drop(columns=["gnorm_0", "gnorm_1"])
        )


def pilot(collapsed: dict) -> pd.DataFrame:
    """LT pilot cells; ``collapsed[(R, lr)]`` = how many of seeds 0-2 collapse."""
    frames = []
    for (R, lr), k in collapsed.items():
        for s in range(3):
            frames.append(series_cell("lt", s, np.ones(300), R=R, lr=lr,
                                      collapse=100 if s < k else None))  # fmt: skip
    return pd.concat(frames, ignore_index=True)


def test_the_control_is_the_smallest_r_then_the_smallest_lr_with_three_of_three():
    grid = {(12, 3e-2): 2, (12, 6e-2): 3, (12, 1e-1): 3, (24, 3e-2): 3}
    assert rd.choose_control(pilot(grid), FLOOR) == (12, 6e-2)
    assert rd.choose_control(pilot({(12, 6e-2): 2, (24, 1e-1): 3}), FLOOR) == (24, 1e-1)
    assert rd.choose_control(pilot({(12, 6e-2): 2, (24, 1e-1): 2}), FLOOR) is None
    two_seeds = pilot({(12, 6e-2): 3})
    assert rd.choose_control(two_seeds[two_seeds["seed"] < 2], FLOOR) is None
    md = rd.summary_markdown(None, pilot({(12, 6e-2): 2}), FLOOR)
    assert "no positive control within budget" in md


def test_a_planted_study_where_only_the_lt_collapses_holds_and_noise_is_not_specific():
    rng = np.random.default_rng(1)
    noisy = [series_cell(arm, s, 1 + 0.1 * rng.random(300), collapse=150 if arm == "lt" else None,
                         rms=(lambda t: 1 + 0.1 * t) if arm == "lt" else None)
             for s in range(100, 110) for arm in ("lt", "flt")]  # fmt: skip
    j = rd.judge(pd.concat(noisy, ignore_index=True), FLOOR)
    assert (j["R"], j["lr"], j["avoids"]["verdict"]) == (12, 3e-2, "holds")
    assert j["avoids"]["lt_collapsed"] == 10 and j["avoids"]["flt_collapsed"] == 0
    g = j["warns"]["grad_oscillation"]  # i.i.d. noise flips 2/3 of the time: fires everywhere
    assert g["verdict"] == "fails" and g["false_alarms"] == 10
    growth = j["warns"]["growth"]  # 10x the step-0 RMS at step 90, 60 steps before collapse
    assert growth["verdict"] == "holds" and growth["before"] == 10 and growth["median_lead"] == 60
    md = rd.summary_markdown(pd.concat(noisy), pilot({(12, 3e-2): 3}), FLOOR)
    assert "FLT avoids the LT's collapse (R 12, lr 0.03): holds" in md


def test_the_driver_appends_each_cell_once_and_a_rerun_skips_it(tmp_path, monkeypatch):
    calls = []

    def fake(cfg):
        calls.append(cfg["seed"])
        extra = {"new_col": 1.0} if cfg["seed"] == 2 else {}
        return [{"step": 0, "val_loss": 5.0, **extra}, {"step": 10, "val_loss": 4.0, **extra}]

    monkeypatch.setattr(flt_run, "train_cell", fake)
    path = str(tmp_path / "cells.csv")
    cells = [rd.cell("lt", 12, 3e-2, s, probe=False) for s in (0, 1)]
    assert rd.run_cells(cells, path) == 2 and rd.run_cells(cells, path) == 0
    more = cells + [rd.cell("lt", 12, 3e-2, 2, probe=False)]
    assert rd.run_cells(more, path) == 1 and calls == [0, 1, 2]
    df = pd.read_csv(path)
    assert len(df) == 6 and df.groupby("seed").size().tolist() == [2, 2, 2]
    assert df["new_col"].isna().tolist() == [True] * 4 + [False] * 2  # column added, kept
    assert rd.done_keys(path) == {("lt", 12, 0.03, s) for s in (0, 1, 2)}


def test_a_real_cell_records_each_layer_gradient_norm_at_every_step(lp_one_thread):
    cfg = {**flt_run.BASE, "d": 16, "seq": 8, "batch": 2, "eval_batches": 1, "every": 2,
           "warmup": 2, "steps": 4, "lr": 1e-2, "seed": 0, "R": 2, "arm": "lt"}  # fmt: skip
    rows = flt_run.train_cell(cfg)
    assert [len(r["gnorm_0"].split()) for r in rows] == [1, 2, 1]  # steps 0 | 1,2 | 3
    for r in rows[:-1]:  # the layers' norms are part of the global one (embeddings too)
        layers = math.sqrt(sum(float(r[f"gnorm_{k}"].split()[-1]) ** 2 for k in (0, 1)))
        assert 0 < layers <= r["grad_norm"] * (1 + 1e-6)
    bare = flt_run.train_cell({**cfg, "probe": False})  # no lp.instability: same training
    assert [r["val_loss"] for r in bare] == [r["val_loss"] for r in rows]
    assert [r["gnorm_1"] for r in bare] == [r["gnorm_1"] for r in rows]
    assert "n_oscillating" not in bare[0] and "n_oscillating" in rows[0]


def test_the_verdict_table_gets_redesign_rows_only_with_a_control_and_every_cell(tmp_path):
    from studies import judges, scope

    rng = np.random.default_rng(2)
    cells = pd.concat([series_cell(arm, s, 1 + 0.1 * rng.random(300),
                                   collapse=150 if arm == "lt" else None)
                       for s in rd.SEEDS for arm in ("lt", "flt")], ignore_index=True)  # fmt: skip
    pilot({(12, 3e-2): 3}).to_csv(tmp_path / "flt_redesign_pilot.csv", index=False)
    cells[cells["seed"] < 109].to_csv(tmp_path / "flt_redesign.csv", index=False)
    assert judges._flt_redesign(tmp_path) == []  # 18 of 20 cells: not judged yet
    cells.to_csv(tmp_path / "flt_redesign.csv", index=False)
    real_floor = rd.study.unigram_floor()  # the judge uses the val split's floor
    assert abs(real_floor - FLOOR) < 0.01
    rows = judges._flt_redesign(tmp_path)
    assert [v.claim for v in rows][0] == "FLT (redesign): avoids the looped transformer's collapse"
    assert rows[0].verdict == "holds" and len(rows) == 1 + len(rd.SIGNALS)
    assert all("10 seeds" in scope.worded("flt", v).claim for v in rows)
    pilot({(12, 3e-2): 2}).to_csv(tmp_path / "flt_redesign_pilot.csv", index=False)
    assert judges._flt_redesign(tmp_path) == []  # no control: no study rows
