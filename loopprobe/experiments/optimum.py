"""The optimal learning rate of a loss curve: a parabola in log2(lr), bootstrapped over seeds.

The optimum of one curve is the vertex of a parabola fitted by least squares to the
seed-mean loss against ``log2(lr)`` at the grid argmin and up to ``half_width`` grid points
on each side. The *drift* of a rule is ``vertex(N = hi) - vertex(N = lo)`` in octaves; its
interval is a percentile bootstrap over seeds, the same resample for every rule and N
(seeds are paired: seed s means the same init stream and data order in every cell).
Reference: issue 17 (the Loop-muP learning-rate-transfer claim, seed 004).

Example::

    table = drift_interval(df, group="arm", lo=1, hi=8)       # df: arm, N, lr, seed, loss
    table["verdict"] = [classify(a, b, 0.75) for a, b in zip(table.ci_low, table.ci_high)]
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np
import pandas as pd

__all__ = ["classify", "drift_interval", "seed_matrix", "vertex"]


def vertex(log2_lr: Sequence[float], loss: Sequence[float], half_width: int = 2) -> float:
    """log2 lr of the vertex of the parabola through the argmin and its grid neighbours.

    ``log2_lr`` increasing; non-finite losses are dropped first. NaN when fewer than three
    points remain in the window, the parabola is not convex, or the vertex falls outside
    the window (an extrapolated optimum is not a measurement).
    """
    x = np.asarray(log2_lr, dtype=float)
    y = np.asarray(loss, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"vertex: log2_lr {x.shape} and loss {y.shape} must be equal 1-d shapes")
    if not isinstance(half_width, int) or half_width < 1:
        raise ValueError(f"vertex: half_width={half_width!r} must be an integer >= 1")
    ok = np.isfinite(y)
    x, y = x[ok], y[ok]
    if len(x) < 3:
        return math.nan
    i = int(np.argmin(y))
    lo, hi = max(0, i - half_width), min(len(x), i + half_width + 1)
    xs, ys = x[lo:hi], y[lo:hi]
    if len(xs) < 3:
        return math.nan
    a, b, _ = np.polyfit(xs, ys, 2)
    if not a > 0:
        return math.nan
    v = -b / (2 * a)
    return float(v) if xs[0] <= v <= xs[-1] else math.nan


def seed_matrix(frame: pd.DataFrame, seeds: Sequence) -> tuple[np.ndarray, np.ndarray]:
    """``(log2 lr grid, losses[seed, lr])`` of one curve; missing or diverged cells are NaN."""
    wide = frame.pivot_table(index="seed", columns="lr", values="loss", aggfunc="mean")
    wide = wide.reindex(index=list(seeds)).sort_index(axis=1)
    return np.log2(wide.columns.to_numpy(dtype=float)), wide.to_numpy(dtype=float)


def _curve_vertices(x: np.ndarray, m: np.ndarray, draws: np.ndarray, half_width: int):
    with warnings.catch_warnings():  # an lr column with no finite seed: mean NaN, dropped
        warnings.simplefilter("ignore", RuntimeWarning)
        means = np.nanmean(m[draws], axis=1)  # (n_draws, n_lr)
    return np.array([vertex(x, row, half_width) for row in means])


def drift_interval(
    frame: pd.DataFrame,
    group: str = "arm",
    lo: int = 1,
    hi: int = 8,
    *,
    n_boot: int = 2000,
    level: float = 0.95,
    half_width: int = 2,
    seed: int = 0,
) -> pd.DataFrame:
    """Per ``group``: optimum at N = lo and N = hi, drift in octaves and its bootstrap interval.

    ``frame`` has columns ``group, N, lr, seed, loss`` (a diverged cell: loss NaN). Seeds
    are those present in every curve. Columns: ``group, seeds, opt_lo, opt_hi`` (log2 lr),
    ``drift``, ``ci_low``, ``ci_high``, ``boot_valid`` (fraction of resamples where both
    vertices exist; the interval is over those).
    """
    need = {group, "N", "lr", "seed", "loss"}
    if missing := need - set(frame.columns):
        raise ValueError(f"drift_interval: frame lacks columns {sorted(missing)}")
    if not 0 < level < 1:
        raise ValueError(f"drift_interval: level={level!r} must lie in (0, 1)")
    sub = frame[frame["N"].isin([lo, hi])]
    curves = sub.groupby([group, "N"])
    if len(curves) == 0:
        raise ValueError(f"drift_interval: no rows with N in {[lo, hi]}")
    seeds = sorted(set.intersection(*(set(g["seed"]) for _, g in curves)))
    rng = np.random.default_rng(seed)
    S = len(seeds)
    draws = np.vstack([np.arange(S)[None, :], rng.integers(0, S, size=(n_boot, S))])
    rows = []
    for level_value, g in sub.groupby(group, sort=False):
        v = {}
        for N in (lo, hi):
            x, m = seed_matrix(g[g["N"] == N], seeds)
            v[N] = _curve_vertices(x, m, draws, half_width)
        d = v[hi] - v[lo]
        boot = d[1:][np.isfinite(d[1:])]
        q = (1 - level) / 2
        ci = np.quantile(boot, [q, 1 - q]) if len(boot) else (math.nan, math.nan)
        rows.append({group: level_value, "seeds": S, "opt_lo": v[lo][0], "opt_hi": v[hi][0],
                     "drift": d[0], "ci_low": float(ci[0]), "ci_high": float(ci[1]),
                     "boot_valid": len(boot) / n_boot})  # fmt: skip
    return pd.DataFrame(rows)


def classify(ci_low: float, ci_high: float, margin: float) -> str:
    """``stays`` (interval inside (-margin, margin)), ``drifts`` (entirely outside) or
    ``undecided``."""
    if not (math.isfinite(ci_low) and math.isfinite(ci_high)):
        return "undecided"
    if -margin < ci_low and ci_high < margin:
        return "stays"
    if ci_high <= -margin or ci_low >= margin:
        return "drifts"
    return "undecided"
