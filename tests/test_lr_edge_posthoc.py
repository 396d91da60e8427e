"""Issue 39: the LR-edge study's post-hoc analyses on planted cells with known answers.

The relative edge must come from each curve's own best loss (large-N curves planted far above
the unigram floor, where the pre-registered absolute threshold calls every cell failed); the
optimum drift must recover a planted vertex shift per scaling and their contrast.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from studies.lr_edge import analysis as le
from studies.lr_edge import posthoc

GRID = [k / 2 for k in range(-16, 1)]  # log2 lr, half octaves 2^-8 .. 2^0
NS = (1, 2, 4, 8, 16)


def relative_cells(slope: dict, seeds=range(5), rng_seed=0) -> pd.DataFrame:
    """Per (scaling, N, seed) a curve with best loss 2.6 + 0.2 log2 N (N = 16 at 3.4, above
    the floor), 0.05 above it up to the planted edge a + slope log2 N (+ seed jitter on the
    half-octave grid), 0.3 above it beyond."""
    rng = np.random.default_rng(rng_seed)
    rows = []
    for s in seeds:
        for N in NS:
            for sc in ("both",) if N == 1 else le.SCALINGS:
                b = 0.0 if N == 1 else slope[sc]
                t = -3.0 + b * math.log2(N) + 0.5 * int(rng.integers(-1, 2)) + 0.25
                base = 2.6 + 0.2 * math.log2(N)
                for x in GRID:
                    loss = base + (0.3 if x > t else 0.0 if x == -6.0 else 0.05)
                    rows.append({"scaling": sc, "N": N, "lr": 2.0**x, "seed": s,
                                 "loss": loss, "cpu_s": 1.0})  # fmt: skip
    return pd.DataFrame(rows)


def test_relative_edge_recovers_planted_slopes_where_the_floor_threshold_sees_no_edge():
    c = relative_cells({"1/sqrt(N)": -0.5, "1/N": 0.0})
    s = posthoc.relative_edges(c, delta=0.1).set_index("scaling")
    assert s.loc["1/sqrt(N)", "slope"] == pytest.approx(-0.5, abs=0.15)
    assert s.loc["1/N", "slope"] == pytest.approx(0.0, abs=0.15)
    assert (s["n_seeds"] == 5).all() and (s["censored"] == 0).all()
    assert s.loc["1/sqrt(N)", "ci_high"] < 0 < s.loc["1/N", "ci_high"]
    absolute = le.slopes(le.edges(c, floor=3.11)).set_index("scaling")
    assert (absolute["n_seeds"] < 5).all()  # the pre-registered threshold cannot see them


def test_relative_edge_threshold_moves_the_edge_and_bad_delta_is_refused():
    c = relative_cells({"1/sqrt(N)": -0.5, "1/N": 0.0})
    # delta 0.4 > every planted excess: no failure above the best, every edge censored
    assert (posthoc.relative_edges(c, delta=0.4)["n_seeds"] == 0).all()
    with pytest.raises(ValueError, match="delta=0 must be > 0"):
        posthoc.relative_edges(c, delta=0)


def drift_cells(vertex: dict, seeds=range(6), rng_seed=1) -> pd.DataFrame:
    """Parabolas 2.5 + 0.05 (log2 lr - v)^2 with v = -5 at N = 1 (shared) and -5 + vertex[sc]
    at N = 8, small per-seed noise; the octave grid 2^-10 .. 2^0."""
    rng = np.random.default_rng(rng_seed)
    rows = []
    for s in seeds:
        for N in (1, 8):
            for sc in ("both",) if N == 1 else le.SCALINGS:
                v = -5.0 + (0.0 if N == 1 else vertex[sc])
                for x in range(-10, 1):
                    loss = 2.5 + 0.05 * (x - v) ** 2 + 0.002 * rng.normal()
                    rows.append({"scaling": sc, "N": N, "lr": 2.0**x, "seed": s,
                                 "loss": loss})  # fmt: skip
    return pd.DataFrame(rows)


def test_optimum_drift_recovers_planted_shifts_and_their_contrast():
    t = posthoc.optimum_drift(drift_cells({"1/sqrt(N)": 1.5, "1/N": 0.0}), hi=8, n_boot=300)
    t = t.set_index("scaling")
    assert t.loc["1/sqrt(N)", "drift"] == pytest.approx(1.5, abs=0.1)
    assert t.loc["1/N", "drift"] == pytest.approx(0.0, abs=0.1)
    assert t.loc["contrast", "drift"] == pytest.approx(1.5, abs=0.1)
    assert t.loc["contrast", "ci_low"] > 1.0
    assert t.loc["1/N", "ci_low"] < 0 < t.loc["1/N", "ci_high"]


def test_common_grid_keeps_only_rates_every_seed_ran():
    c = drift_cells({"1/sqrt(N)": 0.0, "1/N": 0.0}, seeds=range(2))
    extra = c.iloc[[0]].assign(lr=2.0**-0.5)  # a refinement one seed ran
    g = posthoc.common_grid(pd.concat([c, extra], ignore_index=True))
    assert 2.0**-0.5 not in set(g["lr"])
    assert len(g) == len(c) + len(c[c["N"] == 1])  # the N = 1 cells count for both
