"""Issue 17's fixed-point reachability study (seed 003), judged from its committed runs.

Per task x recall x outer norm (:func:`loopprobe.experiments.recall_study`, cells
``reachability_study.csv`` beside this module): how many runs reached a fixed point (Picard
residual below tolerance), rho and ||dh*/dx|| there, accuracy at more loops than trained.
Claim A: with outer norm, recall (add, internal) reaches one in >= 85 % of runs (fails at
<= 50 %); claim B: ||dh*/dx|| <= 1e-8 at every reached no-recall fixed point and > 1e-3 at
every reached recall one. Superseded by the 64-input study (issue 30.3,
docs/studies/reachability.md, :mod:`studies.reachability.analysis64`).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from studies.reachability.analysis64 import MIN_RUNS

CAP_FACTOR = 2.0  # claim A is also judged as if each miss ran this many times the iterations
#: Claim B as measured: without recall T(h; x) never reads x, so ||dh*/dx|| = 0 by
#: construction; its zeros are an identity, not evidence for the seed's statement (fixed points
#: without recall are countable: inputs only select among them), which is not tested here.
NOT_EVIDENCE = "not tested (zero by construction)"
REACH_HOLDS, REACH_FAILS = 0.85, 0.5  # claim A: reached fraction with outer norm
NO_DEPENDENCE, DEPENDENCE = 1e-8, 1e-3  # claim B: ||dh*/dx|| in float64


ALPHA = 0.05  # two-sided Fisher exact test on reached counts (issue 27, stated after the data)


def reach_outer_norm_effect(runs: pd.DataFrame) -> pd.DataFrame:
    """Which factor makes a fixed point reachable, from the reached counts (Fisher's exact
    test, two-sided): outer norm on against off (every task and recall), and recall (add and
    internal) against none with outer norm on. Columns ``comparison, with, without, p,
    verdict``: ``differs`` (p < ALPHA), ``no difference detected`` (p >= ALPHA: not evidence
    of no difference) or ``undecided (k runs, MIN_RUNS needed)``."""
    from scipy.stats import fisher_exact

    reached = runs["converged"].astype(bool)
    outer = runs["outer_norm"].astype(bool)
    recall = runs["recall"] != "none"
    rows = []
    for name, yes, no in (
        ("outer norm on vs off", outer, ~outer),
        ("with outer norm: recall (add, internal) vs none", outer & recall, outer & ~recall),
    ):
        k1, n1, k0, n0 = int(reached[yes].sum()), int(yes.sum()), int(reached[no].sum()), int(
            no.sum())  # fmt: skip
        if min(n1, n0) < MIN_RUNS:
            p, verdict = math.nan, f"undecided ({min(n1, n0)} runs, {MIN_RUNS} needed)"
        else:
            p = float(fisher_exact([[k1, n1 - k1], [k0, n0 - k0]])[1])
            verdict = "differs" if p < ALPHA else "no difference detected"
        rows.append({"comparison": name, "with": f"{k1}/{n1}", "without": f"{k0}/{n0}",
                     "frac_with": k1 / n1 if n1 else math.nan,
                     "frac_without": k0 / n0 if n0 else math.nan, "p": p,
                     "verdict": verdict})  # fmt: skip
    return pd.DataFrame(rows)


def reach_summary(runs: pd.DataFrame) -> pd.DataFrame:
    """Per task x recall x outer norm: runs, reached fixed points, rho (all runs and where
    reached), ||dh*/dx|| where reached (median, min, max), accuracy at R, 2R and 4R rounds,
    training steps and how many runs stopped on the plateau rule."""
    df = runs.copy()
    reached = df["converged"].astype(bool)
    df["dep"] = df["input_dependence"].where(reached)
    df["rho_reached"] = df["spectral_radius"].where(reached)
    agg = df.groupby(["task", "recall", "outer_norm"], sort=False).agg(
        runs=("seed", "size"),
        reached=("converged", "sum"),
        rho_median=("spectral_radius", "median"),
        rho_reached_median=("rho_reached", "median"),
        dep_median=("dep", "median"),
        dep_min=("dep", "min"),
        dep_max=("dep", "max"),
        acc_R4=("acc_R4", "mean"),
        acc_R8=("acc_R8", "mean"),
        acc_R16=("acc_R16", "mean"),
        steps_median=("steps", "median"),
        train_loss=("train_loss", "mean"),
        plateaued=("stop", lambda s: int((s != "cap").sum())),
    )
    return agg.reset_index()


def reach_claims(runs: pd.DataFrame) -> pd.DataFrame:
    """Claims A and B with what was measured: columns ``claim, measured, expected, verdict``
    (``holds`` / ``fails`` / ``undecided``)."""
    reached = runs["converged"].astype(bool)
    rows = []
    on = runs[runs["outer_norm"].astype(bool)]
    fracs = {r: float(on.loc[on["recall"] == r, "converged"].astype(bool).mean())
             for r in ("add", "internal") if (on["recall"] == r).any()}  # fmt: skip
    counts = ", ".join(
        f"{r} {int(on.loc[on['recall'] == r, 'converged'].astype(bool).sum())}/"
        f"{int((on['recall'] == r).sum())}"
        for r in fracs
    )
    # the same verdict with each miss given more iterations at its own observed rate
    longer = {r: float(_reached_with(on.loc[on["recall"] == r], CAP_FACTOR).mean())
              for r in fracs}  # fmt: skip
    few = {r: int((on["recall"] == r).sum()) for r in fracs}
    few = {r: n for r, n in few.items() if n < MIN_RUNS}
    if len(fracs) < 2:
        verdict = "undecided"
    elif few:
        verdict = (
            f"undecided ({', '.join(f'{r}: {n} runs' for r, n in few.items())}; {MIN_RUNS} needed)"
        )
    else:
        verdict = _claim_a(fracs)
        if verdict != _claim_a(longer):
            verdict = (f"undecided (flips with the iteration cap: {verdict} at the cap, "
                       f"{_claim_a(longer)} with {CAP_FACTOR:g}x the iterations at each "
                       "miss's observed contraction rate)")  # fmt: skip
    rows.append({"claim": "A: recall + outer norm reliably reach a fixed point",
                 "measured": f"reached with outer norm: {counts or 'no runs'}"
                 + (f"; with {CAP_FACTOR:g}x the iterations at each miss's observed rate: "
                    + ", ".join(f"{r} {v:.0%}" for r, v in longer.items()) if fracs else ""),
                 "expected": f">= {REACH_HOLDS:.0%} for add and internal (fails at <= "
                             f"{REACH_FAILS:.0%})", "verdict": verdict})  # fmt: skip
    dep = runs["input_dependence"]
    none = reached & (runs["recall"] == "none")
    recall = reached & (runs["recall"] != "none")
    if not none.any() or not recall.any():
        verdict = "undecided"
    elif min(none.sum(), recall.sum()) < MIN_RUNS:
        verdict = (f"undecided ({int(none.sum())} reached without recall, {int(recall.sum())} "
                   f"with; {MIN_RUNS} each needed)")  # fmt: skip
    elif (dep[none] <= NO_DEPENDENCE).all() and (dep[recall] > DEPENDENCE).all():
        verdict = NOT_EVIDENCE
    else:
        verdict = "fails"  # a nonzero dependence without recall would be a bug, not a test
    measured = (
        f"no recall: max {dep[none].max():.3g} over {int(none.sum())} reached; recall: "
        f"min {dep[recall].min():.3g} over {int(recall.sum())} reached"
    )
    rows.append({"claim": "B: without recall the fixed point does not depend on the input",
                 "measured": measured, "expected": f"<= {NO_DEPENDENCE:g} without recall, "
                 f"> {DEPENDENCE:g} with", "verdict": verdict})  # fmt: skip
    return pd.DataFrame(rows)


def _claim_a(fracs: dict) -> str:
    if min(fracs.values()) <= REACH_FAILS:
        return "fails"
    return "holds" if min(fracs.values()) >= REACH_HOLDS else "undecided"


def _reached_with(runs: pd.DataFrame, factor: float) -> pd.Series:
    """Reached, or would reach ``tol`` within ``factor`` x its iteration cap at the
    contraction rate it showed (residual * rate^k <= tol)."""
    reached = runs["converged"].astype(bool)
    if not {"rate", "residual", "tol", "max_iter"} <= set(runs.columns):
        return reached  # nothing to extrapolate from
    rate, res = runs["rate"].astype(float), runs["residual"].astype(float)
    more = (np.log(runs["tol"] / res) / np.log(rate)).where((rate < 1) & (res > 0), np.inf)
    return reached | (more <= (factor - 1) * runs["max_iter"])
