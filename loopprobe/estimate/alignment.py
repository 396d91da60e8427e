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

from loopprobe._stats import cosine_matrix
from loopprobe.estimate.sensitivity import Sensitivity, sensitivity_norms
from loopprobe.estimate.sensitivity_runs import rounding_slack
from loopprobe.estimate.updates import OUTSIDE_EPS, Updates, per_visit_updates
from loopprobe.linalg import ROUNDOFF_EPS, norm_bounds
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


def default_kappa_tol(dtype: torch.dtype) -> float:
    """The default bound on kappa's error (absolute): 1e-6 in float64, 1e-3 in float32, 1e-2
    in half precision (never certified). In float32 the roundoff allowance of 100 eps on each
    norm alone puts kappa's bound near 2.4e-5 * kappa (1.05e-4 measured at kappa 2.15), so a
    1e-4 default would refuse a well-converged float32 kappa."""
    if dtype in (torch.float16, torch.bfloat16):
        return 1e-2
    return 1e-6 if dtype == torch.float64 else 1e-3


def kappa_interval(
    U_tied: tuple[float, float],
    U_visits: Sequence[tuple[float, float]],
    G_tied: float,
    G_norms: Sequence[float],
    eps: float,
) -> tuple[float, float]:
    """An interval holding the exact ``kappa_j``, from intervals ``(lo, hi)`` holding
    ``||sum_r U_{r,j}||`` and each ``||U_{r,j}||`` (:func:`loopprobe.linalg.norm_bounds`).

    kappa_j grows with the tied norm and falls with the largest visit norm, so the upper
    end takes the tied norm's upper end over the largest *lower* end of the visits and the
    lower end the reverse; G norms are exact up to roundoff (``ROUNDOFF_EPS * eps``). The
    triangle inequality bounds the tied norm by the visits' too, ``||sum_r U_{r,j}|| <=
    sum_r ||U_{r,j}|| <= sum_r hi_r``, and the smaller of the two upper ends is used: when
    the visits are aligned (kappa_j near R_j) that end is tight, and the tied operator needs
    only a lower end, which any Rayleigh quotient gives (issue 29.1). The interval is clipped
    to ``[0, R_j]``. With one visit kappa_j = 1 whatever its norm. Reference: seed 002, Eq. 12.
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


def tied_top(
    U_tied: tuple[float, float], U_visits: Sequence[tuple[float, float]], eps: float
) -> float:
    """The tied norm's upper end: the smaller of its own and ``sum_r hi_r``, unless the two
    contradict each other (:func:`visits_contradict`): then its own only."""
    own, total = U_tied[1], sum(hi for _, hi in U_visits)
    return own if visits_contradict(U_tied, U_visits, eps) else min(own, total)


def visits_contradict(
    U_tied: tuple[float, float], U_visits: Sequence[tuple[float, float]], eps: float
) -> bool:
    """The tied norm's lower end (a Rayleigh quotient: always a lower bound) exceeds the sum
    of the visits' upper ends: then a visit's Krylov run settled on a singular value below
    its top one (the caveat of :func:`loopprobe.linalg.norm_bounds`), and the visits' upper
    ends cannot all be trusted. Seen on a float32 LoopedGPT, d 32, R 8, with warm-started
    visits (issue 29): the tied lower end 7.982 against 7.977 from the visits. Since
    :func:`~loopprobe.estimate.sensitivity_runs.repair_tops` restarts such visits from the
    tied operator's top vector, it fires only where that restart failed too."""
    return U_tied[0] > sum(hi for _, hi in U_visits) * (1 + rounding_slack(eps))


#: The stopping rule spends this share of ``tol``: kappa's estimate still moves while the
#: last operators run, and the interval is recomputed at the end from the final estimates.
STOP_SHARE = 0.5


def kappa_stop(keys, visits, ups: Updates, tol: float, eps: float, each_visit: bool = False):
    """The stopping rule of :func:`visit_alignment` over the operators of
    :func:`~loopprobe.estimate.sensitivity.sensitivity_norms` (``keys``, ``visits``).

    kappa_j's estimate is off from the top of its interval by ``kappa_up (1 - a_t / top)``,
    where ``a_t`` is the tied norm's estimate and ``top`` the smaller of its own upper end
    and ``sum_r hi_r`` (:func:`kappa_interval`), and from the bottom by at most
    ``kappa_up (1 - lo_max / hi_r)`` for the visit r with the largest upper end, where
    ``kappa_up`` is the current upper end of kappa_j (or R_j) and ``lo_max`` the largest lower
    end of the visit norms (only grows). So the tied operator stops once its term is within
    ``STOP_SHARE * tol`` (with aligned visits often after one product, ``sum_r hi_r`` being
    tight), and a visit once its own term is; under ``warm_visits`` (the tied operator then
    starts from its visits' top vectors, and ``sum_r hi_r`` is worth making tight) also its
    width ``hi_r - lo_r`` must be within ``STOP_SHARE * tol * lo_max / (2 kappa_up)``. A
    visit far below the largest one stops as soon as it cannot be the max (and, under
    ``warm_visits``, its width is that small). ``rule.warm_visits`` is set by
    :func:`~loopprobe.estimate.sensitivity.sensitivity_norms`. Every visit runs at least until its
    interval is finite (residual ``TRUST_RESIDUAL``, 1e-2: each norm to about 0.5 %), and
    no operator beyond the roundoff floor of its residual (1e-12 in float64, 1e-5
    otherwise). ``each_visit``: every visit norm also to relative error ``tol``.
    """
    tied_of = {key[1]: b for b, key in enumerate(keys) if key[0] == "tied"}
    mine: dict[int, list[int]] = {}
    for b, key in enumerate(keys):
        if key[0] == "visit":
            mine.setdefault(visits[b].j, []).append(b)
    G = {j: (float(ups.tied(j).norm()), [float(ups.norms(j)[visits[b].r]) for b in bs])
         for j, bs in mine.items()}  # fmt: skip
    budget = STOP_SHARE * tol
    # Below this residual roundoff moves nothing: stop there even if tol is out of reach
    # (float32 at tol=1e-6 ran every operator to max_iter); the report then says so.
    floor = 1e-12 if eps <= torch.finfo(torch.float64).eps else 1e-5

    def rule(ops: torch.Tensor, sigma: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
        bounds = [norm_bounds(float(a), float(r), eps) for a, r in zip(sigma, res, strict=True)]
        may = torch.zeros(len(sigma), dtype=torch.bool)
        for j, bs in mine.items():
            vis = [bounds[b] for b in bs]
            if len(bs) == 1:  # kappa_j = 1; the norm only to a finite interval
                may[bs[0]] = bounds[bs[0]][1] < float("inf")
            else:
                t = tied_of[j]
                up = min(len(bs), kappa_interval(bounds[t], vis, *G[j], eps)[1])
                lo_max = max(lo for lo, _ in vis)
                a_t, top = float(sigma[t]), tied_top(bounds[t], vis, eps)
                may[t] = a_t == a_t and up * (1 - a_t / top) <= budget if top > 0 else True
                for b, (lo, hi) in zip(bs, vis, strict=True):
                    tight = not rule.warm_visits or (hi - lo) * 2 * up <= budget * lo_max
                    may[b] = lo_max > 0 and up * (1 - lo_max / hi) <= budget and tight
            if each_visit:
                for b in bs:
                    a, hi = float(sigma[b]), bounds[b][1]
                    may[b] &= bool(a == a and hi <= a * (1 + tol))
        return may[ops] | (res[ops] <= floor)

    rule.warm_visits = True  # type: ignore[attr-defined]  # set by sensitivity_norms
    return rule


@dataclass
class AlignmentReport:
    """kappa_R, one row per physical sublayer, one row per visit, and the Gram matrices.

    ``kappa_bar = sum_j R_j kappa_j / M_g`` is the visit-weighted aggregate of Eq. 21
    (``M_g kappa_bar`` is the per-sublayer sum of Eq. 20, never above ``M_g kappa_R``).
    ``gram_G[name]``/``cos_G[name]``: visit Gram and cosine matrices of ``G_{.,j}``;
    ``gram_UTw``/``cos_UTw``: the same for ``U_{.,j}^T w``. ``M``/``M_g``: forward- and
    gradient-visible visits (measured). ``update`` says which effective update G is.
    ``converged`` is True only when every U estimate converged, every kappa_j is a
    number in ``[0, R_j]`` and ``sum_r G_{r,j}`` is the tied update of every sublayer kappa_R
    uses (:func:`per_visit_updates` checks it; column ``G_outside_share``); ``reason`` says
    what is not (a sublayer's ``kappa_ok`` column marks its own kappa_j). ``kappa_err``:
    the certified bound on kappa_R's error, ``[kappa_lo, kappa_hi]`` the interval holding
    it (from every operator's residual certificate, :func:`kappa_interval`); ``tol`` the
    bound asked for (above it: not converged).
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
) -> AlignmentReport:
    """kappa_j per sublayer and kappa_R = max_j, from G (one backward) and U (power iteration).

    The visits counted are the gradient-visible ones (offsets that reach the loss); U is
    measured on the same visits with F picked by ``output=`` (default the model output).
    Every model evaluation runs with torch's RNG at ``seed`` (same dropout masks for G
    and every U product). See :func:`per_visit_updates` and :func:`sensitivity_norms`
    for the arguments (``loss_fn=None``: the model's own ``.loss``); ``memory="low"``
    keeps only G norms and tied sums (no G Gram matrices in the report). ``start``: an
    earlier report (or its ``sensitivity``) to warm-start the U estimates from
    (:func:`sensitivity_norms`; a training monitor).

    ``tol`` is the bound on kappa's error (absolute; default :func:`default_kappa_tol`: 1e-6
    in float64, 1e-3 in float32): each operator runs until the interval that its Ritz
    residual certificate puts around its norm (:func:`loopprobe.linalg.norm_bounds`),
    propagated through the max over visits and the ratio (:func:`kappa_interval`), holds
    every kappa_j, and so kappa_R, within ``tol`` (:func:`kappa_stop`); a visit that cannot
    be the max stops once that is certain, so its own ``U_norm`` may be looser (columns
    ``U_lo``/``U_hi``; ``each_visit=True`` also certifies each visit norm to relative
    ``tol``). ``kappa_err`` (the report's, and a column per sublayer with ``kappa_lo``,
    ``kappa_hi``) is the bound met; above ``tol`` the report is not converged. The bound
    assumes, like every Krylov estimate, that the start vectors overlap the top singular
    vectors. A training monitor affords ``tol=1e-2`` (3-4x fewer products). ``warm_visits``:
    as in :func:`sensitivity_norms` (each visit from its sublayer's previous one, the tied
    operator from its visits).
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
    dtype = ups.G_tied[0].dtype
    tol = default_kappa_tol(dtype) if tol is None else float(tol)
    if not tol > 0:
        raise ValueError(f"visit_alignment: tol={tol}; kappa's error bound must be > 0")
    keys = [("visit", v.i) for v in visible]
    keys += [("tied", j) for j in sorted({v.j for v in visible})
             if sum(v.j == j for v in visible) > 1]  # fmt: skip
    eps = float(torch.finfo(dtype).eps)
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
        stop=kappa_stop(keys, visible, ups, tol, eps, each_visit),
    )
    if sens.keys and sens.keys != keys:
        raise RuntimeError(f"visit_alignment: operator order {sens.keys} is not {keys}")
    subs = probe.sublayers()
    rep = _report(ups, sens, {s.name: s.role for s in subs}, tol)
    notes = [f"{s.name}: {s.note}" for s in subs if s.note and s.role == "body"]
    rep.kappa_note = "; ".join([rep.kappa_note, *notes] if rep.kappa_note else notes)
    return rep


def _report(
    ups: Updates, sens: Sensitivity, roles: dict | None = None, tol: float = float("inf")
) -> AlignmentReport:
    U_of = {v.i: est for v, est in zip(sens.visits, sens.visit_norms, strict=True)}
    eps = sens.eps

    def bounds(est: Any) -> tuple[float, float]:
        return norm_bounds(est.value, est.residual, eps) if est else (float("nan"),) * 2

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
                "U_lo": bounds(est)[0],
                "U_hi": bounds(est)[1],
                "G_norm": float(ups.norms(v.j)[v.r]),
                "converged": est.converged if est else None,
                "iterations": est.iterations if est else 0,
                "rel_change": est.rel_change if est else float("nan"),
            }
        )
    visits = pd.DataFrame(vrows)
    kappas, missed = [], []
    for j, name in enumerate(ups.sublayers):
        mine = visits[(visits.j == j) & visits.grad_visible]
        R = int((visits.j == j).sum())
        role = (roles or {}).get(name, "body")
        row: dict[str, Any] = {"sublayer": name, "j": j, "role": role, "R": R, "R_g": len(mine)}
        if len(mine) and j in sens.tied_norms:
            tied_U = sens.tied_norms[j]
            G_tied = float(ups.tied(j).norm())  # invisible visits contribute zero
            kappa = visit_kappa(tied_U.value, G_tied, list(mine.U_norm), list(mine.G_norm))
            U_b = list(zip(mine.U_lo, mine.U_hi, strict=True))
            k_lo, k_hi = kappa_interval(bounds(tied_U), U_b, G_tied, list(mine.G_norm), eps)
            if visits_contradict(bounds(tied_U), U_b, eps) or not k_lo <= k_hi:
                missed.append(name)  # a visit's norm is not its top singular value
            if ups.G is not None:
                gram = ups.gram(j)
                gram_G[name], cos_G[name] = gram, cosine_matrix(gram)
            if j in sens.UTw:
                g2 = sens.UTw[j] @ sens.UTw[j].T
                gram_UTw[name], cos_UTw[name] = g2, cosine_matrix(g2)
            kappas.append((role, kappa, k_lo, k_hi))
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
                G_outside_share=ups.outside_share[j] if ups.outside_share else float("nan"),
                tied_converged=tied_U.converged,
                converged=bool(tied_U.converged and mine.converged.all()) and name not in missed,
                cos_G_adjacent=_adjacent(cos_G[name]) if name in cos_G else float("nan"),
            )
        else:
            nan = float("nan")
            row.update(kappa=nan, kappa_err=nan, U_tied=nan, G_tied=nan)
        srows.append(row)
    # kappa_R: max over the loop body only; reuse that is not recurrence is listed, not used.
    finite = [k for k in kappas if not math.isnan(k[1]) and k[0] == "body"]
    out = [n for n in ups.sublayers if (roles or {}).get(n, "body") != "body"]
    note = f"kappa_R is over role='body' sublayers; excluded: {out}" if out else ""
    if not finite and out:
        finite = [k for k in kappas if not math.isnan(k[1])]
        note = f"no body sublayer: kappa_R is over every sublayer, including {out}"
    # kappa_R = max_j kappa_j lies between the largest lower and the largest upper end.
    kappa_R = max(k[1] for k in finite) if finite else float("nan")
    k_lo = max((k[2] for k in finite), default=float("nan"))
    k_hi = max((k[3] for k in finite), default=float("nan"))
    kappa_err = max(k_hi - kappa_R, kappa_R - k_lo) if finite else float("nan")
    sub = pd.DataFrame(srows)
    M_g = int(visits.grad_visible.sum())
    in_R = sub.role.eq("body") if sub.role.eq("body").any() else sub.role.notna()
    sub["kappa_ok"], flagged = _kappa_checks(sub)
    problems = [text for i, text in flagged.items() if in_R[i]]  # only what kappa_R uses
    counted = sub.kappa.notna() & (sub.R_g > 0) & in_R
    weighted = (sub.R_g * sub.kappa)[counted].sum()
    reasons = [sens.reason] if not sens.converged else []
    if missed:
        reasons.append(
            f"sublayers {missed}: the tied norm's certified lower end exceeds the sum of its "
            "visits' upper ends, so a visit's Krylov run missed its top singular value and "
            "kappa's interval is not certified (another start usually finds it: seed=, or "
            "warm_visits toggled)"
        )
        kappa_err = float("inf")
    elif finite and not kappa_err <= tol:
        reasons.append(f"kappa's error bound {kappa_err:.3g} exceeds tol={tol:g}")
    bad_G = _updates_problem(ups, in_R)
    notes = [ups.reason] if ups.reason and not bad_G else []  # checks that could not run
    return AlignmentReport(
        kappa=kappa_R,
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
        converged=not (reasons or problems or bad_G),
        reason="; ".join(reasons + bad_G + problems + notes),
        kappa_err=kappa_err,
        kappa_lo=k_lo,
        kappa_hi=k_hi,
        tol=tol,
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
