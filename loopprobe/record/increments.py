"""Recording the increments of one forward pass (the measuring half of :mod:`.increments`).

:class:`Collector` runs one visit session of a probe and keeps, per visit, the stream
RMS and the increment, and the evidence for what each sublayer returns, read at *every*
pair of consecutive visits (and the model output): whether the next visit reads its
output (it returns the updated stream: the increment is output - input), input + output
(the output is the increment), output + the same tensor at every visit (an input
injection ``z <- f(x + z)``: the increment is output + injection - input, the change of
the stream between reads), or none of these; else the sizes of output and input.
A reading that two kinds explain alike (a zero input; a first visit whose input is the
injection itself, as from a zero state) is no evidence; readings that disagree leave the
sublayer undecided. Reference: docs/definitions.md §3.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loopprobe.record.probe import Probe, grads_kept
from loopprobe.record.types import Forward, Visit, VisitRecord, call_model

IncrementFn = Callable[[VisitRecord], torch.Tensor]

_MEASURED = {
    "output": "output",
    "delta": "output - input",
    "inject": "output + injection - input",
}
_CHAIN = {
    "state": "the next visit reads its output (it returns the updated stream)",
    "increment": "the next visit reads input + output (it returns the increment)",
    "injection": (
        "the next visit reads output + the same tensor at every visit (an input injection "
        "z <- f(x + z): the increment is output + injection - input)"
    ),
    "neither": "the next visit reads neither its output nor input + output",
}
_FIRST = (
    "the first visit's input + output is also what a loop injecting that input into a zero "
    "state reads (z <- f(x + z), z_0 = 0), and no later visit reads input + output"
)


@dataclass(frozen=True)
class _Pair:
    """What the stream read after visit ``r`` was (``kind``), and whether it is the injection.

    ``same``: the next read minus this output equals the sublayer's reference (its first
    such difference, taken at ``ref``); ``final``: the model output, not a visit, read it.
    """

    r: int
    kind: str  # "state" | "increment" | "both" | "neither" | "nonfinite"
    same: bool
    ref: bool
    final: bool


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
    evidence for what the sublayer returns (one :class:`_Pair` per consecutive pair of
    visits, the sizes of output and input). In ``auto`` mode every visit keeps its output
    and a clone of its input until the end of the pass, because the decision rests on all
    pairs (a first pair can fit a reading that later pairs refute).
    """

    def __init__(self, increment: str | IncrementFn, copy: bool, call: str):
        self.increment, self.copy, self.call = increment, copy, call
        self.visits: list[Visit] = []
        self.x_rms: list[torch.Tensor] = []
        self.incs: list[Any] = []  # None while an auto visit's sublayer is undecided
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pairs: dict[str, list[_Pair]] = {}
        self.ref: dict[str, tuple[int, torch.Tensor]] = {}  # sublayer -> (r, next read - output)
        self.injected: set[str] = set()
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
        try:  # no_grad first: no graph is kept
            with torch.no_grad(), probe.session(None, self.leave, call=self.call):
                out = call_model(probe.model, inputs, forward)
        except RuntimeError:  # torch's refusal; retried in grad mode, a real error raises again
            # A forward that needs grad mode (x.register_hook, torch.autograd.grad inside)
            # runs as training runs it; what the first try recorded is dropped.
            skip = self.skip
            self.__init__(self.increment, self.copy, self.call)
            self.skip = skip
            with grads_kept(probe.model), probe.session(None, self.leave, call=self.call):
                out = call_model(probe.model, inputs, forward)
        if not self.visits:
            raise ValueError(
                f"{self.call}: the forward pass made no visit to any sublayer; check inputs"
            )
        if isinstance(out, torch.Tensor):
            self._chain_evidence(out.detach(), final=True)  # it read the last visit's output
        self._resolve()
        return out

    def leave(self, v: Visit, args: tuple, kwargs: dict, out: Any) -> None:
        if v.sublayer in self.skip:
            return
        raw = out
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
            z = _call_increment(self.increment, VisitRecord(v, args, kwargs, raw), self.call)
            _check_callable_result(rec, raw, x, z, self.call)
            inc = z.detach().clone() if self.copy else z.detach()
            self.prev = (v, z.detach(), x.detach() + z.detach())  # its chain is checked too
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
        if self.increment == "auto":  # decided in _resolve, from every pair of visits
            self.pending[len(self.incs)] = (y.clone() if self.copy else y, x.clone())
            return None
        return self._increment(self.increment, x, y, None, cloned=False)

    def _increment(
        self, mode: str, x: torch.Tensor, y: torch.Tensor, c: torch.Tensor | None, cloned: bool
    ) -> torch.Tensor:
        if mode == "delta":
            return y - x  # a new tensor nobody else holds
        if mode == "inject":
            return y + c - x  # the stream the next visit reads minus the one this visit read
        return y.clone() if self.copy and not cloned else y

    def _chain_evidence(self, x_next: torch.Tensor, final: bool = False) -> None:
        """What the stream read next is: this output, input + output, or output + c."""
        if self.prev is None:
            return
        v, y, s = self.prev
        self.prev = None
        if x_next.shape != y.shape or not x_next.is_floating_point() or x_next.dtype != y.dtype:
            return
        state, inc = x_next is y or _close(x_next, y), _close(x_next, s)
        kind = "both" if state and inc else "state" if state else "increment" if inc else ""
        same = is_ref = False
        if kind in ("", "increment"):
            d = x_next - y  # what the loop adds between this output and the next read
            if not kind and not math.isfinite(float(torch.linalg.vector_norm(d))):
                kind = "nonfinite"
            elif v.sublayer not in self.ref:
                self.ref[v.sublayer], is_ref = (v.r, d), True
            else:
                same = _close(d, self.ref[v.sublayer][1])
        self.pairs.setdefault(v.sublayer, []).append(
            _Pair(v.r, kind or "neither", same, is_ref, final)
        )

    def _resolve(self) -> None:
        """Decide what each sublayer returns; an undecidable ``auto`` sublayer is a ValueError."""
        counts: dict[str, int] = {}
        for v in self.visits:
            counts[v.sublayer] = counts.get(v.sublayer, 0) + 1
        for s in counts:
            if callable(self.increment):
                self._check_callable_chain(s, counts[s] > 1)
                continue
            kind, why = self._evidence(s, counts[s] > 1)
            if self.increment == "auto":
                if kind is None:
                    self._undecided(s, why)
                mode = {"state": "delta", "injection": "inject"}.get(kind, "output")
                self._flush(s, mode)
                self.evidence[s] = f"detected: {why}"
                if kind == "unknown":
                    self.problems.append(f"sublayer {s!r} reads or returns {why}")
            else:
                mode, self.evidence[s] = self.increment, f"chosen: increment={self.increment!r}"
                wrong = {"output": ("state", "injection"), "delta": ("increment", "injection")}
                if kind in wrong[mode]:
                    flip = "'delta' (or 'auto')" if mode == "output" else "'output' (or 'auto')"
                    other = "'auto'" if kind == "injection" else flip
                    self.problems.append(
                        f"sublayer {s!r} was measured with increment={mode!r} but {why}; "
                        f"increment={other} measures its increments"
                    )
                    self.evidence[s] += f", contradicted: {why}"
            self.measured[s] = _MEASURED[mode]
            if s in self.tuple_outputs:
                self.evidence[s] += "; the output read is element 0 of the tuple it returns"

    def _check_callable_chain(self, sublayer: str, repeated: bool) -> None:
        """A callable's result read as output: does the next visit read it as the stream?"""
        self.measured[sublayer] = "callable"
        self.evidence[sublayer] = "chosen: a callable (given rec.output as the module returned it)"
        readings, _ = self._readings(sublayer, repeated)
        kind, why = self._evidence(sublayer, repeated) if readings else (None, "")
        if kind in ("state", "injection"):
            self.problems.append(
                f"the increment callable's result for sublayer {sublayer!r} is not what the "
                f"visit adds to the stream: {why.replace('its output', 'that result')}"
            )
            self.evidence[sublayer] += f", contradicted: {why}"

    def _flush(self, sublayer: str, mode: str) -> None:
        c = self.ref[sublayer][1] if mode == "inject" else None
        if c is not None:
            self.injected.add(sublayer)
        for k in [k for k in self.pending if self.visits[k].sublayer == sublayer]:
            y, x = self.pending.pop(k)
            self.incs[k] = self._increment(mode, x, y, c, cloned=True)

    def _readings(self, sublayer: str, repeated: bool) -> tuple[list[tuple[str, int]], bool]:
        """``[(kind, r)]`` that count as evidence, and whether the first one was set aside.

        A pair that two kinds explain alike is no evidence: a zero input (``both``); under
        an injection, an ``increment`` pair whose difference is the injection (the first
        visit from a zero state) and the model output reading the carried state itself.
        """
        pairs = self.pairs.get(sublayer, [])
        injected = any(p.kind == "neither" and p.same for p in pairs)
        out = []
        for p in pairs:
            kind = p.kind
            if kind in ("both", "nonfinite"):
                continue
            if injected and kind in ("increment", "neither") and (p.same or p.ref):
                kind = "injection"
            if p.final and (kind == "neither" or (injected and kind == "state")):
                continue  # what reads the model output is outside the loop
            out.append((kind, p.r))
        first_only = (
            repeated and not injected and [p.ref for p in pairs if p.kind == "increment"] == [True]
        )
        if first_only:
            out = [(k, r) for k, r in out if k != "increment"]
        return out, first_only

    def _evidence(self, sublayer: str, repeated: bool) -> tuple[str | None, str]:
        """``(kind | "unknown" | None, why)`` from every pair of visits, else the sizes.

        ``kind``: "state", "increment" or "injection"; ``None``: ambiguous or contradicted;
        ``"unknown"``: not finite, nothing to decide on."""
        readings, first_only = self._readings(sublayer, repeated)
        kind, why = self._chain(readings, first_only)
        if kind is not None or sublayer not in self.size:
            return kind, why
        sizes = self.size[sublayer]
        nonfinite = any(p.kind == "nonfinite" for p in self.pairs.get(sublayer, []))
        if nonfinite or any(math.isnan(rs) or math.isnan(ry) for _, _, rs, ry in sizes):
            return "unknown", "a non-finite stream (measured as output; the result is non-finite)"
        if why:
            return None, why
        if all(rs == math.inf for _, _, rs, _ in sizes):
            return "state", "every visit reads a zero stream, so output - input = output"
        kinds = {k for _, k, _, _ in sizes}
        if len(kinds) == 1 and None not in kinds:
            kind = kinds.pop()
            return kind, _SIZE[kind]
        return None, (
            "no visit reads its output or input + output (is the output transformed "
            "before it is added?)"
        )

    @staticmethod
    def _chain(readings: list[tuple[str, int]], first_only: bool) -> tuple[str | None, str]:
        """The kind every telling read agrees on; ``(None, why)`` if they disagree, else ``""``."""
        first = {}
        for k, r in readings:
            first.setdefault(k, r)
        decisive = set(first) - {"neither"}
        if decisive and len(first) > 1:
            return None, "the forward pass says both: " + ", ".join(
                f"{_CHAIN[k]} at r={r}" for k, r in first.items()
            )
        if decisive:
            kind = decisive.pop()
            n = sum(1 for k, _ in readings if k == kind)
            return kind, f"{_CHAIN[kind]} (at all {n} reads that tell)"
        return None, _FIRST if first_only else ""

    def _undecided(self, sublayer: str, why: str) -> None:
        r, _, rs, ry = self.size[sublayer][0]
        raise ValueError(
            f"{self.call}: cannot tell whether sublayer {sublayer!r} returns its residual "
            f"increment or the updated stream: {why}; by size it is not settled either "
            f"(visit r={r}: ||output - input||/||input|| = {rs:.3g}, ||output||/||input|| = "
            f"{ry:.3g}); pass increment='output' if it returns what is added to the stream, "
            "increment='delta' if it returns the updated stream, or a callable (for an input "
            "injection z <- f(x + z): increment=lambda rec: rec.output + x - rec.args[0])"
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


def _check_callable_result(v: VisitRecord, raw: Any, x: torch.Tensor, z: Any, call: str) -> None:
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
    _check_increment(v, x, z, "a callable", call)


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
