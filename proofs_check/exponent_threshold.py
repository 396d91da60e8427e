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
  1 under p = 1/4 and 0 under p = 1/2 (tolerance +-0.15). At init the post-norm stream
  barely moves between visits (alpha > 1), so visits are close to aligned: the aligned
  bound's slope 2 - 4p... in R at fixed K is 1 - 4p + 1 = 2 - 4p, i.e. 1 and 0.

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

from loopprobe import theory
from proofs_check._common import loglog_slope, one_sgd_step_change, tiny_gpt, tokens
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


def _rs(profile: Profile) -> tuple[int, ...]:
    return (1, 2, 4, 8, 16) if profile.wide else (1, 2, 4, 8)


@statement("Prop 3.1 measured: aligned ||dF|| slope in R = 1 (p=1/4), 0 (p=1/2)", REF, "rate")
def check_rate(profile: Profile) -> Outcome:
    Rs = _rs(profile)
    s_dn = loglog_slope(Rs, tied_sweep("deepnorm", Rs, profile.seeds)[0])
    s_dl = loglog_slope(Rs, tied_sweep("deeploop", Rs, profile.seeds)[0])
    return Outcome(
        abs(s_dn - 1) <= TOL and abs(s_dl) <= TOL,
        f"slope p=1/4: {s_dn:.3f}, p=1/2: {s_dl:.3f} (want 1, 0 +-{TOL}; R={list(Rs)}, K=2)",
    )


@wrong_variant("DeepNorm p=1/4 keeps aligned tied ||dF|| bounded in R", REF, "rate")
def wrong_deepnorm_bounded(profile: Profile) -> Outcome:
    Rs = _rs(profile)
    s = loglog_slope(Rs, tied_sweep("deepnorm", Rs, profile.seeds)[0])
    return Outcome(abs(s) <= TOL, f"slope p=1/4: {s:.3f} (bounded would be 0 +-{TOL})")
