"""The LR-transfer study's tables, drift CSVs and figures from its committed cells (seconds).

    python -m studies lr_transfer --analyze

The criteria and the analysis are :mod:`studies.lr_transfer.analysis`. Per run (1:
exploratory, 2: confirmatory): per arm the parabola-vertex optimum (log2 lr) at N = 1 and 8,
the drift in octaves with its 95% paired seed-bootstrap interval and the pre-stated verdict
(margin 0.75 octave), the claim, and the contrast drift(1/sqrt N) - drift(1/N), under the
pre-stated vertex and two others (issue 27), the diverged cells, the N = 8 minus N = 1 loss at
each rule's optimum and the 1/sqrt(N) - 1/N loss gap at N = 8. Writes
``lr_transfer_drift{,2}.csv`` beside the cells and docs/figures/lr_transfer_study{,2}.png;
prints markdown.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from studies._common import md
from studies.lr_transfer.analysis import (
    LR_RUNS,
    lr_claim,
    lr_contrast,
    lr_contrast_sensitivity,
    lr_divergence,
    lr_drift,
    lr_loop_cost,
    lr_rule_gap,
)
from studies.optimum import vertex


def lr_figure(df: pd.DataFrame, t: pd.DataFrame, path: str, half_width: int) -> None:
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
            v = vertex(x, m.to_numpy(), half_width)
            if math.isfinite(v):
                ax.axvline(v, color=color, ls="--", lw=1)
        r = t[t["arm"] == arm].iloc[0]
        ax.set_title(f"{arm}: drift {r['drift']:+.2f} [{r['ci_low']:+.2f}, {r['ci_high']:+.2f}]")
        ax.set_xlabel("log2 lr")
        ax.legend(fontsize=8)
    np.atleast_1d(axes)[0].set_ylabel("held-out loss (seed mean ± se)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def analyze(data: str, figdir: str) -> None:
    """Every run's tables (printed), drift CSV (under ``data``) and figure (under ``figdir``)."""
    for run, spec in LR_RUNS.items():
        try:
            lr = pd.read_csv(f"{data}/{spec['cells']}")
        except FileNotFoundError:
            continue
        hw = spec["half_width"]
        t = lr_drift(lr, half_width=hw)
        suffix = "" if run == 1 else str(run)
        t.to_csv(f"{data}/lr_transfer_drift{suffix}.csv", index=False, float_format="%.4g")
        print(f"## LR transfer, run {run} ({t['seeds'].min()}-{t['seeds'].max()} seeds)")
        print(md(t))
        print("claim:", lr_claim(t))
        c = lr_contrast(lr, half_width=hw)
        when = "pre-stated" if spec["contrast_prestated"] else "post hoc"
        print(f"contrast drift(1/sqrt(N)) - drift(1/N) ({when}): {c['contrast']:.3f} "
              f"[{c['ci_low']:.3f}, {c['ci_high']:.3f}] -> {c['verdict']}")  # fmt: skip
        sens, statement = lr_contrast_sensitivity(lr, half_width=hw)
        print("contrast under three vertex estimators (issue 27; the same resamples):")
        print(md(sens))
        print("->", statement)
        div = lr_divergence(lr)
        print(f"diverged: {div['diverged']} of {div['trainings']} trainings ({div['rows']} cells)")
        print("loss at the optimum (least seed-mean loss on the grid), N = 8 minus N = 1, nats:")
        print(md(lr_loop_cost(lr)))
        g = lr_rule_gap(lr)
        print(f"N = 8: loss(1/sqrt(N)) - loss(1/N) at each rule's best grid lr: {g['gap']:.3f} "
              f"[{g['ci_low']:.3f}, {g['ci_high']:.3f}] nats ({g['seeds']} seeds, paired; "
              f"criterion: above 0, stated after the data) -> {g['verdict']}")  # fmt: skip
        wide = lr.pivot_table(index=["arm", "N"], columns="lr", values="loss", aggfunc="mean")
        print(md(wide.reset_index()))
        lr_figure(lr, t, f"{figdir}/lr_transfer_study{suffix}.png", hw)
