"""The tied-depth bound: one real optimizer step, the output change it causes, and C.

:func:`bound_check` steps a copy of the parameters (the model never changes), measures
the relative output change ``||Delta F|| / ||F||`` (first order, one JVP, and the true
finite change) and compares it with the prediction for the step's optimizer, built from
:func:`loopprobe.visit_alignment`: ``M_g kappa_R (beta/alpha)^2`` for SGD (seed 002),
``J_g kappa_U (beta/alpha)`` for Adam/AdamW (this project's extension); the implied
constant is ``C``.
:func:`bound_sweep` repeats it over R and fits log-log slopes. Definitions:
docs/definitions.md (the bound and C); reference: seed 002, Eq. 13-16, 18, 20-21.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
from torch import nn
from torch.func import functional_call

from loopprobe._html import HTMLView
from loopprobe._stats import loglog_slope
from loopprobe.autodiff import JVP, transform_safe
from loopprobe.distributed import refuse
from loopprobe.estimate.alignment import AlignmentReport, visit_alignment
from loopprobe.estimate.steps import (
    OptimizerArg,
    check_optimizer,
    optimizer_family,
    optimizer_name,
    optimizer_step,
)
from loopprobe.record.probe import Probe
from loopprobe.record.session import restored
from loopprobe.record.types import (
    Forward,
    LossFn,
    Output,
    call_model,
    default_loss,
    pick_output,
    seeded,
)

# --------------------------------------------------------------------------- bound check


@dataclass
class BoundCheck(HTMLView):
    """Measured ``||Delta F|| / ||F||`` after one step vs the prediction for its optimizer.

    ``family``: ``"sgd"`` (prediction ``M_g kappa_R (beta/alpha)^2``, seed 002), ``"adam"``
    (``J_g kappa_U (beta/alpha)``, this project's extension; ``kappa_U = max_j ||sum_r U_{r,j}||
    / max_r ||U_{r,j}||``, ``J_g`` gradient-visible body sublayers) or ``"other"`` (no
    prediction: NaN). ``prediction_sgd``/``prediction_adam`` hold both forms whatever the step.

    ``converged``/``reason`` carry the alignment report's (kappa_R from unconverged norms, or
    from a G whose visit sum is not the tied gradient, is not a prediction; a check that could
    not run is named in ``reason`` only) and flag a true change ``dF_true`` whose relative
    roundoff ``dF_roundoff`` (about eps / dF_true: a difference of two nearly equal outputs)
    exceeds 1e-3; ``dF_first`` (one JVP) has no such cancellation. A lower-precision model whose
    change is within 1000 eps of roundoff gets ``dF_true`` from a float64 copy of itself
    (up to 5e7 parameters), where the roundoff is controlled. ``prediction_M`` uses
    all forward visits M instead of M_g (they differ for truncated models, whose
    forward-only visits also read the update; C is defined with M_g).
    """

    _html_keys = ("dF_true", "prediction", "C", "kappa", "optimizer")

    kappa: float
    M: int
    M_g: int
    alpha: float
    beta: float
    lr: float
    optimizer: str
    scope: str
    F_norm: float
    dF_first: float
    dF_true: float
    prediction: float
    C: float
    C_first: float
    kappa_bar: float = float("nan")
    prediction_sum: float = float("nan")
    prediction_M: float = float("nan")
    dF_roundoff: float = float("nan")
    family: str = "sgd"
    kappa_U: float = float("nan")
    J_g: int = 0
    prediction_sgd: float = float("nan")
    prediction_adam: float = float("nan")
    converged: bool = True
    reason: str = ""
    report: AlignmentReport | None = field(default=None, repr=False)

    def to_dict(self) -> dict:
        keys = [k for k in self.__dataclass_fields__ if k != "report"]
        return {k: getattr(self, k) for k in keys}

    def to_frame(self) -> pd.DataFrame:
        return pd.DataFrame([self.to_dict()])


@transform_safe()
def bound_check(
    probe: Probe,
    inputs: Any,
    loss_fn: LossFn | None = None,
    *,
    lr: float | None = None,
    optimizer: OptimizerArg = "sgd",
    scope: str = "looped",
    alpha: float | None = None,
    beta: float | None = None,
    forward: Forward | None = None,
    output: Output | None = None,
    seed: int | None = 0,
    report: AlignmentReport | None = None,
    **alignment_kwargs: Any,
) -> BoundCheck:
    """One real optimizer step on a copy of the parameters; the output change it causes.

    ``optimizer``: ``"sgd"``, ``"adam"`` or ``"adamw"`` (a fresh ``torch.optim`` optimizer
    with ``lr``, default 1e-3), or the ``torch.optim.Optimizer`` you train with (its real
    state: a deep copy steps, ``lr`` comes from its param groups); the model and the
    optimizer never change. ``scope``:
    ``"looped"`` steps only the loop body's parameters (the bound's subject: the
    sublayers with role ``"body"``, whose kappa_R it uses and whose visits M, M_g count;
    embeddings, norms and heads fixed), ``"all"`` every parameter. Measured: the
    first-order change ``||J dtheta|| / ||F||`` (one JVP) and the true finite change
    ``||F(theta + dtheta) - F(theta)|| / ||F||``. ``alpha``/``beta`` default to
    ``model.cfg.alpha``/``.beta``. The prediction uses the gradient-visible count
    ``M_g`` (equal to M without truncation; seed 002, Eq. 21) for an SGD step and
    ``J_g kappa_U (beta/alpha)`` for an Adam/AdamW step (docs/definitions.md, "The
    tied-depth bound under Adam"); ``C = dF_true / prediction``; ``prediction_sum`` is the
    finer per-sublayer form (``sum_j R_j kappa_j (beta/alpha)^2``, Eq. 20, or ``sum_j
    kappa^U_j (beta/alpha)``). Reference: seed 002, Eq. 13-14, 20.
    """
    call = "bound_check"
    loss_fn = default_loss(loss_fn, call)  # None: the model's own .loss
    refuse(probe.ranks, call)  # its real step would use this rank's gradient only
    if scope not in ("looped", "all"):
        raise ValueError(f"{call}: scope={scope!r}; choose 'looped' or 'all'")
    if isinstance(optimizer, str) and lr is None:
        lr = 1e-3
    check_optimizer(optimizer, lr, call)
    alpha, beta = _scales(probe.model, alpha, beta, call)
    if report is None:
        report = visit_alignment(
            probe, inputs, loss_fn, forward=forward, output=output, seed=seed, **alignment_kwargs
        )
    model = probe.model
    if scope == "looped":
        groups = probe.groups()
        body = [g for g in groups if g.sublayer.role == "body"] or groups
        params = list({id(p): p for g in body for p in g.params}.values())
    else:
        params = [p for p in model.parameters()]
    params = [p for p in params if p.requires_grad]
    with torch.enable_grad(), seeded(seed, params[0].device), restored(model):
        loss = loss_fn(call_model(model, inputs, forward), inputs)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
    delta, step_notes = optimizer_step(params, grads, optimizer, lr, call)
    new = [p.detach() + d for p, d in zip(params, delta, strict=True)]
    if not isinstance(optimizer, str):
        lr = _lr_of(optimizer, params)

    def F_of(*values: torch.Tensor) -> torch.Tensor:
        return _output_at(model, params, values, inputs, forward, output, seed)

    with torch.no_grad():
        F0 = F_of(*[p.detach() for p in params])
        F1 = F_of(*[q.detach() for q in new])
        _, dF = JVP(model, call)(F_of, tuple(p.detach() for p in params), tuple(delta))
    F_norm = float(F0.norm())
    dF_first = float(dF.norm()) / F_norm
    dF_true = float((F1 - F0).norm()) / F_norm
    eps = torch.finfo(F0.dtype).eps
    if F0.dtype != torch.float64 and dF_true < 1e3 * eps:
        # A difference of two nearly equal low-precision outputs: take it in float64.
        exact = _true_change_float64(model, params, new, inputs, forward, output, seed)
        if exact is not None:
            dF_true, eps = exact, torch.finfo(torch.float64).eps
    # The bound's subject is the loop body (kappa_R's sublayers): count its visits only.
    rows = report.sublayers
    rows = rows[rows.role.eq("body")] if rows.role.eq("body").any() else rows
    M, M_g = int(rows.R.sum()), int(rows.R_g.sum())
    ratio = beta / alpha
    pred = _predictions(report, rows, M_g, ratio)
    family = optimizer_family(optimizer)
    prediction = pred[family]
    roundoff = eps / dF_true if dF_true > 0 else float("inf")
    reasons = [report.reason] if not report.converged else []
    notes = [report.reason] if report.converged and report.reason else []
    notes += step_notes
    if family == "other":
        notes.append(
            f"no prediction is derived for a {optimizer_name(optimizer)} step (SGD without "
            "momentum history, Adam and AdamW have one); dF and prediction_sgd/_adam reported"
        )
    if roundoff > 1e-3:
        reasons.append(
            f"the true change dF/F = {dF_true:.3g} is a difference of two outputs in "
            f"{str(F0.dtype).removeprefix('torch.')} with relative roundoff ~{roundoff:.1g}; "
            "read dF_first (first order) or probe the model in float64"
        )
    return BoundCheck(
        kappa=report.kappa,
        M=M,
        M_g=M_g,
        alpha=alpha,
        beta=beta,
        lr=float(lr),
        optimizer=optimizer_name(optimizer),
        scope=scope,
        F_norm=F_norm,
        dF_first=dF_first,
        dF_true=dF_true,
        prediction=prediction,
        C=dF_true / prediction,
        C_first=dF_first / prediction,
        kappa_bar=report.kappa_bar,
        prediction_sum=pred[family + "_sum"],
        prediction_M=M * report.kappa * ratio**2 if family == "sgd" else float("nan"),
        dF_roundoff=roundoff,
        family=family,
        kappa_U=pred["kappa_U"],
        J_g=pred["J_g"],
        prediction_sgd=pred["sgd"],
        prediction_adam=pred["adam"],
        converged=not reasons,
        reason="; ".join(reasons + notes),
        report=report,
    )


def _predictions(report: AlignmentReport, rows: pd.DataFrame, M_g: int, ratio: float) -> dict:
    """Both forms from one alignment report: seed 002's ``M_g kappa_R (beta/alpha)^2`` (SGD)
    and this project's ``J_g kappa^U_R (beta/alpha)`` (Adam), ``kappa^U_j = ||sum_r U_{r,j}||
    / max_r ||U_{r,j}||`` over the gradient-visible body sublayers; ``_sum``: per-sublayer
    sums (Eq. 20 for SGD, ``sum_j kappa^U_j (beta/alpha)`` for Adam). ``other``: NaN."""
    seen = rows[rows.R_g > 0]
    kU = seen.U_tied / seen.U_max
    kappa_U = float(kU.max()) if len(kU) else float("nan")
    nan = float("nan")
    return {
        "sgd": M_g * report.kappa * ratio**2,
        "sgd_sum": M_g * report.kappa_bar * ratio**2,
        "adam": len(seen) * kappa_U * ratio,
        "adam_sum": float(kU.sum()) * ratio,
        "other": nan,
        "other_sum": nan,
        "kappa_U": kappa_U,
        "J_g": len(seen),
    }


def _lr_of(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> float:
    """The lr of the first param group holding one of ``params`` (NaN: none holds them)."""
    ids = {id(p) for p in params}
    for group in optimizer.param_groups:
        if any(id(p) in ids for p in group["params"]):
            return float(group["lr"])
    return float("nan")


def _scales(model: nn.Module, alpha: float | None, beta: float | None, call: str) -> tuple:
    cfg = getattr(model, "cfg", None)
    if alpha is None:
        alpha = getattr(cfg, "alpha", None)
    if beta is None:
        beta = getattr(cfg, "beta", None)
    if alpha is None or beta is None:
        raise ValueError(
            f"{call}: the model has no cfg.alpha/cfg.beta; pass alpha= and beta= (the residual "
            "scale and init gain; 1.0 and 1.0 for a plain pre-norm model)"
        )
    return float(alpha), float(beta)


FLOAT64_COPY_LIMIT = 50_000_000


def _true_change_float64(model, params, new, inputs, forward, output, seed) -> float | None:
    """``||F(theta + dtheta) - F(theta)|| / ||F||`` on a float64 copy of the model (None when
    the model is too large to copy, or does not run in float64)."""
    if sum(p.numel() for p in model.parameters()) > FLOAT64_COPY_LIMIT:
        return None
    names = {id(p): n for n, p in model.named_parameters()}
    try:
        twin = copy.deepcopy(model).double()
        twin_params = [twin.get_parameter(names[id(p)]) for p in params]
        x = _to_float64(inputs)

        def F_of(values: list[torch.Tensor]) -> torch.Tensor:
            return _output_at(twin, twin_params, values, x, forward, output, seed)

        with torch.no_grad():
            F0 = F_of([p.detach().double() for p in params])
            F1 = F_of([q.detach().double() for q in new])
    except (RuntimeError, TypeError, KeyError, AttributeError):
        return None
    return float((F1 - F0).norm() / F0.norm())


def _to_float64(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.double() if x.is_floating_point() else x
    if isinstance(x, tuple | list):
        return type(x)(_to_float64(v) for v in x)
    if isinstance(x, dict):
        return {k: _to_float64(v) for k, v in x.items()}
    return x


class _Called(nn.Module):
    """``model`` called as the probe calls it, so ``functional_call`` can swap its parameters."""

    def __init__(self, model: nn.Module, forward: Forward | None) -> None:
        super().__init__()
        self.model, self.forward_fn = model, forward

    def forward(self, inputs: Any) -> Any:
        return call_model(self.model, inputs, self.forward_fn)


def _output_at(model, params, values, inputs, forward, output, seed) -> torch.Tensor:
    """F with ``params[k]`` replaced by ``values[k]`` everywhere in ``model``
    (``torch.func.functional_call``: tied names get the same value). Buffers are fresh
    copies made here, so a forward that writes its buffers in place (a cache, a counter)
    writes the copies: the model's buffers stay as they were, and ``torch.func.jvp``
    accepts the write (it refuses writes into tensors captured from outside)."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    new = {f"model.{names[id(p)]}": v for p, v in zip(params, values, strict=True)}
    new.update({f"model.{n}": b.clone() for n, b in model.named_buffers()})
    with seeded(seed, params[0].device), restored(model):
        out = functional_call(_Called(model, forward), new, (inputs,), strict=False)
    return pick_output(out, output, call="bound_check")


# --------------------------------------------------------------------------- R sweep


@dataclass
class BoundSweep(HTMLView):
    """One :class:`BoundCheck` row per R, and the fitted log-log slopes in R."""

    _html_keys = ("slope", "slope_prediction", "C_ratio")

    frame: pd.DataFrame
    slope: float
    slope_first: float
    slope_prediction: float
    C_ratio: float

    @property
    def converged(self) -> bool:
        """Every row's check converged (see :class:`BoundCheck`)."""
        return bool(self.frame["converged"].all())

    @property
    def reason(self) -> str:
        bad = self.frame[~self.frame["converged"]]
        return "; ".join(f"R={r.R}: {r.reason}" for r in bad.itertuples())

    def to_frame(self) -> pd.DataFrame:
        df = self.frame.copy()
        df.attrs.update(converged=self.converged, reason=self.reason)
        return df


def bound_sweep(
    factory: Callable[[int], nn.Module],
    Rs: Sequence[int],
    inputs: Any,
    loss_fn: LossFn | None = None,
    *,
    sublayers: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    **kwargs: Any,
) -> BoundSweep:
    """:func:`bound_check` on ``factory(R)`` for each R; slopes of log dF vs log R.

    ``inputs`` may be a callable ``inputs(model)``. ``slope`` fits the true relative change,
    ``slope_first`` the first-order one, ``slope_prediction`` the predicted bound;
    ``C_ratio = max C / min C`` across R; ``sublayers`` / ``exclude`` as in
    :func:`loopprobe.attach`. Reference: seed 002, Eq. 13-16.
    """
    if len(Rs) < 2:
        raise ValueError(f"bound_sweep: need at least two values of R, got {list(Rs)}")
    rows = []
    for R in Rs:
        model = factory(R)
        x = inputs(model) if callable(inputs) else inputs
        with Probe(model, sublayers, exclude) as probe:
            chk = bound_check(probe, x, loss_fn, **kwargs)
        rows.append({"R": R, **chk.to_dict()})
    frame = pd.DataFrame(rows)
    fit = lambda col: loglog_slope(frame.R, frame[col])  # noqa: E731
    return BoundSweep(
        frame=frame,
        slope=fit("dF_true"),
        slope_first=fit("dF_first"),
        slope_prediction=fit("prediction"),
        C_ratio=float(frame.C.max() / frame.C.min()),
    )
