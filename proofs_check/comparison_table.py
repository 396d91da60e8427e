"""The DeepNorm vs DeepLoop comparison table of seed 002, cell by cell.

Statement (seed 002, the table after Eq. 16). With N = K R, M = 2N:

| row                          | DeepNorm          | DeepLoop          |
| alpha                        | (2N)^(1/4)        | (2N)^(1/2)        |
| beta (per-matrix init gain)  | (8N)^(-1/4)       | (8N)^(-1/2)       |
| beta/alpha                   | 1/(2 sqrt N)      | 1/(4N)            |
| untied bound M(beta/alpha)^2 | Theta(1)          | Theta(1/N)        |
| aligned tied MR(beta/alpha)^2, fixed K | Theta(R) | Theta(1/K)        |

Checks: every cell in sympy (a Theta cell holds when expr / rate has a finite non-zero
limit in the growing variable; the exact values are 1/2, 1/(8N), R/2, 1/(8K)); the same
values from ``loopprobe.theory`` on a grid.

Wrong variant (the issue's example): "DeepNorm keeps the aligned tied bound bounded in R";
its limit as R -> oo is infinite.

What a check cannot establish: which row matters for a given trained model; the table is
about upper bounds, kappa_R = R is the conservative case.
"""

from __future__ import annotations

import sympy as sp

from loopprobe import theory
from proofs_check._registry import Outcome, Profile, statement, wrong_variant

REF = "seed 002, table after Eq. 16"
K, R, Nn = sp.symbols("K R N", positive=True)


def _cells(p: sp.Rational) -> dict[str, sp.Expr]:
    N = K * R
    alpha, beta = (2 * N) ** p, (8 * N) ** (-p)
    ratio = sp.simplify(beta / alpha)
    return {
        "alpha": alpha,
        "beta": beta,
        "ratio": ratio,
        "untied": sp.simplify(2 * N * ratio**2),
        "aligned": sp.simplify(2 * N * R * ratio**2),
    }


def _theta(expr: sp.Expr, rate: sp.Expr, var: sp.Symbol) -> bool:
    lim = sp.limit(sp.simplify(expr / rate), var, sp.oo)
    return bool(lim.is_finite and lim != 0)


@statement("Comparison table DeepNorm vs DeepLoop (5 rows x 2 columns)", REF, "symbolic")
def check(profile: Profile) -> Outcome:
    q, h = sp.Rational(1, 4), sp.Rational(1, 2)
    dn, dl = _cells(q), _cells(h)
    N = K * R
    ok = [
        sp.simplify(dn["ratio"] - 1 / (2 * sp.sqrt(N))) == 0,
        sp.simplify(dl["ratio"] - 1 / (4 * N)) == 0,
        _theta(dn["untied"].subs(K, Nn / R), sp.Integer(1), Nn),
        _theta(dl["untied"].subs(K, Nn / R), 1 / Nn, Nn),
        _theta(dn["aligned"], R, R),
        _theta(dl["aligned"], 1 / K, K) and _theta(dl["aligned"], sp.Integer(1), R),
        sp.simplify(dn["aligned"] - R / 2) == 0,
        sp.simplify(dl["aligned"] - 1 / (8 * K)) == 0,
    ]
    worst = 0.0
    for k, r in [(1, 1), (2, 3), (4, 16), (12, 7)] + (
        [(k, r) for k in range(1, 9) for r in range(1, 33)] if profile.wide else []
    ):
        for name, p in (("deepnorm", q), ("deeploop", h)):
            sc = theory.scales(k * r, name)
            cells = _cells(p)
            want = {c: float(e.subs({K: k, R: r})) for c, e in cells.items()}
            got = {
                "alpha": sc.alpha,
                "beta": sc.beta,
                "ratio": sc.ratio,
                "untied": theory.untied_bound(k * r, sc),
                "aligned": theory.aligned_tied_bound(k, r, sc),
            }
            worst = max(worst, max(abs(got[c] / want[c] - 1) for c in want))
    return Outcome(
        all(ok) and worst < 1e-12,
        f"{sum(ok)}/{len(ok)} cells hold (DN: 1/2, R/2; DL: 1/(8N), 1/(8K)); "
        f"theory.py rel err {worst:.0e}",
    )


@wrong_variant("DeepNorm keeps the aligned tied bound bounded in R", REF, "symbolic")
def wrong_deepnorm_aligned(profile: Profile) -> Outcome:
    expr = _cells(sp.Rational(1, 4))["aligned"]
    lim = sp.limit(expr, R, sp.oo)
    return Outcome(bool(lim.is_finite), f"MR(beta/alpha)^2 = {sp.sstr(expr)} -> {lim} as R -> oo")
