"""Assumption 3.1: per-visit sensitivity and update are O(beta/alpha), uniformly in N.

Statement (seed 002, Assumption 3.1, "DeepNorm-scale local sensitivity"). For each unrolled
visit i = (r, j), the norm of the linearised output map from a residual-branch parameter
perturbation at that visit, ||U_{r,j}||, and the norm of the visit-wise effective update,
||G_{r,j}||, are both O(beta/alpha), with constants independent of the depth N. Prop. A.5
and the tied bound (Eq. 13) rest on it: C_U and C_G are these constants.

Check (rate; tiny float64 LoopedGPT at initialisation, K = 1, R = N = 1..16 (32 with
--thorough), d = 8, DeepNorm and DeepLoop, a 2 x 4 batch, cross-entropy on random targets;
U_{r,j} and G_{r,j} by brute force, dense ``jacrev`` on the explicitly untied twin, plain
SGD so G = U^T dL/dF): c_U(N) = max over visits and seeds of ||U_{r,j}|| / (beta/alpha)
and c_G(N) likewise stay bounded in N: the log-log slope of each in N lies within
+-0.15 of 0 (the figure also gives the range of c_U, c_G over N).

Wrong variant: without the residual scaling (plain Post-LN, alpha = beta = 1, so
beta/alpha = 1) the per-visit norms are bounded uniformly in N. They are not: the largest
||U_{r,j}|| grows with N (measured slope ~0.6 over N = 1..16), so the O(beta/alpha)
sensitivity is a property of the scaled initialisation, not of depth.

What a check cannot establish: a bound for all N (the slope is measured on N <= 16),
the constants at the paper's width, or the assumption after training (only init is
checked), or for Adam's preconditioned update (SGD's G only).
"""

from __future__ import annotations

import functools

from proofs_check._common import loglog_slope, opnorm, per_visit, tiny_gpt, tokens
from proofs_check._registry import Outcome, Profile, statement, wrong_variant

REF = "seed 002, Assumption 3.1"
TOL = 0.15


@functools.cache
def visit_constants(norm: str, N: int, seeds: int) -> tuple[float, float]:
    """(max ||U_{r,j}||, max ||G_{r,j}||) / (beta/alpha) over visits and seeds, K = 1."""
    cu = cg = 0.0
    for s in range(seeds):
        m = tiny_gpt(1, N, norm, seed=s)
        idx, tgt = tokens(16, 2, 4, s)
        pv = per_visit(m, idx, tgt)
        ba = m.cfg.scales.ratio
        cu = max(cu, max(opnorm(Ur) for Uj in pv["U"] for Ur in Uj) / ba)
        cg = max(cg, max(float(Gr.norm()) for Gj in pv["G"] for Gr in Gj) / ba)
    return cu, cg


def _ns(profile: Profile) -> tuple[int, ...]:
    return (1, 2, 4, 8, 16, 32) if profile.wide else (1, 2, 4, 8, 16)


def _slopes(norm: str, profile: Profile) -> tuple[float, float, str]:
    Ns = _ns(profile)
    vals = [visit_constants(norm, n, profile.seeds) for n in Ns]
    cu, cg = [u for u, _ in vals], [g for _, g in vals]
    su, sg = loglog_slope(Ns, cu), loglog_slope(Ns, cg)
    text = (
        f"{norm}: c_U slope {su:+.3f} (range {min(cu):.3g}..{max(cu):.3g}), "
        f"c_G slope {sg:+.3f} ({min(cg):.3g}..{max(cg):.3g})"
    )
    return su, sg, text


@statement("Assumption 3.1: max per-visit ||U||, ||G|| = O(beta/alpha) uniformly in N", REF, "rate")
def check_uniform(profile: Profile) -> Outcome:
    res = [_slopes(n, profile) for n in ("deepnorm", "deeploop")]
    ok = all(abs(su) <= TOL and abs(sg) <= TOL for su, sg, _ in res)
    return Outcome(
        ok, "; ".join(t for *_, t in res) + f"; want 0 +-{TOL} over N={list(_ns(profile))}"
    )


@wrong_variant("no residual scaling (Post-LN): per-visit ||U||, ||G|| bounded in N", REF, "rate")
def wrong_unscaled(profile: Profile) -> Outcome:
    su, sg, text = _slopes("post", profile)
    return Outcome(abs(su) <= TOL and abs(sg) <= TOL, f"{text}; bounded would be 0 +-{TOL}")
