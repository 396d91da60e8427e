"""Intra-op thread count for probing small models: an opt-in context manager and the rule.

Why. Probing a small looped model runs many tiny kernels (a JVP and a VJP per visit per
power iteration). With two or more intra-op threads, every kernel ends at a barrier where
the threads wait for each other; when another process holds one of the cores, a waiting
thread is descheduled for a whole time slice and the run collapses. Measured on a 2-core
machine with one core kept busy by a busy-loop process (``benchmarks/bench_threads.py``):
``loopprobe kappa --K 2 --R 4 --norm deeploop`` (d_model 32) is 10-30x slower with two
threads than with one, while on an idle machine two threads gain nothing at that size.
Above about ``THRESHOLD`` parameter-tokens (parameters times token positions, about the
multiply-adds of one forward; LoopedGPT d_model 256, seq 128, batch 8, K=2 is 1.6e9) the
kernels are large enough that a busy core costs at most about 2x and an idle one pays off.

The library never changes the thread setting of the calling process. The ``loopprobe``
command line applies :func:`auto_threads` (one thread below ``THRESHOLD``, torch's default
above, ``--threads N`` overrides); from Python, opt in with :func:`threads`::

    with lp.threads(1):          # restores torch.get_num_threads() on exit
        rep = probe.alignment(inputs, loss_fn)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

#: Parameter-tokens (parameters x token positions per batch) below which one intra-op
#: thread is used by the command line; measured in ``benchmarks/bench_threads.py``.
THRESHOLD = 1e9


@contextmanager
def threads(n: int) -> Iterator[int]:
    """Run the block with ``n`` intra-op torch threads; restore the previous count on exit.

    Opt-in: loopprobe's functions never change the process setting themselves. One thread
    is the safe choice for small models on a shared or busy machine (see the module
    docstring for the measured reason); the previous ``torch.get_num_threads()`` is restored
    also when the block raises.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"threads: n={n!r}; give an integer >= 1 (e.g. lp.threads(1))")
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(previous)


def work(model: nn.Module, inputs: Any = None) -> float:
    """Parameter-tokens of one forward: parameters x token positions in ``inputs``.

    Token positions: the element count of the first integer tensor found in ``inputs``
    (token ids), else of the first floating tensor without its last (feature) axis; 1 when
    ``inputs`` holds no tensor.
    """
    params = sum(p.numel() for p in model.parameters())
    return float(params * _positions(inputs))


def auto_threads(work: float, default: int | None = None) -> int:
    """One thread below :data:`THRESHOLD` parameter-tokens, else ``default`` (torch's)."""
    if default is None:
        default = torch.get_num_threads()
    return 1 if work < THRESHOLD else max(1, default)


def _positions(inputs: Any) -> int:
    tensors = list(_tensors(inputs))
    for t in tensors:
        if not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool:
            return max(1, t.numel())
    for t in tensors:
        if t.is_floating_point():
            return max(1, t.numel() // max(1, t.shape[-1] if t.ndim else 1))
    return 1


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)
