"""Fixed points of one round T(h; x): reachability, geometry, input-dependence.

A looped model applies the same round map ``T`` again and again. Whether that iteration
means anything is a fixed-point question along three axes (docs/definitions.md §4; seed 000/003,
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

The round map and its JVP plumbing are :mod:`loopprobe.differentiate.roundmap`;
input-dependence is :mod:`loopprobe.estimate.implicit`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from loopprobe._checks import count as _count
from loopprobe._html import HTMLView
from loopprobe.autodiff import transform_safe
from loopprobe.differentiate.roundmap import (
    NonFinite,
    Step,
    apply_map,
    bind,
    check_positive,
    check_same,
    check_state,
    linearize,
    numpy_op,
    rel,
    state_norm,
)
from loopprobe.estimate.eigenpairs import DENSE_N, checked_pairs, dense_eig
from loopprobe.linalg import Estimate, arnoldi_ritz, eig_residual, operator_norm

# ------------------------------------------------------------------------- reachability


@dataclass(frozen=True)
class FixedPoint(HTMLView):
    """Result of :func:`fixed_point`.

    ``residuals[k] = ||T(h_k) - h_k|| / ||h_k||`` for the iterates ``h_0 .. h_K``;
    ``h`` is the last iterate with a finite residual (``h_K``); ``rate`` is the observed
    contraction rate (:func:`observed_rate`); ``reason`` says why the iteration stopped.
    """

    _html_keys = ("residual", "rate", "iterations", "method")

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


@transform_safe()
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
    raises ``ValueError``. Reference: docs/definitions.md §4 (reachability).

    Example: ``fp = fixed_point(lambda h: 0.5 * h + 1, torch.zeros(3))`` reaches 2.
    """
    call = "fixed_point"
    T = bind(step, x)
    h = check_state(call, h0)
    check_positive(call, "tol", tol)
    _count(call, "max_iter", max_iter, 0)
    _count(call, "memory", memory, 1)
    if method not in ("picard", "anderson"):
        raise ValueError(f"{call}: method={method!r} is unknown; use 'picard' or 'anderson'")
    limit = blowup * max(state_norm(h), 1.0)
    residuals: list[float] = []
    dF: list[torch.Tensor] = []
    dG: list[torch.Tensor] = []
    prev: tuple[torch.Tensor, torch.Tensor] | None = None
    converged, reason = False, ""
    with torch.no_grad():
        for k in range(max_iter + 1):
            Th = apply_map(call, T, h)
            if not bool(torch.isfinite(Th).all()):
                reason = f"the step returned NaN/inf at iteration {k}"
                break
            if state_norm(Th) > limit:
                size = state_norm(Th)
                reason = f"diverged: ||T(h)|| = {size:.3g} at iteration {k} (blowup={blowup:g})"
                break
            f = Th - h
            residuals.append(rel(f, h))
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
class RoundResiduals(HTMLView):
    """Result of :func:`round_residuals`: where the model's own R rounds leave the state."""

    _html_keys = ("residual", "distance")

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
    ``||h_r - h*|| / ||h*||``. Reference: docs/definitions.md §4 (reachability).
    """
    call = "round_residuals"
    T = bind(step, x)
    h = check_state(call, h0)
    _count(call, "rounds", rounds, 0)
    if h_star is not None and h_star.shape != h.shape:
        raise ValueError(
            f"round_residuals: h_star has shape {tuple(h_star.shape)} but the state has "
            f"{tuple(h.shape)}; pass the fixed point of this same map"
        )
    residuals, distances = [], []
    with torch.no_grad():
        for r in range(rounds + 1):
            Th = apply_map(call, T, h)
            residuals.append(rel(Th - h, h))
            if h_star is not None:
                distances.append(rel(h - h_star, h_star))
            if r < rounds:
                h = Th
    return RoundResiduals(h, residuals, distances if h_star is not None else None)


# ----------------------------------------------------------------------------- geometry


@dataclass(frozen=True)
class SpectralRadius(HTMLView):
    """Result of :func:`spectral_radius`: the top-k eigenvalues of ``J = dT/dh`` at ``h``.

    ``value = max |lambda|``; ``eigenvalues`` sorted by modulus (descending);
    ``residuals[i] = ||J v_i - lambda_i v_i|| / (|lambda_i| ||v_i||)``, checked afresh by
    JVPs; ``rel_change`` is their maximum (the :class:`~loopprobe.linalg.Estimate` field);
    ``iterations`` counts JVPs.
    """

    _html_keys = ("value", "iterations", "method")

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


@transform_safe()
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
    method: str = "auto",
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
    run is exact. ``method``: ``"arnoldi"`` (above), ``"dense"`` (the one exception to
    "never a dense Jacobian": ``J`` from ``n`` VJPs of one forward batched with
    ``torch.vmap``, its top pairs by ARPACK on that matrix (free matvecs), or all its
    eigenvalues by ``numpy.linalg.eig`` below ``DENSE_ARPACK_N`` entries or where ARPACK
    does not converge; the top ``k`` pairs are checked as above by fresh JVPs, in one
    batch), or ``"auto"`` (the default): dense for a state of at most ``DENSE_N`` (1024)
    entries, where it is faster, else Arnoldi
    (benchmarks/bench_spectral_radius.py --sizes). The result's ``method`` says which ran.
    Reference: docs/definitions.md §4 (geometry).
    """
    from scipy.sparse.linalg import ArpackError, ArpackNoConvergence, LinearOperator, eigs

    call = "spectral_radius"
    T = bind(step, x)
    h = check_state(call, h)
    _count(call, "k", k, 1)
    f64 = h.dtype == torch.float64
    tol = (1e-8 if f64 else 1e-5) if tol is None else tol
    max_iter = 100 if max_iter is None else _count(call, "max_iter", max_iter, 1)
    check_tol = (1e-6 if f64 else 1e-3) if check_tol is None else check_tol
    gen = torch.Generator().manual_seed(0) if generator is None else generator
    n = h.numel()
    if method not in ("auto", "arnoldi", "dense"):
        raise ValueError(f"{call}: method={method!r}; choose 'auto', 'arnoldi' or 'dense'")
    if method == "auto":
        method = "dense" if n <= DENSE_N else "arnoldi"
    Th, jvp = linearize(T, h, trace=method != "dense")
    check_same(call, h, Th)
    calls = [0]
    mv = numpy_op(jvp, h.shape, h, "JVP of the step", calls)
    v0 = torch.randn(n, generator=gen, dtype=torch.float64, device=gen.device).cpu().numpy()
    converged, reason = True, ""
    try:
        if method == "dense":
            vals, vecs = dense_eig(T, h, calls, max(k, 2), v0, tol, max_iter)
        elif n < k + 2:
            method = "full-arnoldi"
            vals, vecs = arnoldi_ritz(mv, v0, n)
        else:
            op = LinearOperator((n, n), matvec=mv, dtype=np.float64)
            vals, vecs = eigs(op, k=max(k, 2), which="LM", v0=v0, tol=tol, maxiter=max_iter)
    except ArpackNoConvergence as err:
        vals, vecs = err.eigenvalues, err.eigenvectors
        converged = False
        reason = f"ARPACK did not converge: {len(vals)} of {max(k, 2)} eigenvalues ({err})"
        if len(vals) == 0:
            try:
                vals, vecs = arnoldi_ritz(mv, v0, min(n, 60))
            except NonFinite as nonfinite:
                return _failed_radius(calls[0], f"{reason}; {nonfinite}")
            method = "arnoldi-ritz"
            reason += "; value is the largest Ritz value of a 60-step Arnoldi run, uncertified"
    except ArpackError as err:
        return _failed_radius(calls[0], f"ARPACK failed: {err}")
    except NonFinite as err:
        return _failed_radius(calls[0], f"{err}; the state may be outside the step's domain")
    order = np.argsort(-np.abs(vals), kind="stable")[:k]
    vals, vecs = vals[order], vecs[:, order]
    try:
        if method == "dense":
            res = checked_pairs(jvp, h, vals, vecs, calls)
        else:
            res = np.array([eig_residual(mv, lam, vecs[:, i]) for i, lam in enumerate(vals)])
    except NonFinite as err:
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


@transform_safe()
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
    Reference: docs/definitions.md §4 (geometry).
    """
    call = "jacobian_norm"
    T = bind(step, x)
    h = check_state(call, h)
    gen = torch.Generator().manual_seed(0) if generator is None else generator
    Th, jvp = linearize(T, h)
    check_same(call, h, Th)
    _, vjp = torch.func.vjp(T, h)
    v0 = torch.randn(1, h.numel(), generator=gen, dtype=torch.float64, device=gen.device).to(h)
    return operator_norm(
        lambda v: jvp(v.view(h.shape)).detach().reshape(1, -1),
        lambda u: vjp(u.view(h.shape))[0].detach().reshape(1, -1),
        v0,
        max_iter=max_iter,
        tol=tol,
    )[0]
