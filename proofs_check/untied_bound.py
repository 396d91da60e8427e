"""Eq. 9/10, Proposition A.3: the depth-untied bound ||Delta F|| <= C' M (beta/alpha)^2.

Statement (seed 002, Eq. 9, 10; Prop. A.3). Under Assumption 3.1 (each visit's output
sensitivity and effective update are O(beta/alpha)), summing the M = 2N visits of a
depth-UNtied post-norm network gives ||Delta F|| <= C' M (beta/alpha)^2 for one update of
learning rate eta (eta absorbed into C'), so M (beta/alpha)^2 = O(1) suffices.

Check (rate, float64): the reference LoopedGPT with ``tied=False`` (K R distinct blocks,
each applied once), post-norm family alpha = (2N)^p, beta = (8N)^(-p) with p = 1/4
(DeepNorm) and p = 1/2, at initialisation; one SGD step (lr 1e-3) on the residual-branch
parameters of the blocks (embeddings, norms, head fixed); F = logits of a fixed random
batch. M (beta/alpha)^2 = 2N 16^(-2p) N^(-4p) scales like N^(1-4p): slope 0 for p = 1/4
and -1 for p = 1/2. Pass: each measured log-log slope of ||Delta F|| in N within 0.15 of
1 - 4p, and the implied constant C' = ||Delta F|| / (eta M (beta/alpha)^2) within a factor
2 over all N and both p.

The bound is an upper bound, yet here it is also the rate: the first-order change is
-eta sum_i U_i U_i^T dL/dF, a sum of positive semi-definite terms, so untied visits add
without cancellation and M (beta/alpha)^2 is attained up to the constant.

Wrong variant: "||Delta F|| scales like M beta/alpha" (the ratio counted once, as if
only sensitivity or only the update were small): it predicts slope 1 - 2p, i.e. 0 for
p = 1/2, against a measured -1.

What a check cannot establish: the bound for a trained network or another optimizer
(Adam's preconditioning is absorbed into C'), nor the size of C' at other widths; N <= 16
(32 with --thorough).
"""

from __future__ import annotations

import functools

import numpy as np

from proofs_check._common import band, loglog_slope, one_sgd_step_change, tiny_gpt, tokens
from proofs_check._registry import Outcome, Profile, statement, wrong_variant

REF = "seed 002, Eq. 9-10, Prop. A.3"
LR = 1e-3
TOL = 0.15


@functools.cache
def untied_sweep(p: float, Rs: tuple[int, ...], seeds: int, K: int = 2):
    """(N list, mean ||Delta F|| list, M (beta/alpha)^2 list) for the untied model."""
    Ns, dF, pred = [], [], []
    for r in Rs:
        vals = []
        for s in range(seeds):
            m = tiny_gpt(K, r, "postp", p=p, tied=False, d=16, vocab=32, T=8, seed=s)
            idx, tgt = tokens(32, 4, 8, s)
            vals.append(float(one_sgd_step_change(m, idx, tgt, LR)["dF"].norm()))
        Ns.append(m.cfg.N)
        dF.append(float(np.mean(vals)))
        pred.append(m.cfg.M * m.cfg.scales.ratio**2)
    return Ns, dF, pred


def _rs(profile: Profile) -> tuple[int, ...]:
    return (1, 2, 4, 8, 16) if profile.wide else (1, 2, 4, 8)


@statement("Prop A.3: untied ||dF|| ~ M(beta/alpha)^2, bounded C' across N", REF, "rate")
def check(profile: Profile) -> Outcome:
    slopes, consts = {}, []
    for p in (0.25, 0.5):
        Ns, dF, pred = untied_sweep(p, _rs(profile), profile.seeds)
        slopes[p] = loglog_slope(Ns, dF)
        consts += [f / (LR * b) for f, b in zip(dF, pred, strict=True)]
    ok = all(abs(slopes[p] - (1 - 4 * p)) <= TOL for p in slopes) and band(consts) <= 2
    return Outcome(
        ok,
        f"slope in N: p=1/4 {slopes[0.25]:.3f} (want 0), p=1/2 {slopes[0.5]:.3f} (want -1); "
        f"C' {min(consts):.3g}..{max(consts):.3g} (band {band(consts):.2f} <= 2)",
    )


@wrong_variant("untied ||dF|| ~ M beta/alpha (ratio counted once)", REF, "rate")
def wrong_ratio_once(profile: Profile) -> Outcome:
    res = {}
    for p in (0.25, 0.5):
        Ns, dF, _ = untied_sweep(p, _rs(profile), profile.seeds)
        res[p] = loglog_slope(Ns, dF)
    ok = all(abs(res[p] - (1 - 2 * p)) <= TOL for p in res)
    return Outcome(ok, f"predicted slopes 0.5, 0; measured {res[0.25]:.3f}, {res[0.5]:.3f}")
