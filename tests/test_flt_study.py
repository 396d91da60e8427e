"""Issue 30.5: the FLT study's analysis on planted cells with a known answer."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from studies.flt import analysis as flt
from studies.flt import run as flt_run

FLOOR = 3.11


def cell(arm, seed, lr=1e-2, collapse=None, fire=None, explode=None, grow=None, steps=300,
         nan_at=None):  # fmt: skip
    """Record rows every 10 steps: loss falls to 2.5 by step 80, back to the floor from
    ``collapse`` on; oscillation flag on from ``fire``, explosion flag from ``explode``,
    the last round's stream RMS 0.1, and 1.2 (12x: growth) from ``grow``;
    ``nan_at``: the run stops there on a non-finite loss (diverged)."""
    rng = np.random.default_rng(seed)
    rows = []
    for s in range(0, steps + 1, 10):
        loss = max(2.5, 5.5 - 0.04 * s) + 0.01 * rng.normal()
        if collapse is not None and s >= collapse:
            loss = FLOOR + 0.02
        row = {"arm": arm, "lr": lr, "R": 12, "seed": seed, "step": s, "val_loss": loss,
               "n_oscillating": int(fire is not None and s >= fire),
               "exploding": bool(explode is not None and s >= explode),
               "stream_rms_last": 1.2 if grow is not None and s >= grow else 0.1,
               "min_mean_cos": 0.5, "diverged": False,
               "cpu_s": 2.0}  # fmt: skip
        if nan_at is not None and s >= nan_at:
            rows.append({**row, "val_loss": math.nan, "diverged": True})
            break
        rows.append(row)
    out = pd.DataFrame(rows)
    out["diverged"] = out["diverged"].any()
    return out


def study(n=6, lt=None, flt_kw=None, lrs=flt.COLLAPSE_LRS):
    lt = {"collapse": 200, "fire": 150} if lt is None else lt
    frames = [cell("lt", s, lr, **lt) for s in range(n) for lr in lrs]
    frames += [cell("flt", s, lr, **(flt_kw or {})) for s in range(n) for lr in lrs]
    return pd.concat(frames, ignore_index=True)


def test_wilson_and_newcombe_match_their_closed_forms():
    lo, hi = flt.wilson(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)  # Newcombe 1998, Table I
    lo, hi = flt.newcombe(56, 70, 48, 80)  # Newcombe 1998, example (a): 0.0524 to 0.3339
    assert (lo, hi) == (pytest.approx(0.0524, abs=1e-4), pytest.approx(0.3339, abs=1e-4))


def test_planted_collapse_is_found_at_its_step_and_a_nan_run_collapses_where_it_stopped():
    ev = flt.events(pd.concat([cell("lt", 0, collapse=200), cell("lt", 1, nan_at=50),
                               cell("flt", 0)]), FLOOR)  # fmt: skip
    ev = ev.set_index(["arm", "seed"])
    assert ev.loc[("lt", 0), "collapse_step"] == 200 and ev.loc[("lt", 0), "collapsed"]
    assert ev.loc[("lt", 1), "collapse_step"] == 50  # stopped before COLLAPSE_FROM
    assert not ev.loc[("flt", 0), "collapsed"] and math.isnan(ev.loc[("flt", 0), "collapse_step"])


def test_the_plateau_phase_is_no_collapse_and_a_run_stuck_from_the_start_collapses_at_100():
    ev = flt.events(pd.concat([cell("lt", 0), cell("lt", 1, collapse=0)]), FLOOR)
    assert list(ev["collapsed"]) == [False, True]  # seed 0: above the floor until step 60
    assert ev["collapse_step"].iloc[1] == flt.COLLAPSE_FROM


def test_a_run_that_dips_below_the_floor_late_is_judged_on_its_last_steps():
    late = cell("lt", 0, collapse=100)
    late.loc[late["step"] == 250, "val_loss"] = 2.9  # one dip: collapsed from 260 on
    ev = flt.events(late, FLOOR)
    assert ev["collapsed"].iloc[0] and ev["collapse_step"].iloc[0] == 260
    late.loc[late["step"] >= 260, "val_loss"] = 2.9  # the end is below the floor: healthy
    assert not flt.events(late, FLOOR)["collapsed"].iloc[0]


def test_signals_firing_50_steps_before_a_planted_collapse_warn_and_flt_avoids():
    cells = study(lt={"collapse": 200, "fire": 150, "explode": 150, "grow": 150})
    for s in flt.SIGNALS:
        w = flt.warns(cells, s, FLOOR)
        assert w["verdict"] == "holds", w["reason"]
        assert w["before"] == 12 and w["false_alarms"] == 0 and w["median_lead"] == 50
    a = flt.avoids(cells, 1e-2, floor=FLOOR)
    assert a["verdict"] == "holds" and a["lt_collapsed"] == 6 and a["flt_collapsed"] == 0
    assert flt.avoids_claim(cells, floor=FLOOR)["verdict"] == "holds"


def test_the_claim_needs_every_collapse_lr_and_fails_when_one_fails():
    good = study(lrs=(1e-2,))
    assert flt.avoids_claim(good, floor=FLOOR)["verdict"] == "undecided"  # 3e-2 missing
    bad = pd.concat([good, study(lrs=(3e-2,), flt_kw={"collapse": 200})])
    assert flt.avoids_claim(bad, floor=FLOOR)["verdict"] == "fails"


def test_signals_that_never_fire_do_not_warn():
    cells = study(lt={"collapse": 200})
    for s in flt.SIGNALS:
        w = flt.warns(cells, s, FLOOR)
        assert w["verdict"] == "fails" and "does not fire" in w["reason"]


def test_a_signal_firing_only_at_the_collapse_step_is_not_a_warning():
    w = flt.warns(study(lt={"collapse": 200, "fire": 200}), "oscillation", FLOOR)
    assert w["before"] == 0 and w["verdict"] == "fails"


def test_a_signal_that_fires_in_healthy_runs_too_is_not_specific():
    cells = study(lt={"collapse": 200, "explode": 0}, flt_kw={"explode": 0})
    w = flt.warns(cells, "explosion", FLOOR)
    assert w["before"] == 12 and w["false_alarms"] == 12
    assert w["verdict"] == "fails" and "not specific" in w["reason"]


def test_one_seed_is_undecided_for_both_claims():
    cells = study(n=1, lt={"collapse": 200, "fire": 150})
    w = flt.warns(cells, "oscillation", FLOOR)
    assert w["verdict"] == "undecided" and "minimum" in w["reason"]
    assert flt.avoids(cells, floor=FLOOR)["verdict"] == "undecided"
    both = study(n=1, flt_kw={"collapse": 200}, lrs=(1e-2,))  # "fails" with enough seeds
    assert flt.avoids(both, floor=FLOOR)["verdict"] == "undecided"


def test_flt_collapsing_as_often_as_lt_fails_and_a_split_is_undecided():
    both = study(flt_kw={"collapse": 250}, lrs=(1e-2,))
    assert flt.avoids(both, floor=FLOOR)["verdict"] == "fails"
    half = pd.concat(
        [cell("lt", s, collapse=200 if s < 3 else None) for s in range(6)]
        + [cell("flt", s, collapse=200 if s < 2 else None) for s in range(6)]
    )
    a = flt.avoids(half, floor=FLOOR)
    assert a["verdict"] == "undecided" and a["ci_low"] < 0 < a["ci_high"]


def test_power_is_exact_keeps_its_level_at_equal_rates_and_grows_with_seeds():
    assert flt.power_avoids(3, 3) == pytest.approx(1.0)  # rates 1 vs 0: always 3/3 vs 0/3
    assert flt.power_avoids(6, 6, 0.5, 0.5) < 0.05  # no difference: holds at most ~5 %
    assert flt.power_avoids(6, 6, 0.8, 0.1) < flt.power_avoids(12, 12, 0.8, 0.1)
    assert 0 < flt.power_warns(4, 8) < flt.power_warns(12, 24) <= 1


def test_summary_and_figure_run_on_planted_cells(tmp_path):
    cells = study(lt={"collapse": 200, "fire": 150})
    md = flt.summary_markdown(cells, FLOOR)
    assert "FLT avoids the LT's collapse: holds" in md and "CPU-minutes" in md
    flt.figure(cells, str(tmp_path / "f.png"), FLOOR)
    assert (tmp_path / "f.png").stat().st_size > 1000


# ------------------------------------------------------------------------------ script


def test_a_study_cell_records_every_k_steps_and_probing_does_not_change_training(lp_one_thread):
    mod = flt_run
    cfg = {**mod.BASE, "d": 16, "seq": 8, "batch": 2, "eval_batches": 1, "every": 2,
           "warmup": 2, "steps": 4, "lr": 1e-2, "seed": 0, "R": 2, "arm": "flt"}  # fmt: skip
    rows = mod.train_cell(cfg)
    assert [r["step"] for r in rows] == [0, 2, 4]
    assert all(math.isfinite(r["val_loss"]) and not r["diverged"] for r in rows)
    assert {"n_oscillating", "exploding", "stream_rms_last", "cos_3"} <= set(rows[0])
    sparse = mod.train_cell({**cfg, "every": 4})  # fewer probes, same training
    assert [r["step"] for r in sparse] == [0, 4]
    assert sparse[-1]["val_loss"] == rows[-1]["val_loss"]
    lt = mod.train_cell({**cfg, "arm": "lt"})
    assert lt[-1]["val_loss"] != rows[-1]["val_loss"]  # same init, other model
