"""Analysis of the issue-17 studies from their CSVs (no training; seconds).

    python scripts/repro_analysis.py   # reads docs/data/{lr_transfer,reachability}_study.csv

LR transfer: per arm the parabola-vertex optimum (log2 lr) at N = 1 and 8, the drift in
octaves with its 95% paired seed-bootstrap interval (loopprobe.experiments.optimum) and the
pre-stated verdict (margin 0.75 octave). Reachability: per task x recall x outer norm the
fraction of runs that reached a fixed point, rho and ||dh*/dx|| there, accuracy at R, 2R, 4R.
Writes docs/data/lr_transfer_drift.csv, docs/data/reachability_summary.csv and the figures
docs/figures/lr_transfer_study.png, docs/figures/reachability_study.png; prints markdown.
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import pandas as pd

from loopprobe.experiments.optimum import classify, drift_interval, seed_matrix, vertex

MARGIN = 0.75  # octaves: half the predicted 1/sqrt(N) drift of -1.5
MIN_SEEDS = 4


def md(df: pd.DataFrame, digits: int = 3) -> str:
    """A markdown table (no tabulate dependency)."""

    def cell(v):
        if isinstance(v, float | np.floating):
            return (
                "–"
                if not math.isfinite(v)
                else f"{v:.{digits}g}"
                if abs(v) >= 100
                else f"{v:.{digits}f}"
            )
        return str(v)

    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


def lr_drift(df: pd.DataFrame, n_boot: int = 2000) -> pd.DataFrame:
    rows = []
    for _, g in df.groupby("arm", sort=False):
        # seeds complete for this arm: every (N, lr) cell present
        cells = g.groupby("seed").size()
        full = cells[cells == cells.max()].index
        t = drift_interval(g[g["seed"].isin(full)], "arm", 1, 8, n_boot=n_boot)
        rows.append(t)
    t = pd.concat(rows, ignore_index=True)
    t["verdict"] = [
        classify(lo, hi, MARGIN) if v >= 0.9 else "undecided (optimum off the grid)"
        for lo, hi, v in zip(t["ci_low"], t["ci_high"], t["boot_valid"], strict=True)
    ]
    t["below_min_seeds"] = t["seeds"] < MIN_SEEDS
    return t


def contrast(df: pd.DataFrame, a: str = "1/sqrt(N)", b: str = "1/N", n_boot: int = 2000):
    """Post hoc: drift(a) - drift(b) with one paired seed bootstrap (point, 2.5%, 97.5%)."""
    sub = df[df["arm"].isin([a, b])]
    cells = sub.groupby("seed").size()
    seeds = sorted(cells[cells == cells.max()].index)
    rng = np.random.default_rng(1)
    draws = np.vstack(
        [np.arange(len(seeds))[None], rng.integers(0, len(seeds), (n_boot, len(seeds)))]
    )
    d = {}
    for arm in (a, b):
        v = {}
        for N in (1, 8):
            x, m = seed_matrix(sub[(sub["arm"] == arm) & (sub["N"] == N)], seeds)
            v[N] = np.array([vertex(x, np.nanmean(m[i], axis=0)) for i in draws])
        d[arm] = v[8] - v[1]
    c = d[a] - d[b]
    boot = c[1:][np.isfinite(c[1:])]
    return c[0], *np.quantile(boot, [0.025, 0.975])


def claim_verdict(t: pd.DataFrame) -> str:
    v = dict(zip(t["arm"], t["verdict"], strict=True))
    stay = [v.get(r) for r in ("1/N", "loop-mup") if r in v]
    if v.get("1/sqrt(N)") == "stays" or "drifts" in stay:
        return "FAILS"
    if v.get("1/sqrt(N)") == "drifts" and stay and all(s == "stays" for s in stay):
        return "HOLDS"
    return "UNDECIDED"


def lr_figure(df: pd.DataFrame, t: pd.DataFrame, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(t["arm"])
    fig, axes = plt.subplots(1, len(arms), figsize=(4 * len(arms), 3.2), sharey=True)
    for ax, arm in zip(np.atleast_1d(axes), arms, strict=True):
        g = df[df["arm"] == arm]
        for N, color in ((1, "C0"), (8, "C3")):
            c = g[g["N"] == N].groupby("lr")["loss"]
            m, s, n = c.mean(), c.std(), c.count()
            x = np.log2(m.index.to_numpy(dtype=float))
            ax.errorbar(x, m, yerr=s / np.sqrt(n), color=color, marker="o", ms=3, label=f"N={N}")
            v = vertex(x, m.to_numpy())
            if math.isfinite(v):
                ax.axvline(v, color=color, ls="--", lw=1)
        r = t[t["arm"] == arm].iloc[0]
        ax.set_title(f"{arm}: drift {r['drift']:+.2f} [{r['ci_low']:+.2f}, {r['ci_high']:+.2f}]")
        ax.set_xlabel("log2 lr")
        ax.legend(fontsize=8)
    np.atleast_1d(axes)[0].set_ylabel("held-out loss (seed mean ± se)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def reach_summary(df: pd.DataFrame) -> pd.DataFrame:
    df = df.copy()
    df["dep"] = df["input_dependence"].where(df["converged"])
    df["rho_reached"] = df["spectral_radius"].where(df["converged"])
    agg = df.groupby(["task", "recall", "outer_norm"], sort=False).agg(
        runs=("seed", "size"),
        reached=("converged", "sum"),
        rho_median=("spectral_radius", "median"),
        rho_reached_median=("rho_reached", "median"),
        dep_median=("dep", "median"),
        dep_max=("dep", "max"),
        acc_R4=("acc_R4", "mean"),
        acc_R8=("acc_R8", "mean"),
        acc_R16=("acc_R16", "mean"),
        steps_median=("steps", "median"),
        train_loss=("train_loss", "mean"),
        plateaued=("stop", lambda s: int((s != "cap").sum())),
    )
    return agg.reset_index()


def reach_figure(df: pd.DataFrame, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    for ax, (task, g) in zip(axes, df.groupby("task"), strict=False):
        for (recall, outer), h in g.groupby(["recall", "outer_norm"]):
            mark = "o" if outer else "x"
            ax.scatter(h["spectral_radius"], h["acc_R16"] - h["acc_R4"], marker=mark,
                       label=f"{recall}{' +norm' if outer else ''}")  # fmt: skip
        ax.axvline(1.0, color="k", lw=0.5)
        ax.set_title(task)
        ax.set_xlabel("rho(dT/dh) at the Picard end point")
    axes[0].set_ylabel("acc(16 rounds) - acc(4 rounds)")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lr", default="docs/data/lr_transfer_study.csv")
    ap.add_argument("--reach", default="docs/data/reachability_study.csv")
    ap.add_argument("--figdir", default="docs/figures")
    a = ap.parse_args()
    pd.set_option("display.width", 200)
    lr = pd.read_csv(a.lr)
    lr.loc[lr["diverged"], "loss"] = np.nan
    t = lr_drift(lr)
    t.to_csv("docs/data/lr_transfer_drift.csv", index=False, float_format="%.4g")
    print(md(t))
    print("claim:", claim_verdict(t))
    c, lo, hi = contrast(lr)
    print(f"post hoc contrast drift(1/sqrt(N)) - drift(1/N): {c:.3f} [{lo:.3f}, {hi:.3f}]")
    wide = lr.pivot_table(index=["arm", "N"], columns="lr", values="loss", aggfunc="mean")
    print(md(wide.reset_index()))
    lr_figure(lr, t, f"{a.figdir}/lr_transfer_study.png")
    try:
        reach = pd.read_csv(a.reach)
    except FileNotFoundError:
        return
    s = reach_summary(reach)
    s.to_csv("docs/data/reachability_summary.csv", index=False, float_format="%.4g")
    print(md(s))
    reach_figure(reach, f"{a.figdir}/reachability_study.png")


if __name__ == "__main__":
    main()
