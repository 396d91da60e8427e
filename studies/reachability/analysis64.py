"""The 64-input reachability study (issue 30.3): its pre-stated claims, judged from the runs.

Pre-registered in docs/studies/reachability.md before the run: :func:`study_claims` judges
``studies/reachability/reach_runs.csv`` (reach fraction per run over 64 held-out inputs,
distinct fixed points, local constancy) by the thresholds below with stratified bootstrap
intervals (:func:`boot_mean`); :func:`study_summary` gives one row per arm. Both feed the
verdict table (:mod:`studies.verdicts`).

Example::

    runs = pd.read_csv("studies/reachability/reach_runs.csv")
    study_claims(runs)[["claim", "verdict"]]
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

MIN_RUNS = 4  # runs per arm below which a reachability verdict is undecided

#: Its pre-stated thresholds: reach fraction (claims A, A'), the outer-norm and recall
#: contrasts, the internal-vs-standard accuracy margin, and claim C's distinct/reached ratio.
STUDY_REACH, STUDY_OUTER, STUDY_RECALL, STUDY_ACC, STUDY_DISTINCT = 0.8, 0.1, 0.1, 0.02, 0.5
STUDY_MIN_REACHED = 8  # claim C counts fixed points only in runs with this many reached inputs


def boot_mean(groups_a: list, groups_b: list | None = None, *, n_boot: int = 2000,
              seed: int = 0) -> tuple[float, float, float]:  # fmt: skip
    """Mean of the pooled values ``groups_a`` (minus that of ``groups_b``) with its 95 %
    percentile bootstrap interval; each group (a stratum: a task, a task x recall) is
    resampled with replacement within itself, so the design's balance is kept."""
    rng = np.random.default_rng(seed)
    sides = [[np.asarray(g, dtype=float) for g in gs] for gs in (groups_a, groups_b or [])]

    def mean(gs, draw):
        vals = [g[rng.integers(0, len(g), len(g))] if draw else g for g in gs]
        return float(np.concatenate(vals).mean())

    def stat(draw):
        return mean(sides[0], draw) - (mean(sides[1], draw) if sides[1] else 0.0)

    boots = np.array([stat(True) for _ in range(n_boot)])
    return stat(False), float(np.quantile(boots, 0.025)), float(np.quantile(boots, 0.975))


def _groups(runs: pd.DataFrame, col: str, by: list) -> list:
    return [g[col].to_numpy(dtype=float) for _, g in runs.groupby(by, sort=True)]


def _side(lo: float, hi: float, holds_above: float, fails_below: float) -> str:
    return "holds" if lo > holds_above else "fails" if hi < fails_below else "undecided"


def study_claims(runs: pd.DataFrame, *, n_boot: int = 2000) -> pd.DataFrame:
    """The pre-stated claims of the 64-input study, one row each: ``claim, runs, estimate,
    ci_low, ci_high, measured, expected, verdict`` (``holds`` / ``fails`` / ``undecided (why)``;
    undecided whenever a group has fewer than ``MIN_RUNS`` runs, or a reach-fraction verdict
    changes when each miss is counted at 2x the hard cap, as registered)."""
    on, rows = runs["outer_norm"].astype(bool), []

    def row(claim, n, est, expected, verdict, measured=""):
        m, lo, hi = est
        if n < MIN_RUNS:
            verdict = f"undecided ({n} runs, {MIN_RUNS} needed)"
        elif verdict == "undecided":
            verdict = f"undecided (the interval {_fmt(lo, hi)} contains the threshold; {n} runs)"
        rows.append({"claim": claim, "runs": n, "estimate": m, "ci_low": lo, "ci_high": hi,
                     "measured": measured, "expected": expected, "verdict": verdict})  # fmt: skip

    for recall, name in (("add", "A: standard recall"), ("internal", "A': internal recall")):
        sub = runs[on & (runs["recall"] == recall)]
        est = boot_mean(_groups(sub, "reach_frac", ["task"]), n_boot=n_boot) if len(sub) else (
            math.nan,) * 3  # fmt: skip
        v = _side(est[1], est[2], STUDY_REACH, STUDY_REACH)
        if len(sub) and v != "undecided":
            e2 = boot_mean(_groups(sub, "reach_frac_2x", ["task"]), n_boot=n_boot)
            v2 = _side(e2[1], e2[2], STUDY_REACH, STUDY_REACH)
            v = v if v2 == v else f"undecided (flips with the cap: {v} at it, {v2} at 2x)"
        row(f"{name} + outer norm reliably reach a fixed point", len(sub), est,
            f"mean reach fraction: interval above {STUDY_REACH:g} (fails below)", v,
            f"reach fraction {_mci(est)} over {len(sub)} runs x 64 inputs")  # fmt: skip
    by = ["task", "recall"]

    def contrast(a, b, judge):  # judged at the cap rule and, as registered, at 2x the hard cap
        if not (len(a) and len(b)):
            return (math.nan,) * 3, "undecided"
        est, e2 = (boot_mean(_groups(a, c, by), _groups(b, c, by), n_boot=n_boot)
                   for c in ("reach_frac", "reach_frac_2x"))  # fmt: skip
        v, v2 = judge(*est[1:]), judge(*e2[1:])
        return est, v if v2 == v or v == "undecided" else (
            f"undecided (flips with the cap: {v} at it, {v2} at 2x)")  # fmt: skip

    est, v = contrast(runs[on], runs[~on], lambda lo, hi: _side(lo, hi, 0.0, STUDY_OUTER))
    row("outer norm makes fixed points reachable", int(min(on.sum(), (~on).sum())), est,
        f"on - off: interval above 0 (fails below {STUDY_OUTER:g})", v,
        f"reach on - off {_mci(est)}")  # fmt: skip
    rec, none = runs[on & (runs["recall"] != "none")], runs[on & (runs["recall"] == "none")]
    est, v = contrast(rec, none, lambda lo, hi: "holds" if -STUDY_RECALL < lo and hi <
                      STUDY_RECALL else "fails" if lo >= STUDY_RECALL or hi <= -STUDY_RECALL
                      else "undecided")  # fmt: skip
    row("with outer norm on, recall does not change reachability", min(len(rec), len(none)),
        est, f"recall - none: interval inside ±{STUDY_RECALL:g} (fails outside it)", v,
        f"reach recall - none {_mci(est)}")  # fmt: skip
    pair = (
        runs[on & runs["recall"].isin(["add", "internal"])]
        .pivot_table(index=["task", "seed"], columns="recall", values="acc_R4")
        .dropna()
    )
    diff = (pair.get("internal", pd.Series(dtype=float)) - pair.get("add", pd.Series(
        dtype=float))).dropna()  # fmt: skip
    est = boot_mean([g.to_numpy() for _, g in diff.groupby(level="task")], n_boot=n_boot) if len(
        diff) else (math.nan,) * 3  # fmt: skip
    per_task = "; ".join(f"{t} {g.mean():+.3f}" for t, g in diff.groupby(level="task"))
    row("internal recall is competitive with standard recall once outer norm is on", len(diff),
        est, f"accuracy at R, internal - add (paired): interval above -{STUDY_ACC:g}",
        _side(est[1], est[2], -STUDY_ACC, -STUDY_ACC),
        f"acc internal - add {_mci(est)}; per task {per_task or 'none'}")  # fmt: skip
    q = runs[(runs["recall"] == "none") & (runs["reached"] >= STUDY_MIN_REACHED)]
    est = boot_mean(_groups(q, "distinct_frac", ["task", "outer_norm"]), n_boot=n_boot) if len(
        q) else (math.nan,) * 3  # fmt: skip
    qr = runs[(runs["recall"] != "none") & (runs["reached"] >= STUDY_MIN_REACHED)]
    row("C: without recall, inputs select among few fixed points", len(q), est,
        f"mean distinct / reached: interval below {STUDY_DISTINCT:g} (fails above)",
        _side(-est[2], -est[1], -STUDY_DISTINCT, -STUDY_DISTINCT),
        f"distinct / reached {_mci(est)} over {len(q)} runs (recall: "
        f"{qr['distinct_frac'].mean():.2f} over {len(qr)}); local sensitivity median "
        f"{q['local_sensitivity'].median():.2g} (recall {qr['local_sensitivity'].median():.2g}); "
        f"distinct outputs / inputs {q['distinct_outputs'].sum():.0f}/"
        f"{q['distinct_inputs'].sum():.0f}")  # fmt: skip
    return pd.DataFrame(rows)


def _fmt(lo: float, hi: float) -> str:
    return f"[{lo:.2f}, {hi:.2f}]"


def _mci(est: tuple) -> str:
    return f"{est[0]:.2f} {_fmt(est[1], est[2])}"


def study_summary(runs: pd.DataFrame) -> pd.DataFrame:
    """Per task x recall x outer norm of the 64-input study: runs, mean reach fraction (at the
    cap rule, at 2x the hard cap), rho at reached fixed points (median of the run medians,
    largest), distinct / reached, distinct outputs, local sensitivity, accuracies, steps."""
    agg = runs.groupby(["task", "recall", "outer_norm"], sort=False).agg(
        runs=("seed", "size"),
        reach=("reach_frac", "mean"),
        reach_2x=("reach_frac_2x", "mean"),
        rho_reached=("rho_median", "median"),
        rho_reached_max=("rho_max", "max"),
        distinct_frac=("distinct_frac", "mean"),
        distinct_outputs=("distinct_outputs", "mean"),
        local_sens=("local_sensitivity", "median"),
        acc_R4=("acc_R4", "mean"),
        acc_R16=("acc_R16", "mean"),
        acc_fixed=("acc_fixed", "mean"),
        steps=("steps", "median"),
    )
    return agg.reset_index()
