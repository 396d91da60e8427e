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

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch

from loopprobe._html import HTMLView
from loopprobe._stats import cosine_matrix
from loopprobe.estimate.kappa_bounds import (  # noqa: F401 - kappa_interval etc.: public here too
    STOP_SHARE,
    KappaStop,
    default_kappa_tol,
    kappa_interval,
    tied_top,
    visit_row_error,
    visits_contradict,
)
from loopprobe.estimate.sensitivity import Sensitivity, sensitivity_norms
from loopprobe.estimate.updates import OUTSIDE_EPS, Updates, per_visit_updates
from loopprobe.linalg import norm_bounds
from loopprobe.record.probe import Probe
from loopprobe.record.types import Forward, LossFn, Output, default_loss


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
class AlignmentReport(HTMLView):
    """kappa_R, one row per physical sublayer, one row per visit, and the Gram matrices.

    ``kappa_bar = sum_j R_j kappa_j / M_g`` is the visit-weighted aggregate of Eq. 21
    (``M_g kappa_bar`` is the per-sublayer sum of Eq. 20, never above ``M_g kappa_R``).
    ``gram_G[name]``/``cos_G[name]``: visit Gram and cosine matrices of ``G_{.,j}``;
    ``gram_UTw``/``cos_UTw``: the same for ``U_{.,j}^T w``. ``M``/``M_g``: forward- and
    gradient-visible visits (measured) of the sublayers kappa_R is over (role ``"body"``;
    every sublayer when none is): a read-out applied after every round is not counted,
    as in :func:`~loopprobe.bound_check` and :func:`~loopprobe.health`. ``update`` says
    which effective update G is. ``converged`` is True only when kappa_R's certified error
    bound is within ``tol``, every kappa_j is a number in ``[0, R_j]`` and
    ``sum_r G_{r,j}`` is the tied update of every sublayer kappa_R uses
    (:func:`per_visit_updates` checks it; column ``G_outside_share``); ``reason`` says what
    is not (a sublayer's ``kappa_ok`` column marks its own kappa_j). ``kappa_err``: the
    certified bound on kappa_R's error, ``[kappa_lo, kappa_hi]`` the interval holding it
    (from every operator's residual certificate, :func:`kappa_interval`); ``tol`` the bound
    asked for (above it: not converged). Every row's ``converged`` means its own value is
    within its stated bound: a sublayer row's kappa_j within ``tol`` (``kappa_err``), a
    visit row's ``U_norm`` within relative ``tol`` (``U_err <= tol U_norm``; a visit that
    stopped once it could no longer move kappa_R is not, its ``[U_lo, U_hi]`` still holds
    the exact norm).
    """

    _html_keys = ("kappa", "kappa_lo", "kappa_hi", "kappa_bar", "M", "M_g", "update")

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
    kappa_err: float = float("nan")
    kappa_lo: float = float("nan")
    kappa_hi: float = float("nan")
    tol: float = float("nan")

    def to_frame(self) -> pd.DataFrame:
        """One row per visit with its sublayer's kappa_j, R_j and tied norms joined on;
        ``attrs`` carry kappa_R, its error bound, ``converged`` and ``reason``."""
        cols = ["sublayer", "kappa", "kappa_err", "R_g", "U_tied", "G_tied", "U_max", "G_max"]
        df = self.visits.merge(self.sublayers[cols], on="sublayer", how="left")
        df.attrs.update(kappa_R=self.kappa, kappa_R_err=self.kappa_err, tol=self.tol)
        df.attrs.update(converged=self.converged, reason=self.reason)
        return df


def visit_alignment(
    probe: Probe,
    inputs: Any,
    loss_fn: LossFn | None = None,
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
    start: Any = None,
    each_visit: bool = False,
    warm_visits: bool | None = None,
    narrow: bool = True,
) -> AlignmentReport:
    """kappa_j per sublayer and kappa_R = max_j, from G (one backward) and U (power iteration).

    The visits counted are the gradient-visible ones (offsets that reach the loss); U is
    measured on the same visits with F picked by ``output=`` (default the model output).
    Every model evaluation runs with torch's RNG at ``seed`` (same dropout masks for G
    and every U product). See :func:`per_visit_updates` and :func:`sensitivity_norms`
    for the arguments (``loss_fn=None``: the model's own ``.loss``); ``memory="low"``
    keeps only G norms and tied sums (no G Gram matrices in the report) and runs U's
    products in forward mode (:func:`sensitivity_norms`). ``start``: an
    earlier report (or its ``sensitivity``) to warm-start the U estimates from
    (:func:`sensitivity_norms`; a training monitor).

    ``tol`` is the bound on kappa's error (absolute; default :func:`default_kappa_tol` of the
    precision the operators are computed in: 1e-6 in float64, 1e-3 where any arithmetic on
    the path rounds in float32, which ``reason`` then says; a float32 tensor that is only
    moved, such as a zero pad, does not count): each operator runs until the interval that
    its Ritz residual certificate puts around its norm (:func:`loopprobe.linalg.norm_bounds`),
    propagated through the max over visits and the ratio (:func:`kappa_interval`), holds
    every kappa_j, and so kappa_R, within ``tol`` (:class:`KappaStop`); a visit that cannot
    be the max stops once that is certain, so its own ``U_norm`` may be looser (columns
    ``U_lo``/``U_hi``; ``each_visit=True`` also certifies each visit norm to relative
    ``tol``). ``kappa_err`` (the report's, and a column per sublayer with ``kappa_lo``,
    ``kappa_hi``) is the bound met; above ``tol`` the report is not converged. The bound
    assumes, like every Krylov estimate, that the start vectors overlap the top singular
    vectors. A training monitor affords ``tol=1e-2`` (3-4x fewer products). ``warm_visits``:
    as in :func:`sensitivity_norms` (each visit from its sublayer's previous one, the tied
    operator from its visits). ``narrow``: as in :func:`sensitivity_norms` (``False``: every
    operator in one batch, each product over every visit: more arithmetic, fewer calls,
    which is faster on small operators).
    Reference: seed 002, Eq. 12.
    """
    loss_fn = default_loss(loss_fn, "visit_alignment")
    ups = per_visit_updates(
        probe, inputs, loss_fn, forward=forward, update=update, seed=seed, memory=memory
    )
    visible = [v for v in ups.visits if bool(ups.visible[v.j][v.r])]
    if not visible:
        raise ValueError(
            "visit_alignment: no visit of any sublayer gets a gradient from the loss; "
            "check loss_fn and that the looped sublayers run with gradient enabled"
        )
    if tol is not None and not float(tol) > 0:
        raise ValueError(f"visit_alignment: tol={tol}; kappa's error bound must be > 0")
    keys = [("visit", v.i) for v in visible]
    keys += [("tied", j) for j in sorted({v.j for v in visible})
             if sum(v.j == j for v in visible) > 1]  # fmt: skip
    rule = KappaStop(keys, visible, ups, None if tol is None else float(tol), each_visit)
    sens = sensitivity_norms(
        probe,
        inputs,
        forward=forward,
        output=output,
        visits=visible,
        method=method,
        max_iter=max_iter,
        generator=generator,
        seed=seed,
        chunk_size=chunk_size,
        start=start,
        warm_visits=warm_visits,
        stop=rule,
        narrow=narrow,
        memory=memory,
    )
    if sens.keys and sens.keys != keys:
        raise RuntimeError(f"visit_alignment: operator order {sens.keys} is not {keys}")
    subs = probe.sublayers()
    rep = _report(ups, sens, {s.name: s.role for s in subs}, rule.tol)
    if tol is None and rule.dtype != torch.float64:
        rep.reason = "; ".join(filter(None, [rep.reason, _tol_note(rule)]))
    notes = [f"{s.name}: {s.note}" for s in subs if s.note and s.role == "body"]
    rep.kappa_note = "; ".join([rep.kappa_note, *notes] if rep.kappa_note else notes)
    return rep


def _tol_note(rule: KappaStop) -> str:
    """Says that the default ``tol`` is not the float64 one, and why."""
    name = str(rule.dtype).removeprefix("torch.")
    return (
        f"tol={rule.tol:g} (the {name} default: the operators are computed in {name}; "
        "pass tol= to ask for another bound)"
    )


def _report(
    ups: Updates, sens: Sensitivity, roles: dict | None = None, tol: float | None = None
) -> AlignmentReport:
    """The report from the updates and the norms: rows, kappa_R with its interval, and why
    it is or is not converged."""
    tol = float("inf") if tol is None else tol
    roles = roles or {}
    visits = _visit_rows(ups, sens, tol)
    grams: tuple[dict, dict, dict, dict] = ({}, {}, {}, {})
    srows, kappas, missed = [], [], []
    for j, name in enumerate(ups.sublayers):
        row, kappa = _sublayer_row(j, name, roles.get(name, "body"), visits, ups, sens, grams)
        if kappa is not None:  # converged: kappa_j certified within tol
            kappas.append(kappa)
            lost = not kappa[2] <= kappa[3] or row.pop("contradict")
            missed += [name] if lost else []  # a visit's norm is not its top singular value
            row["converged"] = bool(not lost and row.pop("certified") and row["kappa_err"] <= tol)
        srows.append(row)
    kappa_R, k_lo, k_hi, note = _kappa_R(kappas, ups.sublayers, roles)
    kappa_err = max(k_hi - kappa_R, kappa_R - k_lo) if math.isfinite(kappa_R) else math.nan
    sub = pd.DataFrame(srows)
    in_R = sub.role.eq("body") if sub.role.eq("body").any() else sub.role.notna()
    sub["kappa_ok"], flagged = _kappa_checks(sub)
    problems = [text for i, text in flagged.items() if in_R[i]]  # only what kappa_R uses
    in_body = visits.sublayer.isin(set(sub.sublayer[in_R]))  # M, M_g: kappa_R's visits only
    counted = sub.kappa.notna() & (sub.R_g > 0) & in_R
    weighted = (sub.R_g * sub.kappa)[counted].sum()
    reasons = [sens.reason] if not sens.converged else []
    if missed:
        reasons.append(_missed_reason(missed))
        kappa_err = float("inf")
    elif kappas and not kappa_err <= tol:
        reasons.append(f"kappa's error bound {kappa_err:.3g} exceeds tol={tol:g}")
    bad_G = _updates_problem(ups, in_R)
    notes = [ups.reason] if ups.reason and not bad_G else []  # checks that could not run
    gram_G, cos_G, gram_UTw, cos_UTw = grams
    return AlignmentReport(
        kappa=kappa_R,
        sublayers=sub,
        visits=visits,
        gram_G=gram_G,
        cos_G=cos_G,
        gram_UTw=gram_UTw,
        cos_UTw=cos_UTw,
        M=int(in_body.sum()),
        M_g=int((visits.grad_visible & in_body).sum()),
        update=ups.method,
        F_norm=sens.F_norm,
        loss=ups.loss,
        kappa_bar=float(weighted / sub.R_g[counted].sum()) if counted.any() else float("nan"),
        kappa_note=note,
        updates=ups,
        sensitivity=sens,
        converged=not (reasons or problems or bad_G),
        reason="; ".join(reasons + bad_G + problems + notes),
        kappa_err=kappa_err,
        kappa_lo=k_lo,
        kappa_hi=k_hi,
        tol=tol,
    )


def _visit_rows(ups: Updates, sens: Sensitivity, tol: float) -> pd.DataFrame:
    """One row per forward visit: its G norm, its U estimate with the interval holding the
    exact norm (``U_lo``/``U_hi``) and the bound that interval puts on the estimate's error
    (``U_err``). ``converged``: the row's own ``U_norm`` is certified to relative ``tol``
    (``U_err <= tol U_norm``); a visit that stopped once it could no longer move kappa by
    ``tol`` is not, though its interval holds the exact norm. ``stopped``: its Krylov run
    ended by the stopping rule (not by ``max_iter``)."""
    U_of = {v.i: est for v, est in zip(sens.visits, sens.visit_norms, strict=True)}
    rows = []
    for v in ups.visits:
        est = U_of.get(v.i)
        value = est.value if est else math.nan
        lo, hi = norm_bounds(value, est.residual, sens.eps) if est else (math.nan, math.nan)
        err = visit_row_error(value, lo, hi) if est else math.nan
        rows.append(
            {
                "sublayer": v.sublayer,
                "j": v.j,
                "r": v.r,
                "i": v.i,
                "module": v.module,
                "grad_enabled": v.grad_enabled,
                "grad_visible": bool(ups.visible[v.j][v.r]),
                "U_norm": value,
                "U_lo": lo,
                "U_hi": hi,
                "U_err": err,
                "G_norm": float(ups.norms(v.j)[v.r]),
                "converged": bool(err <= tol * value) if est else None,
                "stopped": est.converged if est else None,
                "iterations": est.iterations if est else 0,
                "rel_change": est.rel_change if est else math.nan,
            }
        )
    return pd.DataFrame(rows)


def _sublayer_row(j, name, role, visits, ups, sens, grams) -> tuple[dict, tuple | None]:
    """Sublayer j's row (kappa_j with its interval, the tied and max norms) and, when it has
    gradient-visible visits, ``(role, kappa_j, lo, hi)``; fills its Gram matrices in."""
    mine = visits[(visits.j == j) & visits.grad_visible]
    row: dict[str, Any] = {"sublayer": name, "j": j, "role": role,
                           "R": int((visits.j == j).sum()), "R_g": len(mine)}  # fmt: skip
    if not (len(mine) and j in sens.tied_norms):
        return {**row, "kappa": math.nan, "kappa_err": math.nan, "U_tied": math.nan,
                "G_tied": math.nan}, None  # fmt: skip
    tied_U = sens.tied_norms[j]
    tied_b = norm_bounds(tied_U.value, tied_U.residual, sens.eps)
    G_tied = float(ups.tied(j).norm())  # invisible visits contribute zero
    kappa = visit_kappa(tied_U.value, G_tied, list(mine.U_norm), list(mine.G_norm))
    U_b = list(zip(mine.U_lo, mine.U_hi, strict=True))
    k_lo, k_hi = kappa_interval(tied_b, U_b, G_tied, list(mine.G_norm), sens.eps)
    gram_G, cos_G, gram_UTw, cos_UTw = grams
    if ups.G is not None:
        gram_G[name] = ups.gram(j)
        cos_G[name] = cosine_matrix(gram_G[name])
    if j in sens.UTw:
        gram_UTw[name] = sens.UTw[j] @ sens.UTw[j].T
        cos_UTw[name] = cosine_matrix(gram_UTw[name])
    row.update(
        kappa=kappa,
        kappa_lo=k_lo,
        kappa_hi=k_hi,
        kappa_err=max(k_hi - kappa, kappa - k_lo),
        U_tied=tied_U.value,
        G_tied=G_tied,
        U_max=float(mine.U_norm.max()),
        G_max=float(mine.G_norm.max()),
        U_sum=float(mine.U_norm.sum()),
        G_sum=float(mine.G_norm.sum()),
        G_outside_share=ups.outside_share[j] if ups.outside_share else math.nan,
        tied_converged=tied_U.converged,
        cos_G_adjacent=_adjacent(cos_G[name]) if name in cos_G else math.nan,
        certified=bool(math.isfinite(k_hi)),
        contradict=visits_contradict(tied_b, U_b, sens.eps),
    )
    return row, (role, kappa, k_lo, k_hi)


def _kappa_R(kappas: list[tuple], names: list[str], roles: dict) -> tuple:
    """kappa_R = max_j kappa_j over the loop body (reuse that is not recurrence is listed,
    not used) with the interval it lies in (between the largest lower and the largest
    upper end), and the note saying which sublayers it is over."""
    finite = [k for k in kappas if not math.isnan(k[1]) and k[0] == "body"]
    out = [n for n in names if roles.get(n, "body") != "body"]
    note = f"kappa_R is over role='body' sublayers; excluded: {out}" if out else ""
    if not finite and out:
        finite = [k for k in kappas if not math.isnan(k[1])]
        note = f"no body sublayer: kappa_R is over every sublayer, including {out}"
    if not finite:
        return math.nan, math.nan, math.nan, note
    lo, hi = max(k[2] for k in finite), max(k[3] for k in finite)
    return max(k[1] for k in finite), lo, hi, note


def _missed_reason(missed: list[str]) -> str:
    return (
        f"sublayers {missed}: the tied norm's certified lower end exceeds the sum of its "
        "visits' upper ends, so a visit's Krylov run missed its top singular value and "
        "kappa's interval is not certified (another start usually finds it: seed=, or "
        "warm_visits toggled)"
    )


def _updates_problem(ups: Updates, in_R: pd.Series) -> list[str]:
    """The G check of :func:`per_visit_updates` (``sum_r G_{r,j}`` = tied update) failed for
    a sublayer kappa_R uses: its ``||sum_r G||`` is not the tied update's norm. A sublayer
    outside kappa_R (a head read out by ``F.linear``) is named in ``reason``, not fatal."""
    if ups.converged or not ups.outside_share:
        return []
    tol = [OUTSIDE_EPS * torch.finfo(t.dtype).eps for t in ups.G_tied]
    failed = [not s <= t for s, t in zip(ups.outside_share, tol, strict=True)]
    return [ups.reason] if any(f and bool(in_R[j]) for j, f in enumerate(failed)) else []


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
