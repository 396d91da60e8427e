"""Argument checks and messages of the increments recording (:mod:`.increments`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from loopprobe.record.types import VisitRecord

IncrementFn = Callable[[VisitRecord], torch.Tensor]


def _how(names: list[str] | None = None) -> str:
    probed = f" (this probe's sublayers: {names})" if names else ""
    return (
        "point the probe at the residual branch whose output is the increment as added to the "
        f"stream{probed}: lp.increments(model, inputs, sublayers=[...]) with names from "
        "model.named_modules(); pass increment='delta' if the sublayer returns the updated "
        "stream x + f(x), increment='auto' to measure the stream a loop carries through an "
        "injection layer, or increment=lambda rec: ... to pick the tensor from rec.args/rec.output"
    )


def _floats(v: VisitRecord) -> list[torch.Tensor]:
    return [
        t
        for t in (*v.args, *v.kwargs.values())
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]


def _stream_in(v: VisitRecord, call: str) -> torch.Tensor:
    """The stream a visit reads: its first float tensor argument shaped like its output."""
    found = _floats(v)
    if not found:
        raise ValueError(
            f"{call}: visit r={v.r} of sublayer {v.sublayer!r} (module {v.module!r}) has no "
            f"floating-point tensor input to take as the residual stream; {_how()}"
        )
    shape = v.output.shape if isinstance(v.output, torch.Tensor) else None
    return next((t for t in found if t.shape == shape), found[0])


def _call_increment(fn: IncrementFn, rec: VisitRecord, call: str) -> Any:
    """``fn(rec)``; a failure on a tuple output says what ``rec.output`` is."""
    try:
        return fn(rec)
    except (TypeError, IndexError, AttributeError) as e:
        if not isinstance(rec.output, tuple | list):
            raise
        raise TypeError(
            f"{call}: the increment callable failed at visit r={rec.r} of sublayer "
            f"{rec.sublayer!r} ({type(e).__name__}: {e}); rec.output is the output as the "
            f"module returned it, here a {type(rec.output).__name__} of "
            f"{len(rec.output)}: index it (e.g. rec.output[0] - rec.args[0])"
        ) from e


def _check_callable_result(
    v: VisitRecord, raw: Any, x: torch.Tensor, z: Any, call: str, names: list[str]
) -> None:
    if isinstance(z, torch.Tensor) and z.shape != x.shape:
        what = f"a {type(raw).__name__}"
        if isinstance(raw, torch.Tensor):
            what = f"a tensor of shape {tuple(raw.shape)}"
        elif isinstance(raw, tuple | list):
            what += f" of {len(raw)} whose element 0 has shape {tuple(raw[0].shape)}"
        raise ValueError(
            f"{call}: the increment callable returned shape {tuple(z.shape)} at visit "
            f"r={v.r} of sublayer {v.sublayer!r}, but the stream it reads has shape "
            f"{tuple(x.shape)}; an increment is shaped like the stream (did it index the "
            f"batch?). rec.output is the output as the module returned it, here {what}"
        )
    _check_increment(v, x, z, "a callable", call, names)


def _check_increment(
    v: VisitRecord, x: torch.Tensor, z: Any, increment: Any, call: str, names: list[str]
) -> None:
    if not isinstance(z, torch.Tensor):
        raise ValueError(
            f"{call}: the increment of sublayer {v.sublayer!r} (module {v.module!r}) is a "
            f"{type(z).__name__}, not a tensor (increment={increment!r}); {_how(names)}"
        )
    if z.shape != x.shape:
        raise ValueError(f"{_not_shaped(v, x, z, increment, call)}; {_how(names)}")


def _not_shaped(v: VisitRecord, x: torch.Tensor, z: torch.Tensor, increment: Any, call: str) -> str:
    return (
        f"{call}: cannot locate the residual increment of sublayer {v.sublayer!r} "
        f"(module {v.module!r}): its output has shape {tuple(z.shape)} but the stream it "
        f"reads has shape {tuple(x.shape)}, so it is not a residual-shaped branch output "
        "(loopprobe does not broadcast one against the other)"
    )
