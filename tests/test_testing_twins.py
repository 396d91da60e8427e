"""loopprobe.testing's brute-force-twin checks (an untied copy, dense Jacobians) and the
model-unchanged check pass on sane third-party-style models and catch planted bugs: a G
shifted by one visit (which the sum over visits cannot see), a norm off by 1e-6, a radius
off by 1 %, a dropped visit, and probes that leave parametrization state, a module's own
generator, a gradient or a reseeded RNG behind."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _testing_family import batch, loop, loss, recur
from thirdparty_models import TruncatedModel, make, randn
from torch import nn

import loopprobe as lp
import loopprobe.testing as lpt


def x_for(model):
    return batch(model, torch.Generator().manual_seed(0))


def sq(out, inputs):
    return out.pow(2).sum()


def test_each_G_is_the_gradient_of_its_visits_untied_copy_and_no_grad_visits_are_zero():
    m = make(TruncatedModel, C=3, C_L=2)
    errors = lpt.check_updates_match_untied_copy(m, randn(4, 6), sq, rtol=1e-12)
    # C_L low and 1 high visit per cycle; only the last cycle's 3 reach the loss
    assert sorted(errors) == [("high", 2), ("low", 4), ("low", 5)]
    assert max(errors.values()) < 1e-12


def shifted(real):
    """``lp.per_visit_updates`` with every G shifted by one visit (row r holds G_{r+1})."""

    def wrong(*args, **kwargs):
        ups = real(*args, **kwargs)
        return dataclasses.replace(ups, G=[g.roll(1, 0) for g in ups.G])

    return wrong


def test_a_G_shifted_by_one_visit_passes_the_sum_but_not_the_untied_copy(monkeypatch):
    m = loop(R=3)
    x = x_for(m)
    monkeypatch.setattr(lp, "per_visit_updates", shifted(lp.per_visit_updates))
    lpt.check_updates_sum_to_tied_gradient(m, x, loss)  # the sum over visits cannot tell
    with pytest.raises(AssertionError, match=r"'blocks.0' visit 0 .*untied copy\n.*> rtol"):
        lpt.check_updates_match_untied_copy(m, x, loss)


def test_a_visit_the_probe_misses_is_caught_by_counting_the_copies_calls(monkeypatch):
    real = lp.per_visit_updates

    def dropped(*args, **kwargs):
        ups = real(*args, **kwargs)
        return dataclasses.replace(ups, visits=ups.visits[:-1])

    monkeypatch.setattr(lp, "per_visit_updates", dropped)
    m = loop(R=3)
    with pytest.raises(AssertionError, match=r"calls 'blocks.0' more than the 2 times"):
        lpt.check_updates_match_untied_copy(m, x_for(m), loss)


def test_visit_norms_are_the_dense_jacobians_top_singular_values():
    m = make(TruncatedModel, C=2, C_L=2)
    errors = lpt.check_sensitivity_matches_dense_jacobian(m, randn(4, 6))
    assert sorted(errors) == [("high", 1), ("low", 3)] and max(errors.values()) < 1e-8


def test_a_visit_norm_off_by_one_part_in_a_million_fails(monkeypatch):
    real = lp.sensitivity_norms

    def off(*args, **kwargs):
        sens = real(*args, **kwargs)
        norms = [dataclasses.replace(e, value=e.value * (1 + 1e-6)) for e in sens.visit_norms]
        return dataclasses.replace(sens, visit_norms=norms)

    monkeypatch.setattr(lp, "sensitivity_norms", off)
    m = loop(R=3)
    with pytest.raises(AssertionError, match=r"visit 2: \|\|U_r\|\| is not .*\n.*relative 1e-06"):
        lpt.check_sensitivity_matches_dense_jacobian(m, x_for(m))


def test_the_spectral_radius_of_a_round_is_the_dense_one_and_one_percent_off_fails(monkeypatch):
    m, x = recur(0.9), randn(3, 6)
    rho = lpt.check_spectral_radius_matches_dense(m, x, "cell", input_arg=1)
    assert 0 < rho < 0.9
    real = lp.spectral_radius
    monkeypatch.setattr(
        lp, "spectral_radius", lambda *a, **k: dataclasses.replace(real(*a, **k), value=rho * 1.01)
    )
    with pytest.raises(AssertionError, match=r"not the dense one\n.*rtol=1e-06"):
        lpt.check_spectral_radius_matches_dense(m, x, "cell", input_arg=1)


# ------------------------------------------------------------------ the model unchanged


class NoisyNormedLoop(nn.Module):
    """A third-party-style loop: a spectrally normalised block (parametrization state u/v)
    applied R times, with noise drawn from a generator the model owns."""

    def __init__(self, d: int = 6, R: int = 3) -> None:
        super().__init__()
        self.R = R
        self.block = nn.utils.parametrizations.spectral_norm(nn.Linear(d, d))
        self.gen = torch.Generator().manual_seed(7)
        self.spare = {"noise": torch.Generator().manual_seed(8)}  # one held in a dict

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.R):
            x = x + torch.tanh(self.block(x))
        if self.training:
            x = x + 1e-3 * torch.randn(x.shape, generator=self.gen, dtype=x.dtype)
        return x


KW = {"alpha": 1.0, "beta": 1.0, "increment": "output"}  # a plain residual loop


def noisy() -> NoisyNormedLoop:
    return make(NoisyNormedLoop).eval()  # eval: spectral_norm's u/v stay as they are


def planted(monkeypatch, bug):
    real = lp.bound_check

    def leaky(probe, *args, **kwargs):
        out = real(probe, *args, **kwargs)
        bug(probe.model)
        return out

    monkeypatch.setattr(lp, "bound_check", leaky)


def train_forward(model):
    model.train()
    model(randn(4, 6))
    model.eval()


def draw_own_generator(model):
    torch.rand(1, generator=model.gen)


def draw_spare_generator(model):
    torch.rand(1, generator=model.spare["noise"])


def test_probing_leaves_parametrization_state_and_a_module_generator_alone():
    m = noisy()
    ran = lpt.check_probe_leaves_model_unchanged(m, randn(4, 6), sq, **KW)
    assert ran == [
        "visit_table",
        "per_visit_updates",
        "sensitivity_norms",
        "visit_alignment",
        "bound_check",
        "increments",
    ]


@pytest.mark.parametrize(
    ("bug", "needle"),
    [
        (train_forward, r"block.parametrizations.weight.0._u: value changed"),
        (draw_own_generator, r"gen: torch.Generator state advanced"),
        (draw_spare_generator, r"spare\['noise'\]: torch.Generator state advanced"),
        (lambda m: m.zero_grad(), r"block.bias.grad changed \(set -> None\)"),
        (lambda m: torch.manual_seed(0), r"torch's global RNG state advanced"),
    ],
)
def test_a_probe_that_leaves_state_behind_is_caught_after_the_call_that_did_it(
    monkeypatch, bug, needle
):
    m = noisy()
    planted(monkeypatch, bug)
    with (
        torch.random.fork_rng(),
        pytest.raises(AssertionError, match=r"seen after bound_check\n.*" + needle),
    ):
        torch.manual_seed(0)  # a reseeding probe would be invisible from here, not the check's
        lpt.check_probe_leaves_model_unchanged(m, randn(4, 6), sq, **KW)
    assert m.block.bias.grad is None  # the check put the caller's .grad back


def test_an_entry_point_that_raises_must_leave_the_model_unchanged_too(monkeypatch):
    def broken(model, *args, **kwargs):
        model.out.weight.data.add_(1.0)
        raise RuntimeError("planted")

    monkeypatch.setattr(lp, "increments", broken)
    m = loop(R=3)
    with pytest.raises(AssertionError, match=r"seen after increments \(and raised\)\n.*out.weight"):
        lpt.check_probe_leaves_model_unchanged(m, x_for(m), loss)
