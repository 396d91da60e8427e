"""Proposition 3.4 of arXiv 2609.16665: Delta U = A - KL exactly, for readouts affine in alpha.

Statement (PAPERS.md 2a). If the logits are affine in alpha along the path H + alpha D
and U is the mean reference-token log-probability, then the full-step gain is

    Delta U = phi(1) = A - C,   C = (1/|M|) sum_j KL(p_j(0) || p_j(1)) >= 0,

so a finite-step failure (phi(1) < 0 < A) happens exactly when 0 < A < C. (Proof: with
logits z(alpha) = z0 + alpha dz, phi(1) = mean_j [dz_y - lse(z1) + lse(z0)],
A = mean_j [dz_y - <p_j(0), dz>], and KL(p0 || p1) = lse(z1) - lse(z0) - <p0, dz>.)

Check (exact, float64): hypothesis draws affine readouts (random, and the tied embedding of
a tiny LoopedGPT round), transition sizes 0.01..4, seeds, and optionally a D tilted to a
small positive slope A (long steps in a right direction: where failures live);
``lp.finite_step`` returns A, phi(1), the mean KL and the label. Assert
|phi(1) - (A - KL)| <= 1e-8, KL >= 0, and label == "finite-step failure" iff 0 < A < KL.
``@example`` pins a large tilted step (a failure) and a tiny one.

Wrong variant: the same identity for a readout that is NOT affine in alpha (a tanh layer
before the head, as a final norm would also do): the gap is far above 1e-8.

What a check cannot establish: how close real models' readouts are to affine (the paper
measures a 2.7e-6 gap on Ouro; a final RMSNorm already breaks exactness).
"""

from __future__ import annotations

from hypothesis import example, given, target

from loopprobe.estimate.finitestep import FINITE_STEP
from proofs_check._common import Tightest, falsified
from proofs_check._paths import make, path_args
from proofs_check._registry import Outcome, Profile, statement, wrong_variant

REF = "arXiv 2609.16665, Prop. 3.4"


def _run(profile: Profile, kinds: tuple[str, ...]):
    tight, seen = Tightest(), {"failures": 0}

    @profile.hypothesis(examples=40)
    @given(**path_args(kinds))
    @example(seed=0, kind=kinds[0], scale=4.0, small=True)
    @example(seed=1, kind=kinds[-1], scale=0.01, small=False)
    def prop(seed, kind, scale, small):
        t = make(seed, kind, scale, small).taylor()
        A, gain, kl, label = float(t.A[0]), float(t.gain[0]), float(t.kl[0]), t.label[0]
        gap = abs(gain - (A - kl))
        target(gap, label="|dU - (A - KL)|")
        tight.see(gap, f"{kind}, scale {scale:.2g}")
        seen["failures"] += label == FINITE_STEP
        assert kl >= 0, kl
        assert (label == FINITE_STEP) == (0 < A < kl) or gap > 1e-8, (label, A, kl)
        assert gap <= 1e-8, gap

    why = falsified(prop)
    return tight, seen["failures"], why


@statement("Prop 3.4: dU = A - mean KL(p(0)||p(1)) for affine logits", REF, "exact")
def check(profile: Profile) -> Outcome:
    tight, n_fail, why = _run(profile, ("affine", "looped"))
    return Outcome(
        why is None,
        f"max |dU - (A - KL)| = {tight.ratio:.1e} ({tight.count} paths, {n_fail} finite-step "
        f"failures, each with 0 < A < KL)" + (f"; {why}" if why else ""),
    )


@wrong_variant("Prop 3.4 for a readout not affine in alpha (tanh layer)", REF, "exact")
def wrong_nonaffine(profile: Profile) -> Outcome:
    tight, _, why = _run(profile, ("mlp",))
    return Outcome(
        why is None, f"max |dU - (A - KL)| = {tight.ratio:.1e} (identity would be <= 1e-8)"
    )
