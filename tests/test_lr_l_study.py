"""The LR-vs-L study's analysis (studies.lr_l.analysis) on planted cell tables, and the
pointer-chasing task it trains on (lp.tasks.pointer_chasing) against a plain-Python twin."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

import loopprobe as lp
from loopprobe.experiments.lrtransfer import LRTransfer
from studies.lr_l import analysis as lr_l

LOG2_LRS = np.arange(-9.0, -2.9, 0.5)  # half octaves 2^-9 .. 2^-3


def planted(center, seeds=range(4), noise=0.01, seed_shift=0.0, curv=0.2, rng=0):
    """Cells with loss = 1 + curv (log2 lr - center(L, N) - shift_s)^2 + noise, L in {1, 2},
    N in 1..8; shift_s ~ seed_shift * normal is a seed's optimum shift, shared by its arms."""
    g = np.random.default_rng(rng)
    rows = []
    for s in seeds:
        shift = seed_shift * g.standard_normal()
        for L in (1, 2):
            for N in (1, 2, 4, 8):
                c = center(L, N) + shift
                for x in LOG2_LRS:
                    loss = 1 + curv * (x - c) ** 2 + noise * g.standard_normal()
                    rows.append({"d": 32, "m": 8, "L": L, "N": N, "lr": 2.0**x, "seed": s,
                                 "loss": loss})  # fmt: skip
    return pd.DataFrame(rows)


def loop_mup_truth(L, N):  # the claim: flat in N, half an octave lower at L = 2
    return -6.0 - 0.5 * (L - 1)


def test_optimum_is_the_exact_vertex_of_a_planted_parabola_off_the_grid():
    x = LOG2_LRS
    mean = 0.3 * (x - (-5.8)) ** 2 + 2.0
    v, edge = lr_l.optimum(mean[None], x)
    assert not edge[0]
    assert v[0] == pytest.approx(-5.8, abs=1e-9)


def test_optimum_matches_lrtransfer_fit_log2_lr_on_random_curves():
    rng = np.random.default_rng(1)
    lrs = list(2.0**LOG2_LRS)
    for _ in range(20):
        y = rng.uniform(1, 2, len(lrs))
        rows = pd.DataFrame({"N": 1, "lr": lrs, "seed": 0, "loss": y, "diverged": False})
        twin = float(LRTransfer(rows, lrs).best()["fit_log2_lr"].iloc[0])
        v, edge = lr_l.optimum(y[None], LOG2_LRS)
        if math.isnan(twin):  # polyfit's vertex is undefined exactly at the grid's edge
            assert edge[0] and v[0] in (LOG2_LRS[0], LOG2_LRS[-1])
        else:
            assert not edge[0] and v[0] == pytest.approx(twin, abs=1e-9)


def test_flat_in_N_and_lower_at_L2_holds_and_estimates_the_planted_contrasts():
    est = lr_l.estimate(planted(loop_mup_truth))
    c = est["contrasts"].set_index("contrast")
    assert c.loc["drift d=32 L=1", "estimate"] == pytest.approx(0.0, abs=0.1)
    assert c.loc["L contrast d=32", "estimate"] == pytest.approx(-0.5, abs=0.1)
    assert lr_l.verdict(est)[0] == "holds"


def test_optimum_moving_right_with_N_fails_with_the_planted_drift_and_sign():
    est = lr_l.estimate(planted(lambda L, N: -7.0 - 0.5 * (L - 1) + 0.5 * math.log2(N)))
    c = est["contrasts"].set_index("contrast")
    assert c.loc["drift d=32 L=2", "estimate"] == pytest.approx(1.5, abs=0.1)
    assert c.loc["drift d=32 L=2", "ci_low"] > lr_l.BAND
    v, why = lr_l.verdict(est)
    assert v == "fails" and "drift d=32 L=1" in why


def test_optimum_higher_at_L2_fails_on_the_L_contrast():
    v, why = lr_l.verdict(lr_l.estimate(planted(lambda L, N: -6.5 + 0.75 * (L - 1))))
    assert v == "fails" and why.endswith("L contrast d=32")


def test_optimum_at_the_grid_edge_is_undecided():
    v, why = lr_l.verdict(lr_l.estimate(planted(lambda L, N: -10.0 + 0.0 * L)))
    assert v == "undecided" and "edge" in why


def test_noisy_seeds_give_undecided_not_holds():
    cells = planted(loop_mup_truth, noise=0.08, curv=0.02)
    est = lr_l.estimate(cells)
    widths = est["contrasts"]["ci_high"] - est["contrasts"]["ci_low"]
    assert (widths > 1.0).any()
    assert lr_l.verdict(est)[0] == "undecided"


def test_bootstrap_is_paired_a_seed_shift_shared_by_the_arms_cancels_in_the_contrasts():
    cells = planted(loop_mup_truth, noise=0.0, seed_shift=0.4)
    est = lr_l.estimate(cells)
    c = est["contrasts"]
    assert np.allclose(c["ci_high"] - c["ci_low"], 0.0, atol=1e-6)
    assert np.allclose(c["estimate"], [0.0, 0.0, -0.5], atol=1e-6)


def test_too_few_complete_seeds_is_undecided_and_incomplete_seeds_are_dropped():
    cells = planted(loop_mup_truth, seeds=range(3))
    cells = cells.drop(cells.index[(cells["seed"] == 2) & (cells["N"] == 8)][:1])
    est = lr_l.estimate(cells)
    assert est["seeds"] == [0, 1]
    assert lr_l.verdict(est) == ("undecided", "2 complete seeds < 3")


def test_a_non_finite_cell_counts_as_chance_not_as_a_missing_cell():
    cells = planted(loop_mup_truth)
    top = cells["lr"] == cells["lr"].max()
    cells.loc[top & (cells["N"] == 8), "loss"] = np.nan
    est = lr_l.estimate(cells)
    assert est["seeds"] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="lack columns"):
        lr_l.estimate(cells.drop(columns="loss"))


def test_summary_and_figure_are_drawn_from_the_cells(tmp_path):
    cells = planted(loop_mup_truth)
    text = lr_l.summary_markdown(cells)
    assert "Verdict: **holds**" in text and "L contrast d=32" in text
    path = tmp_path / "f.png"
    fig = lr_l.figure(cells, str(path))
    img = __import__("matplotlib.pyplot").pyplot.imread(path)
    assert len(fig.axes) == 2 and img[..., :3].std() > 0.05


def pilot_cells(n8_loss, n8_acc):
    """Two pilot configurations x (N = 1, N = 8) x 3 lrs; the N = 8 best at the middle lr."""
    rows = []
    for block, m in (("x", 6), ("y", 8), ("z", 8)):  # y and z: one configuration, two blocks
        for N in (1, 8) if block != "z" else (8,):
            for k, lr in enumerate((2**-8, 2**-7, 2**-6)):
                best = n8_loss if N == 8 else 1.0
                best += 0.5 if block == "z" else 0.0  # z's lrs are worse: y's stay the best
                rows.append({"block": block, "task": "chase", "m": m, "hops": 3, "d": 32,
                             "batch": 64, "steps": 100, "L": 1, "N": N,
                             "lr": lr / 8 if block == "z" else lr,
                             "loss": best + 0.3 * abs(k - 1),
                             "acc": (n8_acc if N == 8 else 0.5) - 0.2 * abs(k - 1)})  # fmt: skip
    return pd.DataFrame(rows)


@pytest.mark.parametrize(
    ("n8_loss", "n8_acc", "qualifies"),
    [(0.85, 0.5, True), (0.95, 0.5, False), (1.0, 0.62, True), (1.0, 0.55, False),
     (1.2, 0.3, False)],
)  # fmt: skip
def test_pilot_table_takes_each_arms_best_lr_and_applies_the_search_condition(
    n8_loss, n8_acc, qualifies, tmp_path
):
    t = lr_l.pilot_table(pilot_cells(n8_loss, n8_acc))
    n8 = t[t["N"] == 8]
    assert np.allclose(n8["gap_nats"], n8_loss - 1.0) and np.allclose(n8["gap_acc"], n8_acc - 0.5)
    assert (n8["best_lr"] == 2**-7).all() and list(n8["qualifies"]) == [qualifies] * 2
    assert not t[t["N"] == 1]["qualifies"].any()
    assert list(t["block"]) == ["x", "x", "y+z", "y+z"] and list(n8["n_lrs"]) == [3, 6]
    text = lr_l.pilot_markdown(pilot_cells(n8_loss, n8_acc))
    assert text.endswith("**none**") != qualifies
    fig = lr_l.pilot_figure(pilot_cells(n8_loss, n8_acc), str(tmp_path / "p.png"))
    assert len(fig.axes) == 1


def test_claim_is_undecided_without_a_qualifying_task_else_the_study_verdict():
    v, why = lr_l.claim(pilot_cells(1.05, 0.5))
    assert v == "undecided" and "closest +0.050 nats" in why
    assert lr_l.claim(pilot_cells(0.8, 0.5), planted(loop_mup_truth))[0] == "holds"
    moving = planted(lambda L, N: -7.0 + 0.5 * math.log2(N) - 0.5 * (L - 1))
    assert lr_l.claim(pilot_cells(1.05, 0.5), moving)[0] == "undecided"  # cells cannot count
    assert lr_l.claim(pilot_cells(0.8, 0.5), moving)[0] == "fails"


# ------------------------------------------------------------------------ the task


def test_pointer_chasing_matches_a_plain_python_twin():
    x, y = lp.tasks.pointer_chasing(64, torch.Generator().manual_seed(3), m=5, hops=3)
    assert x.shape == (64, 6) and y.shape == (64,) and x.dtype == y.dtype == torch.long
    for row, target in zip(x.tolist(), y.tolist(), strict=True):
        f = {t // 5: t % 5 for t in row[:5]}
        assert sorted(f) == list(range(5)) and sorted(f.values()) == list(range(5))
        p = row[5] - 25
        assert 0 <= p < 5
        for _ in range(3):
            p = f[p]
        assert p == target


def test_pointer_chasing_is_reproducible_from_the_generator_and_checks_its_input():
    a = lp.tasks.pointer_chasing(8, torch.Generator().manual_seed(0))
    b = lp.tasks.pointer_chasing(8, torch.Generator().manual_seed(0))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(ValueError, match="hops"):
        lp.tasks.pointer_chasing(8, torch.Generator(), hops=0)
    with pytest.raises(TypeError, match="generator"):
        lp.tasks.pointer_chasing(8, 0)
