"""DeepLoop constants: beta/alpha = 1/(4N) and M R (beta/alpha)^2 = 1/(8K).

Statement (seed 002, Eq. 7, 8 and the display after Eq. 16). DeepLoop keeps the DeepNorm
architecture and constants (c, d) = (2, 8) but raises the exponent to p = 1/2:
alpha = (2N)^(1/2), beta = (8N)^(-1/2) (a per-matrix init gain, Eq. 7). Then
beta/alpha = 1/(4N), and with N = K R, M = 2N the aligned tied-loop bound is
M R (beta/alpha)^2 = 2NR / (16 N^2) = 1/(8K): independent of R at fixed physical depth K.

Assumptions: K, R >= 1; M = 2KR; the aligned worst case kappa_R = R.

Checks: the identities in sympy; ``theory.scales``/``aligned_tied_bound`` against them on
a grid; the reference LoopedGPT's DeepLoop init is beta times the same unscaled draw on
exactly the DeepNorm matrix set (Eq. 7).

What a check cannot establish: that kappa_R = R is the worst case a trained model meets,
or that bounded first-order change means stable training (Appendix C's sweep is empirical).
"""

from __future__ import annotations

import sympy as sp

from loopprobe import theory
from proofs_check._registry import Outcome, Profile, statement
from proofs_check.deepnorm_constants import init_gain_ratios

REF = "seed 002, Eq. 7-8"
K, R = sp.symbols("K R", positive=True, integer=True)
N = K * R


@statement("DeepLoop: beta/alpha = 1/(4N), M R (beta/alpha)^2 = 1/(8K)", REF, "symbolic")
def check(profile: Profile) -> Outcome:
    alpha = (2 * N) ** sp.Rational(1, 2)
    beta = (8 * N) ** sp.Rational(-1, 2)
    ratio = sp.simplify(beta / alpha)
    aligned = sp.simplify(2 * N * R * ratio**2)
    ok = sp.simplify(ratio - 1 / (4 * N)) == 0 and sp.simplify(aligned - 1 / (8 * K)) == 0
    grid = [(k, r) for k in (1, 2, 3, 12) for r in (1, 2, 5, 64)]
    if profile.wide:
        grid += [(k, r) for k in range(1, 20) for r in range(1, 40, 3)]
    worst = 0.0
    for k, r in grid:
        sc = theory.scales(k * r, "deeploop")
        worst = max(
            worst,
            abs(sc.ratio * 4 * k * r - 1),
            abs(theory.aligned_tied_bound(k, r, sc) * 8 * k - 1),
        )
    gains = init_gain_ratios("deeploop")
    return Outcome(
        ok and worst < 1e-12 and max(gains.values()) < 1e-6,
        f"beta/alpha={sp.sstr(ratio)}; MR(beta/alpha)^2={sp.sstr(aligned)}; "
        f"theory.py rel err {worst:.0e}; init W=beta*W~ to {max(gains.values()):.0e}",
    )
