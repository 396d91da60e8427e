"""LoopedGPT: a decoder-only causal LM whose K physical blocks are applied for R rounds.

Read top to bottom: the config (validated, frozen), then the model (embed -> R rounds of
``step`` -> head). Unrolled depth N = K·R, M = 2N residual-sublayer visits.
Reference: seed 002, Eq. 1 (the loop), Eq. 2-8 (DeepNorm / DeepLoop scales).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from loopprobe import theory
from loopprobe.models.layers import (
    POST_NORMS,
    PRE_NORMS,
    Block,
    RMSNorm,
    no_global_draws,
    xavier_normal,
)
from loopprobe.theory import RESIDUALS

NORMS = PRE_NORMS + POST_NORMS
RECALLS = ("none", "add", "linear", "internal")
POSITIONS = ("learned", "rope")


def _choice(cls: str, name: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{cls}.{name}={value!r} is not allowed; choose one of {list(allowed)}")


def _at_least(cls: str, name: str, value: int, low: int) -> None:
    if not isinstance(value, int) or value < low:
        raise ValueError(f"{cls}.{name}={value!r} is invalid; it must be an integer >= {low}")


def _check_sizes(cls: str, cfg: object, positive: tuple, nonnegative: tuple = ()) -> None:
    """Sizes are integers (``positive`` >= 1, ``nonnegative`` >= 0); heads divide d_model."""
    for name in positive:
        _at_least(cls, name, getattr(cfg, name), 1)
    for name in nonnegative:
        _at_least(cls, name, getattr(cfg, name), 0)
    if cfg.d_model % cfg.n_heads:
        raise ValueError(
            f"{cls}.d_model={cfg.d_model} is not divisible by n_heads={cfg.n_heads}; "
            "pick d_model as a multiple of n_heads"
        )


class _ScaleGains:
    """``alpha`` and ``beta`` of a config's residual scheme (``scales``, seed 002, Eq. 3/7)."""

    @property
    def alpha(self) -> float:
        return self.scales.alpha

    @property
    def beta(self) -> float:
        return self.scales.beta


@dataclass(frozen=True)
class GPTConfig(_ScaleGains):
    """Configuration of :class:`LoopedGPT`.

    ``norm``: ``pre`` (Pre-LN, residual multiplier from ``residual``), ``post`` (Post-LN,
    alpha = beta = 1), ``deepnorm`` (p = 1/4), ``deeploop`` (p = 1/2) or ``postp`` (the
    family alpha = (2N)^p, beta = (8N)^-p with the given ``p``).
    ``residual`` (pre-norm only): ``none`` (eps = 1), ``1/sqrt(N)`` and ``1/N`` with N = K·R
    the unrolled depth, ``loop-mup`` eps = mup_lambda / (R·sqrt(K)) (R loops of K unique
    layers; Loop-muP's N is the loop count).
    ``recall``: re-inject the input embedding every round: ``add`` (h + x before the round),
    ``linear`` (W [h; x]), ``internal`` (x added inside the first block, between its two
    sublayers). ``grad_rounds=k``: only the last k rounds carry gradient (the others run
    under ``torch.no_grad()``). ``tied=False`` builds K·R distinct blocks, each used once.
    ``position``: ``learned`` (an added position embedding) or ``rope`` (rotary queries and
    keys in every attention, no position embedding; d_model / n_heads must be even).
    ``embed_norm``: an RMSNorm on the input embedding (seed 002's backbone has both).
    """

    vocab_size: int = 64
    seq_len: int = 32
    d_model: int = 32
    n_heads: int = 4
    K: int = 2
    R: int = 4
    mlp_ratio: int = 4
    norm: str = "pre"
    p: float | None = None
    residual: str = "none"
    mup_lambda: float = 1.0
    recall: str = "none"
    outer_norm: bool = False
    prelude: int = 0
    coda: int = 0
    tie_embeddings: bool = True
    grad_rounds: int | None = None
    tied: bool = True
    dropout: float = 0.0
    position: str = "learned"
    embed_norm: bool = False

    def __post_init__(self) -> None:
        c = "GPTConfig"
        sizes = ("vocab_size", "seq_len", "d_model", "n_heads", "K", "R", "mlp_ratio")
        _check_sizes(c, self, sizes, ("prelude", "coda"))
        _choice(c, "norm", self.norm, NORMS)
        _choice(c, "residual", self.residual, RESIDUALS)
        _choice(c, "recall", self.recall, RECALLS)
        _choice(c, "position", self.position, POSITIONS)
        if self.position == "rope" and (self.d_model // self.n_heads) % 2:
            raise ValueError(f"{c}.position='rope' needs an even head size; got d_model / "
                             f"n_heads = {self.d_model // self.n_heads}")  # fmt: skip
        if self.norm == "postp" and (self.p is None or self.p <= 0):
            raise ValueError(f"{c}.p={self.p!r} is invalid for norm='postp'; give p > 0")
        if self.p is not None and self.p <= 0:
            raise ValueError(f"{c}.p={self.p!r} is invalid; p must be > 0")
        if self.residual != "none" and self.norm not in PRE_NORMS:
            raise ValueError(
                f"{c}.residual={self.residual!r} only applies to norm='pre'; "
                f"got norm={self.norm!r} (use residual='none')"
            )
        if self.grad_rounds is not None:
            _at_least(c, "grad_rounds", self.grad_rounds, 1)
            if self.grad_rounds > self.R:
                raise ValueError(f"{c}.grad_rounds={self.grad_rounds} exceeds R={self.R}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"{c}.dropout={self.dropout!r} must lie in [0, 1)")
        _ = self.scales  # validates N and p through the theory

    @property
    def scales(self) -> theory.Scales:
        """alpha, beta of the residual scheme at this depth (seed 002, Eq. 3, 7, 15)."""
        return theory.scales(self.N, self.norm, p=self.p)

    @property
    def N(self) -> int:
        """Unrolled depth K·R (blocks applied in the loop)."""
        return self.K * self.R

    @property
    def M(self) -> int:
        """Residual-sublayer visits 2N (seed 002, Eq. 9)."""
        return 2 * self.N

    @property
    def eps(self) -> float:
        """Pre-norm residual-branch multiplier (1 for the post-norm family)."""
        if self.residual == "loop-mup":
            return theory.residual_multiplier("loop-mup", self.R, L=self.K, lam=self.mup_lambda)
        return theory.residual_multiplier(self.residual, self.N)


class LoopedGPT(nn.Module):
    """Decoder-only causal LM: embed, optional prelude, R rounds of K tied blocks, optional coda.

    Example::

        model = LoopedGPT(GPTConfig(K=2, R=4, norm="deeploop"))
        logits = model(torch.randint(0, 64, (2, 16)))   # (2, 16, 64)
    """

    def __init__(self, cfg: GPTConfig, generator: torch.Generator | None = None):
        super().__init__()
        if not isinstance(cfg, GPTConfig):
            raise TypeError(f"LoopedGPT(cfg): expected a GPTConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        D = cfg.d_model

        rotary = cfg.position == "rope"

        def block() -> Block:
            return Block(D, cfg.n_heads, cfg.mlp_ratio, cfg.norm, cfg.alpha, cfg.eps, cfg.dropout,
                         rotary)  # fmt: skip

        with no_global_draws():  # default inits are overwritten below
            self.tok_emb = nn.Embedding(cfg.vocab_size, D)
            self.pos_emb = None if rotary else nn.Embedding(cfg.seq_len, D)
            self.embed_norm = RMSNorm(D) if cfg.embed_norm else None
            self.prelude = nn.ModuleList(block() for _ in range(cfg.prelude))
            self.blocks = nn.ModuleList(block() for _ in range(cfg.K if cfg.tied else cfg.N))
            self.coda = nn.ModuleList(block() for _ in range(cfg.coda))
            self.recall = nn.Linear(2 * D, D, bias=False) if cfg.recall == "linear" else None
            self.outer_norm = RMSNorm(D) if cfg.outer_norm else None
            self.final_norm = RMSNorm(D)
            self.lm_head = None if cfg.tie_embeddings else nn.Linear(D, cfg.vocab_size, bias=False)
        self._init_weights(generator)

    def _init_weights(self, generator: torch.Generator | None) -> None:
        for emb in (self.tok_emb, self.pos_emb):
            if emb is None:
                continue
            with torch.no_grad():
                emb.weight.copy_(0.02 * torch.randn(emb.weight.shape, generator=generator))
        for blk in self.prelude:
            blk.init_weights(1.0, generator)
        for blk in self.blocks:
            blk.init_weights(self.cfg.beta, generator)
        for blk in self.coda:
            blk.init_weights(1.0, generator)
        for lin in (self.recall, self.lm_head):
            if lin is not None:
                xavier_normal(lin.weight, 1.0, generator)

    @property
    def loopprobe_sublayers(self) -> list[str]:
        """The paper's grouping: one attention or MLP residual branch per looped block."""
        return [f"blocks.{k}.{s}" for k in range(len(self.blocks)) for s in ("attn", "mlp")]

    def beta_matrices(self) -> list[str]:
        """Names of the parameters initialised with gain beta (seed 002, Eq. 4/7)."""
        return [
            f"blocks.{k}.{n}" for k in range(len(self.blocks)) for n in Block.beta_matrix_names()
        ]

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token (+ position) embedding, its norm if set, then the prelude blocks:
        (B, T) -> (B, T, D)."""
        if idx.dim() != 2:
            raise ValueError(f"LoopedGPT: idx must have shape (batch, seq), got {tuple(idx.shape)}")
        T = idx.shape[1]
        if T > self.cfg.seq_len:
            raise ValueError(
                f"LoopedGPT: sequence length {T} exceeds cfg.seq_len={self.cfg.seq_len}"
            )
        x = self.tok_emb(idx)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(T, device=idx.device))
        if getattr(self, "embed_norm", None) is not None:  # subclasses may not build one
            x = self.embed_norm(x)
        for blk in self.prelude:
            x = blk(x)
        return x

    def step(self, h: torch.Tensor, x: torch.Tensor, r: int = 0) -> torch.Tensor:
        """One round T(h; x): recall, the K blocks of round ``r``, outer norm; shape (B, T, D)."""
        recall = self.cfg.recall
        if recall == "add":
            h = h + x
        elif recall == "linear":
            h = self.recall(torch.cat([h, x], dim=-1))
        K = self.cfg.K
        blocks = self.blocks if self.cfg.tied else self.blocks[r * K : (r + 1) * K]
        for k, blk in enumerate(blocks):
            h = blk(h, inject=x if (recall == "internal" and k == 0) else None)
        if self.outer_norm is not None:
            h = self.outer_norm(h)
        return h

    def loop(self, x: torch.Tensor) -> torch.Tensor:
        """The R rounds from h_0 = x; early rounds without gradient if ``grad_rounds`` is set."""
        h = x
        first_grad = self.cfg.R - (self.cfg.grad_rounds or self.cfg.R)
        for r in range(self.cfg.R):
            with torch.set_grad_enabled(torch.is_grad_enabled() and r >= first_grad):
                h = self.step(h, x, r)
        return h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Coda blocks, final norm and LM head: (B, T, D) -> (B, T, vocab)."""
        for blk in self.coda:
            h = blk(h)
        h = self.final_norm(h)
        w = self.tok_emb.weight if self.lm_head is None else self.lm_head.weight
        return h @ w.t()

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """The state after the loop, before the head: (B, T) -> (B, T, D)."""
        return self.loop(self.embed(idx))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(idx))
