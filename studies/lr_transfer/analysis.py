"""Issue 17's LR-transfer study (seed 004, Loop-muP), judged from its committed cells.

The training runs are :mod:`studies.lr_transfer.run` (hours, outside CI); their tidy cells are
committed beside it (``lr_transfer_study.csv`` run 1, ``lr_transfer_study2.csv`` run 2). This
module holds only the analysis and the criteria stated before each run
(docs/results/reproductions.md), so ``python -m studies lr_transfer`` and the verdict table
``studies/verdicts.csv`` that the report reads agree.

Per residual rule ("arm") the drift of the optimal lr from N = 1 to N = 8 loops, in octaves,
with a paired seed bootstrap (:mod:`studies.optimum`); a rule *stays* when its interval lies
inside ``(-margin, margin)``, *drifts* when entirely outside. The claim holds if 1/sqrt(N)
drifts while 1/N and loop-mup stay. The contrast ``drift(1/sqrt N) - drift(1/N)`` (predicted
-1.5) is judged against half the prediction.

Example::

    cells = pd.read_csv("studies/lr_transfer/lr_transfer_study2.csv")
    table = lr_drift(cells, half_width=4)          # arm, drift, ci_low, ci_high, verdict
    lr_claim(table), lr_contrast(cells, half_width=4)["verdict"]
"""

from __future__ import annotations

import functools

import numpy as np
import pandas as pd

from studies.optimum import (
    best_loss_gap,
    classify,
    contrast_interval,
    drift_interval,
    vertex_fixed,
    vertex_quartic,
)

__all__ = [
    "LR_RUNS",
    "MARGIN",
    "PREDICTED_DRIFT",
    "lr_claim",
    "lr_contrast",
    "lr_contrast_sensitivity",
    "lr_divergence",
    "lr_drift",
    "lr_loop_cost",
    "lr_rule_gap",
]

#: Seed 004's bound ||dh_N|| <~ eta eps N makes eta* ~ 1/(eps N): from N = 1 to 8 the optimum
#: moves by log2(1/sqrt 8) = -1.5 octaves under 1/sqrt(N), by 0 under 1/N and loop-mup.
PREDICTED_DRIFT = {"1/sqrt(N)": -1.5, "1/N": 0.0, "loop-mup": 0.0}
MARGIN = 0.75  # octaves: half the predicted 1/sqrt(N) drift
MIN_SEEDS = 4  # an optimum's interval from fewer seeds is not a verdict
#: The LR-transfer runs: cells CSV (beside this module), the vertex window (grid points each
#: side of the argmin: +-2 octaves on run 1's 1-octave and run 2's half-octave grid) and
#: whether the contrast criterion was stated before the run (run 1: post hoc).
LR_RUNS = {
    1: {"cells": "lr_transfer_study.csv", "half_width": 2, "contrast_prestated": False},
    2: {"cells": "lr_transfer_study2.csv", "half_width": 4, "contrast_prestated": True},
}


def _loss_cells(cells: pd.DataFrame) -> pd.DataFrame:
    """Diverged cells count as missing (NaN), not as a high loss."""
    cells = cells.copy()
    if "diverged" in cells:
        cells.loc[cells["diverged"].astype(bool), "loss"] = float("nan")
    return cells


def lr_drift(
    cells: pd.DataFrame, *, half_width: int = 2, margin: float = MARGIN, n_boot: int = 2000
) -> pd.DataFrame:
    """Per arm: the optimum at N = 1 and 8 (log2 lr), the drift and its 95% interval, the
    verdict (``stays``/``drifts``/``undecided``, or ``undecided (optimum off the grid)`` when
    fewer than 90 % of the resamples have both vertices) and ``predicted``. Each arm uses
    its seeds with every cell present."""
    cells = _loss_cells(cells)
    rows = []
    for _, g in cells.groupby("arm", sort=False):
        per_seed = g.groupby("seed").size()
        full = per_seed[per_seed == per_seed.max()].index
        rows.append(drift_interval(g[g["seed"].isin(full)], "arm", 1, 8, n_boot=n_boot,
                                   half_width=half_width))  # fmt: skip
    t = pd.concat(rows, ignore_index=True)
    t["verdict"] = [
        f"undecided ({n} seeds, {MIN_SEEDS} needed)" if n < MIN_SEEDS
        else classify(lo, hi, margin) if v >= 0.9 else "undecided (optimum off the grid)"
        for lo, hi, v, n in zip(t["ci_low"], t["ci_high"], t["boot_valid"], t["seeds"],
                                strict=True)
    ]  # fmt: skip
    t["predicted"] = t["arm"].map(PREDICTED_DRIFT)
    t["below_min_seeds"] = t["seeds"] < MIN_SEEDS
    return t


def lr_claim(table: pd.DataFrame) -> str:
    """``HOLDS`` if 1/sqrt(N) drifts and 1/N and loop-mup stay; ``FAILS`` if 1/sqrt(N)
    stays or 1/N or loop-mup drifts; else ``UNDECIDED`` (always when an arm has fewer than
    ``MIN_SEEDS`` seeds: an interval from too few seeds decides nothing)."""
    if "below_min_seeds" in table and table["below_min_seeds"].astype(bool).any():
        return "UNDECIDED"
    v = dict(zip(table["arm"], table["verdict"], strict=True))
    stay = [v[r] for r in ("1/N", "loop-mup") if r in v]
    if v.get("1/sqrt(N)") == "stays" or "drifts" in stay:
        return "FAILS"
    if v.get("1/sqrt(N)") == "drifts" and stay and all(s == "stays" for s in stay):
        return "HOLDS"
    return "UNDECIDED"


def lr_contrast(
    cells: pd.DataFrame,
    a: str = "1/sqrt(N)",
    b: str = "1/N",
    *,
    half_width: int = 2,
    n_boot: int = 2000,
    estimator=None,
) -> dict:
    """``drift(a) - drift(b)`` with its paired interval and a verdict against half the
    predicted difference: ``differ as predicted`` (interval entirely beyond it),
    ``do not differ as predicted`` (entirely short of it) or ``undecided``. ``estimator``:
    a vertex estimator for :func:`~studies.optimum.contrast_interval` (default
    the pre-stated argmin window)."""
    out = contrast_interval(_full_seeds(cells, [a, b]), "arm", a, b, n_boot=n_boot,
                            half_width=half_width, seed=1, estimator=estimator)  # fmt: skip
    predicted = PREDICTED_DRIFT[a] - PREDICTED_DRIFT[b]
    return {**out, "predicted": predicted,
            "verdict": _contrast_verdict(out["ci_low"], out["ci_high"], predicted)}  # fmt: skip


def _full_seeds(cells: pd.DataFrame, arms) -> pd.DataFrame:
    """The arms' cells (diverged ones NaN) on the seeds with every cell present."""
    cells = _loss_cells(cells)
    sub = cells[cells["arm"].isin(list(arms))]
    per_seed = sub.groupby("seed").size()
    return sub[sub["seed"].isin(per_seed[per_seed == per_seed.max()].index)]


def _contrast_verdict(lo: float, hi: float, predicted: float) -> str:
    half = predicted / 2
    beyond = hi < half if predicted < 0 else lo > half
    short = lo > half if predicted < 0 else hi < half
    return "differ as predicted" if beyond else "do not differ as predicted" if short else (
        "undecided")  # fmt: skip


#: Issue 27: the contrast's verdict under three vertex estimators. ``argmin window`` is the
#: pre-stated one (parabola through the argmin of each resample's curve +- half_width grid
#: points); ``quartic`` fits all rates; ``fixed window`` is a parabola over +- half_width grid
#: points around the argmin of the *pooled* sample curve (both arms, N = 1 and 8, every
#: seed): one window for every curve and resample, so no argmin can move it.
VERTEX_ESTIMATORS = ("argmin window (pre-stated)", "quartic", "fixed window")
MIN_BOOT_VALID = 0.9  # as lr_drift: fewer resamples with a vertex is "optimum off the grid"


def lr_contrast_sensitivity(
    cells: pd.DataFrame,
    a: str = "1/sqrt(N)",
    b: str = "1/N",
    *,
    half_width: int = 2,
    n_boot: int = 2000,
) -> tuple[pd.DataFrame, str]:
    """The contrast ``drift(a) - drift(b)`` under each of :data:`VERTEX_ESTIMATORS` (the same
    paired seed resamples as :func:`lr_contrast`), and which conclusion holds under all.

    Table columns: ``estimator, window, contrast, ci_low, ci_high, boot_valid, verdict``
    (as :func:`lr_contrast`; ``undecided (no vertex in k % of resamples)`` when fewer than
    90 % have one) and ``excludes_bound`` (the interval excludes the predicted contrast, -1.5
    for 1/sqrt(N) against 1/N). The statement names the conclusions that hold under every
    estimator and those that hinge on the estimator.
    """
    sub = _full_seeds(cells, [a, b])
    sub = sub[sub["N"].isin([1, 8])]
    pooled = sub.groupby("lr")["loss"].mean()
    centre = float(np.log2(pooled.idxmin()))
    n_lr = sub["lr"].nunique()
    estimators = {
        VERTEX_ESTIMATORS[0]: (None, f"argmin ± {half_width} points"),
        VERTEX_ESTIMATORS[1]: (vertex_quartic, f"all {n_lr} rates"),
        VERTEX_ESTIMATORS[2]: (functools.partial(vertex_fixed, centre=centre,
                                                 half_width=half_width),
                               f"log2 lr {centre:+.2f} ± {half_width} points"),
    }  # fmt: skip
    predicted = PREDICTED_DRIFT[a] - PREDICTED_DRIFT[b]
    rows = []
    for name, (est, window) in estimators.items():  # the same resamples (seed 1) for each
        c = lr_contrast(cells, a, b, half_width=half_width, n_boot=n_boot, estimator=est)
        verdict = c["verdict"] if c["boot_valid"] >= MIN_BOOT_VALID else (
            f"undecided (no vertex in {1 - c['boot_valid']:.0%} of resamples)")  # fmt: skip
        excl = c["ci_low"] > predicted if predicted < 0 else c["ci_high"] < predicted
        excl = bool(excl and c["boot_valid"] >= MIN_BOOT_VALID)
        rows.append({"estimator": name, "window": window, "contrast": c["contrast"],
                     "ci_low": c["ci_low"], "ci_high": c["ci_high"],
                     "boot_valid": c["boot_valid"], "verdict": verdict,
                     "excludes_bound": excl})  # fmt: skip
    t = pd.DataFrame(rows)
    conclusions = {
        f"the predicted contrast {predicted:+.1f} is excluded": t["excludes_bound"],
        "the rules do not differ as predicted": t["verdict"] == "do not differ as predicted",
        "the rules differ as predicted": t["verdict"] == "differ as predicted",
    }
    every = [k for k, v in conclusions.items() if v.all()]
    some = [f"{k} ({' and '.join(t.loc[v, 'estimator'])} only)" for k, v in conclusions.items()
            if v.any() and not v.all()]  # fmt: skip
    statement = (f"under every vertex estimator: {'; '.join(every) if every else 'nothing'}"
                 + (f"; estimator-dependent: {'; '.join(some)}" if some else ""))  # fmt: skip
    return t, statement


def lr_divergence(cells: pd.DataFrame) -> dict[str, int]:
    """Rows, distinct trainings (a repeated cell, same K, N, lr, seed and bit-identical
    losses, as 1/N's N = 1 cells repeat 1/sqrt(N)'s, counts once) and how many diverged
    (flagged, or a non-finite loss)."""
    bad = ~np.isfinite(cells["loss"].to_numpy(dtype=float))
    if "diverged" in cells:
        bad |= cells["diverged"].astype(bool).to_numpy()
    key = [c for c in ("K", "N", "lr", "seed", "loss", "train_loss") if c in cells]
    distinct = ~cells.duplicated(subset=key)
    return {"rows": len(cells), "trainings": int(distinct.sum()),
            "diverged": int((bad & distinct.to_numpy()).sum())}  # fmt: skip


def lr_loop_cost(cells: pd.DataFrame, lo: int = 1, hi: int = 8, *, n_boot: int = 2000):
    """Per arm: the loss at its optimum at N = hi minus at N = lo, in nats, paired over seeds
    (:func:`~studies.optimum.best_loss_gap`: the least seed-mean loss on the
    grid). Columns ``arm, seeds, best_lo, best_hi, lr_lo, lr_hi, gap, ci_low, ci_high``;
    positive: more loops train worse."""
    rows = []
    for arm in cells["arm"].unique():
        g = best_loss_gap(_full_seeds(cells, [arm]), "arm", (arm, hi), (arm, lo),
                          n_boot=n_boot, seed=1)  # fmt: skip
        rows.append({"arm": arm, "seeds": g["seeds"], "best_lo": g["best_b"],
                     "best_hi": g["best_a"], "lr_lo": g["lr_b"], "lr_hi": g["lr_a"],
                     "gap": g["gap"], "ci_low": g["ci_low"], "ci_high": g["ci_high"]})  # fmt: skip
    return pd.DataFrame(rows)


def lr_rule_gap(
    cells: pd.DataFrame, a: str = "1/sqrt(N)", b: str = "1/N", N: int = 8, *, n_boot: int = 2000
) -> dict:
    """Seed 004's "1/N gives a better loss than 1/sqrt(N)": ``best(a) - best(b)`` at N loops
    in nats, each rule at its best grid lr, paired over seeds. Criterion (stated after the
    data, issue 27): ``b better`` if the 95 % interval lies above 0, ``a better`` if below,
    else ``undecided``."""
    g = best_loss_gap(_full_seeds(cells, [a, b]), "arm", (a, N), (b, N), n_boot=n_boot, seed=1)
    verdict = f"{b} better" if g["ci_low"] > 0 else f"{a} better" if g["ci_high"] < 0 else (
        "undecided")  # fmt: skip
    return {**g, "N": N, "verdict": verdict}
