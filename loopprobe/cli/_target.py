"""What a probing command probes: the model (reference or ``--model``), inputs, loss, F.

Shared by ``kappa``, ``bound`` and ``report``; imported when a command runs (not for
``--help``), since it needs torch and the reference models.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loopprobe import tasks
from loopprobe._io import call_user, load_model, load_object
from loopprobe.cli._common import DefaultOutput
from loopprobe.models import GPTConfig, LoopedGPT
from loopprobe.record.types import MappingCallError, model_loss

DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass
class Target:
    """What one probe needs: the model, its inputs, the loss, F, and the scales."""

    model: nn.Module
    inputs: Any
    loss_fn: Callable[[Any, Any], torch.Tensor]
    output: Callable[[Any], torch.Tensor] | None
    loss_name: str
    alpha: float | None
    beta: float | None
    forward: Callable[[nn.Module, Any], Any] | None = None
    output_spec: str | None = None

    def describe_output(self) -> str | None:
        """Which tensor F is: ``--output``'s, the reference model's logits, or what the
        default picker chose (known after a probe; ``None`` before)."""
        if self.output_spec is not None:
            return f"the tensor --output {self.output_spec} returns from the model output"
        if isinstance(self.output, DefaultOutput):
            if self.output.picked is None:
                return None
            return f"{self.output.picked} (default; pass --output to pick another tensor)"
        if self.output is None:  # only the reference model has no picker
            return "the model output (the reference LoopedGPT's logits)"
        return None

    def describe_loss(self) -> str:
        return getattr(self.loss_fn, "used", None) or self.loss_name


class DefaultLoss:
    """The loss when no ``--loss`` is given: the model's own scalar ``.loss`` if its output
    carries one (Hugging Face style; the library's ``loss_fn=None``, one implementation:
    :func:`loopprobe.record.types.model_loss`), else ``fallback``. ``used`` names what was
    used."""

    def __init__(self, fallback: Callable[[Any, Any], torch.Tensor], name: str) -> None:
        self.fallback, self.name, self.used = fallback, name, None

    def __call__(self, out: Any, inputs: Any) -> torch.Tensor:
        loss = model_loss(out)
        if loss is not None:
            self.used = self.used or "the model's own .loss"
            return loss
        self.used = self.used or self.name
        return self.fallback(out, inputs)


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


def build_target(args: argparse.Namespace, R: int | None) -> Target:
    """The model (reference or ``--model``), its inputs, loss, F picker and scales."""
    if args.model is None:
        for flag in ("inputs", "loss", "output", "forward"):
            if getattr(args, flag) is not None:
                raise ValueError(f"--{flag} only applies together with --model")
        model = reference_model(args, 4 if R is None else R)
        output = None
    else:
        model = user_model(args, R)
        output = load_object(args.output, "--output") if args.output else DefaultOutput()
    forward = load_object(args.forward, "--forward") if args.forward else None
    cfg = getattr(model, "cfg", None)
    inputs, loss_fn, loss_name = _inputs_and_loss(args, model, cfg, output)
    alpha = args.alpha if args.alpha is not None else getattr(cfg, "alpha", None)
    beta = args.beta if args.beta is not None else getattr(cfg, "beta", None)
    spec = args.output if args.model is not None else None
    return Target(model, inputs, loss_fn, output, loss_name, alpha, beta, forward, spec)


def _inputs_and_loss(args: argparse.Namespace, model: nn.Module, cfg: Any, output: Any) -> tuple:
    """Inputs from ``--inputs`` or random tokens; loss from ``--loss`` or a default."""
    pick = output if output is not None else (lambda out: out)
    targets = None
    if args.inputs is not None:
        fn = load_object(args.inputs, "--inputs")
        inputs = call_user(fn, "--inputs", args.inputs, *([model] if _takes_argument(fn) else []))
        if isinstance(inputs, list):
            inputs = tuple(inputs)
    elif hasattr(cfg, "vocab_size") and hasattr(cfg, "seq_len"):
        seq = args.seq if args.model is None else cfg.seq_len
        g = torch.Generator().manual_seed(args.seed)
        inputs, targets = tasks.random_tokens(args.batch, seq, cfg.vocab_size, g)
        inputs, targets = inputs.to(_device(model)), targets.to(_device(model))
    else:
        raise ValueError(
            f"--model {args.model}: {type(model).__name__} has no cfg.vocab_size/cfg.seq_len to "
            "draw random tokens from; pass --inputs package.module:fn returning its inputs"
        )
    if args.loss is not None:
        return inputs, load_object(args.loss, "--loss"), args.loss
    fallback, name = _fallback_loss(pick, targets)
    if args.model is None:
        return inputs, fallback, name
    return inputs, DefaultLoss(fallback, name), name


def _fallback_loss(pick: Callable[[Any], torch.Tensor], targets: Any) -> tuple:
    if targets is not None:

        def cross_entropy(out: Any, _inputs: Any) -> torch.Tensor:
            logits = pick(out)
            return nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
            )

        return cross_entropy, "cross-entropy on random tokens"

    def half_mean_square(out: Any, _inputs: Any) -> torch.Tensor:
        return 0.5 * pick(out).pow(2).mean()

    return half_mean_square, "0.5 * mean(F^2) (pass --loss to use yours)"


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


def _takes_argument(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return any(p.kind in kinds or p.kind == inspect.Parameter.VAR_POSITIONAL for p in params)


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
