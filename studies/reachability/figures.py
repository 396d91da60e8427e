"""The reachability studies' tables, summaries and figures from their committed runs (seconds).

    python -m studies reachability --analyze

Issue 17's recall-variant study (:mod:`studies.reachability.analysis`): per task x recall x
outer norm the runs that reached a fixed point, rho and ||dh*/dx|| there, accuracy at R, 2R,
4R, claims A and B, and Fisher tests of outer norm and of recall on the reached counts ->
``reachability_summary.csv``, docs/figures/reachability_study.png. The 64-input study (issue
30.3, docs/studies/reachability.md, :mod:`studies.reachability.analysis64`):
``reach_runs.csv`` -> ``reach_summary.csv``, its pre-stated claims,
docs/figures/reach_study.png. The redesign (issue 39.4,
:mod:`studies.reachability.analysis_redesign`): ``reach_redesign.csv`` ->
``reach_redesign_summary.csv``, its pre-stated claims, docs/figures/reach_redesign.png.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from studies._common import md
from studies.reachability.analysis import reach_claims, reach_outer_norm_effect, reach_summary
from studies.reachability.analysis64 import study_claims, study_summary
from studies.reachability.analysis_redesign import redesign_claims, redesign_summary


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


def redesign_figure(runs: pd.DataFrame, path: str) -> None:
    """The redesign: reach fraction and accuracy at R per run, per recall x arm (x: prefix
    sums, o: Latin square; blue: post-norm without outer norm, orange: pre-norm + outer norm)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [(r, n) for n in ("post", "pre") for r in ("none", "add", "internal")]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    rng = np.random.default_rng(0)
    for ax, col in zip(axes, ("reach_frac", "acc_R4"), strict=True):
        for i, (r, n) in enumerate(arms):
            for task, mark in (("prefix_sums", "x"), ("sudoku_like", "o")):
                v = runs.loc[(runs["recall"] == r) & (runs["norm"] == n)
                             & (runs["task"] == task), col]  # fmt: skip
                ax.scatter(i + rng.uniform(-0.15, 0.15, len(v)), v, marker=mark, s=18,
                           color="C1" if n == "pre" else "C0")  # fmt: skip
        ax.set_xticks(range(len(arms)), [f"{r} {'pre+outer' if n == 'pre' else 'post'}"
                                         for r, n in arms], rotation=30, fontsize=8)  # fmt: skip
        ax.set_ylabel({"reach_frac": "reach fraction (64 inputs)", "acc_R4": "accuracy at R"}[col])
    axes[0].set_title("x: prefix sums, o: Latin square", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def redesign(data: str, figdir: str) -> None:
    """The redesign (issue 39.4): summary CSV, claims, figure."""
    try:
        runs = pd.read_csv(f"{data}/reach_redesign.csv")
    except FileNotFoundError:
        return
    s = redesign_summary(runs)
    s.to_csv(f"{data}/reach_redesign_summary.csv", index=False, float_format="%.4g")
    cpu = (runs["cpu_train_s"].sum() + runs["cpu_probe_s"].sum()) / 60
    print(f"## Reachability redesign ({len(runs)} runs, {cpu:.1f} CPU-min)")
    print(md(s))
    claims = redesign_claims(runs)
    for r in claims.to_dict("records"):
        print(f"- {r['claim']}: {r['measured']} -> {r['verdict']}")
    redesign_figure(runs, f"{figdir}/reach_redesign.png")


def analyze(data: str, figdir: str) -> None:
    """Every study's tables (printed), summary CSVs (under ``data``), figures (``figdir``)."""
    reach_study(data, figdir)
    redesign(data, figdir)
    try:
        reach = pd.read_csv(f"{data}/reachability_study.csv")
    except FileNotFoundError:
        return
    s = reach_summary(reach)
    s.to_csv(f"{data}/reachability_summary.csv", index=False, float_format="%.4g")
    print("## Reachability")
    print(md(s))
    print(md(reach_claims(reach)))
    print("Which factor makes a fixed point reachable (two-sided Fisher exact, issue 27):")
    effect = reach_outer_norm_effect(reach)
    effect["p"] = [f"{p:.2g}" for p in effect["p"]]  # 1.6e-07, not 0.000
    print(md(effect))
    reach_figure(reach, f"{figdir}/reachability_study.png")
