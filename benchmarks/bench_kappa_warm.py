"""Warm starts for a monitor's kappa: from the last kappa's top vectors, k AdamW steps back.

LoopedGPT (DeepLoop, float32, d 64, R 4, K 2, seq 128, batch 8; ``bench_visits.build``),
trained by AdamW (``--lr``) on its fixed random-token batch, one thread. At training steps
``--at`` a cold kappa (error <= ``--tol``) is taken; then, for each k in ``--ks``, the model
trains k more steps and kappa is measured twice, from that kappa's top vectors (``start=``,
what :class:`loopprobe.Monitor` does between its scheduled steps) and cold; the model and
optimizer state are then put back, so every k starts from the same point. Printed: operator
products (Lanczos iterations over the visit and tied operators), CPU seconds, both kappas
with the cold one's error bound, the CPU seconds in training steps (``warm st``, ``cold
st``: one AdamW step of the same model and batch, measured first on a copy), and the |cos|
between each operator's top right singular vector at the two points (its minimum and median
over operators): a start helps as much as it overlaps the new top vector.

    nice -n 19 .venv/bin/python benchmarks/bench_kappa_warm.py
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_visits as bv  # noqa: E402

import loopprobe as lp  # noqa: E402


def products(rep: lp.AlignmentReport) -> int:
    s = rep.sensitivity
    multi = [j for j in s.tied_norms if sum(v.j == j for v in s.visits) > 1]
    return sum(e.iterations for e in s.visit_norms) + sum(s.tied_norms[j].iterations for j in multi)


def overlap(a: lp.AlignmentReport, b: lp.AlignmentReport) -> torch.Tensor:
    A, B = a.sensitivity.vectors.double(), b.sensitivity.vectors.double()
    return (A * B).sum(1).abs() / (A.norm(dim=1) * B.norm(dim=1))


def train_step_cpu(model, idx, loss_fn, lr: float) -> float:
    """CPU seconds of one AdamW training step (the minimum of 5 after one warm-up,
    ``bench_visits.interleaved`` on the CPU clock), on a copy of the model: the columns
    ``warm st``/``cold st`` are kappa's CPU in these units."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(idx), idx).backward()
        opt.step()

    bv.CLOCK.update(fn=time.process_time, name="cpu")
    return min(bv.interleaved({"step": step}, 5)["step"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--R", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--tol", type=float, default=1e-2)
    ap.add_argument("--at", default="0,100,300", help="training steps, comma-separated")
    ap.add_argument("--ks", default="1,10", help="steps between the two kappas")
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    model, probe, idx, loss_fn = bv.build(args.d, max(1, args.d // 64), 128, 8, 2, args.R)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(idx), idx)
        loss.backward()
        opt.step()
        return loss.item()

    def kappa(start=None) -> tuple[lp.AlignmentReport, float]:
        t = time.process_time()
        rep = lp.visit_alignment(probe, idx, loss_fn, tol=args.tol, start=start)
        return rep, time.process_time() - t

    unit = train_step_cpu(model, idx, loss_fn, args.lr)
    print(f"d {args.d} R {args.R}, AdamW lr {args.lr:g}, kappa error <= {args.tol:g}, one thread;"
          f" a training step {unit:.4f} CPU-s (min of 5, on a copy)")  # fmt: skip
    head = f"{'step':>5} {'+k':>3} {'loss':>6} {'warm prod':>9} {'cold prod':>9} {'warm s':>6} "
    head += f"{'cold s':>6} {'warm st':>7} {'cold st':>7} "
    print(head + f"{'kappa warm':>10} {'kappa cold':>10} {'err':>7} cos min  median")
    trained = 0
    for at in [int(x) for x in args.at.split(",")]:
        while trained < at:
            step()
            trained += 1
        before, _ = kappa()
        for k in [int(x) for x in args.ks.split(",")]:
            params = [p.detach().clone() for p in model.parameters()]
            state = copy.deepcopy(opt.state_dict())
            for _ in range(k):
                loss = step()
            warm, cpu_w = kappa(before)
            cold, cpu_c = kappa()
            cos = overlap(before, cold)
            print(f"{at:>5} {k:>3} {loss:6.3f} {products(warm):9d} {products(cold):9d} "
                  f"{cpu_w:6.1f} {cpu_c:6.1f} {cpu_w / unit:7.0f} {cpu_c / unit:7.0f} "
                  f"{warm.kappa:10.5f} {cold.kappa:10.5f} "
                  f"{cold.kappa_err:7.1g} {float(cos.min()):7.3f} {float(cos.median()):7.4f}",
                  flush=True)  # fmt: skip
            with torch.no_grad():
                for p, saved in zip(model.parameters(), params, strict=True):
                    p.copy_(saved)
            opt.load_state_dict(state)


if __name__ == "__main__":
    main()
