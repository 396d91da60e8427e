"""What a probe runs on: one object for the library's callers, the CLI and the report.

A :class:`Target` holds a model, the inputs it is called with, the loss (the one default
rule, :class:`~loopprobe.record.types.DefaultLoss`, when none is given), how F is picked and
the model called, the bound check's scales, the round map and what to probe. The CLI's
probing commands (``kappa``, ``bound``, ``ddp-kappa``) build one from their options and the
report builds one from ``--model``; :meth:`Target.probe_kwargs` are what :func:`lp.health`
takes besides the loss and scales (``lp.health(t.model, t.inputs, **t.probe_kwargs())``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from loopprobe.record.types import Forward, LossFn, Output, loss_label


@dataclass
class Target:
    """A model to probe and how (fields in the order the report has always built them)."""

    spec: str | None  # --model pkg.mod:factory (None: built in code or the reference model)
    model: nn.Module
    inputs: Any
    loss_fn: LossFn
    loss_name: str  # the name given (a --loss spec) or the default rule's, before it ran
    inputs_spec: str | None = None
    loss_spec: str | None = None
    output: Output | None = None  # picks F; None: the output itself (the reference model)
    forward: Forward | None = None  # --forward: fn(model, inputs) -> output
    alpha: float | None = None  # --alpha/--beta: the bound check's scales (default cfg)
    beta: float | None = None
    step: Callable[..., Any] | None = None  # --step: fn(model, inputs) -> lp.RoundMap
    increment: Any = None  # --increment: what lp.increments(increment=) takes
    sublayers: list[str] | None = None  # --sublayers: what lp.attach(sublayers=) takes
    exclude: list[str] | None = None  # --exclude: what lp.attach(exclude=) takes
    targets: Any = None  # the random next tokens of the default cross-entropy, if drawn
    output_spec: str | None = None  # --output pkg.mod:fn

    @property
    def loss_label(self) -> str:
        """The loss actually used (the default rule's pick once it ran), else its name."""
        return loss_label(self.loss_fn, self.loss_name)

    def describe_loss(self) -> str:
        return self.loss_label

    def describe_output(self) -> str | None:
        """Which tensor F is: ``--output``'s, the reference model's logits, or what the
        default picker chose (known after a probe; ``None`` before or when unknown)."""
        if self.output_spec is not None:
            return f"the tensor --output {self.output_spec} returns from the model output"
        if hasattr(self.output, "picked"):  # the CLI's default picker records its choice
            picked = self.output.picked
            return (
                None
                if picked is None
                else f"{picked} (default; pass --output to pick another tensor)"
            )
        if self.output is None:  # only the reference model has no picker
            return "the model output (the reference LoopedGPT's logits)"
        return None

    def probe_kwargs(self) -> dict[str, Any]:
        """``forward``, ``output``, ``sublayers``, ``exclude``: as :func:`lp.health` takes them."""
        return dict(
            forward=self.forward, output=self.output, sublayers=self.sublayers, exclude=self.exclude
        )
