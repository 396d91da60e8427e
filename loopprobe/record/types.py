"""The records of a probe: sublayers, visits, recordings, and how a model is called.

A *physical sublayer* ``j`` is a group of parameters ``phi_j`` that is reused; a *visit*
``(r, j)`` is the r-th call (execution order, 0-based) of a module that computes with
``phi_j``. These are plain data: :mod:`loopprobe.record.probe` finds and fills them.
``inputs`` is what the model is called with (a tensor; a tuple of positional arguments;
a mapping, e.g. a Hugging Face ``BatchEncoding``, of keyword arguments);
``forward(model, inputs)`` replaces the call for anything else, ``output(out)`` picks the
tensor F from the result, and :func:`model_loss` reads the loss a model returns itself
(the default ``loss_fn``). Definitions: docs/definitions.md.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
from torch import nn

from loopprobe._html import HTMLView

Forward = Callable[[nn.Module, Any], Any]
Output = Callable[[Any], torch.Tensor]
LossFn = Callable[[Any, Any], torch.Tensor]  # loss_fn(output, inputs) -> scalar


@dataclass(frozen=True)
class Sublayer:
    """One physical sublayer: a parameter group and the module instance(s) that use it.

    ``role``: ``body`` (the loop), ``head``, ``norm``, ``embedding`` or ``other`` (reuse
    that is not recurrence); ``role_reason`` gives the evidence (see loopprobe.record.discover).
    ``note``: what a number measured on this sublayer does not cover (empty when nothing),
    e.g. that it is only the shared part of partly tied modules.
    """

    name: str
    index: int
    modules: tuple[str, ...]
    param_names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    numel: int
    role: str = "body"
    role_reason: str = "named by the user"
    note: str = ""


@dataclass(frozen=True)
class Visit:
    """Visit ``r`` of sublayer ``j`` (global execution index ``i`` among all visits)."""

    i: int
    j: int
    r: int
    sublayer: str
    module: str
    grad_enabled: bool
    grad_visible: bool | None = None


@dataclass
class VisitRecord:
    """A visit with detached copies of its call arguments and of its output."""

    visit: Visit
    args: tuple
    kwargs: dict
    output: Any

    def __getattr__(self, name: str) -> Any:
        if name == "visit":
            raise AttributeError(name)
        return getattr(self.visit, name)


@dataclass
class Recording(HTMLView):
    """All visits of one forward pass, in execution order, plus the model output."""

    visits: list[VisitRecord]
    output: Any
    sublayers: list[Sublayer] = field(default_factory=list)

    def to_frame(self) -> pd.DataFrame:
        rows = []
        for v in self.visits:
            out = v.output if isinstance(v.output, torch.Tensor) else None
            norm = float(out.norm()) if out is not None else float("nan")
            rows.append(visit_row(v) | {"grad_enabled": v.grad_enabled, "output_norm": norm})
        return pd.DataFrame(rows)


def visit_row(v: Visit | VisitRecord) -> dict[str, Any]:
    """The columns that name a visit in every per-visit frame: i, sublayer, j, r, module."""
    return {"i": v.i, "sublayer": v.sublayer, "j": v.j, "r": v.r, "module": v.module}


def call_model(model: nn.Module, inputs: Any, forward: Forward | None = None) -> Any:
    """``forward(model, inputs)`` if given, else ``model(*inputs)`` for a tuple,
    ``model(**inputs)`` for a mapping (a dict, a Hugging Face ``BatchEncoding``), else
    ``model(inputs)``.

    Compiled code runs eagerly here (``torch.compiler.set_stance("force_eager")``): a model
    compiled in place (``model.compile()``) would otherwise make Dynamo trace loopprobe's
    hooks, recompile per visit and lose the visits' gradients; the values are the same.
    Nothing is compiled before ``torch._dynamo`` is imported, and ``set_stance`` imports it
    (seconds, once per process), so without it the model is called as it is.
    """
    if "torch._dynamo" not in sys.modules:
        return _call(model, inputs, forward)
    with torch.compiler.set_stance("force_eager"):
        return _call(model, inputs, forward)


def _call(model: nn.Module, inputs: Any, forward: Forward | None) -> Any:
    if forward is not None:
        return forward(model, inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    if isinstance(inputs, Mapping):
        try:
            return model(**inputs)
        except TypeError as err:
            if _binds(model, inputs):
                raise  # raised inside the model: its own error
            raise MappingCallError(
                f"calling the model with a {type(inputs).__name__} of inputs as "
                f"model(**inputs) (keys {list(inputs)}) raised TypeError: {err}; pass "
                "forward=lambda model, inputs: model(inputs) if it takes the mapping itself"
            ) from err
    return model(inputs)


class MappingCallError(TypeError):
    """The model's forward does not take a mapping's items as keyword arguments."""


def _binds(model: nn.Module, inputs: Mapping) -> bool:
    """Whether ``model.forward`` accepts the mapping's items as keyword arguments."""
    try:
        inspect.signature(model.forward).bind(**inputs)
    except TypeError:
        return False
    except ValueError:  # no signature to read: assume it binds, keep the model's error
        return True
    return True


HF_OUTPUTS = ("logits", "last_hidden_state")


def pick_output(out: Any, output: Output | None = None, *, call: str = "probe") -> torch.Tensor:
    """The tensor F: ``output(out)`` if given, else ``out`` itself when it is a tensor, else
    the ``.logits`` (or, without logits, ``.last_hidden_state``) of a Hugging Face output."""
    F = output(out) if output is not None else out
    if output is None and not isinstance(F, torch.Tensor):
        F = next((getattr(F, k) for k in HF_OUTPUTS if getattr(F, k, None) is not None), F)
    if not isinstance(F, torch.Tensor):
        raise TypeError(
            f"{call}: the model output is a {type(F).__name__}, not a tensor; pass "
            "output=lambda out: out[...] (or forward=) to pick the tensor F"
        )
    return F


def model_loss(out: Any) -> torch.Tensor | None:
    """The scalar loss a model returned itself: its output's ``.loss`` (a Hugging Face
    ``ModelOutput`` given ``labels``) or ``["loss"]``, as a 0-d tensor; ``None`` when it
    has none."""
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss.reshape(())
    return None


def check_loss(loss_fn: LossFn, call: str) -> LossFn:
    """``loss_fn`` checked: it must take ``(output, inputs)`` (a ``TypeError`` naming
    ``call`` and that signature before anything runs, when its signature is readable) and
    return a scalar (a ``ValueError`` with the shape it returned instead, never the tensor).
    """
    if not callable(loss_fn):
        raise TypeError(
            f"{call}: loss_fn is a {type(loss_fn).__name__}, not a function; pass "
            "loss_fn(output, inputs) returning a scalar tensor"
        )
    if getattr(loss_fn, "_loopprobe_checked", None) == call:
        return loss_fn
    try:
        inspect.signature(loss_fn).bind(None, None)
    except TypeError:
        raise TypeError(
            f"{call}: loss_fn{_signature(loss_fn)} cannot be called as loss_fn(output, "
            "inputs) (output: what the model returns; inputs: what it was called with); "
            "write def loss_fn(output, inputs): ... returning a scalar (ignore inputs if "
            "you do not need them)"
        ) from None
    except ValueError:  # no signature to read (a builtin): find out when it is called
        pass

    def checked(out: Any, inputs: Any) -> torch.Tensor:
        loss = loss_fn(out, inputs)
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"{call}: loss_fn(output, inputs) returned a {type(loss).__name__}, not a "
                "tensor; return a scalar torch tensor (the loss to differentiate)"
            )
        if loss.numel() != 1:
            raise ValueError(
                f"{call}: loss_fn(output, inputs) returned a tensor of shape "
                f"{tuple(loss.shape)}, not a scalar; reduce it (e.g. .mean() or .sum())"
            )
        return loss

    checked._loopprobe_checked = call  # type: ignore[attr-defined]
    return checked


def _signature(fn: Callable) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return ""


#: the one default-loss rule, as every entry point (lp.health, the CLI, the report) states it
LOSS_RULE_SHORT = "the model's own .loss, else cross-entropy against drawn tokens, else ½·mean(F²)"


class DefaultLoss:
    """The default loss, one rule for every entry point: the model's own scalar ``.loss``
    (:func:`model_loss`) when its output carries one; else cross-entropy of ``pick(out)``
    against ``targets`` when loopprobe drew the input tokens (``targets`` given); else
    ``0.5 * mean(F²)`` with ``F = pick(out)``. ``pick=None`` (an estimator called on its own,
    with no tensor picker): no fallback, a ``ValueError`` naming ``call`` instead.

    ``used`` names what was actually used (known after the first call); ``label`` is
    ``used``, or the rule itself before any call.
    """

    def __init__(self, pick: Output | None = None, targets: Any = None, call: str = "probe"):
        self.pick, self.targets, self.call, self.used = pick, targets, call, None

    @property
    def label(self) -> str:
        return self.used or f"default: {LOSS_RULE_SHORT}"

    def __call__(self, out: Any, _inputs: Any) -> torch.Tensor:
        loss = model_loss(out)
        if loss is not None:
            self.used = self.used or "the model's own .loss"
            return loss
        if self.pick is None:
            raise ValueError(
                f"{self.call}: loss_fn=None uses the loss the model returns itself, but its "
                f"{type(out).__name__} output has no scalar .loss (a Hugging Face model "
                "returns one when the batch holds labels); add labels to the batch or pass "
                "loss_fn=lambda out, inputs: ... returning a scalar"
            )
        F = self.pick(out)
        if self.targets is not None:
            self.used = self.used or "cross-entropy on random tokens"
            t = self.targets
            return torch.nn.functional.cross_entropy(F.reshape(-1, F.shape[-1]), t.reshape(-1))
        self.used = self.used or "0.5 * mean(F^2) (the output has no .loss; pass a loss for yours)"
        return 0.5 * F.pow(2).mean()


def loss_label(loss_fn: Any, given: str = "loss_fn") -> str:
    """What a loss is called in a report: the rule's pick for a :class:`DefaultLoss` (the one
    actually used), else ``given``."""
    return loss_fn.label if isinstance(loss_fn, DefaultLoss) else given


def default_loss(loss_fn: LossFn | None, call: str) -> LossFn:
    """``loss_fn`` (checked by :func:`check_loss`), or when it is ``None`` the
    :class:`DefaultLoss` rule without a tensor picker: the model's own ``.loss``, else a
    ``ValueError`` naming ``call``."""
    if loss_fn is not None:
        return check_loss(loss_fn, call)
    return DefaultLoss(call=call)


def copy_tree(x: Any) -> Any:
    """Detached clones of every tensor in nested tuples/lists/dicts (other leaves as is)."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, tuple):
        return tuple(copy_tree(v) for v in x)
    if isinstance(x, list):
        return [copy_tree(v) for v in x]
    if isinstance(x, dict):
        return {k: copy_tree(v) for k, v in x.items()}
    return x


@dataclass
class Trace:
    """What a :meth:`Probe.session` saw: the visits, and calls of modules owning a
    sublayer's parameters outside any visit of it (uses the per-visit offsets miss)."""

    visits: list[Visit]
    outside: list[tuple[int, str]]


@contextmanager
def seeded(seed: int | None, device: torch.device | None = None) -> Iterator[None]:
    """Run the block with torch's RNG at ``seed`` and put the caller's RNG state back.

    Every function evaluation of one estimate runs under the same seed, so dropout and
    other torch randomness draw the same sample for every derivative. ``None``: no-op.
    """
    if seed is None:
        yield
        return
    cuda = [device.index or 0] if device is not None and device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.default_generator.manual_seed(seed)
        for idx in cuda:
            torch.cuda.default_generators[idx].manual_seed(seed)
        yield
