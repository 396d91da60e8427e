"""The LR-edge redesign's estimators (studies/lr_edge/redesign_analysis.py) and driver
(studies/lr_edge/redesign.py) against brute-force twins on planted cells and a tiny model."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from loopprobe import tasks
from studies.lr_edge import redesign as drv
from studies.lr_edge import redesign_analysis as ra

XS = [x / 2 for x in range(-14, 3)]


def planted(seeds, edge_of, rise_hi=2.0, nonfinite_from=None):
    """Cells of every arm and rate: unstable (rise ``rise_hi``) from the rate index
    ``edge_of(scaling, N, seed)`` on; non-finite from ``nonfinite_from`` rates above it."""
    rows = []
    for seed in seeds:
        for scaling, N in drv.arms():
            k = edge_of(scaling, N, seed)
            for i, x in enumerate(XS):
                bad = i >= k
                nf = nonfinite_from is not None and i >= k + nonfinite_from
                rows.append({"scaling": scaling, "N": N, "lr": drv.lr_of(x), "seed": seed,
                             "nonfinite": nf, "rise": math.nan if nf else (rise_hi if bad else
                                                                          0.1),
                             "cpu_s": 1.0})  # fmt: skip
    return pd.DataFrame(rows)


def twin_edge(xs, bad):
    """Brute force: walk up the grid; the first unstable rate and the one below it."""
    for i, b in enumerate(bad):
        if b:
            return None if i == 0 else (xs[i - 1] + xs[i]) / 2
    return None


def test_unstable_rule_threshold_and_nonfinite():
    c = pd.DataFrame({"nonfinite": [False, False, True, "True", False],
                      "rise": [0.5, 0.5001, math.nan, 0.0, math.nan]})  # fmt: skip
    assert ra.unstable(c).tolist() == [False, True, True, True, False]
    with pytest.raises(ValueError, match="rise"):
        ra.unstable(c.drop(columns="rise"))


def test_edges_match_brute_force_on_random_cells():
    rng = np.random.default_rng(0)
    cells = planted([1, 2], lambda s, N, seed: 0)
    cells["rise"] = rng.choice([0.1, 0.4, 0.6, 3.0], len(cells), p=[0.5, 0.2, 0.15, 0.15])
    cells["nonfinite"] = rng.random(len(cells)) < 0.05
    e = ra.edges(cells).set_index(["scaling", "N", "seed"])
    full = ra.first._expand(cells)
    for (sc, N, seed), g in full.groupby(["scaling", "N", "seed"]):
        g = g.sort_values("lr")
        bad = [bool(nf) or r > 0.5 for nf, r in zip(g["nonfinite"], g["rise"], strict=True)]
        want = twin_edge(list(np.log2(g["lr"])), bad)
        got = e.loc[(sc, N, seed), "log2_edge"]
        if want is None:
            assert math.isnan(got) and e.loc[(sc, N, seed), "censored"]
        else:
            assert got == pytest.approx(want, abs=1e-3)


def test_edges_censoring_and_non_monotone():
    cells = planted([1], lambda s, N, seed: {1: 0, 2: 99}.get(N, 5))
    e = ra.edges(cells).set_index(["scaling", "N"])
    assert e.loc[("1/N", 1), "why"] == "unstable at the lowest rate"
    assert e.loc[("1/N", 2), "why"] == "no unstable rate"
    assert e.loc[("1/N", 4), "log2_edge"] == pytest.approx((XS[4] + XS[5]) / 2, abs=1e-3)
    assert not e.loc[("1/N", 4), "non_monotone"]
    i = cells.index[
        (cells["N"] == 4) & (cells["scaling"] == "1/N") & (cells["lr"] == drv.lr_of(XS[8]))
    ]
    cells.loc[i, "rise"] = 0.1  # a stable rate above the first unstable one: flagged, edge kept
    e2 = ra.edges(cells).set_index(["scaling", "N"])
    assert e2.loc[("1/N", 4), "non_monotone"]
    assert e2.loc[("1/N", 4), "log2_edge"] == e.loc[("1/N", 4), "log2_edge"]


def law(slope_sq, slope_lin):
    """Edge index on the half-octave grid: 2 steps per octave of slope x log2 N."""

    def k(scaling, N, seed):
        s = slope_sq if scaling == "1/sqrt(N)" else slope_lin
        return 12 + round(2 * s * math.log2(N)) + (seed % 2)  # seed offsets keep sd > 0

    return k


def test_verdict_on_complete_seeds_only_and_seed_count():
    cells = planted([100, 101, 102, 103], law(-0.5, 0.0))
    v, why, s = ra.verdict(cells)
    assert v == "holds", why
    t = s.set_index("scaling")
    assert t.loc["1/sqrt(N)", "slope"] == pytest.approx(-0.5, abs=0.01)
    assert t.loc["1/N", "slope"] == pytest.approx(0.0, abs=0.01)
    # a partial seed (one cell missing) is left out: 3 complete seeds -> undecided (3 of 6)
    part = cells.drop(cells.index[(cells["seed"] == 103)][-1:])
    assert ra.complete_seeds(part) == [100, 101, 102]
    v3, _, _ = ra.verdict(part)
    assert v3 == "undecided (3 of 6 seeds run)"
    vf, _, _ = ra.verdict(planted([100, 101, 102, 103], law(0.0, 0.0)))
    assert vf == "fails"
    assert ra.verdict(cells.iloc[:10])[0] == "undecided (0 of 6 seeds run)"


def test_step_slopes_match_polyfit_twin():
    rng = np.random.default_rng(1)
    rows = []
    for seed in range(4):
        for scaling, N in drv.arms():
            eps = 1.0 if N == 1 else (N**-0.5 if scaling == "1/sqrt(N)" else 1 / N)
            for x in XS:
                lr = 2.0**x
                rows.append(
                    {
                        "scaling": scaling,
                        "N": N,
                        "lr": lr,
                        "seed": seed,
                        "eps": eps,
                        "dh": 3 * (lr * eps * N) ** 1.3 * math.exp(rng.normal(0, 0.2)),
                    }
                )
    step = pd.DataFrame(rows)
    got = ra.step_slopes(step)
    per = [np.polyfit(np.log2(g.lr * g.eps * g.N), np.log2(g.dh), 1)[0]
           for _, g in step.groupby("seed")]  # fmt: skip
    assert got["slope"] == pytest.approx(np.mean(per), abs=1e-9)
    assert got["ci_low"] < 1.3 < got["ci_high"]
    n = ra.step_n_slopes(step).set_index("scaling")["slope_in_log2_N"]
    assert n["1/sqrt(N)"] == pytest.approx(1.3 * 0.5, abs=0.05)
    assert n["1/N"] == pytest.approx(0.0, abs=0.05)


def test_step_cell_matches_hand_adam_step():
    cfg = {"scaling": "1/sqrt(N)", "N": 2, "lr": 0.01, "seed": 5}
    got = drv.step_cell(cfg)
    model = drv.model_of("1/sqrt(N)", 2, 5)
    x, y = tasks.stdlib_text(16, 32, torch.Generator().manual_seed(7_005))
    with torch.no_grad():
        e0, h0 = model.embed(x).double(), model.hidden(x).double()
    tasks.lm_loss(model(x), y).backward()
    with torch.no_grad():  # AdamW's first step: m_hat = g, v_hat = g^2
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.01 * p.grad / (p.grad.abs() + 1e-8)
        d = model.hidden(x).double() - h0
        dh = d.pow(2).mean(-1).sqrt().mean()
        dl = (d - model.embed(x).double() + e0).pow(2).mean(-1).sqrt().mean()
    assert got["dh"] == pytest.approx(float(dh), rel=1e-5)
    assert got["dh_loop"] == pytest.approx(float(dl), rel=1e-5)
    assert got["eps"] == pytest.approx(2**-0.5)


def test_train_cell_rise_and_resume(tmp_path, monkeypatch):
    monkeypatch.setattr(drv, "BASE", {**drv.BASE, "steps": 15})
    c = {"scaling": "1/N", "N": 2, "lr": 2.0, "seed": 100, "steps": 15}
    out = drv.train_cell(c)
    assert out["steps_done"] == 15 or out["nonfinite"]
    cells = drv.cells_of(100) + drv.cells_of(101)
    assert len(cells) == 2 * ra.N_ARMS * ra.N_GRID and cells[0]["seed"] == 100
    monkeypatch.setattr(drv, "SEEDS", (100,))
    calls = []
    monkeypatch.setattr(
        drv, "step_cell", lambda c: calls.append(c) or {"dh": 1.0, "eps": 1.0, "cpu_s": 0}
    )
    monkeypatch.setattr(
        drv,
        "train_cell",
        lambda c: calls.append(c) or {"rise": 0.0, "nonfinite": False, "cpu_s": 0},
    )
    a, b = str(tmp_path / "p.csv"), str(tmp_path / "s.csv")
    pd.DataFrame(drv.cells_of(100)[:5], columns=drv.COLUMNS).to_csv(a, index=False)
    drv.run(out=a, step_out=b)
    assert len(calls) == 2 * 153 - 5 and len(pd.read_csv(a)) == 153
    calls.clear()
    drv.run(out=a, step_out=b)
    assert calls == []


def test_redesign_verdicts_for_the_judge(tmp_path):
    cells = planted([100, 101, 102, 103, 104], law(-0.5, 0.0))
    cells = cells.drop(cells.index[cells["seed"] == 104][:3])  # seed 104 still running
    cells.to_csv(tmp_path / "redesign.csv", index=False)
    rows, notes = ra.redesign_verdicts(tmp_path)
    ((claim, v, measured),) = rows
    assert claim == ra.CLAIM and v == "holds" and "complete seeds 4 of 6" in measured
    assert "4 complete seeds" in notes[0]
    cells[cells["seed"] < 103].to_csv(tmp_path / "redesign.csv", index=False)
    assert ra.redesign_verdicts(tmp_path)[0][0][1] == "undecided (3 of 6 seeds run)"


def test_train_cell_never_clips(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the redesign trains without gradient clipping")

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", boom)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_value_", boom)
    c = {"scaling": "1/sqrt(N)", "N": 2, "lr": 0.01, "seed": 100, "steps": 12}
    out = drv.train_cell(c)
    assert out["steps_done"] == 12 and not out["nonfinite"] and math.isfinite(out["rise"])
