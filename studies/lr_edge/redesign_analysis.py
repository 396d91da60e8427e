"""Estimators of the LR-edge redesign (pre-registered in docs/studies/lr_edge.md, "Redesign").

- A cell is **unstable** if its training loss was ever non-finite (``nonfinite``) or the
  10-step moving mean of its training loss rose more than ``RISE`` = 0.5 nats above its
  running minimum after warmup (``rise``, from ``studies.deeploop.redesign.loss_rise``).
- **Edge** of one (scaling, N, seed): scanning the lr grid upwards, the first unstable rate
  (hi) and the rate just below it (lo, the largest stable rate below it); log2 edge = the
  midpoint. No unstable rate, or the lowest rate already unstable: censored. A stable rate
  above the first unstable one is flagged ``non_monotone`` and does not move the edge.
- Slope, interval and verdict: those of the first design (``studies.lr_edge.analysis``:
  mean of per-seed least-squares slopes of log2 edge on log2 N, two-sided 95 % t interval
  over seeds, predictions -1/2 and 0, at least 4 seeds with an edge at every N), computed on
  the **complete seeds** only (every cell of the seed's grid present); with fewer than 4
  complete seeds the verdict is "undecided (k of 6 seeds run)".
- Secondary: per seed, the least-squares slope of log2 d^-1/2 ||Delta h_N|| on
  log2(eta eps N) over every (scaling, N, eta) one-step cell; mean and 95 % t interval over
  seeds. Also per scaling, the slope in log2 N at fixed eta (averaged over eta and seeds).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from scipy import stats

from studies.lr_edge import analysis as first
from studies.lr_edge.analysis import SCALINGS, _md, _ols_slope

RISE = 0.5  # nats: the pre-registered loss-rise threshold
N_PLANNED = 6  # seeds 100-105
N_GRID = 17  # half-octave rates 2^-7 .. 2^1
N_ARMS = 9  # N = 1 once ("both"), N in {2, 4, 8, 16} under both scalings


def unstable(cells: pd.DataFrame, rise: float = RISE) -> pd.Series:
    """True where the training loss was ever non-finite or its moving mean rose > ``rise``."""
    for col in ("nonfinite", "rise"):
        if col not in cells.columns:
            raise ValueError(f"unstable: cells lack the column {col!r} (redesign cells)")
    nf = cells["nonfinite"].astype(str).str.lower().isin(["true", "1", "1.0"]).to_numpy()
    r = cells["rise"].astype(float).to_numpy()
    return pd.Series(nf | (np.nan_to_num(r, nan=0.0) > rise), index=cells.index)


def complete_seeds(cells: pd.DataFrame, n_cells: int = N_ARMS * N_GRID) -> list[int]:
    """Seeds with every cell of their grid present (distinct (scaling, N, lr))."""
    g = cells.drop_duplicates(["scaling", "N", "lr", "seed"]).groupby("seed").size()
    return sorted(int(s) for s, n in g.items() if n >= n_cells)


def edges(cells: pd.DataFrame, rise: float = RISE) -> pd.DataFrame:
    """One row per (scaling, N, seed), N = 1 counted for each scaling: ``lo``/``hi`` (log2),
    ``log2_edge``, ``censored`` with ``why``, ``non_monotone``, ``n_unstable``."""
    need = {"scaling", "N", "lr", "seed", "nonfinite", "rise"}
    if missing := need - set(cells.columns):
        raise ValueError(f"edges: cells lack columns {sorted(missing)}")
    df = first._expand(cells)
    df = df.assign(bad=unstable(df, rise).to_numpy(), log2_lr=np.log2(df["lr"].astype(float)))
    rows = []
    for (scaling, N, seed), g in df.groupby(["scaling", "N", "seed"], sort=True):
        g = g.sort_values("log2_lr").reset_index(drop=True)
        x, bad = g["log2_lr"].to_numpy(), g["bad"].to_numpy()
        row = {"scaling": scaling, "N": int(N), "seed": int(seed), "lo": math.nan,
               "hi": math.nan, "log2_edge": math.nan, "censored": True,
               "why": "no unstable rate", "non_monotone": False,
               "n_unstable": int(bad.sum())}  # fmt: skip
        if bad.any():
            f = int(np.flatnonzero(bad)[0])
            if f == 0:
                row["why"] = "unstable at the lowest rate"
            else:
                row.update(lo=float(x[f - 1]), hi=float(x[f]), censored=False, why="",
                           log2_edge=0.5 * (x[f - 1] + x[f]),
                           non_monotone=bool((~bad[f + 1 :]).any()))  # fmt: skip
        rows.append(row)
    return pd.DataFrame(rows)


def verdict(cells: pd.DataFrame, rise: float = RISE) -> tuple[str, str, pd.DataFrame]:
    """The pre-registered verdict on the complete seeds, its reason and the slope table."""
    seeds = complete_seeds(cells)
    e = edges(cells[cells["seed"].isin(seeds)], rise) if seeds else None
    if e is None or e.empty:
        return f"undecided (0 of {N_PLANNED} seeds run)", "no complete seed", pd.DataFrame()
    s = first.slopes(e)
    v, why = first.verdict(e, s)
    if len(seeds) < first.MIN_SEEDS:
        v = f"undecided ({len(seeds)} of {N_PLANNED} seeds run)"
    return v, why, s


def step_slopes(step: pd.DataFrame, col: str = "dh", level: float = 0.95) -> dict:
    """Per seed, the slope of log2 ``col`` on log2(eta eps N) over all one-step cells; the
    mean over seeds with its two-sided t interval."""
    need = {"lr", "eps", "N", "seed", col}
    if missing := need - set(step.columns):
        raise ValueError(f"step_slopes: cells lack columns {sorted(missing)}")
    b = []
    for _, g in step.groupby("seed"):
        x = np.log2(g["lr"].to_numpy(float) * g["eps"].to_numpy(float) * g["N"].to_numpy(float))
        b.append(_ols_slope(x, np.log2(g[col].to_numpy(float))))
    b = np.array(b)
    m, n = float(b.mean()), len(b)
    h = stats.t.ppf(0.5 + level / 2, n - 1) * b.std(ddof=1) / math.sqrt(n) if n > 1 else math.nan
    return {"slope": m, "ci_low": m - h, "ci_high": m + h, "n_seeds": n}


def step_n_slopes(step: pd.DataFrame, col: str = "dh") -> pd.DataFrame:
    """Per scaling: the slope of log2 ``col`` on log2 N at fixed (eta, seed), N = 1 counted for
    each scaling; its mean over eta and seeds, and over the lower / upper half of the grid."""
    df = first._expand(step)
    rows = []
    for scaling in SCALINGS:
        g = df[df["scaling"] == scaling]
        sl = g.groupby(["lr", "seed"]).apply(
            lambda h: _ols_slope(np.log2(h["N"].to_numpy(float)), np.log2(h[col].to_numpy(float))),
            include_groups=False,
        )
        lrs = sl.index.get_level_values("lr").to_numpy(float)
        mid = np.median(np.unique(lrs))
        rows.append({"scaling": scaling, "slope_in_log2_N": float(sl.mean()),
                     "low_lrs": float(sl[lrs < mid].mean()),
                     "high_lrs": float(sl[lrs > mid].mean()),
                     "bound_if_linear": 1 - (0.5 if scaling == "1/sqrt(N)" else 1.0)})  # fmt: skip
    return pd.DataFrame(rows)


def summary_markdown(
    cells: pd.DataFrame | None, step: pd.DataFrame | None, small: pd.DataFrame | None = None
) -> str:
    out = []
    if small is not None and len(small):
        s = step_slopes(small)
        out += ["### Exploratory (after the data): one step at lr 2^-16 .. 2^-8", "",
                f"Slope on log2(eta eps N): {s['slope']:+.3f} [{s['ci_low']:+.3f}, "
                f"{s['ci_high']:+.3f}] over {s['n_seeds']} seeds", "",
                _md(step_n_slopes(small)), ""]  # fmt: skip
    if step is not None and len(step):
        s = step_slopes(step)
        sl = step_slopes(step, "dh_loop") if "dh_loop" in step else None
        out += ["### Secondary: one AdamW step, d^-1/2 ||Delta h_N|| against eta eps N", "",
                f"{len(step)} cells, {step['cpu_s'].sum() / 60:.1f} CPU-min. Slope of log2 "
                f"d^-1/2||Delta h_N|| on log2(eta eps N): {s['slope']:+.3f} "
                f"[{s['ci_low']:+.3f}, {s['ci_high']:+.3f}] (95 % t over {s['n_seeds']} seeds)"
                + (f"; loop part h_N - h_0: {sl['slope']:+.3f} [{sl['ci_low']:+.3f}, "
                   f"{sl['ci_high']:+.3f}]" if sl else ""), "",
                "Slope in log2 N at fixed eta (a bound C eta eps N that is tight would give "
                "1 - alpha):", "", _md(step_n_slopes(step)), ""]  # fmt: skip
    if cells is not None and len(cells):
        seeds = complete_seeds(cells)
        v, why, s = verdict(cells)
        full = cells.groupby(["scaling", "N", "seed"])["lr"].transform("nunique") >= N_GRID
        e = edges(cells[full])
        tab = e.groupby(["scaling", "N"]).agg(
            seeds=("seed", "nunique"), censored=("censored", "sum"),
            log2_edge=("log2_edge", "mean"), sd=("log2_edge", "std"),
            non_monotone=("non_monotone", "sum")).reset_index()  # fmt: skip
        out += [
            "### Primary: edge by instability (no clipping)",
            "",
            f"{len(cells)} of {N_PLANNED * N_ARMS * N_GRID} cells, "
            f"{cells['cpu_s'].sum() / 60:.1f} CPU-min; complete seeds: {seeds}; unstable "
            f"cells: {int(unstable(cells).sum())} (non-finite "
            f"{int(unstable(cells.assign(rise=0.0)).sum())})",
            "",
            "Edges per (scaling, N), every (scaling, N, seed) with its whole grid (log2 lr):",
            "",
            _md(tab),
            "",
        ]
        if len(s):
            out += ["Slopes on the complete seeds:", "", _md(s), ""]
        out += [f"- **verdict: {v}** ({why})"]  # fmt: skip
    return "\n".join(out)


CLAIM = "slope −½ under 1/√N, 0 under 1/N, edge = instability during training"


def redesign_verdicts(folder) -> tuple[list[tuple[str, str, str]], list[str]]:
    """The judge's rows from ``folder``'s ``redesign.csv`` / ``redesign_step.csv``: [(claim,
    verdict, measured)] and notes (the one-step secondary is a note: no verdict registered)."""
    import os

    out, notes = [], []
    path, step_path = (
        os.path.join(folder, "redesign.csv"),
        os.path.join(folder, "redesign_step.csv"),
    )
    if os.path.exists(path):
        cells = pd.read_csv(path)
        v, why, _ = verdict(cells)
        k = len(complete_seeds(cells))
        out.append((CLAIM, v, f"{why} [complete seeds {k} of {N_PLANNED}]"))
        notes.append(f"LR-edge redesign: {len(cells)} cells, {cells['cpu_s'].sum() / 60:.1f} "
                     f"CPU-min, {k} complete seeds")  # fmt: skip
    if os.path.exists(step_path):
        s = step_slopes(pd.read_csv(step_path))
        notes.append(f"LR-edge redesign, one AdamW step: slope of log2 d^-1/2||Δh_N|| on "
                     f"log2(η ε N) {s['slope']:+.3f} [{s['ci_low']:+.3f}, {s['ci_high']:+.3f}] "
                     f"over {s['n_seeds']} seeds")  # fmt: skip
    return out, notes
