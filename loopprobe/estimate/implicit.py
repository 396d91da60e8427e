"""Input-dependence of a fixed point: ``||dh*/dx||`` by implicit differentiation.

At ``h* = T(h*, x)``, ``dh*/dx = (I - dT/dh)^{-1} dT/dx``; :func:`input_dependence` gets
its operator norm from GMRES solves on JVPs/VJPs, next to the derivative of the unrolled
R rounds. Reached states come from :func:`loopprobe.estimate.fixedpoint.fixed_point`; the round
map and JVP plumbing from :mod:`loopprobe.differentiate.roundmap`.
Reference: docs/definitions.md §4.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from loopprobe._checks import count as _count
from loopprobe._html import HTMLView
from loopprobe.autodiff import transform_safe
from loopprobe.differentiate.roundmap import (
    NonFinite,
    Step,
    check_same,
    check_state,
    linearize,
    numpy_op,
    state_norm,
)
from loopprobe.linalg import Estimate, operator_norm


@dataclass(frozen=True)
class InputDependence(HTMLView):
    """Result of :func:`input_dependence`.

    ``implicit``: ``||dh*/dx||_2`` with ``dh*/dx = (I - dT/dh)^{-1} dT/dx`` at the fixed
    point; ``unrolled``: ``||dh_R/dx||_2`` of the R unrolled rounds (None without
    ``rounds``); ``gap = |implicit - unrolled| / max(implicit, unrolled)``.
    ``directions``: per given direction u, ``||dh*/dx u|| / ||u||``, the same for the
    unrolled map, and their gap ``||(dh*/dx - dh_R/dx) u|| / max(both norms)``.
    ``tangents`` holds ``dh*/dx u`` for each direction, shape ``(m, *h.shape)``.
    ``solves`` counts GMRES solves and ``solver_failures`` those that missed ``tol``.
    """

    _html_keys = ("value", "gap", "solves")

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


@transform_safe()
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
    fixed_point_tol: float = 1e-6,
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
    ``implicit=False`` skips it (e.g. where no fixed point was reached). ``h_star`` must be
    a fixed point: a residual ``||T(h) - h|| / max(||h||, ||T(h)||)`` above
    ``fixed_point_tol`` makes the result ``converged=False`` with the residual in ``reason``
    (the implicit formula describes no point then).
    Reference: docs/definitions.md §4 (input-dependence).
    """
    from scipy.sparse.linalg import LinearOperator, gmres  # on call: import stays light

    call = "input_dependence"
    if not callable(step):
        raise TypeError(f"{call}: step must be a callable (h, x) -> T(h; x), got {step!r}")
    h_star = check_state(call, h_star)
    x = check_state(call, x)
    _count(call, "solve_max_iter", solve_max_iter, 1)
    dirs = _directions(call, directions, x)
    start = _start(call, h0, h_star, x, rounds)
    gen = torch.Generator().manual_seed(0) if generator is None else generator
    Th, jvp_h = linearize(lambda h: step(h, x), h_star)
    check_same(call, h_star, Th)
    scale = torch.maximum(h_star.norm(), Th.norm()).clamp_min(torch.finfo(Th.dtype).tiny)
    residual = float((Th - h_star).norm() / scale)
    _, jvp_x = linearize(lambda u: step(h_star, u), x)
    _, vjp_hx = torch.func.vjp(step, h_star, x)
    calls, stats = [0], {"solves": 0, "failures": 0}
    n = h_star.numel()
    A = LinearOperator(
        (n, n),
        numpy_op(lambda v: v - jvp_h(v), h_star.shape, h_star, "JVP of the step", calls),
        dtype=np.float64,
    )
    At = LinearOperator(
        (n, n),
        numpy_op(lambda w: w - vjp_hx(w)[0], h_star.shape, h_star, "VJP of the step", calls),
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

    v0 = torch.randn(1, x.numel(), generator=gen, dtype=torch.float64, device=gen.device).to(x)
    reasons = []
    if not residual <= fixed_point_tol:
        reasons.append(
            f"h is not a fixed point: ||T(h) - h|| / ||h|| = {residual:.3g} > fixed_point_tol "
            f"{fixed_point_tol:g} (run fixed_point first and pass its state)"
        )
    try:
        if not implicit:
            raise _SolveFailed("not computed (implicit=False)")
        implicit_norm = _norm_of(S, St, v0, max_iter, norm_tol)
        dir_implicit = [S(u) for u in dirs]
    except (NonFinite, _SolveFailed) as err:
        implicit_norm = Estimate(math.nan, 0, False, math.nan, "power")
        dir_implicit = [torch.full_like(h_star, math.nan) for _ in dirs]
        reasons.append(f"implicit: {err}")
    unrolled, dir_unrolled = None, [None] * len(dirs)
    if rounds is not None:
        try:
            U, Ut = _unrolled(step, start, x, rounds)
            unrolled = _norm_of(U, Ut, v0, max_iter, norm_tol)
            dir_unrolled = [U(u) for u in dirs]
        except NonFinite as err:
            unrolled = Estimate(math.nan, 0, False, math.nan, "power")
            reasons.append(f"unrolled: {err}")
    for name, est in (("implicit", implicit_norm), ("unrolled", unrolled)):
        if est is not None and not est.converged and not math.isnan(est.value):
            reasons.append(f"{name} norm: power iteration stopped at rel. change "
                           f"{est.rel_change:.3g} > norm_tol {norm_tol:g}")  # fmt: skip
    converged = not reasons
    reason = "; ".join(reasons)
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

    hR, jvp = linearize(f, x, trace=False)  # few calls: tracing R rounds does not pay
    _, vjp = torch.func.vjp(f, x)
    return (lambda u: jvp(u.view(x.shape)).detach()), (lambda w: vjp(w.view(hR.shape))[0].detach())


def _norm_of(S, St, v0: torch.Tensor, max_iter: int, tol: float) -> Estimate:
    def guard(t: torch.Tensor, what: str) -> torch.Tensor:
        if not bool(torch.isfinite(t).all()):
            raise NonFinite(f"the {what} returned NaN/inf")
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
        nu = state_norm(u)
        na = state_norm(a) / nu
        nb = math.nan if b is None else state_norm(b) / nu
        if b is None:
            gap = math.nan
        else:
            gap = state_norm(a - b) / nu / max(na, nb) if max(na, nb) > 0 else 0.0
        rows.append({"probe": f"direction {i}", "implicit": na, "unrolled": nb, "gap": gap})
    return pd.DataFrame(rows, columns=["probe", "implicit", "unrolled", "gap"])
