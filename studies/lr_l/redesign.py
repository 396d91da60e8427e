"""The LR-vs-L redesign without the gate (pre-registered in docs/studies/lr_l.md, "Redesign").

Task and budget of the LR-edge study (byte-level text, seq 32, batch 16, 200 steps, AdamW,
warmup 10, linear decay, clip 1): each cell is ``studies.lr_edge.run.transfer_cell`` (K = L
unique pre-norm blocks looped N times, ``residual="loop-mup"``, lambda = 1, d 32), the held-out
loss on the LR-edge study's fixed val batches. L in {1, 2} x N in {1, 2, 4, 8}; half-octave lr
grid 2^-9 .. 2^-3 (13 rates); seeds 100-103. A seed fixes init and data order (paired arms).

Resumable and seed-major: every finished cell is appended at once to ``redesign.csv`` (committed
with the repository), and a rerun skips the cells already there; a seed's whole grid runs before
the next seed starts, so a partial run is a set of complete seeds plus one partial. Grid
extension (pre-registered): where a seed-mean argmin over the complete seeds sits at the grid's
edge for any arm, two more half-octave rates are added on that side for every arm (one shared
grid, so the estimator is unchanged) and run for every complete seed before the next seed.

    nice -n 19 python -m studies.lr_l.redesign            # run / resume (one thread)
    nice -n 19 python -m studies.lr_l.redesign --stop-at 20:50   # stop before this UTC time
    python -m studies.lr_l.redesign --plan                # the cells still to run, no training
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import sys

import numpy as np
import pandas as pd
import torch

from studies import _common
from studies.lr_l.analysis import REDESIGN_ARMS, REDESIGN_GRID

CSV = _common.here(__file__, "redesign.csv")
SEEDS = (100, 101, 102, 103)
LS, NS = (1, 2), (1, 2, 4, 8)
GRID = tuple(REDESIGN_GRID)  # log2 lr: -9, -8.5, ..., -3 (13 rates)
assert [(L, N) for L in LS for N in NS] == REDESIGN_ARMS
BASE = {"task": "text", "d": 32, "heads": 4, "seq": 32, "batch": 16, "eval_batches": 8,
        "steps": 200}  # fmt: skip
KEY = ["L", "N", "lr", "seed"]
CHANCE = math.log(256)  # a non-finite held-out loss counts as a uniform byte


def lr_of(x: float) -> float:
    return float(f"{2.0**x:.6g}")


def load(path: str = CSV) -> pd.DataFrame:
    return pd.read_csv(path) if os.path.exists(path) else pd.DataFrame(columns=KEY + ["loss"])


def grid(done: pd.DataFrame) -> list[float]:
    """The log2-lr grid: GRID, extended by two half-octave rates on each side where an arm's
    seed-mean argmin (over the seeds complete on the current grid) sits at the edge; repeated
    until no arm's argmin is at an edge that was extended for it."""
    xs = list(GRID)
    while True:
        seeds = complete_seeds(done, xs)
        if not seeds:
            return xs
        d = done[done["seed"].isin(seeds)].assign(x=np.log2(done["lr"].astype(float)).round(3))
        d = d[d["x"].isin([round(x, 3) for x in xs])]
        loss = d["loss"].astype(float).where(np.isfinite(d["loss"].astype(float)), CHANCE)
        mean = d.assign(loss=loss).groupby(["L", "N", "x"])["loss"].mean()
        arg = mean.groupby(["L", "N"]).idxmin().map(lambda t: t[2])
        lo, hi = bool((arg == round(xs[0], 3)).any()), bool((arg == round(xs[-1], 3)).any())
        if not (lo or hi):
            return xs
        xs = ([xs[0] - 1, xs[0] - 0.5] if lo else []) + xs + ([xs[-1] + 0.5, xs[-1] + 1] if hi
                                                                 else [])  # fmt: skip


def complete_seeds(done: pd.DataFrame, xs: list[float]) -> list[int]:
    need = {(L, N, lr_of(x)) for L in LS for N in NS for x in xs}
    out = []
    for s in SEEDS:
        have = {(int(r.L), int(r.N), float(r.lr)) for r in done[done["seed"] == s].itertuples()}
        if need <= have:
            out.append(s)
    return out


def cells_of(seed: int, xs: list[float]) -> list[dict]:
    """One seed's cells on the log2-lr grid ``xs``: every (L, N, lr)."""
    return [{**BASE, "L": L, "N": N, "lr": lr_of(x), "seed": seed}
            for L in LS for N in NS for x in xs]  # fmt: skip


def todo(done: pd.DataFrame) -> list[dict]:
    """The next cells in seed-major order: the current grid's missing cells of the complete
    seeds (extension rates) first, then those of the first incomplete seed."""
    xs = grid(done)
    have = {(int(r.L), int(r.N), float(r.lr), int(r.seed)) for r in done.itertuples()}
    for s in SEEDS:
        missing = [c for c in cells_of(s, xs) if (c["L"], c["N"], c["lr"], s) not in have]
        if missing:
            return missing
    return []


COLUMNS = ["task", "d", "heads", "seq", "batch", "eval_batches", "steps", "L", "N", "lr", "seed",
           "loss", "train_loss", "acc", "diverged", "error", "steps_done", "cpu_s"]  # fmt: skip


def append(row: dict, path: str = CSV) -> None:
    df = pd.DataFrame([{k: row.get(k) for k in COLUMNS}])
    df.to_csv(path, mode="a", header=not os.path.exists(path), index=False, float_format="%.6g")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=CSV)
    ap.add_argument("--stop-at", help="UTC HH:MM: start no cell after this time")
    ap.add_argument("--plan", action="store_true", help="print the cells still to run and stop")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    from studies.lr_edge.run import transfer_cell

    stop = None
    if a.stop_at:
        h, m = map(int, a.stop_at.split(":"))
        stop = dt.datetime.now(dt.UTC).replace(hour=h, minute=m, second=0, microsecond=0)
    last: list[dict] = []
    while True:
        done = load(a.out)
        cells = todo(done)
        if cells and cells == last:
            raise RuntimeError(f"lr_l redesign: {a.out} did not gain the cells just run")
        last = cells
        if a.plan or not cells:
            print(f"{len(done)} cells done, {len(cells)} to run next (seed "
                  f"{cells[0]['seed'] if cells else '-'})")  # fmt: skip
            return
        for c in cells:
            if stop is not None and dt.datetime.now(dt.UTC) >= stop:
                print("stop time reached", file=sys.stderr)
                return
            out = transfer_cell(c)
            append({**c, **out}, a.out)
            print(f"L{c['L']} N{c['N']} lr {c['lr']:.4g} seed {c['seed']}: loss {out['loss']:.4f}"
                  f" cpu {out['cpu_s']} s", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
