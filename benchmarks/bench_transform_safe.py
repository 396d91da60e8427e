"""Cost of making probes transform-safe (issue 10): the attention-layout TorchFunctionMode
and the inline-checkpoint patch around every probe, on a model that needs neither.

Times ``sensitivity_norms`` (power iteration, a fixed 20 iterations) on the reference
LoopedGPT (K=2, R=4, d 32, float64, one thread) with ``loopprobe.autodiff.transform_safe``
as shipped, with the math-kernel setting and the checkpoint patch but no mode, and with
nothing; interleaved repeats, CPU time, the ratio of the fastest repeats.

    .venv/bin/python benchmarks/bench_transform_safe.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import time
from contextlib import contextmanager

import torch

import loopprobe as lp
import loopprobe.autodiff as ad
import loopprobe.record.probe as visits


@contextmanager
def bare():
    yield


@contextmanager
def no_mode():
    with ad.sdpa_kernel(ad.SDPBackend.MATH), ad.inline_checkpoint():
        yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = lp.models.GPTConfig(K=2, R=4, norm="deeploop", d_model=32, n_heads=4, seq_len=16)
    model = lp.models.LoopedGPT(cfg).double()
    idx, _ = lp.tasks.random_tokens(4, 16, 64, generator=torch.Generator().manual_seed(0))
    variants = {"shipped": ad.transform_safe, "no layout mode": no_mode, "nothing": bare}
    times: dict[str, list[float]] = {k: [] for k in variants}
    try:
        for _ in range(args.repeats + 1):  # the first round warms up and is dropped
            for name, ctx in variants.items():
                visits.transform_safe = ctx
                t = time.process_time()
                lp.sensitivity_norms(lp.attach(model), idx, method="power", max_iter=20, tol=0.0)
                times[name].append(time.process_time() - t)
    finally:
        visits.transform_safe = ad.transform_safe
    best = {k: min(v[1:]) for k, v in times.items()}
    for name, t in best.items():
        print(f"{name:15s} {t:6.2f} CPU-s (fastest of {args.repeats})")
    print(f"shipped / nothing        = {best['shipped'] / best['nothing']:.3f}x")
    print(f"shipped / no layout mode = {best['shipped'] / best['no layout mode']:.3f}x")


if __name__ == "__main__":
    main()
