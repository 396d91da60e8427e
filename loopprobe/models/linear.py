"""LinearLoop: a tiny looped model with closed-form answers, for estimator tests.

State h_0 = x (B, d). Each of the R rounds applies the one looped sublayer W:
residual form ``h <- h + eps * W h (+ U x)``, norm form ``h <- RMSNorm(alpha h + W h) (+ U x)``.
With ``spectrum`` the symmetric W = Q diag(spectrum) Q^T has planted eigenvalues, so the
transition I + eps W, its fixed point (I - A)^-1 U x and its spectral radius are known.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from loopprobe.models.gpt import _at_least, _choice
from loopprobe.models.layers import RMSNorm, no_global_draws

FORMS = ("residual", "norm")


@dataclass(frozen=True)
class LinearLoopConfig:
    d: int = 8
    R: int = 4
    form: str = "residual"
    eps: float | None = None
    alpha: float = 1.0
    spectrum: tuple[float, ...] | None = None
    recall: bool = False

    def __post_init__(self) -> None:
        c = "LinearLoopConfig"
        _at_least(c, "d", self.d, 1)
        _at_least(c, "R", self.R, 1)
        _choice(c, "form", self.form, FORMS)
        if self.spectrum is not None and len(self.spectrum) != self.d:
            raise ValueError(
                f"{c}.spectrum has {len(self.spectrum)} values but d={self.d}; give d eigenvalues"
            )

    @property
    def step_size(self) -> float:
        """eps of the residual form (default 1/R)."""
        return 1.0 / self.R if self.eps is None else self.eps


class LinearLoop(nn.Module):
    """R rounds of one shared linear sublayer; ``forward(x) -> h_R``."""

    def __init__(self, cfg: LinearLoopConfig, generator: torch.Generator | None = None):
        super().__init__()
        self.cfg = cfg
        d = cfg.d
        with no_global_draws():  # default inits are overwritten below
            self.W = nn.Linear(d, d, bias=False)
            self.U = nn.Linear(d, d, bias=False) if cfg.recall else None
            self.norm = RMSNorm(d, affine=False) if cfg.form == "norm" else None
        with torch.no_grad():
            if cfg.spectrum is None:
                self.W.weight.copy_(torch.randn(d, d, generator=generator) / d**0.5)
            else:
                Q, _ = torch.linalg.qr(torch.randn(d, d, generator=generator, dtype=torch.float64))
                s = torch.tensor(cfg.spectrum, dtype=torch.float64)
                self.W.weight.copy_((Q * s) @ Q.t())
            if self.U is not None:
                self.U.weight.copy_(torch.randn(d, d, generator=generator) / d**0.5)

    @property
    def loopprobe_sublayers(self) -> list[str]:
        return ["W"]

    def step(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """One round T(h; x)."""
        if self.norm is None:
            h = h + self.cfg.step_size * self.W(h)
        else:
            h = self.norm(self.cfg.alpha * h + self.W(h))
        if self.U is not None:
            h = h + self.U(x)
        return h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for _ in range(self.cfg.R):
            h = self.step(h, x)
        return h

    def transition_matrix(self) -> torch.Tensor:
        """A = I + eps W, so that h_R = A^R x without recall (residual form only)."""
        if self.norm is not None:
            raise ValueError("LinearLoop.transition_matrix: only the residual form is linear")
        W = self.W.weight.detach()
        return torch.eye(self.cfg.d, dtype=W.dtype) + self.cfg.step_size * W
