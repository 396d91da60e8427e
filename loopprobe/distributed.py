"""Probing inside a torch.distributed job: which ranks a probe's numbers are global over.

A model trained data-parallel holds the same parameters on every rank and a different
shard of the batch. The numbers loopprobe reports are then those of the *global* batch
(the ranks' shards concatenated), computed on every rank with torch.distributed's own
collectives (nothing here talks to the network itself):

- ``G_{r,j}`` is reduced the way DDP reduces gradients: the mean over ranks of each
  rank's per-visit gradient on its shard. With a per-shard mean loss and equal shards,
  ``sum_r G_{r,j}`` is then exactly DDP's averaged ``.grad`` of ``phi_j``.
- ``U_{r,j}`` of the global batch stacks the ranks' blocks ``U^{(q)}`` (one per rank q,
  rows = that rank's outputs), so ``U^T U = sum_q U^{(q)T} U^{(q)}`` and
  ``||U v||^2 = sum_q ||U^{(q)} v||^2``. Power iteration and Lanczos run on every rank
  with identical start vectors and the products summed across ranks (two all-reduces per
  iteration: B vectors of length n and B scalars), so every rank takes identical steps
  and stops at the same iteration. Averaging the per-rank norms instead would be wrong:
  ``||U|| <= sqrt(sum_q ||U^{(q)}||^2)``, with equality only when the ranks' top singular
  vectors coincide.

:class:`Ranks` is the process group; :func:`unwrap` finds the module to probe (DDP's
``.module``, torch.compile's eager ``._orig_mod``) and refuses sharded parameters (FSDP1
flat parameters, FSDP2 DTensors), naming the full-replica route that works for both
(:func:`full_replica`: one full copy of the parameters per rank). This module may import
torch.distributed but no loopprobe layer.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import torch
from torch import nn


class Ranks:
    """The ranks of a process group that probe results are reduced over.

    ``Ranks()`` is the default (world) group; ``Ranks(group)`` any other. Every rank
    must make the same probe calls in the same order (they are collectives).
    """

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "Ranks: torch.distributed is not initialised; call "
                "torch.distributed.init_process_group(...) first (torchrun sets the "
                "environment), or attach without ranks= for a single-process probe"
            )
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        # NCCL reduces CUDA tensors only; gloo is given CPU tensors (its CUDA support varies).
        nccl = dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else None

    def __repr__(self) -> str:
        return f"Ranks(size={self.size}, rank={self.rank})"

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """``sum_q t^{(q)}`` over the ranks (a new tensor, identical on every rank)."""
        import torch.distributed as dist

        out = t.detach().to(self.device or "cpu", copy=True).contiguous()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out.to(t.device)

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        """The mean over ranks, as DDP averages gradients."""
        return self.sum(t) / self.size

    def agree(self, values: list[int], what: str, call: str) -> None:
        """Raise unless every rank holds the same integers (e.g. visit counts)."""
        import torch.distributed as dist

        device = self.device or "cpu"
        n = torch.tensor([len(values), -len(values)], dtype=torch.long, device=device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.group)  # equal lengths first:
        if n[0] != -n[1]:  # a collective of unequal sizes hangs (gloo, measured)
            values = [*values, *[-1] * (int(n[0]) - len(values))]  # -1: not seen on this rank
        t = torch.tensor(values, dtype=torch.long, device=device)
        hi, lo = t.clone(), -t
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=self.group)
        dist.all_reduce(lo, op=dist.ReduceOp.MAX, group=self.group)
        hi, lo = hi.cpu(), lo.cpu()
        if not torch.equal(hi, -lo):
            raise ValueError(
                f"{call}: the ranks disagree on {what} (this rank {values}, max {hi.tolist()}, "
                f"min {(-lo).tolist()}); data-dependent control flow (e.g. halting) gave the "
                "ranks different visits, so there is no global per-visit quantity: attach "
                "to model.module without ranks= for per-rank numbers"
            )


def scope(ranks: Ranks | None, *, per_rank: bool = False) -> str:
    """How a result's numbers are to be read: global over the ranks, or one process.

    ``per_rank``: the estimator does not reduce (e.g. increments: activation statistics
    of this rank's shard, a sample of the same population as the global batch).
    """
    if ranks is None:
        return "this process"
    if per_rank:
        return f"this rank's shard only (rank {ranks.rank} of {ranks.size}; not reduced)"
    return f"global over {ranks.size} ranks (rank {ranks.rank} reporting)"


def refuse(ranks: Ranks | None, call: str) -> None:
    """For estimators that are not distributed-aware: raise instead of a per-rank number."""
    if ranks is not None and ranks.size > 1:
        raise ValueError(
            f"{call}: not distributed-aware yet (the probe reduces over {ranks.size} ranks); "
            "attach to the unwrapped model (lp.attach(model.module)) for per-rank numbers "
            "on this rank's shard"
        )


_REPLICA = (
    "probe a full replica instead: build the same model unsharded on every rank and call "
    "loopprobe.distributed.full_replica(model, replica) (it loads torch.distributed."
    "checkpoint.state_dict.get_model_state_dict(model, options=StateDictOptions("
    "full_state_dict=True))), then lp.attach(replica, ranks=loopprobe.distributed.Ranks()) "
    "(docs/distributed.md)"
)


def full_replica(model: nn.Module, replica: nn.Module) -> nn.Module:
    """Load the full (unsharded) state of a sharded ``model`` into ``replica`` and return it.

    ``replica`` is an unsharded instance of the same architecture on this rank. The state
    is gathered with ``get_model_state_dict(..., full_state_dict=True)`` (a collective:
    call it on every rank); ``model``, its shards and its optimizer are only read. Memory:
    one full copy of the parameters per rank while probing.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if any(_is_dtensor(p) for p in replica.parameters()):
        raise TypeError(
            "full_replica: the replica holds DTensor parameters; pass a fresh unsharded "
            "instance of the model (the one built before fully_shard)"
        )
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    replica.load_state_dict(full)
    return replica


def _refuse_meta(model: nn.Module, call: str) -> None:
    """A model on the meta device has shapes and no values: say so before any forward."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    meta = next((name for name, t in tensors if t.is_meta), None)
    if meta is not None:
        raise ValueError(
            f"{call}: {meta!r} is on the meta device (shapes, no values: a model built under "
            "torch.device('meta') or loaded with empty weights); materialise the model first: "
            "model.to_empty(device='cpu') then load its weights, or load it without 'meta'"
        )


def unwrap(model: nn.Module, call: str = "attach") -> tuple[nn.Module, Ranks | None]:
    """The module to probe and the ranks to reduce over.

    DDP: its ``.module`` (the probe's forward never passes through DDP's reducer, so the
    next training step is unaffected) and the DDP process group. ``torch.compile``'s
    ``OptimizedModule``: its ``._orig_mod``, the eager module holding the same parameters
    (with a ``UserWarning``: what is measured is the eager forward, not the compiled
    graph); also nested, ``DDP(compile(m))`` and ``compile(DDP(m))``. A plain module:
    itself, no ranks. Sharded parameters are refused with the replica route: FSDP1
    flattens parameters (the per-sublayer tensors do not exist outside its forward), and
    FSDP2 holds DTensor shards that its own hooks swap in and out around each unit's
    forward, which a reused (looped) unit would interleave with the probe's swap.
    """
    parallel = sys.modules.get("torch.nn.parallel.distributed")
    ranks, compiled = None, False
    while True:
        if _is_compiled(model):
            model, compiled = model._orig_mod, True
        elif parallel is not None and isinstance(model, parallel.DistributedDataParallel):
            import torch.distributed as dist

            group = model.process_group
            model, ranks = model.module, Ranks(None if group is dist.group.WORLD else group)
        else:
            break
    _refuse_sharded(model, call)
    _refuse_meta(model, call)
    if compiled:
        warnings.warn(
            f"{call}: the model is torch.compile'd; probing runs the eager module "
            f"({type(model).__name__}, the same parameters) and torch.compile's graph is not "
            "what is measured",
            UserWarning,
            stacklevel=_caller_level(),
        )
    return model, ranks


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside loopprobe (the user's call), so the
    warning names their line and the default filter shows it once per line."""
    root = os.path.dirname(os.path.abspath(__file__)) + os.sep
    level, frame = 1, sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(root):
        frame, level = frame.f_back, level + 1
    return level


def _is_compiled(model: nn.Module) -> bool:
    """A ``torch.compile``'d module (``torch._dynamo.eval_frame.OptimizedModule``), told by
    name and attribute so that loopprobe never imports torch._dynamo itself."""
    return type(model).__name__ == "OptimizedModule" and isinstance(
        getattr(model, "_orig_mod", None), nn.Module
    )


def _refuse_sharded(model: nn.Module, call: str) -> None:
    kinds = {type(m).__name__ for m in model.modules()}
    names = [n for n, _ in model.named_parameters()]
    if "FullyShardedDataParallel" in kinds or any("_flat_param" in n for n in names):
        raise TypeError(
            f"{call}: the model is wrapped in FSDP1 (FullyShardedDataParallel): its "
            "parameters are flat shards and a looped sublayer's tensors do not exist "
            f"outside its forward; {_REPLICA}"
        )
    fsdp2 = any(_is_fsdp2(m) for m in model.modules())
    dtensor = [n for n, p in model.named_parameters() if _is_dtensor(p)]
    if dtensor or fsdp2:
        where = f" (DTensor parameters, e.g. {dtensor[0]!r})" if dtensor else ""
        raise TypeError(
            f"{call}: the model is sharded with FSDP2 fully_shard{where}; the probe's "
            "per-visit swap cannot safely interleave with FSDP2's unshard/reshard of a "
            f"reused unit; {_REPLICA}"
        )


# A model sharded by FSDP or holding DTensors was built with these modules imported, so
# their absence from sys.modules answers "no" without importing them (seconds at attach).


def _is_fsdp2(m: nn.Module) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(m, fsdp.FSDPModule)


def _is_dtensor(p: torch.Tensor) -> bool:
    tensor = sys.modules.get("torch.distributed.tensor")
    return tensor is not None and isinstance(p, tensor.DTensor)
