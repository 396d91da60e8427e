"""The health check's verdict lines: the thresholds, and one function per check.

Each function below runs the estimate its check needs (or takes it from ``visit_alignment``'s
report) and turns it into rows of ``Health.frame`` (columns :data:`COLUMNS`): measured,
predicted, threshold, verdict (``holds`` / ``does not hold`` / ``cannot tell``), why, kind.
:func:`loopprobe.estimate.health.health` runs them on one model and batch.

Checks and thresholds (the module constants):

- ``alignment`` (measurement; seed 002, Eq. 12): visits aligned, κ_R / R ≥ ``ALIGNED`` = 0.8
  (the tied bound grows like R); κ_R ≤ ``DECORRELATED`` = 1.5 (κ_R/R ≈ 1/R) is named
  decorrelated, anything between partly aligned.
- ``bound`` (measurement; Eqs. 13-16): ``M_g κ_R (β/α)² ≤ BOUND_MAX`` = 1 (DeepNorm's untied
  value is 1/2), next to DeepNorm's and DeepLoop's for the same κ_R at ``N = M_g / 2``
  (Eq. 22). Needs α, β.
- ``scaling`` (inference; Prop. 3.1, Eq. 15): the model's family exponent
  ``p = ln(α/β) / ln(16 N²)`` is at least ``(1 + γ)/4 - SCALING_TOL`` (0.025), with
  ``γ = ln κ_R / ln R`` (κ_R = Θ(R^γ) assumed).
- ``increments`` (measurement; seed 004): the largest mean off-diagonal cosine of a looped
  sublayer's increments ≥ ``CORRELATED`` = 0.5 (``|cos| ≤ UNCORRELATED`` = 0.2: uncorrelated).
- ``growth rule`` (inference; seeds 003/004): from the coherence ratio
  ``c = ‖Σ inc‖² / Σ ‖inc‖²`` of R increments, ``‖Σ inc‖ ∝ R^e`` with
  ``e = (1 + ln c / ln R) / 2`` if size and correlation stay as measured; "1/√N keeps the
  growth flat" holds for ``e ≤ SQRT_RULE`` = 0.65, does not for ``e ≥ LINEAR_RULE`` = 0.85
  (1/N needed); between: cannot tell.
- ``fixed point`` (measurement; fixed-point framework): Picard from h_0 reaches
  ``‖T(h) − h‖ / ‖h‖ ≤ FIXED_POINT_TOL`` (1e-6 float64; ``FIXED_POINT_TOL_LOW`` = 1e-4
  otherwise) within ``fp_max_iter`` steps.
- ``spectral radius`` (measurement): certified ρ(∂T/∂h) < ``RHO_MAX`` = 1 at the reached
  state (at the last iterate when none was reached).
- ``oscillation`` (measurement; Fully Looped Transformer): every looped sublayer's mean
  consecutive ``cos(G_r, G_{r+1}) ≥ OSCILLATION`` = 0 (``lp.instability``'s default).
- ``explosion`` (measurement): ``max_r ‖G_r‖ / ‖G_last‖ ≤ EXPLOSION`` = 10 per sublayer.

Definitions: docs/definitions.md §2-4; guide: docs/guides/health.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pandas as pd
import torch

from loopprobe import theory
from loopprobe.differentiate.roundmap import RoundMap
from loopprobe.estimate.alignment import AlignmentReport
from loopprobe.estimate.fixedpoint import fixed_point, spectral_radius
from loopprobe.estimate.increments import increments as _increments

HOLDS, FAILS, UNKNOWN = "holds", "does not hold", "cannot tell"
MEASUREMENT, INFERENCE = "measurement", "inference"
ALIGNED, DECORRELATED = 0.8, 1.5  # κ_R / R at or above: aligned; κ_R at or below: decorrelated
BOUND_MAX, SCALING_TOL = 1.0, 0.025  # M_g κ_R (β/α)² at most; p at least (1 + γ)/4 - this
CORRELATED, UNCORRELATED = 0.5, 0.2  # mean increment cosine at least; |cos| at most
SQRT_RULE, LINEAR_RULE = 0.65, 0.85  # growth exponent e: 1/√N suffices at most; 1/N at least
FIXED_POINT_TOL, FIXED_POINT_TOL_LOW = 1e-6, 1e-4  # fixed-point residual (float64; lower)
RHO_MAX, OSCILLATION, EXPLOSION = 1.0, 0.0, 10.0  # ρ below; cos(G_r, G_r+1) ≥; ‖G_r‖/‖G_R‖ ≤
#: the columns of ``Health.frame``, one row per check
COLUMNS = "check claim kind verdict value measured predicted threshold why".split()
FIX_STEP = (
    "pass step= / --step pkg.mod:fn (fn(model, inputs) -> lp.RoundMap, e.g. "
    "lp.replay_round(model, inputs, 'block')), or give the model step(h, x) and embed(inputs)"
)
FIX_SCALES = "pass alpha= and beta= / --alpha --beta (1 and 1 for a plain pre-norm loop)"


def _judge(ok: bool, holds: bool) -> str:
    return (HOLDS if holds else FAILS) if ok else UNKNOWN


def _body(rep: AlignmentReport) -> pd.DataFrame:
    subs = rep.sublayers
    return subs[subs.role.eq("body")] if subs.role.eq("body").any() else subs


def _row(check: str, kind: str, verdict: str, value: float, measured: str, why: str = "") -> dict:
    claim, predicted, threshold = _CHECKS[check]
    row = [check, claim, kind, verdict, value, measured, predicted, threshold, why]
    return dict(zip(COLUMNS, row, strict=True))


# per check: the claim judged, what the theory predicts, the threshold (refined where measured)
_CHECKS = {
    "alignment": ("the visits are aligned", "aligned: κ_R/R → 1, the tied bound grows like R; "
                  f"decorrelated (κ_R ≤ {DECORRELATED:g}): κ_R/R ≈ 1/R", f"κ_R/R ≥ {ALIGNED:g}"),
    "bound": ("the tied bound M_g κ_R (β/α)² is O(1)", "", f"M_g κ_R (β/α)² ≤ {BOUND_MAX:g}"),
    "scaling": ("α, β keep the bound flat in R", "p ≥ (1 + γ)/4 (κ_R = Θ(R^γ))",
                f"p ≥ (1 + γ)/4 − {SCALING_TOL:g}"),
    "increments": ("the increments are correlated", "a shared block adds correlated increments",
                   f"mean cos ≥ {CORRELATED:g} (|cos| ≤ {UNCORRELATED:g}: uncorrelated)"),
    "growth rule": ("1/√N keeps ‖h_N − h_0‖ flat at this R", "correlated increments: e = 1, "
                    "flat only under 1/N; uncorrelated: e = 1/2, 1/√N suffices",
                    f"e ≤ {SQRT_RULE:g} holds, e ≥ {LINEAR_RULE:g} does not (needs 1/N)"),
    "fixed point": ("iterating one round reaches a fixed point",
                    "a stable loop's round has a reachable fixed point", "residual ≤ tol"),
    "spectral radius": ("the round contracts", "ρ < 1: the state attracts; ρ ≥ 1: "
                        "perturbations grow round to round", f"ρ(∂T/∂h) < {RHO_MAX:g}"),
    "oscillation": ("no gradient oscillation", "consecutive visits pull the same way (cos > 0)",
                    f"mean cos(G_r, G_r+1) ≥ {OSCILLATION:g}"),
    "explosion": ("no gradient explosion back through the loop", "earlier visits' ‖G_r‖ stay "
                  "within a factor of the last", f"max_r ‖G_r‖/‖G_last‖ ≤ {EXPLOSION:g}"),
}  # fmt: skip


def _unknown(checks: Sequence[str], kinds: Sequence[str], why: str) -> list[dict]:
    return [_row(c, k, UNKNOWN, math.nan, "—", why) for c, k in zip(checks, kinds, strict=True)]


# --------------------------------------------------------------------------- κ_R and the bound


def alignment_rows(rep: AlignmentReport, scales: tuple) -> tuple[list[dict], dict]:
    body = _body(rep)
    top = body.loc[body.kappa.idxmax()] if body.kappa.notna().any() else body.iloc[0]
    kappa, R, M_g, name = float(rep.kappa), int(top.R_g), int(body.R_g.sum()), str(top.sublayer)
    alpha, beta, where = scales
    N = max(M_g / 2, 1.0)
    values = {"kappa": kappa, "R": R, "N": N, "alpha": alpha, "beta": beta, "scales": where}
    ok = rep.converged and math.isfinite(kappa)
    unsure = "" if ok else f"κ_R not converged: {rep.reason}"
    ratio = kappa / R
    regime = ["partly aligned", "decorrelated"][kappa <= DECORRELATED]
    meas = f"κ_R/R = {ratio:.3g} (κ_R = {kappa:.3g}, R = {R}, {name}): "
    meas += "aligned" if ratio >= ALIGNED else regime
    one = "one visit: κ = 1 by definition" if R < 2 else unsure
    verdict = _judge(ok and R > 1, ratio >= ALIGNED)
    rows = [_row("alignment", MEASUREMENT, verdict, ratio, meas, one)]
    dn, dl = (theory.scales(N, s).ratio ** 2 * M_g * kappa for s in ("deepnorm", "deeploop"))
    compare = f"with this κ_R at N = M_g/2 = {N:g}: DeepNorm {dn:.3g}, DeepLoop {dl:.3g}"
    if alpha is None or beta is None:
        why = f"α, β unknown ({where or 'no model.cfg.alpha/beta or model.alpha/beta'})"
        why += f": {FIX_SCALES}"
        rows += _unknown(["bound", "scaling"], [MEASUREMENT, INFERENCE], why)
        rows[-2]["predicted"] = compare
        return rows, values
    bound = M_g * kappa * (beta / alpha) ** 2
    values["bound"] = bound
    meas = f"{bound:.3g} (M_g = {M_g}, α = {alpha:.4g}, β = {beta:.4g}: {where})"
    verdict = _judge(ok, bound <= BOUND_MAX)
    rows.append(_row("bound", MEASUREMENT, verdict, bound, meas, unsure) | {"predicted": compare})
    rows.append(_scaling_row(kappa, R, N, alpha / beta, ok, unsure, values))
    return rows, values


def _scaling_row(kappa: float, R: int, N: float, a_over_b: float, ok, unsure, values) -> dict:
    """The family exponent p of the model's α, β against the one that keeps the bound flat."""
    p = math.log(a_over_b) / math.log(16 * N * N)
    meas = f"p = {p:.3g} (β/α = 16^-p N^-2p at N = {N:g})"
    if R < 2 or not ok or not kappa > 0:
        why = unsure or "one visit per sublayer or κ_R = 0: no growth of κ_R in R to read"
        return _row("scaling", INFERENCE, UNKNOWN, p, meas, why)
    gamma = min(max(math.log(kappa) / math.log(R), 0.0), 1.0)
    need = theory.exponent_threshold(gamma)
    sc = theory.scales(N, "postp", p=need)
    values.update(p=p, gamma=gamma, p_needed=need)
    pred = f"p ≥ {need:.3g} (γ = ln κ_R / ln R = {gamma:.3g}): α = {sc.alpha:.4g}, "
    pred += f"β = {sc.beta:.4g}"
    why = "assumes κ_R = Θ(R^γ) with γ read at this one R, and (c, d) = (2, 8)"
    verdict = HOLDS if p >= need - SCALING_TOL else FAILS
    return _row("scaling", INFERENCE, verdict, p, meas, why) | {"predicted": pred}


# --------------------------------------------------------------------------- increments


def increment_rows(probe, inputs, forward, increment, rep) -> tuple[list[dict], list[str]]:
    checks, kinds = ["increments", "growth rule"], [MEASUREMENT, INFERENCE]
    try:
        inc = _increments(probe, inputs, forward=forward, increment=increment or "auto")
    except ValueError as err:
        return _unknown(checks, kinds, f"{err} (pass increment= / --increment)"), []
    names = set(_body(rep).sublayer)
    groups = [g for g, n in enumerate(inc.groups) if n in names] or list(range(len(inc.groups)))
    groups = [g for g in groups if len(inc.cos[g]) > 1]
    if not groups:
        return _unknown(checks, kinds, "no looped sublayer has two visits to compare"), []
    cos = {g: _offdiag(inc.cos[g]) for g in groups}
    g = max(cos, key=lambda k: cos[k])
    c, name = cos[g], inc.groups[g]
    ok = inc.converged and math.isfinite(c)
    unsure = "" if ok else f"increments not converged: {inc.reason}"
    named = "partly correlated" if c > -UNCORRELATED else "anticorrelated"
    named = "correlated" if c >= CORRELATED else "uncorrelated" if abs(c) <= UNCORRELATED else named
    meas = f"mean cos = {c:.3g} ({name}, increment = {inc.measured.get(name, inc.increment)}): "
    verdict = _judge(ok, c >= CORRELATED)
    rows = [_row("increments", MEASUREMENT, verdict, c, meas + named, unsure)]
    e_of = {g: _exponent(inc.ratio[g], len(inc.cos[g])) for g in groups}
    g = max(e_of, key=lambda k: e_of[k])
    e = e_of[g]
    n, ratio = len(inc.cos[g]), inc.ratio[g]
    meas = f"e = {e:.3g} (coherence ratio {ratio:.3g} of R = {n}, {inc.groups[g]})"
    why = "assumes the increments keep this size and correlation as R grows"
    if not ok:
        verdict, why = UNKNOWN, unsure
    elif e <= SQRT_RULE:
        verdict = HOLDS
    elif e >= LINEAR_RULE:
        verdict, why = FAILS, f"the 1/N rule (Loop-μP) matches; {why}"
    else:
        verdict, why = UNKNOWN, f"between the two rules; {why}"
    rows.append(_row("growth rule", INFERENCE, verdict, e, meas, why))
    return rows, ([] if inc.converged else [f"increments: {inc.reason}"])


def _offdiag(c) -> float:
    n = len(c)
    return float((c.sum() - c.trace()) / (n * (n - 1))) if n > 1 else math.nan


def _exponent(ratio: float, R: int) -> float:
    """e with ‖Σ_r inc_r‖ ∝ R^e, from the coherence ratio ‖Σ inc‖² / Σ ‖inc‖² of R visits."""
    if not (math.isfinite(ratio) and R > 1):
        return math.nan
    return 0.5 * (1.0 + math.log(max(ratio, 1e-300)) / math.log(R))


# --------------------------------------------------------------------------- round map


def round_rows(rm: RoundMap | None, how: str, fp_max_iter: int) -> tuple[list[dict], list[str]]:
    """The fixed-point and spectral-radius rows of the round map ``rm`` (None: ``how`` says why)."""
    if rm is None:
        return _unknown(["fixed point", "spectral radius"], [MEASUREMENT] * 2, how), []
    f64 = rm.h0.dtype == torch.float64
    tol = FIXED_POINT_TOL if f64 else FIXED_POINT_TOL_LOW
    fp = fixed_point(rm.T, rm.h0, tol=tol, max_iter=fp_max_iter)
    meas = (
        f"{'reached' if fp.converged else 'not reached'} in {fp.iterations} steps, residual "
        f"{fp.residual:.3g}, rate {fp.rate:.3g} ({how})"
    )
    why = "" if fp.converged else fp.reason
    row = _row("fixed point", MEASUREMENT, _judge(True, fp.converged), fp.residual, meas, why)
    rows = [row | {"threshold": f"residual ≤ {tol:g} within {fp_max_iter} steps"}]
    sr = spectral_radius(rm.T, fp.h, k=2, tol=1e-6 if f64 else 1e-4)
    where = "at the fixed point" if fp.converged else "at the last iterate (no fixed point reached)"
    why = sr.reason if sr.converged else f"eigenvalues not certified: {sr.reason}"
    verdict = _judge(sr.converged, sr.value < RHO_MAX)
    rows.append(
        _row("spectral radius", MEASUREMENT, verdict, sr.value, f"ρ = {sr.value:.4g} {where}", why)
    )
    return rows, ([] if sr.converged else [f"spectral radius: {sr.reason}"])


# --------------------------------------------------------------------------- gradient health


def gradient_rows(rep: AlignmentReport) -> list[dict]:
    """Oscillation and explosion of the per-visit G of the looped sublayers (one backward)."""
    body = _body(rep)
    vis = rep.visits[rep.visits.sublayer.isin(set(body.sublayer))]
    vis = vis[vis.grad_visible.astype(bool)]
    osc, exp = {}, {}
    for name, sub in vis.groupby("sublayer", sort=False):
        g = sub.sort_values("r").G_norm.to_numpy(dtype=float)
        cos = rep.cos_G.get(name)
        if len(g) < 2 or cos is None:
            continue
        c = cos.double().cpu().numpy()
        osc[name] = float(sum(c[r, r - 1] for r in range(1, len(c))) / (len(c) - 1))
        exp[name] = float(g.max() / g[-1]) if g[-1] > 0 else math.inf
    checks = ["oscillation", "explosion"]
    if not osc:
        why = "no looped sublayer has two gradient-visible visits"
        return _unknown(checks, [MEASUREMENT] * 2, why)
    lo, hi = min(osc, key=lambda k: osc[k]), max(exp, key=lambda k: exp[k])
    meas_o, meas_e = f"mean cos(G_r, G_r+1) = {osc[lo]:.3g} ({lo})", "max_r ‖G_r‖/‖G_last‖"
    return [
        _row("oscillation", MEASUREMENT, _judge(True, osc[lo] >= OSCILLATION), osc[lo], meas_o),
        _row("explosion", MEASUREMENT, _judge(True, exp[hi] <= EXPLOSION), exp[hi],
             f"{meas_e} = {exp[hi]:.3g} ({hi})"),
    ]  # fmt: skip
