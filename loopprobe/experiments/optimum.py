"""The optimal learning rate of a loss curve: a parabola in log2(lr), bootstrapped over seeds.

The optimum of one curve is the vertex of a parabola fitted by least squares to the
seed-mean loss against ``log2(lr)`` at the grid argmin and up to ``half_width`` grid points
on each side. The *drift* of a rule is ``vertex(N = hi) - vertex(N = lo)`` in octaves; its
interval is a percentile bootstrap over seeds, the same resample for every rule and N
(seeds are paired: seed s means the same init stream and data order in every cell).
Reference: issue 17 (the Loop-muP learning-rate-transfer claim, seed 004).

Why not ``scipy.stats.bootstrap(..., paired=True, method="percentile")``: it draws the very
same resamples (``default_rng(seed).integers(0, S, (n_boot, S))``) and gives the same
interval when every resample has a vertex (tested), but it has no NaN policy: a resample
whose parabola is not convex or whose vertex leaves the window makes its interval NaN. That
happens in 5 of the 6 committed drift cells (``docs/data/lr_transfer_drift*.csv``, 0.7 % to
6.9 % of resamples), so the interval here is over the resamples that have a vertex, and
their fraction is reported (``boot_valid``).

Example::

    table = drift_interval(df, group="arm", lo=1, hi=8)       # df: arm, N, lr, seed, loss
    table["verdict"] = [classify(a, b, 0.75) for a, b in zip(table.ci_low, table.ci_high)]
    c = contrast_interval(df, "arm", "1/sqrt(N)", "1/N")   # drift(a) - drift(b), paired
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["classify", "contrast_interval", "drift_interval", "seed_matrix", "vertex"]


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


def _draws(frame: pd.DataFrame, group: str, Ns: Sequence[int], n_boot: int, seed: int,
           level: float, call: str):  # fmt: skip
    """Seeds present in every (group, N) curve, and the bootstrap draws over them (row 0:
    the sample itself); checks the frame and the level first."""
    if not 0 < level < 1:
        raise ValueError(f"{call}: level={level!r} must lie in (0, 1)")
    need = {group, "N", "lr", "seed", "loss"}
    if missing := need - set(frame.columns):
        raise ValueError(f"{call}: frame lacks columns {sorted(missing)}")
    sub = frame[frame["N"].isin(Ns)]
    curves = sub.groupby([group, "N"])
    if len(curves) == 0:
        raise ValueError(f"{call}: no rows with N in {list(Ns)}")
    seeds = sorted(set.intersection(*(set(g["seed"]) for _, g in curves)))
    rng = np.random.default_rng(seed)
    S = len(seeds)
    draws = np.vstack([np.arange(S)[None, :], rng.integers(0, S, size=(n_boot, S))])
    return sub, seeds, draws


def _vertices(sub, group, level_value, seeds, draws, Ns, half_width) -> dict[int, np.ndarray]:
    """Per N: the vertex of one group level's seed-mean curve, per draw."""
    g = sub[sub[group] == level_value]
    out = {}
    for N in Ns:
        x, m = seed_matrix(g[g["N"] == N], seeds)
        out[N] = _curve_vertices(x, m, draws, half_width)
    return out


def _interval(d: np.ndarray, n_boot: int, level: float) -> tuple[float, float, float]:
    boot = d[1:][np.isfinite(d[1:])]
    q = (1 - level) / 2
    lo, hi = np.quantile(boot, [q, 1 - q]) if len(boot) else (math.nan, math.nan)
    return float(lo), float(hi), len(boot) / n_boot


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
    sub, seeds, draws = _draws(frame, group, (lo, hi), n_boot, seed, level, "drift_interval")
    rows = []
    for level_value in sub[group].unique():
        v = _vertices(sub, group, level_value, seeds, draws, (lo, hi), half_width)
        d = v[hi] - v[lo]
        ci_low, ci_high, valid = _interval(d, n_boot, level)
        rows.append({group: level_value, "seeds": len(seeds), "opt_lo": v[lo][0],
                     "opt_hi": v[hi][0], "drift": d[0], "ci_low": ci_low, "ci_high": ci_high,
                     "boot_valid": valid})  # fmt: skip
    return pd.DataFrame(rows)


def contrast_interval(
    frame: pd.DataFrame,
    group: str,
    a: Any,
    b: Any,
    lo: int = 1,
    hi: int = 8,
    *,
    n_boot: int = 2000,
    level: float = 0.95,
    half_width: int = 2,
    seed: int = 0,
) -> dict[str, float]:
    """``drift(a) - drift(b)`` in octaves with one paired seed bootstrap (the same resample
    for both levels of ``group``): ``{"contrast", "ci_low", "ci_high", "boot_valid", "seeds"}``."""
    frame = frame[frame[group].isin([a, b])] if group in frame else frame
    sub, seeds, draws = _draws(frame, group, (lo, hi), n_boot, seed, level, "contrast_interval")
    v = [_vertices(sub, group, x, seeds, draws, (lo, hi), half_width) for x in (a, b)]
    c = (v[0][hi] - v[0][lo]) - (v[1][hi] - v[1][lo])
    ci_low, ci_high, valid = _interval(c, n_boot, level)
    return {"contrast": float(c[0]), "ci_low": ci_low, "ci_high": ci_high,
            "boot_valid": valid, "seeds": len(seeds)}  # fmt: skip


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
