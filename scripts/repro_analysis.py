"""Analysis of the issue-17 studies from their CSVs (no training; seconds).

    python scripts/repro_analysis.py   # reads docs/data/{lr_transfer_study,lr_transfer_study2,
                                       #                  reachability_study}.csv

The criteria and the analysis are loopprobe.experiments.reproductions (shared with the
report's ``reproductions`` section). LR transfer, per run (1: exploratory, 2: confirmatory):
per arm the parabola-vertex optimum (log2 lr) at N = 1 and 8, the drift in octaves with its
95% paired seed-bootstrap interval and the pre-stated verdict (margin 0.75 octave), the claim,
and the contrast drift(1/sqrt N) - drift(1/N), under the pre-stated vertex and two others
(issue 27), the diverged cells, the N = 8 minus N = 1 loss at each rule's optimum and the
1/sqrt(N) - 1/N loss gap at N = 8. Reachability: per task x recall x outer norm
the runs that reached a fixed point, rho and ||dh*/dx|| there, accuracy at R, 2R, 4R,
claims A and B, and Fisher tests of outer norm and of recall on the reached counts. Writes
docs/data/lr_transfer_drift{,2}.csv, docs/data/reachability_summary.csv and the figures
docs/figures/lr_transfer_study{,2}.png, docs/figures/reachability_study.png; prints markdown.
The 64-input study (issue 30.3, docs/studies/reachability.md): docs/data/reach_runs.csv ->
docs/data/reach_summary.csv, its pre-stated claims, docs/figures/reach_study.png.
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import pandas as pd

from loopprobe.experiments.optimum import vertex
from loopprobe.experiments.reproductions import (
    LR_RUNS,
    lr_claim,
    lr_contrast,
    lr_contrast_sensitivity,
    lr_divergence,
    lr_drift,
    lr_loop_cost,
    lr_rule_gap,
    reach_claims,
    reach_outer_norm_effect,
    reach_summary,
    study_claims,
    study_summary,
)


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


def reach_study_figure(runs: pd.DataFrame, claims: pd.DataFrame, path: str) -> None:
    """The 64-input study: reach fraction per run, distinct / reached fixed points per run
    and rho at reached fixed points, per recall x outer norm (both tasks; x: prefix sums,
    o: Latin square)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [(r, o) for o in (False, True) for r in ("none", "add", "internal")]
    cols = (("reach_frac", "reach fraction (64 inputs)"),
            ("distinct_frac", "distinct / reached fixed points"),
            ("rho_max", "max rho at reached points"))  # fmt: skip
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    rng = np.random.default_rng(0)
    for ax, (col, label) in zip(axes, cols, strict=True):
        for i, (r, o) in enumerate(arms):
            for task, mark in (("prefix_sums", "x"), ("sudoku_like", "o")):
                v = runs.loc[(runs["recall"] == r) & (runs["outer_norm"] == o)
                             & (runs["task"] == task), col]  # fmt: skip
                ax.scatter(i + rng.uniform(-0.15, 0.15, len(v)), v, marker=mark, s=18,
                           color="C1" if o else "C0")  # fmt: skip
        ax.set_xticks(range(len(arms)), [f"{r}{' +norm' if o else ''}" for r, o in arms],
                      rotation=30, fontsize=8)  # fmt: skip
        ax.set_ylabel(label)
    axes[0].set_title("x: prefix sums, o: Latin square; dashed: pre-stated thresholds", fontsize=8)
    axes[0].axhline(0.8, color="k", lw=0.5, ls="--")
    axes[1].axhline(0.5, color="k", lw=0.5, ls="--")
    axes[2].axhline(1.0, color="k", lw=0.5)
    a = claims.set_index("claim")["verdict"]
    fig.suptitle("; ".join(f"{k.split(':')[0] if ':' in k else k[:24]}: {v.split(' (')[0]}"
                           for k, v in a.items()), fontsize=7)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def reach_study(data: str, figdir: str) -> None:
    """The 64-input reachability study (issue 30.3): summary CSV, claims, figure."""
    try:
        runs = pd.read_csv(f"{data}/reach_runs.csv")
    except FileNotFoundError:
        return
    s = study_summary(runs)
    s.to_csv(f"{data}/reach_summary.csv", index=False, float_format="%.4g")
    cpu = (runs["cpu_train_s"].sum() + runs["cpu_probe_s"].sum()) / 60
    print(f"## Reachability on 64 inputs per run ({len(runs)} runs, {cpu:.1f} CPU-min)")
    print(md(s))
    claims = study_claims(runs)
    print(md(claims[["claim", "runs", "estimate", "ci_low", "ci_high", "verdict"]]))
    for r in claims.to_dict("records"):
        print(f"- {r['claim']}: {r['measured']} -> {r['verdict']}")
    reach_study_figure(runs, claims, f"{figdir}/reach_study.png")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="docs/data")
    ap.add_argument("--figdir", default="docs/figures")
    a = ap.parse_args()
    reach_study(a.data, a.figdir)
    for run, spec in LR_RUNS.items():
        try:
            lr = pd.read_csv(f"{a.data}/{spec['cells']}")
        except FileNotFoundError:
            continue
        hw = spec["half_width"]
        t = lr_drift(lr, half_width=hw)
        suffix = "" if run == 1 else str(run)
        t.to_csv(f"{a.data}/lr_transfer_drift{suffix}.csv", index=False, float_format="%.4g")
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
        lr_figure(lr, t, f"{a.figdir}/lr_transfer_study{suffix}.png", hw)
    try:
        reach = pd.read_csv(f"{a.data}/reachability_study.csv")
    except FileNotFoundError:
        return
    s = reach_summary(reach)
    s.to_csv(f"{a.data}/reachability_summary.csv", index=False, float_format="%.4g")
    print("## Reachability")
    print(md(s))
    print(md(reach_claims(reach)))
    print("Which factor makes a fixed point reachable (two-sided Fisher exact, issue 27):")
    effect = reach_outer_norm_effect(reach)
    effect["p"] = [f"{p:.2g}" for p in effect["p"]]  # 1.6e-07, not 0.000
    print(md(effect))
    reach_figure(reach, f"{a.figdir}/reachability_study.png")


if __name__ == "__main__":
    main()
