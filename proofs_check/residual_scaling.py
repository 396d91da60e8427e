"""Seeds 003/004 (arXiv 2606.18524): shared increments add coherently; eps = lambda/(N sqrt L).

Statement (seed 003 and 004 abstracts; PAPERS.md 2b, Theorems 1 and 3). In a pre-norm
looped stack h <- h + eps f(h), a SHARED layer adds positively correlated increments at
every loop, so their sum grows like N (the loop count), while DISTINCT layers add nearly
uncorrelated increments whose sum grows like sqrt(L). Hence eps = 1/sqrt(N) (depth-muP) is
not enough for loops, eps = 1/N is; for L unique layers looped N times,
eps = lambda / (N sqrt L) keeps the forward pass O(1) in both N and L.

Checks (rate; the reference LoopedGPT, Pre-LN, at initialisation, float32, d = 32, a batch
of 4 x 16 random tokens, mean over seeds). An increment is a residual branch's output as
added to the stream, recorded per visit by ``lp.increments``.
- how increments add: the coherence ratio rho = ||sum_r inc_r||^2 / sum_r ||inc_r||^2 of a
  group of visits (1 = uncorrelated, = number of visits when aligned; averaged over the
  groups: a shared sublayer's visits, or one role ``blocks.*.attn`` of an untied stack)
  grows like N for one shared block looped N times (slope 1 +- 0.15 over N = 1..32,
  eps = 1) and stays flat for L distinct blocks (slope 0 +- 0.15 over L = 1..32). We test
  rho rather than ||sum inc|| because at this scale the size of each increment still
  changes over the first few layers (the embedding is small), which tilts ||sum inc|| for
  distinct layers to L^0.6; the figure shows those raw slopes too.
- eps = lambda/(N sqrt L), lambda = 1: RMS(h_N - h_0) (``lp.increments``' growth times
  RMS(h_0)) has log-log slope within 0.15 of 0 in N (L = 2, N = 1..32) and in L (N = 4,
  L = 1..16).

Wrong variants: eps = 1/sqrt(N) (depth-muP, N = loops, L = 1) keeps the looped forward
O(1) -- measured slope ~0.6; eps = 1/N without the 1/sqrt(L) factor keeps it O(1) in L --
measured slope ~0.6.

What a check cannot establish: the infinite-width statements of the paper (d = 32 here),
the learning-rate transfer claims (those need training sweeps), or behaviour after
training (the paper's cosines change during training).
"""

from __future__ import annotations

import functools
import math

import numpy as np

import loopprobe as lp
from proofs_check._common import loglog_slope, tiny_gpt, tokens
from proofs_check._registry import Outcome, Profile, statement, wrong_variant

REF = "seeds 003/004, arXiv 2606.18524"
TOL = 0.15
D, T, B = 32, 16, 4


def _model(K: int, R: int, tied: bool, residual: str, seed: int, lam: float = 1.0):
    m = tiny_gpt(
        K,
        R,
        "pre",
        tied=tied,
        d=D,
        heads=4,
        vocab=64,
        T=T,
        seed=seed,
        residual=residual,
        mup_lambda=lam,
    )
    return m.float()


def _increments(K: int, R: int, tied: bool, residual: str, seed: int, lam: float = 1.0):
    m = _model(K, R, tied, residual, seed, lam)
    idx, _ = tokens(64, B, T, seed)
    return lp.increments(m, idx)


@functools.cache
def coherence(K: int, R: int, tied: bool, seeds: int) -> tuple[float, float]:
    """Mean over seeds of (rho averaged over groups, RMS(h_N - h_0)); eps = 1."""
    rhos, sums = [], []
    for s in range(seeds):
        inc = _increments(K, R, tied, "none", s)
        rhos.append(inc.mean_ratio)
        sums.append(inc.growth * inc.h0_rms)
    return float(np.mean(rhos)), float(np.mean(sums))


@functools.cache
def growth(K: int, R: int, residual: str, seeds: int, lam: float = 1.0) -> float:
    """Mean RMS(h_N - h_0) of the tied loop at init (lp.increments: growth * RMS(h_0))."""
    vals = []
    for s in range(seeds):
        inc = _increments(K, R, True, residual, s, lam)
        vals.append(inc.growth * inc.h0_rms)
    return float(np.mean(vals))


def _ns(profile: Profile) -> list[int]:
    return [1, 2, 4, 8, 16, 32] + ([64] if profile.wide else [])


def _ls(profile: Profile) -> list[int]:
    return [1, 2, 4, 8, 16] + ([32] if profile.wide else [])


@statement("shared increments add coherently (rho ~ N), distinct ones do not", REF, "rate")
def check_coherence(profile: Profile) -> Outcome:
    Ns, seeds = _ns(profile), 2 * profile.seeds
    tied = [coherence(1, n, True, seeds) for n in Ns]
    untied = [coherence(1, n, False, seeds) for n in Ns]
    s_t = loglog_slope(Ns, [r for r, _ in tied])
    s_u = loglog_slope(Ns, [r for r, _ in untied])
    n_t = loglog_slope(Ns, [v for _, v in tied])
    n_u = loglog_slope(Ns, [v for _, v in untied])
    return Outcome(
        abs(s_t - 1) <= TOL and abs(s_u) <= TOL,
        f"rho slope: shared {s_t:.2f} (want 1), distinct {s_u:.2f} (want 0); "
        f"||sum inc|| slope: shared {n_t:.2f}, distinct {n_u:.2f}",
    )


@statement("eps = lambda/(N sqrt L) keeps the forward pass O(1) in N and L", REF, "rate")
def check_loop_mup(profile: Profile) -> Outcome:
    Ns, Ls, seeds = _ns(profile), _ls(profile), 2 * profile.seeds
    vN = [growth(2, n, "loop-mup", seeds) for n in Ns]
    vL = [growth(L, 4, "loop-mup", seeds) for L in Ls]
    sN, sL = loglog_slope(Ns, vN), loglog_slope(Ls, vL)
    return Outcome(
        abs(sN) <= TOL and abs(sL) <= TOL,
        f"RMS(h_N - h_0) slope in N {sN:.3f}, in L {sL:.3f} (want 0 +-{TOL}); "
        f"range {min(vN + vL):.2f}..{max(vN + vL):.2f}",
    )


@wrong_variant("eps = 1/sqrt(N) keeps the looped forward pass O(1)", REF, "rate")
def wrong_sqrt(profile: Profile) -> Outcome:
    Ns, seeds = _ns(profile), 2 * profile.seeds
    s = loglog_slope(Ns, [growth(1, n, "1/sqrt(N)", seeds) for n in Ns])
    return Outcome(abs(s) <= TOL, f"RMS(h_N - h_0) slope in N {s:.3f} (O(1) would be 0 +-{TOL})")


@wrong_variant("eps = 1/N without 1/sqrt(L) keeps the forward pass O(1) in L", REF, "rate")
def wrong_no_sqrt_l(profile: Profile) -> Outcome:
    Ls, seeds = _ls(profile), 2 * profile.seeds
    # loop-mup with lambda = sqrt(L) is exactly eps = 1/N (N = loops)
    s = loglog_slope(Ls, [growth(L, 4, "loop-mup", seeds, lam=math.sqrt(L)) for L in Ls])
    return Outcome(abs(s) <= TOL, f"RMS(h_N - h_0) slope in L {s:.3f} (O(1) would be 0 +-{TOL})")
