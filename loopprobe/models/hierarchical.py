"""HierarchicalLoop: an HRM-style reasoner with a slow module H and a fast module L.

Per outer cycle, L iterates C_L times on ``z_L + z_H + x``, then H updates once on
``z_H + z_L``. With the one-step gradient (HRM's training recipe) every cycle but the last
runs under ``torch.no_grad()``: forward-visible visits M = 2C(K_H + C_L K_L), gradient-visible
M_g = 2(K_H + C_L K_L). Reference: seed 002, Eq. 17-21.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from loopprobe import theory
from loopprobe.models.gpt import NORMS, _check_sizes, _choice, _ScaleGains
from loopprobe.models.layers import Block, RMSNorm, no_global_draws


@dataclass(frozen=True)
class HRMConfig(_ScaleGains):
    """Configuration of :class:`HierarchicalLoop`.

    The scales alpha, beta use the gradient-visible block-equivalent depth N_g = M_g / 2 when
    ``one_step_grad`` (seed 002, Eq. 22), else the forward depth M / 2.
    """

    vocab_size: int = 64
    seq_len: int = 32
    d_model: int = 32
    n_heads: int = 4
    K_H: int = 1
    K_L: int = 1
    C: int = 2
    C_L: int = 2
    mlp_ratio: int = 4
    norm: str = "post"
    p: float | None = None
    one_step_grad: bool = True

    def __post_init__(self) -> None:
        c = "HRMConfig"
        sizes = ("vocab_size", "seq_len", "d_model", "n_heads", "K_H", "K_L", "C", "C_L")
        _check_sizes(c, self, sizes)
        _choice(c, "norm", self.norm, NORMS)
        _ = self.scales  # validates p through the theory

    @property
    def M(self) -> int:
        """Forward-visible residual-sublayer visits (seed 002, Eq. 17)."""
        return 2 * self.C * (self.K_H + self.C_L * self.K_L)

    @property
    def M_g(self) -> int:
        """Gradient-visible visits under the one-step gradient (seed 002, Eq. 18)."""
        return self.M // self.C if self.one_step_grad else self.M

    @property
    def scales(self) -> theory.Scales:
        return theory.scales(self.M_g // 2, self.norm, p=self.p)


class HierarchicalLoop(nn.Module):
    """HRM-style two-module recurrent reasoner over token sequences: (B, T) -> (B, T, vocab)."""

    def __init__(self, cfg: HRMConfig, generator: torch.Generator | None = None):
        super().__init__()
        if not isinstance(cfg, HRMConfig):
            raise TypeError(
                f"HierarchicalLoop(cfg): expected an HRMConfig, got {type(cfg).__name__}"
            )
        self.cfg = cfg
        D = cfg.d_model

        def block() -> Block:
            return Block(D, cfg.n_heads, cfg.mlp_ratio, cfg.norm, cfg.alpha, 1.0)

        with no_global_draws():  # default inits are overwritten below
            self.tok_emb = nn.Embedding(cfg.vocab_size, D)
            self.pos_emb = nn.Embedding(cfg.seq_len, D)
            self.H_blocks = nn.ModuleList(block() for _ in range(cfg.K_H))
            self.L_blocks = nn.ModuleList(block() for _ in range(cfg.K_L))
            self.final_norm = RMSNorm(D)
        for emb in (self.tok_emb, self.pos_emb):
            with torch.no_grad():
                emb.weight.copy_(0.02 * torch.randn(emb.weight.shape, generator=generator))
        for blk in (*self.H_blocks, *self.L_blocks):
            blk.init_weights(cfg.beta, generator)

    @property
    def loopprobe_sublayers(self) -> list[str]:
        return [
            f"{mod}.{k}.{s}"
            for mod, blocks in (("H_blocks", self.H_blocks), ("L_blocks", self.L_blocks))
            for k in range(len(blocks))
            for s in ("attn", "mlp")
        ]

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        return self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device))

    @staticmethod
    def _run_blocks(blocks: nn.ModuleList, h: torch.Tensor) -> torch.Tensor:
        for blk in blocks:
            h = blk(h)
        return h

    def cycle(self, z_H: torch.Tensor, z_L: torch.Tensor, x: torch.Tensor):
        """One outer cycle: C_L iterations of L, then one update of H."""
        for _ in range(self.cfg.C_L):
            z_L = self._run_blocks(self.L_blocks, z_L + z_H + x)
        z_H = self._run_blocks(self.H_blocks, z_H + z_L)
        return z_H, z_L

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        z_H = torch.zeros_like(x)
        z_L = torch.zeros_like(x)
        for c in range(self.cfg.C):
            last = c == self.cfg.C - 1
            with torch.set_grad_enabled(
                torch.is_grad_enabled() and (last or not self.cfg.one_step_grad)
            ):
                z_H, z_L = self.cycle(z_H, z_L, x)
        return self.final_norm(z_H) @ self.tok_emb.weight.t()
