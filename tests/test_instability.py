"""Instability diagnostics: per-visit gradients vs an untied copy, flags, recorder, branch gain."""

from __future__ import annotations

import copy
import importlib
import math

import numpy as np
import pytest
import torch
from thirdparty_models import SharedBlockModel, make, randn

import loopprobe as lp
from loopprobe import tasks
from loopprobe.estimate.instability import branch_gain
from loopprobe.models import GPTConfig, LoopedGPT

ins_mod = importlib.import_module("loopprobe.estimate.instability")


def _gpt(**kw) -> LoopedGPT:
    cfg = {"vocab_size": 256, "seq_len": 8, "d_model": 16, "n_heads": 2, "K": 1, "R": 4, **kw}
    return LoopedGPT(GPTConfig(**cfg), generator=torch.Generator().manual_seed(0)).double()


def _batch():
    return tasks.stdlib_text(2, 8, torch.Generator().manual_seed(0))


def _loss(targets):
    return lambda out, _inp: ins_mod.lm_loss(out, targets)


def test_visit_gradients_and_consecutive_cosines_match_an_untied_copy():
    model, x = make(SharedBlockModel, R=4), randn(3, 6)
    ins = lp.instability(model, x, lambda out, _: out.pow(2).sum())
    # brute force: one deep copy of the block per visit, ordinary autograd
    blocks = [copy.deepcopy(model.block) for _ in range(4)]
    h = x
    for b in blocks:
        h = b(h)
    model.head(h).pow(2).sum().backward()
    G = [torch.cat([p.grad.reshape(-1) for p in b.parameters()]) for b in blocks]
    norms = ins.visits.sort_values("r").G_norm.to_numpy()
    np.testing.assert_allclose(norms, [float(g.norm()) for g in G], rtol=1e-10)
    cos = [float(G[r] @ G[r - 1] / (G[r].norm() * G[r - 1].norm())) for r in range(1, 4)]
    np.testing.assert_allclose(ins.visits.sort_values("r").cos_prev.to_numpy()[1:], cos, rtol=1e-9)
    assert math.isnan(ins.visits.sort_values("r").cos_prev.iloc[0])


def test_stream_rms_per_round_matches_a_hand_unroll_and_flags_explosion():
    model = _gpt(R=5, residual="none")
    idx, tgt = _batch()
    ins = lp.instability(model, idx, _loss(tgt), explosion_threshold=1.0)
    with torch.no_grad():
        h = model.embed(idx)
        rms = []
        for _ in range(5):
            h = model.blocks[0](h)
            rms.append(float(h.pow(2).mean().sqrt()))
    np.testing.assert_allclose(ins.rounds.stream_rms, rms, rtol=1e-10)
    assert list(ins.rounds.explosion) == [r > 1.0 for r in rms]
    assert ins.exploding == any(r > 1.0 for r in rms)
    assert ins.rounds.growth.iloc[1] == pytest.approx(rms[1] / rms[0])
    high = lp.instability(model, idx, _loss(tgt), explosion_threshold=1e6)
    assert not high.exploding


def test_oscillation_flag_follows_the_user_threshold():
    model = _gpt(R=4)
    idx, tgt = _batch()
    lo = lp.instability(model, idx, _loss(tgt), oscillation_threshold=-1.1)
    hi = lp.instability(model, idx, _loss(tgt), oscillation_threshold=1.1)
    assert not lo.oscillating and not lo.visits.oscillation.any()
    assert hi.oscillating and hi.visits[hi.visits.r > 0].oscillation.all()
    assert set(hi.sublayers.columns) >= {"mean_cos_prev", "min_cos_prev", "oscillating"}
    with pytest.raises(ValueError, match="oscillation_threshold"):
        lp.instability(model, idx, _loss(tgt), oscillation_threshold=math.nan)


def test_gradient_oscillation_is_detected_on_a_loop_that_flips_sign():
    # h <- -h + b: d loss / d b at visit r is the gradient that reaches h_{r+1}, and the
    # map -h flips its sign at every round, so consecutive visits' G have cosine -1
    class Flip(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.b = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 4))

        def forward(self, h):
            return -h + self.b

    class Loop(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.f = Flip()

        def forward(self, x):
            for _ in range(4):
                x = self.f(x)
            return x

    model = make(Loop)
    ins = lp.instability(model, randn(5, 4), lambda out, _: out.sum(), increment="delta")
    assert ins.oscillating
    assert ins.visits.cos_prev.dropna().to_numpy() == pytest.approx(-1.0)


def test_probing_leaves_model_and_grads_untouched():
    model = _gpt()
    idx, tgt = _batch()
    model.train()
    before = [p.detach().clone() for p in model.parameters()]
    lp.instability(model, idx, _loss(tgt))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters()) and model.training


def test_recorder_records_every_k_steps_of_a_training_loop():
    model = _gpt(R=3).float()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    rec = lp.experiments.record_training(
        model, opt, lambda t, g: tasks.stdlib_text(2, 8, g), steps=5, every=2,
        generator=torch.Generator().manual_seed(1),
    )  # fmt: skip
    df = rec.to_frame()
    assert sorted(df.step.unique()) == [0, 2, 4]
    assert len(df) == 3 * 2 * 3  # steps x sublayers x visits
    assert list(df.columns[:2]) == ["step", "sublayer"]
    assert {"G_norm", "cos_prev", "oscillation", "stream_rms"} <= set(df.columns)
    assert len(rec.rounds_frame()) == 3 * 3
    assert list(rec.summary_frame().step) == [0, 2, 4]
    assert rec(3) is None
    with pytest.raises(ValueError, match="every=0"):
        lp.experiments.InstabilityRecorder(model, every=0)
    with pytest.raises(ValueError, match="no batch"):
        lp.experiments.InstabilityRecorder(model)(0)


@pytest.mark.parametrize("norm", ["deepnorm", "deeploop"])
def test_postnorm_branches_enter_with_gain_one_over_alpha_after_the_first_visit(norm):
    model = _gpt(norm=norm, R=4, d_model=32, n_heads=4)
    df = branch_gain(model, _batch()[0])
    alpha = model.cfg.alpha
    assert df.inv_alpha.to_numpy() == pytest.approx(1 / alpha)
    later = df[df.i > 0]  # the first visit reads the raw embedding (RMS ~0.03), not RMS 1
    # Lemma A.1: the branch enters as (z - <x,z>_d x)/alpha, so gain * alpha <= 1, close
    # to 1 when z is nearly orthogonal to x (d = 32 here: within about 10%)
    assert later.gain_alpha.between(0.85, 1.02).all()
    assert later.gain.to_numpy() == pytest.approx(later.gain_first_order.to_numpy(), rel=0.03)
    first = df[df.i == 0].iloc[0]
    assert first.rms_x < 0.1 and first.gain_alpha > 10


def test_branch_gain_first_order_term_is_exact_as_the_branch_vanishes():
    # Lemma A.1: R(a x + z) - R(a x) = J z + O(|z|^2); check on raw tensors
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g, dtype=torch.float64)
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt()
    z = torch.randn(3, 64, generator=g, dtype=torch.float64)
    a = 4.0
    errs = []
    for t in (1e-1, 1e-2, 1e-3):
        exact = ins_mod._rmsnorm(a * x + t * z) - ins_mod._rmsnorm(a * x)
        lin = (t * z - (x * t * z).mean(-1, keepdim=True) * x) / a
        errs.append(float((exact - lin).norm()))
    assert errs[1] / errs[0] == pytest.approx(1e-2, rel=0.2)  # second order
    assert errs[2] / errs[1] == pytest.approx(1e-2, rel=0.2)


def test_branch_gain_needs_alpha_and_residual_shaped_branches():
    model = make(SharedBlockModel, R=3)
    with pytest.raises(ValueError, match="pass alpha="):
        branch_gain(model, randn(2, 6))
    probe = lp.attach(_gpt(norm="deeploop"), sublayers=["blocks.*.mlp.f.fc1"])
    with pytest.raises(ValueError, match="blocks.0.mlp.f.fc1"):
        branch_gain(probe, _batch()[0])
