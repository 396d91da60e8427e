"""kappa's certified interval, its default tolerance, and the stopping rule that meets it.

The interval (:func:`kappa_interval`) comes from intervals holding every norm in
``kappa_j`` (:func:`loopprobe.linalg.norm_bounds`); the stopping rule (:class:`KappaStop`)
runs each Lanczos operator of :func:`~loopprobe.estimate.sensitivity.sensitivity_norms`
only until that interval is within ``tol``. ``tol`` means one thing wherever it is taken:
the bound on kappa's absolute error, by default :func:`default_kappa_tol` of the precision
the operators are computed in. Reference: seed 002, Eq. 12.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from loopprobe.estimate.sensitivity_runs import RunContext, rounding_slack
from loopprobe.estimate.updates import Updates
from loopprobe.linalg import ROUNDOFF_EPS, norm_bounds

Interval = tuple[float, float]


def default_kappa_tol(dtype: torch.dtype) -> float:
    """The default bound on kappa's error (absolute), from the precision the operators are
    computed in (the coarsest dtype any arithmetic on the path rounds in,
    :func:`loopprobe.precision.dtypes_on_path`): 1e-6 in float64, 1e-3 in float32, 1e-2 in
    half precision (never certified). In float32 the roundoff allowance of 100 eps on each
    norm alone puts kappa's bound near 5e-5 kappa, so a 1e-4 default would refuse a
    well-converged float32 kappa."""
    if dtype in (torch.float16, torch.bfloat16):
        return 1e-2
    return 1e-6 if dtype == torch.float64 else 1e-3


def kappa_interval(
    U_tied: Interval,
    U_visits: Sequence[Interval],
    G_tied: float,
    G_norms: Sequence[float],
    eps: float,
) -> Interval:
    """An interval holding the exact ``kappa_j``, from intervals ``(lo, hi)`` holding
    ``||sum_r U_{r,j}||`` and each ``||U_{r,j}||`` (:func:`loopprobe.linalg.norm_bounds`).

    kappa_j grows with the tied norm and falls with the largest visit norm, so the upper
    end takes the tied norm's upper end over the largest *lower* end of the visits and the
    lower end the reverse; G norms are exact up to roundoff (``ROUNDOFF_EPS * eps``). The
    triangle inequality bounds the tied norm by the visits' too, ``||sum_r U_{r,j}|| <=
    sum_r ||U_{r,j}|| <= sum_r hi_r``, and the smaller of the two upper ends is used: when
    the visits are aligned (kappa_j near R_j) that end is tight, and the tied operator needs
    only a lower end, which any Rayleigh quotient gives. The interval is clipped to
    ``[0, R_j]``. With one visit kappa_j = 1 whatever its norm. Reference: seed 002, Eq. 12.
    """
    R = len(U_visits)
    rho = ROUNDOFF_EPS * eps
    if R == 1:
        return 1 - rho, 1 + rho
    g = G_tied / max(G_norms) if max(G_norms) > 0 else float("nan")
    lo_max, hi_max = max(lo for lo, _ in U_visits), max(hi for _, hi in U_visits)
    top = tied_top(U_tied, U_visits, eps)
    lo = U_tied[0] * g * (1 - rho) ** 2 / (R * hi_max) if hi_max > 0 else 0.0
    hi = top * g * (1 + rho) ** 2 / (R * lo_max) if lo_max > 0 else float("inf")
    return max(lo, 0.0), min(hi, R * (1 + rho))


def tied_top(U_tied: Interval, U_visits: Sequence[Interval], eps: float) -> float:
    """The tied norm's upper end: the smaller of its own and ``sum_r hi_r``, unless the two
    contradict each other (:func:`visits_contradict`): then its own only."""
    own, total = U_tied[1], sum(hi for _, hi in U_visits)
    return own if visits_contradict(U_tied, U_visits, eps) else min(own, total)


def visits_contradict(U_tied: Interval, U_visits: Sequence[Interval], eps: float) -> bool:
    """The tied norm's lower end (a Rayleigh quotient: always a lower bound) exceeds the sum
    of the visits' upper ends: then a visit's Krylov run settled on a singular value below
    its top one (the caveat of :func:`loopprobe.linalg.norm_bounds`), and the visits' upper
    ends cannot all be trusted. Seen on a float32 LoopedGPT, d 32, R 8, with warm-started
    visits: the tied lower end 7.982 against 7.977 from the visits. Since
    :func:`~loopprobe.estimate.sensitivity_runs.repair_tops` restarts such visits from the
    tied operator's top vector, it fires only where that restart failed too."""
    return U_tied[0] > sum(hi for _, hi in U_visits) * (1 + rounding_slack(eps))


#: The stopping rule spends this share of ``tol``: kappa's estimate still moves while the
#: last operators run, and the interval is recomputed at the end from the final estimates.
STOP_SHARE = 0.5


def residual_floor(dtype: torch.dtype) -> float:
    """Below this relative residual roundoff moves nothing (1e-12 in float64, else 1e-5): an
    operator stops there even when ``tol`` is out of reach (float32 at tol=1e-6 ran every
    operator to max_iter); the report then says so."""
    return 1e-12 if dtype == torch.float64 else 1e-5


@dataclass
class KappaStop:
    """The stopping rule of :func:`~loopprobe.estimate.alignment.visit_alignment` over the
    operators of :func:`~loopprobe.estimate.sensitivity.sensitivity_norms` (``keys`` in its
    order, ``visits`` the visit of each visit operator), passed as its ``stop=``.

    kappa_j's estimate is off from the top of its interval by ``kappa_up (1 - a_t / top)``,
    where ``a_t`` is the tied norm's estimate and ``top`` the smaller of its own upper end
    and ``sum_r hi_r`` (:func:`kappa_interval`), and from the bottom by at most
    ``kappa_up (1 - lo_max / hi_r)`` for the visit r with the largest upper end, where
    ``kappa_up`` is the current upper end of kappa_j (or R_j) and ``lo_max`` the largest
    lower end of the visit norms (only grows). So the tied operator stops once its term is
    within ``STOP_SHARE * tol``, and a visit once its own term is; under ``warm_visits``
    (the tied operator then starts from its visits' top vectors, and ``sum_r hi_r`` is worth
    making tight) also its width ``hi_r - lo_r`` must be within ``STOP_SHARE * tol * lo_max
    / (2 kappa_up)``. Every visit runs at least until its interval is finite (residual
    ``TRUST_RESIDUAL``), and no operator beyond :func:`residual_floor`. ``each_visit``:
    every visit norm also to relative error ``tol``.

    :meth:`bind` is called by ``sensitivity_norms`` once it knows how it runs
    (:class:`~loopprobe.estimate.sensitivity_runs.RunContext`): the precision the operators
    are computed in sets ``eps`` and, when ``tol`` is None, the default
    :func:`default_kappa_tol`; ``tol`` holds the bound used from then on.
    """

    keys: list[tuple[str, int]]
    visits: list[Any]
    ups: Updates
    tol: float | None = None
    each_visit: bool = False
    eps: float = float(torch.finfo(torch.float64).eps)
    dtype: torch.dtype = torch.float64
    warm_visits: bool = True
    _tied_of: dict[int, int] = field(default_factory=dict, repr=False)
    _mine: dict[int, list[int]] = field(default_factory=dict, repr=False)
    _G: dict[int, tuple[float, list[float]]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._tied_of = {key[1]: b for b, key in enumerate(self.keys) if key[0] == "tied"}
        for b, key in enumerate(self.keys):
            if key[0] == "visit":
                self._mine.setdefault(self.visits[b].j, []).append(b)
        for j, ops in self._mine.items():
            G_visits = [float(self.ups.norms(j)[self.visits[b].r]) for b in ops]
            self._G[j] = (float(self.ups.tied(j).norm()), G_visits)

    def bind(self, run: RunContext) -> KappaStop:
        """Take the precision and the warm start of the run; resolve the default ``tol``."""
        self.eps, self.dtype, self.warm_visits = run.eps, run.dtype, run.warm_visits
        if self.tol is None:
            self.tol = default_kappa_tol(run.dtype)
        return self

    def __call__(self, ops: torch.Tensor, sigma: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
        tol = default_kappa_tol(self.dtype) if self.tol is None else self.tol
        bounds = [
            norm_bounds(float(s), float(r), self.eps) for s, r in zip(sigma, res, strict=True)
        ]
        may = torch.zeros(len(sigma), dtype=torch.bool)
        for j, visit_ops in self._mine.items():
            if len(visit_ops) == 1:  # kappa_j = 1; the norm only to a finite interval
                may[visit_ops[0]] = bounds[visit_ops[0]][1] < float("inf")
            else:
                self._sublayer(j, visit_ops, sigma, bounds, may, STOP_SHARE * tol)
            if self.each_visit:
                for b in visit_ops:
                    value, hi = float(sigma[b]), bounds[b][1]
                    may[b] &= bool(not math.isnan(value) and hi <= value * (1 + tol))
        return may[ops] | (res[ops] <= residual_floor(self.dtype))

    def _sublayer(self, j: int, visit_ops: list[int], sigma, bounds, may, budget: float) -> None:
        """Which operators of sublayer j (its visits and its tied sum) may stop."""
        t = self._tied_of[j]
        visit_bounds = [bounds[b] for b in visit_ops]
        tied_bounds = bounds[t]
        _, kappa_hi = kappa_interval(tied_bounds, visit_bounds, *self._G[j], self.eps)
        kappa_up = min(len(visit_ops), kappa_hi)
        lo_max = max(lo for lo, _ in visit_bounds)
        tied_value, top = float(sigma[t]), tied_top(tied_bounds, visit_bounds, self.eps)
        if top > 0:
            may[t] = not math.isnan(tied_value) and kappa_up * (1 - tied_value / top) <= budget
        else:
            may[t] = True
        for b, (lo, hi) in zip(visit_ops, visit_bounds, strict=True):
            narrow = not self.warm_visits or (hi - lo) * 2 * kappa_up <= budget * lo_max
            may[b] = lo_max > 0 and kappa_up * (1 - lo_max / hi) <= budget and narrow


def visit_row_error(value: float, lo: float, hi: float) -> float:
    """The certified bound on a visit norm's error: how far its interval reaches from it
    (``inf`` while the residual is above ``TRUST_RESIDUAL``)."""
    return max(hi - value, value - lo)


__all__ = [
    "KappaStop",
    "default_kappa_tol",
    "kappa_interval",
    "tied_top",
    "visit_row_error",
    "visits_contradict",
]
