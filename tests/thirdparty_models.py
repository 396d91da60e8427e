"""Tiny looped models written the way third-party code is written (not for loopprobe).

Each reuses parameters in a different style; none knows about loopprobe. Several have an
``untied()`` twin: the same function with one deep copy of the reused module per visit,
the brute-force oracle for per-visit quantities. Sizes are tiny (d <= 16) for float64
dense-Jacobian checks.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


class MLPBlock(nn.Module):
    """Pre-norm residual block ``x + W2 tanh(W1 LN(x))``."""

    def __init__(self, d: int, hidden: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class ForLoopModel(nn.Module):
    """A ModuleList of K blocks looped R times by a plain for-loop."""

    def __init__(self, d: int = 6, K: int = 2, R: int = 3, vocab: int = 5) -> None:
        super().__init__()
        self.R = R
        self.inp = nn.Linear(vocab, d)
        self.layers = nn.ModuleList(MLPBlock(d) for _ in range(K))
        self.out = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for _ in range(self.R):
            for layer in self.layers:
                h = layer(h)
        return self.out(h)

    def untied(self) -> UnrolledModel:
        order = [self.layers[k] for _ in range(self.R) for k in range(len(self.layers))]
        return UnrolledModel(self.inp, order, self.out)


class UnrolledModel(nn.Module):
    """The explicit untied twin: ``steps[i]`` is a private copy of the module of visit i."""

    def __init__(self, inp: nn.Module, steps: list[nn.Module], out: nn.Module) -> None:
        super().__init__()
        self.inp = copy.deepcopy(inp)
        self.steps = nn.ModuleList(copy.deepcopy(s) for s in steps)
        self.out = copy.deepcopy(out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for step in self.steps:
            h = step(h)
        return self.out(h)


class SharedBlockModel(nn.Module):
    """One block instance applied R times (Universal-Transformer style)."""

    def __init__(self, d: int = 6, R: int = 4) -> None:
        super().__init__()
        self.R = R
        self.block = MLPBlock(d)
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.R):
            x = self.block(x)
        return self.head(x)

    def untied(self) -> UnrolledModel:
        return UnrolledModel(nn.Identity(), [self.block] * self.R, self.head)


class Mixer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.q = nn.Linear(d, d)
        self.v = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.q(x)) * self.v(x)


class AlbertLayer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.mix = Mixer(d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.mix(x))


class AlbertModel(nn.Module):
    """R distinct layer instances whose mixers share Parameter objects (ALBERT-style tying).

    No module is called twice; each layer keeps its own LayerNorm.
    """

    def __init__(self, d: int = 6, R: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(AlbertLayer(d) for _ in range(R))
        first = self.layers[0].mix
        for layer in self.layers[1:]:
            layer.mix.q.weight = first.q.weight
            layer.mix.q.bias = first.q.bias
            layer.mix.v.weight = first.v.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def untied(self) -> AlbertModel:
        """A copy in which every layer owns private clones of the shared parameters."""
        twin = copy.deepcopy(self)
        for layer in twin.layers:
            for mod in (layer.mix.q, layer.mix.v):
                for name, p in list(mod._parameters.items()):
                    if p is not None:
                        setattr(mod, name, nn.Parameter(p.detach().clone()))
        return twin


class KeywordBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, *, hidden: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return hidden + scale * torch.tanh(self.fc(hidden))


class KeywordModel(nn.Module):
    """Blocks called with keyword-only arguments."""

    def __init__(self, d: int = 6, R: int = 3) -> None:
        super().__init__()
        self.R = R
        self.block = KeywordBlock(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for r in range(self.R):
            x = self.block(hidden=x, scale=1.0 / (r + 1))
        return x


class InplaceModel(nn.Module):
    """The caller rescales each block output in place right after the call."""

    def __init__(self, d: int = 6, R: int = 3) -> None:
        super().__init__()
        self.R = R
        self.block = MLPBlock(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.R):
            y = self.block(x)
            y.mul_(0.5)
            x = y
        return x


class TruncatedModel(nn.Module):
    """HRM/TRM style: early cycles under ``torch.no_grad()`` or with a detached carry.

    ``C`` cycles of ``C_L`` inner steps of ``low`` then one step of ``high``; every cycle
    but the last is invisible to the gradient (``mode="no_grad"`` or ``"detach"``).
    """

    def __init__(self, d: int = 6, C: int = 3, C_L: int = 2, mode: str = "no_grad") -> None:
        super().__init__()
        self.C, self.C_L, self.mode = C, C_L, mode
        self.low = MLPBlock(d)
        self.high = MLPBlock(d)

    def cycle(self, zl: torch.Tensor, zh: torch.Tensor, x: torch.Tensor) -> tuple:
        for _ in range(self.C_L):
            zl = self.low(zl + zh + x)
        zh = self.high(zh + zl)
        return zl, zh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        zl, zh = torch.zeros_like(x), torch.zeros_like(x)
        for _ in range(self.C - 1):
            if self.mode == "no_grad":
                with torch.no_grad():
                    zl, zh = self.cycle(zl, zh, x)
            else:
                zl, zh = self.cycle(zl, zh, x)
                zl, zh = zl.detach(), zh.detach()
        zl, zh = self.cycle(zl, zh, x)
        return zh


class HaltingModel(nn.Module):
    """ACT-style: a shared step applied until a halting score crosses a threshold."""

    def __init__(self, d: int = 6, max_steps: int = 12, threshold: float = 0.5) -> None:
        super().__init__()
        self.max_steps, self.threshold = max_steps, threshold
        self.step = MLPBlock(d)
        self.halt = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = torch.zeros((), dtype=x.dtype)
        for _ in range(self.max_steps):
            x = self.step(x)
            total = total + torch.sigmoid(self.halt(x)).mean()
            if total > self.threshold:
                break
        return x


class ReuseModel(nn.Module):
    """A looped block plus reuse that is not recurrence: a norm and a head called twice,
    dropout (parameter-free), and token embeddings tied to the output layer."""

    def __init__(self, d: int = 6, R: int = 3, vocab: int = 7, p: float = 0.1) -> None:
        super().__init__()
        self.R = R
        self.embed = nn.Embedding(vocab, d)
        self.block = MLPBlock(d)
        self.drop = nn.Dropout(p)
        self.final_norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for _ in range(self.R):
            x = self.drop(self.block(x))
        a = self.head(self.final_norm(x))
        b = self.head(self.final_norm(x.flip(-1)))
        return a + b


class PlainMLP(nn.Module):
    """Nothing looped."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class DropoutLoopModel(nn.Module):
    """A shared block with dropout inside the loop (randomness in every visit)."""

    def __init__(self, d: int = 6, R: int = 3, p: float = 0.3) -> None:
        super().__init__()
        self.R = R
        self.block = MLPBlock(d)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.R):
            x = self.drop(self.block(x))
        return x

    def untied(self) -> UnrolledModel:
        """Block copies at steps 0, 2, 4, ...; the dropouts draw in the same order."""
        steps = [m for _ in range(self.R) for m in (self.block, self.drop)]
        return UnrolledModel(nn.Identity(), steps, nn.Identity())


def make(cls: type, seed: int = 0, **kw) -> nn.Module:
    """Build a test model in float64 from a fixed seed (without touching the global RNG)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return cls(**kw).double()


def randn(*shape: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)
