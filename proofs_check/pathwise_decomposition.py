"""Proposition 3.3 of "Right Direction, Wrong Step" (arXiv 2609.16665): pathwise decomposition.

Statement (PAPERS.md 2a; seed 003 is this paper's title). For a transition H -> F(H) with
D = F(H) - H and a C^2 utility U (Assumption 3.1), the gain phi(alpha) = U(H + alpha D) - U(H)
satisfies, for alpha in [0, 1],

    phi(alpha) = alpha A + int_0^alpha (alpha - s) phi''(s) ds,   A = phi'(0) = <grad U(H), D>.

Consequently a finite-step failure (A > 0 but phi(1) < 0) has int_0^1 (1-s) phi''(s) ds < -A < 0:
the curvature along the path, not the direction, is at fault.

Check (exact, by quadrature; float64): hypothesis draws transitions (random Gaussian H, D
of size 0.01..4 with an affine, a tanh-MLP or a quadratic readout, or one round of a tiny
LoopedGPT with an affine readout) and alpha in (0, 1]; phi from ``path_gains``, A and
phi''(s) from ``lp.finite_step`` (forward-mode AD), the integral by Gauss-Legendre with the
nodes doubled (32..1024) until two rules agree to 1e-12 (a fixed 48-node rule was not
enough for large steps through the tanh readout: phi'' oscillates).
Assert |phi(alpha) - RHS| <= 1e-9 (1 + |phi(alpha)|); on every finite-step failure met,
assert the corollary's strict inequality. ``@example`` pins the quadratic utility (phi''
constant) and a strongly curved large step.

Wrong variant: the quadratic model as an identity, phi(alpha) = alpha A + alpha^2 Q with
Q = phi''(0)/2: its error on the same draws is far above 1e-9.

What a check cannot establish: the identity for utilities that are not C^2 (the paper's
assumption), or anything about how often finite-step failures occur in real models.
"""

from __future__ import annotations

from hypothesis import example, given, target
from hypothesis import strategies as st

from proofs_check._common import Tightest, falsified
from proofs_check._paths import curvature_integral, make
from proofs_check._registry import Outcome, Profile, statement, wrong_variant

REF = "arXiv 2609.16665, Prop. 3.3"
KINDS = ("affine", "mlp", "quadratic", "looped")


def decomposition_error(seed: int, kind: str, scale: float, alpha: float, quadratic_model: bool):
    path = make(seed, kind, scale)
    t = path.taylor()
    A, Q = float(t.A[0]), float(t.Q[0])
    phi = float(path.phi([alpha])[0])
    if quadratic_model:
        rhs = alpha * A + alpha**2 * Q
    else:
        rhs = alpha * A + curvature_integral(path, alpha, lambda s: alpha - s)[0]
    failure = None
    if alpha == 1.0 and A > 0 and phi < 0:
        failure = (curvature_integral(path, 1.0, lambda s: 1 - s)[0], A)
    return abs(phi - rhs) / (1 + abs(phi)), failure


def _run(profile: Profile, quadratic_model: bool):
    tight, failures = Tightest(), []

    @profile.hypothesis(examples=25)
    @given(
        seed=st.integers(0, 10**5),
        kind=st.sampled_from(KINDS),
        scale=st.floats(0.01, 4.0),
        alpha=st.one_of(st.just(1.0), st.floats(0.05, 1.0)),
    )
    @example(seed=0, kind="quadratic", scale=1.0, alpha=1.0)
    @example(seed=1, kind="affine", scale=4.0, alpha=1.0)
    @example(seed=2, kind="looped", scale=3.0, alpha=1.0)
    def prop(seed, kind, scale, alpha):
        err, failure = decomposition_error(seed, kind, scale, alpha, quadratic_model)
        target(err, label="relative error")
        tight.see(err, f"{kind}, scale {scale:.2g}")
        if failure is not None:
            integral, A = failure
            failures.append(integral + A)
            assert integral < -A < 0, failure
        assert err <= 1e-9, err

    return tight, failures, falsified(prop)


@statement("Prop 3.3: phi(a) = a A + int_0^a (a-s) phi''(s) ds", REF, "exact")
def check(profile: Profile) -> Outcome:
    tight, failures, why = _run(profile, quadratic_model=False)
    return Outcome(
        why is None,
        f"max rel. error {tight.ratio:.1e} ({tight.count} paths); {len(failures)} finite-step "
        f"failures, all with int (1-s)phi'' < -A" + (f"; {why}" if why else ""),
    )


@wrong_variant("quadratic model is exact: phi(a) = a A + a^2 Q", REF, "exact")
def wrong_quadratic(profile: Profile) -> Outcome:
    tight, _, why = _run(profile, quadratic_model=True)
    return Outcome(why is None, f"max rel. error {tight.ratio:.1e} (an identity would be < 1e-9)")
