"""One round T(h; x) of a looped model as a function, and the JVP plumbing around it.

:func:`round_map` builds the round map of a reference model (``model.step(h, x)`` with
``x = model.embed(idx)``), :func:`replay_round` that of any looped model from the recorded
calls of one module. The private helpers below (state checks, ``linearize`` / ``TracedJVP``,
``numpy_op``) are shared by :mod:`loopprobe.estimate.fixedpoint` (reachability, geometry) and
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

Step = Callable[..., torch.Tensor]
Map = Callable[[torch.Tensor], torch.Tensor]

# ------------------------------------------------------------------------ the round map


@dataclass(frozen=True)
class RoundMap:
    """One round of a model as a function: ``step(h, x)``, the input ``x``, start ``h0``, R.

    ``T(h)`` is the round at this input. Every call runs the model in eval mode and puts
    each submodule's train/eval flag back afterwards.
    """

    step: Step
    x: torch.Tensor
    h0: torch.Tensor
    rounds: int | None

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

    return RoundMap(step, x, x, getattr(getattr(model, "cfg", None), "R", None))


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
    """
    from loopprobe.record.probe import Probe

    call = "replay_round"
    with _eval_mode(model), Probe(model, sublayers=[module]) as probe:
        calls = probe.record(inputs, forward=forward).visits
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

    def step(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        args, kwargs = list(rec.args), dict(rec.kwargs)
        _put(args, kwargs, state_arg, h)
        if input_arg is not None:
            _put(args, kwargs, input_arg, x)
        with _eval_mode(model):
            return _state_of(mod(*args, **kwargs))

    empty = states[0].new_zeros(0)
    return RoundMap(step, empty if x is None else x, states[0], len(calls))


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
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
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

    A plain JVP recomputes T on every call. After 10 calls that took > 5 ms each on
    average, ``torch.func.linearize`` traces the JVP once (2-4x faster per call on small
    Transformer rounds); the trace is checked against the last plain JVP, and a step it
    cannot trace (data-dependent control flow, some in-place ops) or traces wrongly keeps
    the plain JVPs.
    """

    after_calls, min_seconds = 10, 0.05  # class attributes: tests force tracing with 0

    def __init__(self, T: Map, h: torch.Tensor, trace: bool):
        self.T, self.h, self.trace = T, h, trace
        self.calls, self.seconds = 0, 0.0
        self.traced: Map | None = None
        self.jvp = JVP(call="the round map's JVP")  # reverse mode where an op needs it

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        if self.traced is not None:
            return self.traced(v)
        start = time.perf_counter()
        with quiet():
            out = self.jvp(self.T, (self.h,), (v,))[1]
        self.calls, self.seconds = self.calls + 1, self.seconds + time.perf_counter() - start
        traceable = self.trace and not self.jvp.reverse
        if traceable and self.calls == self.after_calls and self.seconds >= self.min_seconds:
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
