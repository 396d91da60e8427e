"""Lemma A.1: RMSNorm(alpha x + z) = x + (z - <x,z>_d x)/alpha + O(RMS(z)^2 / alpha^2).

Statement (seed 002, Lemma A.1, stated in the text before Eq. 9; the digest quotes the
form). For x in R^d with RMS(x) = 1, any z, and alpha > 0 with RMS(z)/alpha <= c < 1,
writing <x,z>_d = <x,z>/d,

    RMSNorm(alpha x + z) = x + (z - <x,z>_d x)/alpha + r,   RMS(r) <= C(c) RMS(z)^2/alpha^2.

So the residual branch enters the normalised direction with a factor 1/alpha (only its
component orthogonal to x), which is why DeepNorm's ratio is beta/alpha, not beta.

An explicit constant (our derivation, following the proof): with t = z/alpha,
rho = RMS(t), a = <x,t>_d and s = RMS(x + t) in [1 - rho, 1 + rho],
r = x (1/s - 1 + a) + t (1/s - 1), 1/s - 1 + a = (s-1)^2 (s+2)/(2s) - rho^2/2, hence
RMS(r) <= rho^2 (5 + rho) / (2 (1 - rho)). (Not sharp: near rho -> 0 the sharp constant is
about 1/sqrt(3), attained at a = -rho/sqrt(3); the table reports how close hypothesis got.)

Checks, on the library's RMSNorm (eps = 0, no gain) in float64:
- property: hypothesis over d, x, the direction and size of z and alpha; the explicit
  bound with relative slack 1e-9; ``target`` pushes RMS(r) / bound up; ``@example`` pins
  the worst direction a = -rho/sqrt 3 and the edge rho = c = 0.9, and z parallel to x
  (remainder exactly 0).
- rate: RMS(r) against alpha over 10^1..10^4 at fixed z: log-log slope -2 +- 0.05.

Wrong variant: dropping the projection, RMSNorm(alpha x + z) = x + z/alpha + O(1/alpha^2):
its remainder decays with slope -1, not -2.

What a check cannot establish: the lemma for all d and all z (hypothesis samples; d <= 32),
or how the local expansion composes across M sublayers (that is Prop. A.3's argument).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import example, given, target
from hypothesis import strategies as st

from loopprobe.models import RMSNorm
from proofs_check._common import Tightest, falsified, loglog_slope
from proofs_check._registry import Outcome, Profile, statement, wrong_variant

REF = "seed 002, Lemma A.1"
C_MAX = 0.9
SLOPE_TOL = 0.05


def rmsnorm(u: torch.Tensor) -> torch.Tensor:
    return RMSNorm(u.shape[-1], eps=0.0, affine=False)(u)


def rms(v: torch.Tensor) -> float:
    return float(v.pow(2).mean().sqrt())


def instance(d: int, seed: int, rho: float, w: float, alpha: float):
    """x with RMS 1 and z = alpha * t, RMS(t) = rho, <x,t>_d = w * rho."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(d, generator=g, dtype=torch.float64)
    x = x / rms(x)
    y = torch.randn(d, generator=g, dtype=torch.float64)
    y = y - (y @ x) / d * x
    y = y / rms(y)
    t = rho * (w * x + math.sqrt(max(0.0, 1 - w * w)) * y)
    return x, alpha * t


def remainder(x: torch.Tensor, z: torch.Tensor, alpha: float, project: bool = True) -> torch.Tensor:
    d = x.numel()
    lin = z - (x @ z) / d * x if project else z
    return rmsnorm(alpha * x + z) - x - lin / alpha


def bound(rho: float) -> float:
    return rho**2 * (5 + rho) / (2 * (1 - rho))


@statement("Lemma A.1: RMS(remainder) <= C(c) RMS(z)^2/alpha^2", REF, "property")
def check_bound(profile: Profile) -> Outcome:
    tight = Tightest()

    @profile.hypothesis(examples=100)
    @given(
        d=st.integers(2, 32),
        seed=st.integers(0, 10**6),
        rho=st.floats(1e-4, C_MAX),
        w=st.floats(-1.0, 1.0),
        alpha=st.floats(1.0, 1e4),
    )
    @example(d=16, seed=0, rho=1e-3, w=-1 / math.sqrt(3), alpha=10.0)
    @example(d=16, seed=1, rho=C_MAX, w=-0.9623, alpha=1.0)
    @example(d=8, seed=2, rho=0.5, w=1.0, alpha=3.0)
    def prop(d, seed, rho, w, alpha):
        x, z = instance(d, seed, rho, w, alpha)
        rho_m = rms(z) / alpha
        r = rms(remainder(x, z, alpha))
        b = bound(rho_m)
        ratio = r / b
        target(ratio, label="RMS(r)/bound")
        tight.see(ratio, f"rho={rho:.3g}, a/rho={w:.3g}")
        assert r <= b * (1 + 1e-9) + 1e-15, (r, b)

    why = falsified(prop)
    return Outcome(
        why is None,
        f"tightest RMS(r)/bound {tight.ratio:.3f} at {tight.where} ({tight.count} examples)"
        + (f"; {why}" if why else ""),
    )


def _slopes(profile: Profile, project: bool) -> list[float]:
    alphas = np.logspace(1, 4, 13)
    out = []
    for seed in range(2 * profile.seeds):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(16, generator=g, dtype=torch.float64)
        x = x / rms(x)
        z = torch.randn(16, generator=g, dtype=torch.float64)
        z = z / rms(z)
        out.append(loglog_slope(alphas, [rms(remainder(x, z, a, project)) for a in alphas]))
    return out


@statement("Lemma A.1: remainder ~ alpha^-2 (log-log slope -2)", REF, "rate")
def check_rate(profile: Profile) -> Outcome:
    s = _slopes(profile, project=True)
    return Outcome(
        all(abs(v + 2) <= SLOPE_TOL for v in s),
        f"slope {min(s):.3f}..{max(s):.3f} over alpha=1e1..1e4 (want -2 +-{SLOPE_TOL})",
    )


@wrong_variant("Lemma A.1 without projection: x + z/alpha + O(alpha^-2)", REF, "rate")
def wrong_no_projection(profile: Profile) -> Outcome:
    s = _slopes(profile, project=False)
    return Outcome(
        all(abs(v + 2) <= SLOPE_TOL for v in s),
        f"slope {min(s):.3f}..{max(s):.3f} (an O(alpha^-2) remainder would be -2)",
    )
