"""Proposition A.2 of arXiv 2609.16665: the quadratic root and the progress boundary.

Statement (PAPERS.md 2a; the paper's App. A.3, Eq. 19). Under Proposition 3.3, suppose
A > 0 and -L_D <= phi''(s) <= -mu on [0, 1] for constants 0 < mu <= L_D. Then
kappa = -phi''(0) in [mu, L_D], so r^(2) = -A/Q = 2A/kappa in [2A/L_D, 2A/mu], and
r_1 >= min{1, 2A/L_D}. If moreover 2A/mu < 1, then r_1 <= 2A/mu, and consequently

    |r^(2) - r_1| <= 2A (1/mu - 1/L_D),

with r_1 = sup{r in [0, 1] : phi >= 0 on [0, r]} (Eq. 7), the progress boundary.

Check (property, float64): hypothesis draws transitions (affine readouts with a small
positive slope, a tiny LoopedGPT round, and constructed gains whose curvature relaxes from
-L_D at 0 to -mu, ``_paths.shaped_path("decay")``, where the bound is nearly attained).
A, Q from ``lp.finite_step``; phi'' on 1025 points (forward-mode AD, ``Path.phi2``), its
extremes refined by bounded scalar minimisation, give mu and L_D; the draw is kept when
A > 0, mu > 0 and 2A/mu < 1 (the proposition's hypotheses); r_1 is the first sign change
of phi (2049 points, one batched evaluation of U) refined by Brent's method to 1e-13. Assert every
link of the chain with slack 1e-8: kappa in [mu, L_D], r^(2) in [2A/L_D, 2A/mu],
min{1, 2A/L_D} <= r_1 <= 2A/mu, and Eq. 19. ``target`` pushes
|r^(2) - r_1| / (2A (1/mu - 1/L_D)) up; ``@example`` pins a near-tight decay path
(L_D = 20, mu = 1, w = 0.001: ratio ~0.95).

Wrong variant: the bound without its factor 2, |r^(2) - r_1| <= A (1/mu - 1/L_D) (the
distance between the unclipped maximisers A/kappa and A/mu instead of the roots): the
near-tight path refutes it (the ratio to the true bound is above 1/2).

What a check cannot establish: the bound on real models, where the paper computes no
two-sided bound (it evaluates only L_D); mu and L_D here are measured on a grid, so a
curvature extreme between grid points is found only by the local refinement.
"""

from __future__ import annotations

import numpy as np
from hypothesis import assume, example, given, target
from hypothesis import strategies as st
from scipy.optimize import brentq

from proofs_check._common import Tightest, falsified
from proofs_check._paths import make, shaped_path
from proofs_check._registry import Outcome, Profile, statement, wrong_variant

REF = "arXiv 2609.16665, Prop. A.2 (Eq. 19)"
TOL = 1e-8


def _extreme(path, s: np.ndarray, v: np.ndarray, sign: float) -> float:
    """min over [0, 1] of sign * phi''(s): the grid's best point, then a 257-point grid
    between its neighbours (two batched evaluations; a scalar minimiser costs 100x more)."""
    for _ in range(2):
        i = int(np.argmin(sign * v))
        best = float(sign * v[i])
        s = np.linspace(s[max(i - 1, 0)], s[min(i + 1, len(s) - 1)], 257)
        v = path.phi2(s)
    return min(best, float(np.min(sign * v)))


def quantities(path) -> dict | None:
    t = path.taylor()
    A, Q = float(t.A[0]), float(t.Q[0])
    s = np.linspace(0, 1, 1025)
    v = path.phi2(s)
    mu = _extreme(path, s, v, -1.0)  # min over [0, 1] of -phi''
    L = -_extreme(path, s, v, 1.0)  # max over [0, 1] of -phi''
    if not (A > 0 and mu > 0 and 2 * A / mu < 1):
        return None
    a = np.linspace(0, 1, 2049)
    phi = path.phi_batch(a)
    neg = np.flatnonzero(phi < 0)
    if len(neg) == 0:
        return None  # cannot happen when 2A/mu < 1 and the curvature bounds hold
    j = int(neg[0])
    r1 = brentq(lambda x: float(path.phi_batch(np.array([x]))[0]), a[j - 1], a[j], xtol=1e-13)
    return {"A": A, "kappa": -2 * Q, "mu": mu, "L": L, "r2": -A / Q, "r1": r1}


def _draw(kind, seed, scale, L, mu_frac, w, a_frac):
    if kind == "decay":
        mu = mu_frac * L
        return shaped_path(seed, "decay", a_frac * mu / 2, L, mu, w)
    return make(seed, kind, scale, small_slope=True)


def _property(profile: Profile, factor: float) -> Outcome:
    tight = Tightest()

    @profile.hypothesis(examples=16)
    @given(
        kind=st.sampled_from(("affine", "looped", "decay")),
        seed=st.integers(0, 10**5),
        scale=st.floats(0.5, 4.0),
        L=st.floats(1.0, 40.0),
        mu_frac=st.floats(0.02, 1.0),
        w=st.floats(0.001, 0.3),
        a_frac=st.floats(0.05, 0.95),
    )
    @example(kind="decay", seed=0, scale=1.0, L=20.0, mu_frac=0.05, w=0.001, a_frac=0.8)
    def prop(kind, seed, scale, L, mu_frac, w, a_frac):
        q = quantities(_draw(kind, seed, scale, L, mu_frac, w, a_frac))
        assume(q is not None)
        A, kap, mu, Ld, r1, r2 = (q[k] for k in ("A", "kappa", "mu", "L", "r1", "r2"))
        width = 2 * A * (1 / mu - 1 / Ld)
        ratio = abs(r2 - r1) / max(width, 1e-300)
        target(ratio, label="|r2 - r1| / bound")
        tight.see(ratio, f"{kind}, 2A/mu={2 * A / mu:.2f}, L_D/mu={Ld / mu:.1f}")
        assert mu * (1 - TOL) <= kap <= Ld * (1 + TOL), q
        assert 2 * A / Ld - TOL <= r2 <= 2 * A / mu + TOL, q
        assert min(1.0, 2 * A / Ld) - TOL <= r1 <= 2 * A / mu + TOL, q
        assert abs(r2 - r1) <= factor / 2 * width + TOL, (ratio, q)

    why = falsified(prop)
    return Outcome(
        why is None,
        f"tightest |r2 - r1| / 2A(1/mu - 1/L_D) = {tight.ratio:.3f} at {tight.where} "
        f"({tight.count} transitions meeting the hypotheses)" + (f"; {why}" if why else ""),
    )


@statement("Prop A.2: |r2 - r1| <= 2A (1/mu - 1/L_D)", REF, "property")
def check(profile: Profile) -> Outcome:
    return _property(profile, 2.0)


@wrong_variant("Prop A.2 without the 2: |r2 - r1| <= A (1/mu - 1/L_D)", REF, "property")
def wrong_half(profile: Profile) -> Outcome:
    return _property(profile, 1.0)
