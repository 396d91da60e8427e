"""DeepNorm constants: beta/alpha = 1/(2 sqrt N) and M (beta/alpha)^2 = 1/2.

Statement (seed 002, Eq. 3, 5, 6, 4). A Post-LN DeepNorm decoder with N blocks has
M = 2N residual sublayers, skip scale alpha = (2N)^(1/4) and per-matrix init gain
beta = (8N)^(-1/4). Then beta/alpha = 1/(2 sqrt N) and the first-order update condition
M (beta/alpha)^2 = Theta(1) holds with the constant exactly 1/2. beta is an init gain:
W^(0) = beta * W~^(0) on the DeepNorm matrices (attention v, o and both MLP matrices) and
nothing else.

Assumptions: N >= 1 real; M = 2N (two residual sublayers per block).

Checks: the identities in sympy for symbolic N; ``loopprobe.theory.scales`` against them
on a grid of N; and the reference LoopedGPT's init against Eq. 4: the same random draw
with and without the gain differs by exactly beta on v, o, fc1, fc2 and not at all on q, k.

Wrong variant: reading the residual-branch gain beta alone as the update size (forgetting
the 1/alpha that Lemma A.1 puts on the branch): M beta^2 is not O(1) but grows like sqrt N.

What a check cannot establish: that Eq. 6 is the right stability condition (that is
the DeepNet perturbation argument, Prop. A.3, checked numerically elsewhere), nor anything
about training. Here only the arithmetic and the implementation of the constants.
"""

from __future__ import annotations

import math

import sympy as sp
import torch

from loopprobe import theory
from loopprobe.models import GPTConfig, LoopedGPT
from proofs_check._registry import Outcome, Profile, statement, wrong_variant

REF = "seed 002, Eq. 3-6"
N = sp.symbols("N", positive=True)
ALPHA = (2 * N) ** sp.Rational(1, 4)
BETA = (8 * N) ** sp.Rational(-1, 4)


def init_gain_ratios(norm: str, K: int = 2, R: int = 3, seed: int = 0) -> dict[str, float]:
    """max |W_scaled / (beta W_unscaled) - 1| per matrix kind, same generator draw."""
    cfg = GPTConfig(d_model=16, n_heads=2, K=K, R=R, norm=norm)
    scaled = LoopedGPT(cfg, generator=torch.Generator().manual_seed(seed))
    plain = LoopedGPT(
        GPTConfig(d_model=16, n_heads=2, K=K, R=R, norm="post"),
        generator=torch.Generator().manual_seed(seed),
    )
    beta = cfg.beta
    out = {}
    for name, w in scaled.named_parameters():
        if not name.startswith("blocks.") or not name.endswith("weight") or "norm" in name:
            continue
        w0 = dict(plain.named_parameters())[name]
        gain = beta if name in scaled.beta_matrices() else 1.0
        rel = ((w.double() - gain * w0.double()).abs().max() / w0.double().abs().max()).item()
        kind = name.split(".")[-2]
        out[kind] = max(out.get(kind, 0.0), rel)
    return out


@statement("DeepNorm: beta/alpha = 1/(2 sqrt N), M(beta/alpha)^2 = 1/2", REF, "symbolic")
def check(profile: Profile) -> Outcome:
    ratio = sp.simplify(BETA / ALPHA)
    ok_ratio = sp.simplify(ratio - 1 / (2 * sp.sqrt(N))) == 0
    const = sp.simplify(2 * N * ratio**2)
    ok_const = const == sp.Rational(1, 2)
    grid = [1, 2, 3, 7, 12, 48, 1000, 10**6] + (
        [10**k + 1 for k in range(9)] if profile.wide else []
    )
    worst = 0.0
    for n in grid:
        sc = theory.scales(n, "deepnorm")
        worst = max(
            worst, abs(sc.ratio * 2 * math.sqrt(n) - 1), abs(theory.untied_bound(n, sc) * 2 - 1)
        )
    gains = init_gain_ratios("deepnorm")
    ok_init = max(gains.values()) < 1e-6
    return Outcome(
        ok_ratio and ok_const and worst < 1e-12 and ok_init,
        f"beta/alpha={sp.sstr(ratio)}; M(beta/alpha)^2={const}; theory.py rel err {worst:.0e}; "
        f"init W=beta*W~ to {max(gains.values()):.0e}",
    )


@wrong_variant("DeepNorm with beta alone: M beta^2 = O(1)", REF + " (vs Lemma A.1)", "symbolic")
def wrong_beta_alone(profile: Profile) -> Outcome:
    expr = sp.simplify(2 * N * BETA**2)
    lim = sp.limit(expr, N, sp.oo)
    return Outcome(lim.is_finite, f"M beta^2 = {sp.sstr(expr)} -> {lim} as N -> oo")
