"""Fixed points of one round T(h; x): reachability, geometry, input-dependence.

A looped model applies the same round map ``T`` again and again. Whether that iteration
means anything is a fixed-point question along three axes (DESIGN.md §4; seed 000/003,
the fixed-point framework of Labovich, arXiv 2604.15259):

- **reachability** (:func:`fixed_point`, :func:`round_residuals`): does ``h <- T(h)``
  reach ``h* = T(h*)``, how fast, and how far from it do the model's own R rounds stop;
- **geometry** (:func:`spectral_radius`, :func:`jacobian_norm`): the spectrum and the
  norm of ``dT/dh`` at the reached state, from JVPs/VJPs only;
- **input-dependence** (:func:`input_dependence`): ``||dh*/dx||`` by implicit
  differentiation, next to the derivative of the unrolled R rounds.

The round map is a callable ``step(h)`` or ``step(h, x)``; :func:`round_map` builds it
from a reference model (``model.step(h, x)`` with ``x = model.embed(idx)``). Norms are
taken over the whole state tensor (every batch row together).
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
from scipy.sparse.linalg import ArpackError, ArpackNoConvergence, LinearOperator, eigs, gmres

from loopprobe.linalg import Estimate, operator_norm

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
    state_arg: int = 0,
    input_arg: int | str | None = None,
    round: int = 0,
    rtol: float = 1e-5,
) -> RoundMap:
    """The round map of any looped model, replayed from the recorded calls of one module.

    One forward is recorded (``lp.attach(model, sublayers=[module]).record(inputs)``,
    loopprobe/visits.py). Call r of ``module`` must map the state of round r (its
    positional argument ``state_arg``) to the state of round r + 1; this is checked (the
    state passed to call r + 1 equals the output of call r to ``rtol``) and a
    ``ValueError`` says so otherwise (e.g. recall or an outer norm applied outside the
    module: name a module that contains the whole round, or write ``step`` yourself).
    ``T(h)`` calls the module with ``h`` and call ``round``'s other recorded arguments
    (masks, positions, ...). ``input_arg`` (a position or keyword) marks the re-injected
    input: it becomes ``x`` and ``step(h, x)`` substitutes it, so :func:`input_dependence`
    can differentiate through it; without it ``x`` is an empty tensor that ``step``
    ignores. ``h0`` is the state passed to the first call, ``rounds`` the number of calls.
    """
    from loopprobe.visits import attach

    call = "replay_round"
    with _eval_mode(model), attach(model, sublayers=[module]) as probe:
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
        args[state_arg] = h
        if input_arg is not None:
            if isinstance(input_arg, str):
                kwargs[input_arg] = x
            else:
                args[input_arg] = x
        with _eval_mode(model):
            return mod(*args, **kwargs)

    empty = states[0].new_zeros(0)
    return RoundMap(step, empty if x is None else x, states[0], len(calls))


def _chains(out: object, nxt: torch.Tensor, rtol: float) -> bool:
    if not isinstance(out, torch.Tensor) or out.shape != nxt.shape:
        return False
    return bool(torch.allclose(nxt, out, rtol=rtol, atol=rtol * _norm(out)))


def _replay_arg(call: str, args: tuple, kwargs: dict, where: int | str) -> torch.Tensor:
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


def _bind(step: Step, x: torch.Tensor | None) -> Map:
    if not callable(step):
        raise TypeError(f"step must be callable h -> T(h) or (h, x) -> T(h; x), got {step!r}")
    return step if x is None else (lambda h: step(h, x))


def _check_state(call: str, h: object) -> torch.Tensor:
    if not isinstance(h, torch.Tensor) or not h.is_floating_point():
        raise TypeError(f"{call}: the state must be a floating-point tensor, got {h!r:.60}")
    if not bool(torch.isfinite(h).all()):
        raise ValueError(f"{call}: the start state contains NaN or inf; pass a finite state")
    return h.detach()


def _apply(call: str, T: Map, h: torch.Tensor) -> torch.Tensor:
    """``T(h)``, checked to keep the state's shape and dtype (a step must map h to h)."""
    out = T(h)
    _check_same(call, h, out)
    return out


def _check_same(call: str, h: torch.Tensor, out: object) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{call}: step returned {type(out).__name__}, expected a tensor")
    if out.shape != h.shape or out.dtype != h.dtype:
        raise ValueError(
            f"{call}: step changed the state from {tuple(h.shape)} {h.dtype} to "
            f"{tuple(out.shape)} {out.dtype}; a round map must return a state like its input"
        )


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t))


def _rel(num: torch.Tensor, den: torch.Tensor) -> float:
    d = _norm(den)
    return _norm(num) / d if d > 0 else (0.0 if _norm(num) == 0 else math.inf)


def _positive(call: str, name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and value > 0):
        raise ValueError(f"{call}: {name} must be a number > 0, got {value!r}")


def _count(call: str, name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{call}: {name} must be an integer >= {low}, got {value!r}")
    return value


# ------------------------------------------------------------------------- reachability


@dataclass(frozen=True)
class FixedPoint:
    """Result of :func:`fixed_point`.

    ``residuals[k] = ||T(h_k) - h_k|| / ||h_k||`` for the iterates ``h_0 .. h_K``;
    ``h`` is the last iterate with a finite residual (``h_K``); ``rate`` is the observed
    contraction rate (:func:`observed_rate`); ``reason`` says why the iteration stopped.
    """

    h: torch.Tensor
    converged: bool
    residuals: list[float]
    rate: float
    reason: str
    method: str
    iterations: int

    @property
    def residual(self) -> float:
        return self.residuals[-1] if self.residuals else math.nan

    def to_frame(self) -> pd.DataFrame:
        """One row per iterate: ``iteration``, ``residual``."""
        return pd.DataFrame({"iteration": range(len(self.residuals)), "residual": self.residuals})

    def to_dict(self) -> dict:
        keys = ("converged", "iterations", "rate", "reason", "method", "residuals")
        return {k: getattr(self, k) for k in keys} | {"residual": self.residual}


def fixed_point(
    step: Step,
    h0: torch.Tensor,
    *,
    x: torch.Tensor | None = None,
    tol: float = 1e-6,
    max_iter: int = 200,
    method: str = "picard",
    memory: int = 5,
    blowup: float = 1e8,
) -> FixedPoint:
    """Iterate ``h <- T(h)`` from ``h0`` until ``||T(h) - h|| / ||h|| <= tol``.

    ``method="picard"`` is the plain iteration (what the model itself does);
    ``"anderson"`` is Anderson acceleration (type II, ``memory`` past differences):
    ``h_{k+1} = T(h_k) - dG g`` with ``g = argmin ||f_k - dF g||``, ``f = T(h) - h``.
    ``T(h) = step(h)``, or ``step(h, x)`` when ``x`` is given.

    Never raises on the dynamics: NaN/inf from the step, a state growing past
    ``blowup * max(||h0||, 1)`` or ``max_iter`` updates without reaching ``tol`` give
    ``converged=False`` with the reason. A step that changes the state's shape or dtype
    raises ``ValueError``. Reference: DESIGN.md §4 (reachability).

    Example: ``fp = fixed_point(lambda h: 0.5 * h + 1, torch.zeros(3))`` reaches 2.
    """
    call = "fixed_point"
    T = _bind(step, x)
    h = _check_state(call, h0)
    _positive(call, "tol", tol)
    _count(call, "max_iter", max_iter, 0)
    _count(call, "memory", memory, 1)
    if method not in ("picard", "anderson"):
        raise ValueError(f"{call}: method={method!r} is unknown; use 'picard' or 'anderson'")
    limit = blowup * max(_norm(h), 1.0)
    residuals: list[float] = []
    dF: list[torch.Tensor] = []
    dG: list[torch.Tensor] = []
    prev: tuple[torch.Tensor, torch.Tensor] | None = None
    converged, reason = False, ""
    with torch.no_grad():
        for k in range(max_iter + 1):
            Th = _apply(call, T, h)
            if not bool(torch.isfinite(Th).all()):
                reason = f"the step returned NaN/inf at iteration {k}"
                break
            if _norm(Th) > limit:
                reason = (
                    f"diverged: ||T(h)|| = {_norm(Th):.3g} at iteration {k} (blowup={blowup:g})"
                )
                break
            f = Th - h
            residuals.append(_rel(f, h))
            if residuals[-1] <= tol:
                converged, reason = True, f"residual {residuals[-1]:.3g} <= tol {tol:g}"
                break
            if k == max_iter:
                rate = observed_rate(residuals)
                reason = (
                    f"max_iter={max_iter} reached with residual {residuals[-1]:.3g} > tol {tol:g} "
                    f"(observed rate {rate:.4g}"
                    + ("; not contracting)" if rate >= 1 else "; raise max_iter)")
                )
                break
            if method == "picard":
                h = Th
                continue
            if prev is not None:
                dF.append((f - prev[0]).reshape(-1))
                dG.append((Th - prev[1]).reshape(-1))
                del dF[:-memory], dG[:-memory]
            prev = (f, Th)
            h = _anderson_update(f, Th, dF, dG)
    return FixedPoint(h, converged, residuals, observed_rate(residuals), reason, method, k)


def _anderson_update(
    f: torch.Tensor, Th: torch.Tensor, dF: list[torch.Tensor], dG: list[torch.Tensor]
) -> torch.Tensor:
    if not dF:
        return Th
    F_ = torch.stack(dF, dim=1)  # (n, m)
    gamma = torch.linalg.pinv(F_, rtol=1e-10) @ f.reshape(-1)
    h = Th - (torch.stack(dG, dim=1) @ gamma).view_as(Th)
    if not bool(torch.isfinite(h).all()):  # a degenerate history: fall back to a plain step
        dF.clear(), dG.clear()
        return Th
    return h


def observed_rate(residuals: list[float], window: int = 10) -> float:
    """Geometric contraction rate of a residual trace: ``exp(slope)`` of ``log r_k`` vs ``k``.

    A least-squares line through the last ``window`` positive residuals (at least 3, else
    NaN). For a Picard iteration near an attracting fixed point this tends to the spectral
    radius of ``dT/dh`` there; a rate >= 1 means the trace is not contracting.
    """
    r = np.asarray(residuals[1:], dtype=float)[-window:]
    k = np.arange(len(r))[r > 0]
    r = r[r > 0]
    if len(r) < 3 or not np.all(np.isfinite(r)):
        return math.nan
    return float(np.exp(np.polyfit(k, np.log(r), 1)[0]))


@dataclass(frozen=True)
class RoundResiduals:
    """Result of :func:`round_residuals`: where the model's own R rounds leave the state."""

    h: torch.Tensor
    residuals: list[float]
    distances: list[float] | None

    @property
    def residual(self) -> float:
        """``||T(h_R) - h_R|| / ||h_R||`` after the model's R rounds."""
        return self.residuals[-1]

    @property
    def distance(self) -> float:
        """``||h_R - h*|| / ||h*||`` (NaN without ``h_star``)."""
        return self.distances[-1] if self.distances else math.nan

    def to_frame(self) -> pd.DataFrame:
        """One row per round r = 0..R: ``round``, ``residual``, ``distance``."""
        n = len(self.residuals)
        dist = self.distances if self.distances else [math.nan] * n
        return pd.DataFrame({"round": range(n), "residual": self.residuals, "distance": dist})


def round_residuals(
    step: Step,
    h0: torch.Tensor,
    rounds: int,
    *,
    x: torch.Tensor | None = None,
    h_star: torch.Tensor | None = None,
) -> RoundResiduals:
    """Residual ``||T(h_r) - h_r|| / ||h_r||`` after each of the model's ``rounds`` rounds.

    ``h_r = T^r(h0)`` for r = 0..R (R + 1 calls of T, the last one only to measure
    ``h_R``). With ``h_star`` (e.g. ``fixed_point(...).h``) also the distance
    ``||h_r - h*|| / ||h*||``. Reference: DESIGN.md §4 (reachability).
    """
    call = "round_residuals"
    T = _bind(step, x)
    h = _check_state(call, h0)
    _count(call, "rounds", rounds, 0)
    if h_star is not None and h_star.shape != h.shape:
        raise ValueError(
            f"round_residuals: h_star has shape {tuple(h_star.shape)} but the state has "
            f"{tuple(h.shape)}; pass the fixed point of this same map"
        )
    residuals, distances = [], []
    with torch.no_grad():
        for r in range(rounds + 1):
            Th = _apply(call, T, h)
            residuals.append(_rel(Th - h, h))
            if h_star is not None:
                distances.append(_rel(h - h_star, h_star))
            if r < rounds:
                h = Th
    return RoundResiduals(h, residuals, distances if h_star is not None else None)


# ----------------------------------------------------------------------------- geometry


class _NonFinite(ArithmeticError):
    pass


def _linearize(T: Map, h: torch.Tensor, trace: bool = True) -> tuple[torch.Tensor, Map]:
    """``T(h)`` and ``v -> dT/dh(h) v`` (see :class:`_JVP`)."""
    with _quiet():
        Th = T(h)
    return Th.detach(), _JVP(T, h, trace)


class _JVP:
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

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        if self.traced is not None:
            return self.traced(v)
        start = time.perf_counter()
        with _quiet():
            out = torch.func.jvp(self.T, (self.h,), (v,))[1]
        self.calls, self.seconds = self.calls + 1, self.seconds + time.perf_counter() - start
        if self.trace and self.calls == self.after_calls and self.seconds >= self.min_seconds:
            self.traced = self._try_trace(v, out.detach())
        return out

    def _try_trace(self, v: torch.Tensor, reference: torch.Tensor) -> Map | None:
        try:
            with _quiet():
                _, traced = torch.func.linearize(self.T, self.h)
                atol = 1e-6 * float(reference.abs().max().nan_to_num())
                if torch.allclose(traced(v), reference, rtol=1e-5, atol=atol, equal_nan=True):
                    return traced
        except Exception:  # noqa: BLE001 - any tracing failure means: keep plain JVPs
            pass
        return None


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence torch's own tracing noise (forward-AD setup, const folding), not the user's."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Attempted to insert a get_attr Node")
        warnings.filterwarnings("ignore", message=".*torch.jit.script. is deprecated")
        yield


def _numpy_op(fn: Map, shape: torch.Size, like: torch.Tensor, what: str, calls: list[int]):
    """Wrap a torch map on tensors of ``shape`` as a flat float64 numpy function."""

    def apply(v: np.ndarray) -> np.ndarray:
        calls[0] += 1
        t = torch.as_tensor(np.ascontiguousarray(v).reshape(-1), device=like.device)
        out = fn(t.to(like.dtype).view(shape)).detach()
        if not bool(torch.isfinite(out).all()):
            raise _NonFinite(f"the {what} returned NaN/inf")
        return out.reshape(-1).to(torch.float64).cpu().numpy()

    return apply


@dataclass(frozen=True)
class SpectralRadius:
    """Result of :func:`spectral_radius`: the top-k eigenvalues of ``J = dT/dh`` at ``h``.

    ``value = max |lambda|``; ``eigenvalues`` sorted by modulus (descending);
    ``residuals[i] = ||J v_i - lambda_i v_i|| / (|lambda_i| ||v_i||)``, checked afresh by
    JVPs; ``rel_change`` is their maximum (the :class:`~loopprobe.linalg.Estimate` field);
    ``iterations`` counts JVPs.
    """

    value: float
    eigenvalues: np.ndarray
    residuals: np.ndarray
    iterations: int
    converged: bool
    reason: str
    method: str = "arnoldi"
    rel_change: float = field(default=math.nan)

    def estimate(self) -> Estimate:
        return Estimate(self.value, self.iterations, self.converged, self.rel_change, self.method)

    def to_frame(self) -> pd.DataFrame:
        """One row per eigenvalue: ``rank``, ``real``, ``imag``, ``modulus``, ``residual``."""
        ev = self.eigenvalues
        return pd.DataFrame(
            {
                "rank": range(len(ev)),
                "real": ev.real,
                "imag": ev.imag,
                "modulus": np.abs(ev),
                "residual": self.residuals,
            }
        )

    def to_dict(self) -> dict:
        return {
            "value": self.value,
            "converged": self.converged,
            "reason": self.reason,
            "iterations": self.iterations,
            "method": self.method,
            "eigenvalues": [[float(e.real), float(e.imag)] for e in self.eigenvalues],
            "residuals": [float(r) for r in self.residuals],
        }


def spectral_radius(
    step: Step,
    h: torch.Tensor,
    *,
    x: torch.Tensor | None = None,
    k: int = 6,
    tol: float | None = None,
    max_iter: int | None = None,
    check_tol: float | None = None,
    generator: torch.Generator | None = None,
) -> SpectralRadius:
    """Spectral radius and top-``k`` eigenvalues of ``dT/dh`` at ``h``, by Arnoldi on JVPs.

    ``rho = max_i |lambda_i(dT/dh)|`` from ARPACK (``scipy.sparse.linalg.eigs``, which
    ``"LM"``) on a ``LinearOperator`` whose matvec is a JVP; never a dense Jacobian. At
    least 2 eigenvalues are computed so that a complex-conjugate top pair is caught whole.
    ``converged`` is True only if ARPACK converged *and* every returned pair passes the
    check ``||J v - lambda v|| <= check_tol |lambda| ||v||`` (defaults: float64 tol 1e-8,
    check 1e-6; float32 1e-5, 1e-3; ``max_iter`` 100 ARPACK restarts). ARPACK failures,
    NaN/inf JVPs and failed checks come back as ``converged=False`` with the reason, never
    as an exception; when ARPACK certifies no eigenvalue at all (clustered, nearly
    defective top eigenvalues, as in causal rounds whose Jacobian is block-triangular over
    tokens), ``value`` is the largest Ritz value of a 60-step Arnoldi run, uncertified.
    For a state with fewer than ``k + 2`` entries (too small for ARPACK) a full Arnoldi
    run is exact. Reference: DESIGN.md §4 (geometry).
    """
    call = "spectral_radius"
    T = _bind(step, x)
    h = _check_state(call, h)
    _count(call, "k", k, 1)
    f64 = h.dtype == torch.float64
    tol = (1e-8 if f64 else 1e-5) if tol is None else tol
    max_iter = 100 if max_iter is None else _count(call, "max_iter", max_iter, 1)
    check_tol = (1e-6 if f64 else 1e-3) if check_tol is None else check_tol
    gen = torch.Generator().manual_seed(0) if generator is None else generator
    n = h.numel()
    Th, jvp = _linearize(T, h)
    _check_same(call, h, Th)
    calls = [0]
    mv = _numpy_op(jvp, h.shape, h, "JVP of the step", calls)
    v0 = torch.randn(n, generator=gen, dtype=torch.float64).numpy()
    converged, reason, method = True, "", "arnoldi"
    try:
        if n < k + 2:
            method = "full-arnoldi"
            vals, vecs = _arnoldi(mv, v0, n)
        else:
            op = LinearOperator((n, n), matvec=mv, dtype=np.float64)
            vals, vecs = eigs(op, k=max(k, 2), which="LM", v0=v0, tol=tol, maxiter=max_iter)
    except ArpackNoConvergence as err:
        vals, vecs = err.eigenvalues, err.eigenvectors
        converged = False
        reason = f"ARPACK did not converge: {len(vals)} of {max(k, 2)} eigenvalues ({err})"
        if len(vals) == 0:
            try:
                vals, vecs = _arnoldi(mv, v0, min(n, 60))
            except _NonFinite as nonfinite:
                return _failed_radius(calls[0], f"{reason}; {nonfinite}")
            method = "arnoldi-ritz"
            reason += "; value is the largest Ritz value of a 60-step Arnoldi run, uncertified"
    except ArpackError as err:
        return _failed_radius(calls[0], f"ARPACK failed: {err}")
    except _NonFinite as err:
        return _failed_radius(calls[0], f"{err}; the state may be outside the step's domain")
    order = np.argsort(-np.abs(vals), kind="stable")[:k]
    vals, vecs = vals[order], vecs[:, order]
    try:
        res = np.array([_eig_residual(mv, lam, vecs[:, i]) for i, lam in enumerate(vals)])
    except _NonFinite as err:
        return _failed_radius(calls[0], f"{err} while checking the eigenpairs")
    if len(vals) == 0:
        return _failed_radius(calls[0], reason or "no eigenvalue returned")
    worst = float(res.max())
    if not worst <= check_tol and converged:
        converged = False
        reason = (
            f"eigenpair check failed: ||Jv - lambda v|| / |lambda| = {worst:.3g} > {check_tol:g}"
        )
    if converged:
        reason = f"all {len(vals)} eigenpairs pass ||Jv - lambda v|| <= {check_tol:g} |lambda|"
    value = float(np.abs(vals).max())
    return SpectralRadius(value, vals, res, calls[0], converged, reason, method, worst)


def _failed_radius(calls: int, reason: str) -> SpectralRadius:
    empty = np.zeros(0, dtype=complex)
    return SpectralRadius(math.nan, empty, np.zeros(0), calls, False, reason, "arnoldi")


def _eig_residual(mv, lam: complex, v: np.ndarray) -> float:
    """``||J v - lam v|| / (|lam| ||v||)`` for a complex v of the real operator J."""
    Jv = mv(v.real) + 1j * mv(v.imag) if np.iscomplexobj(v) else mv(v)
    scale = max(abs(lam), np.finfo(float).tiny) * np.linalg.norm(v)
    return float(np.linalg.norm(Jv - lam * v) / scale)


def _arnoldi(mv, v0: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Ritz pairs of a ``steps``-step Arnoldi run (exact when ``steps = n``, or on breakdown)."""
    n = len(v0)
    V = np.zeros((n, steps + 1))
    H = np.zeros((steps + 1, steps))
    V[:, 0] = v0 / np.linalg.norm(v0)
    m = steps
    for j in range(steps):
        w = mv(V[:, j])
        for _ in range(2):  # twice: re-orthogonalisation keeps the basis orthonormal
            c = V[:, : j + 1].T @ w
            w = w - V[:, : j + 1] @ c
            H[: j + 1, j] += c
        H[j + 1, j] = np.linalg.norm(w)
        if H[j + 1, j] <= 1e-14 * max(1.0, np.abs(H[: j + 1, j]).max()):
            m = j + 1  # invariant subspace found: the spectrum restricted to it is exact
            break
        V[:, j + 1] = w / H[j + 1, j]
    vals, y = np.linalg.eig(H[:m, :m])
    return vals, V[:, :m] @ y


def jacobian_norm(
    step: Step,
    h: torch.Tensor,
    *,
    x: torch.Tensor | None = None,
    max_iter: int = 200,
    tol: float = 1e-10,
    generator: torch.Generator | None = None,
) -> Estimate:
    """Operator norm ``||dT/dh||_2`` (top singular value) at ``h``, by power iteration.

    Power iteration on ``J^T J`` with ``J v`` a JVP and ``J^T u`` a VJP
    (:func:`loopprobe.linalg.operator_norm`); the estimate is a lower bound that rises
    to the norm. ``||J|| >= rho(J)``; the gap is the non-normality of the round.
    Reference: DESIGN.md §4 (geometry).
    """
    call = "jacobian_norm"
    T = _bind(step, x)
    h = _check_state(call, h)
    gen = torch.Generator().manual_seed(0) if generator is None else generator
    Th, jvp = _linearize(T, h)
    _check_same(call, h, Th)
    _, vjp = torch.func.vjp(T, h)
    v0 = torch.randn(1, h.numel(), generator=gen, dtype=torch.float64).to(h)
    return operator_norm(
        lambda v: jvp(v.view(h.shape)).detach().reshape(1, -1),
        lambda u: vjp(u.view(h.shape))[0].detach().reshape(1, -1),
        v0,
        max_iter=max_iter,
        tol=tol,
    )[0]


# --------------------------------------------------------------------- input-dependence


@dataclass(frozen=True)
class InputDependence:
    """Result of :func:`input_dependence`.

    ``implicit``: ``||dh*/dx||_2`` with ``dh*/dx = (I - dT/dh)^{-1} dT/dx`` at the fixed
    point; ``unrolled``: ``||dh_R/dx||_2`` of the R unrolled rounds (None without
    ``rounds``); ``gap = |implicit - unrolled| / max(implicit, unrolled)``.
    ``directions``: per given direction u, ``||dh*/dx u|| / ||u||``, the same for the
    unrolled map, and their gap ``||(dh*/dx - dh_R/dx) u|| / max(both norms)``.
    ``tangents`` holds ``dh*/dx u`` for each direction, shape ``(m, *h.shape)``.
    ``solves`` counts GMRES solves and ``solver_failures`` those that missed ``tol``.
    """

    implicit: Estimate
    unrolled: Estimate | None
    gap: float
    directions: pd.DataFrame
    tangents: torch.Tensor
    solves: int
    solver_failures: int
    converged: bool
    reason: str

    @property
    def value(self) -> float:
        return self.implicit.value

    def to_frame(self) -> pd.DataFrame:
        """One row per probe (``operator`` and each direction): implicit, unrolled, gap."""
        unrolled = self.unrolled.value if self.unrolled is not None else math.nan
        head = pd.DataFrame(
            {
                "probe": ["operator"],
                "implicit": [self.value],
                "unrolled": [unrolled],
                "gap": [self.gap],
            }
        )
        return pd.concat([head, self.directions], ignore_index=True)

    def to_dict(self) -> dict:
        unrolled = self.unrolled.value if self.unrolled is not None else math.nan
        return {
            "implicit": self.value,
            "unrolled": unrolled,
            "gap": self.gap,
            "converged": self.converged,
            "reason": self.reason,
            "solves": self.solves,
        }


def input_dependence(
    step: Step,
    h_star: torch.Tensor,
    x: torch.Tensor,
    *,
    rounds: int | None = None,
    h0: torch.Tensor | Callable[[torch.Tensor], torch.Tensor] | None = None,
    directions: torch.Tensor | None = None,
    tol: float = 1e-10,
    max_iter: int = 100,
    norm_tol: float = 1e-8,
    solve_max_iter: int = 1000,
    implicit: bool = True,
    generator: torch.Generator | None = None,
) -> InputDependence:
    """``||dh*/dx||`` by implicit differentiation, next to the unrolled ``||dh_R/dx||``.

    At a fixed point ``h* = T(h*, x)``, ``dh*/dx u = v`` solves ``(I - J_h) v = J_x u``
    (``J_h = dT/dh``, ``J_x = dT/dx``); GMRES on JVPs solves it to relative ``tol``. The
    operator norm comes from power iteration on ``S^T S`` (:func:`loopprobe.linalg.operator_norm`
    to ``norm_tol``, ``max_iter`` steps), where ``S^T w = J_x^T (I - J_h^T)^{-1} w`` is a
    GMRES solve on VJPs. With ``rounds = R`` the unrolled map ``x -> T^R(h0(x), x)`` is
    differentiated too (JVP/VJP through the R rounds); ``h0`` is None (start at ``x``, as
    the reference models do), a tensor held fixed, or a callable of ``x``. ``directions``
    has shape ``(m, *x.shape)`` (or ``x.shape``). Without recall ``J_x = 0``, so
    ``dh*/dx = 0`` whatever the unrolled rounds do. A GMRES solve that misses ``tol``
    within ``solve_max_iter`` JVPs (VJPs), or NaN/inf, makes the implicit value NaN with
    ``converged=False`` and the reason (the unrolled one is still computed);
    ``implicit=False`` skips it (e.g. where no fixed point was reached).
    Reference: DESIGN.md §4 (input-dependence).
    """
    call = "input_dependence"
    if not callable(step):
        raise TypeError(f"{call}: step must be a callable (h, x) -> T(h; x), got {step!r}")
    h_star = _check_state(call, h_star)
    x = _check_state(call, x)
    _count(call, "solve_max_iter", solve_max_iter, 1)
    dirs = _directions(call, directions, x)
    start = _start(call, h0, h_star, x, rounds)
    gen = torch.Generator().manual_seed(0) if generator is None else generator
    Th, jvp_h = _linearize(lambda h: step(h, x), h_star)
    _check_same(call, h_star, Th)
    _, jvp_x = _linearize(lambda u: step(h_star, u), x)
    _, vjp_hx = torch.func.vjp(step, h_star, x)
    calls, stats = [0], {"solves": 0, "failures": 0}
    n = h_star.numel()
    A = LinearOperator(
        (n, n),
        _numpy_op(lambda v: v - jvp_h(v), h_star.shape, h_star, "JVP of the step", calls),
        dtype=np.float64,
    )
    At = LinearOperator(
        (n, n),
        _numpy_op(lambda w: w - vjp_hx(w)[0], h_star.shape, h_star, "VJP of the step", calls),
        dtype=np.float64,
    )

    restart = min(n, 50)
    cycles = max(1, -(-solve_max_iter // restart))

    def solve(op: LinearOperator, b: torch.Tensor) -> torch.Tensor:
        rhs = b.detach().reshape(-1).to(torch.float64).cpu().numpy()
        sol, info = gmres(op, rhs, rtol=tol, atol=0.0, restart=restart, maxiter=cycles)
        stats["solves"] += 1
        if info != 0:
            stats["failures"] += 1
            raise _SolveFailed(
                f"GMRES missed rtol {tol:g} within {restart * cycles} JVPs/VJPs (is 1 close to "
                "an eigenvalue of dT/dh, or h not a fixed point? check fixed_point and "
                "spectral_radius)"
            )
        return torch.as_tensor(sol).to(h_star).view(h_star.shape)

    def S(u: torch.Tensor) -> torch.Tensor:  # dh*/dx u
        return solve(A, jvp_x(u.view(x.shape)).detach())

    def St(w: torch.Tensor) -> torch.Tensor:  # (dh*/dx)^T w
        return vjp_hx(solve(At, w.view(h_star.shape)))[1].detach()

    v0 = torch.randn(1, x.numel(), generator=gen, dtype=torch.float64).to(x)
    reasons = []
    try:
        if not implicit:
            raise _SolveFailed("not computed (implicit=False)")
        implicit_norm = _norm_of(S, St, v0, max_iter, norm_tol)
        dir_implicit = [S(u) for u in dirs]
    except (_NonFinite, _SolveFailed) as err:
        implicit_norm = Estimate(math.nan, 0, False, math.nan, "power")
        dir_implicit = [torch.full_like(h_star, math.nan) for _ in dirs]
        reasons.append(f"implicit: {err}")
    unrolled, dir_unrolled = None, [None] * len(dirs)
    if rounds is not None:
        try:
            U, Ut = _unrolled(step, start, x, rounds)
            unrolled = _norm_of(U, Ut, v0, max_iter, norm_tol)
            dir_unrolled = [U(u) for u in dirs]
        except _NonFinite as err:
            unrolled = Estimate(math.nan, 0, False, math.nan, "power")
            reasons.append(f"unrolled: {err}")
    for name, est in (("implicit", implicit_norm), ("unrolled", unrolled)):
        if est is not None and not est.converged and not math.isnan(est.value):
            reasons.append(f"{name} norm: power iteration stopped at rel. change "
                           f"{est.rel_change:.3g} > norm_tol {norm_tol:g}")  # fmt: skip
    converged = not reasons
    reason = "; ".join(reasons) or "all solves and norm iterations converged"
    gap = math.nan if unrolled is None else _gap(implicit_norm.value, unrolled.value)
    frame = _dir_frame(dirs, dir_implicit, dir_unrolled)
    empty = h_star.new_zeros((0, *h_star.shape))
    tangents = torch.stack(dir_implicit) if dir_implicit else empty
    failures = stats["failures"]
    return InputDependence(
        implicit_norm, unrolled, gap, frame, tangents, stats["solves"], failures, converged, reason
    )


class _SolveFailed(ArithmeticError):
    pass


def _directions(call: str, directions: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    if directions is None:
        return x.new_zeros((0, *x.shape))
    d = directions.detach().to(x)
    if d.shape == x.shape:
        d = d.unsqueeze(0)
    if d.shape[1:] != x.shape:
        raise ValueError(
            f"{call}: directions have shape {tuple(directions.shape)}; give (m, *x.shape) = "
            f"(m, {', '.join(map(str, x.shape))}) or x.shape"
        )
    if bool((d.flatten(1).norm(dim=1) == 0).any()):
        raise ValueError(f"{call}: a direction is all zeros; directions must be nonzero")
    return d


def _start(call, h0, h_star, x, rounds) -> Callable[[torch.Tensor], torch.Tensor]:
    if rounds is not None:
        _count(call, "rounds", rounds, 1)
    if callable(h0):
        return h0
    if h0 is None:
        if rounds is not None and x.shape != h_star.shape:
            raise ValueError(
                f"{call}: h0=None starts the rounds at x, but x has shape {tuple(x.shape)} and "
                f"the state {tuple(h_star.shape)}; pass h0= (a tensor or a function of x)"
            )
        return lambda u: u
    fixed = h0.detach()
    return lambda u: fixed


def _unrolled(step: Step, start, x: torch.Tensor, rounds: int):
    """``u -> d h_R/dx u`` and its transpose for ``h_R = T^R(h0(x), x)``."""

    def f(u: torch.Tensor) -> torch.Tensor:
        h = start(u)
        for _ in range(rounds):
            h = step(h, u)
        return h

    hR, jvp = _linearize(f, x, trace=False)  # few calls: tracing R rounds does not pay
    _, vjp = torch.func.vjp(f, x)
    return (lambda u: jvp(u.view(x.shape)).detach()), (lambda w: vjp(w.view(hR.shape))[0].detach())


def _norm_of(S, St, v0: torch.Tensor, max_iter: int, tol: float) -> Estimate:
    def guard(t: torch.Tensor, what: str) -> torch.Tensor:
        if not bool(torch.isfinite(t).all()):
            raise _NonFinite(f"the {what} returned NaN/inf")
        return t.detach().reshape(1, -1)

    return operator_norm(
        lambda v: guard(S(v[0]), "derivative dh/dx"),
        lambda w: guard(St(w[0]), "transposed derivative"),
        v0,
        max_iter=max_iter,
        tol=tol,
    )[0]


def _gap(a: float, b: float) -> float:
    top = max(abs(a), abs(b))
    return abs(a - b) / top if top > 0 else 0.0


def _dir_frame(dirs, implicit, unrolled) -> pd.DataFrame:
    rows = []
    for i, (u, a, b) in enumerate(zip(dirs, implicit, unrolled, strict=True)):
        nu = _norm(u)
        na = _norm(a) / nu
        nb = math.nan if b is None else _norm(b) / nu
        if b is None:
            gap = math.nan
        else:
            gap = _norm(a - b) / nu / max(na, nb) if max(na, nb) > 0 else 0.0
        rows.append({"probe": f"direction {i}", "implicit": na, "unrolled": nb, "gap": gap})
    return pd.DataFrame(rows, columns=["probe", "implicit", "unrolled", "gap"])
