"""Fixed-point reachability on 64 held-out inputs per run (issue 30.3).

Design and criteria: docs/studies/reachability.md.

One-block pre-norm LoopedGPT (K = 1, R = 4) on the seed's tasks (prefix sums, the 4 x 4 Latin
square), recall {none, add, internal} x outer norm {off, on}, 3 seeds (the deviation
from the pre-registered 5 is stated in the study). Each run trains with
constant-lr AdamW and a progressive loop curriculum (1, 2, 3 rounds over the first 300 steps,
then R) until solved (window mean loss < 0.01), plateaued (``patience`` windows without
beating the best by ``rel``, counted once the curriculum is done) or ``--cap`` steps; then
lp.experiments.recall.reach_probe in float64 on 64 held-out inputs (per-input Picard with
the cap from the observed contraction rate, rho at reached points, distinct fixed points,
local constancy) and the accuracy at R and 4R rounds on 512 fresh examples. The criteria
were committed before the run (docs/studies/reachability.md). Cells are cached (resumable).

    nice -n 19 python -m studies reachability --cache DIR   # ~20 CPU-minutes
    python -m studies reachability --quick --cache /tmp/rq --out /tmp/rq.csv
    python -m studies reachability --analyze   # every study's tables, summaries, figures
    nice -n 19 python -m studies reachability --design redesign   # issue 39.4 (redesign.py)

Issue 17's earlier recall-variant study (``reachability_study.csv``) was trained by
:func:`loopprobe.experiments.recall_study`; ``--analyze`` judges it too.

One torch thread. Writes one row per run to --out (``reach_runs.csv`` beside this driver).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

from loopprobe.experiments.recall import TASKS, reach_probe, task_batch
from loopprobe.models import GPTConfig, LoopedGPT
from loopprobe.sweeps import sweep
from studies import _common
from studies.reachability import figures

STUDY_RECALLS = ("none", "add", "internal")
#: The 64-input study's settings as it ran (the redesign uses them unchanged).
BASE = {"d_model": 32, "R": 4, "seq_len": 16, "batch": 32, "lr": 3e-3, "window": 50,
        "patience": 4, "rel": 0.02, "stage": 100, "cap": 600, "inputs": 64,
        "tol": 1e-7, "delta": 1e-3, "base_iter": 300, "hard_cap": 4000}  # fmt: skip


def rounds_at(step: int, R: int, stage: int) -> int:
    """The progressive loop curriculum: 1 round, then one more every ``stage`` steps, up to R."""
    return min(R, 1 + step // stage)


def unrolled(model: LoopedGPT, x: torch.Tensor, rounds: int) -> torch.Tensor:
    h = xe = model.embed(x)
    for r in range(rounds):
        h = model.step(h, xe, r)
    return model.head(h)


def train_to_plateau(cfg: dict) -> tuple[LoopedGPT, dict]:
    """AdamW with the loop curriculum until the windowed task loss stops improving."""
    g = torch.Generator().manual_seed(cfg["seed"])
    inputs, _, vocab = task_batch(cfg["task"], 1, cfg["seq_len"], g)
    gcfg = GPTConfig(vocab_size=vocab, seq_len=inputs.shape[1], d_model=cfg["d_model"],
                     n_heads=4, K=1, R=cfg["R"], recall=cfg["recall"],
                     outer_norm=cfg["outer_norm"], norm=cfg.get("norm", "pre"))  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        model = LoopedGPT(gcfg, generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0)
    window, best, stale, cur, means = cfg["window"], math.inf, 0, [], []
    full_from = (cfg["R"] - 1) * cfg["stage"]  # the first step trained at R rounds
    reason = "cap"
    for step in range(cfg["cap"]):  # noqa: B007 (the count is read after the loop)
        x, y, _ = task_batch(cfg["task"], cfg["batch"], cfg["seq_len"], g)
        rounds = rounds_at(step, cfg["R"], cfg["stage"])
        loss = F.cross_entropy(unrolled(model, x, rounds).flatten(0, 1), y.flatten())
        if not torch.isfinite(loss):
            reason = "non-finite loss"
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step < full_from:
            continue
        cur.append(loss.item())
        if len(cur) == window:
            m, cur = sum(cur) / window, []
            means.append(m)
            stale = 0 if m < best * (1 - cfg["rel"]) else stale + 1
            best = min(best, m)
            if m < 0.01:
                reason = "solved"
                break
            if stale >= cfg["patience"]:
                reason = "plateau"
                break
    return model.eval(), {"steps": step + 1, "stop": reason,
                          "train_loss": means[-1] if means else math.nan}  # fmt: skip


@torch.no_grad()
def accuracy(model: LoopedGPT, x: torch.Tensor, y: torch.Tensor, rounds: int) -> float:
    return float((unrolled(model, x, rounds).argmax(-1) == y).double().mean())


def run(cfg: dict) -> dict:
    t0 = time.process_time()
    model, stats = train_to_plateau(cfg)
    g = torch.Generator().manual_seed(10_000 + cfg["seed"])
    x, y, _ = task_batch(cfg["task"], 512, cfg["seq_len"], g)
    R = cfg["R"]
    accs = {f"acc_R{k * R}": accuracy(model, x, y, k * R) for k in (1, 4)}
    t1 = time.process_time()
    gp = torch.Generator().manual_seed(20_000 + cfg["seed"])
    xp, yp, _ = task_batch(cfg["task"], cfg["inputs"], cfg["seq_len"], gp)
    numbers = reach_probe(model.double(), xp, yp, tol=cfg["tol"], delta=cfg["delta"],
                          seed=cfg["seed"], base_iter=cfg["base_iter"],
                          hard_cap=cfg["hard_cap"])  # fmt: skip
    t2 = time.process_time()
    return {**stats, **accs, **numbers, "cpu_train_s": t1 - t0, "cpu_probe_s": t2 - t1}


run.version = 2


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", help="where each trained run is cached (needed to train)")
    ap.add_argument("--analyze", action="store_true", help="no training: tables and figures")
    ap.add_argument("--out", default=_common.here(__file__, "reach_runs.csv"))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--cap", type=int, default=600)
    ap.add_argument("--quick", action="store_true", help="1 seed, 1 task, 60 steps, 8 inputs")
    ap.add_argument("--limit", type=int, help="only the first LIMIT cells (seed-major order)")
    ap.add_argument(
        "--design",
        choices=("64", "redesign"),
        default="64",
        help="redesign: pre-norm + outer norm vs post-norm (appends to its CSV)",
    )
    a = ap.parse_args(argv)
    if a.design == "redesign" and not a.analyze:
        return _redesign(a)
    if a.analyze:
        figures.analyze(_common.here(__file__, ""), str(_common.FIGURES))
        return
    if a.cache is None:
        ap.error("--cache DIR is needed to train (or --analyze)")
    torch.set_num_threads(1)
    base = dict(BASE, cap=a.cap)
    tasks_ = TASKS
    if a.quick:
        base.update(cap=60, window=5, stage=10, inputs=8)
        tasks_, a.seeds = TASKS[:1], 1
    items = [
        {"task": t, "recall": r, "outer_norm": o, "seed": s, **base}
        for s in range(a.seeds)
        for t in tasks_
        for r in STUDY_RECALLS
        for o in (False, True)
    ]
    items = items[: a.limit] if a.limit is not None else items
    df = sweep(items, run, a.cache, progress=True, name="reachability-64")
    df.to_csv(a.out, index=False, float_format="%.6g")


def _redesign(a: argparse.Namespace) -> None:
    from studies.reachability import redesign

    base = dict(BASE, cap=a.cap)
    seeds, tasks_ = redesign.SEEDS, TASKS
    out = a.out if a.out != _common.here(__file__, "reach_runs.csv") else _common.here(
        __file__, redesign.CELLS)  # fmt: skip
    if a.quick:
        base.update(cap=60, window=5, stage=10, inputs=8)
        seeds, tasks_ = seeds[:1], TASKS[:1]
    items = redesign.cells(base, seeds, tasks_)
    redesign.run_cells(items[: a.limit] if a.limit is not None else items, out)


if __name__ == "__main__":
    main()
