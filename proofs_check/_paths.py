"""Random one-step transitions H -> H + D with a readout, for the finite-step statements.

All derivatives come from the library (``lp.finite_step``: A = phi'(0), Q = phi''(0)/2 by
forward-mode AD; ``path_gains``: phi on a grid). phi''(s) at an interior point s is
read off as 2 Q of the shifted transition H + s D -> H + (s + 1) D, many s at once (they
are stacked along the example axis).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from hypothesis import strategies as st

import loopprobe as lp
from loopprobe.estimate.finitestep import path_gains, reference_logprob
from loopprobe.models import GPTConfig, LoopedGPT

f64 = torch.float64
READOUTS = ("affine", "mlp", "quadratic")


@dataclass
class Path:
    H: torch.Tensor  # (1, T, d)
    D: torch.Tensor  # (1, T, d)
    readout: object
    targets: torch.Tensor  # (1, T)
    utility: object = None  # None: the reference-token log-probability

    def _batch(self, s: np.ndarray):
        s_t = torch.as_tensor(np.asarray(s, float), dtype=f64).view(-1, 1, 1)
        return self.H + s_t * self.D, self.targets.expand(len(s_t), -1)

    def taylor(self) -> lp.results.FiniteStep:
        """A, Q, phi(1), KL, alpha_hat of the transition itself (example 0)."""
        return lp.finite_step(
            lambda h: h + self.D, self.H, self.readout, self.targets, utility=self.utility
        )

    def phi2(self, s: np.ndarray) -> np.ndarray:
        """phi''(s) at each s."""
        Hs, tg = self._batch(s)
        fs = lp.finite_step(lambda h: h + self.D, Hs, self.readout, tg, utility=self.utility)
        return 2 * fs.Q

    def phi_batch(self, alphas: np.ndarray) -> np.ndarray:
        """phi at each alpha in one batched evaluation of U (for dense grids and root finding;
        ``phi`` goes through the library's ``path_gains`` instead)."""
        Hs, tg = self._batch(alphas)
        U = self.utility or reference_logprob(self.readout, tg)
        U0 = (self.utility or reference_logprob(self.readout, self.targets))(self.H)
        with torch.no_grad():
            return (U(Hs) - U0).numpy()

    def phi(self, alphas: np.ndarray) -> np.ndarray:
        """phi(alpha) = U(H + alpha D) - U(H) at each alpha."""
        a = torch.as_tensor(np.asarray(alphas, float), dtype=f64)
        df = path_gains(
            lambda h: h + self.D, self.H, self.readout, self.targets, a, utility=self.utility
        )
        return df.sort_values("alpha").gain.to_numpy()


def random_path(seed: int, readout: str, scale: float, d: int = 6, T: int = 3, V: int = 7) -> Path:
    """Gaussian H and D (|D| ~ scale), a random readout of the given kind."""
    g = torch.Generator().manual_seed(seed)
    H = torch.randn(1, T, d, generator=g, dtype=f64)
    D = scale * torch.randn(1, T, d, generator=g, dtype=f64)
    W = torch.randn(V, d, generator=g, dtype=f64) / d**0.5
    b = 0.5 * torch.randn(V, generator=g, dtype=f64)
    W1 = 2 * torch.randn(d, d, generator=g, dtype=f64) / d**0.5
    targets = torch.randint(0, V, (1, T), generator=g)
    if readout == "affine":
        return Path(H, D, lambda h: h @ W.T + b, targets)
    if readout == "mlp":
        return Path(H, D, lambda h: 3 * torch.tanh(h @ W1.T) @ W.T + b, targets)
    if readout == "quadratic":  # U = -|H - H*|^2 / 2: phi is exactly quadratic
        target = torch.randn(1, T, d, generator=g, dtype=f64)
        U = lambda h: -0.5 * (h - target).pow(2).flatten(1).sum(1)  # noqa: E731
        return Path(H, D, lambda h: h @ W.T + b, targets, U)
    raise ValueError(readout)


def looped_path(seed: int, scale: float) -> Path:
    """A round of a tiny pre-norm LoopedGPT with recall; affine readout by the tied embedding."""
    cfg = GPTConfig(vocab_size=16, seq_len=4, d_model=8, n_heads=2, K=1, R=2, recall="add")
    model = LoopedGPT(cfg, generator=torch.Generator().manual_seed(seed)).double()
    idx = torch.randint(0, 16, (1, 4), generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        x = model.embed(idx)
        H = model.step(x, x)
        D = scale * (model.step(H, x) - H)
    E = model.tok_emb.weight.detach()
    return Path(H, D, lambda h: 10 * h @ E.T, torch.roll(idx, -1, dims=1))


def make(seed: int, readout: str, scale: float, small_slope: bool = False) -> Path:
    """A path of the given kind; ``small_slope`` tilts D so that A = phi'(0) is small and
    positive (2% of |grad U| |D|): the right direction with a long step, where finite-step
    failures live."""
    path = looped_path(seed, scale) if readout == "looped" else random_path(seed, readout, scale)
    if small_slope:
        U = path.utility or reference_logprob(path.readout, path.targets)
        g = torch.func.grad(lambda h: U(h).sum())(path.H)
        gn = g / g.norm()
        D = path.D - (path.D * gn).sum() * gn
        path.D = D + 0.02 * D.norm() * gn
    return path


def argmax_on_grid(f, lo: float = 0.0, hi: float = 1.0, n: int = 201) -> tuple[float, float]:
    """Maximiser of f on [lo, hi]: a grid, a finer grid around the best point, then the
    vertex of the parabola through the three best neighbours (exact for quadratics)."""
    for _ in range(2):
        x = np.linspace(lo, hi, n)
        y = f(x)
        i = int(np.argmax(y))
        lo, hi = x[max(i - 1, 0)], x[min(i + 1, n - 1)]
    if 0 < i < n - 1:
        x0, x1 = x[i - 1], x[i]
        y0, y1, y2 = y[i - 1], y[i], y[i + 1]
        den = y0 - 2 * y1 + y2
        if den < 0:
            xv = x1 + 0.5 * (x1 - x0) * (y0 - y2) / den
            yv = float(f(np.array([xv]))[0])
            if yv >= y1:
                return float(xv), yv
    return float(x[i]), float(y[i])


def curvature_integral(path: Path, alpha: float, weight) -> tuple[float, int]:
    """int_0^alpha weight(s) phi''(s) ds by Gauss-Legendre, doubling the nodes until two
    successive rules agree to 1e-12 (relative); returns (value, nodes used).

    A fixed rule is not enough: a large step through a tanh readout makes phi'' oscillate.
    """
    prev = None
    for n in (32, 64, 128, 256, 512, 1024):
        x, w = np.polynomial.legendre.leggauss(n)
        s = alpha * (x + 1) / 2
        val = alpha / 2 * float(np.sum(w * weight(s) * path.phi2(s)))
        if prev is not None and abs(val - prev) <= 1e-12 * (1 + abs(val)):
            return val, n
        prev = val
    raise RuntimeError(f"curvature_integral: no convergence up to 1024 nodes (last {val!r})")


def path_args(kinds: tuple[str, ...]) -> dict:
    """Hypothesis strategies for ``make(seed, kind, scale, small)``: the checks' common draw."""
    return {
        "seed": st.integers(0, 10**5),
        "kind": st.sampled_from(kinds),
        "scale": st.floats(0.01, 4.0),
        "small": st.booleans(),
    }


def shaped_path(seed: int, shape: str, A: float, k0: float, k1: float, w: float) -> Path:
    """A transition whose gain phi(alpha) = psi(alpha) has a chosen curvature profile.

    The utility is U(h) = psi(<h - H, D> / |D|^2) on a random state, so phi = psi exactly;
    phi'' comes from the library's forward-mode AD like every other path. ``shape``:
    ``"decay"``: psi'' = -k1 - (k0 - k1) exp(-t / w) (curvature -k0 at 0 relaxing to -k1);
    ``"bump"``: psi'' = -k0 + k1 (t / w) e^(1 - t / w) (a curvature bump of height k1 at w).
    psi(0) = 0 and psi'(0) = A in both.
    """
    g = torch.Generator().manual_seed(seed)
    H = torch.randn(1, 3, 6, generator=g, dtype=f64)
    D = torch.randn(1, 3, 6, generator=g, dtype=f64)
    W = torch.randn(7, 6, generator=g, dtype=f64) / 6**0.5
    targets = torch.randint(0, 7, (1, 3), generator=g)
    H0, D0, n2 = H.clone(), D.clone(), float(D.pow(2).sum())

    def U(h: torch.Tensor) -> torch.Tensor:
        t = ((h - H0) * D0).flatten(1).sum(1) / n2
        if shape == "decay":
            e = torch.exp(-t / w)
            return A * t - k1 * t**2 / 2 - (k0 - k1) * w * (t - w * (1 - e))
        if shape == "bump":
            e = torch.exp(-t / w)
            return A * t - k0 * t**2 / 2 + k1 * math.e * w * (t - 2 * w * (1 - e) + t * e)
        raise ValueError(shape)

    return Path(H, D, lambda h: h @ W.T, targets, U)
