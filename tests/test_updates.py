"""Per-visit updates G_{r,j}: against the tied gradient, an untied twin, and real optimizers."""

from __future__ import annotations

import copy

import pytest
import torch
from thirdparty_models import (
    AlbertModel,
    ForLoopModel,
    InplaceModel,
    KeywordModel,
    SharedBlockModel,
    TruncatedModel,
    make,
    randn,
)
from torch import nn

import loopprobe as lp
from loopprobe.estimate.updates import per_visit_updates


def mse(target: torch.Tensor):
    return lambda out, inputs: ((out - target) ** 2).sum()


def flat(ts) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


@pytest.mark.parametrize(
    "cls, kw, shape",
    [
        (ForLoopModel, {"K": 2, "R": 3}, (4, 5)),
        (AlbertModel, {"R": 3}, (4, 6)),
        (KeywordModel, {"R": 3}, (4, 6)),
        (InplaceModel, {"R": 3}, (4, 6)),
        (TruncatedModel, {"C": 3, "C_L": 2}, (4, 6)),
    ],
)
def test_sum_over_visits_of_G_equals_the_ordinary_tied_gradient(cls, kw, shape):
    model = make(cls, **kw)
    x = randn(*shape)
    target = randn(*model(x).shape, seed=7)
    probe = lp.attach(model)
    ups = per_visit_updates(probe, x, mse(target))
    for j, g in enumerate(probe.groups()):
        tied = flat(torch.autograd.grad(mse(target)(model(x), x), g.params))
        torch.testing.assert_close(ups.tied(j), tied, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cls", [ForLoopModel, SharedBlockModel])
def test_each_G_equals_the_gradient_of_its_private_copy_in_the_untied_twin(cls):
    model = make(cls)
    x = randn(4, 5 if cls is ForLoopModel else 6)
    target = randn(*model(x).shape, seed=7)
    ups = per_visit_updates(lp.attach(model), x, mse(target))
    twin = model.untied()
    grads = torch.autograd.grad(mse(target)(twin(x), x), list(twin.steps.parameters()))
    per_step = len(list(twin.steps[0].parameters()))
    for v in ups.visits:  # visit i is step i of the twin
        expected = flat(grads[v.i * per_step : (v.i + 1) * per_step])
        torch.testing.assert_close(ups.G[v.j][v.r], expected, rtol=0, atol=1e-13)


def test_albert_G_equals_the_per_layer_gradients_of_the_untied_copy():
    model = make(AlbertModel, R=3)
    x = randn(4, 6)
    target = randn(4, 6, seed=7)
    ups = per_visit_updates(lp.attach(model), x, mse(target))
    twin = model.untied()
    for r, layer in enumerate(twin.layers):
        g = torch.autograd.grad(mse(target)(twin(x), x), list(layer.mix.parameters()))
        torch.testing.assert_close(ups.G[0][r], flat(g), rtol=0, atol=1e-13)


def test_truncated_visits_get_zero_G_and_are_marked_not_gradient_visible():
    model = make(TruncatedModel, C=3, C_L=2)
    x = randn(4, 6)
    ups = per_visit_updates(lp.attach(model), x, lambda out, _: out.square().sum())
    assert ups.visible[0].tolist() == [False] * 4 + [True] * 2
    assert ups.visible[1].tolist() == [False, False, True]
    assert float(ups.G[0][:4].abs().max()) == 0.0
    frame = ups.to_frame()
    assert len(frame) == 9 and int(frame.grad_visible.sum()) == 3


def test_fresh_adam_effective_updates_sum_to_adams_real_first_step():
    model = make(ForLoopModel)
    x, target = randn(4, 5), randn(4, 5, seed=7)
    probe = lp.attach(model)
    ups = per_visit_updates(probe, x, mse(target), update="adam")
    assert "fresh" in ups.method
    twin = copy.deepcopy(model)
    opt = torch.optim.Adam(twin.parameters(), lr=1e-3)
    mse(target)(twin(x), x).backward()
    before = [p.detach().clone() for p in twin.layers[0].parameters()]
    opt.step()
    step = flat(
        [(b - p.detach()) / 1e-3 for b, p in zip(before, twin.layers[0].parameters(), strict=True)]
    )
    torch.testing.assert_close(ups.tied(0), step, rtol=1e-9, atol=1e-9)


def test_adam_state_is_read_not_written_and_gradient_part_plus_momentum_is_the_next_step():
    model = make(SharedBlockModel)
    x, target = randn(4, 6), randn(4, 3, seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    mse(target)(model(x), x).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    state = copy.deepcopy(opt.state_dict())
    ups = per_visit_updates(lp.attach(model), x, mse(target), update=opt)
    assert "state at step 1" in ups.method
    after = opt.state_dict()
    for k, s in state["state"].items():
        for name, t in s.items():
            assert torch.equal(t, after["state"][k][name])
    twin = copy.deepcopy((model, opt))
    tm, topt = twin
    mse(target)(tm(x), x).backward()
    before = [p.detach().clone() for p in tm.block.parameters()]
    topt.step()
    step = flat(
        [(b - p.detach()) / 1e-3 for b, p in zip(before, tm.block.parameters(), strict=True)]
    )
    gradient_part = ups.tied(0)
    assert float((step - gradient_part).norm()) == pytest.approx(ups.history_norm[0], rel=1e-9)


def test_probing_updates_never_changes_parameters_grads_or_mode():
    model = make(ForLoopModel).train()
    x, target = randn(4, 5), randn(4, 5, seed=7)
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    snap = {n: (p.detach().clone(), p.grad.clone()) for n, p in model.named_parameters()}
    per_visit_updates(lp.attach(model), x, mse(target), update="adam")
    for n, p in model.named_parameters():
        assert torch.equal(p, snap[n][0]) and torch.equal(p.grad, snap[n][1])
    assert model.training


class Exploding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            x = self.lin(x) * 1e160
        return x


def test_non_finite_loss_names_the_first_visit_whose_output_overflows():
    model = make(Exploding)
    with pytest.raises(FloatingPointError, match=r"visit r=2 of sublayer .lin."):
        per_visit_updates(lp.attach(model), randn(2, 4), lambda out, _: out.sum())


class NaNGradient(nn.Module):
    """A finite output whose gradient is NaN: the unselected branch of a ``where`` is
    sqrt of negative numbers, and 0 * NaN = NaN flows back to every visit."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = self.lin(x)
        return torch.where(x.abs() < 1e30, x, (-x.abs()).sqrt())


@pytest.mark.parametrize("memory", ["full", "low"])
def test_a_nan_gradient_behind_a_finite_loss_names_the_last_visit_it_reaches(memory):
    probe = lp.attach(make(NaNGradient))
    with pytest.raises(
        FloatingPointError, match=r"non-finite gradient at visit r=2 of sublayer .lin."
    ):
        per_visit_updates(probe, randn(2, 4), lambda out, _: out.sum(), memory=memory)


def test_bad_update_argument_raises_with_the_allowed_values():
    model = make(SharedBlockModel)
    with pytest.raises(ValueError, match="choose one of"):
        per_visit_updates(lp.attach(model), randn(2, 6), lambda o, _: o.sum(), update="lion")
    opt = torch.optim.RMSprop(model.parameters())
    with pytest.raises(TypeError, match="not supported"):
        per_visit_updates(lp.attach(model), randn(2, 6), lambda o, _: o.sum(), update=opt)


@pytest.mark.parametrize("update", ["sgd", "adam"])
def test_low_memory_mode_streams_the_same_norms_and_tied_sums_without_storing_G(update):
    model = make(TruncatedModel, C=2, C_L=3)
    x, target = randn(4, 6), randn(4, 6, seed=7)
    probe = lp.attach(model)
    full = per_visit_updates(probe, x, mse(target), update=update)
    low = per_visit_updates(probe, x, mse(target), update=update, memory="low")
    assert low.G is None and low.memory == "low" and low.method == full.method
    for j in range(2):
        torch.testing.assert_close(low.norms(j), full.norms(j), rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(low.tied(j), full.tied(j), rtol=1e-12, atol=1e-14)
        assert torch.equal(low.visible[j], full.visible[j])
    with pytest.raises(ValueError, match="memory='full'"):
        low.gram(0)
