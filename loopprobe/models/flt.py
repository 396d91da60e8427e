"""FullyLoopedGPT: the Fully Looped Transformer (FLT) on the LoopedGPT backbone.

Taken from the paper (seed 001 abstract; PAPERS.md §6 details [S]; the authors' code
``nanochat/gpt.py``, model types ``FLT`` and ``LT`` [P]):

- *Fully Looped Architecture*, "distributes inter-loop signals across all layers":
  ``h_l^(t) = f_l(h_(l-1)^(t), h_L^(t-1))``. Every loop t restarts its residual stream from
  the input embedding (the code: ``x_i = norm(x_0)`` at the start of each loop) and the
  previous loop's final state ``h_L^(t-1)`` reaches every layer l of loop t.
- *Attention Injection*, "reuses the existing attention block": for t > 1,
  ``a_l^(t) = Attention(W_Q h_L^(t-1), W_K z_l^(t), W_V z_l^(t))`` with the layer's own
  W_Q, W_K, W_V (no new parameters; the code: ``attn(norm(h), norm(x), norm(x))``). The
  previous loop enters through the queries only; at t = 1 it is plain self-attention.
- Both modifications are parameter-free: the parameters are exactly those of the LT
  (:class:`LoopedGPT` with the same config), and so is the initialization: the same
  ``generator`` gives the same weights, so an LT and an FLT of one seed are paired.

Chosen here (the paper's description does not fix them, or its code differs from this
backbone): the pre-LN LoopedGPT block (learnable RMSNorm weight, GELU MLP, learned
positions, tied embeddings) instead of nanochat's (weightless norm, QK-norm, RoPE,
relu^2, zero-initialised projections, untied head); the carried state ``h_L^(t-1)`` goes
through the attention branch's own RMSNorm (the one that normalizes ``z``), so the
norm's weight is shared between queries and keys/values, as the code's single ``norm``;
the embedding that restarts each loop is not normalized (LoopedGPT's LT is not either);
only ``norm="pre"`` without recall, outer norm or untied blocks (FLT is its own recall).

Unrolled depth N = K·R and M = 2N residual-sublayer visits, as in LoopedGPT; the probe
sees the same sublayers (``blocks.{k}.attn`` / ``.mlp``). With the injection switched
off (``inject=False``) every loop computes the first loop again, so the output is that
of a one-loop LT with the same weights; the FLT is *not* an LT with a zeroed injection.

Example::

    model = FullyLoopedGPT(GPTConfig(K=2, R=12), generator=torch.Generator().manual_seed(0))
    logits = model(torch.randint(0, 64, (2, 16)))   # (2, 16, 64)
"""

from __future__ import annotations

import math

import torch
from torch import nn

from loopprobe.models.gpt import GPTConfig, LoopedGPT
from loopprobe.models.layers import (
    PRE_NORMS,
    Block,
    Branch,
    CausalSelfAttention,
    RMSNorm,
    no_global_draws,
)


class InjectedSelfAttention(CausalSelfAttention):
    """Causal attention with queries from another tensor: ``Attn(W_Q q, W_K x, W_V x)``."""

    def forward(self, x: torch.Tensor, query: torch.Tensor | None = None) -> torch.Tensor:
        B, T, D = x.shape
        H = self.n_heads
        query = x if query is None else query

        def heads(t: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, H, T, D/H)
            return t.view(B, T, H, D // H).transpose(1, 2)

        q, k, v = heads(self.q(query)), heads(self.k(x)), heads(self.v(x))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(D // H)  # (B, H, T, T)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, D)
        return self.dropout(self.o(y))


class InjectedBranch(Branch):
    """Pre-norm attention branch ``eps * Attn(W_Q Norm(h), W_K Norm(x), W_V Norm(x))``.

    ``h=None`` is plain self-attention (the first loop). Returns the increment added to
    the stream ``x`` (so the probe records it as LoopedGPT's branches).
    """

    def forward(self, x: torch.Tensor, h: torch.Tensor | None = None) -> torch.Tensor:
        z = self.norm(x)
        return self.eps * self.f(z, None if h is None else self.norm(h))


class FLTBlock(Block):
    """A pre-LN block whose attention may take its queries from the previous loop's state."""

    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int, eps: float, dropout: float):
        super().__init__(d_model, n_heads, mlp_ratio, "pre", 1.0, eps, dropout)
        attn = InjectedSelfAttention(d_model, n_heads, dropout)
        self.attn = InjectedBranch(attn, d_model, True, eps)

    def forward(self, x: torch.Tensor, h: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(x, h)
        return x + self.mlp(x)


class FullyLoopedGPT(LoopedGPT):
    """LoopedGPT with the Fully Looped Architecture and Attention Injection (see module doc).

    ``inject=False`` switches the injection off (every loop is then the first one); it
    exists for the checks in the tests and for ablations.
    """

    def __init__(
        self, cfg: GPTConfig, generator: torch.Generator | None = None, inject: bool = True
    ):
        nn.Module.__init__(self)
        if not isinstance(cfg, GPTConfig):
            raise TypeError(f"FullyLoopedGPT(cfg): expected a GPTConfig, got {type(cfg).__name__}")
        bad = {"norm": cfg.norm not in PRE_NORMS, "recall": cfg.recall != "none",
               "outer_norm": cfg.outer_norm, "tied": not cfg.tied,
               "position": cfg.position != "learned", "embed_norm": cfg.embed_norm}  # fmt: skip
        if any(bad.values()):
            names = [k for k, v in bad.items() if v]
            raise ValueError(
                f"FullyLoopedGPT: GPTConfig fields {names} are not supported; use norm='pre', "
                "recall='none', outer_norm=False, tied=True, position='learned', "
                "embed_norm=False (the FLT carries the previous "
                "loop through its attention queries)"
            )
        self.cfg = cfg
        self.inject = bool(inject)
        D = cfg.d_model

        def block() -> Block:
            return Block(D, cfg.n_heads, cfg.mlp_ratio, "pre", 1.0, cfg.eps, cfg.dropout)

        with no_global_draws():  # the same modules, in the same order, as LoopedGPT
            self.tok_emb = nn.Embedding(cfg.vocab_size, D)
            self.pos_emb = nn.Embedding(cfg.seq_len, D)
            self.prelude = nn.ModuleList(block() for _ in range(cfg.prelude))
            self.blocks = nn.ModuleList(
                FLTBlock(D, cfg.n_heads, cfg.mlp_ratio, cfg.eps, cfg.dropout) for _ in range(cfg.K)
            )
            self.coda = nn.ModuleList(block() for _ in range(cfg.coda))
            self.recall = None
            self.outer_norm = None
            self.final_norm = RMSNorm(D)
            self.lm_head = None if cfg.tie_embeddings else nn.Linear(D, cfg.vocab_size, bias=False)
        self._init_weights(generator)

    def step(self, h: torch.Tensor, x: torch.Tensor, r: int = 0) -> torch.Tensor:
        """Loop ``r``: the K blocks from the embedding ``x``, queries from ``h`` when r > 0.

        ``h`` is the previous loop's final state ``h_L^(r-1)`` (ignored at r = 0);
        returns ``h_L^(r)``, shape (B, T, D). :meth:`LoopedGPT.loop` chains the loops.
        """
        carried = h if (r > 0 and self.inject) else None
        z = x
        for blk in self.blocks:
            z = blk(z, carried)
        return z
