"""Issue 18.5: the GPT-2-small-scale case on a GPU: time and peak memory of G, U norms, kappa.

LoopedGPT (DeepLoop, float32, vocab 256 by default, random tokens, cross-entropy, weights
from ``torch.Generator().manual_seed(0)``) at d_model 768, 12 heads, K=2, R=8, seq 1024,
batch 8, moved to ``--device`` (default ``cuda``). Measured after a warm-up (one step,
one G, one U iteration): one training step (forward + backward + AdamW step, the unit), all-visit
G (full and ``memory="low"``), U norms (``lp.sensitivity_norms``) and kappa
(``lp.visit_alignment``). U with ``--max-iter`` iterations (default 5) and ``tol=0``
(every operator runs them all; NOT converged, the cost per iteration is what to scale);
kappa to its error bound ``--kappa-tol`` (default 1e-2, what a training monitor affords;
issue 29) within ``--kappa-iter`` iterations (default 100; 2 with ``--small``), printed
with ``kappa_err``, whether it converged and its operator products. ``--repeats`` (3;
1 with ``--small``): step, G and G low are timed that many times (the minimum).
Time: wall clock with ``torch.cuda.synchronize`` around each call. Peak memory:
``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats``, above what was allocated before the call; on CPU the peak
of the heap in use (glibc ``mallinfo2``, as in ``bench_visits.py``). The batched
operators use the chunk size ``loopprobe._memory`` picks from the device's free memory.

    .venv/bin/python benchmarks/bench_gpu.py                      # CUDA, GPT-2-small scale
    .venv/bin/python benchmarks/bench_gpu.py --device cpu --small # CPU, reduced size, ~10 s

``--small`` runs d_model 32, 4 heads, K=2, R=2, seq 16, batch 2, max_iter 2 (the CI smoke
run of tests/test_bench_gpu.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_visits as bv  # noqa: E402

import loopprobe as lp  # noqa: E402

GPT2_SMALL = {"d": 768, "heads": 12, "K": 2, "R": 8, "seq": 1024, "batch": 8}
REPEATED = ("step", "G", "G low")
SMALL = {"d": 32, "heads": 4, "K": 2, "R": 2, "seq": 16, "batch": 2}


def measured(fn: Callable[[], object], device: torch.device) -> tuple[object, float, float]:
    """Run ``fn`` once: its result, wall seconds and peak memory above the start (MiB)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize(device)
        wall = time.perf_counter() - t
        return out, wall, (torch.cuda.max_memory_allocated(device) - base) / 2**20
    in_use = bv.heap_in_use()
    box: dict = {}

    def run() -> object:
        t = time.perf_counter()
        box["out"] = fn()
        box["wall"] = time.perf_counter() - t
        return box["out"]

    peak = bv.peak_extra(run, in_use) if in_use is not None else math.nan
    if in_use is None:
        run()
    return box["out"], box["wall"], peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="reduced size (CPU smoke run)")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--max-iter", type=int, default=None, help="U/kappa iterations (5; 2 small)")
    ap.add_argument("--kappa-tol", type=float, default=1e-2, help="bound on kappa's error")
    ap.add_argument("--kappa-iter", type=int, default=None, help="kappa iterations (100)")
    ap.add_argument("--repeats", type=int, default=None, help="timings of step/G (3; 1 small)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads on CPU")
    ap.add_argument("--json", action="store_true", help="also print the rows as one JSON line")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_gpu: no CUDA device here; NOT RUN on a GPU (try --device cpu --small)")
    torch.set_num_threads(args.threads)
    size = SMALL if args.small else GPT2_SMALL
    it = args.max_iter or (2 if args.small else 5)
    kit = args.kappa_iter or (2 if args.small else 100)
    repeats = args.repeats or (1 if args.small else 3)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"loopprobe {lp.__version__}, torch {torch.__version__}, {name}; LoopedGPT DeepLoop "
        f"float32 d_model {size['d']}, {size['heads']} heads, K={size['K']}, R={size['R']}, "
        f"seq {size['seq']}, batch {size['batch']}, vocab {args.vocab}; U and kappa: "
        f"{it} iterations, tol=0 (not converged); kappa to error {args.kappa_tol:g} within "
        f"{kit} iterations"
    )
    dims = [size[k] for k in ("d", "heads", "seq", "batch", "K", "R")]
    model, probe, idx, loss_fn = bv.build(*dims, vocab=args.vocab, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(idx), idx).backward()
        opt.step()

    gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731 - CPU draws, same on any device
    cases = {
        "step": step,
        "G": lambda: lp.per_visit_updates(probe, idx, loss_fn),
        "G low": lambda: lp.per_visit_updates(probe, idx, loss_fn, memory="low"),
        "U": lambda: lp.sensitivity_norms(probe, idx, max_iter=it, tol=0.0, generator=gen()),
        "kappa": lambda: lp.visit_alignment(
            probe, idx, loss_fn, max_iter=kit, tol=args.kappa_tol, generator=gen()
        ),
    }
    # Warm-up: optimizer state, allocator, kernels, torch.func's first-call set-up.
    step()
    cases["G"]()
    lp.sensitivity_norms(probe, idx, max_iter=1, tol=0.0, generator=gen())
    rows = {}
    print(f"{'what':>6} {'wall s':>9} {'steps':>8} {'peak MiB':>9}  notes")
    for key, fn in cases.items():
        runs = [measured(fn, device) for _ in range(repeats if key in REPEATED else 1)]
        out, wall, peak = min(runs, key=lambda r: r[1])
        note = ""
        if key == "kappa":
            products = int(out.visits.iterations.sum()) + sum(
                e.iterations for j, e in out.sensitivity.tied_norms.items()
                if (out.visits.j == j).sum() > 1
            )  # fmt: skip
            state = "converged" if out.converged else "NOT converged"
            note = (
                f"kappa {out.kappa:.4g}, err {out.kappa_err:.2g} ({state}), {products} "
                f"products, {out.sensitivity.method}"
            )
        elif key == "U":
            note = f"{len(out.visit_norms) + len(out.tied_norms)} operators, {out.method}"
        rows[key] = {"wall": wall, "peak_mib": peak, "note": note}
        x = wall / rows["step"]["wall"]
        print(f"{key:>6} {wall:9.3f} {x:8.2f} {peak:9.1f}  {note}")
    if args.json:
        print(
            json.dumps(
                {"device": name, "size": size, "max_iter": it, "kappa_iter": kit, "rows": rows}
            )
        )


if __name__ == "__main__":
    main()
