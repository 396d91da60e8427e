"""The optimal learning rate against unique layers L and loops N under Loop-muP (issue 30.2 part 2).

Design and criteria fixed in docs/studies/lr_l.md before any confirmatory cell; none has run,
because the pilot's task search (--pilot a .. f) found no task where N = 8 beats N = 1; the
redesign without that gate (issue 39.3) has its own driver, studies/lr_l/redesign.py.
Pre-norm LoopedGPT, K = L unique blocks looped N times, residual "loop-mup"
(eps = 1 / (N sqrt(L))), on k-hop pointer chasing (lp.tasks.pointer_chasing: loss and accuracy
on the answer at the last position only). Every (d, L, N, lr, seed) cell trains a fresh model
with lp.experiments.lrtransfer.train_short (AdamW betas 0.9/0.95, warmup 5 %, linear decay,
clip 1) and records the held-out loss and accuracy on fixed val batches. A seed fixes the init
and the data order (paired across arms). Cells are cached one by one with lp.sweep in --cache
(resumable; the same command resumes); seed-major; the CSV is rewritten after every seed.

    nice -n 19 python -m studies lr_l --cache /work/cache/lr_l     # the study
    python -m studies lr_l --analyze        # table, verdict, figure from the CSV, seconds
    python -m studies lr_l --pilot NAME     # one exploratory pilot block (PILOTS below)
    python -m studies lr_l --quick --cache /tmp/llq --out /tmp/llq.csv   # smoke test
    nice -n 19 python -m studies.lr_l.redesign   # the redesign without the gate (redesign.py)

One torch thread; CPU seconds per cell are in the ``cpu_s`` column.
"""

from __future__ import annotations

import argparse
import math
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
from studies.lr_l import analysis as lr_l

PILOT_CSV = _common.here(__file__, "lr_l_pilot.csv")
REDESIGN_CSV = _common.here(__file__, "redesign.csv")
REDESIGN_FIGURE = _common.figure("lr_l_redesign.png")
BASE = {"task": "chase", "m": 8, "hops": 3, "d": 32, "heads": 4, "batch": 32, "eval_batches": 8}


def last_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy of the answer at the last position: ``(B, T, V)`` logits, ``(B,)`` targets."""
    return torch.nn.functional.cross_entropy(logits[:, -1], targets)


def chase_batch(cfg: dict, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if cfg["task"] == "modsum":  # pilot only: [a_1 .. a_hops, =] -> sum mod m
        a = torch.randint(cfg["m"], (cfg["batch"], cfg["hops"]), generator=gen)
        eq = torch.full((cfg["batch"], 1), cfg["m"], dtype=torch.long)
        return torch.cat([a, eq], dim=1), a.sum(dim=1) % cfg["m"]
    return tasks.pointer_chasing(cfg["batch"], gen, m=cfg["m"], hops=cfg["hops"])


def chase_cell(cfg: dict) -> dict:
    """Train one (d, L, N, lr, seed) for ``steps`` steps; held-out loss, accuracy, CPU time."""
    cpu0 = time.process_time()
    m = cfg["m"]
    V, T = (m + 1, cfg["hops"] + 1) if cfg["task"] == "modsum" else (m * m + m, m + 1)
    gcfg = GPTConfig(vocab_size=V, seq_len=T, d_model=cfg["d"], n_heads=cfg["heads"],
                     K=cfg["L"], R=cfg["N"], norm="pre", residual="loop-mup")  # fmt: skip
    model = LoopedGPT(gcfg, generator=torch.Generator().manual_seed(cfg["seed"]))
    val = torch.Generator().manual_seed(10_123)
    evals = [chase_batch(cfg, val) for _ in range(cfg["eval_batches"])]
    out = train_short(model, lambda step, gen: chase_batch(cfg, gen), evals, steps=cfg["steps"],
                      lr=cfg["lr"], loss_fn=last_token_loss,
                      generator=torch.Generator().manual_seed(7_000 + cfg["seed"]))  # fmt: skip
    with torch.no_grad():
        hits = [(model(x)[:, -1].argmax(-1) == y).float().mean() for x, y in evals]
    out["acc"] = float(torch.stack(hits).mean())
    out["cpu_s"] = round(time.process_time() - cpu0, 2)
    return out


chase_cell.version = 1


def octaves(lo: float, hi: float, step: float = 1.0) -> list[float]:
    n = round((hi - lo) / step)
    return [float(f"{2.0 ** (lo + i * step):.6g}") for i in range(n + 1)]


def pilot_items(name: str) -> list[dict]:
    """The exploratory pilot blocks (step 1 of the brief), one seed each unless said."""
    if name == "a":  # first look: hops 2 and 3, m 8, L 1, N 1 vs 8, three lrs
        return [{**BASE, "hops": k, "L": 1, "N": N, "lr": lr, "seed": 0, "steps": 400}
                for k in (2, 3) for N in (1, 8) for lr in octaves(-8, -4, 2)]  # fmt: skip
    if name == "b":  # nothing learned in a: smaller m, bigger batch, longer; hop 1 as a control
        return [{**BASE, "m": 6, "hops": k, "batch": 64, "L": 1, "N": N, "lr": lr, "seed": 0,
                 "steps": 800}
                for k in (1, 2) for N in (1, 8) for lr in octaves(-7, -5, 2)]  # fmt: skip
    if name == "c":  # N = 8 preferred the larger lr in b: reach 2^-3; 3 hops at m 6, 2 at m 8
        return [{**BASE, "m": m, "hops": k, "batch": 64, "L": 1, "N": N, "lr": lr, "seed": 0,
                 "steps": 1000} for m, k in ((6, 3), (8, 2)) for N in (1, 8)
                for lr in octaves(-7, -3, 2)]  # fmt: skip
    if name == "d":  # N = 8 behind in a-c: multi-operand modular sum (pilot-only generator)
        return [{**BASE, "task": "modsum", "m": p, "hops": k, "batch": 64, "L": 1, "N": N,
                 "lr": lr, "seed": 0, "steps": 1000} for p, k in ((7, 4), (11, 3))
                for N in (1, 8) for lr in octaves(-7, -5, 2)]  # fmt: skip
    if name == "e":  # nothing learned in d; does the gap of c (m 6, 3 hops) close at 2000 steps,
        # and does depth help at all (L = 2 untied-in-depth, N = 1; L = 1, N = 2)?
        arms = [(1, 1, 2**-7), (1, 8, 2**-7), (1, 8, 2**-8), (2, 1, 2**-7), (1, 2, 2**-7)]
        return [{**BASE, "m": 6, "hops": 3, "batch": 64, "L": L, "N": N, "lr": lr, "seed": 0,
                 "steps": 2000} for L, N, lr in arms]  # fmt: skip
    if name == "f":  # e's N = 8 preferred the lower lr: one lr below each of N = 1 and N = 8
        arms = [(1, 1, 2**-8), (1, 8, 2**-9)]
        return [{**BASE, "m": 6, "hops": 3, "batch": 64, "L": L, "N": N, "lr": lr, "seed": 0,
                 "steps": 2000} for L, N, lr in arms]  # fmt: skip
    raise ValueError(f"--pilot {name!r}: unknown block")


def run_pilot(name: str, cache: str) -> None:
    df = sweep(pilot_items(name), chase_cell, cache, progress=True, name="lr_l_pilot")
    df.insert(0, "block", name)
    old = pd.read_csv(PILOT_CSV) if os.path.exists(PILOT_CSV) else None
    if old is not None:
        df = pd.concat([old[old["block"] != name], df], ignore_index=True)
    os.makedirs(os.path.dirname(PILOT_CSV), exist_ok=True)
    df.to_csv(PILOT_CSV, index=False, float_format="%.5g")
    cols = ["block", "hops", "m", "d", "L", "N", "lr", "steps", "seed", "loss", "acc", "cpu_s"]
    print(df[df["block"] == name][[c for c in cols if c in df]].to_string(index=False))


def study_items(seed: int, a: argparse.Namespace) -> list[dict]:
    """One seed of the design in docs/studies/lr_l.md: every (d, L, N, lr)."""
    base = {**BASE, "m": a.m, "hops": a.hops, "batch": a.batch, "steps": a.steps, "seed": seed}
    return [{**base, "d": d, "L": L, "N": N, "lr": lr}
            for d in a.ds for L in (1, 2) for N in (1, 2, 4, 8) for lr in a.lrs]  # fmt: skip


def run_study(a: argparse.Namespace) -> None:
    """Seed-major, every cell cached in ``a.cache``; the CSV is rewritten after every seed."""
    df = _common.run_seeds(range(a.seed0, a.seed0 + a.seeds), lambda seed: study_items(seed, a),
                           chase_cell, a.cache, a.out, "lr_l_study")  # fmt: skip
    print(f"{len(df)} cells in {a.out}", file=sys.stderr)


def report(out: str, figure: str) -> None:
    """The task search (table, qualifying line, figure); the study's table, verdict and figure
    where its CSV exists."""
    pilot = pd.read_csv(PILOT_CSV)
    print("### Task search (N = 8 must beat N = 1)\n")
    print(lr_l.pilot_markdown(pilot))
    print(f"\npilot CPU: {pilot['cpu_s'].sum() / 60:.1f} min")
    if os.path.exists(out):
        cells = pd.read_csv(out)
        print("\n### Study\n")
        print(lr_l.summary_markdown(cells))
        lr_l.figure(cells, figure)
    else:
        print(f"\nno study cells ({out}): verdict undecided (no task qualified)")
        lr_l.pilot_figure(pilot, figure)
    print(f"figure: {figure}")
    if os.path.exists(REDESIGN_CSV):  # issue 39.3: the grid without the gate
        cells = pd.read_csv(REDESIGN_CSV)
        part = lr_l.complete_part(cells)
        print(f"\n### Redesign (no gate): {len(cells)} cells, {cells['cpu_s'].sum() / 60:.1f} "
              f"CPU-min; {part['seed'].nunique()} complete seeds\n")  # fmt: skip
        if len(part):
            print(lr_l.summary_markdown(part, math.log(256)))
            lr_l.figure(part, REDESIGN_FIGURE, ylabel="held-out loss (next byte)")
            print(f"figure: {REDESIGN_FIGURE}")
        v, why = lr_l.redesign_claim(cells)
        print(f"\nRedesign verdict: **{v}** ({why})")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", default="/work/cache/lr_l")
    ap.add_argument("--pilot", help="run one exploratory pilot block into " + PILOT_CSV)
    ap.add_argument("--analyze", action="store_true", help="no training: tables and figure")
    ap.add_argument("--quick", action="store_true", help="1 seed, 2 lrs, 3 steps: a smoke test")
    ap.add_argument("--seed0", type=int, default=100)
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--m", type=int, default=6)
    ap.add_argument("--hops", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ds", default="32", help="widths, comma-separated")
    ap.add_argument("--lrs", default=",".join(map(str, octaves(-10, -5, 0.5))))
    ap.add_argument("--out", default=_common.here(__file__, "lr_l_study.csv"))
    ap.add_argument("--figure", default=_common.figure("lr_l.png"))
    a = ap.parse_args(argv)
    if a.analyze:
        report(a.out, a.figure)
        return
    torch.set_num_threads(1)
    if a.pilot:
        run_pilot(a.pilot, a.cache + "_pilot")
        return
    a.ds = [int(d) for d in a.ds.split(",")]
    a.lrs = [float(x) for x in a.lrs.split(",")]
    if a.quick:
        a.seeds, a.steps, a.lrs = 1, 3, a.lrs[:2]
    run_study(a)


if __name__ == "__main__":
    main()
