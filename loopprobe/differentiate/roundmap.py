"""One round T(h; x) of a looped model as a function, and the JVP plumbing around it.

:func:`round_map` builds the round map of a reference model (``model.step(h, x)`` with
``x = model.embed(idx)``), :func:`replay_round` that of any looped model from the recorded
calls of one module. Both check, when they build the map, that it is the model's round
(the replayed call reproduces its recording; the call leaves the module's attributes as they
were) and refuse with a ``ValueError`` otherwise: every estimate built on a map that is not
the model's round would be a wrong number. The private helpers below (state checks,
``linearize`` / ``TracedJVP``, ``numpy_op``) are shared by
:mod:`loopprobe.estimate.fixedpoint` (reachability, geometry) and
:mod:`loopprobe.estimate.implicit` (input-dependence). Reference: docs/definitions.md §4.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from loopprobe._checks import count as _count
from loopprobe.autodiff import JVP
from loopprobe.record.modulestate import IN_PLACE, Change, ModuleState
from loopprobe.record.session import running_stats

Step = Callable[..., torch.Tensor]
Map = Callable[[torch.Tensor], torch.Tensor]

# ------------------------------------------------------------------------ the round map

EVAL_ROUND = "eval mode (dropout off, BatchNorm with its running statistics)"


@dataclass(frozen=True)
class RoundMap:
    """One round of a model as a function: ``step(h, x)``, the input ``x``, start ``h0``, R.

    ``T(h)`` is the round at this input. The maps loopprobe builds run the model in eval
    mode, BatchNorm with its running statistics even when the model is in train mode, and
    put each submodule's train/eval flag back afterwards; ``mode`` says which round a map
    measures (:data:`EVAL_ROUND`, or the step's own for a map written by hand). ``reason``
    says what was checked when the map was built (empty for a map written by hand).
    """

    step: Step
    x: torch.Tensor
    h0: torch.Tensor
    rounds: int | None
    reason: str = ""
    mode: str = "the step's own mode (a map written by hand)"

    def T(self, h: torch.Tensor) -> torch.Tensor:
        return self.step(h, self.x)


def round_map(model: torch.nn.Module, idx: torch.Tensor) -> RoundMap:
    """The round map of a reference model at token ids ``idx`` (docs/models-api.md).

    ``x = model.embed(idx)`` (detached), ``h0 = x`` (the reference models start the state at
    the embedding), ``step(h, x) = model.step(h, x)``, ``rounds = model.cfg.R``.
    For any other looped model see :func:`replay_round`.
    """
    for attr in ("step", "embed"):
        if not callable(getattr(model, attr, None)):
            raise TypeError(
                f"round_map: {type(model).__name__} has no method {attr!r}; pass a reference "
                "model (LoopedGPT, LinearLoop) or call fixed_point(step, h0) with your own step"
            )
    if getattr(getattr(model, "cfg", None), "tied", True) is False:
        raise ValueError(
            "round_map: the model is untied (cfg.tied=False), so every round is a different map "
            "and has no common fixed point; use a tied model"
        )
    with torch.no_grad(), _eval_mode(model):
        x = model.embed(idx).detach()

    def step(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        with _eval_mode(model):
            return model.step(h, x)

    reason = _check_pure_step(model, step, x)
    R = getattr(getattr(model, "cfg", None), "R", None)
    return RoundMap(step, x, x, R, f"{reason}; {EVAL_ROUND}", EVAL_ROUND)


def _check_pure_step(model: torch.nn.Module, step: Step, x: torch.Tensor) -> str:
    """``model.step`` at ``h0`` twice: same output, no attribute of the model changed.

    A step that keeps state between calls (a cache, a counter) is not a function of h, and
    after the forward it reads the state the last round left, not round r's.
    """
    name = type(model).__name__
    state = ModuleState(model, "model", clone=True)
    try:
        with torch.no_grad():
            first, second = step(x, x), step(x, x)
    finally:
        changes = state.restore()
    if changes:
        raise ValueError(
            f"round_map: {name}.step changes the model ({'; '.join(map(str, changes))}; put "
            "back), so it keeps state between rounds and is not a function of h; pass that "
            "state explicitly in your own step(h, x) and use fixed_point(step, h0, x=x)"
        )
    check_same("round_map", x, first)
    diff = _rel_diff(second, first)
    if not diff <= replay_tol(first.dtype):
        raise ValueError(
            f"round_map: {name}.step(h0, x) called twice gives outputs {diff:.3g} apart "
            f"(relative; roundoff allows {replay_tol(first.dtype):.2g}), so it is not a "
            "function of h (randomness in eval mode?); pass a deterministic step"
        )
    return f"{name}.step(h0, x) called twice: relative difference {diff:.2g}, model unchanged"


def replay_round(
    model: torch.nn.Module,
    inputs: object,
    module: str,
    *,
    forward: Callable | None = None,
    state_arg: int | str = 0,
    input_arg: int | str | None = None,
    round: int = 0,
    rtol: float = 1e-5,
    replay_rtol: float | None = None,
) -> RoundMap:
    """The round map of any looped model, replayed from the recorded calls of one module.

    One forward is recorded (``lp.attach(model, sublayers=[module]).record(inputs)``,
    loopprobe/visits.py). Call r of ``module`` must map the state of round r (its
    argument ``state_arg``: a position, or a keyword for ``block(x=..., h=...)``-style
    calls) to the state of round r + 1 (its output, or element 0 of a ``(state, extras)``
    tuple, as x-transformers' layers return); this is checked (the
    state passed to call r + 1 equals the output of call r to ``rtol``) and a
    ``ValueError`` says so otherwise (e.g. recall or an outer norm applied outside the
    module: name a module that contains the whole round, or write ``step`` yourself).
    ``T(h)`` calls the module with ``h`` and call ``round``'s other recorded arguments
    (masks, positions, ...). ``input_arg`` (a position or keyword) marks the re-injected
    input: it becomes ``x`` and ``step(h, x)`` substitutes it, so :func:`input_dependence`
    can differentiate through it; without it ``x`` is an empty tensor that ``step``
    ignores. ``h0`` is the state passed to the first call, ``rounds`` the number of calls.
    The module attributes the recorded forward changed are put back afterwards.

    The map is checked to be the model's round ``round``: the module is called once with
    that call's recorded arguments and must reproduce its recorded output to
    ``replay_rtol`` (relative, whole state; default :func:`replay_tol`, roundoff of a
    nondeterministic kernel; bitwise equal in the normal case). A module that keeps state
    between calls (a KV cache or memory of earlier repeats on ``self``, a step counter)
    reads, after the forward, what the last round left, not what round ``round`` read;
    it fails the check and ``replay_round`` raises ``ValueError`` with the relative
    difference and the attributes the call changed, rather than return a map whose every
    estimate would be a wrong number. A check call that writes into a tensor attribute in
    place (a preallocated cache, a counter buffer) raises ``ValueError`` too. Every later call
    of ``step`` puts back the attributes the check call rebound or whose lists/dicts it
    changed (probing never changes the model).
    """
    from loopprobe.record.probe import Probe

    call = "replay_round"
    before = ModuleState(model, "", clone=True)
    try:  # the forward itself may fill a cache or advance a counter: probing changes nothing
        with _eval_mode(model), Probe(model, sublayers=[module]) as probe:
            calls = probe.record(inputs, forward=forward).visits
    finally:
        before.restore()
    if not calls:
        raise ValueError(f"{call}: module {module!r} was never called on these inputs")
    _count(call, "round", round, 0)
    if round >= len(calls):
        raise ValueError(f"{call}: round={round} but {module!r} ran {len(calls)} times")
    states = [_replay_arg(call, c.args, c.kwargs, state_arg) for c in calls]
    for r in range(len(calls) - 1):
        if not _chains(calls[r].output, states[r + 1], rtol):
            raise ValueError(
                f"{call}: call {r + 1} of {module!r} does not receive the output of call {r}, "
                "so one call is not one round (recall or a norm between rounds?); name the "
                "module that holds a whole round or pass your own step(h, x)"
            )
    rec = calls[round]
    mod = model.get_submodule(rec.module)
    x = _replay_arg(call, rec.args, rec.kwargs, input_arg) if input_arg is not None else None

    watched: list[Change] | None = None  # None for the check call: watch everything

    def run(h: torch.Tensor, x: torch.Tensor) -> tuple[object, list]:
        args, kwargs = list(rec.args), dict(rec.kwargs)
        _put(args, kwargs, state_arg, h)
        if input_arg is not None:
            _put(args, kwargs, input_arg, x)
        state = ModuleState(mod, rec.module, clone=watched is None, only=watched)
        try:
            with _eval_mode(model):
                out = _state_of(mod(*args, **kwargs))
        finally:
            changes = state.restore()
        return out, changes

    def step(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        out, changes = run(h, x)
        if any(not c.restored for c in changes):
            raise ValueError(_in_place(call, module, changes))
        return out

    with torch.set_grad_enabled(rec.grad_enabled):
        out, changes = run(states[round], x)
    reason = _check_replay(call, module, round, out, _state_of(rec.output), changes, replay_rtol)
    watched = changes  # every later call puts back what this one changed
    empty = states[0].new_zeros(0)
    reason = f"{reason}; {EVAL_ROUND}"
    return RoundMap(step, empty if x is None else x, states[0], len(calls), reason, EVAL_ROUND)


def replay_tol(dtype: torch.dtype) -> float:
    """Relative difference roundoff can put between two runs of one call: 64 eps (32/64-bit
    floats; a nondeterministic reduction reorders a few sums), 4 eps for 16-bit floats."""
    eps = torch.finfo(dtype).eps
    return (64 if eps < 1e-6 else 4) * eps


def _rel_diff(a: object, b: torch.Tensor) -> float:
    if not isinstance(a, torch.Tensor) or a.shape != b.shape:
        return math.inf
    a, b = a.detach().to(torch.float64), b.detach().to(torch.float64)
    return 0.0 if torch.equal(a, b) else rel(a - b, b)


def _check_replay(call, module, r, out, recorded, changes, rtol) -> str:
    """The replayed call ``r`` against its recording; the reason, or ``ValueError``."""
    if any(c.how == IN_PLACE for c in changes):  # later calls could not put it back
        raise ValueError(_in_place(call, module, changes))
    if not isinstance(recorded, torch.Tensor):
        raise ValueError(
            f"{call}: call {r} of {module!r} returned {type(recorded).__name__}, not a state "
            "tensor (or a (state, extras) tuple); name the module whose output is the state"
        )
    tol = replay_tol(recorded.dtype) if rtol is None else rtol
    check_positive(call, "replay_rtol", tol)
    diff = _rel_diff(out, recorded)
    kept = f"; the call changes {'; '.join(map(str, changes))}" if changes else ""
    if not diff <= tol:
        raise ValueError(
            f"{call}: replaying call {r} of {module!r} with its recorded arguments does not "
            f"reproduce its recorded output (relative difference {diff:.3g} > replay_rtol "
            f"{tol:.2g}){kept}. The module keeps state between calls (a cache, a memory, a "
            f"step counter on self?) or is random in eval mode, so the replay is not round {r} "
            "of the model and every estimate on it would be wrong. Write the round as a "
            "function step(h, x) that takes that state explicitly and use it directly "
            "(lp.fixed_point(step, h0, x=x), lp.RoundMap(step=step, x=x, h0=h0, rounds=R))"
        )
    if changes:
        kept = f"; it changes {'; '.join(map(str, changes))}, put back after every call"
    return (
        f"replayed call {r} of {module!r} reproduces its recorded output (relative difference "
        f"{diff:.2g} <= replay_rtol {tol:.2g}){kept}"
    )


def _in_place(call: str, module: str, changes: list) -> str:
    lost = "; ".join(str(c) for c in changes if c.how == IN_PLACE)
    return (
        f"{call}: calling {module!r} writes into tensors it holds in place ({lost}), so "
        "replaying it would change your model (a preallocated cache or a counter buffer?); "
        "write the round as a function step(h, x) that takes that state explicitly"
    )


def _put(args: list, kwargs: dict, where: int | str, value: torch.Tensor) -> None:
    if isinstance(where, str):
        kwargs[where] = value
    else:
        args[where] = value


def _state_of(out: object) -> object:
    """A round's new state: the output, or element 0 of a ``(state, extras)`` tuple."""
    if isinstance(out, tuple | list) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return out


def _chains(out: object, nxt: torch.Tensor, rtol: float) -> bool:
    out = _state_of(out)
    if not isinstance(out, torch.Tensor) or out.shape != nxt.shape:
        return False
    return bool(torch.allclose(nxt, out, rtol=rtol, atol=rtol * state_norm(out)))


def _replay_arg(call: str, args: tuple, kwargs: dict, where: int | str) -> torch.Tensor:
    if not isinstance(where, (int, str)) or isinstance(where, bool):
        raise TypeError(
            f"{call}: an argument is named by its position (int) or keyword (str), got {where!r}"
        )
    value = kwargs.get(where) if isinstance(where, str) else (
        args[where] if -len(args) <= where < len(args) else None
    )  # fmt: skip
    if not isinstance(value, torch.Tensor):
        raise ValueError(
            f"{call}: argument {where!r} of the recorded call is {type(value).__name__}, not a "
            f"tensor (the call had {len(args)} positional and keywords {sorted(kwargs)})"
        )
    return value


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """The model in eval mode, BatchNorm with its running statistics even inside probing
    (which sets them aside for train-mode forwards): the round of docs/definitions.md §4."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with running_stats(model):
            yield
    finally:
        for m, flag in flags:
            m.training = flag


def bind(step: Step, x: torch.Tensor | None) -> Map:
    if not callable(step):
        raise TypeError(f"step must be callable h -> T(h) or (h, x) -> T(h; x), got {step!r}")
    return step if x is None else (lambda h: step(h, x))


def check_state(call: str, h: object) -> torch.Tensor:
    if not isinstance(h, torch.Tensor) or not h.is_floating_point():
        raise TypeError(f"{call}: the state must be a floating-point tensor, got {h!r:.60}")
    if not bool(torch.isfinite(h).all()):
        raise ValueError(f"{call}: the start state contains NaN or inf; pass a finite state")
    return h.detach()


def apply_map(call: str, T: Map, h: torch.Tensor) -> torch.Tensor:
    """``T(h)``, checked to keep the state's shape and dtype (a step must map h to h)."""
    out = T(h)
    check_same(call, h, out)
    return out


def check_same(call: str, h: torch.Tensor, out: object) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{call}: step returned {type(out).__name__}, expected a tensor")
    if out.shape != h.shape or out.dtype != h.dtype:
        raise ValueError(
            f"{call}: step changed the state from {tuple(h.shape)} {h.dtype} to "
            f"{tuple(out.shape)} {out.dtype}; a round map must return a state like its input"
        )


def state_norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t))


def rel(num: torch.Tensor, den: torch.Tensor) -> float:
    d = state_norm(den)
    return state_norm(num) / d if d > 0 else (0.0 if state_norm(num) == 0 else math.inf)


def check_positive(call: str, name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and value > 0):
        raise ValueError(f"{call}: {name} must be a number > 0, got {value!r}")


# ------------------------------------------------------------------------- JVP plumbing


class NonFinite(ArithmeticError):
    pass


def linearize(T: Map, h: torch.Tensor, trace: bool = True) -> tuple[torch.Tensor, Map]:
    """``T(h)`` and ``v -> dT/dh(h) v`` (see :class:`TracedJVP`)."""
    with quiet():
        Th = T(h)
    return Th.detach(), TracedJVP(T, h, trace)


class TracedJVP:
    """``v -> dT/dh(h) v``: plain ``torch.func.jvp`` first, traced once it pays off.

    A plain JVP recomputes T on every call. Once at least 10 calls have taken 0.25 s of
    CPU together, ``torch.func.linearize`` traces the JVP once (2-4x faster per call on
    small Transformer rounds); the trace is checked against the last plain JVP, and a step
    it cannot trace (data-dependent control flow, some in-place ops) or traces wrongly keeps
    the plain JVPs. The trace itself costs about 0.25-0.5 CPU-s on the report's round maps
    (60-120 plain JVPs there), so it waits until the plain JVPs have cost about as much: a
    map called a few dozen times is never traced, at most twice the cost of the better
    choice either way (benchmarks/bench_report.py, the fixed-point section).
    """

    after_calls, min_seconds = 10, 0.25  # class attributes: tests force tracing with 0

    def __init__(self, T: Map, h: torch.Tensor, trace: bool):
        self.T, self.h, self.trace = T, h, trace
        self.calls, self.seconds = 0, 0.0
        self.traced: Map | None = None
        self.tried = False
        self.jvp = JVP(call="the round map's JVP")  # reverse mode where an op needs it

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        if self.traced is not None:
            return self.traced(v)
        start = time.process_time()  # CPU: a loaded machine's wall time would trace early
        with quiet():
            out = self.jvp(self.T, (self.h,), (v,))[1]
        self.calls, self.seconds = self.calls + 1, self.seconds + time.process_time() - start
        traceable = self.trace and not self.jvp.reverse
        ready = self.calls >= self.after_calls and self.seconds >= self.min_seconds
        if traceable and ready and not self.tried:
            self.tried = True
            self.traced = self._try_trace(v, out.detach())
        return out

    def _try_trace(self, v: torch.Tensor, reference: torch.Tensor) -> Map | None:
        try:
            with quiet():
                _, traced = torch.func.linearize(self.T, self.h)
                atol = 1e-6 * float(reference.abs().max().nan_to_num())
                if torch.allclose(traced(v), reference, rtol=1e-5, atol=atol, equal_nan=True):
                    return traced
        except Exception:  # noqa: BLE001 - any tracing failure means: keep plain JVPs
            pass
        return None


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence torch's own tracing noise (forward-AD setup, const folding), not the user's."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Attempted to insert a get_attr Node")
        warnings.filterwarnings("ignore", message=".*torch.jit.script. is deprecated")
        yield


def numpy_op(fn: Map, shape: torch.Size, like: torch.Tensor, what: str, calls: list[int]):
    """Wrap a torch map on tensors of ``shape`` as a flat float64 numpy function."""

    def apply(v: np.ndarray) -> np.ndarray:
        calls[0] += 1
        t = torch.as_tensor(np.ascontiguousarray(v).reshape(-1), device=like.device)
        out = fn(t.to(like.dtype).view(shape)).detach()
        if not bool(torch.isfinite(out).all()):
            raise NonFinite(f"the {what} returned NaN/inf")
        return out.reshape(-1).to(torch.float64).cpu().numpy()

    return apply
