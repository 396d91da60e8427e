"""Eq. 15-16 and Proposition 3.1: the exponent threshold p >= (1 + gamma)/4.

Statement (seed 002, Eq. 15, 16, Prop. 3.1). In the family alpha = (cN)^p,
beta = (dN)^(-p) (c, d > 0), beta/alpha = (cd)^(-p) N^(-2p). With kappa_R = Theta(R^gamma),
gamma in [0, 1], at fixed K (R = N/K) the tied bound M kappa_R (beta/alpha)^2 is
Theta(N^(1 + gamma - 4p)), bounded in N iff p >= (1 + gamma)/4: gamma = 0 (decorrelated
visits) gives DeepNorm's 1/4, gamma = 1 (aligned) gives DeepLoop's 1/2. Eq. 16:
M R (beta/alpha)^2 = 2NR (cd)^(-2p) N^(-4p).

Checks:
- symbolic: Eq. 15 and 16 in sympy; the exponent of the bound is 1 + gamma - 4p; the
  threshold solves 1 + gamma - 4p = 0; ``theory.exponent_threshold``/``bound_exponent``
  agree.
- rate: on the reference LoopedGPT at initialisation (float64, K = 2, R in 1..8, one SGD
  step on the looped branches), the measured ||Delta F|| grows with log-log slope in R of
  1 under p = 1/4 and 0 under p = 1/2 (tolerance +-0.15). Measured twice: with
  ``lp.bound_check`` (d = 8; kappa_R by Lanczos on JVP/VJP, convergence required) and by
  brute force (d = 16, plain functional SGD step, mean over seeds); both must hold. At
  init the post-norm stream moves by O(beta/alpha) per visit, so visits are close to
  aligned (kappa_R ~ R), and the aligned bound
  M R (beta/alpha)^2 = 2KR^2 16^(-2p) (KR)^(-4p) ~ R^(2 - 4p) at fixed K:
  slope 1 for p = 1/4, 0 for p = 1/2.

Wrong variant: DeepNorm's p = 1/4 keeps the aligned tied ||Delta F|| bounded in R
(measured slope ~1, so it does not).

What a check cannot establish: gamma for a trained model (kappa is measured per model),
the constants C'', or that the threshold is where training actually breaks (Appendix C
brackets it empirically). The slope is measured on R <= 8 (16 with --thorough); an
asymptotic rate is only ever estimated.
"""

from __future__ import annotations

import functools

import numpy as np
import sympy as sp

import loopprobe as lp
from loopprobe import theory
from proofs_check._common import cross_entropy, loglog_slope, one_sgd_step_change, tiny_gpt, tokens
from proofs_check._registry import Outcome, Profile, statement, wrong_variant

REF = "seed 002, Eq. 15-16, Prop. 3.1"
N, c, d, R, K = sp.symbols("N c d R K", positive=True)
p, gamma = sp.symbols("p gamma", real=True)
LR = 1e-3
TOL = 0.15


@statement("Prop 3.1: bound ~ N^(1+gamma-4p), threshold p = (1+gamma)/4", REF, "symbolic")
def check_symbolic(profile: Profile) -> Outcome:
    ratio = sp.powsimp(sp.simplify((d * N) ** (-p) / (c * N) ** p), force=True)
    ok15 = sp.simplify(ratio - (c * d) ** (-p) * N ** (-2 * p)) == 0
    eq16 = sp.simplify(2 * N * R * ratio**2 - 2 * N * R * (c * d) ** (-2 * p) * N ** (-4 * p)) == 0
    bound = 2 * N * (N / K) ** gamma * ratio**2  # M kappa_R (beta/alpha)^2, kappa_R = R^gamma
    expo = sp.simplify(
        sp.expand_log(sp.log(bound.subs({c: 1, d: 1, K: 1}) / 2), force=True) / sp.log(N)
    )
    ok_exp = sp.simplify(expo - (1 + gamma - 4 * p)) == 0
    thr = sp.solve(sp.Eq(expo, 0), p)
    ok_thr = len(thr) == 1 and sp.simplify(thr[0] - (1 + gamma) / 4) == 0
    worst = 0.0
    for g in np.linspace(0, 1, 11 if not profile.wide else 101):
        worst = max(worst, abs(theory.exponent_threshold(float(g)) - (1 + g) / 4))
        for q in (0.1, 0.25, 0.5, 0.8):
            worst = max(worst, abs(theory.bound_exponent(q, float(g)) - (1 + g - 4 * q)))
    return Outcome(
        ok15 and eq16 and ok_exp and ok_thr and worst < 1e-12,
        f"exponent {sp.sstr(expo)}; threshold p = {sp.sstr(thr[0]) if thr else '?'}; "
        f"theory.py err {worst:.0e}",
    )


@functools.cache
def tied_sweep(
    norm: str, Rs: tuple[int, ...], seeds: int, K: int = 2
) -> tuple[tuple[float, ...], ...]:
    """Mean ||Delta F|| after one SGD step (lr 1e-3) per R, and M (beta/alpha)^2 per R."""
    dF, untied = [], []
    for r in Rs:
        vals = []
        for s in range(seeds):
            m = tiny_gpt(K, r, norm, d=16, vocab=32, T=8, seed=s)
            idx, tgt = tokens(32, 4, 8, s)
            vals.append(float(one_sgd_step_change(m, idx, tgt, LR)["dF"].norm()))
        dF.append(float(np.mean(vals)))
        untied.append(m.cfg.M * m.cfg.scales.ratio**2)
    return tuple(dF), tuple(untied)


@functools.cache
def lp_sweep(
    norm: str,
    Rs: tuple[int, ...],
    K: int = 2,
    seed: int = 0,
    p: float | None = None,
    predict_as: str | None = None,
) -> tuple[dict, ...]:
    """``lp.bound_check`` (one real SGD step, kappa by Lanczos on JVP/VJP) per R, d = 8.

    ``p``: the exponent of a ``postp`` model. ``predict_as``: compute the prediction with
    the alpha, beta of this scheme at the same N = K R instead of the model's own (a
    mis-specified prediction, for a wrong variant); None uses the model's.
    """
    idx, tgt = tokens(16, 2, 4, seed)
    rows = []
    for R in Rs:
        model = tiny_gpt(K, R, norm, p=p, seed=seed)
        ab = {}
        if predict_as is not None:
            sc = theory.scales(K * R, predict_as)
            ab = {"alpha": sc.alpha, "beta": sc.beta}
        with lp.attach(model) as probe:
            chk = lp.bound_check(
                probe,
                idx,
                lambda out, inp: cross_entropy(out, tgt),
                lr=LR,
                method="lanczos",
                max_iter=20,
                tol=1e-8,
                **ab,
            )
        rows.append(
            {
                "R": R,
                "kappa": chk.kappa,
                "dF": chk.dF_true,
                "prediction": chk.prediction,
                "C": chk.C,
                "converged": bool(chk.report.sublayers.converged.all()),
            }
        )
    return tuple(rows)


def _rs(profile: Profile) -> tuple[int, ...]:
    return (1, 2, 4, 8, 16) if profile.wide else (1, 2, 4, 8)


def _slopes(profile: Profile) -> dict[str, tuple[float, float, bool, float]]:
    """Per norm: (library slope, brute-force slope, all converged, kappa_R / R at max R)."""
    Rs = _rs(profile)
    out = {}
    for norm in ("deepnorm", "deeploop"):
        rows = lp_sweep(norm, Rs)
        out[norm] = (
            loglog_slope(Rs, [r["dF"] for r in rows]),
            loglog_slope(Rs, tied_sweep(norm, Rs, profile.seeds)[0]),
            all(r["converged"] for r in rows),
            rows[-1]["kappa"] / rows[-1]["R"],
        )
    return out


@statement("Prop 3.1 measured: aligned ||dF|| slope in R = 1 (p=1/4), 0 (p=1/2)", REF, "rate")
def check_rate(profile: Profile) -> Outcome:
    s = _slopes(profile)
    want = {"deepnorm": 1.0, "deeploop": 0.0}
    ok = all(
        abs(a - want[n]) <= TOL and abs(b - want[n]) <= TOL and conv
        for n, (a, b, conv, _) in s.items()
    )
    (a1, b1, _, k1), (a2, b2, _, k2) = s["deepnorm"], s["deeploop"]
    return Outcome(
        ok,
        f"slope p=1/4: {a1:.3f} (brute force {b1:.3f}), p=1/2: {a2:.3f} ({b2:.3f}); want 1, 0 "
        f"+-{TOL}; kappa_R/R at R={_rs(profile)[-1]}: {k1:.2f}, {k2:.2f}",
    )


@wrong_variant("DeepNorm p=1/4 keeps aligned tied ||dF|| bounded in R", REF, "rate")
def wrong_deepnorm_bounded(profile: Profile) -> Outcome:
    a, b, _, _ = _slopes(profile)["deepnorm"]
    return Outcome(
        abs(a) <= TOL and abs(b) <= TOL,
        f"slope p=1/4: {a:.3f} (brute force {b:.3f}); bounded would be 0 +-{TOL}",
    )
