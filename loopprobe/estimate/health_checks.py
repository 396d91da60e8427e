"""The health check's lines: the thresholds, the margins, and one function per check.

Each function below runs the estimate its check needs (or takes it from ``visit_alignment``'s
report) and turns it into rows of ``Health.frame`` (columns :data:`COLUMNS`). A row answers
two questions:

- ``reading``: is this a risk for training this model? ``fine``, ``risk`` (``advice`` says
  what to change: the learning rate, α/β, the scaling rule, damping) or ``cannot tell``
  (``advice`` says what would tell);
- ``verdict``: does the theory's premise or claim hold here (``holds`` / ``does not hold`` /
  ``cannot tell``)? For alignment and increments this is context (aligned or decorrelated,
  correlated or not: both are legitimate regimes), not a pass/fail.

Margins: a line decides only when the measured value's uncertainty lies on one side of its
threshold: κ_R's certified interval ``[kappa_lo, kappa_hi]`` (alignment, bound, scaling), the
eigenpair residual (spectral radius), and for cosines the 95 % Student-t interval of the
mean over the pairs it averages (≥ ``MIN_PAIRS`` pairs: distinct increment pairs, or
consecutive visit pairs per sublayer; a margin, the pairs share visits); else ``cannot tell``.

Checks and thresholds (the module constants):

- ``alignment`` (measurement; seed 002, Eq. 12): visits aligned, κ_R / R ≥ ``ALIGNED`` = 0.8
  (the tied update grows like R); κ_R ≤ ``DECORRELATED`` = 1.5 (κ_R/R ≈ 1/R) is named
  decorrelated, anything between partly aligned. κ_R is the max over sublayers (named).
- ``bound`` (measurement; Eqs. 13-16): ``M_g κ_R (β/α)² ≤ BOUND_MAX`` = 1 (DeepNorm's untied
  value is 1/2), next to DeepNorm's and DeepLoop's for the same κ_R at ``N = M_g / 2``
  (Eq. 22). Needs α (the weight of the carried stream in ``h ← α h + f(h)``) and β (the
  gain of f's initial weights).
- ``scaling`` (inference; Prop. 3.1, Eq. 15): the model's family exponent
  ``p = ln(α/β) / ln(16 N²)`` is at least ``(1 + γ)/4 - SCALING_TOL`` (0.025), with
  ``γ = ln κ_R / ln R`` (κ_R = Θ(R^γ) assumed).
- ``increments`` (measurement; seed 004): the largest mean off-diagonal cosine of a looped
  sublayer's increments ≥ ``CORRELATED`` = 0.5 (``|cos| ≤ UNCORRELATED`` = 0.2: uncorrelated).
- ``growth rule`` (inference; seeds 003/004): from the coherence ratio
  ``c = ‖Σ inc‖² / Σ ‖inc‖²`` of R increments, ``‖Σ inc‖ ∝ R^e`` with
  ``e = (1 + ln c / ln R) / 2`` (the exponent between 1 and R rounds); "1/√N keeps the growth
  flat" holds for ``e ≤ SQRT_RULE`` = 0.65, does not for ``e ≥ LINEAR_RULE`` = 0.85 (1/N
  needed); between: cannot tell. The size-weighted coherence ``m = (c − 1)/(R − 1)`` (the mean
  cosine when the increments have one size) says how far 1/√N carries: held fixed, it gives
  ``‖Σ inc‖² ∝ N (1 + (N − 1) m)``, linear in N beyond ``N ≈ 1/m``.
- ``fixed point`` (measurement; fixed-point framework): Picard from h_0 reaches
  ``‖T(h) − h‖ / ‖h‖ ≤ FIXED_POINT_TOL`` (1e-6 float64; ``FIXED_POINT_TOL_LOW`` = 1e-4
  otherwise) within ``fp_max_iter`` steps.
- ``spectral radius`` (measurement): ρ(∂T/∂h) < ``RHO_MAX`` = 1 at the state Picard reached
  (the fixed point, or the last Picard iterate when none was reached).
- ``oscillation`` (measurement; Fully Looped Transformer): every looped sublayer's mean
  consecutive ``cos(G_r, G_{r+1}) ≥ OSCILLATION`` = 0 (``lp.instability``'s default).
- ``explosion`` (measurement): ``max_r ‖G_r‖ / ‖G_last‖ ≤ EXPLOSION`` = 10 per sublayer.

Definitions: docs/definitions.md §2-4; guide: docs/guides/health.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch

from loopprobe import theory
from loopprobe.differentiate.roundmap import RoundMap
from loopprobe.estimate.alignment import AlignmentReport
from loopprobe.estimate.fixedpoint import fixed_point, spectral_radius
from loopprobe.estimate.increments import increments as _increments

HOLDS, FAILS, UNKNOWN = "holds", "does not hold", "cannot tell"
FINE, RISK = "fine", "risk"  # the reading; "cannot tell" is UNKNOWN
MEASUREMENT, INFERENCE = "measurement", "inference"
ALIGNED, DECORRELATED = 0.8, 1.5  # κ_R / R at or above: aligned; κ_R at or below: decorrelated
BOUND_MAX, SCALING_TOL = 1.0, 0.025  # M_g κ_R (β/α)² at most; p at least (1 + γ)/4 - this
CORRELATED, UNCORRELATED = 0.5, 0.2  # mean increment cosine at least; |cos| at most
SQRT_RULE, LINEAR_RULE = 0.65, 0.85  # growth exponent e: 1/√N suffices at most; 1/N at least
FIXED_POINT_TOL, FIXED_POINT_TOL_LOW = 1e-6, 1e-4  # fixed-point residual (float64; lower)
RHO_MAX, OSCILLATION, EXPLOSION = 1.0, 0.0, 10.0  # ρ below; cos(G_r, G_r+1) ≥; ‖G_r‖/‖G_R‖ ≤
MIN_PAIRS, CONFIDENCE = 3, 0.95  # cosines averaged: pairs needed; the t interval's level
#: the columns of ``Health.frame``, one row per check
COLUMNS = "check claim kind reading verdict value measured predicted threshold why advice".split()
FIX_STEP = (
    "pass step= / --step pkg.mod:fn (fn(model, inputs) -> lp.RoundMap, e.g. "
    "lp.replay_round(model, inputs, 'block')), or give the model step(h, x) and embed(inputs)"
)
FIX_SCALES = "pass alpha= and beta= / --alpha --beta (1 and 1 for a plain pre-norm loop)"
NO_RESIDUAL = (
    "α is the weight of the carried stream in h ← α·h + f(h), β the gain of f's initial "
    "weights; a loop with no residual across rounds (h ← f(h)) has no α and this line does "
    "not apply to it: read the spectral radius line"
)


def _judge(ok: bool, holds: bool) -> str:
    return (HOLDS if holds else FAILS) if ok else UNKNOWN


def _side(lo: float, hi: float, threshold: float, above: bool) -> bool | None:
    """True when all of [lo, hi] is on the holding side (≥ threshold when ``above``, else
    ≤), False when all of it is on the other, None when it straddles or is not finite."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return None
    if above:
        return True if lo >= threshold else False if hi < threshold else None
    return True if hi <= threshold else False if lo > threshold else None


def _verdict(side: bool | None) -> str:
    return UNKNOWN if side is None else HOLDS if side else FAILS


def mean_interval(values: Sequence[float]) -> tuple[float, float]:
    """(mean, half-width of its ``CONFIDENCE`` Student-t interval); inf below ``MIN_PAIRS``."""
    v = np.asarray(values, dtype=float)
    mean = float(v.mean()) if len(v) else math.nan
    if len(v) < MIN_PAIRS or not np.isfinite(v).all():
        return mean, math.inf
    from scipy.stats import t as student_t  # on call: scipy.stats costs ~1 s to import

    q = float(student_t.ppf(0.5 + CONFIDENCE / 2, len(v) - 1))
    return mean, q * float(v.std(ddof=1)) / math.sqrt(len(v))


def _spread(mean: float, half: float, pairs: int, what: str) -> str:
    if not math.isfinite(half):
        return f"{pairs} {what}: too few to judge a mean near its threshold (need {MIN_PAIRS})"
    return f"{mean:.3g} ± {half:.2g} ({CONFIDENCE:.0%} t interval over {pairs} {what})"


def _body(rep: AlignmentReport) -> pd.DataFrame:
    subs = rep.sublayers
    return subs[subs.role.eq("body")] if subs.role.eq("body").any() else subs


def _row(check: str, kind: str, verdict: str, value: float, measured: str, why: str = "",
         reading: str = UNKNOWN, advice: str = "") -> dict:  # fmt: skip
    claim, predicted, threshold = _CHECKS[check]
    row = [check, claim, kind, reading, verdict, value, measured, predicted, threshold, why]
    return dict(zip(COLUMNS, [*row, advice], strict=True))


# per check: the claim judged, what the theory predicts, the threshold (refined where measured)
_CHECKS = {
    "alignment": ("the visits are aligned (premise, context)", "aligned: κ_R/R → 1, the tied "
                  f"bound grows like R; decorrelated (κ_R ≤ {DECORRELATED:g}): κ_R/R ≈ 1/R",
                  f"κ_R/R ≥ {ALIGNED:g}"),
    "bound": ("the tied bound M_g κ_R (β/α)² is O(1)", "", f"M_g κ_R (β/α)² ≤ {BOUND_MAX:g}"),
    "scaling": ("α, β keep the bound flat in R", "p ≥ (1 + γ)/4 (κ_R = Θ(R^γ))",
                f"p ≥ (1 + γ)/4 − {SCALING_TOL:g}"),
    "increments": ("the increments are correlated (premise, context)",
                   "a shared block adds correlated increments",
                   f"mean cos ≥ {CORRELATED:g} (|cos| ≤ {UNCORRELATED:g}: uncorrelated)"),
    "growth rule": ("1/√N keeps ‖h_N − h_0‖ flat at this R", "correlated increments: e = 1, "
                    "flat only under 1/N; uncorrelated: e = 1/2, 1/√N suffices",
                    f"e ≤ {SQRT_RULE:g} holds, e ≥ {LINEAR_RULE:g} does not (needs 1/N)"),
    "fixed point": ("iterating one round reaches a fixed point",
                    "a stable loop's round has a reachable fixed point", "residual ≤ tol"),
    "spectral radius": ("the round contracts", "ρ < 1: the state attracts; ρ ≥ 1: "
                        "perturbations grow round to round", f"ρ(∂T/∂h) < {RHO_MAX:g}"),
    "oscillation": ("no gradient oscillation", "consecutive visits pull the same way (cos > 0)",
                    f"mean cos(G_r, G_r+1) ≥ {OSCILLATION:g}, outside its t interval"),
    "explosion": ("no gradient explosion back through the loop", "earlier visits' ‖G_r‖ stay "
                  "within a factor of the last", f"max_r ‖G_r‖/‖G_last‖ ≤ {EXPLOSION:g}"),
}  # fmt: skip


def _unknown(checks: Sequence[str], kinds: Sequence[str], why: str) -> list[dict]:
    return [
        _row(c, k, UNKNOWN, math.nan, "—", why, UNKNOWN, why)
        for c, k in zip(checks, kinds, strict=True)
    ]


# --------------------------------------------------------------------------- κ_R and the bound


def _kappa_interval(rep: AlignmentReport) -> tuple[float, float]:
    lo, hi = float(rep.kappa_lo), float(rep.kappa_hi)
    if math.isfinite(lo) and math.isfinite(hi):
        return lo, hi
    k = float(rep.kappa)
    return (k, k) if rep.converged and math.isfinite(k) else (math.nan, math.nan)


def alignment_rows(rep: AlignmentReport, scales: tuple) -> tuple[list[dict], dict]:
    body = _body(rep)
    top = body.loc[body.kappa.idxmax()] if body.kappa.notna().any() else body.iloc[0]
    kappa, R, M_g, name = float(rep.kappa), int(top.R_g), int(body.R_g.sum()), str(top.sublayer)
    lo, hi = _kappa_interval(rep)
    alpha, beta, where = scales
    N = max(M_g / 2, 1.0)
    values = {"kappa": kappa, "kappa_lo": lo, "kappa_hi": hi, "R": R, "N": N, "alpha": alpha,
              "beta": beta, "scales": where, "kappa_sublayer": name}  # fmt: skip
    unsure = "" if rep.converged else f"κ_R not converged: {rep.reason}"
    ratio = kappa / R
    regime = ["partly aligned", "decorrelated"][kappa <= DECORRELATED]
    side = _side(lo / R, hi / R, ALIGNED, above=True) if R > 1 else None
    span = f" ∈ [{lo / R:.3g}, {hi / R:.3g}]" if math.isfinite(lo) and lo != hi else ""
    meas = f"κ_R/R = {ratio:.3g}{span} (κ_R = {kappa:.3g}, the largest κ_j, of {name}; R = {R}): "
    meas += "aligned" if side else regime if side is False else "on the threshold"
    if R < 2:
        why, reading, advice = "one visit: κ = 1 by definition", UNKNOWN, "nothing to tell"
    elif side is None:
        why, reading = unsure or f"the certified interval straddles {ALIGNED:g}", UNKNOWN
        advice = "a tighter κ bound would tell: raise max_iter or lower tol"
    elif side:
        why, reading = unsure, RISK
        advice = (
            "aligned visits add up: the tied update grows like R, so more rounds need a "
            "learning rate ∝ 1/R or β/α scaled down (the bound and scaling lines)"
        )
    else:
        why, reading = unsure, FINE
        advice = "the visits' updates partly cancel: the tied update grows slower than R "
        advice += f"({regime})"
    rows = [_row("alignment", MEASUREMENT, _verdict(side), ratio, meas, why, reading, advice)]
    dn, dl = (theory.scales(N, s).ratio ** 2 * M_g * kappa for s in ("deepnorm", "deeploop"))
    compare = f"with this κ_R at N = M_g/2 = {N:g}: DeepNorm {dn:.3g}, DeepLoop {dl:.3g}"
    if alpha is None or beta is None:
        why = f"α, β unknown ({where or 'no model.cfg.alpha/beta or model.alpha/beta'})"
        why += f": {FIX_SCALES}"
        rows += _unknown(["bound", "scaling"], [MEASUREMENT, INFERENCE], why)
        rows[-2]["predicted"] = compare
        rows[-2]["advice"] = rows[-1]["advice"] = f"{FIX_SCALES}; {NO_RESIDUAL}"
        return rows, values
    s2 = M_g * (beta / alpha) ** 2
    bound = s2 * kappa
    values["bound"] = bound
    side = _side(s2 * lo, s2 * hi, BOUND_MAX, above=False)
    meas = f"{bound:.3g} (M_g = {M_g}, α = {alpha:.4g}, β = {beta:.4g}: {where})"
    if side is None:
        reading, advice = UNKNOWN, unsure or "κ_R's interval straddles the threshold: tighten it"
    elif side:
        reading, advice = FINE, "one SGD step moves F by O(lr ‖G‖) whatever R is"
    else:
        reading = RISK
        advice = (f"one step moves F about {bound:.3g}× more than an O(1) bound: lower the "
                  "learning rate by that factor, or use the scaling line's α, β")  # fmt: skip
    row = _row("bound", MEASUREMENT, _verdict(side), bound, meas, unsure, reading, advice)
    rows.append(row | {"predicted": compare})
    rows.append(_scaling_row(kappa, (lo, hi), R, N, alpha / beta, unsure, values))
    return rows, values


def _scaling_row(kappa, interval, R: int, N: float, a_over_b: float, unsure, values) -> dict:
    """The family exponent p of the model's α, β against the one that keeps the bound flat."""
    p = math.log(a_over_b) / math.log(16 * N * N)
    meas = f"p = {p:.3g} (β/α = 16^-p N^-2p at N = {N:g})"
    lo, hi = interval
    if R < 2 or not (math.isfinite(lo) and lo > 0 and kappa > 0):
        why = unsure or "one visit per sublayer or κ_R = 0: no growth of κ_R in R to read"
        return _row("scaling", INFERENCE, UNKNOWN, p, meas, why, UNKNOWN, why)

    def gamma_of(k: float) -> float:
        return min(max(math.log(k) / math.log(R), 0.0), 1.0)

    gamma = gamma_of(kappa)
    need, need_lo, need_hi = (theory.exponent_threshold(gamma_of(k)) for k in (kappa, lo, hi))
    sc = theory.scales(N, "postp", p=need)
    values.update(p=p, gamma=gamma, p_needed=need)
    pred = f"p ≥ {need:.3g} (γ = ln κ_R / ln R = {gamma:.3g}): α = {sc.alpha:.4g}, "
    pred += f"β = {sc.beta:.4g}"
    why = "assumes κ_R = Θ(R^γ) with γ read at this one R, and (c, d) = (2, 8)"
    side = True if p >= need_hi - SCALING_TOL else False if p < need_lo - SCALING_TOL else None
    reading = {True: FINE, False: RISK, None: UNKNOWN}[side]
    advice = {True: "α, β already scale for this growth of κ_R",
              False: f"use α = {sc.alpha:.4g}, β = {sc.beta:.4g} (p = {need:.3g}) at N = {N:g}",
              None: "κ_R's interval straddles the needed p: tighten it, or measure κ_R at a "
                    "second R"}[side]  # fmt: skip
    return _row("scaling", INFERENCE, _verdict(side), p, meas, why, reading, advice) | {
        "predicted": pred
    }


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
    c, name, n = cos[g], inc.groups[g], len(inc.cos[g])
    pairs = np.asarray(inc.cos[g], dtype=float)[np.triu_indices(n, 1)]
    _, half = mean_interval(pairs)
    ok = inc.converged and math.isfinite(c)
    unsure = "" if ok else f"increments not converged: {inc.reason}"
    side = _side(c - half, c + half, CORRELATED, above=True) if ok else None
    named = "partly correlated" if c > -UNCORRELATED else "anticorrelated"
    named = "correlated" if c >= CORRELATED else "uncorrelated" if abs(c) <= UNCORRELATED else named
    m = _coherence(inc.ratio[g], n)
    meas = f"mean cos = {_spread(c, half, len(pairs), 'pairs')} ({name}, increment = "
    meas += f"{inc.measured.get(name, inc.increment)}): {named}; size-weighted {m:.3g}"
    if side is None:
        reading, advice = (
            UNKNOWN,
            unsure
            or (f"the interval straddles {CORRELATED:g}: more rounds (more pairs) would tell"),
        )
    elif side:
        reading = RISK
        advice = (
            "the rounds push the state the same way: ‖h_N − h_0‖ grows faster than √N "
            "(the growth rule line says how fast, and which scaling keeps it flat)"
        )
    else:
        reading, advice = FINE, "the rounds' increments partly cancel or are independent"
    rows = [_row("increments", MEASUREMENT, _verdict(side), c, meas, unsure, reading, advice)]
    rows.append(_growth_row(inc, groups, ok, unsure))
    return rows, ([] if inc.converged else [f"increments: {inc.reason}"])


def _growth_row(inc, groups: list[int], ok: bool, unsure: str) -> dict:
    e_of = {g: _exponent(inc.ratio[g], len(inc.cos[g])) for g in groups}
    g = max(e_of, key=lambda k: e_of[k])
    e, n, ratio = e_of[g], len(inc.cos[g]), inc.ratio[g]
    m = _coherence(ratio, n)
    meas = f"e = {e:.3g} (coherence ratio {ratio:.3g} of R = {n}, {inc.groups[g]})"
    carry = f"size-weighted coherence m = {m:.3g}"
    if m > 0:
        carry += f": held fixed, 1/√N keeps the growth flat up to N ≈ {1 / m:.3g}, 1/N beyond"
    else:
        carry += " ≤ 0: held fixed, 1/√N suffices at any N"
    why = f"assumes the increments keep this size and correlation as R grows; {carry}"
    if not ok:
        verdict, reading, why, advice = UNKNOWN, UNKNOWN, unsure, unsure
    elif e <= SQRT_RULE:
        verdict, reading, advice = HOLDS, FINE, "1/√N residual scaling suffices at this R"
    elif e >= LINEAR_RULE:
        verdict, reading = FAILS, RISK
        advice = "scale each round's increment by 1/N (Loop-μP), not 1/√N"
    else:
        verdict, reading = UNKNOWN, UNKNOWN
        advice = "between the two rules: e read at a larger R would tell"
    return _row("growth rule", INFERENCE, verdict, e, meas, why, reading, advice)


def _offdiag(c) -> float:
    n = len(c)
    return float((c.sum() - c.trace()) / (n * (n - 1))) if n > 1 else math.nan


def _exponent(ratio: float, R: int) -> float:
    """e with ‖Σ_r inc_r‖ ∝ R^e, from the coherence ratio ‖Σ inc‖² / Σ ‖inc‖² of R visits."""
    if not (math.isfinite(ratio) and R > 1):
        return math.nan
    return 0.5 * (1.0 + math.log(max(ratio, 1e-300)) / math.log(R))


def _coherence(ratio: float, R: int) -> float:
    """m = (c − 1)/(R − 1): Σ_{r≠s} ⟨inc_r, inc_s⟩ / ((R − 1) Σ_r ‖inc_r‖²)."""
    return (ratio - 1.0) / (R - 1) if R > 1 and math.isfinite(ratio) else math.nan


# --------------------------------------------------------------------------- round map


def round_rows(rm: RoundMap | None, how: str, fp_max_iter: int) -> tuple[list[dict], list[str]]:
    """The fixed-point and spectral-radius rows of the round map ``rm`` (None: ``how`` says why)."""
    if rm is None:
        return _unknown(["fixed point", "spectral radius"], [MEASUREMENT] * 2, how), []
    f64 = rm.h0.dtype == torch.float64
    tol = FIXED_POINT_TOL if f64 else FIXED_POINT_TOL_LOW
    fp = fixed_point(rm.T, rm.h0, tol=tol, max_iter=fp_max_iter)
    meas = (
        f"{'reached' if fp.converged else 'not reached'} in {fp.iterations} Picard steps, "
        f"residual {fp.residual:.3g}, rate {fp.rate:.3g} ({how})"
    )
    why = "" if fp.converged else fp.reason
    advice = (
        "running more rounds than trained changes nothing once h* is reached"
        if fp.converged
        else "the state still moves after these rounds: more rounds at test time change the "
        "output; damp the round (h ← (1−λ)h + λT(h)) if you need a fixed point"
    )
    reading = FINE if fp.converged else RISK
    row = _row("fixed point", MEASUREMENT, _judge(True, fp.converged), fp.residual, meas, why,
               reading, advice)  # fmt: skip
    rows = [row | {"threshold": f"residual ≤ {tol:g} within {fp_max_iter} steps"}]
    sr = spectral_radius(rm.T, fp.h, k=2, tol=1e-6 if f64 else 1e-4)
    res = float(sr.residuals[0]) if len(sr.residuals) else math.inf
    where = (
        "at the fixed point Picard reached"
        if fp.converged
        else f"at Picard's last iterate (step {fp.iterations}; no fixed point reached)"
    )
    side = _side(sr.value * (1 - res), sr.value * (1 + res), RHO_MAX, above=False)
    side = side if side is not True or sr.value < RHO_MAX else None
    why = sr.reason if sr.converged else f"eigenvalues not certified: {sr.reason}"
    side = side if sr.converged else None
    reading = {True: FINE, False: RISK, None: UNKNOWN}[side]
    advice = {
        True: f"perturbations of the state shrink by about {sr.value:.3g} per round",
        False: f"perturbations grow by about {sr.value:.3g} per round: lower the round's "
        "gain (weight norms) or damp it, and watch the learning rate",
        None: "a certified eigenpair would tell: a larger eigensolver budget",
    }[side]
    meas = f"ρ = {sr.value:.4g} {where} (eigenpair residual {res:.2g})"
    rows.append(_row("spectral radius", MEASUREMENT, _verdict(side), sr.value, meas, why,
                     reading, advice))  # fmt: skip
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
        osc[name] = mean_interval([c[r, r - 1] for r in range(1, len(c))]) + (len(c) - 1,)
        exp[name] = float(g.max() / g[-1]) if g[-1] > 0 else math.inf
    checks = ["oscillation", "explosion"]
    if not osc:
        why = "no looped sublayer has two gradient-visible visits"
        return _unknown(checks, [MEASUREMENT] * 2, why)
    sides = {k: _side(m - h, m + h, OSCILLATION, above=True) for k, (m, h, _) in osc.items()}
    bad = [k for k, s in sides.items() if s is False]
    lo = min(bad or osc, key=lambda k: osc[k][0])
    side = False if bad else True if all(sides.values()) else None
    m, half, pairs = osc[lo]
    meas_o = f"mean cos(G_r, G_r+1) = {_spread(m, half, pairs, 'consecutive pairs')} ({lo})"
    reading = {True: FINE, False: RISK, None: UNKNOWN}[side]
    advice = {True: "consecutive visits' gradients pull the same way",
              False: "consecutive visits' gradients pull opposite ways and partly cancel: lower "
                     "the learning rate, or damp the round (a negative eigenvalue of ∂T/∂h "
                     "flips the sign round to round)",
              None: "the mean is within its noise of 0 (typical at initialization): more rounds, "
                    "or the same check on other batches or seeds, would tell"}[side]  # fmt: skip
    hi = max(exp, key=lambda k: exp[k])
    ok_e = exp[hi] <= EXPLOSION
    advice_e = (
        "earlier visits' gradients stay within a factor of the last"
        if ok_e
        else "earlier visits get over 10× the last one's gradient: clip per visit or lower "
        "the learning rate; the spectral radius line says whether the round expands"
    )
    return [
        _row("oscillation", MEASUREMENT, _verdict(side), m, meas_o, "", reading, advice),
        _row("explosion", MEASUREMENT, _judge(True, ok_e), exp[hi],
             f"max_r ‖G_r‖/‖G_last‖ = {exp[hi]:.3g} ({hi})", "", FINE if ok_e else RISK,
             advice_e),
    ]  # fmt: skip
