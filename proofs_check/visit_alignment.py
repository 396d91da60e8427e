"""Eq. 12: the visit-alignment coefficient kappa_R lies in [0, R]; aligned -> R, orthogonal -> O(1).

Statement (seed 002, Eq. 12 and the text after it). For a physical sublayer j with R
visits, kappa_j = ||sum_r U_{r,j}|| ||sum_r G_{r,j}|| / (R C_U C_G (beta/alpha)^2) with
||U_{r,j}|| <= C_U beta/alpha and ||G_{r,j}|| <= C_G beta/alpha; kappa_R = max_j kappa_j.
The triangle inequality gives 0 <= kappa_R <= R. Independent or nearly orthogonal visits
give kappa_R = O(1); fully aligned visits give kappa_R = Theta(R).

We use the tightest admissible constants, C_U beta/alpha = max_r ||U_{r,j}|| and
C_G beta/alpha = max_r ||G_{r,j}|| (any larger constants only lower kappa).

Checks:
- property: hypothesis over visit families U_r (matrices) and G_r (vectors) that
  interpolate between identical, random and sign-alternating visits; 0 <= kappa <= R with
  relative slack 1e-12; ``target`` pushes kappa/R up; ``@example`` pins identical visits
  (the equality case kappa = R) and cancelling visits (kappa = 0).
- exact, on the reference LinearLoop (h <- h + eps W h), measured with
  ``lp.visit_alignment`` (Lanczos on JVP/VJP; convergence required) and by brute force
  (dense ``jacrev`` of an explicitly untied twin written out here, one weight per visit,
  which uses nothing of the library; the two must agree to 1e-6): (a) aligned:
  eps = 1e-6 so every visit reads h_r ~ x, kappa/R >= 1 - 1e-4 for R = 2, 4, 8;
  (b) orthogonal: W = P - I with P the cyclic shift, eps = 1 and x = e_1, so visit r reads
  e_{r+1}: the U_r act on disjoint columns of the weight and kappa = 1 exactly
  (analytically sqrt(R) sqrt(R) / R) for every R <= d.

Wrong variant: "tied visits never add coherently: kappa_R <= 1": the aligned LinearLoop has
kappa = R.

What a check cannot establish: which regime a trained model is in (kappa is a measurement),
nor kappa with the paper's unknown constants C_U, C_G rather than the empirical maxima.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from hypothesis import example, given, target
from hypothesis import strategies as st
from torch.func import jacrev

import loopprobe as lp
from loopprobe.models import LinearLoop, LinearLoopConfig
from proofs_check._common import Tightest, falsified, kappa, loglog_slope, opnorm
from proofs_check._registry import Outcome, Profile, statement, wrong_variant

REF = "seed 002, Eq. 12"


def synthetic(R: int, m: int, q: int, seed: int, mix: float, flip: bool):
    """R visits: U_r = mix * U + (1 - mix) * noise_r (sign-alternating when flip)."""
    g = torch.Generator().manual_seed(seed)
    U0, G0 = (
        torch.randn(m, q, generator=g, dtype=torch.float64),
        torch.randn(q, generator=g, dtype=torch.float64),
    )
    Us, Gs = [], []
    for r in range(R):
        sign = (-1.0) ** r if flip else 1.0
        Us.append(
            sign * (mix * U0 + (1 - mix) * torch.randn(m, q, generator=g, dtype=torch.float64))
        )
        Gs.append(sign * (mix * G0 + (1 - mix) * torch.randn(q, generator=g, dtype=torch.float64)))
    return Us, Gs


@statement("Eq 12: 0 <= kappa_R <= R (triangle inequality)", REF, "property")
def check_range(profile: Profile) -> Outcome:
    tight, low = Tightest(), [np.inf]

    @profile.hypothesis(examples=60)
    @given(
        R=st.integers(1, 8),
        m=st.integers(1, 6),
        q=st.integers(1, 6),
        seed=st.integers(0, 10**6),
        mix=st.floats(0.0, 1.0),
        flip=st.booleans(),
    )
    @example(R=8, m=3, q=4, seed=0, mix=1.0, flip=False)
    @example(R=4, m=3, q=4, seed=1, mix=1.0, flip=True)
    def prop(R, m, q, seed, mix, flip):
        Us, Gs = synthetic(R, m, q, seed, mix, flip)
        k = kappa(Us, Gs, max(opnorm(U) for U in Us), max(float(G.norm()) for G in Gs))
        target(k / R, label="kappa/R")
        tight.see(k / R, f"R={R}, mix={mix:.2f}, flip={flip}")
        low[0] = min(low[0], k)
        assert -1e-15 <= k <= R * (1 + 1e-12), (k, R)

    why = falsified(prop)
    return Outcome(
        why is None,
        f"max kappa/R = {tight.ratio:.12f} at {tight.where}; min kappa = {low[0]:.1e} "
        f"({tight.count} examples)" + (f"; {why}" if why else ""),
    )


def linear_loop_kappa(R: int, regime: str, d: int = 8) -> tuple[float, float, bool]:
    """kappa of the one looped sublayer W of a LinearLoop: (lp.visit_alignment, brute force
    per visit with dense jacrev, whether the library's estimates converged)."""
    if regime == "aligned":
        model = LinearLoop(
            LinearLoopConfig(d=d, R=R, eps=1e-6), generator=torch.Generator().manual_seed(R)
        ).double()
        x = torch.randn(3, d, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    else:
        model = LinearLoop(LinearLoopConfig(d=d, R=R, eps=1.0)).double()
        with torch.no_grad():
            model.W.weight.copy_(
                torch.roll(torch.eye(d, dtype=torch.float64), 1, 0)
                - torch.eye(d, dtype=torch.float64)
            )
        x = torch.eye(d, dtype=torch.float64)[:1]
    y = torch.randn(x.shape, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    W = model.W.weight.detach()
    eps = model.cfg.step_size

    def untied(Ws: torch.Tensor) -> torch.Tensor:
        """The explicitly untied twin: visit r applies its own weight Ws[r]."""
        h = x
        for r in range(R):
            h = h + eps * h @ Ws[r].T
        return h.reshape(-1)

    tied = W.expand(R, d, d).clone()
    assert torch.allclose(untied(tied), model(x).reshape(-1), rtol=1e-13, atol=0)
    J = jacrev(untied)(tied)
    Us = [J[:, r].reshape(J.shape[0], -1) for r in range(R)]
    dLdF = untied(tied) - y.reshape(-1)  # L = |F - y|^2 / 2
    Gs = [U.t() @ dLdF for U in Us]
    brute = kappa(Us, Gs, max(opnorm(U) for U in Us), max(float(G.norm()) for G in Gs))
    rep = lp.visit_alignment(
        lp.attach(model),
        x,
        lambda out, inp: 0.5 * (out - y).pow(2).sum(),
        method="lanczos",
        max_iter=30,
    )
    return rep.kappa, brute, bool(rep.sublayers.converged.all())


@functools.cache
def _measured(Rs: tuple[int, ...]) -> dict[str, list[tuple[float, float, bool]]]:
    return {reg: [linear_loop_kappa(R, reg) for R in Rs] for reg in ("aligned", "orthogonal")}


def _rs(profile: Profile) -> tuple[int, ...]:
    return (2, 3, 4, 5, 6, 7, 8) if profile.wide else (2, 4, 8)


@statement(
    "Eq 12 measured: aligned visits kappa = R, orthogonal kappa = 1", REF + " (LinearLoop)", "exact"
)
def check_regimes(profile: Profile) -> Outcome:
    Rs = _rs(profile)
    m = _measured(Rs)
    lib = {reg: [t[0] for t in rows] for reg, rows in m.items()}
    gap = max(abs(t[0] / t[1] - 1) for rows in m.values() for t in rows)
    conv = all(t[2] for rows in m.values() for t in rows)
    al = [a / R for a, R in zip(lib["aligned"], Rs, strict=True)]
    ok = (
        min(al) >= 1 - 1e-4
        and max(abs(o - 1) for o in lib["orthogonal"]) < 1e-6
        and gap < 1e-6
        and conv
    )
    return Outcome(
        ok,
        f"aligned kappa/R >= {min(al):.6f} (slope {loglog_slope(Rs, lib['aligned']):.3f}); "
        f"orthogonal kappa = {', '.join(f'{o:.6f}' for o in lib['orthogonal'])} at R={list(Rs)}"
        f" (lp.visit_alignment; brute force agrees to {gap:.0e})",
    )


@wrong_variant("tied visits never add coherently: kappa_R <= 1", REF + " (LinearLoop)", "exact")
def wrong_kappa_le_one(profile: Profile) -> Outcome:
    Rs = _rs(profile)
    k = [t[0] for t in _measured(Rs)["aligned"]]
    return Outcome(
        max(k) <= 1 + 1e-9, f"aligned kappa = {', '.join(f'{v:.4f}' for v in k)} at R={list(Rs)}"
    )
