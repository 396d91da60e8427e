"""The visit-alignment coefficient kappa, the visit Gram matrices, and the tied-depth bound.

Per physical sublayer j with R_j gradient-visible visits (seed 002, Eq. 12, with the
measured maxima in place of ``C_U beta/alpha`` and ``C_G beta/alpha``)::

    kappa_j = ||sum_r U_{r,j}|| * ||sum_r G_{r,j}|| / (R_j * max_r ||U_{r,j}|| * max_r ||G_{r,j}||)

and ``kappa_R = max_j kappa_j``. By the triangle inequality ``0 <= kappa_j <= R_j``: R_j
when the visits are aligned, O(1) when they decorrelate; ``kappa = 1`` when ``R = 1``.
The Gram/cosine matrices of ``G_{.,j}`` and of ``U_{.,j}^T w`` (a random unit output
direction w) show *why*: negative cosines between consecutive visits are gradient
oscillation. The bound check (Eq. 13/14) compares the measured relative output change
after one real optimizer step with ``M_g * kappa_R * (beta/alpha)^2`` and reports the
implied constant ``C``. Reference: seed 002, Eq. 12-14, 18, 21.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
from torch import nn
from torch.func import jvp

from loopprobe._stats import cosine_matrix, loglog_slope
from loopprobe.autodiff import transform_safe
from loopprobe.sensitivity import Sensitivity, sensitivity_norms
from loopprobe.updates import LossFn, Updates, per_visit_updates
from loopprobe.visits import (
    Forward,
    Output,
    Probe,
    _restored,
    call_model,
    pick_output,
    seeded,
)


def visit_kappa(
    U_tied: float, G_tied: float, U_norms: Sequence[float], G_norms: Sequence[float]
) -> float:
    """``kappa_j`` from the four measured norms (NaN when a maximum is zero).

    Reference: seed 002, Eq. 12.
    """
    R = len(U_norms)
    if R == 0 or len(G_norms) != R:
        raise ValueError(
            f"visit_kappa: need one U and one G norm per visit, got {len(U_norms)} and "
            f"{len(G_norms)}"
        )
    denom = R * max(U_norms) * max(G_norms)
    return float(U_tied * G_tied / denom) if denom > 0 else float("nan")


@dataclass
class AlignmentReport:
    """kappa_R, one row per physical sublayer, one row per visit, and the Gram matrices.

    ``kappa_bar = sum_j R_j kappa_j / M_g`` is the visit-weighted aggregate of Eq. 21
    (``M_g kappa_bar`` is the per-sublayer sum of Eq. 20, never above ``M_g kappa_R``).
    ``gram_G[name]``/``cos_G[name]``: visit Gram and cosine matrices of ``G_{.,j}``;
    ``gram_UTw``/``cos_UTw``: the same for ``U_{.,j}^T w``. ``M``/``M_g``: forward- and
    gradient-visible visits (measured). ``update`` says which effective update G is.
    ``converged`` is True only when every U estimate converged and every kappa_j is a
    number in ``[0, R_j]``; ``reason`` says what is not (a sublayer's ``kappa_ok`` column
    marks its own kappa_j).
    """

    kappa: float
    sublayers: pd.DataFrame
    visits: pd.DataFrame
    gram_G: dict[str, torch.Tensor]
    cos_G: dict[str, torch.Tensor]
    gram_UTw: dict[str, torch.Tensor]
    cos_UTw: dict[str, torch.Tensor]
    M: int
    M_g: int
    update: str
    F_norm: float
    loss: float
    kappa_bar: float = float("nan")
    kappa_note: str = ""
    updates: Updates | None = field(default=None, repr=False)
    sensitivity: Sensitivity | None = field(default=None, repr=False)
    converged: bool = True
    reason: str = ""

    def to_frame(self) -> pd.DataFrame:
        """One row per visit with its sublayer's kappa_j, R_j and tied norms joined on."""
        cols = ["sublayer", "kappa", "R_g", "U_tied", "G_tied", "U_max", "G_max"]
        return self.visits.merge(self.sublayers[cols], on="sublayer", how="left")


def visit_alignment(
    probe: Probe,
    inputs: Any,
    loss_fn: LossFn,
    *,
    forward: Forward | None = None,
    output: Output | None = None,
    update: str | torch.optim.Optimizer = "sgd",
    method: str = "auto",
    max_iter: int = 100,
    tol: float | None = None,
    generator: torch.Generator | None = None,
    seed: int | None = 0,
    chunk_size: int | None = None,
    memory: str = "full",
) -> AlignmentReport:
    """kappa_j per sublayer and kappa_R = max_j, from G (one backward) and U (power iteration).

    The visits counted are the gradient-visible ones (offsets that reach the loss); U is
    measured on the same visits with F picked by ``output=`` (default the model output).
    Every model evaluation runs with torch's RNG at ``seed`` (same dropout masks for G
    and every U product). See :func:`per_visit_updates` and :func:`sensitivity_norms`
    for the arguments; ``memory="low"`` keeps only G norms and tied sums (no G Gram
    matrices in the report). Reference: seed 002, Eq. 12.
    """
    ups = per_visit_updates(
        probe, inputs, loss_fn, forward=forward, update=update, seed=seed, memory=memory
    )
    visible = [v for v in ups.visits if bool(ups.visible[v.j][v.r])]
    if not visible:
        raise ValueError(
            "visit_alignment: no visit of any sublayer gets a gradient from the loss; "
            "check loss_fn and that the looped sublayers run with gradient enabled"
        )
    sens = sensitivity_norms(
        probe,
        inputs,
        forward=forward,
        output=output,
        visits=visible,
        method=method,
        max_iter=max_iter,
        tol=tol,
        generator=generator,
        seed=seed,
        chunk_size=chunk_size,
    )
    return _report(ups, sens, {s.name: s.role for s in probe.sublayers()})


def _report(ups: Updates, sens: Sensitivity, roles: dict | None = None) -> AlignmentReport:
    U_of = {v.i: est for v, est in zip(sens.visits, sens.visit_norms, strict=True)}
    vrows, srows = [], []
    gram_G, cos_G, gram_UTw, cos_UTw = {}, {}, {}, {}
    for v in ups.visits:
        est = U_of.get(v.i)
        vrows.append(
            {
                "sublayer": v.sublayer,
                "j": v.j,
                "r": v.r,
                "i": v.i,
                "module": v.module,
                "grad_enabled": v.grad_enabled,
                "grad_visible": bool(ups.visible[v.j][v.r]),
                "U_norm": est.value if est else float("nan"),
                "G_norm": float(ups.norms(v.j)[v.r]),
                "converged": est.converged if est else None,
                "iterations": est.iterations if est else 0,
                "rel_change": est.rel_change if est else float("nan"),
            }
        )
    visits = pd.DataFrame(vrows)
    kappas = []
    for j, name in enumerate(ups.sublayers):
        mine = visits[(visits.j == j) & visits.grad_visible]
        R = int((visits.j == j).sum())
        role = (roles or {}).get(name, "body")
        row: dict[str, Any] = {"sublayer": name, "j": j, "role": role, "R": R, "R_g": len(mine)}
        if len(mine) and j in sens.tied_norms:
            tied_U = sens.tied_norms[j]
            G_tied = float(ups.tied(j).norm())  # invisible visits contribute zero
            kappa = visit_kappa(tied_U.value, G_tied, list(mine.U_norm), list(mine.G_norm))
            if ups.G is not None:
                gram = ups.gram(j)
                gram_G[name], cos_G[name] = gram, cosine_matrix(gram)
            if j in sens.UTw:
                g2 = sens.UTw[j] @ sens.UTw[j].T
                gram_UTw[name], cos_UTw[name] = g2, cosine_matrix(g2)
            kappas.append((role, kappa))
            row.update(
                kappa=kappa,
                U_tied=tied_U.value,
                G_tied=G_tied,
                U_max=float(mine.U_norm.max()),
                G_max=float(mine.G_norm.max()),
                U_sum=float(mine.U_norm.sum()),
                G_sum=float(mine.G_norm.sum()),
                tied_converged=tied_U.converged,
                converged=bool(tied_U.converged and mine.converged.all()),
                cos_G_adjacent=_adjacent(cos_G[name]) if name in cos_G else float("nan"),
            )
        else:
            row.update(kappa=float("nan"), U_tied=float("nan"), G_tied=float("nan"))
        srows.append(row)
    # kappa_R: max over the loop body only; reuse that is not recurrence is listed, not used.
    finite = [k for r, k in kappas if not math.isnan(k) and r == "body"]
    out = [n for n in ups.sublayers if (roles or {}).get(n, "body") != "body"]
    note = f"kappa_R is over role='body' sublayers; excluded: {out}" if out else ""
    if not finite and out:
        finite = [k for _, k in kappas if not math.isnan(k)]
        note = f"no body sublayer: kappa_R is over every sublayer, including {out}"
    sub = pd.DataFrame(srows)
    M_g = int(visits.grad_visible.sum())
    in_R = sub.role.eq("body") if sub.role.eq("body").any() else sub.role.notna()
    sub["kappa_ok"], flagged = _kappa_checks(sub)
    problems = [text for i, text in flagged.items() if in_R[i]]  # only what kappa_R uses
    counted = sub.kappa.notna() & (sub.R_g > 0) & in_R
    weighted = (sub.R_g * sub.kappa)[counted].sum()
    reasons = [sens.reason] if not sens.converged else []
    return AlignmentReport(
        kappa=max(finite) if finite else float("nan"),
        sublayers=sub,
        visits=visits,
        gram_G=gram_G,
        cos_G=cos_G,
        gram_UTw=gram_UTw,
        cos_UTw=cos_UTw,
        M=len(ups.visits),
        M_g=M_g,
        update=ups.method,
        F_norm=sens.F_norm,
        loss=ups.loss,
        kappa_bar=float(weighted / sub.R_g[counted].sum()) if counted.any() else float("nan"),
        kappa_note=note,
        updates=ups,
        sensitivity=sens,
        converged=not (reasons or problems),
        reason="; ".join(reasons + problems),
    )


def _kappa_checks(sub: pd.DataFrame) -> tuple[list[bool], dict[int, str]]:
    """Which kappa_j can be shown as numbers, and why the others cannot.

    ``0 <= kappa_j <= R_j`` holds for exact norms (triangle inequality); a value above R_j
    means the max-norms in its denominator were underestimated (unconverged U). A NaN
    kappa_j (a zero max norm: a sublayer the loss does not reach) is named, not dropped.
    """
    ok, problems = [], {}
    for i, row in enumerate(sub.itertuples()):
        if row.R_g == 0:
            ok.append(True)  # no gradient-visible visit: not part of kappa_R by definition
        elif math.isnan(row.kappa):
            ok.append(False)
            problems[i] = f"kappa of {row.sublayer} is NaN (a zero max norm of U or G)"
        elif not 0 <= row.kappa <= row.R_g * (1 + 1e-9):
            ok.append(False)
            problems[i] = (
                f"kappa of {row.sublayer} = {row.kappa:.4g} lies outside [0, R_j = {row.R_g}]: "
                "its max-norms are underestimated (U not converged); not a measurement"
            )
        else:
            ok.append(True)
    return ok, problems


def _adjacent(cos: torch.Tensor) -> float:
    """Mean cosine between consecutive visits (negative: gradient oscillation)."""
    if cos.shape[0] < 2:
        return float("nan")
    return float(cos.diagonal(1).mean())


# --------------------------------------------------------------------------- bound check


@dataclass
class BoundCheck:
    """Measured ``||Delta F|| / ||F||`` after one step vs ``M_g kappa_R (beta/alpha)^2``.

    ``converged``/``reason`` carry the alignment report's (kappa_R from unconverged norms is
    not a prediction) and flag a true change ``dF_true`` whose relative roundoff
    ``dF_roundoff`` (about eps / dF_true: a difference of two nearly equal outputs) exceeds
    1e-3; ``dF_first`` (one JVP) has no such cancellation. A lower-precision model whose
    change is within 1000 eps of roundoff gets ``dF_true`` from a float64 copy of itself
    (up to 5e7 parameters), where the roundoff is controlled. ``prediction_M`` uses
    all forward visits M instead of M_g (they differ for truncated models, whose
    forward-only visits also read the update; C is defined with M_g).
    """

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
    loss_fn: LossFn,
    *,
    lr: float = 1e-3,
    optimizer: str = "sgd",
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
    with ``lr``), stepping on detached clones, so the model never changes. ``scope``:
    ``"looped"`` steps only the loop body's parameters (the bound's subject: the
    sublayers with role ``"body"``, whose kappa_R it uses and whose visits M, M_g count;
    embeddings, norms and heads fixed), ``"all"`` every parameter. Measured: the
    first-order change ``||J dtheta|| / ||F||`` (one JVP) and the true finite change
    ``||F(theta + dtheta) - F(theta)|| / ||F||``. ``alpha``/``beta`` default to
    ``model.cfg.alpha``/``.beta``. The prediction uses the gradient-visible count
    ``M_g`` (equal to M without truncation; seed 002, Eq. 21) and
    ``C = dF_true / prediction``; ``prediction_sum`` is the finer per-sublayer form
    ``sum_j R_j kappa_j (beta/alpha)^2`` (Eq. 20). Reference: seed 002, Eq. 13-14, 20.
    """
    call = "bound_check"
    if scope not in ("looped", "all"):
        raise ValueError(f"{call}: scope={scope!r}; choose 'looped' or 'all'")
    opt_cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
    if optimizer not in opt_cls:
        raise ValueError(f"{call}: optimizer={optimizer!r}; choose one of {list(opt_cls)}")
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
    with torch.enable_grad(), seeded(seed, params[0].device), _restored(model):
        loss = loss_fn(call_model(model, inputs, forward), inputs)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
    new = [p.detach().clone() for p in params]
    for q, g in zip(new, grads, strict=True):
        q.grad = torch.zeros_like(q) if g is None else g.detach().clone()
    opt = opt_cls[optimizer](new, lr=lr)
    opt.step()
    delta = [q.detach() - p.detach() for q, p in zip(new, params, strict=True)]

    def F_of(*values: torch.Tensor) -> torch.Tensor:
        with seeded(seed, params[0].device), _restored(model), _swapped(model, params, values):
            return pick_output(call_model(model, inputs, forward), output, call=call)

    with torch.no_grad():
        F0 = F_of(*[p.detach() for p in params])
        F1 = F_of(*[q.detach() for q in new])
        _, dF = jvp(F_of, tuple(p.detach() for p in params), tuple(delta))
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
    prediction = M_g * report.kappa * (beta / alpha) ** 2
    roundoff = eps / dF_true if dF_true > 0 else float("inf")
    reasons = [report.reason] if not report.converged else []
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
        lr=lr,
        optimizer=optimizer,
        scope=scope,
        F_norm=F_norm,
        dF_first=dF_first,
        dF_true=dF_true,
        prediction=prediction,
        C=dF_true / prediction,
        C_first=dF_first / prediction,
        kappa_bar=report.kappa_bar,
        prediction_sum=M_g * report.kappa_bar * (beta / alpha) ** 2,
        prediction_M=M * report.kappa * (beta / alpha) ** 2,
        dF_roundoff=roundoff,
        converged=not reasons,
        reason="; ".join(reasons),
        report=report,
    )


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
            with seeded(seed, params[0].device), _swapped(twin, twin_params, values):
                return pick_output(call_model(twin, x, forward), output, call="bound_check")

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


@contextmanager
def _swapped(model: nn.Module, params: list[torch.Tensor], values: Sequence) -> Iterator[None]:
    """Every module slot holding ``params[k]`` holds ``values[k]`` inside the block."""
    index = {id(p): k for k, p in enumerate(params)}
    saved = []
    try:
        for m in model.modules():
            for name, p in list(m._parameters.items()):
                if p is not None and id(p) in index:
                    saved.append((m, name, p))
                    m._parameters[name] = values[index[id(p)]]
        yield
    finally:
        for m, name, p in reversed(saved):
            m._parameters[name] = p


# --------------------------------------------------------------------------- R sweep


@dataclass
class BoundSweep:
    """One :class:`BoundCheck` row per R, and the fitted log-log slopes in R."""

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
    loss_fn: LossFn,
    *,
    sublayers: Sequence[str] | None = None,
    **kwargs: Any,
) -> BoundSweep:
    """:func:`bound_check` on ``factory(R)`` for each R; slopes of log dF vs log R.

    ``inputs`` may be a callable ``inputs(model)``. ``slope`` fits the true relative change,
    ``slope_first`` the first-order one, ``slope_prediction`` the predicted bound;
    ``C_ratio = max C / min C`` across R. Reference: seed 002, Eq. 13-16.
    """
    if len(Rs) < 2:
        raise ValueError(f"bound_sweep: need at least two values of R, got {list(Rs)}")
    rows = []
    for R in Rs:
        model = factory(R)
        x = inputs(model) if callable(inputs) else inputs
        with Probe(model, sublayers) as probe:
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
