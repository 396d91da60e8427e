"""Checks of the theory's statements on a user's model: each returns the measurement when
the statement holds and raises ``AssertionError`` with the figures, the tolerance and the
visit/sublayer when it does not.

``loss(output, inputs)`` returns a scalar (as everywhere in loopprobe); ``forward`` and
``output`` are passed through to the probes. ``alpha``/``beta`` default to
``model.cfg.alpha``/``.beta`` (1.0 and 1.0 for a plain pre-norm model). Needs neither
pytest nor hypothesis.

The checks live by job: this module (updates, kappa, the first-order change, the bound,
increments, fixed points), :mod:`loopprobe.testing.unchanged` (probing leaves the model as
it was) and :mod:`loopprobe.testing.twins` (the measurements against brute-force twins:
an untied copy, dense Jacobians).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

import loopprobe as lp
from loopprobe._stats import loglog_slope
from loopprobe.record.types import call_model, seeded
from loopprobe.testing._common import _blame_model, _fail, _fmt
from loopprobe.testing._family import rebuilder

# kept importable from here: the lp_unchanged fixture and older tests use these names
from loopprobe.testing._snapshot import _differences, _snapshot  # noqa: F401
from loopprobe.testing.unchanged import check_probe_leaves_model_unchanged  # noqa: F401

# ------------------------------------------------------------------- per-visit updates


def check_updates_sum_to_tied_gradient(
    model: nn.Module,
    batch: Any,
    loss: Callable,
    *,
    forward: Callable | None = None,
    sublayers: Sequence[str] | None = None,
    rtol: float = 1e-6,
    seed: int | None = 0,
) -> dict[str, float]:
    """``sum_r G_{r,j}`` equals the tied gradient ``dL/dphi_j`` of plain autograd, per
    sublayer (seed 002, Eq. 11). Returns the relative error per sublayer.

    Fails when the probe sees fewer (or other) uses of a shared parameter than autograd:
    a parameter also used outside its module call (``F.linear(h, block.weight)``)."""
    __tracebackhide__ = True  # a failure points at the user\'s test line
    call = "check_updates_sum_to_tied_gradient"
    with _blame_model(call, model, batch, forward), lp.attach(model, sublayers) as probe:
        groups = probe.groups(batch, forward, seed=seed)
        ups = lp.per_visit_updates(probe, batch, loss, forward=forward, seed=seed)
    params = [p for g in groups for p in g.params]
    with torch.enable_grad(), seeded(seed):
        value = loss(call_model(model, batch, forward), batch)
        grads = torch.autograd.grad(value, params, allow_unused=True)
    errors, k = {}, 0
    for j, g in enumerate(groups):
        tied = torch.cat(
            [
                (torch.zeros_like(p) if gr is None else gr).reshape(-1)
                for p, gr in zip(g.params, grads[k : k + len(g.params)], strict=True)
            ]
        )
        k += len(g.params)
        summed = ups.G[j].sum(0)
        err = float((summed - tied).norm() / tied.norm().clamp_min(1e-300))
        errors[g.sublayer.name] = err
        if not err <= rtol:
            worst = int((summed - tied).abs().argmax())
            _fail(
                call,
                f"sublayer {g.sublayer.name!r}: the per-visit updates over its "
                f"{ups.G[j].shape[0]} visits do not sum to its tied gradient",
                f"||sum_r G_r - dL/dphi|| / ||dL/dphi|| = {err:.3g} > rtol={rtol:g}; "
                f"||dL/dphi|| = {float(tied.norm()):.4g}, ||sum_r G_r|| = "
                f"{float(summed.norm()):.4g}, worst entry {worst}: {float(summed[worst]):.4g} "
                f"vs {float(tied[worst]):.4g}",
                "a shared parameter used outside its module call (F.linear(h, blk.weight)) is "
                "invisible to the probe: wrap that use in the module, or exclude it",
            )
    return errors


# ------------------------------------------------------------------------------ kappa


def check_kappa_in_range(
    model: nn.Module,
    batch: Any,
    loss: Callable,
    *,
    sublayers: Sequence[str] | None = None,
    slack: float = 1e-6,
    **alignment_kwargs: Any,
) -> lp.results.AlignmentReport:
    """``0 <= kappa_j <= R_j`` for every sublayer the loss reaches (``R_j`` its
    gradient-visible visits > 0; heads and norms included), and ``kappa_R`` is the largest
    ``kappa_j`` of the loop body, from converged estimates (seed 002, Eq. 12; ``slack``
    relative). Returns the alignment report."""
    __tracebackhide__ = True  # a failure points at the user\'s test line
    call = "check_kappa_in_range"
    forward = alignment_kwargs.get("forward")
    with _blame_model(call, model, batch, forward), lp.attach(model, sublayers) as probe:
        rep = lp.visit_alignment(probe, batch, loss, **alignment_kwargs)
    rows = rep.sublayers
    reached = rows[rows.R_g > 0]
    if reached.empty:
        _fail(call, "no sublayer has a visit the loss reaches, so no kappa_j is measured",
              f"R_j = {list(rows.R_g)} for {list(rows.sublayer)}")  # fmt: skip
    for r in reached.itertuples():
        R = int(r.R_g)
        if not (math.isfinite(r.kappa) and -slack <= r.kappa <= R * (1 + slack)):
            _fail(
                call,
                f"sublayer {r.sublayer!r}: kappa_j outside [0, R_j]",
                f"kappa_j = {r.kappa:.6g}, R_j = {R} (gradient-visible visits), slack {slack:g}",
            )
    body = reached[reached.role.eq("body")] if reached.role.eq("body").any() else reached
    if not rep.kappa == float(body.kappa.max()):
        _fail(
            call,
            "kappa_R is not the largest kappa_j of the loop body",
            f"kappa_R = {rep.kappa:.6g}; body kappa_j = {_fmt(body.kappa)} "
            f"for {list(body.sublayer)}",
        )
    if not rep.converged:
        _fail(
            call,
            "the estimates behind kappa did not converge, so kappa_R is not a measurement",
            f"kappa_R = {rep.kappa:.4g}; {rep.reason}",
            "raise max_iter= or probe the model in float64",
        )
    return rep


# ------------------------------------------------------------------ first-order change


def check_first_order_change(
    model: nn.Module,
    batch: Any,
    loss: Callable,
    *,
    lr: float = 1e-4,
    rtol: float = 0.05,
    alpha: float | None = None,
    beta: float | None = None,
    **bound_kwargs: Any,
) -> lp.results.BoundCheck:
    """For a small SGD step on the loop body, the true change ``||F(theta + d) - F||`` matches
    the tied first-order change ``||J d||`` of one JVP (seed 002, Eq. 11 summed over the
    visits) to ``rtol``, and is not zero. Returns the :class:`loopprobe.BoundCheck`.

    Fails when the step does not reach the output the way autograd says it does: a model
    that re-initialises (or otherwise overwrites) its block inside forward."""
    __tracebackhide__ = True  # a failure points at the user\'s test line
    call = "check_first_order_change"
    fwd = bound_kwargs.get("forward")
    with _blame_model(call, model, batch, fwd), lp.attach(model) as probe:
        chk = lp.bound_check(probe, batch, loss, lr=lr, alpha=alpha, beta=beta, **bound_kwargs)
    ref = max(chk.dF_first, chk.dF_true)
    rel = abs(chk.dF_true - chk.dF_first) / ref if ref > 0 else math.inf
    if not rel <= rtol:
        _fail(
            call,
            "the finite change of F after one small step does not match its first-order "
            "(JVP) change",
            f"lr={lr:g}: dF/F true = {chk.dF_true:.4g}, first order = {chk.dF_first:.4g}, "
            f"relative difference {rel:.3g} > rtol={rtol:g}",
            "a true change of 0 means the step never reaches the output: does forward "
            "overwrite the parameters (re-initialise the block)?"
            if chk.dF_true == 0
            else "reduce lr= if the model is very curved, or check the loop's parameters",
        )
    if chk.dF_roundoff > 1e-3:
        _fail(call, "the true change is within roundoff", chk.reason, "probe in float64")
    return chk


# ------------------------------------------------------------------------- the bound


def check_bound(
    model: nn.Module,
    batch: Any,
    loss: Callable,
    *,
    C_max: float,
    lr: float = 1e-3,
    alpha: float | None = None,
    beta: float | None = None,
    **bound_kwargs: Any,
) -> lp.results.BoundCheck:
    """``||Delta F|| / ||F|| <= C_max * M_g kappa_R (beta/alpha)^2`` after one step, with
    converged estimates (seed 002, Eq. 14; ``C_max`` is the constant you state)."""
    __tracebackhide__ = True  # a failure points at the user\'s test line
    call = "check_bound"
    fwd = bound_kwargs.get("forward")
    with _blame_model(call, model, batch, fwd), lp.attach(model) as probe:
        chk = lp.bound_check(probe, batch, loss, lr=lr, alpha=alpha, beta=beta, **bound_kwargs)
    if not chk.converged:
        _fail(call, "the measurement did not converge", chk.reason)
    if not chk.dF_true <= C_max * chk.prediction:
        _fail(
            call,
            "the output change after one step exceeds the stated bound",
            f"dF/F = {chk.dF_true:.4g} > C_max * M_g kappa_R (beta/alpha)^2 = {C_max:g} * "
            f"{chk.M_g} * {chk.kappa:.4g} * ({chk.beta:.4g}/{chk.alpha:.4g})^2 = "
            f"{C_max * chk.prediction:.4g} (measured C = {chk.C:.4g}, lr={lr:g})",
            "a residual scale applied in forward that differs from the alpha you declare "
            "makes C grow with depth",
        )
    return chk


def check_bound_slope(
    model_or_factory: nn.Module | Callable[[int], nn.Module],
    batch: Any,
    loss: Callable,
    *,
    max_slope: float,
    min_slope: float = -math.inf,
    Rs: Sequence[int] = (2, 4, 8),
    **bound_kwargs: Any,
) -> lp.results.BoundSweep:
    """The log-log slope in R of the true ``||Delta F|| / ||F||`` after one step lies in
    ``[min_slope, max_slope]`` (seed 002, Eq. 13-16: DeepLoop flat, DeepNorm slope 1).

    ``model_or_factory``: a model drawn by :func:`loopprobe.testing.configs` (its family is
    rebuilt at each R with the same other settings and batch seed) or a factory ``R ->
    model`` (then ``batch`` is a tensor or ``batch(model)``)."""
    __tracebackhide__ = True  # a failure points at the user\'s test line
    call = "check_bound_slope"
    rebuild = rebuilder(model_or_factory, batch, call)
    built = {R: rebuild(R) for R in Rs}
    sweep = lp.bound_sweep(
        lambda R: built[R][0], list(Rs), lambda m: _batch_of(built, m), loss, **bound_kwargs
    )
    f = sweep.frame
    figures = (
        f"R = {list(Rs)}: dF/F = {_fmt(f.dF_true)}, kappa_R = {_fmt(f.kappa)}, C = {_fmt(f.C)}"
    )
    if not sweep.converged:
        _fail(call, "a measurement did not converge", sweep.reason)
    if not min_slope <= sweep.slope <= max_slope:
        _fail(
            call,
            f"log-log slope of dF/F in R is {sweep.slope:.3g}, outside "
            f"[{min_slope:g}, {max_slope:g}]",
            figures,
            "slope near 1 with kappa_R ~ R: the residual scale does not shrink with the number"
            " of visits (DeepNorm-like, or alpha computed from the blocks instead of visits)",
        )
    return sweep


def _batch_of(built: dict, model: nn.Module) -> Any:
    return next(b for m, b in built.values() if m is model)


# ------------------------------------------------------------------------- increments


def check_increment_growth(
    model_or_factory: nn.Module | Callable[[int], nn.Module],
    batch: Any,
    *,
    band: tuple[float, float],
    Rs: Sequence[int] = (2, 4, 8),
    forward: Callable | None = None,
    increment: str = "auto",
) -> np.ndarray:
    """The growth exponent over R of ``||h_R - h_0|| / ||h_0||`` (the forward increments'
    accumulation, docs/definitions.md §3) lies in ``band``. Returns the growth per R."""
    __tracebackhide__ = True  # a failure points at the user\'s test line
    call = "check_increment_growth"
    rebuild = rebuilder(model_or_factory, batch, call)
    growth, reasons = [], []
    for R in Rs:
        m, x = rebuild(R)
        inc = lp.increments(m, x, forward=forward, increment=increment)
        growth.append(inc.growth)
        if not inc.converged:
            reasons.append(f"R={R}: {inc.reason}")
    if reasons:
        _fail(call, "an increment measurement did not converge", "; ".join(reasons))
    slope = loglog_slope(list(Rs), growth)
    lo, hi = band
    if not lo <= slope <= hi:
        _fail(
            call,
            f"growth exponent {slope:.3g} outside [{lo:g}, {hi:g}]",
            f"R = {list(Rs)}: growth = {_fmt(growth)}",
        )
    return np.asarray(growth)


# ------------------------------------------------------------------------ fixed points


def check_fixed_point_contracts(
    model: nn.Module | lp.RoundMap,
    batch: Any = None,
    module: str | None = None,
    *,
    max_rho: float = 1.0,
    tol: float = 1e-8,
    max_iter: int = 500,
    **replay_kwargs: Any,
) -> lp.results.SpectralRadius:
    """The loop reaches a fixed point ``h* = T(h*)`` from its start and the spectral radius
    of ``dT/dh`` there is below ``max_rho`` (docs/definitions.md §4), both converged.

    ``model`` is a :class:`loopprobe.RoundMap`, or a model with ``module`` naming the
    module that runs one round (:func:`loopprobe.replay_round`)."""
    __tracebackhide__ = True  # a failure points at the user\'s test line
    call = "check_fixed_point_contracts"
    if isinstance(model, lp.RoundMap):
        rm = model
    else:
        if module is None:
            raise TypeError(f"{call}: pass module='name' (the module that runs one round)")
        rm = lp.replay_round(model, batch, module, **replay_kwargs)
    fp = lp.fixed_point(rm.T, rm.h0, tol=tol, max_iter=max_iter)
    if not fp.converged:
        _fail(
            call,
            "no fixed point reached",
            f"{fp.reason}; residual {fp.residual:.3g} after {fp.iterations} rounds, observed "
            f"rate {fp.rate:.3g}",
        )
    rho = lp.spectral_radius(rm.T, fp.h)
    if not rho.converged:
        _fail(call, "the spectral radius did not converge", rho.reason)
    if not rho.value < max_rho:
        _fail(
            call,
            f"spectral radius at the fixed point is {rho.value:.4g} >= {max_rho:g}",
            f"top eigenvalue moduli {_fmt(np.abs(rho.eigenvalues))}; fixed-point residual "
            f"{fp.residual:.3g}",
        )
    return rho
