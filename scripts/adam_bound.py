"""The tied-depth bound under SGD and AdamW on the reference ladder, first step and along training.

Three measurements (docs/results/tied-bound.md shows their tables):

* ``ladder``: LoopedGPT at init, K 2, R 1..16, norm deepnorm and deeploop; one real step of
  SGD and of AdamW; measured ``||dF|| / ||F||`` against seed 002's ``M_g kappa_R (b/a)^2``
  and this project's Adam form ``J_g kappa_U (b/a)``; slopes in R and C max/min.
* ``train``: the same ladder trained with AdamW (lr 1e-3, weight decay 0.1) on byte-level
  text for ``--steps`` steps; every ``--every`` steps the real next step of the training
  optimizer (its moments, its weight decay) is checked against the Adam form.
* ``threshold``: norm ``postp`` with p in {0.25, 0.375, 0.5, 0.625}: the slope of ``||dF||``
  in R under AdamW at init and after ``--steps`` steps (the exponent that keeps it flat).

Run (one thread, float64, d_model 16, seq 16, batch 8)::

    python scripts/adam_bound.py ladder
    python scripts/adam_bound.py train --steps 200 --every 50 --only deepnorm   # and deeploop
    python scripts/adam_bound.py threshold --steps 200 --only 0.25,0.375        # and 0.5,0.625
    python scripts/adam_bound.py summary --of train                             # merged CSVs
    python scripts/adam_bound.py diagnose --steps 200 --every 50   # kappa_step, step size
    python scripts/adam_bound.py weights --steps 200               # branch matrices' RMS

Each run prints its table and writes ``scripts/adam_bound_<part>[_<only>].csv``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd
import torch

import loopprobe as lp
from loopprobe._stats import loglog_slope
from loopprobe.models import GPTConfig, LoopedGPT
from loopprobe.tasks import lm_loss, stdlib_text

RS = (1, 2, 4, 8, 16)
HERE = Path(__file__).resolve().parent
KW = {"method": "lanczos", "max_iter": 20}


def build(R: int, norm: str, p: float | None = None) -> LoopedGPT:
    cfg = GPTConfig(vocab_size=256, seq_len=16, d_model=16, n_heads=2, K=2, R=R, norm=norm, p=p)
    return LoopedGPT(cfg, generator=torch.Generator().manual_seed(0)).double()


def probe_batch() -> tuple[torch.Tensor, object]:
    idx, tgt = stdlib_text(8, 16, torch.Generator().manual_seed(123), split="val")
    return idx, lambda out, inputs: lm_loss(out, tgt)


def check(model: LoopedGPT, optimizer: object, lr: float | None = None, max_iter=20) -> dict:
    idx, loss_fn = probe_batch()
    kw = {**KW, "max_iter": max_iter}
    with lp.Probe(model) as probe:
        chk = lp.bound_check(probe, idx, loss_fn, optimizer=optimizer, lr=lr, **kw)
    keep = ("dF_first", "dF_true", "kappa", "kappa_U", "J_g", "M_g", "prediction", "C",
            "prediction_sgd", "prediction_adam", "family", "optimizer", "converged")  # fmt: skip
    row = {k: getattr(chk, k) for k in keep}
    row["ratio"] = chk.beta / chk.alpha
    return row


def summarise(df: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    rows = []
    for key, g in df.groupby(by, sort=False):
        g = g.sort_values("R")
        rows.append({
            **dict(zip(by, key if isinstance(key, tuple) else (key,), strict=True)),
            "slope": loglog_slope(g.R, g.dF_true),
            "slope_pred": loglog_slope(g.R, g.prediction),
            "slope_sgd_form": loglog_slope(g.R, g.prediction_sgd),
            "slope_adam_form": loglog_slope(g.R, g.prediction_adam),
            "C_ratio": float(g.C.max() / g.C.min()),
            "C_adam_form_ratio": float((g.dF_true / g.prediction_adam).max()
                                       / (g.dF_true / g.prediction_adam).min()),
            "converged": bool(g.converged.all()),
        })  # fmt: skip
    return pd.DataFrame(rows)


def ladder() -> pd.DataFrame:
    rows = []
    for norm in ("deepnorm", "deeploop"):
        for opt in ("sgd", "adamw"):
            for R in RS:
                row = check(build(R, norm), opt, 1e-3, max_iter=30)  # every kappa certified
                rows.append({"norm": norm, "opt": opt, "R": R, **row})
    return pd.DataFrame(rows)


def train(R: int, norm: str, p: float | None, steps: int, every: int, seed: int = 0, diag=False):
    """AdamW on byte-level text; yields (step, check row) every ``every`` steps, step 0 first."""
    model = build(R, norm, p)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    gen = torch.Generator().manual_seed(seed)
    for t in range(steps + 1):
        if t % every == 0:
            yield t, diagnose(model, opt) if diag else check(model, opt)
        if t == steps:
            return
        idx, tgt = stdlib_text(8, 16, gen)
        opt.zero_grad()
        lm_loss(model(idx), tgt).backward()
        opt.step()


def diagnose(model: LoopedGPT, optimizer: object) -> dict:
    """Which assumption moves: the step's size per coordinate (A2) or its alignment."""
    idx, loss_fn = probe_batch()
    with lp.Probe(model) as probe:
        sc = lp.step_change(probe, idx, loss_fn, optimizer=optimizer, norms=False)
    n = sum(d.numel() for d in sc.delta)
    lr = optimizer.param_groups[0]["lr"]
    return {"dF_first": sc.dF_first, "kappa_step": float(sc.sublayers.kappa_step.max()),
            "step_rms_over_lr": sc.step_norm / (n**0.5 * lr), "sum_error": sc.sum_error,
            "ratio": model.cfg.beta / model.cfg.alpha, "J_g": len(sc.sublayers)}  # fmt: skip


def weights(steps: int) -> None:
    """RMS of blocks.0's MLP matrices at init and after ``steps`` AdamW steps (DeepLoop),
    trained as :func:`train` trains (same data seed, lr, weight decay)."""

    def rms(model: LoopedGPT) -> list[float]:
        return [round(float(p.detach().pow(2).mean().sqrt()), 4)
                for n, p in model.named_parameters()
                if n.startswith("blocks.0.mlp") and p.dim() == 2]  # fmt: skip

    for R in (1, 16):
        model = build(R, "deeploop")
        before = rms(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        gen = torch.Generator().manual_seed(0)
        for _ in range(steps):
            idx, tgt = stdlib_text(8, 16, gen)
            opt.zero_grad()
            lm_loss(model(idx), tgt).backward()
            opt.step()
        print(f"R={R} beta={model.cfg.beta:.4g}: RMS {before} -> {rms(model)} after {steps} steps")


def along_training(steps: int, every: int, norms: tuple[str, ...], diag: bool = False):
    rows = []
    for norm in norms:
        for R in RS:
            for t, row in train(R, norm, None, steps, every, diag=diag):
                rows.append({"norm": norm, "step": t, "R": R, **row})
    return pd.DataFrame(rows)


def threshold(steps: int, ps: tuple[float, ...]) -> pd.DataFrame:
    rows = []
    for p in ps:
        for R in RS:
            for t, row in train(R, "postp", p, steps, max(steps, 1)):
                rows.append({"p": p, "step": t, "R": R, **row})
    return pd.DataFrame(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "part", choices=("ladder", "train", "threshold", "diagnose", "weights", "summary")
    )
    ap.add_argument("--of", choices=("ladder", "train", "threshold"), help="summary of")
    ap.add_argument("--only", default="", help="train: one norm; threshold: comma-separated p")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=25)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.process_time()
    if args.part == "weights":
        return weights(args.steps)
    if args.part == "diagnose":  # the training runs again: step size and step alignment
        norms = (args.only,) if args.only else ("deepnorm", "deeploop")
        df = along_training(args.steps, args.every, norms, diag=True)
        df.to_csv(HERE / f"adam_bound_diagnose{'_' + args.only if args.only else ''}.csv")
        pd.set_option("display.width", 200)
        for col in ("kappa_step", "step_rms_over_lr", "dF_first"):
            print(col, df.pivot_table(index=["norm", "step"], columns="R", values=col), sep="\n")
        return
    part = args.of if args.part == "summary" else args.part
    by = {"ladder": ["norm", "opt"], "train": ["norm", "step"], "threshold": ["p", "step"]}[part]
    if args.part == "summary":  # every CSV the runs of this part wrote
        df = pd.concat([pd.read_csv(f) for f in sorted(HERE.glob(f"adam_bound_{part}*.csv"))])
    else:
        if part == "ladder":
            df = ladder()
        elif part == "train":
            norms = (args.only,) if args.only else ("deepnorm", "deeploop")
            df = along_training(args.steps, args.every, norms)
        else:
            ps = tuple(map(float, args.only.split(","))) if args.only else (0.25, 0.375, 0.5, 0.625)
            df = threshold(args.steps, ps)
        tag = f"_{args.only.replace(',', '_')}" if args.only else ""
        df.to_csv(HERE / f"adam_bound_{part}{tag}.csv", index=False)
    pd.set_option("display.width", 200)
    print(summarise(df, by).to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    print(f"CPU-s: {time.process_time() - t0:.0f}")


if __name__ == "__main__":
    main()
