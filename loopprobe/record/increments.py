"""Recording the increments of one forward pass (the measuring half of :mod:`.increments`).

:class:`Collector` runs one visit session of a probe and keeps, per visit, the stream
RMS and the increment, and the evidence for what each sublayer returns: whether the next
visit reads its output (it returns the updated stream: the increment is output - input)
or input + output (the output is the increment), else the sizes of output and input.
Reference: docs/definitions.md §3.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from loopprobe.record.probe import Probe
from loopprobe.record.types import Forward, Visit, VisitRecord, call_model

IncrementFn = Callable[[VisitRecord], torch.Tensor]

_MEASURED = {"output": "output", "delta": "output - input"}
_CHAIN = {
    "state": "the next visit reads its output (it returns the updated stream)",
    "increment": "the next visit reads input + output (it returns the increment)",
}
_SIZE = {
    "state": "||output - input|| <= ||input||/2 at every visit (it returns the updated stream)",
    "increment": "||output|| <= ||input||/2 at every visit (it returns the increment)",
}


class Collector:
    """One forward through the probe's visit session, keeping per visit only what is needed.

    At each visit's return: the RMS of the stream it read, its increment (a clone when
    ``copy``, so later in-place edits cannot change it), a clone of the first visit's
    input (``h_0``), the last visit's input with its version counter (``h_N`` falls back
    to input + increment and must detect an in-place edit of that input), and the
    evidence for what the sublayer returns: whether the next visit reads this output
    (a state) or input + output (an increment), and the sizes of output and input.
    In ``auto`` mode a visit whose sublayer is still undecided keeps its output and a
    clone of its input until the evidence arrives (usually at the next visit).
    """

    def __init__(self, increment: str | IncrementFn, copy: bool, call: str):
        self.increment, self.copy, self.call = increment, copy, call
        self.visits: list[Visit] = []
        self.x_rms: list[torch.Tensor] = []
        self.incs: list[Any] = []  # None while an auto visit's sublayer is undecided
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.chain: dict[str, dict[str, int]] = {}  # sublayer -> {kind: first r seen}
        self.size: dict[str, list[tuple[int, str | None, float, float]]] = {}
        self.prev: tuple[Visit, torch.Tensor, torch.Tensor] | None = None
        self.h0: torch.Tensor | None = None
        self.shapes: dict[str, tuple[int, tuple]] = {}
        self.last: tuple[torch.Tensor, int, int] | None = None
        self.measured: dict[str, str] = {}
        self.evidence: dict[str, str] = {}
        self.problems: list[str] = []
        self.tuple_outputs: set[str] = set()
        self.skip: set[str] = set()

    def run(self, probe: Probe, inputs: Any, forward: Forward | None) -> Any:
        subs = probe.sublayers(inputs, forward=forward)  # discovery (once per probe)
        # Increments are the loop body's: heads, norms and embedders write no residual stream.
        self.skip = {x.name for x in subs if x.role != "body"} if len(subs) > 1 else set()
        with torch.no_grad(), probe.session(None, self.leave, call=self.call):
            out = call_model(probe.model, inputs, forward)
        if not self.visits:
            raise ValueError(
                f"{self.call}: the forward pass made no visit to any sublayer; check inputs"
            )
        if isinstance(out, torch.Tensor):
            self._chain_evidence(out.detach())  # the model output read the last visit's
        self._resolve()
        return out

    def leave(self, v: Visit, args: tuple, kwargs: dict, out: Any) -> None:
        if v.sublayer in self.skip:
            return
        if isinstance(out, tuple | list) and out and isinstance(out[0], torch.Tensor):
            # Layers that return (hidden, extras) (Hugging Face, x-transformers): the
            # stream-shaped first element is the output; _check_increment checks its shape.
            self.tuple_outputs.add(v.sublayer)
            out = out[0]
        rec = VisitRecord(v, args, kwargs, out)
        x = _stream_in(rec, self.call)
        first = self.shapes.setdefault(v.sublayer, (v.r, tuple(x.shape)))
        if first[1] != tuple(x.shape):
            refuse_routing(
                self.call, v.sublayer, [f"r={first[0]}: {first[1]}", f"r={v.r}: {tuple(x.shape)}"]
            )
        self._chain_evidence(x.detach())
        if callable(self.increment):
            z = self.increment(rec)
            _check_increment(rec, x, z, self.increment, self.call)
            inc = z.detach().clone() if self.copy else z.detach()
        else:
            _check_increment(rec, x, out, self.increment, self.call)
            inc = self._store(v, x.detach(), out.detach())
        if self.h0 is None:
            self.h0 = x.detach().clone()
        self.visits.append(v)
        self.x_rms.append(torch.linalg.vector_norm(x.detach()) / math.sqrt(x.numel()))
        self.incs.append(inc)
        self.last = (x, x._version, len(self.incs) - 1)

    def _store(self, v: Visit, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        nx, ny, ns = (float(torch.linalg.vector_norm(t)) for t in (x, y, y - x))
        kind = "state" if ns <= nx / 2 else "increment" if ny <= nx / 2 else None
        rs, ry = (math.inf, math.inf) if nx == 0 else (ns / nx, ny / nx)  # NaN if not finite
        self.size.setdefault(v.sublayer, []).append((v.r, kind if nx > 0 else None, rs, ry))
        self.prev = (v, y, x + y)
        mode = self._mode(v.sublayer)
        if mode is None:  # auto and undecided: keep both until the evidence arrives
            self.pending[len(self.incs)] = (y.clone() if self.copy else y, x.clone())
            return None
        return self._increment(mode, x, y, cloned=False)

    def _increment(self, mode: str, x: torch.Tensor, y: torch.Tensor, cloned: bool) -> torch.Tensor:
        if mode == "delta":
            return y - x  # a new tensor nobody else holds
        return y.clone() if self.copy and not cloned else y

    def _mode(self, sublayer: str) -> str | None:
        if self.increment != "auto":
            return self.increment
        kinds = self.chain.get(sublayer, {})
        if len(kinds) != 1:
            return None
        return "delta" if "state" in kinds else "output"

    def _chain_evidence(self, x_next: torch.Tensor) -> None:
        """Does the stream read next equal the previous visit's output, or input + output?"""
        if self.prev is None:
            return
        v, y, s = self.prev
        self.prev = None
        if x_next.shape != y.shape:
            return
        state, inc = x_next is y or _close(x_next, y), _close(x_next, s)
        if state == inc:  # neither, or both (a zero input): no evidence
            return
        self.chain.setdefault(v.sublayer, {}).setdefault("state" if state else "increment", v.r)
        if self.increment == "auto" and self._mode(v.sublayer) is not None:
            self._flush(v.sublayer)

    def _flush(self, sublayer: str) -> None:
        mode = self._mode(sublayer)
        for k in [k for k in self.pending if self.visits[k].sublayer == sublayer]:
            y, x = self.pending.pop(k)
            self.incs[k] = self._increment(mode, x, y, cloned=True)

    def _resolve(self) -> None:
        """Decide what each sublayer returns; an undecidable ``auto`` sublayer is a ValueError."""
        for s in dict.fromkeys(v.sublayer for v in self.visits):
            if callable(self.increment):
                self.measured[s], self.evidence[s] = "callable", "chosen: a callable"
                continue
            kind, why = self._evidence(s)
            if self.increment == "auto":
                if kind is None:
                    self._undecided(s, why)
                self.chain[s] = {kind: 0}
                self._flush(s)
                mode = "delta" if kind == "state" else "output"
                self.evidence[s] = f"detected: {why}"
            else:
                mode, self.evidence[s] = self.increment, f"chosen: increment={self.increment!r}"
                if kind == {"output": "state", "delta": "increment"}[mode]:
                    other = "delta" if mode == "output" else "output"
                    self.problems.append(
                        f"sublayer {s!r} was measured with increment={mode!r} but {why}; "
                        f"increment={other!r} (or 'auto') measures its increments"
                    )
                    self.evidence[s] += f", contradicted: {why}"
            self.measured[s] = _MEASURED[mode]
            if s in self.tuple_outputs:
                self.evidence[s] += "; the output read is element 0 of the tuple it returns"

    def _evidence(self, sublayer: str) -> tuple[str | None, str]:
        """``("state" | "increment" | "unknown" | None, why)`` from the chain, else the sizes.

        ``None``: ambiguous; ``"unknown"``: not finite, nothing to decide on."""
        kinds = self.chain.get(sublayer, {})
        if len(kinds) == 2:
            return None, "the forward pass says both: " + ", ".join(
                f"{_CHAIN[k]} at r={r}" for k, r in kinds.items()
            )
        if kinds:
            kind = next(iter(kinds))
            return kind, _CHAIN[kind]
        sizes = {k for _, k, _, _ in self.size[sublayer]}
        if any(math.isnan(rs) or math.isnan(ry) for _, _, rs, ry in self.size[sublayer]):
            return "unknown", "a non-finite output (measured as output; the result is non-finite)"
        if all(rs == math.inf for _, _, rs, _ in self.size[sublayer]):
            return "state", "every visit reads a zero stream, so output - input = output"
        if len(sizes) == 1 and None not in sizes:
            kind = sizes.pop()
            return kind, _SIZE[kind]
        return None, (
            "no visit reads its output or input + output (is the output transformed "
            "before it is added?)"
        )

    def _undecided(self, sublayer: str, why: str) -> None:
        r, _, rs, ry = self.size[sublayer][0]
        raise ValueError(
            f"{self.call}: cannot tell whether sublayer {sublayer!r} returns its residual "
            f"increment or the updated stream: {why}, and by size it is ambiguous "
            f"(visit r={r}: ||output - input||/||input|| = {rs:.3g}, ||output||/||input|| = "
            f"{ry:.3g}); pass increment='output' if it returns what is added to the stream, "
            "increment='delta' if it returns the updated stream, or a callable"
        )


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    tol = math.sqrt(torch.finfo(b.dtype).eps) if b.is_floating_point() else 0.0
    if not a.is_floating_point() or a.dtype != b.dtype:
        return False
    return float(torch.linalg.vector_norm(a - b)) <= tol * float(torch.linalg.vector_norm(b))


@contextlib.contextmanager
def caller_rng(model: nn.Module) -> Iterator[None]:
    """Run the block on a fork of torch's RNG, so the caller's RNG does not advance."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    cuda = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):
        yield


def refuse_routing(call: str, group: str, seen: list[str]) -> None:
    raise ValueError(
        f"{call}: the visits of {group!r} read streams of different shapes "
        f"({', '.join(seen)}, ...), e.g. a router sends different tokens to each visit; "
        "increments of different tokens have no cosine. Pass increment=lambda rec: ... "
        "returning each increment scattered back to a fixed shape"
    )


_HOW = (
    "point the probe at the residual branch whose output is the increment as added to the "
    "stream, e.g. lp.attach(model, sublayers=['blocks.*.attn', 'blocks.*.mlp']), pass "
    "increment='delta' if the sublayer returns the updated stream x + f(x), or "
    "increment=lambda rec: ... to pick the tensor from rec.args/rec.output"
)


def _stream_in(v: VisitRecord, call: str) -> torch.Tensor:
    """The stream a visit reads: its first float tensor argument shaped like its output."""
    found = [
        t
        for t in (*v.args, *v.kwargs.values())
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]
    if not found:
        raise ValueError(
            f"{call}: visit r={v.r} of sublayer {v.sublayer!r} (module {v.module!r}) has no "
            f"floating-point tensor input to take as the residual stream; {_HOW}"
        )
    shape = v.output.shape if isinstance(v.output, torch.Tensor) else None
    return next((t for t in found if t.shape == shape), found[0])


def _check_increment(v: VisitRecord, x: torch.Tensor, z: Any, increment: Any, call: str) -> None:
    if not isinstance(z, torch.Tensor):
        raise ValueError(
            f"{call}: the increment of sublayer {v.sublayer!r} (module {v.module!r}) is a "
            f"{type(z).__name__}, not a tensor (increment={increment!r}); {_HOW}"
        )
    if z.shape != x.shape:
        raise ValueError(
            f"{call}: cannot locate the residual increment of sublayer {v.sublayer!r} "
            f"(module {v.module!r}): its output has shape {tuple(z.shape)} but the stream it "
            f"reads has shape {tuple(x.shape)}, so it is not a residual-shaped branch output "
            f"(loopprobe does not broadcast one against the other); {_HOW}"
        )
