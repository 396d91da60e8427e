"""LR transfer across loop count (issue 17): the drift of the optimal lr between N = 1 and 8.

Arms (pre-norm LoopedGPT, byte-level lp.tasks.stdlib_text): K = 1 block with ``1/sqrt(N)``
and ``1/N`` (at N = 1 both have eps = 1, so those cells are run once and shared), and K = 2
unique blocks with ``loop-mup`` (eps = 1 / (R sqrt(2)), N = R loops). Each (arm, N, lr, seed)
cell trains a fresh model with lp.experiments.lrtransfer.lr_transfer (AdamW, warmup 5%,
linear decay, clip 1) and is cached per cell in --cache (resumable). Seeds run in order,
each complete before the next, so an interrupted study leaves whole seeds.

    python -m studies lr_transfer --cache DIR   # run 2: ~75 CPU-minutes (one thread)
    python -m studies lr_transfer --cache DIR --seed0 100 --seeds 6 --out a.csv &
    python -m studies lr_transfer --cache DIR --seed0 106 --seeds 6 --out b.csv  # 2 cores
    python -m studies lr_transfer --run 1 --cache DIR   # run 1 (exploratory, 120 steps)
    python -m studies lr_transfer --quick --cache /tmp/lrq --out /tmp/lrq.csv   # smoke test
    python -m studies lr_transfer --analyze   # tables, drift CSVs, figures from the cells

Writes the tidy cells (arm, residual, K, N, lr, seed, loss, ...) to --out after every seed.
One torch thread.
"""

from __future__ import annotations

import argparse
import sys

import pandas as pd
import torch
from tqdm import tqdm

from loopprobe import tasks
from loopprobe.experiments.lrtransfer import lr_transfer
from loopprobe.models import GPTConfig, LoopedGPT
from studies import _common
from studies.lr_transfer import figures

ARMS = {  # arm -> (residual rule, K unique blocks, loop counts run; N = 1 of 1/N is shared)
    "1/sqrt(N)": ("1/sqrt(N)", 1, (1, 8)),
    "1/N": ("1/N", 1, (8,)),
    "loop-mup": ("loop-mup", 2, (1, 8)),
}
RUNS = {  # the two designs of the README section (run 2: stated before it ran, fresh seeds)
    1: {"seed0": 0, "seeds": 8, "steps": 120,
        "out": _common.here(__file__, "lr_transfer_study.csv"),
        "lrs": [1e-3 * 2**k for k in range(7)]},  # 1-octave grid 1e-3 .. 6.4e-2
    2: {"seed0": 100, "seeds": 12, "steps": 200,
        "out": _common.here(__file__, "lr_transfer_study2.csv"),
        "lrs": [2.0 ** (k / 2) for k in range(-19, -7)]},  # half-octave grid 2^-9.5 .. 2^-4
}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", help="where each trained cell is cached (needed to train)")
    ap.add_argument("--analyze", action="store_true", help="no training: tables and figures")
    ap.add_argument("--run", type=int, choices=(1, 2), default=2, help="the design (README)")
    ap.add_argument("--seed0", type=int, default=None, help="first seed (run 1: 0, run 2: 100)")
    ap.add_argument("--seeds", type=int, default=None, help="how many (run 1: 8, run 2: 12)")
    ap.add_argument("--steps", type=int, default=None, help="run 1: 120, run 2: 200")
    ap.add_argument("--d", type=int, default=32)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lrs", default=None, help="comma list (default: the run's grid)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="2 lrs, 3 steps, 1 seed")
    a = ap.parse_args(argv)
    if a.analyze:
        figures.analyze(_common.here(__file__, ""), str(_common.FIGURES))
        return
    if a.cache is None:
        ap.error("--cache DIR is needed to train (or --analyze)")
    for key, value in RUNS[a.run].items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    torch.set_num_threads(1)
    lrs = [float(x) for x in a.lrs.split(",")] if isinstance(a.lrs, str) else list(a.lrs)
    if a.quick:
        lrs, a.steps, a.seeds = lrs[:2], 3, 1
    B, T = a.batch, a.seq
    val = torch.Generator().manual_seed(123)
    evals = [tasks.stdlib_text(B, T, val, split="val") for _ in range(8)]

    def batch_fn(step, gen):
        return tasks.stdlib_text(B, T, gen)

    def maker(residual, K):
        def make_model(N, seed):
            cfg = GPTConfig(vocab_size=256, seq_len=T, d_model=a.d, n_heads=4, K=K, R=N,
                            norm="pre", residual=residual)  # fmt: skip
            return LoopedGPT(cfg, generator=torch.Generator().manual_seed(seed))

        return make_model

    seeds = range(a.seed0, a.seed0 + a.seeds)
    if a.run == 1:  # run 1 ran the two K = 1 arms for every seed first, then loop-mup
        order = [(s, arm) for group in (("1/sqrt(N)", "1/N"), ("loop-mup",)) for s in seeds
                 for arm in group]  # fmt: skip
    else:  # run 2: seed-major, every arm of a seed before the next seed
        order = [(s, arm) for s in seeds for arm in ARMS]
    frames = []
    for seed, arm in tqdm(order, desc="(seed, arm)", file=sys.stderr):
        residual, K, Ns = ARMS[arm]
        name = f"lrstudy:{residual}:K{K}:d{a.d}:T{T}:B{B}:S{a.steps}"
        lt = lr_transfer(maker(residual, K), batch_fn, evals, list(Ns), lrs, [seed],
                         steps=a.steps, cache_dir=a.cache, name=name, progress=True)  # fmt: skip
        frames.append(lt.to_frame().assign(arm=arm, residual=residual, K=K))
        write(frames, a.out)


def write(frames: list[pd.DataFrame], out: str) -> None:
    """The cells so far, with the shared N = 1 cells of 1/sqrt(N) also under 1/N."""
    df = pd.concat(frames, ignore_index=True)
    shared = df[(df["arm"] == "1/sqrt(N)") & (df["N"] == 1)].assign(arm="1/N", residual="1/N")
    df = pd.concat([df, shared], ignore_index=True)
    cols = ["arm", "residual", "K", "N", "lr", "seed", "loss", "train_loss", "diverged",
            "seconds", "steps_done"]  # fmt: skip
    df[cols].sort_values(["arm", "N", "lr", "seed"]).to_csv(out, index=False, float_format="%.6g")


if __name__ == "__main__":
    main()
