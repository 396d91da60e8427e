"""Intra-op thread count for probing: an opt-in context manager and the command line's rule.

Why. Probing a small looped model runs many tiny kernels (a JVP and a VJP per visit per
power iteration). With two or more intra-op threads every kernel ends at a barrier where
the threads wait for each other; when another process holds a core, a waiting thread is
descheduled for a time slice and the run collapses. Measured on a 2-core machine with one
core kept busy by a busy-loop process (``benchmarks/bench_threads.py``, a shared machine
with a load average of about 8 during the run): ``loopprobe kappa --K 2 --R 4 --norm
deeploop --max-iter 20`` (d_model 32) took over 240 s with two threads and 71 s with one
(> 3.4x), and an earlier run measured 20 s against over 5 minutes at 100 iterations. One
forward+backward of that model gains nothing from a second thread even on a quiet
machine (1.04x), while with one core busy it loses 1.4x at d_model 32, 2.2x at 64, 2.8x
at 128 and 1.7x at 256; on a quiet machine two threads gain from d_model 64 on (0.84x,
0.54x at 128) (``--calibrate`` sizes: d_model/seq/batch 32/16/4, 64/32/8, 128/64/8,
256/128/8; one run at load average 0.3). On a machine loaded well beyond its cores (load
average 8), two threads lost 4-16x at every size up to d_model 256.

Hence the rule of the ``loopprobe`` command line (:func:`auto_threads`): one thread below
:data:`THRESHOLD` parameter-tokens (parameters times token positions, about the
multiply-adds of one forward; LoopedGPT d_model 256, seq 128, batch 8, K=2 is 1.6e9; the
reference models of every command are far below), above it torch's default capped at the
cores the 1-minute load average leaves idle; ``--threads N`` overrides.

The library never changes the thread setting of the calling process; from Python, opt in
with :func:`threads`::

    with lp.threads(1):          # restores torch.get_num_threads() on exit
        rep = lp.visit_alignment(probe, inputs, loss_fn)

numpy's and scipy's BLAS (OpenBLAS, MKL, BLIS, ...) have thread pools of their own, which
``torch.set_num_threads`` does not reach: :func:`blas_threads` sets them for a block through
threadpoolctl (for the scaling-law fit, L-BFGS-B on 6-vectors, one thread is the rule;
measured on the loaded 2-core machine: 20 L-BFGS-B fits of a 6-d Rosenbrock took 0.6-1.6 s
with OpenBLAS at 2 threads and 0.08-0.17 s at one, two runs each).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
    import torch

    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"threads: n={n!r}; give an integer >= 1 (e.g. lp.threads(1))")
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(previous)


@contextmanager
def blas_threads(n: int) -> Iterator[int]:
    """Run the block with every BLAS loaded in the process at ``n`` threads; restore on exit.

    ``threadpoolctl.threadpool_limits(limits=n, user_api="blas")``: it finds the BLAS
    libraries numpy and scipy loaded (also the prefixed ``scipy_openblas`` builds, MKL,
    BLIS, FlexiBLAS; on Linux, macOS and Windows) and puts back the counts it found on
    entry, also when the block raises. torch's intra-op threads are untouched (that is
    :func:`threads`). The limit is process-wide for the block (OpenBLAS with pthreads has
    one pool per process; threadpoolctl lets one Python thread at a time change it).
    """
    from threadpoolctl import threadpool_limits

    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"blas_threads: n={n!r}; give an integer >= 1 (e.g. blas_threads(1))")
    with threadpool_limits(limits=n, user_api="blas"):
        yield n


def work(model: nn.Module, inputs: Any = None) -> float:
    """Parameter-tokens of one forward: parameters x token positions in ``inputs``.

    Token positions: the element count of the first integer tensor found in ``inputs``
    (token ids), else of the first floating tensor without its last (feature) axis; 1 when
    ``inputs`` holds no tensor.
    """
    params = sum(p.numel() for p in model.parameters())
    return float(params * _positions(inputs))


def auto_threads(work: float, default: int | None = None, idle: int | None = None) -> int:
    """The command line's rule: one thread below :data:`THRESHOLD` parameter-tokens; above
    it ``default`` (torch's) capped at the cores left ``idle`` (default :func:`idle_cores`)."""
    import torch

    if work < THRESHOLD:
        return 1
    n = torch.get_num_threads() if default is None else default
    idle = idle_cores() if idle is None else idle
    return max(1, min(n, idle) if idle is not None else n)


def idle_cores() -> int | None:
    """Cores this process may use minus the 1-minute load average, rounded; at least 1.

    ``None`` where the load average is not available (Windows).
    """
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, int(cpus - load + 0.5))


def _positions(inputs: Any) -> int:
    import torch

    tensors = list(_tensors(inputs))
    for t in tensors:
        if not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool:
            return max(1, t.numel())
    for t in tensors:
        if t.is_floating_point():
            return max(1, t.numel() // max(1, t.shape[-1] if t.ndim else 1))
    return 1


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    import torch

    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, Mapping):  # a dict or a BatchEncoding
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)
