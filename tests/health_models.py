"""User-style looped models for the health check (``lp.health``, ``report --sections health``).

Written the way third-party code is (plain ``nn.Module``s that know nothing of loopprobe);
referenced on the command line as ``health_models:factory`` (the tests directory is on
``sys.path`` under pytest). Three shapes, none in ``lp.models``:

- :class:`InjectedGPT`: a GPT-style block (causal ``F.scaled_dot_product_attention`` and an
  MLP, post-norm ``RMSNorm(alpha h + f(h))`` with init gain ``beta``) fed through a small input
  injection layer, ``z <- block(z + inject(x))``, looped R times; ``alpha``/``beta`` as
  attributes;
- :class:`DictGPT`: the same loop called as ``model(input_ids=..., labels=...)`` and
  returning an HF-style output (``.logits``, ``.loss``), with ``cfg.alpha``/``cfg.beta``;
- :class:`RelaxedLoop`: a looped MLP ``h <- (1 - relax) h + relax tanh(gain W h + U x)`` with a
  ``step(h, x)`` and an ``embed(x)``, so the round map is known; ``gain`` and ``relax`` put it
  on either side of the fixed-point, oscillation and explosion thresholds.
"""

from __future__ import annotations

import collections
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

D, T, VOCAB = 8, 5, 11


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _seeded(cls: type, seed: int, *args, **kw) -> nn.Module:
    """Build ``cls(*args, **kw)`` in float64 from ``seed`` without touching the global RNG."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return cls(*args, **kw).double()


class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self, d: int, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)
        q, k, v = (t.view(B, L, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, L, C))


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Post-norm block ``h <- RMSNorm(alpha h + attn(h))``, then the same with the MLP."""

    def __init__(self, d: int, alpha: float) -> None:
        super().__init__()
        self.alpha = alpha
        self.attn, self.mlp = Attention(d), MLP(d)
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.norm1(self.alpha * h + self.attn(h))
        return self.norm2(self.alpha * h + self.mlp(h))


class InjectedGPT(nn.Module):
    """Token embedding, a small injection layer, one post-norm block looped R times, a head."""

    def __init__(
        self, R: int = 4, alpha: float = 1.0, beta: float = 1.0, inject: bool = True
    ) -> None:
        super().__init__()
        self.R, self.alpha, self.beta, self.injects = R, alpha, beta, inject
        self.emb = nn.Embedding(VOCAB, D)
        self.inject = nn.Linear(D, D, bias=False)
        self.block = Block(D, alpha)
        self.head = nn.Linear(D, VOCAB, bias=False)
        for m in (self.block.attn.qkv, self.block.attn.proj, self.block.mlp.fc, self.block.mlp.out):
            with torch.no_grad():  # beta: the init gain of the residual-branch matrices
                m.weight.mul_(beta)

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.inject(self.emb(idx))
        if not self.injects:  # no injection: the state starts at x and is looped alone
            for _ in range(self.R):
                x = self.block(x)
            return x
        z = torch.zeros_like(x)
        for _ in range(self.R):
            z = self.block(z + x)
        return z

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(idx))


def scales(R: int, p: float) -> tuple[float, float]:
    """``alpha = (2N)^p``, ``beta = (8N)^-p`` at unrolled depth ``N = K R = R`` (one block)."""
    return (2 * R) ** p, (8 * R) ** (-p)


def gpt(R: int = 4, p: float = 0.5, seed: int = 0, inject: bool = True) -> nn.Module:
    """:class:`InjectedGPT` in float64 with the DeepNorm/DeepLoop-family scales of exponent p."""
    return _seeded(InjectedGPT, seed, R, *scales(R, p), inject)


def gpt_deepnorm(R: int = 8) -> nn.Module:
    return gpt(R, 0.25)


def gpt_deeploop(R: int = 8) -> nn.Module:
    return gpt(R, 0.5)


def gpt_unscaled(R: int = 4) -> nn.Module:
    """alpha = beta = 1 (a plain post-norm loop), without alpha/beta attributes."""
    model = gpt(R, 0.0)
    del model.alpha, model.beta
    return model


def tokens(model: nn.Module | None = None, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, T), generator=_gen(1))


# --------------------------------------------------------------------- dict in, HF-style out


class Output(collections.OrderedDict):
    """Like transformers.ModelOutput: a dict of the fields that are set, and attributes."""

    def __init__(self, logits=None, loss=None):
        super().__init__((k, v) for k, v in (("loss", loss), ("logits", logits)) if v is not None)

    def __getattr__(self, name):
        if name in ("loss", "logits"):
            return self.get(name)
        raise AttributeError(name)


class DictGPT(nn.Module):
    """:class:`InjectedGPT` called as ``model(input_ids=..., labels=...)``; ``cfg.alpha/beta``."""

    def __init__(self, R: int = 4, p: float = 0.5) -> None:
        super().__init__()
        alpha, beta = scales(R, p)
        self.cfg = SimpleNamespace(R=R, alpha=alpha, beta=beta)
        self.core = InjectedGPT(R, alpha, beta)
        del self.core.alpha, self.core.beta  # the config is where this model keeps them

    def forward(self, *, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Output:
        logits = self.core(input_ids)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return Output(logits=logits, loss=loss)


def dict_gpt(R: int = 4) -> nn.Module:
    return _seeded(DictGPT, 0, R)


def dict_batch(model: nn.Module | None = None) -> dict[str, torch.Tensor]:
    ids = tokens()
    return {"input_ids": ids, "labels": ids.roll(-1, 1)}


def hf_loss(out: Output, inputs: dict) -> torch.Tensor:
    return out.loss


# --------------------------------------------------------------------- a looped MLP with step


class Cell(nn.Module):
    """One round ``(1 - relax) h + relax tanh(gain W h + U x)``; W orthogonal (norm = gain)."""

    def __init__(self, d: int, gain: float, relax: float) -> None:
        super().__init__()
        self.gain, self.relax = gain, relax
        self.W = nn.Linear(d, d)
        self.U = nn.Linear(d, d, bias=False)
        with torch.no_grad():
            self.W.weight.copy_(torch.linalg.qr(torch.randn(d, d))[0])

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return (1 - self.relax) * h + self.relax * torch.tanh(self.gain * self.W(h) + self.U(x))


class RelaxedLoop(nn.Module):
    """An input layer, :class:`Cell` applied R times from ``h_0 = x``, a head; has ``step``."""

    def __init__(self, R: int = 6, gain: float = 0.5, relax: float = 1.0) -> None:
        super().__init__()
        self.R = R
        self.inp = nn.Linear(D, D)
        self.cell = Cell(D, gain, relax)
        self.head = nn.Linear(D, 3)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.inp(x)

    def step(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.cell(h, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.embed(x)
        h = e
        for _ in range(self.R):
            h = self.step(h, e)
        return self.head(h)


def loop(R: int = 6, gain: float = 0.5, relax: float = 1.0) -> nn.Module:
    return _seeded(RelaxedLoop, 0, R, gain, relax)


def loop_contracting() -> nn.Module:
    """A fixed point within reach (ρ ≈ 0.49); its G oscillate (consecutive cosines ≈ -0.5)."""
    return loop(6, gain=0.5)


def loop_expanding() -> nn.Module:
    """No fixed point reached (ρ ≈ 1.35 > 1)."""
    return loop(6, gain=1.5)


def loop_smooth() -> nn.Module:
    """Under-relaxed: visits nearly alike, no oscillation."""
    return loop(6, gain=0.5, relax=0.1)


def loop_overrelaxed() -> nn.Module:
    """Over-relaxed, 12 rounds: earlier visits get over 10x the last one's gradient."""
    return loop(12, gain=0.6, relax=1.9)


def features(model: nn.Module | None = None, batch: int = 3) -> torch.Tensor:
    return torch.randn(batch, D, generator=_gen(2), dtype=torch.float64)


def step_fn(model: RelaxedLoop, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``--step``: the round map fn(model, h, x) -> h."""
    return model.step(h, x)


# --------------------------------------------------------------------- for the command line


def gpt_plain() -> nn.Module:
    """:class:`InjectedGPT` without the injection, DeepLoop scales, R = 4 (``--step`` below)."""
    return gpt(4, 0.5, inject=False)


def gpt_round(model: nn.Module, inputs: torch.Tensor):
    """``--step``: the round map fn(model, inputs) -> lp.RoundMap, replayed from ``block``."""
    import loopprobe as lp

    return lp.replay_round(model, inputs, "block")
