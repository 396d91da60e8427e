"""The tied-depth bound for an Adam step: ||dF|| ~ J kappa^U_R (beta/alpha), not M kappa_R (b/a)^2.

Statement (this project's extension of seed 002, Eq. 11-14 and Assumption 3.1;
docs/definitions.md §8). For any step, ||Delta F_1|| = ||sum_j sum_r U_{r,j} dtheta_j||
<= sum_j ||sum_r U_{r,j}|| ||dtheta_j||. Adam's first step is dtheta = -eta g / (|g| + eps)
(m_hat = g, v_hat = g^2): every coordinate moves by about eta whatever R and beta/alpha, so
with ||U_{r,j}|| = O(beta/alpha) the change scales like J kappa^U_R (beta/alpha) with
kappa^U_j = ||sum_r U_{r,j}|| / max_r ||U_{r,j}|| in [0, R_j]: at fixed K it grows like
R^(gamma - 2p) (kappa^U ~ R^gamma), bounded iff p >= gamma / 2.

Checks:
- symbolic: with beta/alpha = (cd)^(-p) N^(-2p) and kappa^U = R^gamma, J kappa^U (beta/alpha)
  = Theta(N^(gamma - 2p)) at fixed K, and the threshold solving gamma - 2p = 0 is gamma / 2
  (which equals SGD's (1 + gamma) / 4 exactly at gamma = 1).
- property, hypothesis over tiny float64 LoopedGPTs (K in 1..2, R in 1..4, DeepNorm /
  DeepLoop / Post-LN / the p-family): Adam's first step written by hand from the TIED
  model's gradient; its first-order change from the tied model's own dense Jacobian equals
  the explicitly untied twin's per-visit sum sum_j sum_r U_{r,j} dtheta_j (rel 1e-10), is at
  most sum_j ||sum_r U_{r,j}|| ||dtheta_j|| (dense SVD of the twin's blocks, slack 1e-9), and
  ||dtheta_j|| is within 10% of eta sqrt(n_j) (the sign-like step, assumption A2 at step
  one; coordinates whose gradient is near eps or exactly zero move less: up to 5% measured).
- rate: ``lp.bound_check(optimizer="adam")`` (one real Adam step, kappa^U by Lanczos) on
  the reference LoopedGPT at init, K = 2, R = 1..8 (d = 8): C_A = ||dF|| / (J_g kappa^U_R
  (beta/alpha)) has log-log slope in R within +-0.1 of 0 for DeepNorm and DeepLoop.

Wrong variant: the SGD form applied to the same Adam steps, C = ||dF|| / (M_g kappa_R
(beta/alpha)^2) flat in R: DeepNorm's Adam change grows like sqrt(R) while the SGD form grows
like R, so its C falls like R^(-1/2) (slope about -0.5) and the check must reject it.

What a check cannot establish: the form after many steps, once v_hat has history (measured
along training in docs/results/tied-bound.md, not proved), or for other optimizers.
"""

from __future__ import annotations

import functools
import math

import sympy as sp
from hypothesis import example, given
from hypothesis import strategies as st

import loopprobe as lp
from proofs_check._common import (
    Tightest,
    cross_entropy,
    falsified,
    loglog_slope,
    opnorm,
    per_visit,
    tiny_gpt,
    tokens,
)
from proofs_check._registry import Outcome, Profile, statement, wrong_variant
from proofs_check.exponent_threshold import _rs

REF = "this project's extension of seed 002, Eq. 11-14, Assumption 3.1"
SLOPE_C = 0.1
ETA, EPS = 1e-3, 1e-8
NORMS = ("deepnorm", "deeploop", "post", "postp")


@statement("Adam: J kappa^U (beta/alpha) ~ N^(gamma - 2p), threshold p = gamma/2", REF, "symbolic")
def check_symbolic(profile: Profile) -> Outcome:
    N, K, c, d, p, g = sp.symbols("N K c d p gamma", positive=True)
    ratio = sp.powsimp(sp.simplify((d * N) ** (-p) / (c * N) ** p), force=True)
    form = 2 * K * (N / K) ** g * ratio  # J = 2K, kappa^U = R^gamma, R = N / K
    expo = sp.simplify(sp.expand_log(sp.log(form.subs({c: 1, d: 1, K: 1}) / 2), force=True)
                       / sp.log(N))  # fmt: skip
    ok_exp = sp.simplify(expo - (g - 2 * p)) == 0
    thr = sp.solve(sp.Eq(expo, 0), p)
    ok_thr = len(thr) == 1 and sp.simplify(thr[0] - g / 2) == 0
    meets_sgd = sp.solve(sp.Eq(g / 2, (1 + g) / 4), g) == [1]
    return Outcome(
        ok_exp and ok_thr and meets_sgd,
        f"exponent {expo}; threshold p = {thr}; equals SGD's (1+gamma)/4 at gamma = 1: {meets_sgd}",
    )


@functools.lru_cache(maxsize=128)
def adam_ratio(K: int, R: int, norm: str, p: float | None, seed: int) -> dict:
    m = tiny_gpt(K, R, norm, p=p if norm == "postp" else None, seed=seed)
    idx, tgt = tokens(16, 2, 4, seed)
    pv = per_visit(m, idx, tgt)
    steps = [-ETA * g / (g.abs() + EPS) for g in pv["g_tied"]]  # Adam's first step, by hand
    tied = sum(Ut @ s for Ut, s in zip(pv["U_tied"], steps, strict=True))  # the tied model's
    twin = sum(Ur @ s for Uj, s in zip(pv["U"], steps, strict=True) for Ur in Uj)
    bound = sum(opnorm(sum(Uj)) * float(s.norm()) for Uj, s in zip(pv["U"], steps, strict=True))
    size = max(abs(float(s.norm()) / (ETA * math.sqrt(s.numel())) - 1) for s in steps)
    return {
        "ratio": float(tied.norm()) / bound,
        "identity": float((tied - twin).norm() / tied.norm()),
        "size": size,
    }


@statement("Adam step: tied ||dF_1|| <= sum_j ||sum_r U_{r,j}|| ||dtheta_j||", REF, "property")
def check_bound(profile: Profile) -> Outcome:
    tight, worst = Tightest(), [0.0, 0.0]

    @profile.hypothesis(examples=8)
    @given(
        K=st.integers(1, 2),
        R=st.integers(1, 4),
        norm=st.sampled_from(NORMS),
        p=st.floats(0.1, 1.0),
        seed=st.integers(0, 10**4),
    )
    @example(K=1, R=1, norm="deepnorm", p=0.25, seed=0)
    @example(K=2, R=4, norm="deeploop", p=0.5, seed=1)
    def prop(K, R, norm, p, seed):
        res = adam_ratio(K, R, norm, p, seed)
        tight.see(res["ratio"], f"K={K}, R={R}, {norm}")
        worst[0], worst[1] = max(worst[0], res["identity"]), max(worst[1], res["size"])
        assert res["identity"] <= 1e-10, res
        assert res["ratio"] <= 1 + 1e-9, res
        assert res["size"] <= 0.1, res

    why = falsified(prop)
    return Outcome(
        why is None,
        f"tightest ||dF_1|| / bound {tight.ratio:.3f} at {tight.where} ({tight.count} models); "
        f"tied vs per-visit sum {worst[0]:.1e}; | ||dtheta_j|| / (eta sqrt n_j) - 1 | <= "
        f"{worst[1]:.1e}" + (f"; {why}" if why else ""),
    )


@functools.lru_cache(maxsize=8)
def adam_sweep(norm: str, Rs: tuple[int, ...], K: int = 2, seed: int = 0) -> tuple[dict, ...]:
    """``lp.bound_check`` with one real Adam step (lr 1e-3) per R, d = 8."""
    idx, tgt = tokens(16, 2, 4, seed)
    rows = []
    for R in Rs:
        model = tiny_gpt(K, R, norm, seed=seed)
        with lp.attach(model) as probe:
            chk = lp.bound_check(
                probe, idx, lambda out, inp: cross_entropy(out, tgt), lr=ETA, optimizer="adam",
                method="lanczos", max_iter=20, tol=1e-8,
            )  # fmt: skip
        rows.append({"R": R, "dF": chk.dF_true, "adam": chk.prediction_adam,
                     "sgd": chk.prediction_sgd, "family": chk.family,
                     "converged": bool(chk.report.sublayers.converged.all())})  # fmt: skip
    return tuple(rows)


def _flat(profile: Profile, form: str) -> Outcome:
    Rs = _rs(profile)
    rows = {n: adam_sweep(n, Rs) for n in ("deepnorm", "deeploop")}
    slopes = {n: loglog_slope(Rs, [r["dF"] / r[form] for r in rs]) for n, rs in rows.items()}
    conv = all(r["converged"] and r["family"] == "adam" for rs in rows.values() for r in rs)
    ok = conv and all(abs(s) <= SLOPE_C for s in slopes.values())
    text = ", ".join(f"{n} {s:+.3f}" for n, s in slopes.items())
    return Outcome(
        ok,
        f"slope in R of ||dF|| / ({'J_g kappa_U b/a' if form == 'adam' else 'M_g kappa_R (b/a)^2'})"
        f" after one Adam step: {text}; want |slope| <= {SLOPE_C} over R={list(Rs)}"
        + ("" if conv else " (NOT converged)"),
    )


@statement("Adam step: C_A = ||dF|| / (J_g kappa_U (beta/alpha)) flat in R", REF, "rate")
def check_adam_form(profile: Profile) -> Outcome:
    return _flat(profile, "adam")


@wrong_variant("SGD form on an Adam step: ||dF|| / (M_g kappa_R (b/a)^2) flat in R", REF, "rate")
def wrong_sgd_form(profile: Profile) -> Outcome:
    return _flat(profile, "sgd")
