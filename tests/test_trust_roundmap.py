"""A replayed round is trusted only when it reproduces the model's own round (issue 24).

Third-party blocks keep state between repeats on ``self`` (a memory of the previous repeat,
a step counter, a KV cache, a stored attention map). After the forward, calling the module
again reads what the *last* round left, so the replayed map is not round r; before the
check ``spectral_radius`` certified its eigenvalues (memory toy: 0.058 off at round 0,
counter toy: 0.625 off, both ``converged=True``). The twin is a dense ``eigvals`` of
``jacrev`` of the model's actual round r, written by hand for each toy.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import loopprobe as lp
import loopprobe.models as lpm
from loopprobe.differentiate.roundmap import replay_tol

D, R = 6, 4
F64 = torch.float64


def _linear(d: int, seed: int) -> nn.Linear:
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(d, d, dtype=F64)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(d, d, generator=g, dtype=F64) / d**0.5)
        lin.bias.copy_(torch.randn(d, generator=g, dtype=F64) / d**0.5)
    return lin


class MemoryBlock(nn.Module):
    """Transformer-XL style: attends over [memory of the previous repeat, h]."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (_linear(D, s) for s in range(4))
        self.mem: torch.Tensor | None = None

    def attend(self, h: torch.Tensor, mem: torch.Tensor | None) -> torch.Tensor:
        kv = h if mem is None else torch.cat([mem, h], 1)
        a = torch.softmax(self.q(h) @ self.k(kv).transpose(1, 2) / D**0.5, -1)
        return torch.tanh(h + self.o(a @ self.v(kv)))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.attend(h, self.mem)
        self.mem = h.detach()
        return out


class CounterBlock(nn.Module):
    """A step counter picks the repeat's gain (a time embedding, in effect)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = _linear(D, 5)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, R, dtype=F64))
        self.t = 0

    def round(self, h: torch.Tensor, t: int) -> torch.Tensor:
        return torch.tanh(self.gain[min(t, R - 1)] * self.lin(h)) + 0.5 * h

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.round(h, self.t)
        self.t += 1
        return out


class CacheBlock(nn.Module):
    """Attention over the keys/values of every earlier repeat, appended to ``self.cache``."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (_linear(D, s) for s in range(3))
        self.cache: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.cache.append((self.k(h), self.v(h)))
        K = torch.cat([c[0] for c in self.cache], 1)
        V = torch.cat([c[1] for c in self.cache], 1)
        return torch.tanh(h + torch.softmax(self.q(h) @ K.transpose(1, 2), -1) @ V)


class ShowBlock(nn.Module):
    """Stores its last pre-activation for plotting: state that the computation never reads."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = _linear(D, 7)
        self.last: torch.Tensor | None = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        z = self.lin(h)
        self.last = z
        return torch.tanh(z) + 0.5 * h


class CountingBlock(nn.Module):
    """Counts its calls in a buffer, in place."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = _linear(D, 8)
        self.register_buffer("calls", torch.zeros((), dtype=F64))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.lin(h)) + 0.5 * h


class Looped(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blk = self.block
        blk.mem, blk.t = None, 0
        if isinstance(blk, CacheBlock):
            blk.cache.clear()
        h = x
        for _ in range(R):
            h = blk(h)
        return h


def _inputs() -> torch.Tensor:
    return torch.randn(1, 3, D, generator=torch.Generator().manual_seed(0), dtype=F64)


def _states(model: Looped, x: torch.Tensor) -> list[torch.Tensor]:
    model(x)
    hs = [x]
    model.block.mem, model.block.t = None, 0
    with torch.no_grad():
        for _ in range(R):
            hs.append(model.block(hs[-1]))
    return hs


def _dense_rho(f, h: torch.Tensor) -> float:
    J = torch.func.jacrev(f)(h).detach().reshape(h.numel(), h.numel())
    return float(torch.linalg.eigvals(J).abs().max())


def test_the_memory_toys_replay_unchecked_gives_a_certified_wrong_radius():
    # replay_rtol=inf switches the check off: what every estimate on the replay used to be
    model, x = Looped(MemoryBlock()), _inputs()
    hs = _states(model, x)
    rm = lp.replay_round(model, x, "block", round=0, replay_rtol=math.inf)
    sr = lp.spectral_radius(rm.T, hs[0])
    rho = _dense_rho(lambda h: model.block.attend(h, None), hs[0])  # the model's round 0
    assert sr.converged, sr.reason
    assert abs(sr.value - rho) / rho > 0.05, (sr.value, rho)


@pytest.mark.parametrize("r", [0, 1, 3])
def test_replay_of_a_block_with_a_memory_of_the_previous_repeat_is_refused(r):
    model, x = Looped(MemoryBlock()), _inputs()
    model(x)
    mem = model.block.mem
    with pytest.raises(
        ValueError,
        match=rf"replay_round: replaying call {r} of 'block' .* does "
        r"not reproduce its recorded output \(relative difference .*block\.mem",
    ):
        lp.replay_round(model, x, "block", round=r)
    assert model.block.mem is mem


def test_replay_of_a_step_counter_is_refused_early_and_is_the_dense_round_at_the_last():
    model, x = Looped(CounterBlock()), _inputs()
    hs = _states(model, x)
    for r in range(R - 1):
        with pytest.raises(ValueError, match=r"relative difference .*block\.t rebound to 5"):
            lp.replay_round(model, x, "block", round=r)
    rm = lp.replay_round(model, x, "block", round=R - 1)
    assert "reproduces its recorded output" in rm.reason and "put back" in rm.reason
    sr = lp.spectral_radius(rm.T, hs[R - 1])
    rho = _dense_rho(lambda h: model.block.round(h, R - 1), hs[R - 1])
    assert sr.converged, sr.reason
    assert abs(sr.value - rho) <= 1e-8 * rho, (sr.value, rho)
    assert model.block.t == R  # hundreds of JVPs later, the counter is as the forward left it


def test_replay_of_a_kv_cache_is_refused_and_leaves_the_cache_as_it_was():
    model, x = Looped(CacheBlock()), _inputs()
    model(x)
    cache, entries = model.block.cache, list(model.block.cache)
    with pytest.raises(ValueError, match=r"block\.cache changed in place \(list of 4 -> list of 5"):
        lp.replay_round(model, x, "block", round=0)
    assert model.block.cache is cache and len(cache) == R
    assert all(a is b for a, b in zip(cache, entries, strict=True))


def test_replay_of_a_block_that_stores_state_it_never_reads_is_trusted_and_changes_nothing():
    model, x = Looped(ShowBlock()), _inputs()
    hs = _states(model, x)
    model(x)
    last = model.block.last
    rm = lp.replay_round(model, x, "block", round=2)
    assert "relative difference 0 <=" in rm.reason and "block.last rebound" in rm.reason
    sr = lp.spectral_radius(rm.T, hs[2])
    fp = lp.fixed_point(rm.T, rm.h0, tol=1e-10, max_iter=500)
    assert sr.converged and fp.converged, (sr.reason, fp.reason)
    rho = _dense_rho(lambda h: torch.tanh(model.block.lin(h)) + 0.5 * h, hs[2])
    assert abs(sr.value - rho) <= 1e-8 * rho, (sr.value, rho)
    assert model.block.last is last  # not a tensor of the last JVP (a dead functorch wrapper)


def test_replay_of_a_block_that_writes_a_buffer_in_place_is_refused_and_the_buffer_restored():
    model, x = Looped(CountingBlock()), _inputs()
    model(x)
    assert float(model.block.calls) == R
    with pytest.raises(
        ValueError,
        match=r"writes into tensors it holds in place \(buffer "
        r"block\.calls written in place\)",
    ):
        lp.replay_round(model, x, "block")
    assert float(model.block.calls) == R


class NoisyBlock(nn.Module):
    """Roundoff-sized nondeterminism (as a nondeterministic GPU reduction would give)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = _linear(D, 9)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = torch.tanh(self.lin(h)) + 0.5 * h
        return out * (1 + 1e-12 * torch.rand_like(out))


def test_replay_tolerance_is_roundoff_by_default_and_can_be_widened():
    model, x = Looped(NoisyBlock()), _inputs()
    assert replay_tol(F64) == 64 * torch.finfo(F64).eps
    assert replay_tol(torch.float32) == pytest.approx(7.63e-6, rel=1e-2)
    assert replay_tol(torch.bfloat16) == 4 * 2.0**-7
    with pytest.raises(ValueError, match=r"replay_rtol 1.4e-14"):
        lp.replay_round(model, x, "block")
    rm = lp.replay_round(model, x, "block", replay_rtol=1e-10)
    assert "<= replay_rtol 1e-10" in rm.reason


class CountingLoop(nn.Module):
    """A model with the reference interface (embed/step) whose step counts its rounds."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = _linear(D, 10)
        self.t = 0

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        return idx.to(F64)

    def step(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        self.t += 1
        return torch.tanh(self.lin(h) / self.t) + x


def test_round_map_refuses_a_step_that_keeps_state_and_leaves_the_model_as_it_was():
    model = CountingLoop()
    with pytest.raises(
        ValueError,
        match=r"round_map: CountingLoop\.step changes the model "
        r"\(model\.t rebound to 2; put back\)",
    ):
        lp.round_map(model, _inputs())
    assert model.t == 0


def test_round_map_of_a_reference_model_says_what_it_checked():
    cfg = lpm.GPTConfig(vocab_size=16, seq_len=8, d_model=8, n_heads=2, K=1, R=3, recall="add")
    model = lpm.LoopedGPT(cfg, generator=torch.Generator().manual_seed(0)).double()
    rm = lp.round_map(model, torch.zeros(1, 4, dtype=torch.long))
    assert rm.reason == (
        "LoopedGPT.step(h0, x) called twice: relative difference 0, model unchanged; "
        f"{lp.differentiate.roundmap.EVAL_ROUND}"
    )
