"""What a probing command probes: the model (reference or ``--model``), inputs, loss, F.

Shared by ``kappa``, ``bound`` and ``ddp-kappa``; imported when a command runs (not for
``--help``), since it needs torch and the reference models.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from loopprobe import tasks
from loopprobe._io import load_model, load_object, user_inputs
from loopprobe.cli._common import DefaultOutput
from loopprobe.models import GPTConfig, LoopedGPT
from loopprobe.record.target import Target  # the one target object (the report's too)
from loopprobe.record.types import MappingCallError
from loopprobe.report.common import resolve_loss

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def reference_model(args: argparse.Namespace, R: int) -> nn.Module:
    cfg = GPTConfig(
        vocab_size=args.vocab,
        seq_len=args.seq,
        d_model=args.d_model,
        n_heads=args.heads,
        K=args.K,
        R=R,
        norm=args.norm,
    )
    model = LoopedGPT(cfg, generator=torch.Generator().manual_seed(args.seed))
    return model.to(DTYPES[args.dtype or "float64"])


def user_model(args: argparse.Namespace, R: int | None) -> nn.Module:
    model = load_model(args.model, *([] if R is None else [R]))
    if args.dtype is not None:
        model = model.to(DTYPES[args.dtype])
    return model


#: the user-model options that need --model (the reference model brings its own)
NEEDS_MODEL = ("inputs", "loss", "output", "forward", "sublayers", "exclude", "increment", "step")


def check_needs_model(args: argparse.Namespace) -> None:
    if getattr(args, "model", None) is None:
        for flag in NEEDS_MODEL:
            if getattr(args, flag, None) is not None:
                raise ValueError(f"--{flag} only applies together with --model")


def build_target(args: argparse.Namespace, R: int | None) -> Target:
    """The model (reference or ``--model``), its inputs, loss, F picker and scales."""
    check_needs_model(args)
    if args.model is None:
        model, output = reference_model(args, 4 if R is None else R), None
    else:
        model = user_model(args, R)
        output = load_object(args.output, "--output") if args.output else DefaultOutput()
    forward = load_object(args.forward, "--forward") if args.forward else None
    cfg = getattr(model, "cfg", None)
    inputs, targets = _inputs(args, model, cfg)
    pick = output if output is not None else (lambda out: out)
    loss_fn, loss_name = resolve_loss(args.loss, pick, targets)
    alpha = args.alpha if args.alpha is not None else getattr(cfg, "alpha", None)
    beta = args.beta if args.beta is not None else getattr(cfg, "beta", None)
    spec = args.output if args.model is not None else None
    subs = dict(sublayers=getattr(args, "sublayers", None), exclude=getattr(args, "exclude", None))
    return Target(
        args.model, model, inputs, loss_fn, loss_name, output=output, alpha=alpha, beta=beta,
        forward=forward, output_spec=spec, targets=targets, **subs,
    )  # fmt: skip


def _inputs(args: argparse.Namespace, model: nn.Module, cfg: Any) -> tuple[Any, Any]:
    """Inputs from ``--inputs``, or random tokens and their random next tokens."""
    if args.inputs is not None:
        return user_inputs(args.inputs, model), None
    if hasattr(cfg, "vocab_size") and hasattr(cfg, "seq_len"):
        seq = args.seq if args.model is None else cfg.seq_len
        g = torch.Generator().manual_seed(args.seed)
        inputs, targets = tasks.random_tokens(args.batch, seq, cfg.vocab_size, g)
        return inputs.to(_device(model)), targets.to(_device(model))
    raise ValueError(
        f"--model {args.model}: {type(model).__name__} has no cfg.vocab_size/cfg.seq_len to "
        "draw random tokens from; pass --inputs package.module:fn returning its inputs"
    )


@contextlib.contextmanager
def call_hint(target: Target) -> Iterator[None]:
    """A model fed the mapping from ``--inputs`` (called as ``model(**inputs)``) whose
    forward does not take its keys: say how to call it instead, in the CLI's flags."""
    try:
        yield
    except MappingCallError as err:  # raised only when no --forward is given
        raise ValueError(
            f"calling the model with the {type(target.inputs).__name__} from --inputs as "
            f"model(**inputs) (keys {list(target.inputs)}) failed: {err.__cause__}; pass "
            "--forward package.module:fn with def fn(model, inputs): return model(inputs) "
            "if it takes the mapping itself"
        ) from err


def _device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def describe(args: argparse.Namespace, R: Any) -> str:
    if args.model is not None:
        return f"{args.model}" + ("" if R is None else f" (R={R})")
    return (
        f"LoopedGPT K={args.K} R={R} norm={args.norm} (d_model {args.d_model}, {args.heads} "
        f"heads, seq {args.seq}, batch {args.batch}, {args.dtype or 'float64'}, seed {args.seed})"
    )
