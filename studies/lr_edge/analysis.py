"""The edge learning rate against loop count (issue 30.2): edges, slopes, verdict.

The training runs live in ``studies/lr_edge/run.py`` (CPU time, outside CI); its cells (one row
per scaling, N, lr, seed) are committed as ``studies/lr_edge/lr_edge_study.csv``. This module
holds only the analysis and the criteria pre-registered in ``docs/studies/lr_edge.md``
(committed before the study ran).

Theory (seed 004, Theorem 2): for h <- h + eps f(h) looped N times with Adam-like updates,
``d^-1/2 ||Delta h_N|| <= C eta eps N``, so eta eps N = O(1) suffices for stability and the edge
learning rate scales as ``eta_edge ~ N^(alpha - 1)`` with eps = N^-alpha: slope -1/2 of
log2 eta_edge on log2 N under ``1/sqrt(N)``, slope 0 under ``1/N``.

- A cell *failed* when its held-out loss is not finite or is at least ``floor - MARGIN``
  (it collapsed to, or never left, the unigram floor).
- Edge of one (scaling, N, seed): on the lr grid, the best lr is the one with the lowest
  held-out loss; the edge is bracketed by the smallest failing lr above the best and the grid
  lr just below it (stable), and estimated by their geometric midpoint. No failure above the
  best: right-censored (no edge, counted in ``censored``).
- Slope per scaling: per seed with an uncensored edge at every N, the least-squares slope of
  log2 edge on log2 N; the estimate is their mean, the interval the two-sided 95 % t interval
  over seeds, its sd at least the grid's resolution (each edge uniform in its bracket).
  Secondary (decides nothing): a pooled fit's seed bootstrap with in-bracket draws.
- Verdict: *holds* if the 1/sqrt(N) interval contains -1/2 and excludes 0 and the 1/N interval
  contains 0 and excludes -1/2; *fails* if the 1/sqrt(N) interval excludes -1/2 or the 1/N
  interval excludes 0; *undecided* otherwise, or when a scaling has fewer than ``MIN_SEEDS``
  seeds with an edge at every N.

Example::

    cells = pd.read_csv("studies/lr_edge/lr_edge_study.csv")
    e = edges(cells)             # scaling, N, seed, log2_edge, lo, hi, censored, ...
    s = slopes(e)                # scaling, slope, ci_low, ci_high, n_seeds, ...
    verdict(e, s)                # ("holds" | "fails" | "undecided", reason)
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from scipy import stats

__all__ = [
    "MARGIN", "MIN_SEEDS", "PREDICTED", "SCALINGS", "edge_table", "edges", "failed", "figure",
    "resolution_sd", "seed_slopes", "slopes", "summary_markdown", "task_figure", "task_table",
    "verdict",
]  # fmt: skip

SCALINGS = ("1/sqrt(N)", "1/N")
PREDICTED = {"1/sqrt(N)": -0.5, "1/N": 0.0}  # slope of log2 eta_edge on log2 N (alpha - 1)
#: Pre-registered (docs/studies/lr_edge.md)
MARGIN = 0.1  # nats below the unigram floor that a stable run must reach
MIN_SEEDS = 4
LEVEL = 0.95
N_BOOT = 4000


def _floor(floor: float | None) -> float:
    if floor is not None:
        return float(floor)
    from studies.deeploop.analysis import unigram_floor

    return unigram_floor()


def _expand(cells: pd.DataFrame) -> pd.DataFrame:
    """The N = 1 cells (scaling ``both``: eps = 1 under either rule) counted for each scaling."""
    both = cells[cells["scaling"] == "both"]
    own = cells[cells["scaling"].isin(SCALINGS)]
    return pd.concat([own] + [both.assign(scaling=s) for s in SCALINGS], ignore_index=True)


def failed(cells: pd.DataFrame, floor: float | None = None) -> pd.Series:
    """True where the held-out loss is not finite or at least ``floor - MARGIN``."""
    v = cells["loss"].astype(float).to_numpy()
    bad = ~np.isfinite(v) | (np.nan_to_num(v, nan=np.inf) >= _floor(floor) - MARGIN)
    return pd.Series(bad, index=cells.index)


def edges(cells: pd.DataFrame, floor: float | None = None) -> pd.DataFrame:
    """One row per (scaling, N, seed): the best lr, the bracket [lo, hi] (log2) of the edge,
    its midpoint ``log2_edge`` (NaN if censored), ``censored`` with ``why`` (no stable lr, or
    no failure above the best) and ``non_monotone`` (a stable lr above the first failure: the
    bracket is still the first failure's)."""
    need = {"scaling", "N", "lr", "seed", "loss"}
    if missing := need - set(cells.columns):
        raise ValueError(f"edges: cells lack columns {sorted(missing)}")
    df = _expand(cells)
    df = df.assign(failed=failed(df, floor).to_numpy(), log2_lr=np.log2(df["lr"].astype(float)))
    rows = []
    for (scaling, N, seed), g in df.groupby(["scaling", "N", "seed"], sort=True):
        g = g.sort_values("log2_lr").reset_index(drop=True)
        x, bad = g["log2_lr"].to_numpy(), g["failed"].to_numpy()
        loss = np.where(bad, np.inf, g["loss"].astype(float).to_numpy())
        row = {"scaling": scaling, "N": int(N), "seed": int(seed), "lo": math.nan,
               "hi": math.nan, "log2_edge": math.nan, "censored": True, "why": "no stable lr",
               "non_monotone": False,
               "best_log2_lr": math.nan, "grid_top": float(x[-1])}  # fmt: skip
        if np.isfinite(loss).any():
            b = int(np.argmin(loss))
            row.update(best_log2_lr=float(x[b]), why="no failure above the best lr")
            above = np.flatnonzero(bad[b + 1 :]) + b + 1
            if len(above):
                f = int(above[0])
                row.update(lo=float(x[f - 1]), hi=float(x[f]), censored=False, why="",
                           log2_edge=0.5 * (x[f - 1] + x[f]),
                           non_monotone=bool((~bad[f + 1 :]).any()))  # fmt: skip
        rows.append(row)
    return pd.DataFrame(rows)


def _ols_slope(x: np.ndarray, y: np.ndarray) -> float:
    if len(x) < 2 or np.ptp(x) == 0:
        return math.nan
    xc = x - x.mean()
    return float((xc * (y - y.mean())).sum() / (xc * xc).sum())


def seed_slopes(e: pd.DataFrame, scaling: str) -> pd.Series:
    """Per seed whose edge is uncensored at every N of the scaling: the least-squares slope of
    its log2 edges (bracket midpoints) on log2 N."""
    g = e[e["scaling"] == scaling]
    Ns = set(g["N"])
    out = {}
    for seed, h in g.groupby("seed"):
        h = h[~h["censored"]]
        if set(h["N"]) == Ns and len(Ns) >= 2:
            out[int(seed)] = _ols_slope(np.log2(h["N"].to_numpy(float)), h["log2_edge"].to_numpy())
    return pd.Series(out, dtype=float)


def resolution_sd(Ns, width: float) -> float:
    """sd of one seed's slope from the grid alone: each edge uniform in its bracket of
    ``width`` octaves (sd width / sqrt(12)) -> slope sd width / sqrt(12 Sxx)."""
    x = np.log2(np.asarray(sorted(Ns), dtype=float))
    return float(width / math.sqrt(12 * ((x - x.mean()) ** 2).sum()))


def slopes(e: pd.DataFrame, level: float = LEVEL, seed: int = 0) -> pd.DataFrame:
    """Per scaling: the mean over seeds of the per-seed slopes and its two-sided t interval
    (primary; the sd is at least the grid's :func:`resolution_sd`), its half-width, and a
    pooled-fit seed bootstrap with in-bracket draws (secondary, ``boot_low``/``boot_high``)."""
    rng = np.random.default_rng(seed)
    rows = []
    for scaling in SCALINGS:
        b = seed_slopes(e, scaling).to_numpy()
        g = e[(e["scaling"] == scaling) & ~e["censored"]]
        width = float(np.median(g["hi"] - g["lo"])) if len(g) else math.nan
        n, m = len(b), float(b.mean()) if len(b) else math.nan
        lo = hi = sd = math.nan
        if n >= 2:
            sd = max(float(b.std(ddof=1)), resolution_sd(set(g["N"]), width))
            h = stats.t.ppf(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
            lo, hi = m - h, m + h
        boot_low, boot_high = _boot(g, level, rng)
        rows.append({"scaling": scaling, "predicted": PREDICTED[scaling], "slope": m,
                     "sd": sd, "ci_low": lo, "ci_high": hi, "half_width": (hi - lo) / 2,
                     "n_seeds": n, "censored": int(e[e["scaling"] == scaling]["censored"].sum()),
                     "boot_low": boot_low, "boot_high": boot_high})  # fmt: skip
    return pd.DataFrame(rows)


def _boot(g: pd.DataFrame, level: float, rng: np.random.Generator) -> tuple[float, float]:
    """Pooled least-squares slope, seeds resampled, each edge drawn inside its bracket."""
    seeds = np.array(sorted(set(g["seed"])))
    if len(seeds) < 2:
        return math.nan, math.nan
    x, lo, hi = np.log2(g["N"].to_numpy(float)), g["lo"].to_numpy(), g["hi"].to_numpy()
    where = {s: np.flatnonzero(g["seed"].to_numpy() == s) for s in seeds}
    boot = []
    for _ in range(N_BOOT):
        idx = np.concatenate([where[s] for s in rng.choice(seeds, len(seeds))])
        boot.append(_ols_slope(x[idx], rng.uniform(lo[idx], hi[idx])))
    boot = np.array([v for v in boot if math.isfinite(v)])
    if not len(boot):
        return math.nan, math.nan
    q = np.quantile(boot, [0.5 - level / 2, 0.5 + level / 2])
    return float(q[0]), float(q[1])


def verdict(e: pd.DataFrame, s: pd.DataFrame) -> tuple[str, str]:
    """The pre-registered verdict and its reason (see the module docstring)."""
    t = s.set_index("scaling")
    desc = "; ".join(
        f"{sc}: slope {t.loc[sc, 'slope']:+.3f} [{t.loc[sc, 'ci_low']:+.3f}, "
        f"{t.loc[sc, 'ci_high']:+.3f}] over {int(t.loc[sc, 'n_seeds'])} seeds (predicted "
        f"{PREDICTED[sc]:+g}, half-width {t.loc[sc, 'half_width']:.3f})"
        for sc in SCALINGS
    )
    few = [sc for sc in SCALINGS if t.loc[sc, "n_seeds"] < MIN_SEEDS]
    if few:
        return "undecided", (f"seeds with an edge at every N < the pre-stated minimum "
                             f"{MIN_SEEDS} for {few}; {desc}")  # fmt: skip

    def contains(sc: str, v: float) -> bool:
        return t.loc[sc, "ci_low"] <= v <= t.loc[sc, "ci_high"]

    sq, lin = "1/sqrt(N)", "1/N"
    if not contains(sq, PREDICTED[sq]) or not contains(lin, PREDICTED[lin]):
        return "fails", f"an interval excludes its predicted slope; {desc}"
    if not contains(sq, PREDICTED[lin]) and not contains(lin, PREDICTED[sq]):
        return "holds", f"each interval contains its prediction and excludes the other; {desc}"
    return "undecided", f"an interval contains both predictions; {desc}"


# ------------------------------------------------------------------------------ present


def _md(df: pd.DataFrame) -> str:
    def cell(v):
        if isinstance(v, float | np.floating):
            return "–" if not math.isfinite(v) else f"{v:.3f}"
        return str(v)

    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in df.itertuples(index=False)]
    return "\n".join(lines)


def edge_table(e: pd.DataFrame) -> pd.DataFrame:
    """Per (scaling, N): seeds, censored edges, mean and sd of log2 edge, mean best log2 lr."""
    g = e.groupby(["scaling", "N"], sort=True)
    return g.agg(seeds=("seed", "nunique"), censored=("censored", "sum"),
                 log2_edge=("log2_edge", "mean"), sd=("log2_edge", "std"),
                 best_log2_lr=("best_log2_lr", "mean"),
                 non_monotone=("non_monotone", "sum")).reset_index()  # fmt: skip


def summary_markdown(cells: pd.DataFrame, floor: float | None = None) -> str:
    """Every pre-registered table and the verdict as markdown (what the study script prints)."""
    floor = _floor(floor)
    e = edges(cells, floor)
    s = slopes(e)
    v, why = verdict(e, s)
    diff = s.set_index("scaling")["slope"]
    cpu = cells["cpu_s"].sum() if "cpu_s" in cells else math.nan
    return "\n".join([
        f"unigram floor (val split): {floor:.4f} nats; failed = non-finite or loss >= floor - "
        f"{MARGIN}", "", "### Edge per scaling and N (log2 lr; midpoint of the bracket)", "",
        _md(edge_table(e)), "",
        "### Slope of log2 edge on log2 N (mean of per-seed slopes, 95 % t)", "",
        _md(s), "",
        f"- secondary: slope(1/sqrt(N)) - slope(1/N) = {diff['1/sqrt(N)'] - diff['1/N']:+.3f} "
        "(predicted -0.5)",
        f"- **verdict: {v}** ({why})", "", f"CPU time of these cells: {cpu / 60:.1f} CPU-minutes",
    ])  # fmt: skip


def figure(cells: pd.DataFrame, path: str, floor: float | None = None) -> None:
    """Left: log2 edge vs log2 N per scaling (seeds as dots, the fit, the predicted slopes);
    then one panel per scaling: seed-mean held-out loss vs lr (the lrs every seed ran), a
    line per N, the mean edge dashed, the floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    floor = _floor(floor)
    e = edges(cells, floor)
    s = slopes(e).set_index("scaling")
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for i, sc in enumerate(SCALINGS):
        g = e[(e["scaling"] == sc) & ~e["censored"]]
        x = np.log2(g["N"].to_numpy(float)) + (i - 0.5) * 0.08
        ax[0].errorbar(x, g["log2_edge"], yerr=[g["log2_edge"] - g["lo"], g["hi"] - g["log2_edge"]],
                       fmt="o", color=f"C{i}", alpha=0.4, ms=3, lw=0.6)  # fmt: skip
        m = g.groupby("N")["log2_edge"].mean()
        if len(m):
            xs = np.log2(m.index.to_numpy(float))
            b = s.loc[sc, "slope"]
            a = float(m.mean() - b * xs.mean()) if math.isfinite(b) else float(m.iloc[0])
            ax[0].plot(xs, a + (b if math.isfinite(b) else 0) * xs, color=f"C{i}",
                       label=f"{sc}: {b:+.2f} [{s.loc[sc, 'ci_low']:+.2f}, "
                       f"{s.loc[sc, 'ci_high']:+.2f}]")  # fmt: skip
            ax[0].plot(xs, float(m.iloc[0]) + PREDICTED[sc] * xs, color=f"C{i}", ls=":",
                       label=f"predicted {PREDICTED[sc]:+g}")  # fmt: skip
    ax[0].set(xlabel="log2 N", ylabel="log2 edge lr (bracket midpoint)")
    ax[0].legend(fontsize=7)
    full = _expand(cells)
    for i, sc in enumerate(SCALINGS):
        sub = full[full["scaling"] == sc]
        for j, (N, g) in enumerate(sub.groupby("N")):
            n = g.groupby("lr")["seed"].nunique()  # the coarse grid: lrs every seed ran
            m = g.groupby("lr")["loss"].mean()[n == g["seed"].nunique()]
            ax[i + 1].plot(np.log2(m.index), m.to_numpy(), marker="o", ms=3, color=f"C{j}",
                           label=f"N={N}")  # fmt: skip
            mid = e[(e["scaling"] == sc) & (e["N"] == N)]["log2_edge"].mean()
            if math.isfinite(mid):
                ax[i + 1].axvline(mid, color=f"C{j}", ls="--", lw=0.7)
        ax[i + 1].axhline(floor, color="k", ls=":", lw=1, label="unigram floor")
        ax[i + 1].axhline(floor - MARGIN, color="k", ls="-.", lw=0.6, label="floor - margin")
        ax[i + 1].set(xlabel="log2 lr", ylabel="held-out loss (seed mean)", title=sc)
        ax[i + 1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def task_table(t: pd.DataFrame) -> str:
    """Part 2's task pilot: per task and N the best held-out loss over the pilot's lrs (and
    its accuracy and log2 lr)."""
    best = t.loc[t.groupby(["task", "N"])["loss"].idxmin()]
    best = best.assign(log2_lr=np.log2(best["lr"].astype(float)))
    return _md(best[["task", "N", "log2_lr", "loss", "acc", "steps"]].reset_index(drop=True))


def task_figure(t: pd.DataFrame, path: str) -> None:
    """Part 2's task pilot: held-out loss vs lr, a line per N, a panel per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(t["task"]))
    fig, ax = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 3.4), squeeze=False)
    for a, task in zip(ax[0], tasks, strict=True):
        g = t[t["task"] == task]
        for N, h in g.groupby("N"):
            h = h.sort_values("lr")
            a.plot(np.log2(h["lr"]), h["loss"], marker="o", label=f"N={N}")
        a.set(xlabel="log2 lr", ylabel="held-out loss", title=f"{task}, {g['steps'].iloc[0]} steps")
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
