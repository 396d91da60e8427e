"""The reachability redesign (issue 39.4): its pre-stated claims, judged from the runs.

Pre-registered in docs/studies/reachability.md ("Redesign — pre-registration") before any
cell: ``reach_redesign.csv`` holds pre-norm + outer norm and post-norm without it
(``norm="post"``), recall {none, add, internal}, 5 seeds per task. :func:`redesign_claims`
judges

- per recall, "the outer norm is what makes fixed points reachable": mean reach fraction
  (pre-norm + outer norm) − (post-norm, no outer norm), 10 vs 10 runs, bootstrap stratified
  by task: *holds* if the interval lies above 0.1, *fails* if it lies inside ±0.1, else
  undecided (as registered; an interval below −0.1 is undecided too, and says so);
- A, A′, "recall does not change reachability" and "internal competitive with standard recall"
  with the 64-input study's criteria (:func:`~studies.reachability.analysis64.study_claims`)
  on the outer-norm arm, now with 10 runs per arm.

As in the 64-input study a reach verdict that flips when each miss is counted at 2 x the hard
cap (``reach_frac_2x``) is undecided. :func:`redesign_summary` gives one row per arm.

Example::

    runs = pd.read_csv("studies/reachability/reach_redesign.csv")
    redesign_claims(runs)[["claim", "verdict"]]
"""

from __future__ import annotations

import math

import pandas as pd

from studies.reachability.analysis64 import MIN_RUNS, _groups, _mci, boot_mean, study_claims

MARGIN = 0.1  # the outer-norm contrast's pre-stated margin
#: The 64-input study's claims the redesign judges again (by their first words).
REJUDGED = ("A: ", "A': ", "with outer norm on, recall", "internal recall is competitive")


def _outer_side(lo: float, hi: float) -> str:
    if lo > MARGIN:
        return "holds"
    if -MARGIN < lo and hi < MARGIN:
        return "fails"
    if hi < -MARGIN:
        return (
            "undecided (the interval lies below -0.1: more is reached without the outer "
            "norm; the registered rule has no verdict for this side)"
        )
    return "undecided"


def outer_norm_claims(runs: pd.DataFrame, *, n_boot: int = 2000) -> list[dict]:
    """Per recall: reach (pre-norm + outer norm) − (post-norm, no outer norm), judged."""
    on = runs["outer_norm"].astype(bool) & (runs["norm"] == "pre")
    post = ~runs["outer_norm"].astype(bool) & (runs["norm"] == "post")
    rows = []
    for recall in ("none", "add", "internal"):
        a, b = runs[on & (runs["recall"] == recall)], runs[post & (runs["recall"] == recall)]
        n = min(len(a), len(b))
        est = (boot_mean(_groups(a, "reach_frac", ["task"]), _groups(b, "reach_frac", ["task"]),
                         n_boot=n_boot) if n else (math.nan,) * 3)  # fmt: skip
        v = _outer_side(est[1], est[2])
        if n and not v.startswith("undecided"):
            e2 = boot_mean(_groups(a, "reach_frac_2x", ["task"]),
                           _groups(b, "reach_frac_2x", ["task"]), n_boot=n_boot)  # fmt: skip
            v2 = _outer_side(e2[1], e2[2])
            v = v if v2 == v else f"undecided (flips with the cap: {v} at it, {v2} at 2x)"
        if n < MIN_RUNS:
            v = f"undecided ({n} runs, {MIN_RUNS} needed)"
        elif v == "undecided":
            v = (f"undecided (the interval [{est[1]:.2f}, {est[2]:.2f}] lies neither above "
                 f"{MARGIN:g} nor inside ±{MARGIN:g}; {n} vs {n} runs)")  # fmt: skip
        rows.append({
            "claim": f"recall {recall}: the outer norm is what makes fixed points reachable",
            "runs": n, "estimate": est[0], "ci_low": est[1], "ci_high": est[2],
            "measured": f"reach (pre-norm + outer norm) {a['reach_frac'].mean():.2f} − "
            f"(post-norm) {b['reach_frac'].mean():.2f} = {_mci(est)}, {len(a)} vs {len(b)} runs",
            "expected": f"interval above {MARGIN:g} (fails inside ±{MARGIN:g})", "verdict": v,
        })  # fmt: skip
    return rows


def redesign_claims(runs: pd.DataFrame, *, n_boot: int = 2000) -> pd.DataFrame:
    """The redesign's pre-stated claims, one row each: ``claim, runs, estimate, ci_low,
    ci_high, measured, expected, verdict`` (``holds`` / ``fails`` / ``undecided (why)``)."""
    rows = outer_norm_claims(runs, n_boot=n_boot)
    outer = runs[runs["outer_norm"].astype(bool) & (runs["norm"] == "pre")]
    again = study_claims(outer, n_boot=n_boot)
    keep = again["claim"].map(lambda c: c.startswith(REJUDGED))
    return pd.concat([pd.DataFrame(rows), again[keep]], ignore_index=True)


def redesign_summary(runs: pd.DataFrame) -> pd.DataFrame:
    """Per task x recall x arm: runs, mean reach fraction (at the cap rule, at 2 x the hard
    cap), misses not contracting, iterations, rho at reached points, distinct / reached,
    local sensitivity, accuracies, training steps and how many runs plateaued."""
    arm = runs["norm"] + runs["outer_norm"].map({True: " + outer norm", False: ""})
    agg = (
        runs.assign(arm=arm)
        .groupby(["task", "recall", "arm"], sort=False)
        .agg(
            runs=("seed", "size"),
            reach=("reach_frac", "mean"),
            reach_2x=("reach_frac_2x", "mean"),
            miss_not_contracting=("miss_not_contracting", "sum"),
            iter_median=("iter_median", "median"),
            rate_median=("rate_median", "median"),
            rho_reached_max=("rho_max", "max"),
            distinct_frac=("distinct_frac", "mean"),
            local_sens=("local_sensitivity", "median"),
            acc_R4=("acc_R4", "mean"),
            acc_R16=("acc_R16", "mean"),
            steps=("steps", "median"),
            plateau=("stop", lambda s: int((s == "plateau").sum())),
        )
    )
    return agg.reset_index()
