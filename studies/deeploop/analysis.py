"""DeepLoop against its baselines across R (issue 30.1): paired intervals, verdicts, p-sweep.

The training runs live in ``studies/deeploop/run.py`` (CPU-hours, outside CI); its long CSV (one
row per cell and checkpoint) is committed as ``studies/deeploop/deeploop_study.csv``. This
module holds only the analysis and the criteria pre-registered in ``docs/studies/deeploop.md``
(committed before the study ran).

Claims (seed 002, Sec. 5: "neutral when no block is revisited, better once recurrent depth is
active"), judged per baseline from the seed-paired differences ``d_s = loss(deeploop, s) -
loss(baseline, s)`` of the final held-out loss, with a two-sided 95 % t interval over seeds:

- *neutral at R = 1*: holds when the interval lies inside ``(-DELTA, DELTA)``, fails when it
  lies entirely outside ``[-DELTA, DELTA]``;
- *improves at R > 1* (each of R = 3, 7): holds when the interval lies below 0, fails when it
  lies above 0;
- the claim holds when all three hold, fails when one fails; else undecided. A comparison
  with fewer than ``MIN_SEEDS`` pairs is undecided whatever its interval.

The baseline of the seed is ``post`` (alpha = beta = 1; the primary verdict); ``deepnorm``
(p = 1/4) is the secondary one. A run whose final loss is not finite counts as
``FAILED_LOSS`` = ln 256 (a model that learned nothing). The p-sweep (seed 002, App. C)
counts, per exponent p at R = 3, the seeds whose held-out loss escaped the unigram floor.

Example::

    cells = pd.read_csv("studies/deeploop/deeploop_study.csv")
    table = comparisons(cells)          # baseline, R, n, diff, ci_low, ci_high, verdict, ...
    claim(table, "post"), p_boundary(p_sweep(cells))
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pandas as pd
from scipy import stats

__all__ = [
    "ARMS", "DELTA", "MIN_SEEDS", "RS", "claim", "comparisons", "figure", "final_losses",
    "p_boundary", "p_sweep", "power_improves", "power_neutral", "seeds_needed",
    "summary_markdown", "unigram_floor",
]  # fmt: skip

ARMS = ("post", "deepnorm", "deeploop")
RS = (1, 3, 7)
TARGET, BASELINES = "deeploop", ("post", "deepnorm")  # the first baseline is the seed's
P_SWEEP_R = 3
P_GRID = (0.0, 0.25, 0.30, 0.35, 0.40, 0.45, 0.50, 0.55, 0.60)
SHARED_P = {0.0: "post", 0.25: "deepnorm", 0.50: "deeploop"}  # = these arms' R = 3 cells
#: Pre-registered (docs/studies/deeploop.md): equivalence margin of "neutral", nats
DELTA = 0.016
GAIN = 0.016  # the smallest gain the seed reports at R > 1 (R = 3, GPT-2 small), nats
MIN_SEEDS = 6
MIN_P_SEEDS = 4
LEVEL = 0.95
FAILED_LOSS = math.log(256)
ESCAPE_MARGIN = 0.1  # nats below the unigram floor of the val split
ESCAPE_STEP = None  # checkpoint at which escape is judged (None: the final one)
EARLY_STEP = 250  # secondary: escape by the second checkpoint of a 1000-step run
N_BOOT = 10_000


@functools.lru_cache(maxsize=1)
def unigram_floor() -> float:
    """Entropy (nats) of the byte frequencies of the val split of ``lp.tasks.stdlib_text``:
    the loss of a model that learned only how often each byte occurs."""
    from loopprobe import tasks

    data = tasks._stdlib_corpus()  # the corpus the task draws from (this interpreter's)
    val = data[int(len(data) * (1.0 - tasks._VAL_FRACTION)) :].numpy()
    f = np.bincount(val, minlength=256) / len(val)
    f = f[f > 0]
    return float(-(f * np.log(f)).sum())


# ------------------------------------------------------------------------------ cells


def final_losses(cells: pd.DataFrame, floor: float | None = None, step=None) -> pd.DataFrame:
    """One row per cell: arm, p, R, seed, loss (at ``step``, default the final checkpoint;
    non-finite -> FAILED_LOSS), ``failed`` (it was non-finite) and ``escaped`` (loss below
    ``floor - ESCAPE_MARGIN``; floor defaults to :func:`unigram_floor`)."""
    need = {"arm", "p", "R", "seed", "step", "val_loss", "final"}
    if missing := need - set(cells.columns):
        raise ValueError(f"final_losses: cells lack columns {sorted(missing)}")
    floor = unigram_floor() if floor is None else floor
    rows = cells[cells["final"].astype(bool)] if step is None else cells[cells["step"] == step]
    out = rows[["arm", "p", "R", "seed"] + (["cpu_s"] if "cpu_s" in rows else [])].copy()
    v = rows["val_loss"].astype(float).to_numpy()
    out["failed"] = ~np.isfinite(v)
    out["loss"] = np.where(np.isfinite(v), v, FAILED_LOSS)
    out["escaped"] = out["loss"] < floor - ESCAPE_MARGIN
    return out.reset_index(drop=True)


def _pairs(final: pd.DataFrame, R: int, a: str, b: str) -> np.ndarray:
    """``loss(a, s) - loss(b, s)`` over the seeds that have both cells at R."""
    sub = final[(final["R"] == R) & final["arm"].isin([a, b])]
    wide = sub.pivot_table(index="seed", columns="arm", values="loss", aggfunc="first")
    if a not in wide or b not in wide:
        return np.array([])
    wide = wide.dropna(subset=[a, b])
    return (wide[a] - wide[b]).to_numpy(dtype=float)


def t_interval(d: np.ndarray, level: float = LEVEL) -> tuple[float, float, float, float]:
    """mean, sd and the two-sided t interval of the mean of ``d`` (NaN below 2 values)."""
    n = len(d)
    if n < 2:
        m = float(d.mean()) if n else math.nan
        return m, math.nan, math.nan, math.nan
    m, sd = float(d.mean()), float(d.std(ddof=1))
    h = stats.t.ppf(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
    return m, sd, m - h, m + h


def boot_interval(d: np.ndarray, level: float = LEVEL, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap over seeds of the mean of ``d`` (secondary; NaN below 2 values)."""
    if len(d) < 2:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, len(d), (N_BOOT, len(d)))].mean(axis=1)
    q = np.quantile(means, [0.5 - level / 2, 0.5 + level / 2])
    return float(q[0]), float(q[1])


# ------------------------------------------------------------------------------ power


def power_improves(sd: float, n: int, gain: float = GAIN, level: float = LEVEL) -> float:
    """P(the t interval lies below 0) when the true difference is ``-gain`` (noncentral t)."""
    if n < 2 or not sd > 0:
        return math.nan
    tc = stats.t.ppf(0.5 + level / 2, n - 1)
    return float(stats.nct.cdf(-tc, n - 1, -gain / (sd / math.sqrt(n))))


def power_neutral(sd: float, n: int, delta: float = DELTA, level: float = LEVEL) -> float:
    """P(the t interval lies inside (-delta, delta)) when the true difference is 0 (normal
    approximation of the mean, sd taken as known)."""
    if n < 2 or not sd > 0:
        return math.nan
    se = sd / math.sqrt(n)
    room = delta - stats.t.ppf(0.5 + level / 2, n - 1) * se
    return max(0.0, float(2 * stats.norm.cdf(room / se) - 1))


def seeds_needed(sd: float, power: float = 0.8, kind: str = "improves", cap: int = 200) -> int:
    """Fewest seeds (>= 2) whose power reaches ``power`` at this paired sd (``cap + 1``: none)."""
    f = {"improves": power_improves, "neutral": power_neutral}[kind]
    return next((n for n in range(2, cap + 1) if f(sd, n) >= power), cap + 1)


# ------------------------------------------------------------------------------ verdicts


def _verdict(kind: str, n: int, lo: float, hi: float, sd: float) -> tuple[str, str]:
    if n < MIN_SEEDS:
        return "undecided", f"{n} seed pairs < the pre-stated minimum {MIN_SEEDS}"
    if kind == "neutral":
        if -DELTA < lo and hi < DELTA:
            return "holds", f"interval inside ±{DELTA}"
        if lo >= DELTA or hi <= -DELTA:
            return "fails", f"interval outside ±{DELTA}"
        return "undecided", (f"interval crosses ±{DELTA}; power to show neutrality at a true 0: "
                             f"{power_neutral(sd, n):.2f}")  # fmt: skip
    if hi < 0:
        return "holds", "interval below 0"
    if lo > 0:
        return "fails", "interval above 0 (DeepLoop worse)"
    note = f"; excludes a gain of {GAIN} or more" if lo > -GAIN else ""
    return "undecided", (f"interval contains 0; power to resolve a gain of {GAIN}: "
                         f"{power_improves(sd, n):.2f}{note}")  # fmt: skip


def comparisons(cells: pd.DataFrame, floor: float | None = None) -> pd.DataFrame:
    """Per baseline and R: pairs, mean paired difference (deeploop - baseline), sd, t and
    bootstrap intervals, the criterion, verdict and reason."""
    final = final_losses(cells, floor=floor)
    rows = []
    for b in BASELINES:
        for R in RS:
            d = _pairs(final, R, TARGET, b)
            m, sd, lo, hi = t_interval(d)
            blo, bhi = boot_interval(d)
            kind = "neutral" if R == 1 else "improves"
            verdict, reason = _verdict(kind, len(d), lo, hi, sd)
            failed = final[(final["R"] == R) & final["arm"].isin([TARGET, b])]["failed"].sum()
            rows.append({"baseline": b, "R": R, "n": len(d), "diff": m, "sd": sd,
                         "ci_low": lo, "ci_high": hi, "boot_low": blo, "boot_high": bhi,
                         "failed_runs": int(failed), "criterion": kind, "verdict": verdict,
                         "reason": reason})  # fmt: skip
    return pd.DataFrame(rows)


def claim(table: pd.DataFrame, baseline: str = "post") -> tuple[str, str]:
    """The seed's claim against one baseline: holds when neutral at R = 1 and improves at
    every R > 1, fails when one of them fails, else undecided; with the per-R verdicts."""
    t = table[table["baseline"] == baseline].sort_values("R")
    if t.empty:
        return "undecided", f"no comparison against {baseline}"
    parts = ", ".join(f"R={r.R} {r.criterion} {r.verdict}" for r in t.itertuples())
    v = set(t["verdict"])
    if "fails" in v:
        return "fails", parts
    if v == {"holds"} and set(t["R"]) == set(RS):
        return "holds", parts
    return "undecided", parts


# ------------------------------------------------------------------------------ p-sweep


def p_sweep(cells: pd.DataFrame, floor: float | None = None, step=ESCAPE_STEP) -> pd.DataFrame:
    """Per p at R = 3: seeds, escaped seeds, escape fraction, mean loss. Only seeds that ran
    the p-sweep (the ``postp`` arm) count; p = 0, 1/4 and 1/2 are their post, deepnorm and
    deeploop cells. ``step``: the checkpoint judged (None: the final one)."""
    final = final_losses(cells, floor=floor, step=step)
    final = final[final["R"] == P_SWEEP_R]
    seeds = set(final.loc[final["arm"] == "postp", "seed"])
    rows = []
    for p in P_GRID:
        if p in SHARED_P:
            g = final[(final["arm"] == SHARED_P[p]) & final["seed"].isin(seeds)]
        else:
            g = final[(final["arm"] == "postp") & np.isclose(final["p"].astype(float), p)]
        n = len(g)
        rows.append({"p": p, "seeds": n, "escaped": int(g["escaped"].sum()),
                     "frac": g["escaped"].mean() if n else math.nan,
                     "loss": g["loss"].mean() if n else math.nan,
                     "loss_sd": g["loss"].std() if n > 1 else math.nan})  # fmt: skip
    return pd.DataFrame(rows)


def p_boundary(sweep_table: pd.DataFrame) -> dict:
    """The stability boundary p* (smallest grid p from which every larger p escaped in every
    seed; NaN if the largest p did not) and the pre-registered verdict on "near p = 1/2"."""
    t = sweep_table.sort_values("p").reset_index(drop=True)
    few = t[t["seeds"] < MIN_P_SEEDS]
    all_in = t["frac"].to_numpy() == 1.0
    p_star = math.nan
    for i in range(len(t) - 1, -1, -1):
        if not all_in[i]:
            break
        p_star = float(t["p"][i])
    low = float(t.loc[np.isclose(t["p"], 0.30), "frac"].iloc[0])
    high = float(t["frac"].iloc[-1])
    desc = f"p* = {p_star:g}, escaped at p=0.30: {low:.2f}, at p={t['p'].iloc[-1]:g}: {high:.2f}"
    if len(few):
        return {"p_star": p_star, "verdict": "undecided",
                "reason": f"p with < {MIN_P_SEEDS} seeds: {list(few['p'])}; {desc}"}  # fmt: skip
    if 0.45 - 1e-9 <= p_star <= 0.55 + 1e-9 and low <= 0.5:
        verdict = "holds"
    elif p_star <= 0.35 + 1e-9 or (math.isnan(p_star) and high <= 0.5):
        verdict = "fails"
    else:
        verdict = "undecided"
    return {"p_star": p_star, "verdict": verdict, "reason": desc}


# ------------------------------------------------------------------------------ present


def _md(df: pd.DataFrame) -> str:
    def cell(v):
        if isinstance(v, float | np.floating):
            return "–" if not math.isfinite(v) else f"{v:.4f}" if abs(v) < 10 else f"{v:.1f}"
        return str(v)

    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in df.itertuples(index=False)]
    return "\n".join(lines)


def arm_table(cells: pd.DataFrame, floor: float | None = None) -> pd.DataFrame:
    """Per arm and R: seeds, mean and sd of the final held-out loss, escaped and failed runs,
    CPU seconds per cell."""
    final = final_losses(cells, floor=floor)
    if "cpu_s" not in final:
        final["cpu_s"] = math.nan
    g = final[final["arm"].isin(ARMS)].groupby(["arm", "R"], sort=False)
    return g.agg(seeds=("loss", "size"), loss=("loss", "mean"), sd=("loss", "std"),
                 escaped=("escaped", "sum"), failed=("failed", "sum"),
                 cpu_s=("cpu_s", "mean")).reset_index()  # fmt: skip


def summary_markdown(cells: pd.DataFrame, floor: float | None = None) -> str:
    """Every pre-registered table and verdict as markdown (what the study script prints)."""
    floor = unigram_floor() if floor is None else floor
    table = comparisons(cells, floor)
    out = [f"unigram floor (val split): {floor:.4f} nats; escaped = below floor - "
           f"{ESCAPE_MARGIN}", "", "### Final held-out loss per arm", "",
           _md(arm_table(cells, floor)), "",
           f"### Paired differences {TARGET} - baseline (95 % t; bootstrap secondary)", "",
           _md(table.drop(columns=["reason"])), ""]  # fmt: skip
    out += [f"- {r.baseline} R={r.R}: {r.verdict} ({r.reason})" for r in table.itertuples()]
    for b in BASELINES:
        v, why = claim(table, b)
        out.append(f"- **claim vs {b}: {v}** ({why})")
    if (cells["arm"] == "postp").any():
        t = p_sweep(cells, floor)
        b = p_boundary(t)
        out += ["", f"### p-sweep at R = {P_SWEEP_R}", "", _md(t), "",
                f"- **boundary near p = 1/2: {b['verdict']}** ({b['reason']})"]  # fmt: skip
        early = p_sweep(cells, floor, step=EARLY_STEP)
        out.append(
            f"- secondary, escaped by step {EARLY_STEP}: "
            + ", ".join(f"p={r.p:g} {r.escaped}/{r.seeds}" for r in early.itertuples())
        )
    cpu = cells[cells["final"].astype(bool)]["cpu_s"].sum() if "cpu_s" in cells else math.nan
    out += ["", f"CPU time of these cells: {cpu / 60:.1f} CPU-minutes"]
    return "\n".join(out)


def figure(cells: pd.DataFrame, path: str, floor: float | None = None) -> None:
    """Four panels: paired differences vs R, loss per arm vs R, the R = 3 loss curves, and
    the p-sweep's escape fraction and loss (written to ``path``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    floor = unigram_floor() if floor is None else floor
    fig, ax = plt.subplots(1, 4, figsize=(17, 3.6))
    table = comparisons(cells, floor)
    for i, b in enumerate(BASELINES):
        t = table[table["baseline"] == b]
        x = np.arange(len(t)) + (i - 0.5) * 0.15
        ax[0].errorbar(x, t["diff"], yerr=[t["diff"] - t["ci_low"], t["ci_high"] - t["diff"]],
                       fmt="o", capsize=3, label=f"{TARGET} - {b}")  # fmt: skip
    ax[0].plot(range(len(RS)), [0.0004, -0.0160, -0.0186], "k*", label="seed 002 (GPT-2 small)")
    ax[0].axhline(0, color="k", lw=0.5)
    ax[0].axhspan(-DELTA, DELTA, xmin=0, xmax=1 / len(RS), color="C2", alpha=0.2)
    ax[0].set(xticks=range(len(RS)), xticklabels=[f"R={r}" for r in RS],
              ylabel="paired loss difference (nats, 95 % t)")  # fmt: skip
    ax[0].legend(fontsize=7)
    at = arm_table(cells, floor)
    for arm in ARMS:
        t = at[at["arm"] == arm]
        ax[1].errorbar(t["R"], t["loss"], yerr=t["sd"] / np.sqrt(t["seeds"]), marker="o",
                       capsize=3, label=arm)  # fmt: skip
    ax[1].axhline(floor, color="k", ls=":", lw=1, label="unigram floor")
    ax[1].set(xlabel="R", ylabel="final held-out loss (mean ± se)", xticks=list(RS))
    ax[1].legend(fontsize=7)
    curves = cells[(cells["R"] == P_SWEEP_R) & cells["arm"].isin(ARMS)]
    for i, arm in enumerate(ARMS):  # one thin line per seed: a run left on the floor shows
        for j, (_, g) in enumerate(curves[curves["arm"] == arm].groupby("seed")):
            ax[2].plot(g["step"], g["val_loss"], color=f"C{i}", lw=0.8, alpha=0.7,
                       label=arm if j == 0 else None)  # fmt: skip
    ax[2].axhline(floor, color="k", ls=":", lw=1)
    ax[2].set(xlabel="step", ylabel=f"held-out loss at R = {P_SWEEP_R} (per seed)")
    ax[2].legend(fontsize=7)
    if (cells["arm"] == "postp").any():
        t = p_sweep(cells, floor)
        ax[3].bar(t["p"], t["frac"], width=0.035, color="C7", label="escaped fraction")
        ax[3].axvline(0.5, color="k", lw=0.5)
        ax[3].set(xlabel="p", ylabel="escaped the unigram floor", ylim=(0, 1.05))
        tw = ax[3].twinx()
        tw.errorbar(t["p"], t["loss"], yerr=t["loss_sd"], color="C3", marker="o", capsize=3)
        tw.set_ylabel("final loss (mean ± sd)", color="C3")
    else:
        ax[3].text(0.5, 0.5, "no p-sweep cells yet", ha="center", transform=ax[3].transAxes)
    ax[3].set_title(f"p-sweep, R = {P_SWEEP_R}")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
