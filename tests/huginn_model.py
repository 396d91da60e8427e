"""A Huginn-style depth-recurrent LM written from scratch, the way a user's code looks.

prelude → a core of two blocks iterated R times, fed through a concatenating input adapter
(``adapter(cat[state, embedded])``) → coda; SDPA attention, RMSNorm, an HF-style output with
``.loss`` and ``.logits``, float32. Not written for loopprobe: no ``cfg``, ``step`` or ``embed``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, D, HEADS, SEQ = 32, 16, 2, 8


@dataclass
class CausalLMOutput:
    loss: torch.Tensor | None
    logits: torch.Tensor


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.up, self.down = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Huginn(nn.Module):
    def __init__(self, R: int = 4) -> None:
        super().__init__()
        self.R = R
        self.wte = nn.Embedding(VOCAB, D)
        self.prelude = Block(D, HEADS)
        self.adapter = nn.Linear(2 * D, D, bias=False)
        self.core = nn.ModuleList([Block(D, HEADS), Block(D, HEADS)])
        self.core_norm = RMSNorm(D)
        self.coda = Block(D, HEADS)
        self.ln_f = RMSNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        e = self.prelude(self.wte(input_ids))
        s = torch.zeros_like(e)
        for _ in range(self.R):
            s = self.adapter(torch.cat([s, e], dim=-1))
            for block in self.core:
                s = block(s)
            s = self.core_norm(s)
        logits = self.lm_head(self.ln_f(self.coda(s)))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
        return CausalLMOutput(loss=loss, logits=logits)


def huginn() -> nn.Module:
    torch.manual_seed(0)
    return Huginn()


def batch(model: nn.Module | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


def no_labels(model: nn.Module | None = None) -> dict[str, torch.Tensor]:
    return {"input_ids": batch()["input_ids"]}


class Flat(nn.Module):
    """Not looped: every module runs once."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def flat() -> nn.Module:
    torch.manual_seed(0)
    return Flat()


def features(model: nn.Module | None = None) -> torch.Tensor:
    return torch.randn(3, D, generator=torch.Generator().manual_seed(2))
