"""The lr optimum (parabola in log2 lr) and its seed bootstrap, on planted curves."""

import math

import numpy as np
import pandas as pd
import pytest

from loopprobe.experiments.optimum import classify, drift_interval, vertex

GRID = [1e-3 * 2**k for k in range(7)]  # log2: -9.97 .. -3.97


def planted(opt: dict, seeds=range(6), noise=0.0, a=0.05, seed_shift=None, rng_seed=0):
    """Rows arm, N, lr, seed, loss = a (log2 lr - opt)^2 + per-seed level + noise."""
    rng = np.random.default_rng(rng_seed)
    rows = []
    for (arm, N), o in opt.items():
        for s in seeds:
            shift = 0.0 if seed_shift is None else seed_shift[s]
            level = 3.0 + 0.5 * s  # a per-seed level offset moves no vertex
            for lr in GRID:
                x = math.log2(lr)
                loss = a * (x - o - shift) ** 2 + level + noise * rng.normal()
                rows.append({"arm": arm, "N": N, "lr": lr, "seed": s, "loss": loss})
    return pd.DataFrame(rows)


def test_vertex_of_an_exact_parabola_is_its_minimum_between_grid_points():
    x = np.log2(GRID)
    assert vertex(x, 0.1 * (x + 6.3) ** 2 + 2) == pytest.approx(-6.3, abs=1e-9)


def test_vertex_uses_only_the_window_around_the_argmin():
    x = np.log2(GRID)
    y = 0.1 * (x + 6.3) ** 2
    y[0] += 10.0  # a point outside the window (argmin index 4, window 2..6) must not matter
    assert vertex(x, y, half_width=2) == pytest.approx(-6.3, abs=1e-9)


def test_vertex_is_nan_for_a_concave_or_edge_extrapolated_curve():
    x = np.log2(GRID)
    assert math.isnan(vertex(x, -((x + 6.3) ** 2)))
    assert math.isnan(vertex(x, (x + 12.0) ** 2))  # optimum left of the grid: no extrapolation


def test_vertex_drops_diverged_points():
    x = np.log2(GRID)
    y = 0.1 * (x + 6.3) ** 2
    y[-1] = np.nan
    assert vertex(x, y) == pytest.approx(-6.3, abs=1e-9)


def test_planted_drift_of_minus_one_and_a_half_octaves_is_recovered_and_called_a_drift():
    df = planted({("a", 1): -6.0, ("a", 8): -7.5, ("b", 1): -6.0, ("b", 8): -6.0}, noise=0.01)
    t = drift_interval(df, "arm", n_boot=400).set_index("arm")
    assert t.loc["a", "drift"] == pytest.approx(-1.5, abs=0.15)
    assert t.loc["a", "ci_low"] <= -1.5 <= t.loc["a", "ci_high"]
    assert classify(t.loc["a", "ci_low"], t.loc["a", "ci_high"], 0.75) == "drifts"
    assert abs(t.loc["b", "drift"]) < 0.15
    assert classify(t.loc["b", "ci_low"], t.loc["b", "ci_high"], 0.75) == "stays"


def test_bootstrap_pairs_seeds_across_loop_counts():
    # each seed moves its optimum by the same amount at N=1 and N=8: paired, the drift is 0 in
    # every resample (an unpaired bootstrap would give a wide interval)
    shifts = {s: 0.4 * (s - 2.5) for s in range(6)}
    df = planted({("a", 1): -6.0, ("a", 8): -6.0}, seed_shift=shifts)
    t = drift_interval(df, "arm", n_boot=300).iloc[0]
    assert abs(t["ci_low"]) < 1e-6 and abs(t["ci_high"]) < 1e-6


def test_interval_widens_with_noise_and_narrows_with_seeds():
    opt = {("a", 1): -6.0, ("a", 8): -6.0}
    w = {}
    for n in (3, 12):
        t = drift_interval(planted(opt, seeds=range(n), noise=0.05), "arm", n_boot=400).iloc[0]
        w[n] = t["ci_high"] - t["ci_low"]
    assert w[12] < w[3]


def test_classify_needs_the_whole_interval_on_one_side_of_the_margin():
    assert classify(-0.5, 0.5, 0.75) == "stays"
    assert classify(-2.0, -0.8, 0.75) == "drifts"
    assert classify(-1.2, -0.3, 0.75) == "undecided"
    assert classify(math.nan, 0.1, 0.75) == "undecided"


def test_drift_interval_names_missing_columns():
    with pytest.raises(ValueError, match="drift_interval: frame lacks columns"):
        drift_interval(pd.DataFrame({"arm": [1], "N": [1]}))
