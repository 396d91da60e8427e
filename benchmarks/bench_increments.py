"""Recording overhead of lp.increments over a plain forward (issue 4: <= 1.2x).

Times, interleaved in one run (so load on the machine hits all alike), in CPU time of
this process (``time.process_time``: time spent waiting for a busy machine's cores is not
counted; ``--clock wall`` for wall time): the plain ``model.hidden(idx)`` forward,
``probe.record`` (hooks + per-visit copies of inputs and outputs) and the full
``lp.increments`` (one visit session keeping the increments, then cosine matrices, ratios,
stream RMS) on the pre-norm reference model, tied K=1 for N rounds. Prints the ratios of
the fastest repeats (as timeit does: the least disturbed by other processes).

    .venv/bin/python benchmarks/bench_increments.py [--threads 1] [--repeats 15]
"""

from __future__ import annotations

import argparse
import time

import torch

import loopprobe as lp
from loopprobe.models import GPTConfig, LoopedGPT

SIZES = [  # (d_model, seq_len, batch, N)
    (64, 32, 8, 32),
    (128, 64, 8, 16),
    (128, 128, 8, 32),
]


CLOCK = {"cpu": time.process_time, "wall": time.perf_counter}
clock = CLOCK["cpu"]


def timed(fn, inner: int) -> float:
    t = clock()
    for _ in range(inner):
        fn()
    return (clock() - t) / inner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--clock", choices=list(CLOCK), default="cpu")
    args = ap.parse_args()
    global clock
    clock = CLOCK[args.clock]
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), {args.clock} time, "
        f"fastest of {args.repeats} interleaved repeats"
    )
    head = ["d", "T", "B", "N", "forward ms", "record x", "increments x"]
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, WIDTHS, strict=True)))
    for size in SIZES:
        base, ratio = measure(*size, repeats=args.repeats)
        cells = [*size, f"{base * 1e3:.1f}", f"{ratio['record']:.2f}", f"{ratio['increments']:.2f}"]
        print(" ".join(f"{c:>{w}}" for c, w in zip(cells, WIDTHS, strict=True)))


WIDTHS = [4, 4, 3, 3, 11, 9, 13]


def measure(d: int, T: int, B: int, N: int, repeats: int) -> tuple[float, dict]:
    """Fastest forward time and the ratios of the fastest record/increments to it."""
    cfg = GPTConfig(vocab_size=256, seq_len=T, d_model=d, n_heads=4, K=1, R=N, residual="1/N")
    model = LoopedGPT(cfg, generator=torch.Generator().manual_seed(0))
    idx = torch.randint(256, (B, T), generator=torch.Generator().manual_seed(1))
    probe = lp.attach(model)

    def hidden(m, x):
        return m.hidden(x)

    fns = {
        "forward": lambda: model.hidden(idx),
        "record": lambda: probe.record(idx, forward=hidden),
        "increments": lambda: lp.increments(probe, idx),
    }
    for fn in fns.values():
        fn()  # warm-up
    inner = max(1, int(0.2 / timed(fns["forward"], 1)))
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            times[k].append(timed(fn, inner))
    # the fastest repeat of each is the least disturbed by other processes (as timeit does)
    base = min(times["forward"])
    return base, {k: min(v) / base for k, v in times.items()}


if __name__ == "__main__":
    main()
