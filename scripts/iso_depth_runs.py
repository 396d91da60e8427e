"""Tiny iso-depth runs on CPU for the phi demonstration (writes docs/data/iso_depth_runs.csv).

Effective depth 6: prelude 1 + r x (4/r recurrent blocks) + coda 1, r in {1, 2, 4}; r = 1 is
six unshared blocks; looped models re-inject the prelude output with a linear map W [h; x]
(2 d^2, counted in N_rec, as in arXiv 2604.21106). Byte-level text (lp.tasks.stdlib_text),
AdamW, warmup then linear decay to 10%. Each (width, budget) gets tokens D = C / (6 N_fwd),
N_fwd = n_once + r n_rec (the paper's accounting, injection included). n_once / n_rec are
read from the model's visit table (lp.scaling.param_split), not from a formula.

    python scripts/iso_depth_runs.py --seed 0; python scripts/iso_depth_runs.py --seed 1
                                        # the shipped CSV (two seeds, ~15 CPU-minutes)
    python scripts/iso_depth_runs.py --quick --out /tmp/x.csv   # seconds, a smoke test

Runs already in --out are skipped (resumable). One thread.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import pandas as pd
import torch
import torch.nn.functional as F

import loopprobe as lp
from loopprobe.estimate.scaling import param_split
from loopprobe.models import GPTConfig, LoopedGPT

T, BATCH, DEPTH = 64, 16, 4  # recurrent depth 4 = r x (4 / r); + prelude 1 + coda 1


def model_for(r: int, d: int, seed: int) -> LoopedGPT:
    cfg = GPTConfig(
        vocab_size=256,
        seq_len=T,
        d_model=d,
        n_heads=max(1, d // 16),
        K=DEPTH // r,
        R=r,
        prelude=1,
        coda=1,
        recall="linear" if r > 1 else "none",
        tie_embeddings=True,
    )
    return LoopedGPT(cfg, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def val_loss(model: LoopedGPT, batches: list) -> float:
    model.eval()
    out = [F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item() for x, y in batches]
    model.train()
    return sum(out) / len(out)


def train(r: int, d: int, budget: float, seed: int, val: list) -> dict:
    model = model_for(r, d, seed)
    split = param_split(model, val[0][0][:1])
    assert split.r == r, (split.r, r)
    n_fwd = split.n_once + r * split.n_rec
    tokens = budget / (6 * n_fwd)
    steps = max(1, round(tokens / (BATCH * T)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    warm = max(1, steps // 20)

    def lr_at(k: int) -> float:
        return (k + 1) / warm if k < warm else 1.0 - 0.9 * (k - warm) / max(1, steps - warm)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    gen = torch.Generator().manual_seed(1000 + seed)
    t0 = time.perf_counter()
    for _ in range(steps):
        x, y = lp.tasks.stdlib_text(BATCH, T, gen)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    return {
        "loss": val_loss(model, val),
        "r": r,
        "n_once": split.n_once,
        "n_rec": split.n_rec,
        "tokens": steps * BATCH * T,
        "budget": budget,
        "arch": f"r={r}",
        "seed": seed,
        "d": d,
        "steps": steps,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/data/iso_depth_runs.csv")
    ap.add_argument("--quick", action="store_true", help="tiny budgets: a smoke test")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    widths = (16, 32) if args.quick else (16, 24, 32)
    budgets = (2e9, 4e9) if args.quick else (3e10, 9e10)
    vgen = torch.Generator().manual_seed(12345)
    val = [lp.tasks.stdlib_text(32, T, vgen, split="val") for _ in range(8)]
    done = pd.read_csv(args.out) if os.path.exists(args.out) else pd.DataFrame()
    rows = done.to_dict("records")
    for budget in budgets:
        for d in widths:
            for r in (1, 2, 4):
                if any(
                    math.isclose(x["budget"], budget)
                    and (x["d"], x["r"], x["seed"]) == (d, r, args.seed)
                    for x in rows
                ):
                    continue
                row = train(r, d, budget, args.seed, val)
                rows.append(row)
                print(row, flush=True)
                os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
                pd.DataFrame(rows).to_csv(args.out, index=False)


if __name__ == "__main__":
    main()
