"""Theorem 3.6 of arXiv 2609.16665: the quadratic step scale is within C(1)/kappa of the best.

Statement (PAPERS.md 2a). Let Q = phi''(0)/2 < 0, kappa = -2Q, the quadratic model's scale
alpha_hat = clip_[0,1](-A/(2Q)) = clip(A/kappa), alpha* a maximiser of phi on [0, 1], and
C(1) = int_0^1 |phi''(s) - phi''(0)| ds. Then
|alpha_hat - alpha*| <= min{1, C(1)/kappa}, and the regret
0 <= phi(alpha*) - phi(alpha_hat) <= C(1)^2/(2 kappa).

Check (property, float64): hypothesis draws transitions (affine / tanh-MLP / quadratic
readouts, a tiny LoopedGPT round; sizes 0.01..4) with Q < 0. alpha_hat, A, Q from
``lp.finite_step``; alpha* by a 201-point grid of ``path_gains``, a finer grid around
the best point and the vertex of the parabola through its neighbours; C(1) by composite
Simpson on 2049 points of phi'' (the integrand has kinks, so we allow its error in the
slack: 1e-6 absolute plus 1e-4 relative). ``target`` pushes
|alpha_hat - alpha*| / min{1, C/kappa} up; ``@example`` pins the quadratic utility
(C(1) = 0, so alpha_hat must equal alpha*) and a strongly curved tanh readout.

Wrong variant: the first-order rule "take the full step, alpha = 1, whenever A > 0" is
within C(1)/kappa of alpha*: the quadratic example (C = 0, alpha* < 1) refutes it.

What a check cannot establish: uniqueness of alpha* (any maximiser satisfies the bound; we
find one), or the paper's empirical claim that C(1)/kappa is small on real models.
"""

from __future__ import annotations

import numpy as np
from hypothesis import assume, example, given, target
from hypothesis import strategies as st
from scipy.integrate import simpson

from proofs_check._common import Tightest, falsified
from proofs_check._paths import argmax_on_grid, make
from proofs_check._registry import Outcome, Profile, statement, wrong_variant

REF = "arXiv 2609.16665, Thm. 3.6"
KINDS = ("affine", "mlp", "quadratic", "looped")


def quantities(seed: int, kind: str, scale: float) -> dict | None:
    path = make(seed, kind, scale)
    t = path.taylor()
    A, Q, a_hat = float(t.A[0]), float(t.Q[0]), float(t.alpha_hat[0])
    if not Q < 0:
        return None
    kappa = -2 * Q
    a_star, best = argmax_on_grid(path.phi)
    s = np.linspace(0, 1, 2049)
    C = float(simpson(np.abs(path.phi2(s) - 2 * Q), x=s))
    return {
        "A": A,
        "kappa": kappa,
        "a_hat": a_hat,
        "a_star": a_star,
        "C": C,
        "regret": best - float(path.phi([a_hat])[0]),
    }


@statement("Thm 3.6: |alpha_hat - alpha*| <= min{1, C(1)/kappa}", REF, "property")
def check(profile: Profile) -> Outcome:
    tight, reg = Tightest(), Tightest()

    @profile.hypothesis(examples=20)
    @given(seed=st.integers(0, 10**5), kind=st.sampled_from(KINDS), scale=st.floats(0.01, 4.0))
    @example(seed=0, kind="quadratic", scale=0.5)
    @example(seed=5, kind="mlp", scale=2.0)
    def prop(seed, kind, scale):
        q = quantities(seed, kind, scale)
        assume(q is not None)
        bound = min(1.0, q["C"] / q["kappa"])
        err = abs(q["a_hat"] - q["a_star"])
        slack = 1e-6 + 1e-4 * bound
        ratio = err / (bound + slack)
        target(ratio, label="|a_hat - a*| / bound")
        tight.see(ratio, f"{kind}, scale {scale:.2g}")
        rb = q["C"] ** 2 / (2 * q["kappa"])
        reg.see(q["regret"] / (rb + 1e-9), kind)
        assert err <= bound + slack, q
        assert -1e-9 <= q["regret"] <= rb * (1 + 2e-4) + 1e-9, q

    why = falsified(prop)
    return Outcome(
        why is None,
        f"tightest |a_hat - a*|/bound {tight.ratio:.3f} ({tight.where}); tightest regret/bound "
        f"{reg.ratio:.3f} ({tight.count} paths)" + (f"; {why}" if why else ""),
    )


@wrong_variant("full step alpha = 1 is within C(1)/kappa of alpha* when A > 0", REF, "property")
def wrong_full_step(profile: Profile) -> Outcome:
    worst = Tightest()

    @profile.hypothesis(examples=20)
    @given(seed=st.integers(0, 10**5), kind=st.sampled_from(KINDS), scale=st.floats(0.01, 4.0))
    @example(seed=0, kind="quadratic", scale=3.0)
    def prop(seed, kind, scale):
        q = quantities(seed, kind, scale)
        assume(q is not None and q["A"] > 0)
        bound = min(1.0, q["C"] / q["kappa"])
        worst.see(
            abs(1 - q["a_star"]) - bound, f"{kind}: alpha*={q['a_star']:.3f}, bound={bound:.2g}"
        )
        assert abs(1 - q["a_star"]) <= bound + 1e-6 + 1e-4 * bound, q

    why = falsified(prop)
    return Outcome(
        why is None, f"counterexample: {worst.where}" if why else "no counterexample found"
    )
