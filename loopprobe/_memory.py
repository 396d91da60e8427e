"""How many operators the batched JVPs/VJPs may carry at once: a chunk size from memory.

The rule (:func:`chunk_size`). One operator in a batched product costs about

    per_operator = A + itemsize * (sum_k n_k + 2 n_max + 2 m)

bytes, where ``A`` is the activation memory of one forward (the bytes autograd saves
for backward, :func:`saved_bytes`): a batched JVP carries one tangent per live
activation and a batched VJP one cotangent per saved tensor, at most ``A`` each, plus
each operator's gradient with respect to every offset visit (``sum_k n_k``), its
vectors (``n_max``) and its output (``m``). The budget for one chunk is

    budget = min(available / 2, max(A, 128 MiB))

with ``available`` the memory the device has free now (:func:`available_bytes`): half of
it, so the rest of the process and other processes keep room, and no more than one
forward's activations (or 128 MiB, whichever is larger). That is a budget for the whole
estimate, not only for the chunk: besides the chunk a kappa or ``||U||`` run holds the VJP
graph of one forward (about ``A``) and the graph of its backward, which gives ``U t`` by
reverse over reverse (about ``A`` again), and while the visits of one visit number run on
their narrowed copy (a tied operator and the cross-check on theirs) the whole graph is dropped
(:meth:`~loopprobe.differentiate.jacobian.VisitJacobian.release`). So the peak stays near
three training steps' (benchmarks/bench_kappa_memory.py, kappa to 1e-2 against a first AdamW
step: d 256 R 4 2.75x, R 8 3.11x, d 512 R 4 3.66x; 4.5x, 4.2x and 4.9x with four activations
per chunk and the graph held throughout). Then
``chunk = budget // per_operator``, at least 1; when every operator fits the answer is
``None`` (one batch, no chunking). Chunking never changes the numbers, only how many
operators ``torch.vmap`` carries at once. When the free memory cannot be read the budget is
``max(A, 128 MiB)``.

Why not psutil: ``psutil.virtual_memory().available`` is the same ``MemAvailable`` on Linux
(equal to the byte on the machine this was written on), but it ignores cgroup limits
(psutil issue 2100, open): inside a container it reports the host's free memory, the case
:func:`_cgroup_room` is here for. psutil would only add the free memory on macOS and
Windows, where the budget falls back to the bounded ``max(A, 128 MiB)``; it is not a
dependency of torch, numpy or pandas, so it would be one more compiled package for that.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

GiB = 2**30
#: Budget for one chunk: at most this fraction of the free memory ...
FREE_FRACTION = 0.5
#: ... and at most this many forward activations (or FLOOR_BYTES, whichever is larger).
ACTIVATIONS = 1
FLOOR_BYTES = 128 * 2**20


def available_bytes(device: torch.device | str = "cpu") -> int | None:
    """Free memory on ``device`` now, in bytes, or ``None`` when it cannot be read.

    CUDA: ``torch.cuda.mem_get_info`` (free on the device) plus what torch's caching
    allocator holds reserved but unused. CPU on Linux: ``MemAvailable`` of
    ``/proc/meminfo``, lowered to the room left under a cgroup memory limit (v2
    ``memory.max``, v1 ``memory.limit_in_bytes``) when one is set; elsewhere
    ``os.sysconf`` available pages, else ``None``.
    """
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + cached)
    if device.type != "cpu":
        return None
    avail = _meminfo_available()
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    room = _cgroup_room()
    return min(avail, room) if room is not None else avail


def _meminfo_available(path: str = "/proc/meminfo") -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


CGROUP_FILES = [  # (limit, usage) under /sys/fs/cgroup: v2, then v1
    ("memory.max", "memory.current"),
    ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
]


def _cgroup_room(root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes left under this cgroup's memory limit, or ``None`` without a limit."""
    for limit, usage in CGROUP_FILES:
        cap = _read_int(os.path.join(root, limit))
        used = _read_int(os.path.join(root, usage))
        if cap is not None and used is not None and cap < 2**60:  # v1 "unlimited" is ~2^63
            return max(cap - used, 0)
    return None


def chunk_size(
    operators: int, per_operator: int, activations: int, available: int | None
) -> int | None:
    """Operators per batched product under the rule of this module (bytes in, count out).

    ``None`` when all ``operators`` fit in one chunk; otherwise an integer >= 1 (never 0,
    which the estimators read as "no batching at all").
    """
    budget = max(ACTIVATIONS * activations, FLOOR_BYTES)
    if available is not None:
        budget = min(budget, int(FREE_FRACTION * available))
    fits = budget // max(per_operator, 1)
    return None if fits >= operators else max(int(fits), 1)


def saved_bytes(fn: Any, *args: Any, exclude: Any = ()) -> int:
    """Bytes of the tensors autograd saves for backward while ``fn(*args)`` runs, each
    storage counted once; storages of the tensors in ``exclude`` (the parameters) are
    not counted. The saved tensors are counted, not kept: the measuring forward holds no
    graph (its peak is a forward's without one), and it cannot be differentiated."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    skip = {t.untyped_storage().data_ptr() for t in exclude}
    live: dict[tuple, Any] = {}  # a storage's address, while that storage lives
    total = 0

    def pack(t: torch.Tensor) -> None:
        nonlocal total
        s = t.untyped_storage()
        key = (t.device, s.data_ptr())
        if s.data_ptr() in skip or (key in live and not live[key].expired()):
            return None
        live[key] = StorageWeakRef(s)
        total += s.nbytes()
        return None

    def unpack(_: None) -> torch.Tensor:
        raise RuntimeError("saved_bytes: its forward only measures; it has no backward")

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        fn(*args)
    return total


def auto_chunk_size(jac: Any, operators: int) -> int | None:
    """The chunk size of this module's rule for the operators of a
    :class:`loopprobe.differentiate.jacobian.VisitJacobian`: ``A`` from one extra forward
    with fresh leaves, ``m`` from its output; ``None`` (one batch) if plain autograd cannot
    run that forward. Called before the VJP graph is built, so that the two forwards' saved
    activations are never held at once."""
    import torch

    leaves = [tuple(p.detach().requires_grad_() for p in ps) for ps in jac.primals]
    params = [p for ps in jac.primals for p in ps]
    params += list(jac.probe.model.parameters()) + list(jac.probe.model.buffers())
    m: list[int] = []

    def forward(*deltas: Any) -> Any:
        out = jac.f(*deltas)
        m.append(out.numel())
        return out

    try:
        A = saved_bytes(forward, *leaves, exclude=params)
    except RuntimeError:  # a forward plain autograd refuses (torch.func took it): no chunking,
        return None  # as before this rule existed
    item = torch.finfo(jac.dtype).bits // 8 if jac.dtype.is_floating_point else 4
    per = A + item * (sum(jac.n) + 2 * jac.n_max + 2 * m[0])
    return chunk_size(operators, per, A, available_bytes(jac.device))


#: Peak memory of a κ run per byte autograd saves in one forward of the model, measured:
#: ``loopprobe kappa --d-model 16 --heads 2`` grew its peak RSS by 161 MiB from R = 16 to
#: R = 64 while one forward's saved tensors grew by 15.1 MiB (10.6x); rounded up.
KAPPA_PEAK_PER_SAVED = 11


def rounds_bytes(saved_1: int, saved_2: int, R: int) -> int:
    """Bytes one forward saves at ``R`` rounds, linear from those at 1 and 2 rounds."""
    return saved_1 + (R - 1) * max(saved_2 - saved_1, 0)


def check_fits(what: str, need: int, available: int | None, fix: str) -> None:
    """Raise ValueError naming ``what``, the estimate and the free memory when ``need``
    exceeds ``available`` (the whole free memory: an estimate, not a reservation)."""
    if available is not None and need > available:
        raise ValueError(
            f"{what} needs about {need / GiB:.3g} GiB (an estimate) and {available / GiB:.3g} "
            f"GiB is free; {fix}"
        )
