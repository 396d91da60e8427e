"""Fixed-point reachability with recall x outer norm, trained to a loss plateau (issue 17).

One-block pre-norm LoopedGPT (K = 1, R rounds) on the seed's tasks (prefix sums, the 4 x 4
Latin square), every recall placement x outer norm on/off, several seeds. Each run trains
with constant-lr AdamW until the task loss plateaus (mean loss per ``window`` steps; stop
when ``patience`` windows in a row fail to beat the best earlier window by ``rel``, or the
loss is below 0.01, or at ``--cap`` steps), then lp.experiments.recall.probe (float64, one
held-out example: Picard fixed point from h0 = x, rho(dT/dh), ||dT/dh||, implicit ||dh*/dx||)
and the accuracy on fresh examples at R and at more rounds than trained (extrapolation).
Runs are cached per cell in --cache (resumable), seed-major.

    python scripts/reachability_study.py --cache DIR   # ~15 CPU-minutes
    python scripts/reachability_study.py --quick --cache /tmp/rq --out /tmp/rq.csv

One torch thread. Writes one row per run to --out.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from loopprobe.experiments.recall import TASKS, probe, task_batch
from loopprobe.models import GPTConfig, LoopedGPT
from loopprobe.sweeps import sweep

EXTRA_ROUNDS = (2, 4)  # accuracy also at 2R and 4R rounds
STUDY_RECALLS = ("none", "add", "internal")  # "linear" left out for the CPU budget


def train_to_plateau(cfg: dict) -> tuple[LoopedGPT, dict]:
    """Constant-lr AdamW until the windowed task loss stops improving; returns model, stats."""
    g = torch.Generator().manual_seed(cfg["seed"])
    inputs, _, vocab = task_batch(cfg["task"], 1, cfg["seq_len"], g)
    gcfg = GPTConfig(vocab_size=vocab, seq_len=inputs.shape[1], d_model=cfg["d_model"],
                     n_heads=4, K=1, R=cfg["R"], recall=cfg["recall"],
                     outer_norm=cfg["outer_norm"])  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        model = LoopedGPT(gcfg, generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0)
    window, best, stale, cur, means = cfg["window"], math.inf, 0, [], []
    reason = "cap"
    for step in range(cfg["cap"]):  # noqa: B007 (the count is read after the loop)
        x, y, _ = task_batch(cfg["task"], cfg["batch"], cfg["seq_len"], g)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        if not torch.isfinite(loss):
            reason = "non-finite loss"
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
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
    h = xe = model.embed(x)
    for r in range(rounds):
        h = model.step(h, xe, r)
    return float((model.head(h).argmax(-1) == y).double().mean())


def run(cfg: dict) -> dict:
    model, stats = train_to_plateau(cfg)
    g = torch.Generator().manual_seed(10_000 + cfg["seed"])
    x, y, _ = task_batch(cfg["task"], 512, cfg["seq_len"], g)
    R = cfg["R"]
    accs = {f"acc_R{k * R}": accuracy(model, x, y, k * R) for k in (1, *EXTRA_ROUNDS)}
    numbers = probe(model.double(), x[:1], tol=cfg["tol"], max_iter=cfg["max_iter"],
                    seed=cfg["seed"])  # fmt: skip
    return {**stats, **accs, **numbers}


run.version = 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", required=True)
    ap.add_argument("--out", default="docs/data/reachability_study.csv")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--cap", type=int, default=800)
    ap.add_argument("--quick", action="store_true", help="1 seed, 1 task, cap 20 steps")
    ap.add_argument("--limit", type=int, help="only the first LIMIT cells (seed-major order)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    base = {"d_model": 32, "R": 4, "seq_len": 16, "batch": 32, "lr": 3e-3, "window": 50,
            "patience": 4, "rel": 0.02, "cap": a.cap, "tol": 1e-6, "max_iter": 300}  # fmt: skip
    tasks_ = TASKS
    if a.quick:
        base.update(cap=20, window=5)
        tasks_, a.seeds = TASKS[:1], 1
    items = [
        {"task": t, "recall": r, "outer_norm": o, "seed": s, **base}
        for s in range(a.seeds)
        for t in tasks_
        for r in STUDY_RECALLS
        for o in (False, True)
    ]
    items = items[: a.limit] if a.limit is not None else items
    df = sweep(items, run, a.cache, progress=True, name="reachability")
    df.to_csv(a.out, index=False, float_format="%.6g")


if __name__ == "__main__":
    main()
