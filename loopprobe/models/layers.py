"""Building blocks shared by the reference models: RMSNorm, attention, MLP, residual branches.

A *branch* module returns the residual increment exactly as it is added to the stream
(pre-norm: ``eps * f(Norm(x))``; post-norm: ``f(x)``), so hooking its output records the
increment with the model's own scaling. A :class:`Block` holds two branches (attention and
MLP) and applies the residual rule around them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

PRE_NORMS = ("pre",)
POST_NORMS = ("post", "deepnorm", "deeploop", "postp")


class RMSNorm(nn.Module):
    """``x / RMS(x) * weight`` over the last dimension (weight optional)."""

    def __init__(self, dim: int, eps: float = 1e-6, affine: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return y if self.weight is None else y * self.weight


def rope(t: torch.Tensor, base: float = 10_000.0) -> torch.Tensor:
    """Rotary position embedding of ``t`` (..., T, hd), hd even: the pair (i, i + hd/2) at
    position m is rotated by the angle m * base^(-2i/hd) (rotate-half form), so the dot
    product of a rotated query and key depends on their positions only through m - n."""
    T, hd = t.shape[-2], t.shape[-1]
    half = hd // 2
    inv = base ** (-torch.arange(half, dtype=t.dtype, device=t.device) / half)
    ang = torch.arange(T, dtype=t.dtype, device=t.device)[:, None] * inv[None, :]  # (T, hd/2)
    cos, sin = ang.cos(), ang.sin()
    t1, t2 = t[..., :half], t[..., half:]
    return torch.cat([t1 * cos - t2 * sin, t1 * sin + t2 * cos], dim=-1)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q, k, v, o projections (no bias);
    ``rotary=True`` rotates queries and keys by :func:`rope` (RoPE)."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0, rotary: bool = False):
        super().__init__()
        self.n_heads = n_heads
        self.rotary = rotary
        self.q = nn.Linear(d_model, d_model, bias=False)
        self.k = nn.Linear(d_model, d_model, bias=False)
        self.v = nn.Linear(d_model, d_model, bias=False)
        self.o = nn.Linear(d_model, d_model, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        H = self.n_heads

        def heads(t: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, H, T, D/H)
            return t.view(B, T, H, D // H).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        if self.rotary:
            q, k = rope(q), rope(k)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(D // H)  # (B, H, T, T)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, D)
        return self.dropout(self.o(y))


class MLP(nn.Module):
    """``fc2(GELU(fc1(x)))`` with hidden width ``ratio * d_model``."""

    def __init__(self, d_model: int, ratio: int = 4, dropout: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(d_model, ratio * d_model, bias=False)
        self.fc2 = nn.Linear(ratio * d_model, d_model, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc2(F.gelu(self.fc1(x))))


class Branch(nn.Module):
    """One residual sublayer: returns the increment as added to the residual stream.

    Pre-norm: ``eps * f(RMSNorm(x))`` (the norm belongs to the branch). Post-norm family:
    ``f(x)``; the surrounding block computes ``Norm(alpha * x + f(x))``.
    """

    def __init__(self, f: nn.Module, d_model: int, pre_norm: bool, eps: float):
        super().__init__()
        self.norm = RMSNorm(d_model) if pre_norm else None
        self.f = f
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm is None:
            return self.f(x)
        return self.eps * self.f(self.norm(x))


class Block(nn.Module):
    """A Transformer block: an attention and an MLP residual sublayer.

    Reference: seed 002, Eq. 2 (post-norm ``x <- Norm(alpha x + f(x))``) and the Pre-LN
    form ``x <- x + eps f(Norm(x))``. ``inject`` (internal recall) is added to the stream
    between the two sublayers.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        mlp_ratio: int,
        norm: str,
        alpha: float,
        eps: float,
        dropout: float = 0.0,
        rotary: bool = False,
    ):
        super().__init__()
        pre = norm in PRE_NORMS
        self.pre = pre
        self.alpha = alpha
        attn = CausalSelfAttention(d_model, n_heads, dropout, rotary)
        self.attn = Branch(attn, d_model, pre, eps)
        self.mlp = Branch(MLP(d_model, mlp_ratio, dropout), d_model, pre, eps)
        self.norm_attn = None if pre else RMSNorm(d_model)
        self.norm_mlp = None if pre else RMSNorm(d_model)

    def forward(self, x: torch.Tensor, inject: torch.Tensor | None = None) -> torch.Tensor:
        x = self._residual(x, self.attn, self.norm_attn)
        if inject is not None:
            x = x + inject
        return self._residual(x, self.mlp, self.norm_mlp)

    def _residual(self, x: torch.Tensor, branch: Branch, post: RMSNorm | None) -> torch.Tensor:
        if post is None:
            return x + branch(x)
        return post(self.alpha * x + branch(x))

    def init_weights(self, beta: float, generator: torch.Generator | None) -> None:
        """Xavier-normal init; the residual-branch matrices (v, o, fc1, fc2) get gain ``beta``.

        Reference: seed 002, Eq. 4 / Eq. 7 (beta is an init gain, not a runtime multiplier).
        """
        attn, mlp = self.attn.f, self.mlp.f
        for lin, gain in (
            (attn.q, 1.0),
            (attn.k, 1.0),
            (attn.v, beta),
            (attn.o, beta),
            (mlp.fc1, beta),
            (mlp.fc2, beta),
        ):
            xavier_normal(lin.weight, gain, generator)

    @staticmethod
    def beta_matrix_names() -> list[str]:
        return ["attn.f.v.weight", "attn.f.o.weight", "mlp.f.fc1.weight", "mlp.f.fc2.weight"]


def no_global_draws():
    """Build modules without drawing from torch's global RNG.

    The reference models overwrite every default init from their own ``generator``, so
    constructing one must not move the global random state (randomness is an argument).
    """
    return torch.random.fork_rng(devices=[])


def xavier_normal(w: torch.Tensor, gain: float, generator: torch.Generator | None) -> None:
    """In-place Xavier-normal init ``N(0, gain^2 * 2 / (fan_in + fan_out))`` from ``generator``."""
    fan_out, fan_in = w.shape
    std = gain * math.sqrt(2.0 / (fan_in + fan_out))
    with torch.no_grad():
        w.copy_(torch.randn(w.shape, generator=generator, dtype=w.dtype) * std)
