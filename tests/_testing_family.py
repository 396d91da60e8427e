"""A small looped model family written from scratch, the way a user would (for the tests of
``loopprobe.testing``), with switches that plant the bugs the checks must catch."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """A post-norm residual MLP block: ``h <- norm(alpha h + W2 tanh(W1 h))``."""

    def __init__(self, d: int, beta: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d, bias=False)
        self.fc2 = nn.Linear(2 * d, d, bias=False)
        self.norm = nn.LayerNorm(d, elementwise_affine=False)
        self.beta = beta
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for lin in (self.fc1, self.fc2):
            nn.init.xavier_normal_(lin.weight.data, gain=self.beta)

    def forward(self, h: torch.Tensor, alpha: float, ste=False, pre=False) -> torch.Tensor:
        if pre:  # h + f(norm(h)): nothing keeps the stream from growing with R
            return h + self.fc2(torch.tanh(self.fc1(self.norm(h))))
        w = self.fc1.weight
        if ste:  # 6-bit weights with a straight-through gradient
            w = w + (torch.round(w * 32) / 32 - w).detach()
        return self.norm(alpha * h + self.fc2(torch.tanh(F.linear(h, w))))


class Loop(nn.Module):
    """K blocks applied R times. ``p``: 1/4 DeepNorm, 1/2 DeepLoop (alpha = (2N)^p,
    beta = (8N)^-p with N = K R block visits). Planted bugs: ``bug="scale"`` computes alpha
    from the K physical blocks instead of the K R visits (what copying DeepNorm from an
    unlooped model gives); ``bug="reinit"`` re-initialises the block at every visit;
    ``bug="bypass"`` applies fc2 once more through ``F.linear`` outside its module call."""

    def __init__(self, d: int = 8, R: int = 4, K: int = 1, p: float = 0.5, bug: str = "") -> None:
        super().__init__()
        N = K * R
        self.cfg = SimpleNamespace(R=R, K=K, alpha=(2 * N) ** p, beta=(8 * N) ** -p)
        self.run_alpha = (2 * K) ** p if bug == "scale" else self.cfg.alpha
        self.bug = bug
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d, self.cfg.beta) for _ in range(K))
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for _ in range(self.cfg.R):
            for blk in self.blocks:
                if self.bug == "reinit":
                    blk.reset_parameters()  # writes .data: autograd never notices
                h = blk(h, self.run_alpha, ste=self.bug == "ste", pre=self.bug == "prenorm")
        if self.bug == "bypass":
            h = h + 0.1 * F.linear(h, self.blocks[0].fc2.weight[:, : h.shape[-1]])
        return self.out(h)


class Cell(nn.Module):
    """``h <- tanh(W h + x)`` with ``||W||_2 = rho``: a contraction when rho < 1."""

    def __init__(self, d: int, rho: float) -> None:
        super().__init__()
        self.W = nn.Linear(d, d, bias=False)
        with torch.no_grad():
            self.W.weight.mul_(rho / torch.linalg.matrix_norm(self.W.weight, 2))

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.W(h) + x)


class Recur(nn.Module):
    """A weight-tied recurrence run R times from h = 0 (a DEQ-style loop)."""

    def __init__(self, d: int = 6, R: int = 8, rho: float = 0.5) -> None:
        super().__init__()
        self.R = R
        self.cell = Cell(d, rho)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros_like(x)
        for _ in range(self.R):
            h = self.cell(h, x)
        return h


def recur(rho: float, seed: int = 0) -> Recur:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return Recur(rho=rho).double()


def loop(R: int = 4, K: int = 1, d: int = 8, seed: int = 0, p: float = 0.5, bug: str = ""):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return Loop(d, R, K, p, bug).double()


def batch(model: nn.Module, generator: torch.Generator) -> torch.Tensor:
    d = model.inp.in_features
    return torch.randn(3, 5, d, generator=generator, dtype=torch.float64)


def loss(out: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def deeploop(R: int) -> Loop:
    """``factory(R)`` for ``python -m proofs_check --model _testing_family:deeploop``."""
    return loop(R=R)


def wrong_scale(R: int) -> Loop:
    return loop(R=R, bug="scale")


def inputs(model: nn.Module) -> torch.Tensor:
    return batch(model, torch.Generator().manual_seed(0))
