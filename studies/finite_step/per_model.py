"""Finite step: the statistics per trained model and an interval over models (issue 39.5).

The pre-registered analysis (``studies/finite_step/run.py``) pools the models' inputs and
resamples inputs only, so its interval ignores how much the statistics differ between
trained models. Here each model (training seed) gets its own statistics at the primary
transition 4 -> 5 (:func:`loopprobe.estimate.finitestep_summary.summarize`), and the
criterion is judged on a two-sided 95 % t interval over the models' values (stated after the
data, issue 39): with 3 models the t quantile is 4.30, so only a large, consistent effect can
decide; :func:`power_over_models` says how large.

    python -m studies.finite_step.per_model      # the table and the verdicts, seconds
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from scipy import stats

from loopprobe.estimate.finitestep_summary import summarize
from studies._common import here

CELLS = here(__file__, "finite_step_study.csv.gz")
PRIMARY = "4->5"
MIN_FAILURES = 5  # a model's recovery (H1) needs this many finite-step failures
#: criterion -> (statistic, threshold, direction), as pre-registered in run.py's CRITERIA
CRITERIA = {
    "H1 quarter step recovers >= 72%": ("recovery_quarter", 0.72, ">="),
    "H2 sign(A+Q) accuracy >= 97%": ("sign_acc_AQ", 0.97, ">="),
    "H3 Spearman(A+Q, dU) >= 0.99": ("spearman_AQ", 0.99, ">="),
    "H4 generic |Spearman| <= 0.29": ("spearman_generic_max", 0.29, "<="),
}


def per_model(cells: pd.DataFrame, transition: str = PRIMARY) -> pd.DataFrame:
    """One row per training seed: :func:`summarize` of that model's inputs at ``transition``."""
    sub = cells[cells["transition"] == transition]
    if sub.empty:
        raise ValueError(f"per_model: no cells at transition {transition!r}")
    return pd.DataFrame([{"seed": s, **summarize(g)} for s, g in sub.groupby("seed")])


def over_models(models: pd.DataFrame, level: float = 0.95) -> pd.DataFrame:
    """Per criterion: the models' values, their mean, the t interval over models and the
    verdict (holds: the interval on the claimed side of the threshold; fails: entirely on the
    other side; undecided otherwise or with fewer than 2 models). H1 counts only the models
    with at least ``MIN_FAILURES`` finite-step failures."""
    rows = []
    for name, (stat, t, d) in CRITERIA.items():
        v = models[stat]
        if stat == "recovery_quarter":
            v = v[models["n_finite_step"] >= MIN_FAILURES]
        v = v.to_numpy(float)
        v = v[np.isfinite(v)]
        n, m = len(v), float(v.mean()) if len(v) else math.nan
        lo = hi = math.nan
        if n >= 2:
            h = stats.t.ppf(0.5 + level / 2, n - 1) * v.std(ddof=1) / math.sqrt(n)
            lo, hi = m - h, m + h
        ok, bad = (lo >= t, hi < t) if d == ">=" else (hi <= t, lo > t)
        verdict = "holds" if ok else "fails" if bad else "undecided"
        rows.append({"criterion": name, "models": n, "values": ", ".join(f"{x:.3f}" for x in v),
                     "estimate": m, "lo": lo, "hi": hi, "threshold": t,
                     "verdict": verdict})  # fmt: skip
    return pd.DataFrame(rows)


def power_over_models(sd: float, gap: float, n: int, level: float = 0.95) -> float:
    """P(the t interval over ``n`` models lies on one side of the threshold) when the models'
    mean is ``gap`` from it and their sd is ``sd`` (noncentral t)."""
    if n < 2 or not sd > 0:
        return math.nan
    tc = stats.t.ppf(0.5 + level / 2, n - 1)
    return float(1 - stats.nct.cdf(tc, n - 1, abs(gap) / (sd / math.sqrt(n))))


def main() -> None:
    cells = pd.read_csv(CELLS)
    models = per_model(cells)
    table = over_models(models)
    print(models.to_string(index=False))
    print(table.to_string(index=False))
    for r in table.itertuples():
        stat = CRITERIA[r.criterion][0]
        sd = models[stat].std(ddof=1)
        n10 = power_over_models(sd, r.estimate - r.threshold, 10)
        print(f"{r.criterion}: sd over models {sd:.3f}; power with 10 models at this mean "
              f"and sd: {n10:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
