"""Theorem 2 of arXiv 2606.18524: one Adam-like step moves h_N by at most ~ eta eps N.

Statement (PAPERS.md 2b, Theorem 2, a reading of the v2 PDF; the seeds 003/004 abstracts
state its consequence, a learning rate independent of N under eps = 1/N). For the looped
map h_{n+1} = h_n + eps W relu(h_n), n < N, W_ij ~ N(0, 1/d), ||h_0||^2/d = Theta(1), an
Adam-like update Delta W_ij = (eta/sqrt d) S_ij with |S_ij| <= 1 changes the output by
d^(-1/2) ||Delta h_N|| <= C_Delta Q_+ e^M eta eps N; so eta eps N = O(1) suffices, and with
eps = 1/N (eps N = 1, M fixed) the change is O(eta) whatever N.

Check (rate; float64, d = 128, 2 x seeds draws of W, h_0 and a readout u): S = sign of the
gradient of u . h_N / sqrt(d) (Adam's first step from a fresh state), eta = 1e-3 and 1e-2,
eps = 1/N, N = 1..64 (256 with --thorough). The ratio d^(-1/2) ||Delta h_N|| / (eta eps N)
(the true finite change, mean over draws) has log-log slope in N within +-0.1 of 0 at both
learning rates, and the two learning rates give the same ratio to 5 % (the change is
linear in eta, as the bound's form says).

Wrong variant: the update adds incoherently over the N visits of the shared W (the
untied/depth-muP count), ||Delta h_N|| <~ eta eps sqrt(N): the ratio
d^(-1/2) ||Delta h_N|| / (eta eps sqrt N) would be flat; it grows like sqrt(N) (measured
slope ~0.5), because every loop applies the same Delta W.

What a check cannot establish: the constants C_Delta, Q_+, e^M (unknown; only the shape
eta eps N is tested), the infinite-width limit (d = 128), the sharpness condition behind
eta ~ N^(alpha - 1), or anything about a trained Transformer (the model is the paper's
ReLU toy recurrence, not LoopedGPT).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from proofs_check._common import loglog_slope
from proofs_check._registry import Outcome, Profile, statement, wrong_variant

REF = "arXiv 2606.18524, Theorem 2 (PAPERS.md 2b)"
D = 128
TOL = 0.1
LRS = (1e-3, 1e-2)


def _step_change(N: int, eta: float, seed: int) -> float:
    """d^(-1/2) ||h_N(W + eta/sqrt(d) S) - h_N(W)|| for eps = 1/N, S = sign(grad)."""
    g = torch.Generator().manual_seed(20_000 + seed)
    W = torch.randn(D, D, generator=g, dtype=torch.float64) / math.sqrt(D)
    h0 = torch.randn(D, generator=g, dtype=torch.float64)
    u = torch.randn(D, generator=g, dtype=torch.float64)
    eps = 1.0 / N

    def h_N(W: torch.Tensor) -> torch.Tensor:
        h = h0
        for _ in range(N):
            h = h + eps * W @ torch.relu(h)
        return h

    Wg = W.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad((u * h_N(Wg)).sum() / math.sqrt(D), Wg)
    with torch.no_grad():
        dh = h_N(W + eta / math.sqrt(D) * torch.sign(grad)) - h_N(W)
    return float(dh.norm()) / math.sqrt(D)


@functools.cache
def changes(Ns: tuple[int, ...], eta: float, draws: int) -> tuple[float, ...]:
    return tuple(float(np.mean([_step_change(n, eta, s) for s in range(draws)])) for n in Ns)


def _ns(profile: Profile) -> tuple[int, ...]:
    return (1, 2, 4, 8, 16, 32, 64) + ((128, 256) if profile.wide else ())


@statement("Thm 2: Adam-like step, ||dh_N|| / (eta eps N) flat in N (eps = 1/N)", REF, "rate")
def check_lr_bound(profile: Profile) -> Outcome:
    Ns, draws = _ns(profile), 2 * profile.seeds
    ratios = {
        eta: [c / (eta * (1 / n) * n) for c, n in zip(changes(Ns, eta, draws), Ns, strict=True)]
        for eta in LRS
    }
    slopes = {eta: loglog_slope(Ns, r) for eta, r in ratios.items()}
    lin = max(abs(a / b - 1) for a, b in zip(ratios[LRS[0]], ratios[LRS[1]], strict=True))
    ok = all(abs(s) <= TOL for s in slopes.values()) and lin <= 0.05
    r0 = ratios[LRS[0]]
    return Outcome(
        ok,
        "ratio slope in N: "
        + ", ".join(f"eta={eta:g} {s:+.3f}" for eta, s in slopes.items())
        + f" (want 0 +-{TOL}); ratio {min(r0):.3g}..{max(r0):.3g} over N={list(Ns)}; "
        f"eta 1e-3 vs 1e-2 ratios differ by <= {lin:.1%} (want <= 5%)",
    )


@wrong_variant("Thm 2 with the incoherent count: ||dh_N|| <~ eta eps sqrt(N)", REF, "rate")
def wrong_sqrt_count(profile: Profile) -> Outcome:
    Ns, draws = _ns(profile), 2 * profile.seeds
    eta = LRS[0]
    cs = changes(Ns, eta, draws)
    r = [c / (eta * (1 / n) * math.sqrt(n)) for c, n in zip(cs, Ns, strict=True)]
    s = loglog_slope(Ns, r)
    return Outcome(
        abs(s) <= TOL, f"d^-1/2 ||dh_N|| / (eta eps sqrt N) slope {s:+.3f} (flat: 0 +-{TOL})"
    )
