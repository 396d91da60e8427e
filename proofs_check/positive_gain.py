"""Corollary 3.5 of arXiv 2609.16665: a short enough step along a right direction gains.

Statement (PAPERS.md 2a). If A = phi'(0) > 0 and phi'' >= -L_D on [0, 1], then
phi(alpha) >= alpha A - (L_D/2) alpha^2, so every 0 < alpha < 2A/L_D (alpha <= 1) has
positive gain phi(alpha) > 0.

Check (property, float64): hypothesis draws transitions (affine / tanh-MLP / quadratic
readouts, a tiny LoopedGPT round; sizes 0.01..4; D replaced by -D when A < 0, so A > 0).
L_D = max(0, -min phi'') with phi'' from ``lp.finite_step`` on a 257-point grid, refined
on a finer grid and by a parabola through the best points (so L_D is not underestimated
between grid points); draws with ``small_slope`` make A small and the step long;
phi from ``path_gains`` on 101 points. Assert
phi(alpha) >= alpha A - L_D alpha^2 / 2 - 1e-10 on the grid and phi(alpha) > 0 on the grid
points inside (0, min(1, 2A/L_D)). ``target`` minimises the relative slack;
``@example`` pins the quadratic utility, where phi'' = -L_D and the bound is an equality:
there phi(alpha) = alpha A - L_D alpha^2 / 2 is asserted to 1e-9 (1 + |D|^2), so a wrong
constant in A or Q (and so in L_D) fails.

Check (exact, float64): the library's A = phi'(0) and Q = phi''(0)/2 (forward-mode AD in
``lp.finite_step``) against central finite differences of phi computed here from the
utility itself (Richardson-extrapolated, step 1e-2/|D|):
|A - A_fd| <= 1e-6 |D| and |Q - Q_fd| <= 1e-6 |D|^2 (observed <= 3e-9 |D|^2).

Wrong variant: "A > 0 implies a positive full step, phi(1) > 0" -- finite-step failures
(pinned: the quadratic utility with L_D > 2A) refute it.

What a check cannot establish: L_D for a real model (a global curvature bound is not
observable from finitely many points; the paper also reports it is loose: median C/kappa
0.06-0.11 against 2.8-4.6 for M/(2 kappa)).
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import example, given, target
from hypothesis import strategies as st

from proofs_check._common import Tightest, falsified
from proofs_check._paths import argmax_on_grid, make, path_args
from proofs_check._registry import Outcome, Profile, statement, wrong_variant

REF = "arXiv 2609.16665, Cor. 3.5"
KINDS = ("affine", "mlp", "quadratic", "looped")
ALPHAS = np.linspace(0, 1, 101)


def oriented(seed: int, kind: str, scale: float, small_slope: bool = False):
    """The path with D oriented so that A > 0 (None when A == 0)."""
    path = make(seed, kind, scale, small_slope)
    A = float(path.taylor().A[0])
    if A == 0:
        return None, 0.0
    if A < 0:
        path.D = -path.D
        A = -A
    return path, A


def curvature_bound(path) -> float:
    """L_D = max(0, -min phi''), the minimum located on grids and refined (never above)."""
    _, top = argmax_on_grid(lambda s: -path.phi2(s), n=257)
    return max(0.0, top)


@statement("Cor 3.5: phi(a) >= aA - L_D a^2/2 > 0 for 0 < a < 2A/L_D", REF, "property")
def check(profile: Profile) -> Outcome:
    tight = Tightest()

    @profile.hypothesis(examples=25)
    @given(**path_args(KINDS))
    @example(seed=0, kind="quadratic", scale=1.0, small=False)
    @example(seed=3, kind="affine", scale=4.0, small=True)
    def prop(seed, kind, scale, small):
        path, A = oriented(seed, kind, scale, small)
        if path is None:
            return
        L = curvature_bound(path)
        phi = path.phi(ALPHAS)
        lower = ALPHAS * A - L * ALPHAS**2 / 2
        inside = (ALPHAS > 0) & (ALPHAS < min(1.0, 2 * A / L if L > 0 else np.inf))
        slack = float(np.max((lower - phi)[1:] / (ALPHAS[1:] * A)))
        target(slack, label="max (lower - phi) / (alpha A)")
        tight.see(slack, f"{kind}, scale {scale:.2g}")
        assert np.all(phi >= lower - 1e-10), float(np.min(phi - lower))
        assert np.all(phi[inside] > 0), float(np.min(phi[inside]))
        if kind == "quadratic":  # phi'' = 2Q = -L_D everywhere: the bound is an equality
            n2 = float(path.D.norm()) ** 2
            assert np.max(np.abs(phi - lower)) <= 1e-9 * (1 + n2), float(np.max(phi - lower))

    why = falsified(prop)
    return Outcome(
        why is None,
        f"closest approach (lower - phi)/(alpha A) = {tight.ratio:.1e} at {tight.where} "
        f"({tight.count} paths)" + (f"; {why}" if why else ""),
    )


def finite_differences(path) -> tuple[float, float, float]:
    """(A, Q, |D|) from central differences of phi(a) = U(H + a D) - U(H), Richardson-
    extrapolated; U is the path's utility or the mean reference-token log-probability,
    written out here (not the library's)."""
    U = path.utility
    if U is None:

        def U(h: torch.Tensor) -> torch.Tensor:
            logp = torch.log_softmax(path.readout(h), -1)
            return logp.gather(-1, path.targets.unsqueeze(-1)).squeeze(-1).mean(1)

    n = float(path.D.norm())

    def phi(a: float) -> float:
        return float(U(path.H + a * path.D)[0] - U(path.H)[0])

    def d1(h: float) -> float:
        return (phi(h) - phi(-h)) / (2 * h)

    def d2(h: float) -> float:
        return (phi(h) + phi(-h)) / h**2

    h = 1e-2 / n
    return (4 * d1(h / 2) - d1(h)) / 3, (4 * d2(h / 2) - d2(h)) / 6, n


@statement("A = phi'(0), Q = phi''(0)/2 match finite differences of phi", REF, "exact")
def check_taylor_terms(profile: Profile) -> Outcome:
    tight = Tightest()

    @profile.hypothesis(examples=25)
    @given(**path_args(KINDS))
    @example(seed=0, kind="quadratic", scale=1.0, small=False)
    @example(seed=0, kind="mlp", scale=4.0, small=True)
    def prop(seed, kind, scale, small):
        path = make(seed, kind, scale, small)
        t = path.taylor()
        A, Q, n = finite_differences(path)
        err = max(abs(float(t.A[0]) - A) / n, abs(float(t.Q[0]) - Q) / n**2)
        target(err, label="max(|dA|/|D|, |dQ|/|D|^2)")
        tight.see(err, f"{kind}, scale {scale:.2g}")
        assert err <= 1e-6, (float(t.A[0]), A, float(t.Q[0]), Q, n)

    why = falsified(prop)
    return Outcome(
        why is None,
        f"max(|A - A_fd|/|D|, |Q - Q_fd|/|D|^2) = {tight.ratio:.1e} at {tight.where} "
        f"({tight.count} paths)" + (f"; {why}" if why else ""),
    )


@wrong_variant("A > 0 implies a positive full step phi(1) > 0", REF, "property")
def wrong_full_step(profile: Profile) -> Outcome:
    worst = Tightest()

    @profile.hypothesis(examples=25)
    @given(seed=st.integers(0, 10**5), kind=st.sampled_from(KINDS), scale=st.floats(0.01, 4.0))
    @example(seed=0, kind="quadratic", scale=3.0)
    def prop(seed, kind, scale):
        path, A = oriented(seed, kind, scale)
        if path is None:
            return
        gain = float(path.phi([1.0])[0])
        worst.see(-gain / A, f"{kind}, scale {scale:.2g}, A={A:.2g}, phi(1)={gain:.2g}")
        assert gain > 0, (A, gain)

    why = falsified(prop)
    return Outcome(
        why is None, f"counterexample: {worst.where}" if why else "no counterexample found"
    )
