"""``loopprobe ddp-kappa``: ``loopprobe kappa`` inside a torch.distributed (DDP) job.

Launch one process per rank with torchrun; every rank builds the same model and batch,
wraps the model in ``DistributedDataParallel``, keeps its shard of the batch (dim 0
split evenly over the ranks) and probes it. G is reduced the way DDP reduces gradients
and U/kappa are those of the global batch (see :mod:`loopprobe.distributed`), so the
numbers equal ``loopprobe kappa`` on the whole batch in one process. Rank 0 prints.

Example (CPU, gloo)::

    torchrun --standalone --nproc-per-node 2 -m loopprobe.cli ddp-kappa --R 4 --batch 8
    torchrun --standalone --nproc-per-node 8 -m loopprobe.cli ddp-kappa --model pkg.mod:make \\
        --inputs pkg.mod:batch --loss pkg.mod:loss --backend nccl
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from loopprobe.cli._common import add_target_args


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "ddp-kappa",
        help="kappa_R of a DDP model over the global batch (launch with torchrun)",
        description=(
            "loopprobe kappa on every rank of a torchrun job: the model wrapped in DDP, the "
            "batch split over ranks, G reduced as DDP reduces gradients, U and kappa of the "
            "global batch. Rank 0 prints the report."
        ),
    )
    add_target_args(parser, default_norm="deeploop", R="one")
    parser.add_argument(
        "--backend",
        default=None,
        help="torch.distributed backend (default: nccl on CUDA, gloo otherwise)",
    )
    parser.set_defaults(func=run)


def shard(inputs: Any, rank: int, world: int, what: str = "the inputs") -> Any:
    """This rank's part of a batch: every tensor split evenly along dim 0."""
    import torch

    if isinstance(inputs, torch.Tensor):
        if inputs.shape[0] % world:
            raise ValueError(
                f"ddp-kappa: {what} have batch {inputs.shape[0]}, not divisible by the "
                f"{world} ranks; pass a batch that is a multiple of {world}"
            )
        return inputs.chunk(world)[rank]
    if isinstance(inputs, tuple | list):
        return type(inputs)(shard(x, rank, world, what) for x in inputs)
    if isinstance(inputs, dict):
        return {k: shard(v, rank, world, what) for k, v in inputs.items()}
    return inputs  # not batched (a flag, a scalar): the same on every rank


def run(args: argparse.Namespace) -> int:
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ValueError(
            "ddp-kappa: RANK/WORLD_SIZE are not set; launch it with torchrun, e.g. "
            "torchrun --standalone --nproc-per-node 2 -m loopprobe.cli ddp-kappa --R 4"
        )
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from loopprobe.cli import _target
    from loopprobe.cli._common import emit
    from loopprobe.cli.kappa import build_report, format_report
    from loopprobe.report.common import resolve_loss

    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        target = _target.build_target(args, args.R)
        if backend == "nccl":
            target.model = target.model.cuda()
            target.inputs = _cuda(target.inputs)
        if target.targets is not None and args.loss is None:
            # The default cross-entropy holds the whole batch's targets: this rank's shard.
            pick = target.output if target.output is not None else (lambda out: out)
            mine = shard(target.targets, rank, world, "targets")
            target.loss_fn, target.loss_name = resolve_loss(None, pick, mine)
        batch = _batch(target.inputs)
        target.inputs = shard(target.inputs, rank, world)
        target.model = DDP(target.model)
        report = build_report(args, target)
        report["ranks"] = world
        report["backend"] = backend
        report["global_batch"] = batch
        if rank == 0:
            emit(report, args.json, lambda r: format_report(r) + _ranks_line(r))
    finally:
        dist.destroy_process_group()
    return 0


def _cuda(x: Any) -> Any:
    if hasattr(x, "cuda"):
        return x.cuda()
    if isinstance(x, tuple | list):
        return type(x)(_cuda(v) for v in x)
    if isinstance(x, dict):
        return {k: _cuda(v) for k, v in x.items()}
    return x


def _batch(inputs: Any) -> int | None:
    import torch

    if isinstance(inputs, torch.Tensor):
        return int(inputs.shape[0])
    if isinstance(inputs, tuple | list | dict):
        for x in inputs.values() if isinstance(inputs, dict) else inputs:
            if (b := _batch(x)) is not None:
                return b
    return None


def _ranks_line(r: dict) -> str:
    return (
        f"\nranks: {r['ranks']} ({r['backend']}, DDP); G, U and kappa are global over the "
        f"batch of {r['global_batch']}, each rank held {r['global_batch'] // r['ranks']}"
    )
