"""The edge learning rate against loop count N under 1/sqrt(N) and 1/N (issue 30.2).

Pre-registered in docs/studies/lr_edge.md (committed before the study's cells ran).
Pre-norm LoopedGPT, K = 1 block looped N times (h <- h + eps f(h), eps = N^-alpha), d_model 32,
4 heads, seq 32, batch 16, byte-level lp.tasks.stdlib_text. Every (scaling, N, lr, seed) cell
trains a fresh model with lp.experiments.lrtransfer.train_short (AdamW betas 0.9/0.95, warmup
5 %, linear decay, clip 1) and records the held-out loss on 8 fixed val batches. At N = 1 both
scalings have eps = 1: those cells are run once (scaling "both") and count for each.
A seed fixes the init and the data order. Cells are cached one by one with lp.sweep in --cache
(resumable); seed-major, so an interrupted run leaves whole seeds; the CSV is rewritten after
every seed.

    nice -n 19 python -m studies lr_edge --cache /work/cache/lr_edge    # the study
    python -m studies lr_edge --analyze      # table + figure from the CSV, seconds
    python -m studies lr_edge --pilot --cache /work/cache/lr_edge_pilot   # pilot, 100 st
    python -m studies lr_edge --pilot --steps 200 --seeds 1 --lrs ... --out ...  # 200 st
    python -m studies lr_edge --task-pilot --cache /work/cache/lr_edge_t2pilot  # part 2
    python -m studies lr_edge --quick --cache /tmp/leq --out /tmp/leq.csv  # smoke
    nice -n 19 python -m studies lr_edge --design redesign   # the redesign (redesign.py)

One torch thread; CPU seconds per cell are in the ``cpu_s`` column.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import pandas as pd
import torch

from loopprobe import tasks
from loopprobe.experiments.lrtransfer import train_short
from loopprobe.models import GPTConfig, LoopedGPT
from loopprobe.sweeps import sweep
from studies import _common
from studies._common import val_batches
from studies.lr_edge import analysis as lr_edge

BASE = {"d": 32, "heads": 4, "seq": 32, "batch": 16, "eval_batches": 8}
SCALINGS = ("1/sqrt(N)", "1/N")
STUDY = {"seed0": 100, "seeds": 6, "steps": 200, "Ns": "1,2,4,8,16",
         "lrs": ",".join(f"{2.0**k:.6g}" for k in range(-7, 1)),
         "out": _common.here(__file__, "lr_edge_study.csv")}  # fmt: skip
TASKS_CSV = _common.here(__file__, "lr_edge_task_pilot.csv")
PILOT = {"seed0": 0, "seeds": 2, "steps": 100, "Ns": "1,8",
         "lrs": ",".join(f"{2.0**k:.6g}" for k in range(-10, 1)),
         "out": _common.here(__file__, "lr_edge_pilot.csv")}  # fmt: skip


def edge_cell(cfg: dict) -> dict:
    """Train one (scaling, N, lr, seed) for ``steps`` steps; the held-out loss and CPU time."""
    cpu0 = time.process_time()
    residual = "1/N" if cfg["scaling"] == "both" else cfg["scaling"]  # N = 1: eps = 1 in both
    gcfg = GPTConfig(vocab_size=256, seq_len=cfg["seq"], d_model=cfg["d"], n_heads=cfg["heads"],
                     K=1, R=cfg["N"], norm="pre", residual=residual)  # fmt: skip
    model = LoopedGPT(gcfg, generator=torch.Generator().manual_seed(cfg["seed"]))
    B, T = cfg["batch"], cfg["seq"]
    out = train_short(model, lambda step, gen: tasks.stdlib_text(B, T, gen), val_batches(cfg),
                      steps=cfg["steps"], lr=cfg["lr"],
                      generator=torch.Generator().manual_seed(7_000 + cfg["seed"]))  # fmt: skip
    out["cpu_s"] = round(time.process_time() - cpu0, 2)
    return out


edge_cell.version = 1


def task_batch(task: str, B: int, T: int, gen: torch.Generator, split: str = "train"):
    """``text``: byte-level stdlib_text; ``parity``: running parity of random bits (vocab 2)."""
    if task == "text":
        return tasks.stdlib_text(B, T, gen, split=split)
    if task == "parity":
        return tasks.prefix_sums(B, T, gen, modulus=2)
    raise ValueError(f"task={task!r}; choose 'text' or 'parity'")


def transfer_cell(cfg: dict) -> dict:
    """Part 2: one (task, d, L, N, lr, seed) of Loop-muP (eps = 1 / (N sqrt(L)), K = L unique
    layers looped N times); held-out loss, and accuracy (argmax) on the held-out batches."""
    cpu0 = time.process_time()
    V = 256 if cfg["task"] == "text" else 2
    gcfg = GPTConfig(vocab_size=V, seq_len=cfg["seq"], d_model=cfg["d"], n_heads=cfg["heads"],
                     K=cfg["L"], R=cfg["N"], norm="pre", residual="loop-mup")  # fmt: skip
    model = LoopedGPT(gcfg, generator=torch.Generator().manual_seed(cfg["seed"]))
    B, T = cfg["batch"], cfg["seq"]
    val = torch.Generator().manual_seed(123 if cfg["task"] == "text" else 10_123)
    evals = [task_batch(cfg["task"], B, T, val, "val") for _ in range(cfg["eval_batches"])]
    out = train_short(model, lambda step, gen: task_batch(cfg["task"], B, T, gen), evals,
                      steps=cfg["steps"], lr=cfg["lr"],
                      generator=torch.Generator().manual_seed(7_000 + cfg["seed"]))  # fmt: skip
    with torch.no_grad():
        hits = [(model(x).argmax(-1) == y).float().mean() for x, y in evals]
    out["acc"] = float(torch.stack(hits).mean())
    out["cpu_s"] = round(time.process_time() - cpu0, 2)
    return out


transfer_cell.version = 1


def edge_cells_for_seed(seed: int, a: argparse.Namespace) -> list[dict]:
    """The coarse grid of one seed: every (scaling, N, lr); N = 1 once, as ``both``."""
    base = {**BASE, "steps": a.steps, "seed": seed}
    out = []
    for N in a.Ns:
        for scaling in ("both",) if N == 1 else SCALINGS:
            out += [{"scaling": scaling, "N": N, "lr": lr, **base} for lr in a.lrs]
    return out


def refine_cells(coarse: pd.DataFrame, cells: list[dict]) -> list[dict]:
    """One cell per uncensored (scaling, N) of a seed at the geometric midpoint of its edge
    bracket: the octave bracket becomes a half-octave one (pre-registered)."""
    e = lr_edge.edges(coarse)
    e = e[~e["censored"]]
    by_key = {(c["scaling"], c["N"]): c for c in cells}
    out = []
    for r in e.itertuples():
        key = ("both", 1) if r.N == 1 else (r.scaling, r.N)
        lr = float(f"{2.0 ** ((r.lo + r.hi) / 2):.6g}")
        cell = {**by_key[key], "lr": lr}
        if cell not in out:
            out.append(cell)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = _common.parser(__doc__, cache="/work/cache/lr_edge", figure=_common.figure("lr_edge.png"),
                        quick="1 seed, 2 lrs, 3 steps: a smoke test")  # fmt: skip
    ap.add_argument(
        "--task-pilot", action="store_true", help="the part-2 task search of the pilot (1 seed)"
    )
    ap.add_argument("--Ns")
    ap.add_argument("--lrs")
    ap.add_argument(
        "--no-refine",
        dest="refine",
        action="store_false",
        help="skip the half-octave refinement of each edge bracket",
    )
    ap.add_argument("--design", choices=("redesign",),
                    help="the redesign without clipping (studies/lr_edge/redesign.py)")
    ap.add_argument("--stop-at", help="with --design: UTC HH:MM, start no cell after it")
    ap.add_argument("--plan", action="store_true", help="with --design: the cells still to run")
    ap.add_argument("--small-steps", action="store_true",
                    help="with --design: the exploratory one-step cells at lr 2^-16 .. 2^-8")
    a = _common.apply_design(ap.parse_args(argv), STUDY, PILOT)
    if a.design == "redesign" and not a.analyze:
        from studies.lr_edge import redesign

        if a.small_steps:
            redesign.run_small()
            return
        redesign.run(a.stop_at, a.plan)
        return
    if a.analyze:
        if a.design != "redesign":
            report(pd.read_csv(a.out), a.figure, TASKS_CSV)
        from studies.lr_edge import redesign, redesign_analysis

        if os.path.exists(redesign.CSV) or os.path.exists(redesign.STEP_CSV):
            print("\n## Redesign (instability edge, no clipping)\n")
            paths = (redesign.CSV, redesign.STEP_CSV, redesign.SMALL_CSV)
            loads = [redesign.load(p) for p in paths]
            print(redesign_analysis.summary_markdown(*loads))
        return
    if a.task_pilot:
        torch.set_num_threads(1)
        task_pilot(a.cache, TASKS_CSV)
        return
    a.Ns = [int(n) for n in a.Ns.split(",")]
    a.lrs = [float(x) for x in a.lrs.split(",")]
    if a.quick:
        a.seeds, a.steps, a.lrs = 1, 3, a.lrs[:2]
    df = _common.run_seeds(range(a.seed0, a.seed0 + a.seeds),
                           lambda seed: edge_cells_for_seed(seed, a), edge_cell, a.cache, a.out,
                           "lr_edge_study", more=refine_cells if a.refine else None)  # fmt: skip
    print(f"{len(df)} cells in {a.out}", file=sys.stderr)


def task_pilot(cache: str, out: str) -> None:
    """Part 2's task search: N = 1 vs 8 under eps = 1/(N sqrt(L)), L = 1, two lrs, one seed."""
    items = [{"task": task, **BASE, "seq": T, "L": 1, "N": N, "lr": lr, "seed": 0, "steps": st}
             for task, T, st in (("parity", 16, 300), ("text", 32, 400))
             for N in (1, 8) for lr in (2**-7, 2**-5)]  # fmt: skip
    df = sweep(items, transfer_cell, cache, progress=True, name="lr_edge_transfer")
    df.to_csv(out, index=False, float_format="%.5g")


def report(df: pd.DataFrame, figure: str | None, tasks_csv: str | None = None) -> None:
    """Print the pre-registered tables and verdict; draw the figures (edge; task pilot)."""
    print(lr_edge.summary_markdown(df))
    if figure:
        lr_edge.figure(df, figure)
        print(f"figure: {figure}")
    if tasks_csv and os.path.exists(tasks_csv):
        t = pd.read_csv(tasks_csv)
        print("\n### Part 2 task pilot (N = 8 must beat N = 1)\n")
        print(lr_edge.task_table(t))
        if figure:
            path = figure.replace(".png", "_tasks.png")
            lr_edge.task_figure(t, path)
            print(f"figure: {path}")


if __name__ == "__main__":
    main()
