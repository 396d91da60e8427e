"""Per-rank cost and communication of distributed probing on CPU with gloo (issue 16).

LoopedGPT K=2, d 32, 4 heads, seq 16, global batch 8 (flags change them), float64, one
thread per rank, for R in (2, 4) and world size 1 and 2 (each rank holds batch / world
sequences). Per rank:
CPU seconds of ``per_visit_updates`` (G) and of ``sensitivity_norms`` with power
iteration run for exactly ``--iters`` iterations (``tol=0``), and the bytes and calls of
every all-reduce the probe makes (counted by a :class:`loopprobe.distributed.Ranks`
subclass), next to the paper formulas of docs/distributed.md:

    G:        sum_j R_j n_j numbers, once;
    U, power: B_ops (n_max + 1) numbers per iteration (U^T U v and ||U v||^2),
              B_ops = M visits + 2K tied sums, n_max = the largest sublayer.

The per-iteration bytes are the difference to a one-iteration run (the start vectors,
``U^T w`` and ``||F||`` are reduced once per call).

    .venv/bin/python benchmarks/bench_distributed.py [--iters 10] [--batch 8 --seq 16 --d 32]
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import loopprobe as lp
from loopprobe.distributed import Ranks


class CountingRanks(Ranks):
    """Ranks that count what they all-reduce."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes, self.calls = 0, 0

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        self.bytes += t.numel() * t.element_size()
        self.calls += 1
        return super().sum(t)


def loss(out: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out[:, :-1].flatten(0, 1), idx[:, 1:].flatten())


def cpu(fn) -> tuple[float, object]:
    t = time.thread_time()
    out = fn()
    return time.thread_time() - t, out


def work(rank: int, world: int, port: int, R: int, a: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    cfg = lp.models.GPTConfig(vocab_size=64, seq_len=a.seq, d_model=a.d, n_heads=4, K=2, R=R)
    model = lp.models.LoopedGPT(cfg, generator=torch.Generator().manual_seed(0)).double()
    idx = torch.randint(0, 64, (a.batch, a.seq), generator=torch.Generator().manual_seed(1))
    iters = a.iters
    x = idx.chunk(world)[rank]
    ranks = CountingRanks()
    probe = lp.attach(model, ranks=ranks)
    probe.visits(x)  # discovery outside the timings
    lp.per_visit_updates(probe, x, loss)  # warm-up
    ranks.bytes = ranks.calls = 0
    t_G, ups = cpu(lambda: lp.per_visit_updates(probe, x, loss))
    g_bytes, g_calls = ranks.bytes, ranks.calls
    ranks.bytes = ranks.calls = 0
    lp.sensitivity_norms(probe, x, method="power", max_iter=1, tol=0.0)
    once, ranks.bytes, ranks.calls = ranks.bytes, 0, 0  # one iteration + the fixed part
    t_U, sens = cpu(lambda: lp.sensitivity_norms(probe, x, method="power", max_iter=iters, tol=0.0))
    n = [g.sublayer.numel for g in probe.groups()]
    ops = len(sens.visits) + len(n)
    rows = {
        "t_G": t_G,
        "t_U_iter": t_U / iters,
        "G_bytes": g_bytes,
        "G_formula": sum(R * nj for nj in n) * 8,
        "G_calls": g_calls,
        "U_bytes_iter": (ranks.bytes - once) / (iters - 1),
        "U_formula_iter": ops * (max(n) + 1) * 8,
        "U_calls": ranks.calls,
        "ops": ops,
    }
    if rank == 0:
        torch.save(rows, os.path.join(out, f"R{R}_w{world}.pt"))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8, help="global batch (8)")
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--d", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        res = {}
        for R in (2, 4):
            for world in (1, 2):
                mp.spawn(work, args=(world, free_port(), R, args, out), nprocs=world)
                res[R, world] = torch.load(os.path.join(out, f"R{R}_w{world}.pt"))
    print("R world ops  G CPU-s  U CPU-s/iter  G MB (formula)   U KB/iter (formula)  calls G/U")
    for (R, world), r in res.items():
        print(
            f"{R} {world:5d} {r['ops']:4d} {r['t_G']:8.3f} {r['t_U_iter']:13.4f}  "
            f"{r['G_bytes'] / 1e6:5.3f} ({r['G_formula'] / 1e6:5.3f})  "
            f"{r['U_bytes_iter'] / 1e3:8.1f} ({r['U_formula_iter'] / 1e3:8.1f})  "
            f"{r['G_calls']}/{r['U_calls']}"
        )
    for R in (2, 4):
        a, b = res[R, 1], res[R, 2]
        print(
            f"R={R}: per-rank CPU, world 2 / world 1: G {b['t_G'] / a['t_G']:.2f}, "
            f"U per iteration {b['t_U_iter'] / a['t_U_iter']:.2f}"
        )
    for world in (1, 2):
        a, b = res[2, world], res[4, world]
        print(
            f"world={world}: R 4 / R 2: G {b['t_G'] / a['t_G']:.2f}, "
            f"U per iteration {b['t_U_iter'] / a['t_U_iter']:.2f}"
        )


if __name__ == "__main__":
    main()
