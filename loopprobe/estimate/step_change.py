"""The output change of the user's real optimizer step, per visit and per sublayer.

For the step ``Delta theta`` the user's optimizer would take (any ``torch.optim.Optimizer``
with its real state, or a fresh one by name; :func:`loopprobe.estimate.steps.optimizer_step`
steps a copy), :func:`step_change` splits the first-order output change by visit::

    Delta F_1 = sum_j sum_r U_{r,j} Delta theta_j  (+ the parameters outside every sublayer)

with one batched JVP over all visits (:class:`loopprobe.differentiate.jacobian.VisitJacobian`),
checks that the terms sum to a plain JVP of the tied model along ``Delta theta``, and puts
next to it the optimizer-free bound ``||Delta F_1|| <= sum_j ||sum_r U_{r,j}|| ||Delta theta_j||``
(each sublayer's ``||sum_r U_{r,j}|| = kappa^U_j max_r ||U_{r,j}||``). Definitions:
docs/definitions.md, "The tied-depth bound under Adam". Reference: seed 002, Eq. 11-14.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
from torch.func import jvp

from loopprobe._html import HTMLView
from loopprobe.autodiff import transform_safe
from loopprobe.differentiate.jacobian import VisitJacobian
from loopprobe.distributed import refuse
from loopprobe.estimate.bound import _output_at, _true_change_float64
from loopprobe.estimate.sensitivity import Sensitivity, sensitivity_norms
from loopprobe.estimate.steps import OptimizerArg, check_optimizer, optimizer_name, optimizer_step
from loopprobe.linalg import norm_bounds
from loopprobe.record.probe import Probe
from loopprobe.record.session import restored
from loopprobe.record.types import Forward, LossFn, Output, call_model, default_loss, seeded


def sum_tolerance(dtype: torch.dtype) -> float:
    """How far the per-visit terms may miss the plain JVP (relative): 1e-8 in float64,
    ``10 sqrt(eps)`` in lower precision (two different orders of the same sums)."""
    return 1e-8 if dtype == torch.float64 else 10 * float(torch.finfo(dtype).eps) ** 0.5


@dataclass
class StepChange(HTMLView):
    """``Delta F_1`` of one real optimizer step, split by visit; all changes are ``/ ||F||``.

    ``visits``: one row per visit (``dF``: ``||U_{r,j} Delta theta_j|| / ||F||``, ``cos``:
    its cosine with the total). ``sublayers``: one row per sublayer: ``step_norm``
    ``||Delta theta_j||``, ``dF`` (its visits' sum), ``kappa_step = dF / max_r dF_r`` (in
    ``[0, R_j]``: how aligned its visits' changes are), ``U_tied`` ``||sum_r U_{r,j}||`` (the
    certified upper end of its estimate) and ``bound = U_tied * step_norm / ||F||``.
    ``dF_first``: the norm of the terms' sum (plus ``dF_rest``, the parameters outside every
    sublayer); ``dF_jvp``: one plain JVP of the tied model along ``Delta theta``;
    ``sum_error``: their relative difference (``converged`` needs it within
    :func:`sum_tolerance`); ``dF_true``: the finite change; ``bound``: ``sum_j bound_j +
    dF_rest`` (NaN with ``norms=False``), which holds for any optimizer.
    """

    _html_keys = ("dF_true", "bound", "sum_error", "optimizer")

    optimizer: str
    scope: str
    F_norm: float
    step_norm: float
    dF_first: float
    dF_jvp: float
    dF_rest: float
    dF_true: float
    sum_error: float
    bound: float
    visits: pd.DataFrame
    sublayers: pd.DataFrame
    converged: bool = True
    reason: str = ""
    delta: list[torch.Tensor] = field(default_factory=list, repr=False)
    terms: torch.Tensor | None = field(default=None, repr=False)

    def to_frame(self) -> pd.DataFrame:
        """One row per visit with its sublayer's step, dF, kappa_step and bound joined on;
        ``attrs`` carry the totals, ``converged`` and ``reason``."""
        cols = ["sublayer", "step_norm", "kappa_step", "U_tied", "bound"]
        df = self.visits.merge(
            self.sublayers[cols].rename(columns={"bound": "bound_j"}), on="sublayer"
        )
        keys = ("optimizer", "F_norm", "step_norm", "dF_first", "dF_jvp", "dF_true", "bound")
        df.attrs.update({k: getattr(self, k) for k in keys})
        df.attrs.update(sum_error=self.sum_error, converged=self.converged, reason=self.reason)
        return df


@transform_safe()
def step_change(
    probe: Probe,
    inputs: Any,
    loss_fn: LossFn | None = None,
    *,
    optimizer: OptimizerArg = "sgd",
    lr: float | None = None,
    scope: str = "looped",
    forward: Forward | None = None,
    output: Output | None = None,
    seed: int | None = 0,
    norms: bool | Sensitivity = True,
    **norm_kwargs: Any,
) -> StepChange:
    """The real step of ``optimizer`` on copies; ``Delta F_1`` per visit and its bound.

    ``optimizer``: the ``torch.optim.Optimizer`` you train with (its state is read on a
    deep copy: model and optimizer stay bit-identical) or ``"sgd"``/``"adam"``/``"adamw"``
    (a fresh one with ``lr``, default 1e-3). ``scope``: ``"looped"`` steps the loop body's
    sublayers (role ``"body"``), ``"all"`` every parameter (parameters in no sublayer give
    ``dF_rest``). ``norms``: ``True`` estimates ``||sum_r U_{r,j}||`` for the bound
    (:func:`loopprobe.sensitivity_norms` with ``norm_kwargs``), a :class:`Sensitivity` of
    the same visits reuses one, ``False`` skips the bound. Reference: seed 002, Eq. 13-14.

    Example::

        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
        ...  # train
        sc = lp.step_change(lp.attach(model), batch, loss_fn, optimizer=opt)
        sc.sublayers[["sublayer", "dF", "kappa_step", "bound"]]
    """
    call = "step_change"
    loss_fn = default_loss(loss_fn, call)
    refuse(probe.ranks, call)
    check_optimizer(optimizer, lr, call)
    if scope not in ("looped", "all"):
        raise ValueError(f"{call}: scope={scope!r}; choose 'looped' or 'all'")
    model = probe.model
    groups = probe.groups(inputs, forward, seed=seed)
    body = [g for g in groups if g.sublayer.role == "body"] or groups
    stepped = body if scope == "looped" else groups
    if scope == "looped":
        params = list({id(p): p for g in body for p in g.params}.values())
    else:
        params = list(model.parameters())
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError(f"{call}: no parameter to step requires grad; unfreeze the loop body")
    with torch.enable_grad(), seeded(seed, params[0].device), restored(model):
        loss = loss_fn(call_model(model, inputs, forward), inputs)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
    delta, notes = optimizer_step(params, grads, optimizer, lr, call)
    by_id = {id(p): d for p, d in zip(params, delta, strict=True)}

    visits = [v for v in probe.visits(inputs, forward=forward, output=output, seed=seed)
              if any(v.j == g.sublayer.index for g in stepped)]  # fmt: skip
    jac = VisitJacobian(probe, inputs, visits, forward=forward, output=output, seed=seed, call=call)
    jac.vjp_fn()
    if jac.problems:
        raise RuntimeError(f"{call}: " + "; ".join(jac.problems))
    step_j = {}
    for g in stepped:
        parts = [by_id.get(id(p), torch.zeros_like(p)).reshape(-1) for p in g.params]
        step_j[g.sublayer.index] = torch.cat(parts).to(jac.dtype)
    V = torch.stack([torch.nn.functional.pad(step_j[v.j], (0, jac.n_max - jac.n[k]))
                     for k, v in enumerate(visits)])  # fmt: skip
    terms = jac.matvec(V, jac.masks([[k] for k in range(len(visits))]))  # (visits, |F|)

    in_groups = {id(p) for g in stepped for p in g.params}
    rest = [k for k, p in enumerate(params) if id(p) not in in_groups]

    def F_of(*values: torch.Tensor) -> torch.Tensor:
        return _output_at(model, params, values, inputs, forward, output, seed)

    def F_rest(*values: torch.Tensor) -> torch.Tensor:
        sub = [params[k] for k in rest]
        return _output_at(model, sub, values, inputs, forward, output, seed)

    primals = tuple(p.detach() for p in params)
    with torch.no_grad():
        F0 = F_of(*primals)
        F1 = F_of(*[p + d for p, d in zip(primals, delta, strict=True)])
        dF = jvp(F_of, primals, tuple(delta))[1].reshape(-1)
        total = terms.sum(0)
        if rest:
            t_rest = jvp(F_rest, tuple(primals[k] for k in rest), tuple(delta[k] for k in rest))
            total = total + t_rest[1].reshape(-1)
            rest_norm = float(t_rest[1].norm())
        else:
            rest_norm = 0.0
    F_norm = float(F0.norm())
    sum_error = float((total - dF).norm() / dF.norm()) if float(dF.norm()) > 0 else 0.0
    dF_true = float((F1 - F0).norm()) / F_norm
    if F0.dtype != torch.float64 and dF_true < 1e3 * float(torch.finfo(F0.dtype).eps):
        new = [p + d for p, d in zip(primals, delta, strict=True)]
        exact = _true_change_float64(model, params, new, inputs, forward, output, seed)
        dF_true = dF_true if exact is None else exact

    sens = None
    if norms is not False:
        sens = norms if isinstance(norms, Sensitivity) else sensitivity_norms(
            probe, inputs, forward=forward, output=output, visits=visits, seed=seed,
            **norm_kwargs,
        )  # fmt: skip
    vis_rows, sub_rows = _rows(visits, terms, total, step_j, stepped, sens, F_norm)
    sub = pd.DataFrame(sub_rows)
    bound = float(sub.bound.sum()) + rest_norm / F_norm if sens is not None else float("nan")
    reasons = []
    tol = sum_tolerance(jac.dtype)
    if not sum_error <= tol:
        reasons.append(
            f"the per-visit terms sum to the plain JVP only within {sum_error:.2g} (relative; "
            f"> {tol:.1g}): the visits do not cover the stepped parameters"
        )
    if sens is not None and not sens.converged:
        reasons.append("the bound's ||sum_r U_r||: " + sens.reason)
    return StepChange(
        optimizer=optimizer_name(optimizer),
        scope=scope,
        F_norm=F_norm,
        step_norm=float(torch.sqrt(sum((d.double() ** 2).sum() for d in delta))),
        dF_first=float(total.norm()) / F_norm,
        dF_jvp=float(dF.norm()) / F_norm,
        dF_rest=rest_norm / F_norm,
        dF_true=dF_true,
        sum_error=sum_error,
        bound=bound,
        visits=pd.DataFrame(vis_rows),
        sublayers=sub,
        converged=not reasons,
        reason="; ".join(reasons + notes),
        delta=[d.detach() for d in delta],
        terms=terms.detach(),
    )


def _rows(visits, terms, total, step_j, stepped, sens, F_norm) -> tuple[list, list]:
    """One row per visit and one per stepped sublayer (see :class:`StepChange`)."""
    tn = float(total.norm())
    vis_rows = []
    for k, v in enumerate(visits):
        t = terms[k]
        cos = float(t @ total) / (float(t.norm()) * tn) if float(t.norm()) * tn > 0 else 0.0
        vis_rows.append({"sublayer": v.sublayer, "j": v.j, "r": v.r, "i": v.i,
                         "dF": float(t.norm()) / F_norm, "cos": cos})  # fmt: skip
    tied = {} if sens is None else sens.tied_norms
    pairs = [] if sens is None else zip(sens.visits, sens.visit_norms, strict=True)
    visit_est = {v.i: e for v, e in pairs}
    sub_rows = []
    for g in stepped:
        j = g.sublayer.index
        mine = [k for k, v in enumerate(visits) if v.j == j]
        if not mine:
            continue
        part = terms[mine].sum(0)
        top = max(float(terms[k].norm()) for k in mine)
        est = tied.get(j) or (visit_est.get(visits[mine[0]].i) if len(mine) == 1 else None)
        U = norm_bounds(est.value, est.residual, sens.eps)[1] if est is not None else float("nan")
        step = float(step_j[j].norm())
        sub_rows.append({
            "sublayer": g.sublayer.name, "j": j, "role": g.sublayer.role, "R": len(mine),
            "step_norm": step, "dF": float(part.norm()) / F_norm,
            "kappa_step": float(part.norm()) / top if top > 0 else float("nan"),
            "U_tied": U, "bound": U * step / F_norm,
        })  # fmt: skip
    return vis_rows, sub_rows
