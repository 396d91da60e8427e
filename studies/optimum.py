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
happens in 5 of the 6 committed drift cells
(``studies/lr_transfer/lr_transfer_drift*.csv``, 0.7 % to 6.9 % of resamples), so the
interval here is over the resamples that have a vertex, and
their fraction is reported (``boot_valid``).

Example::

    table = drift_interval(df, group="arm", lo=1, hi=8)       # df: arm, N, lr, seed, loss
    table["verdict"] = [classify(a, b, 0.75) for a, b in zip(table.ci_low, table.ci_high)]
    c = contrast_interval(df, "arm", "1/sqrt(N)", "1/N")   # drift(a) - drift(b), paired
    q = contrast_interval(df, "arm", "1/sqrt(N)", "1/N", estimator=vertex_quartic)
    gap = best_loss_gap(df, "arm", ("1/sqrt(N)", 8), ("1/N", 8))   # nats, paired

Other vertex estimators (issue 27: the verdict must not hinge on one): ``vertex_quartic``
(a quartic in log2 lr over every rate: no argmin-chosen window) and ``vertex_fixed`` (a
parabola over a window fixed in advance, the same for every resample and curve, so a
resample's argmin cannot move it). Any ``estimator(log2_lr, loss) -> float`` can be passed.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd

__all__ = [
    "best_loss_gap",
    "classify",
    "contrast_interval",
    "drift_interval",
    "seed_matrix",
    "vertex",
    "vertices",
    "vertex_fixed",
    "vertex_quartic",
]


def vertex(log2_lr: Sequence[float], loss: Sequence[float], half_width: int = 2) -> float:
    """log2 lr of the vertex of the parabola through the argmin and its grid neighbours.

    ``log2_lr`` increasing; non-finite losses are dropped first. NaN when fewer than three
    points remain in the window, the parabola is not convex, or the vertex falls outside
    the window (an extrapolated optimum is not a measurement).
    """
    x, y = _curve(log2_lr, loss, half_width, "vertex")
    ok = np.isfinite(y)
    x, y = x[ok], y[ok]
    if len(x) < 3:
        return math.nan
    return _window_vertex(x, y, int(np.argmin(y)), half_width)


def vertices(log2_lr: Sequence[float], losses: np.ndarray, half_width: int = 2) -> np.ndarray:
    """:func:`vertex` of every row of ``losses`` (``(rows, n_lr)``), batched: the rows that
    fit the same points share one least-squares solve."""
    y = np.asarray(losses, dtype=float)
    _curve(log2_lr, y[0], half_width, "vertices")
    return _parabola_vertices(np.asarray(log2_lr, dtype=float), y, _argmin_windows(y, half_width))


def _curve(log2_lr, loss, half_width: int, call: str) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(log2_lr, dtype=float)
    y = np.asarray(loss, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"{call}: log2_lr {x.shape} and loss {y.shape} must be equal 1-d shapes")
    if not isinstance(half_width, int) or half_width < 1:
        raise ValueError(f"{call}: half_width={half_width!r} must be an integer >= 1")
    return x, y


def _window_vertex(x: np.ndarray, y: np.ndarray, i: int, half_width: int) -> float:
    """The vertex of the parabola through the finite points within ``half_width`` of index
    ``i``; NaN when fewer than three, not convex, or the vertex leaves the window."""
    lo, hi = max(0, i - half_width), min(len(x), i + half_width + 1)
    xs, ys = x[lo:hi], y[lo:hi]
    ok = np.isfinite(ys)
    xs, ys = xs[ok], ys[ok]
    if len(xs) < 3:
        return math.nan
    a, b, _ = np.polyfit(xs, ys, 2)
    if not a > 0:
        return math.nan
    v = -b / (2 * a)
    return float(v) if xs[0] <= v <= xs[-1] else math.nan


def vertex_quartic(log2_lr: Sequence[float], loss: Sequence[float]) -> float:
    """log2 lr of the minimum of a quartic fitted by least squares to every finite point.

    No window is chosen from the argmin, so a noisy argmin cannot move it. NaN when fewer
    than six points remain (a quartic through five is an interpolation), or when the
    quartic's least value over the grid's range is at an end (the optimum is not inside the
    grid: an extrapolated optimum is not a measurement).
    """
    x, y = _finite(log2_lr, loss, "vertex_quartic")
    if len(x) < 6:
        return math.nan
    c = np.polyfit(x, y, 4)
    r = np.roots(np.polyder(c))
    r = r.real[(np.abs(r.imag) < 1e-9) & (r.real > x[0]) & (r.real < x[-1])]
    if not len(r):
        return math.nan
    best = r[np.argmin(np.polyval(c, r))]
    return float(best) if np.polyval(c, best) < np.polyval(c, [x[0], x[-1]]).min() else math.nan


def vertex_fixed(
    log2_lr: Sequence[float], loss: Sequence[float], centre: float, half_width: int = 2
) -> float:
    """log2 lr of the vertex of a parabola through the grid point nearest ``centre`` (ties:
    the lower rate) and up to ``half_width`` grid points each side: the window is fixed by
    the caller, not by this curve's argmin. NaN as :func:`vertex` (fewer than three finite
    points in the window, not convex, vertex outside the window)."""
    x, y = _curve(log2_lr, loss, half_width, "vertex_fixed")
    return _window_vertex(x, y, int(np.argmin(np.abs(x - centre))), half_width)


def _finite(log2_lr, loss, call: str) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(log2_lr, dtype=float)
    y = np.asarray(loss, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"{call}: log2_lr {x.shape} and loss {y.shape} must be equal 1-d shapes")
    ok = np.isfinite(y)
    return x[ok], y[ok]


def seed_matrix(frame: pd.DataFrame, seeds: Sequence) -> tuple[np.ndarray, np.ndarray]:
    """``(log2 lr grid, losses[seed, lr])`` of one curve; missing or diverged cells are NaN."""
    wide = frame.pivot_table(index="seed", columns="lr", values="loss", aggfunc="mean")
    wide = wide.reindex(index=list(seeds)).sort_index(axis=1)
    return np.log2(wide.columns.to_numpy(dtype=float)), wide.to_numpy(dtype=float)


def _draw_means(m: np.ndarray, draws: np.ndarray) -> np.ndarray:
    with warnings.catch_warnings():  # an lr column with no finite seed: mean NaN, dropped
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(m[draws], axis=1)  # (n_draws, n_lr)


def _curve_vertices(x: np.ndarray, m: np.ndarray, draws: np.ndarray, half_width: int,
                    estimator: Callable | None = None):  # fmt: skip
    """The vertex of each draw's seed-mean curve, as ``estimator`` (default :func:`vertex`)
    row by row would give it. :func:`vertex`, :func:`vertex_quartic` and
    ``functools.partial(vertex_fixed, centre=..., half_width=...)`` are batched: the rows that
    fit the same points share one least-squares solve (issue 29.5: the report made ~88 k tiny
    polyfits); any other estimator runs per row."""
    means = _draw_means(m, draws)
    if estimator is None:
        _curve(x, means[0], half_width, "vertex")
        return _parabola_vertices(x, means, _argmin_windows(means, half_width))
    if estimator is vertex_quartic:
        _finite(x, means[0], "vertex_quartic")
        return _quartic_vertices(x, means)
    if _is_fixed(estimator):
        hw = estimator.keywords.get("half_width", 2)
        _curve(x, means[0], hw, "vertex_fixed")
        i = int(np.argmin(np.abs(x - estimator.keywords["centre"])))
        k = np.arange(len(x))
        return _parabola_vertices(x, means, np.isfinite(means) & (abs(k - i) <= hw)[None, :])
    return np.array([estimator(x, row) for row in means])


def _is_fixed(estimator) -> bool:
    return (isinstance(estimator, functools.partial) and estimator.func is vertex_fixed
            and not estimator.args and "centre" in estimator.keywords
            and set(estimator.keywords) <= {"centre", "half_width"})  # fmt: skip


def _argmin_windows(y: np.ndarray, half_width: int) -> np.ndarray:
    """Per row of ``y``: the mask of the points :func:`vertex` fits, the argmin of the finite
    points and up to ``half_width`` finite points on each side (NaNs are skipped, not
    counted)."""
    ok = np.isfinite(y)
    rank = np.cumsum(ok, axis=1) - 1  # index among the row's finite points
    i = rank[np.arange(len(y)), np.argmin(np.where(ok, y, np.inf), axis=1)]
    lo = np.maximum(0, i - half_width)[:, None]
    hi = np.minimum(ok.sum(axis=1), i + half_width + 1)[:, None]
    return ok & (rank >= lo) & (rank < hi)


def _groups(w: np.ndarray):
    """``(mask, rows)`` for each distinct row of the boolean matrix ``w``."""
    keys, inverse = np.unique(w, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    return [(k, np.flatnonzero(inverse == g)) for g, k in enumerate(keys)]


def _parabola_vertices(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Per row: the vertex of the parabola through ``(x[w], y[w])`` (NaN as in
    ``_window_vertex``), one ``np.polyfit`` (the same column scaling) per distinct window."""
    out = np.full(len(y), math.nan)
    for k, rows in _groups(w):
        xs = x[k]
        if len(xs) < 3:
            continue
        a, b, _ = np.polyfit(xs, y[np.ix_(rows, np.flatnonzero(k))].T, 2)
        with np.errstate(divide="ignore", invalid="ignore"):
            v = -b / (2 * a)
        ok = (a > 0) & (xs[0] <= v) & (v <= xs[-1])
        out[rows[ok]] = v[ok]
    return out


def _quartic_vertices(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """:func:`vertex_quartic` of each row of ``y``: one quartic fit per finite mask, the
    cubic's roots as eigenvalues of stacked companion matrices (as ``np.roots``)."""
    out = np.full(len(y), math.nan)
    for k, rows in _groups(np.isfinite(y)):
        xf = x[k]
        if len(xf) < 6:
            continue
        c = np.polyfit(xf, y[np.ix_(rows, np.flatnonzero(k))].T, 4)  # (5, rows)
        d = c[:-1] * np.arange(4, 0, -1)[:, None]  # np.polyder, one column per row
        r = np.full((len(rows), 3), math.nan, dtype=complex)
        gen = (d[0] != 0) & (d[-1] != 0)  # np.roots strips zero end coefficients
        comp = np.zeros((int(gen.sum()), 3, 3))
        comp[:, 0, :] = (-d[1:, gen] / d[0, gen]).T
        comp[:, 1, 0] = comp[:, 2, 1] = 1.0
        r[gen] = np.linalg.eigvals(comp) if len(comp) else r[gen]
        for j in np.flatnonzero(~gen):
            rj = np.roots(d[:, j])
            r[j, : len(rj)] = rj
        rr = r.real
        with np.errstate(invalid="ignore"):
            ok = (np.abs(r.imag) < 1e-9) & (rr > xf[0]) & (rr < xf[-1])
        f = _horner(c, rr)
        j = np.argmin(np.where(ok, f, np.inf), axis=1)
        n = np.arange(len(rows))
        ends = np.minimum(
            _horner(c, np.full(len(rows), xf[0])), _horner(c, np.full(len(rows), xf[-1]))
        )
        keep = ok.any(axis=1) & (f[n, j] < ends)
        out[rows[keep]] = rr[n, j][keep]
    return out


def _horner(c: np.ndarray, t: np.ndarray) -> np.ndarray:
    """``np.polyval(c[:, n], t[n])`` for every column ``n`` of ``c`` (the same operations)."""
    y = np.zeros_like(t)
    for cv in c:
        y = y * t + (cv[:, None] if t.ndim == 2 else cv)
    return y


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


def _vertices(sub, group, level_value, seeds, draws, Ns, half_width,
              estimator=None) -> dict[int, np.ndarray]:  # fmt: skip
    """Per N: the vertex of one group level's seed-mean curve, per draw."""
    g = sub[sub[group] == level_value]
    out = {}
    for N in Ns:
        x, m = seed_matrix(g[g["N"] == N], seeds)
        out[N] = _curve_vertices(x, m, draws, half_width, estimator)
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
    estimator: Callable[[np.ndarray, np.ndarray], float] | None = None,
) -> pd.DataFrame:
    """Per ``group``: optimum at N = lo and N = hi, drift in octaves and its bootstrap interval.

    ``frame`` has columns ``group, N, lr, seed, loss`` (a diverged cell: loss NaN). Seeds
    are those present in every curve. Columns: ``group, seeds, opt_lo, opt_hi`` (log2 lr),
    ``drift``, ``ci_low``, ``ci_high``, ``boot_valid`` (fraction of resamples where both
    vertices exist; the interval is over those). ``estimator(log2_lr, loss)`` replaces
    :func:`vertex` (``half_width`` is then unused).
    """
    sub, seeds, draws = _draws(frame, group, (lo, hi), n_boot, seed, level, "drift_interval")
    rows = []
    for level_value in sub[group].unique():
        v = _vertices(sub, group, level_value, seeds, draws, (lo, hi), half_width, estimator)
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
    estimator: Callable[[np.ndarray, np.ndarray], float] | None = None,
) -> dict[str, float]:
    """``drift(a) - drift(b)`` in octaves with one paired seed bootstrap (the same resample
    for both levels of ``group``): ``{"contrast", "ci_low", "ci_high", "boot_valid", "seeds"}``.
    ``estimator(log2_lr, loss)`` replaces :func:`vertex` (e.g. :func:`vertex_quartic`)."""
    frame = frame[frame[group].isin([a, b])] if group in frame else frame
    sub, seeds, draws = _draws(frame, group, (lo, hi), n_boot, seed, level, "contrast_interval")
    v = [_vertices(sub, group, x, seeds, draws, (lo, hi), half_width, estimator) for x in (a, b)]
    c = (v[0][hi] - v[0][lo]) - (v[1][hi] - v[1][lo])
    ci_low, ci_high, valid = _interval(c, n_boot, level)
    return {"contrast": float(c[0]), "ci_low": ci_low, "ci_high": ci_high,
            "boot_valid": valid, "seeds": len(seeds)}  # fmt: skip


def best_loss_gap(
    frame: pd.DataFrame,
    group: str,
    a: tuple[Any, int],
    b: tuple[Any, int],
    *,
    n_boot: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> dict[str, float]:
    """``best(a) - best(b)`` in nats, ``a`` and ``b`` being ``(group level, N)`` curves.

    The *loss at the optimum* of a curve is the least seed-mean loss over its lr grid (each
    rule at its own best grid rate; no fitted vertex, so no estimator choice). The interval
    is a percentile bootstrap over seeds, the same resample for both curves (paired):
    ``{"gap", "ci_low", "ci_high", "best_a", "best_b", "lr_a", "lr_b", "seeds"}`` (``lr_*``:
    the sample's best grid rate). Bias: a minimum over a noisy grid sits a little below the
    curve's true minimum, by about the same for both curves when their noise is alike.
    """
    frame = frame[frame[group].isin([a[0], b[0]])] if group in frame else frame
    if not 0 < level < 1:
        raise ValueError(f"best_loss_gap: level={level!r} must lie in (0, 1)")
    need = {group, "N", "lr", "seed", "loss"}
    if missing := need - set(frame.columns):
        raise ValueError(f"best_loss_gap: frame lacks columns {sorted(missing)}")
    curves = [frame[(frame[group] == g) & (frame["N"] == n)] for g, n in (a, b)]
    if empty := [x for x, c in zip((a, b), curves, strict=True) if c.empty]:
        raise ValueError(f"best_loss_gap: no rows for {empty}")
    seeds = sorted(set(curves[0]["seed"]) & set(curves[1]["seed"]))
    S = len(seeds)
    rng = np.random.default_rng(seed)
    draws = np.vstack([np.arange(S)[None, :], rng.integers(0, S, size=(n_boot, S))])
    best, where = [], []
    for c in curves:
        x, m = seed_matrix(c, seeds)
        means = _draw_means(m, draws)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            best.append(np.nanmin(means, axis=1))
        where.append(float(2 ** x[int(np.nanargmin(means[0]))]))
    g = best[0] - best[1]
    lo, hi, _ = _interval(g, n_boot, level)
    return {"gap": float(g[0]), "ci_low": lo, "ci_high": hi, "best_a": float(best[0][0]),
            "best_b": float(best[1][0]), "lr_a": where[0], "lr_b": where[1],
            "seeds": S}  # fmt: skip


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
