"""The lr optimum (parabola in log2 lr) and its seed bootstrap, on planted curves."""

import functools
import math

import numpy as np
import pandas as pd
import pytest

from studies.optimum import (
    _curve_vertices,
    classify,
    contrast_interval,
    drift_interval,
    vertex,
    vertex_fixed,
    vertex_quartic,
    vertices,
)

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


# --- batched vertices (issue 29.5) against the per-row functions they replace --------------


def _rows_cases():
    """Rows of seed-mean curves on GRID, each a case the batched fit must treat as per-row."""
    x = np.log2(GRID)
    p = 0.1 * (x + 6.3) ** 2 + 2  # vertex -6.3, argmin index 4 (window 2..6)
    rows = {
        "inside": p,
        "nan_in_window": np.where(np.arange(7) == 5, np.nan, p),  # the window skips index 5
        "nan_next_to_argmin": np.where(np.arange(7) == 3, np.nan, p),
        "left_edge": 0.1 * (x + 9.8) ** 2,  # argmin index 0: window 0..2, vertex inside it
        "right_edge": 0.1 * (x + 4.1) ** 2,  # argmin index 6: window 4..6
        "off_grid_left": 0.1 * (x + 12.0) ** 2,  # vertex left of the window: NaN
        "concave": 1.0 - 0.2 * (x + 7.3) ** 2,  # argmin at the right end, window concave: NaN
        # argmin index 3; with half_width 2 the window 1..5 fits a concave parabola whose
        # vertex is inside it (at x[3]): only the a > 0 check makes it NaN
        "concave_window": np.array([2.0, 0.1, 0.9, 0.0, 0.9, 0.1, 2.0]),
        "two_finite": np.where(np.arange(7) < 5, np.nan, p),
        "all_nan": np.full(7, np.nan),
        "tie": np.array([3.0, 2.0, 1.5, 1.5, 2.0, 3.0, 4.0]),  # first argmin, as np.argmin
    }
    rng = np.random.default_rng(3)
    for k in range(40):  # noisy rows with scattered NaNs: many distinct windows and masks
        y = 0.05 * (x - rng.uniform(-10.5, -3.5)) ** 2 + 0.02 * rng.normal(size=7)
        y[rng.random(7) < 0.15] = np.nan
        rows[f"noisy{k}"] = y
    return x, list(rows), np.array(list(rows.values()))


def _per_row(x, m, estimator):
    return np.array([estimator(x, row) for row in m])


def _one_draw_per_row(m):
    """``_curve_vertices`` arguments whose draw means are exactly the rows of ``m``."""
    return m, np.arange(len(m))[:, None]


@pytest.mark.parametrize("half_width", [1, 2, 3])
def test_batched_argmin_window_vertices_equal_per_row_vertex(half_width):
    x, names, m = _rows_cases()
    got = _curve_vertices(x, *_one_draw_per_row(m), half_width)
    want = _per_row(x, m, lambda a, b: vertex(a, b, half_width))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)  # NaN where NaN
    assert np.isfinite(want).sum() > 20 and np.isnan(want).sum() >= 3  # both kinds occur
    at = dict(zip(names, got, strict=True))
    assert math.isnan(at["concave"]) and math.isnan(at["off_grid_left"])
    assert math.isnan(at["two_finite"]) and math.isnan(at["all_nan"])
    if half_width == 2:
        assert math.isnan(at["concave_window"])
        assert at["inside"] == pytest.approx(-6.3, abs=1e-9)
        assert at["left_edge"] == pytest.approx(-9.8, abs=1e-9)
        assert at["right_edge"] == pytest.approx(-4.1, abs=1e-9)


@pytest.mark.parametrize("centre", [-10.5, -7.2, -6.0, -3.0])  # incl. both ends of the grid
def test_batched_fixed_window_vertices_equal_per_row_vertex_fixed(centre):
    x, _, m = _rows_cases()
    est = functools.partial(vertex_fixed, centre=centre, half_width=2)
    got = _curve_vertices(x, *_one_draw_per_row(m), 2, est)
    np.testing.assert_allclose(got, _per_row(x, m, est), rtol=1e-12, atol=0)
    assert np.isfinite(got).sum() >= 3


def test_batched_quartic_vertices_equal_per_row_vertex_quartic():
    x, names, m = _rows_cases()
    m = np.vstack([m, 0.1 * (np.log2(GRID) + 8.0) ** 4 - 0.3 * np.log2(GRID)])  # a true quartic
    got = _curve_vertices(x, *_one_draw_per_row(m), 2, vertex_quartic)
    want = _per_row(x, m, vertex_quartic)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
    assert np.isfinite(want).sum() > 20 and np.isnan(want).sum() >= 3
    at = dict(zip([*names, "quartic"], got, strict=True))
    assert math.isnan(at["off_grid_left"]) and math.isnan(at["concave"])  # least value at an end
    assert math.isnan(at["two_finite"]) and math.isnan(at["all_nan"])
    assert at["inside"] == pytest.approx(-6.3, abs=1e-9)
    assert at["nan_in_window"] == pytest.approx(-6.3, abs=1e-9)
    assert at["quartic"] == pytest.approx(-8 + 0.75 ** (1 / 3), abs=1e-9)  # 0.4 (x + 8)^3 = 0.3


def test_drift_and_contrast_intervals_equal_their_per_row_estimator_twins():
    # a lambda is not batched: it runs the per-row path, so each pair compares the two paths
    # over bootstrap resamples, with diverged cells and an optimum near the grid's edge
    df = planted({("a", 1): -6.0, ("a", 8): -9.4, ("b", 1): -6.0, ("b", 8): -6.5}, noise=0.03)
    df.loc[df.sample(frac=0.08, random_state=0).index, "loss"] = np.nan
    for est, twin in [
        (None, lambda x, y: vertex(x, y, 2)),
        (vertex_quartic, lambda x, y: vertex_quartic(x, y)),
        (functools.partial(vertex_fixed, centre=-6.2), lambda x, y: vertex_fixed(x, y, -6.2)),
    ]:
        t = drift_interval(df, "arm", n_boot=200, estimator=est)
        u = drift_interval(df, "arm", n_boot=200, estimator=twin)
        cols = ["opt_lo", "opt_hi", "drift", "ci_low", "ci_high", "boot_valid"]
        np.testing.assert_allclose(t[cols].to_numpy(float), u[cols].to_numpy(float), rtol=1e-12)
        c = contrast_interval(df, "arm", "a", "b", n_boot=200, estimator=est)
        d = contrast_interval(df, "arm", "a", "b", n_boot=200, estimator=twin)
        assert c == pytest.approx(d, rel=1e-12, nan_ok=True)
        assert 0.05 < c["boot_valid"] < 0.9  # arm a at N = 8 sits near the edge: many NaNs


def test_batched_path_keeps_the_half_width_error():
    df = planted({("a", 1): -6.0, ("a", 8): -6.0})
    with pytest.raises(ValueError, match="vertex: half_width=0 must be an integer >= 1"):
        drift_interval(df, "arm", n_boot=10, half_width=0)


def test_vertices_is_vertex_row_by_row():
    rng = np.random.default_rng(3)
    x = np.arange(-9.0, -2.0)
    y = (x - rng.uniform(-8.5, -2.5, (40, 1))) ** 2 + rng.normal(0, 0.5, (40, len(x)))
    y[3, 2] = np.nan  # a missing cell, skipped as vertex skips it
    for hw in (1, 2):
        got = vertices(x, y, half_width=hw)
        want = np.array([vertex(x, row, half_width=hw) for row in y])
        np.testing.assert_allclose(got, want, rtol=1e-12, equal_nan=True)
