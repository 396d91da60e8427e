"""The optimal learning rate against unique layers L and loops N under Loop-muP (issue 30.2).

The training runs live in ``studies/lr_l/run.py`` (CPU time, outside CI); its cells (one row per
d, L, N, lr, seed) would be committed as ``studies/lr_l/lr_l_study.csv``. This module holds the
estimator and the criteria fixed in ``docs/studies/lr_l.md`` before any confirmatory cell, and
the task search's table (``pilot_table``): no pilot task qualified, so ``claim`` is undecided.
The redesign without the gate (``studies/lr_l/redesign.py``, cells in ``redesign.csv``) is
judged by ``redesign_claim``: the same estimator and rule on its complete seeds.

Claim (seed 004, Loop-muP; PAPERS.md §2b): with eps = lambda / (N sqrt(L)) the optimal learning
rate depends on the number of unique layers L and not on the loop count N; the looped stack's
lr scales as L^-1/2 (Table 3, eta_0 m_L^-1/2; Proposition 7, eta = O((lambda sqrt(L))^-1)), so
log2 eta*(L = 2) - log2 eta*(L = 1) = -1/2.

- Optimum of one arm (d, L, N): the seed-mean held-out loss per lr (a non-finite loss counts as
  ``chance``); the grid argmin and the vertex of the parabola through it and its two neighbours
  in log2 lr (``fit_log2_lr`` of :class:`loopprobe.experiments.lrtransfer.LRTransfer`). An
  argmin at the grid's edge has no vertex: the arm is ``at_edge`` and its optimum is the edge.
- Drift per L: opt(N = 8) - opt(N = 1); L contrast: the mean over N of opt(L = 2) - opt(L = 1).
  Intervals: 95 % percentile bootstrap over seeds (paired: one resample of seeds for all arms).
- Verdict: *holds* if every drift interval lies inside [-BAND, BAND] and the L contrast interval
  lies below 0; *fails* if a drift interval lies entirely outside [-BAND, BAND] or the L contrast
  interval lies entirely above 0; *undecided* otherwise, or when an arm's point optimum is at the
  grid's edge, or fewer than ``MIN_SEEDS`` seeds are complete.

Example::

    cells = pd.read_csv("studies/lr_l/lr_l_study.csv")
    est = estimate(cells)        # optima, contrasts (drift per L, L contrast) with intervals
    verdict(est)                 # ("holds" | "fails" | "undecided", reason)
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from studies.optimum import vertices

__all__ = [
    "BAND", "LEVEL", "MIN_SEEDS", "N_BOOT", "PREDICTED_L", "QUALIFY_ACC", "QUALIFY_NATS",
    "REDESIGN_ARMS", "REDESIGN_GRID", "REGISTERED_SEEDS", "claim", "complete_part", "cube",
    "estimate", "figure", "intervals", "optimum", "pilot_figure", "pilot_markdown", "pilot_table",
    "redesign_claim", "summary_markdown", "verdict",
]  # fmt: skip

#: Pre-registered (docs/studies/lr_l.md)
BAND = 0.5  # octaves: the drift of the optimum between N = 1 and N = 8 that counts as "flat"
PREDICTED_L = -0.5  # log2 eta*(L=2) - log2 eta*(L=1) under eta ~ L^-1/2
MIN_SEEDS = 3
LEVEL = 0.95
N_BOOT = 2000
N_LO, N_HI = 1, 8
#: The task search's condition (docs/studies/lr_l.md): N = 8 beats N = 1 by this much at each
#: N's best pilot lr (held-out loss lower by QUALIFY_NATS, or accuracy higher by QUALIFY_ACC)
QUALIFY_NATS, QUALIFY_ACC = 0.1, 0.10
PILOT_KEYS = ["task", "m", "hops", "d", "batch", "steps"]  # one configuration (blocks merged)


def cube(cells: pd.DataFrame, chance: float) -> tuple[np.ndarray, list, np.ndarray, list]:
    """Loss array ``(arm, lr, seed)`` over the seeds complete in every arm; non-finite -> chance.

    Returns ``(loss, arms, log2_lrs, seeds)``; ``arms`` are ``(d, L, N)`` tuples, sorted.
    """
    need = {"d", "L", "N", "lr", "seed", "loss"}
    if missing := need - set(cells.columns):
        raise ValueError(f"lr_l.cube: cells lack columns {sorted(missing)}")
    df = cells.assign(loss=cells["loss"].astype(float).where(np.isfinite(cells["loss"]), chance))
    lrs = sorted(df["lr"].astype(float).unique())
    arms = sorted(
        {(int(d), int(L), int(N)) for d, L, N in zip(df["d"], df["L"], df["N"], strict=True)}
    )
    n_cells = df.groupby("seed").size()
    seeds = sorted(int(s) for s in n_cells.index[n_cells == len(arms) * len(lrs)])
    df = df[df["seed"].isin(seeds)]
    table = df.pivot_table(index=["d", "L", "N", "lr"], columns="seed", values="loss")
    full = pd.MultiIndex.from_tuples([(*a, lr) for a in arms for lr in lrs])
    table = table.reindex(full)
    if table.isna().to_numpy().any():
        raise ValueError("lr_l.cube: a complete seed lacks a (d, L, N, lr) cell; rerun the study")
    loss = table.to_numpy().reshape(len(arms), len(lrs), len(seeds))
    return loss, arms, np.log2(np.asarray(lrs)), seeds


def optimum(mean: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Vertex (log2 lr) of the parabola through the argmin of ``mean[..., lr]`` and its
    neighbours (:func:`studies.optimum.vertices`, half-width 1), and
    ``at_edge`` (argmin at the grid's edge: the optimum is that edge lr). A flat or concave
    triple has no vertex: the optimum is the argmin itself."""
    i = np.argmin(mean, axis=-1)
    at_edge = (i == 0) | (i == len(x) - 1)
    vx = vertices(x, mean.reshape(-1, mean.shape[-1]), half_width=1).reshape(i.shape)
    v = np.where(np.isfinite(vx), vx, x[i])
    return np.where(at_edge, x[i], v), at_edge


def _contrasts(opt: np.ndarray, arms: list) -> dict[str, np.ndarray]:
    """Drift per (d, L) between N_LO and N_HI, and the L contrast per d (mean over N)."""
    pos = {a: k for k, a in enumerate(arms)}
    out = {}
    for d in sorted({a[0] for a in arms}):
        Ls = sorted({a[1] for a in arms if a[0] == d})
        for L in Ls:
            if (d, L, N_LO) in pos and (d, L, N_HI) in pos:
                hi, lo = opt[..., pos[(d, L, N_HI)]], opt[..., pos[(d, L, N_LO)]]
                out[f"drift d={d} L={L}"] = hi - lo
        if {1, 2} <= set(Ls):
            Ns = [N for (dd, L, N) in arms if dd == d and L == 1 and (d, 2, N) in pos]
            diffs = [opt[..., pos[(d, 2, N)]] - opt[..., pos[(d, 1, N)]] for N in Ns]
            out[f"L contrast d={d}"] = np.mean(diffs, axis=0)
    return out


def estimate(cells: pd.DataFrame, chance: float | None = None, seed: int = 0) -> dict:
    """Optima per arm and the contrasts with their seed-bootstrap intervals (pre-registered).

    ``chance`` is the loss a non-finite cell counts as (default log m, from the ``m`` column).
    """
    if chance is None:
        chance = math.log(float(cells["m"].iloc[0])) if "m" in cells else math.inf
    loss, arms, x, seeds = cube(cells, chance)
    opt, at_edge = optimum(loss.mean(-1), x)
    rng = np.random.default_rng(seed)
    draws = rng.integers(len(seeds), size=(N_BOOT, len(seeds)))
    boot_opt, boot_edge = optimum(loss[:, :, draws].mean(-1).transpose(2, 0, 1), x)
    point, boot = _contrasts(opt, arms), _contrasts(boot_opt, arms)
    q = [(1 - LEVEL) / 2, (1 + LEVEL) / 2]
    rows = []
    for name, value in point.items():
        lo, hi = np.quantile(boot[name], q)
        rows.append({"contrast": name, "estimate": float(value), "ci_low": float(lo),
                     "ci_high": float(hi)})  # fmt: skip
    optima = pd.DataFrame(
        [{"d": a[0], "L": a[1], "N": a[2], "opt_log2_lr": float(opt[k]),
          "at_edge": bool(at_edge[k]), "boot_at_edge": float(boot_edge[:, k].mean()),
          "best_loss": float(loss[k].mean(-1).min())} for k, a in enumerate(arms)]
    )  # fmt: skip
    return {"optima": optima, "contrasts": pd.DataFrame(rows), "seeds": seeds}


def verdict(est: dict) -> tuple[str, str]:
    """The pre-registered verdict and its reason (see the module docstring)."""
    c, o = est["contrasts"], est["optima"]
    if len(est["seeds"]) < MIN_SEEDS:
        return "undecided", f"{len(est['seeds'])} complete seeds < {MIN_SEEDS}"
    drift = c[c["contrast"].str.startswith("drift")]
    lc = c[c["contrast"].str.startswith("L contrast")]
    if drift.empty or lc.empty:
        return "undecided", "the cells lack N = 1 and 8 or L = 1 and 2"
    out_band = (drift["ci_low"] > BAND) | (drift["ci_high"] < -BAND)
    wrong_way = lc["ci_low"] > 0
    if out_band.any() or wrong_way.any():
        bad = list(drift["contrast"][out_band]) + list(lc["contrast"][wrong_way])
        return "fails", "interval outside its prediction: " + ", ".join(bad)
    if o["at_edge"].any():
        edge = [f"d={r.d} L={r.L} N={r.N}" for r in o[o["at_edge"]].itertuples()]
        return "undecided", "optimum at the grid's edge: " + ", ".join(edge)
    in_band = (drift["ci_low"] >= -BAND) & (drift["ci_high"] <= BAND)
    if in_band.all() and (lc["ci_high"] < 0).all():
        return "holds", "every drift interval inside the band and the L contrast below 0"
    return "undecided", "an interval overlaps its prediction's boundary"


def summary_markdown(cells: pd.DataFrame, chance: float | None = None) -> str:
    """Optima table, contrasts with intervals and the verdict, as markdown."""
    est = estimate(cells, chance)
    o = est["optima"]
    head = "| d | L | N | optimum log2 lr | at edge | best seed-mean loss |"
    lines = [head, "|---|---|---|---|---|---|"]
    for r in o.itertuples():
        edge = "yes" if r.at_edge else ""
        lines.append(
            f"| {r.d} | {r.L} | {r.N} | {r.opt_log2_lr:+.2f} | {edge} | {r.best_loss:.3f} |"
        )
    lines += ["", "| contrast | predicted | estimate | 95 % interval |", "|---|---|---|---|"]
    for r in est["contrasts"].itertuples():
        pred = f"within ±{BAND}" if r.contrast.startswith("drift") else f"< 0 ({PREDICTED_L})"
        lines.append(f"| {r.contrast} | {pred} | {r.estimate:+.2f} | "
                     f"[{r.ci_low:+.2f}, {r.ci_high:+.2f}] |")  # fmt: skip
    v, why = verdict(est)
    lines += ["", f"Verdict: **{v}** ({why}); seeds {est['seeds']}."]
    return "\n".join(lines)


def figure(cells: pd.DataFrame, path: str | None = None,
           ylabel: str = "held-out loss (answer token)"):  # fmt: skip
    """Seed-mean held-out loss against log2 lr, a line per N, a panel per (d, L); the optimum
    of each arm marked. Returns the Figure (saved to ``path`` when given)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    est = estimate(cells)
    df = cells.assign(log2_lr=np.log2(cells["lr"].astype(float)))
    df = df[df["seed"].isin(est["seeds"])]
    panels = sorted({(int(d), int(L)) for d, L in zip(df["d"], df["L"], strict=True)})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (d, L) in zip(axes[0], panels, strict=True):
        sub = df[(df["d"] == d) & (df["L"] == L)]
        sns.lineplot(sub, x="log2_lr", y="loss", hue="N", palette="viridis", marker="o",
                     errorbar="se", ax=ax)  # fmt: skip
        for r in est["optima"][(est["optima"]["d"] == d) & (est["optima"]["L"] == L)].itertuples():
            ax.axvline(r.opt_log2_lr, color=plt.cm.viridis(math.log2(r.N) / 3), ls=":", lw=1)
        ax.set_title(f"d = {d}, L = {L} (eps = 1/(N sqrt L))")
        ax.set_xlabel("log2 lr")
        ax.set_ylabel(ylabel)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
    return fig


def claim(pilot: pd.DataFrame, cells: pd.DataFrame | None = None) -> tuple[str, str]:
    """The study's verdict from its committed data: without a qualifying pilot task no
    confirmatory cell may count (pre-stated), so "undecided"; else the verdict of ``cells``."""
    t = pilot_table(pilot)
    if not t["qualifies"].any():
        n8 = t[(t["L"] == 1) & (t["N"] == N_HI)]
        best = n8.loc[n8["gap_nats"].idxmin()]
        return "undecided", (
            f"no task where N = {N_HI} beats N = 1 by {QUALIFY_NATS} nats or "
            f"{100 * QUALIFY_ACC:.0f} points ({len(t.groupby(PILOT_KEYS))} pilot configurations; "
            f"closest {best['gap_nats']:+.3f} nats, {best['task']} m {best['m']} "
            f"{best['hops']} hops, {best['steps']} steps)"
        )
    if cells is None or cells.empty:
        return "undecided", "a pilot task qualified but no confirmatory cells were given"
    return verdict(estimate(cells))


def intervals(est: dict) -> str:
    """The contrasts of ``estimate`` as one line: ``name +x.xx [lo, hi]``, comma-separated."""
    return ", ".join(f"{r.contrast} {r.estimate:+.2f} [{r.ci_low:+.2f}, {r.ci_high:+.2f}]"
                     for r in est["contrasts"].itertuples())  # fmt: skip


#: The redesign's registered seeds (100-103; docs/studies/lr_l.md, "Redesign")
REGISTERED_SEEDS = 4


#: The redesign's arms (L, N) and base grid (log2 lr, half octaves 2^-9 .. 2^-3)
REDESIGN_ARMS = [(L, N) for L in (1, 2) for N in (1, 2, 4, 8)]
REDESIGN_GRID = [k / 2 for k in range(-18, -5)]


def complete_part(cells: pd.DataFrame) -> pd.DataFrame:
    """The redesign's cells the estimator may use: the seeds that have every arm at every rate
    of the base grid, on the rates (base or extension) that every such seed has for every arm.
    A seed still running, or an extension rate not yet run for every complete seed, is left
    out, never half-counted."""
    need = {"L", "N", "lr", "seed", "loss"}
    if missing := need - set(cells.columns):
        raise ValueError(f"lr_l.complete_part: cells lack columns {sorted(missing)}")
    x = np.round(np.log2(cells["lr"].astype(float)), 3)
    have = set(zip(cells["seed"], cells["L"], cells["N"], x, strict=True))
    per_seed = {}
    for s in sorted(set(cells["seed"])):
        rates = {xx for (ss, _, _, xx) in have if ss == s}
        per_seed[s] = {xx for xx in rates if all((s, L, N, xx) in have for L, N in REDESIGN_ARMS)}
    seeds = [s for s, r in per_seed.items() if set(REDESIGN_GRID) <= r]
    if not seeds:
        return cells.iloc[:0]
    rates = set.intersection(*(per_seed[s] for s in seeds))
    arms = set(REDESIGN_ARMS)
    keep = (
        cells["seed"].isin(seeds)
        & x.isin(rates)
        & np.array([(L, N) in arms for L, N in zip(cells["L"], cells["N"], strict=True)])
    )
    return cells[keep]


def redesign_claim(cells: pd.DataFrame, chance: float = math.log(256)) -> tuple[str, str]:
    """The redesign's verdict (no gate): the pre-registered rule on the complete seeds, and
    "undecided (k of 4 seeds run)" while fewer than the registered seeds are complete (the
    reason then gives what the rule says on those k, with their intervals). ``chance``: the
    loss a non-finite cell counts as (a uniform byte for the text task)."""
    cells = complete_part(cells)
    k = cells["seed"].nunique()
    if k == 0:
        return f"undecided (0 of {REGISTERED_SEEDS} seeds run)", "no complete seed"
    est = estimate(cells, chance)
    v, why = verdict(est)
    edge = est["optima"][est["optima"]["at_edge"]]
    if k == 1:  # a bootstrap over one seed has no spread: point estimates only
        text = ", ".join(f"{r.contrast} {r.estimate:+.2f}" for r in est["contrasts"].itertuples())
        text += f" (octaves; seed {est['seeds'][0]} only, no interval)"
    else:
        text = f"{intervals(est)} (octaves; seeds {est['seeds']})"
    if len(edge):
        text += "; optimum at the grid's edge: " + ", ".join(
            f"L={r.L} N={r.N}" for r in edge.itertuples())  # fmt: skip
    if k < REGISTERED_SEEDS:
        return f"undecided ({k} of {REGISTERED_SEEDS} seeds run)", (
            f"{text}; the rule on these {k} would give {v} ({why})")  # fmt: skip
    return v, f"{text}; {why}"


# ----------------------------------------------------------------------- task search


def pilot_table(pilot: pd.DataFrame) -> pd.DataFrame:
    """Per pilot configuration (the blocks that ran it merged) and (L, N): the best held-out
    loss over its lrs, that lr and its
    accuracy, and for N > 1 or L > 1 the gap to (L = 1, N = 1) of the same configuration;
    ``qualifies`` marks an (L = 1, N = 8) row that meets the search's condition."""
    rows = []
    for key, g in pilot.groupby(PILOT_KEYS, sort=False):
        base = None
        for (L, N), h in g.groupby(["L", "N"], sort=True):
            b = h.loc[h["loss"].astype(float).idxmin()]
            row = {"block": "+".join(dict.fromkeys(g["block"])),
                   **dict(zip(PILOT_KEYS, key, strict=True))}  # fmt: skip
            row.update(L=int(L), N=int(N), n_lrs=len(h), best_lr=float(b["lr"]),
                       best_loss=float(b["loss"]), acc=float(b["acc"]))  # fmt: skip
            base = row if (L, N) == (1, 1) else base
            rows.append(row)
        for row in rows[-g.groupby(["L", "N"]).ngroups :]:
            gap = row["best_loss"] - base["best_loss"] if base else math.nan
            acc = row["acc"] - base["acc"] if base else math.nan
            row.update(gap_nats=gap, gap_acc=acc, qualifies=bool(
                (row["L"], row["N"]) == (1, N_HI) and (gap <= -QUALIFY_NATS or acc >= QUALIFY_ACC)
            ))  # fmt: skip
    return pd.DataFrame(rows)


def pilot_markdown(pilot: pd.DataFrame) -> str:
    """The task search as a markdown table and one line saying whether any task qualified."""
    t = pilot_table(pilot)
    lines = ["| block | task | m | hops | batch | steps | L | N | lrs | best lr | loss | acc |"
             " vs L=1 N=1 |", "|" + "---|" * 13]  # fmt: skip
    for r in t.itertuples():
        gap = "" if (r.L, r.N) == (1, 1) else f"{r.gap_nats:+.3f} nats, {100 * r.gap_acc:+.1f} pt"
        lines.append(f"| {r.block} | {r.task} | {r.m} | {r.hops} | {r.batch} | {r.steps} | {r.L} "
                     f"| {r.N} | {r.n_lrs} | 2^{math.log2(r.best_lr):.0f} | {r.best_loss:.3f} "
                     f"| {100 * r.acc:.1f} % | {gap} |")  # fmt: skip
    ok = t[t["qualifies"]]
    lines.append("")
    lines.append(f"Qualifying configurations (N = 8 at least {QUALIFY_NATS} nats or "
                 f"{100 * QUALIFY_ACC:.0f} points better than N = 1): "
                 + (", ".join(f"block {b}" for b in ok["block"]) or "**none**"))  # fmt: skip
    return "\n".join(lines)


def pilot_figure(pilot: pd.DataFrame, path: str | None = None):
    """The task search at a glance: per pilot configuration, the best held-out loss of each arm
    minus that of (L = 1, N = 1) (each at its best lr), the qualifying line -QUALIFY_NATS dashed.
    Returns the Figure (saved to ``path`` when given)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = pilot_table(pilot)
    t = t[~((t["L"] == 1) & (t["N"] == 1))]
    labels = [f"{r.block}: {r.task} m{r.m} k{r.hops}, {r.steps} st" for r in t.itertuples()]
    t = t.assign(config=labels, arm=[f"L={r.L}, N={r.N}" for r in t.itertuples()])
    order = list(dict.fromkeys(labels))
    fig, ax = plt.subplots(figsize=(6.4, 0.42 * len(order) + 1.2))
    markers = {"L=1, N=8": "o", "L=1, N=2": "^", "L=2, N=1": "s"}
    for arm, g in t.groupby("arm"):
        y = [order.index(c) for c in g["config"]]
        ax.scatter(g["gap_nats"], y, marker=markers.get(arm, "x"), label=arm, zorder=3)
    ax.axvline(0, color="grey", lw=1)
    ax.axvline(-QUALIFY_NATS, color="red", ls="--", lw=1, label="N = 8 must reach this")
    ax.set_yticks(range(len(order)), order, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("best held-out loss minus that of L = 1, N = 1 (nats; < 0: better)")
    n_ok = int(t["qualifies"].sum())
    ax.set_title(
        f"Task search (eps = 1/(N sqrt L)): {n_ok or 'no'} N = 8 arm(s) qualify", fontsize=9
    )
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
    return fig
