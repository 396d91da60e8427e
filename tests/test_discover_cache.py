"""Discovery once per model and batch (loopprobe.record.discover_cache): a second probe on the
same model and batch runs no discovery forward, and anything discovery reads that changes
(structure, ties, plain attributes, modes, hooks, inputs, seed) makes it run again."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

import loopprobe as lp
from loopprobe.record import discover, discover_cache


class Loop(nn.Module):
    """A plain third-party loop: embed, R rounds of one shared block, a head."""

    def __init__(self, d: int = 4, R: int = 3) -> None:
        super().__init__()
        self.emb, self.block, self.head = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.R = R

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for _ in range(self.R):
            h = h + torch.tanh(self.block(h))
        return self.head(h)


class Stack(nn.Module):
    """Blocks in a ModuleList, tied by holding one module three times."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        b = nn.Linear(d, d)
        self.blocks = nn.ModuleList([b, b, b])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = x + torch.tanh(blk(x))
        return x


@pytest.fixture
def runs(monkeypatch):
    """The number of discovery forwards so far (record_calls wrapped with a counter)."""
    discover_cache.clear()
    count = [0]
    real = discover.record_calls

    def counted(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(discover, "record_calls", counted)
    yield lambda: count[0]
    discover_cache.clear()


def _found(model: nn.Module, x, **kw) -> list[tuple[str, str]]:
    return [(s.name, s.role) for s in lp.attach(model).sublayers(x, **kw)]


def test_second_probe_on_same_model_and_batch_runs_no_discovery_forward(runs):
    torch.manual_seed(0)
    model, x = Loop(), torch.randn(2, 4)
    first = _found(model, x)
    second = _found(model, x)
    assert runs() == 1
    assert second == first and ("block", "body") in first


def test_replaced_submodule_is_rediscovered_with_its_own_parameters(runs):
    torch.manual_seed(0)
    model, x = Loop(), torch.randn(2, 4)
    _found(model, x)
    model.block = nn.Linear(4, 4)
    probe = lp.attach(model)
    groups = probe.groups(x)
    assert runs() == 2
    block = next(g for g in groups if g.sublayer.name == "block")
    assert block.params[0] is model.block.weight


def test_untied_blocks_are_rediscovered_not_served_from_the_cache(runs):
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(2, 4)
    assert _found(model, x) == [("blocks.0", "body")]
    model.blocks[1] = copy.deepcopy(model.blocks[0])  # same names and class, no longer tied
    model.blocks[2] = copy.deepcopy(model.blocks[0])
    with pytest.raises(ValueError, match="nothing is looped"):
        _found(model, x)
    assert runs() == 2


def test_plain_attribute_that_steers_the_loop_is_part_of_the_key(runs):
    torch.manual_seed(0)
    model, x = Loop(R=3), torch.randn(2, 4)
    _found(model, x)
    model.R = 1  # the shared block now runs once: nothing is looped
    with pytest.raises(ValueError, match="nothing is looped"):
        _found(model, x)


def test_inputs_shape_identity_and_in_place_change_each_rediscover(runs):
    torch.manual_seed(0)
    model, x = Loop(), torch.randn(2, 4)
    _found(model, x)
    _found(model, x)
    assert runs() == 1
    _found(model, torch.randn(3, 4))  # another shape
    assert runs() == 2
    _found(model, x.clone())  # the same shape, another tensor: per batch
    assert runs() == 3
    _found(model, x)
    assert runs() == 4  # the clone's entry replaced x's
    x.add_(1.0)  # modified in place: its version counter moved
    _found(model, x)
    assert runs() == 5


def test_mode_hooks_seed_and_forward_each_rediscover(runs):
    torch.manual_seed(0)
    model, x = Loop(), torch.randn(2, 4)
    _found(model, x)
    model.eval()
    _found(model, x)
    assert runs() == 2
    handle = model.head.register_forward_hook(lambda m, a, out: out * 2)
    _found(model, x)
    assert runs() == 3
    handle.remove()
    _found(model, x, seed=1)
    assert runs() == 4

    def forward(m, inp):
        return m(inp)

    _found(model, x, forward=forward)
    _found(model, x, forward=forward)
    assert runs() == 5
    _found(model, x, seed=None)  # the caller's RNG: never cached
    _found(model, x, seed=None)
    assert runs() == 7


def test_cache_keeps_no_model_alive(runs):
    model, x = Loop(), torch.randn(2, 4)
    _found(model, x)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
    assert len(discover_cache._CACHE) == 0


def test_glob_matches_are_computed_per_set_of_module_names():
    def stack(n: int) -> nn.Module:
        m = nn.Module()
        m.layers = nn.ModuleList([nn.Linear(2, 2) for _ in range(n)])
        return m

    one = discover.groups_from_names(stack(1), ["layers.*"], "t")
    three = discover.groups_from_names(stack(3), ["layers.*"], "t")
    assert [len(g) for g in one] == [1] and len(three) == 3  # three untied layers: 3 groups
    assert discover.matches("a.*", ("a", "a.x", "b.x")) == ("a.x",)
