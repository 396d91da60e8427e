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
sublayer undecided. When the pairs leave a sublayer open, or a sublayer's output is not
shaped like what it reads (an injection layer ``h <- block(inject(cat[h, e]))``), ``auto``
looks for the stream the loop carries (:meth:`Collector._carried`): the one visit output
that every next round's first visit reads (as an input, a slice of one, or one plus a fixed
tensor) with everything else it reads the same every round; its increments are the
changes ``h_{r+1} - h_r``. Reference: docs/definitions.md §3.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loopprobe.record._increment_checks import (
    IncrementFn,
    _call_increment,
    _check_callable_result,
    _check_increment,
    _floats,
    _how,
    _not_shaped,
    _stream_in,
)
from loopprobe.record.carried import _close, _Link, find_carried
from loopprobe.record.probe import Probe, grads_kept
from loopprobe.record.types import Forward, Visit, VisitRecord, call_model

CARRIED = "carried stream h_(r+1) - h_r"

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
        self.names: list[str] = []  # the probed sublayers, for errors that name them
        self.unshaped: dict[str, str] = {}  # auto: sublayer -> why its output is no increment
        self.reads: dict[int, list[torch.Tensor]] = {}  # auto: every float input per visit
        self.final: tuple[torch.Tensor, str] | None = None  # (h_N, source) of a carried stream
        self.attrs: dict[str, str] = {}
        self.carried_why = ""

    def run(self, probe: Probe, inputs: Any, forward: Forward | None) -> Any:
        subs = probe.sublayers(inputs, forward=forward)  # discovery (once per probe)
        # Increments are the loop body's: heads, norms and embedders write no residual stream.
        self.skip = {x.name for x in subs if x.role != "body"} if len(subs) > 1 else set()
        self.names = [x.name for x in subs if x.name not in self.skip]
        try:  # no_grad first: no graph is kept
            with torch.no_grad(), probe.session(None, self.leave, call=self.call):
                out = call_model(probe.model, inputs, forward)
        except RuntimeError:  # torch's refusal; retried in grad mode, a real error raises again
            # A forward that needs grad mode (x.register_hook, torch.autograd.grad inside)
            # runs as training runs it; what the first try recorded is dropped.
            skip, names = self.skip, self.names
            self.__init__(self.increment, self.copy, self.call)
            self.skip, self.names = skip, names
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
        k, xc = len(self.incs), None
        if self.increment == "auto":  # every float input, for the carried stream (_carried)
            floats = _floats(rec)
            self.reads[k] = [t.detach().clone() for t in floats]
            xc = self.reads[k][next(i for i, t in enumerate(floats) if t is x)]
        if callable(self.increment):
            z = _call_increment(self.increment, VisitRecord(v, args, kwargs, raw), self.call)
            _check_callable_result(rec, raw, x, z, self.call, self.names)
            inc = z.detach().clone() if self.copy else z.detach()
            self.prev = (v, z.detach(), x.detach() + z.detach())  # its chain is checked too
        elif xc is not None and isinstance(out, torch.Tensor) and out.shape != x.shape:
            # no residual branch (an injection layer Linear(2d, d)); at the end of the pass
            # the stream the loop carries may still be found (_carried), else this raises
            self.unshaped.setdefault(v.sublayer, _not_shaped(rec, x, out, "auto", self.call))
            self.pending[k] = (out.detach().clone(), xc)
            self.prev, inc = (v, out.detach(), None), None
        else:
            _check_increment(rec, x, out, self.increment, self.call, self.names)
            inc = self._store(v, x.detach(), out.detach(), xc)
        if self.h0 is None:
            self.h0 = x.detach().clone()
        self.visits.append(v)
        self.x_rms.append(torch.linalg.vector_norm(x.detach()) / math.sqrt(x.numel()))
        self.incs.append(inc)
        self.last = (x, x._version, len(self.incs) - 1)

    def _store(self, v: Visit, x: torch.Tensor, y: torch.Tensor, xc: Any) -> torch.Tensor | None:
        nx, ny, ns = (float(torch.linalg.vector_norm(t)) for t in (x, y, y - x))
        kind = "state" if ns <= nx / 2 else "increment" if ny <= nx / 2 else None
        rs, ry = (math.inf, math.inf) if nx == 0 else (ns / nx, ny / nx)  # NaN if not finite
        self.size.setdefault(v.sublayer, []).append((v.r, kind if nx > 0 else None, rs, ry))
        self.prev = (v, y, x + y)
        if self.increment == "auto":  # decided in _resolve, from every pair of visits
            self.pending[len(self.incs)] = (y.clone() if self.copy else y, xc)
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
        state, inc = x_next is y or _close(x_next, y), s is not None and _close(x_next, s)
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
        if self.increment == "auto" and self._open(counts):
            found = self._carried()
            if not isinstance(found, str):
                return self._use_carried(*found)
            self.carried_why = f"the stream the loop carries is not found: {found}"
            for msg in self.unshaped.values():
                raise ValueError(f"{msg}; {self.carried_why}; {self._options()}")
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
            mode = "'delta'" if kind == "state" else "'output'"
            return kind, _SIZE[kind] + (
                f"; by size only, since its next visits read neither its output nor input + "
                f"output: this can change as the model trains (increment={mode} fixes it)"
                if readings
                else ""
            )
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

    def _open(self, counts: dict[str, int]) -> bool:
        """Does some sublayer lack an increment its pairs of visits decide?"""
        return bool(self.unshaped) or any(
            self._chain(*self._readings(s, n > 1))[0] is None for s, n in counts.items()
        )

    def _carried(self) -> tuple[int, int, _Link] | str:
        """``(p, P, link)`` of :func:`~loopprobe.record.carried.find_carried` over this
        forward's visits, else why not (a sentence)."""
        outputs = {k: y for k, (y, _) in self.pending.items()}  # by visit index
        return find_carried([v.sublayer for v in self.visits], self.reads, outputs)

    def _use_carried(self, p: int, P: int, link: _Link) -> None:
        """Measure the carried stream: ``h_0`` from the first read, ``h_r`` visit p's outputs."""
        R, first, S = len(self.visits) // P, self.visits[0].sublayer, self.visits[p].sublayer
        ks = [r * P + p for r in range(R)]
        hs = [link.carried(self.reads[0]), *(self.pending[k][0] for k in ks)]
        inside = dict.fromkeys(v.sublayer for v in self.visits[:P] if v.sublayer != S)
        self.visits = [self.visits[k] for k in ks]
        self.incs = [hs[r + 1] - hs[r] for r in range(R)]
        self.x_rms = [torch.linalg.vector_norm(h) / math.sqrt(h.numel()) for h in hs[:-1]]
        self.h0, self.final = hs[0].clone(), (hs[-1], f"carried stream (last output of {S!r})")
        self.measured = {S: CARRIED}
        self.evidence = {
            S: f"detected: the loop carries the output of {S!r}: the next round's first visit "
            f"({first!r}) reads it {link.how()} at all {R - 1} round boundaries, and nothing "
            "else it reads changes between rounds; the increment is h_(r+1) - h_r"
        }
        for o in inside:
            self.evidence[o] = f"not measured: it runs inside the round that carries {S!r}"
        self.attrs = {"carried": S, "carried_by": f"{first} reads it {link.how()}"}
        self.pending.clear()
        self.reads.clear()

    def _options(self) -> str:
        """The choices that fit this model, with its own sublayer names."""
        shaped = [n for n in self.names if n not in self.unshaped]
        if not shaped:
            return _how(self.names)
        return (
            f"for this model: lp.increments(model, inputs, sublayers={shaped!r}, "
            "increment='delta') if that returns the updated stream, increment='output' if it "
            "returns what is added to the stream, or increment=lambda rec: ... built from "
            "rec.args and rec.output"
        )

    def _undecided(self, sublayer: str, why: str) -> None:
        r, _, rs, ry = self.size[sublayer][0]
        raise ValueError(
            f"{self.call}: cannot tell whether sublayer {sublayer!r} returns its residual "
            f"increment or the updated stream: {why}; by size it is not settled either "
            f"(visit r={r}: ||output - input||/||input|| = {rs:.3g}, ||output||/||input|| = "
            f"{ry:.3g}); {self.carried_why}; pass increment='output' if it returns what is "
            "added to the stream, increment='delta' if it returns the updated stream, or a "
            "callable (for an input injection z <- f(x + z): increment=lambda rec: rec.output "
            f"+ x - rec.args[0]); {self._options()}"
        )


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
