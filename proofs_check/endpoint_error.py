"""Eq. 11 of arXiv 2609.16665: the quadratic model's endpoint error is at most C(1).

Statement (PAPERS.md 2a; the paper's Sec. 3.3, Eq. 10-11 and App. A.5.1). With
C(a) := int_0^a |phi''(s) - phi''(0)| ds, under Assumption 3.1

    |Delta U - (A + Q)| <= C(1),

and in particular A + Q has the sign of Delta U whenever |A + Q| > C(1) (no sign
restriction on A or Q).

Check (property, float64): hypothesis draws transitions (affine / tanh-MLP / quadratic
readouts, a tiny LoopedGPT round, sizes 0.01..4, and constructed gains whose curvature has
a bump of height k1 at s = w, ``_paths.shaped_path("bump")``, where the bound is nearly
attained). Delta U = phi(1), A and Q from ``lp.finite_step`` (forward-mode AD);
C(1) by composite Simpson on 2049 points of |phi'' - 2Q| (``Path.phi2``; the integrand has
kinks, so its quadrature error is in the slack: 1e-9 absolute plus 1e-4 relative). Assert
the bound, and the sign statement on every draw with |A + Q| beyond the slackened C(1).
``target`` pushes |Delta U - (A + Q)| / C(1) up; ``@example`` pins the quadratic utility
(C(1) = 0: A + Q must equal Delta U to 1e-9) and a narrow bump (w = 0.01: ratio ~0.98).

Wrong variant: the bound halved, |Delta U - (A + Q)| <= C(1)/2 (the weight (1 - s) of
Prop. 3.3 replaced by its mean 1/2): the error is int_0^1 (1 - s)(phi'' - phi''(0)) ds,
and a deviation concentrated near s = 0 keeps almost all of C(1), so the bump refutes it.

What a check cannot establish: the paper's finding that C(1) is small on trained models,
or its floating-point error accounting for BF16 states (we work in float64 throughout).
"""

from __future__ import annotations

import numpy as np
from hypothesis import example, given, target
from hypothesis import strategies as st
from scipy.integrate import simpson

from proofs_check._common import Tightest, falsified
from proofs_check._paths import make, shaped_path
from proofs_check._registry import Outcome, Profile, statement, wrong_variant

REF = "arXiv 2609.16665, Eq. 10-11, App. A.5.1"
KINDS = ("affine", "mlp", "quadratic", "looped", "bump")


def quantities(path) -> dict:
    t = path.taylor()
    s = np.linspace(0, 1, 2049)
    C = float(simpson(np.abs(path.phi2(s) - 2 * float(t.Q[0])), x=s))
    return {"dU": float(t.gain[0]), "pred": float(t.predicted[0]), "C": C}


def _property(profile: Profile, factor: float) -> Outcome:
    tight, signs = Tightest(), [0, 0]

    @profile.hypothesis(examples=16)
    @given(
        kind=st.sampled_from(KINDS),
        seed=st.integers(0, 10**5),
        scale=st.floats(0.01, 4.0),
        k1=st.floats(0.5, 30.0),
        w=st.floats(0.01, 0.5),
    )
    @example(kind="quadratic", seed=3, scale=2.0, k1=1.0, w=0.1)
    @example(kind="bump", seed=0, scale=1.0, k1=10.0, w=0.01)
    def prop(kind, seed, scale, k1, w):
        if kind == "bump":
            path = shaped_path(seed, "bump", 0.5, 2.0, k1, w)
        else:
            path = make(seed, kind, scale)
        q = quantities(path)
        err, C = abs(q["dU"] - q["pred"]), q["C"]
        bound = factor * C * (1 + 1e-4) + 1e-9
        ratio = err / C if C > 1e-6 else 0.0  # C ~ 0: only the absolute slack applies
        target(min(ratio, 1e6), label="|dU - (A+Q)| / C(1)")
        tight.see(ratio, f"{kind}, scale {scale:.2f}")
        assert err <= bound, (kind, err, C)
        if abs(q["pred"]) > bound:
            signs[0] += 1
            signs[1] += np.sign(q["pred"]) == np.sign(q["dU"])
            assert np.sign(q["pred"]) == np.sign(q["dU"]), q

    why = falsified(prop)
    return Outcome(
        why is None,
        f"tightest |dU - (A+Q)| / C(1) = {tight.ratio:.3f} at {tight.where}; sign(A+Q) = "
        f"sign(dU) on {signs[1]}/{signs[0]} draws with |A+Q| > C(1) ({tight.count} draws)"
        + (f"; {why}" if why else ""),
    )


@statement("Eq 11: |dU - (A+Q)| <= C(1); sign(A+Q) = sign(dU) if |A+Q| > C(1)", REF, "property")
def check(profile: Profile) -> Outcome:
    return _property(profile, 1.0)


@wrong_variant("Eq 11 halved: |dU - (A+Q)| <= C(1)/2", REF, "property")
def wrong_half(profile: Profile) -> Outcome:
    return _property(profile, 0.5)
