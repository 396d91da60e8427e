"""Finite-step failures and the quarter step on trained tiny looped models (issue 30.4).

Design and criteria: docs/studies/finite_step.md (committed before the run).

    nice -n 19 python -m studies finite_step --cache DIR        # a few CPU-minutes
    python -m studies finite_step --analyze    # verdicts + figure from the CSV, seconds
    python -m studies finite_step --quick --cache /tmp/fq --out /tmp/fq.csv.gz

One torch thread. Trains K = 1, R = 4 LoopedGPTs on prefix sums (one cached sweep cell per
training seed), then loopprobe.estimate.finitestep_summary.failure_summary on 512 held-out
inputs for the transitions r -> r + 1, r = 1..7, in float64. Writes one row per (seed,
transition, input) to --out (gzipped, 6 significant digits), then the verdicts of the primary
population (4 -> 5, pooled) with 2000 paired bootstrap resamples, and the figure.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from loopprobe.estimate.finitestep_summary import (
    failure_summary,
    paired_bootstrap,
    summarize,
    verdict,
)
from loopprobe.experiments.recall import task_batch
from loopprobe.models import GPTConfig, LoopedGPT
from loopprobe.sweeps import sweep
from studies import _common

CRITERIA = {  # pre-registered: statistic, threshold, direction
    "H1 quarter step recovers >= 72%": ("recovery_quarter", 0.72, ">="),
    "H2 sign(A+Q) accuracy >= 97%": ("sign_acc_AQ", 0.97, ">="),
    "H3 Spearman(A+Q, dU) >= 0.99": ("spearman_AQ", 0.99, ">="),
    "H4 generic |Spearman| <= 0.29": ("spearman_generic_max", 0.29, "<="),
}


def run(cfg: dict) -> pd.DataFrame:
    t0 = time.process_time()
    g = torch.Generator().manual_seed(cfg["seed"])
    gcfg = GPTConfig(vocab_size=2, seq_len=cfg["seq_len"], d_model=32, n_heads=4, K=1, R=4,
                     recall="add")  # fmt: skip
    model = LoopedGPT(gcfg, generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(cfg["steps"]):
        x, y, _ = task_batch("prefix_sums", 64, cfg["seq_len"], g)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model = model.eval().double()
    gi = torch.Generator().manual_seed(10_000 + cfg["seed"])
    x, y, _ = task_batch("prefix_sums", cfg["inputs"], cfg["seq_len"], gi)
    frames = []
    with torch.no_grad():
        xe = h = model.embed(x)
        for r in range(1, 8):
            h = model.step(h, xe, r - 1)  # h = state after r rounds
            s = failure_summary(lambda v, r=r: model.step(v, xe, r), h, model.head, y)
            frames.append(s.to_frame().assign(transition=f"{r}->{r + 1}", r=r))
    out = pd.concat(frames, ignore_index=True)
    out["train_loss"] = loss.item()
    out["cpu_s"] = time.process_time() - t0
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", default=None)
    ap.add_argument("--out", default=_common.here(__file__, "finite_step_study.csv.gz"))
    ap.add_argument("--fig", default=_common.figure("finite_step_study.png"))
    ap.add_argument("--quick", action="store_true", help="1 seed, 60 steps, 64 inputs")
    ap.add_argument("--analyze", action="store_true", help="only the analysis, from --out")
    a = ap.parse_args(argv)
    if a.analyze:
        return analyze(pd.read_csv(a.out), 2000, a.fig, verdicts_path(a.out))
    torch.set_num_threads(1)
    seeds, steps, inputs, nboot = ((0,), 60, 64, 200) if a.quick else ((0, 1, 2), 600, 512, 2000)
    grid = [{"seed": s, "steps": steps, "inputs": inputs, "seq_len": 16} for s in seeds]
    df = sweep(grid, run, cache_dir=a.cache, name="finite_step_study", version=1)
    df.to_csv(a.out, index=False, float_format="%.6g")
    analyze(pd.read_csv(a.out), nboot, a.fig, verdicts_path(a.out))  # as --analyze does


def verdicts_path(out: str) -> str:
    """The verdicts sit next to the cells (the report reads them: its bootstrap is slow)."""
    return os.path.join(os.path.dirname(out), "finite_step_verdicts.csv")


def analyze(df: pd.DataFrame, nboot: int, fig: str, verdicts: str) -> None:
    """The pre-registered verdicts (4 -> 5 pooled, paired bootstrap; written to ``verdicts``),
    per transition, figure."""
    prim = df[df.transition == "4->5"].reset_index(drop=True)
    boot = paired_bootstrap(prim, n=nboot, seed=20260904)
    res = {}
    for name, (stat, t, d) in CRITERIA.items():
        v = verdict(boot[stat], t, d)
        v["estimate"] = summarize(prim)[stat]
        if stat == "recovery_quarter" and int(prim.finite_step.sum()) < 20:
            v["verdict"] = "undecided (fewer than 20 finite-step failures)"
        res[name] = v
    table = pd.DataFrame([{"criterion": k, **v} for k, v in res.items()])
    table[["criterion", "estimate", "lo", "hi", "verdict"]].to_csv(verdicts, index=False,
                                                                  float_format="%.6g")  # fmt: skip
    per_r = pd.DataFrame([{"transition": t, **summarize(g)} for t, g in df.groupby("transition")])
    print(per_r.to_string(index=False))
    print(json.dumps(res, indent=1))
    print(json.dumps({"cpu_s": float(df.groupby("seed").cpu_s.first().sum()),
                      "train_loss": df.groupby("seed").train_loss.first().tolist()}))  # fmt: skip
    plot(prim, per_r, fig)


def plot(prim: pd.DataFrame, per_r: pd.DataFrame, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(13, 4))
    c = np.where(prim.finite_step, "C3", np.where(prim.harmful, "C1", "C0"))
    ax[0].scatter(prim.predicted, prim.gain, s=4, c=c)
    lim = [min(prim.predicted.min(), prim.gain.min()), max(prim.predicted.max(), prim.gain.max())]
    ax[0].plot(lim, lim, "k:", lw=1)
    ax[0].set(xlabel="A + Q", ylabel="Delta U", title="4->5: prediction (red: finite-step)")
    ax[1].scatter(prim.A, prim.gain, s=4, c=c)
    ax[1].axhline(0, c="k", lw=0.5), ax[1].axvline(0, c="k", lw=0.5)
    ax[1].set(xlabel="A", ylabel="Delta U", title="4->5: slope vs full-step gain")
    x = np.arange(len(per_r))
    ax[2].plot(x, per_r.share, "o-", label="finite-step / harmful")
    ax[2].plot(x, per_r.recovery_quarter, "s-", label="recovered by alpha=0.25")
    ax[2].plot(x, per_r.recovery_hat, "^-", label="recovered by alpha_hat")
    ax[2].axhline(0.72, c="k", ls=":", lw=1)
    ax[2].set_xticks(x, per_r.transition)
    ax[2].set(ylim=(0, 1.02), xlabel="transition", title="per transition (3 seeds pooled)")
    ax[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
