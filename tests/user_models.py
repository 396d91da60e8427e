"""A user's own models, factories and input functions for ``loopprobe kappa/bound --model``.

Written the way a user would write them (not for loopprobe): referenced on the command
line as ``user_models:factory`` (the tests directory is on ``sys.path`` under pytest).
"""

from __future__ import annotations

import torch
from torch import nn

from loopprobe.models import GPTConfig, LoopedGPT

D = 6


def gpt(R: int = 3) -> nn.Module:
    """A small reference LoopedGPT in float64: has cfg, so no --inputs is needed."""
    cfg = GPTConfig(vocab_size=11, seq_len=5, d_model=8, n_heads=2, K=1, R=R, norm="deeploop")
    return LoopedGPT(cfg, generator=torch.Generator().manual_seed(0)).double()


class SharedBlock(nn.Module):
    """One residual MLP block applied R times; returns a tuple (F, an auxiliary scalar)."""

    def __init__(self, R: int = 3) -> None:
        super().__init__()
        self.R = R
        self.inp = nn.Linear(D, D)
        self.block = nn.Sequential(
            nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.Tanh(), nn.Linear(2 * D, D)
        )
        self.out = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.inp(x)
        for _ in range(self.R):
            h = h + self.block(h)
        y = self.out(h)
        return y, y.sum()


def shared(R: int = 3) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return SharedBlock(R).double()


def shared_no_args() -> nn.Module:
    return shared(4)


def batch(model: nn.Module) -> torch.Tensor:
    """Inputs for :class:`SharedBlock` (takes the model, as ``--inputs`` allows)."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, D, generator=g, dtype=torch.float64)


def batch_no_args() -> torch.Tensor:
    return batch(None)


def first(out: tuple) -> torch.Tensor:
    """``--output``: F is the first element of the tuple."""
    return out[0]


def squared_error(out: tuple, inputs: torch.Tensor) -> torch.Tensor:
    """``--loss``: a regression loss against a fixed target."""
    return (out[0] - 1.0).pow(2).mean()


def unlooped() -> nn.Module:
    return nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D)).double()


def not_a_module() -> int:
    return 3


NOT_CALLABLE = 42
