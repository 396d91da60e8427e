"""FlashLoop's three observations on a small LoopedGPT, untrained vs briefly trained.

A LoopedGPT (K=2 blocks, R=4 loops, d=64, 4 heads, pre-norm) is trained on byte-level
Python source (lp.tasks.stdlib_text, seq 64, batch 16, AdamW 3e-3) for ``--steps`` (500) steps; at
init and after training, ``lp.redundancy`` is measured on one held-out batch (4 x 64 tokens,
float64 copy of the model) and its summary (mean over the two blocks / attention modules,
per loop) and the lazy-update simulation (observation ``lazy``, param = kept fraction f,
tensor = ``score`` (FlashLoop's selection) or ``random`` (the baseline), cross-entropy
against the batch's next bytes) are written to the CSV with the columns
``model`` (``init`` / ``trained``) and ``seed``.

    python scripts/redundancy_study.py                     # seeds 0, 1: ~2 CPU-minutes
    python scripts/redundancy_study.py --steps 20 --out /tmp/x.csv   # a smoke test

One thread; the validation loss before/after training is printed and stored in the CSV's
rows with observation ``training``.
"""

from __future__ import annotations

import argparse
import copy
import time

import pandas as pd
import torch
import torch.nn.functional as F

from loopprobe import tasks
from loopprobe.estimate.redundancy import redundancy
from loopprobe.estimate.redundancy.lazy import lazy_update
from loopprobe.models import GPTConfig, LoopedGPT

T, BATCH = 64, 16


def build(seed: int) -> LoopedGPT:
    cfg = GPTConfig(vocab_size=256, seq_len=T, d_model=64, n_heads=4, K=2, R=4)
    return LoopedGPT(cfg, generator=torch.Generator().manual_seed(seed))


def val_loss(model: LoopedGPT, seed: int) -> float:
    x, y = tasks.stdlib_text(32, T, torch.Generator().manual_seed(seed + 1000), split="val")
    with torch.no_grad():
        return float(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))


def train(model: LoopedGPT, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for step in range(steps):
        for group in opt.param_groups:  # short warmup, then constant
            group["lr"] = 3e-3 * min(1.0, (step + 1) / 20)
        x, y = tasks.stdlib_text(BATCH, T, gen)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def measure(model: LoopedGPT, label: str, seed: int) -> pd.DataFrame:
    x, y = tasks.stdlib_text(4, T, torch.Generator().manual_seed(seed + 2000), split="val")
    m = copy.deepcopy(model).double()
    res = redundancy(m, x)
    if not res.converged:
        print(f"{label}: not trustworthy: {res.reason}")
    wide = res.summary().reset_index()
    long = wide.melt(id_vars=["observation", "tensor", "metric", "param"], var_name="loop")
    lazy = pd.concat([lazy_update(m, x, targets=y, select=how) for how in ("score", "random")])
    lazy = lazy.drop(columns="loops").rename(columns={"f": "param", "select": "tensor"})
    lazy = lazy.melt(id_vars=["param", "tensor"], var_name="metric").assign(observation="lazy")
    lazy = lazy.assign(loop=0)
    return pd.concat([long.dropna(subset=["value"]), lazy], ignore_index=True).assign(model=label)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--seeds", default="0,1", help="comma-separated model/data seeds")
    ap.add_argument("--out", default="scripts/redundancy_study.csv")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.process_time()
    frames = []
    for seed in (int(t) for t in args.seeds.split(",")):
        model = build(seed)
        frames.append(measure(model, "init", seed).assign(seed=seed))
        before = val_loss(model, seed)
        train(model, args.steps, seed)
        after = val_loss(model, seed)
        frames.append(measure(model, "trained", seed).assign(seed=seed))
        frames.append(pd.DataFrame(
            {"observation": "training", "tensor": "", "metric": "val_loss", "param": float("nan"),
             "loop": 0, "value": [before, after], "model": ["init", "trained"], "seed": seed}
        ))  # fmt: skip
        print(f"seed {seed}: val loss {before:.3f} -> {after:.3f} after {args.steps} steps; "
              f"{time.process_time() - t0:.0f} CPU-s so far")  # fmt: skip
    df = pd.concat(frames, ignore_index=True)
    df.to_csv(args.out, index=False, float_format="%.5g")
    print(f"wrote {args.out} ({len(df)} rows)")


if __name__ == "__main__":
    main()
