"""kappa against brute force, closed forms on the linear loop, the bound check and the R sweep."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as Fn
from hypothesis import example, given
from hypothesis import strategies as st
from test_sensitivity import dense_blocks, top_sv
from thirdparty_models import (
    ForLoopModel,
    SharedBlockModel,
    TruncatedModel,
    make,
    randn,
)
from torch import nn

import loopprobe as lp
from loopprobe.estimate.alignment import visit_alignment, visit_kappa
from loopprobe.estimate.bound import bound_check, bound_sweep
from loopprobe.models import GPTConfig, LinearLoop, LinearLoopConfig, LoopedGPT


def mse(target: torch.Tensor):
    return lambda out, inputs: ((out - target) ** 2).sum()


def lm_loss(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return Fn.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))


def tiny_gpt(R: int, norm: str = "deeploop", seed: int = 0) -> LoopedGPT:
    cfg = GPTConfig(vocab_size=16, seq_len=8, d_model=16, n_heads=2, K=2, R=R, norm=norm)
    return LoopedGPT(cfg, generator=torch.Generator().manual_seed(seed)).double()


IDX = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(1))


def test_kappa_equals_the_brute_force_value_from_dense_jacobians_and_an_untied_twin():
    model = make(ForLoopModel, K=2, R=3)
    x, target = randn(3, 5), randn(3, 5, seed=7)
    rep = visit_alignment(lp.attach(model), x, mse(target), method="lanczos", max_iter=80)
    twin = model.untied()
    J = dense_blocks(twin, x, [f"steps.{i}." for i in range(6)])
    grads = torch.autograd.grad(mse(target)(twin(x), x), list(twin.steps.parameters()))
    n = len(list(twin.steps[0].parameters()))
    G = [torch.cat([g.reshape(-1) for g in grads[i * n : (i + 1) * n]]) for i in range(6)]
    for j in range(2):
        Js, Gs = J[j::2], G[j::2]
        brute = (
            top_sv(sum(Js))
            * float(sum(Gs).norm())
            / (3 * max(top_sv(a) for a in Js) * max(float(g.norm()) for g in Gs))
        )
        assert rep.sublayers.kappa[j] == pytest.approx(brute, rel=1e-6)
    assert rep.kappa == pytest.approx(max(rep.sublayers.kappa), rel=0)


def test_per_visit_norms_match_the_closed_form_on_the_linear_residual_loop():
    # h_{r+1} = h_r (I + eps W^T): ||U_r|| = eps * ||X A^r|| * ||A^(R-r-1)||, A = I + eps W^T.
    cfg = LinearLoopConfig(d=5, R=4)
    model = LinearLoop(cfg, generator=torch.Generator().manual_seed(0)).double()
    x = randn(3, 5)
    sens = lp.sensitivity_norms(lp.attach(model), x, method="lanczos", max_iter=40)
    A = model.transition_matrix().T
    eps = cfg.step_size
    for v, est in zip(sens.visits, sens.visit_norms, strict=True):
        H = x @ torch.linalg.matrix_power(A, v.r)
        P = torch.linalg.matrix_power(A, cfg.R - v.r - 1)
        assert est.value == pytest.approx(eps * top_sv(H) * top_sv(P), rel=1e-9)


@given(
    R=st.integers(1, 5),
    d=st.integers(2, 4),
    seed=st.integers(0, 2**16),
    form=st.sampled_from(["residual", "norm"]),
)
@example(R=1, d=3, seed=0, form="residual")
def test_kappa_lies_between_zero_and_R(R, d, seed, form):
    cfg = LinearLoopConfig(d=d, R=R, form=form)
    model = LinearLoop(cfg, generator=torch.Generator().manual_seed(seed)).double()
    x, target = randn(2, d, seed=seed), randn(2, d, seed=seed + 1)
    rep = visit_alignment(lp.attach(model), x, mse(target), method="lanczos", max_iter=40)
    assert 0.0 <= rep.kappa <= R * (1 + 1e-9)


def test_a_reference_model_with_one_round_matches_the_dense_jacobian_and_gradient_oracle():
    # At R = 1, kappa = 1 by construction; what can be wrong is each visit's U and G norm.
    model = tiny_gpt(R=1)
    # kappa does not need a lone visit's norm: each_visit=True certifies each to tol.
    rep = visit_alignment(
        lp.attach(model), IDX, lm_loss, method="lanczos", max_iter=80, each_visit=True
    )
    assert rep.M == rep.M_g == 4
    names = list(rep.visits.sublayer)
    J = dense_blocks(model, IDX, [f"{n}." for n in names])
    params = dict(model.named_parameters())
    grads = dict(
        zip(
            params,
            torch.autograd.grad(lm_loss(model(IDX), IDX), list(params.values())),
            strict=True,
        )
    )
    for name, block, row in zip(names, J, rep.visits.itertuples(), strict=True):
        G = torch.cat([g.reshape(-1) for n, g in grads.items() if n.startswith(f"{name}.")])
        assert row.U_norm == pytest.approx(top_sv(block), rel=1e-8)
        assert row.U_lo <= top_sv(block) <= row.U_hi <= row.U_norm * (1 + 1e-6)
        assert row.G_norm == pytest.approx(float(G.norm()), rel=1e-10)


def test_gram_and_cosine_matrices_explain_the_tied_update():
    model = make(SharedBlockModel, R=4)
    x, target = randn(3, 6), randn(3, 3, seed=7)
    rep = visit_alignment(lp.attach(model), x, mse(target), max_iter=20)
    gram, cos = rep.gram_G["block"], rep.cos_G["block"]
    assert gram.shape == (4, 4) and rep.gram_UTw["block"].shape == (4, 4)
    tied = rep.sublayers.set_index("sublayer").loc["block", "G_tied"]
    assert float(gram.sum()) == pytest.approx(tied**2, rel=1e-12)
    torch.testing.assert_close(cos.diagonal(), torch.ones(4, dtype=cos.dtype))
    assert rep.sublayers.cos_G_adjacent[0] == pytest.approx(float(cos.diagonal(1).mean()))


def test_report_frames_have_one_row_per_visit_and_per_sublayer():
    model = make(TruncatedModel, C=3, C_L=2)
    x, target = randn(3, 6), randn(3, 6, seed=7)
    rep = lp.visit_alignment(lp.attach(model), x, mse(target), max_iter=30)
    assert (rep.M, rep.M_g) == (9, 3)
    assert len(rep.visits) == 9 and list(rep.sublayers.sublayer) == ["low", "high"]
    assert list(rep.sublayers.R_g) == [2, 1]
    assert rep.sublayers.kappa[1] == 1.0  # one gradient-visible visit of "high"
    assert rep.visits.U_norm[~rep.visits.grad_visible].isna().all()
    frame = rep.to_frame()
    assert len(frame) == 9 and {"kappa", "U_norm", "G_norm", "converged"} <= set(frame.columns)
    assert rep.update.startswith("sgd")


def test_visit_kappa_validates_its_input_and_returns_nan_for_zero_maxima():
    assert math.isnan(visit_kappa(0.0, 0.0, [0.0, 0.0], [1.0, 1.0]))
    assert visit_kappa(2.0, 2.0, [1.0, 1.0], [1.0, 1.0]) == 2.0
    with pytest.raises(ValueError, match="one U and one G norm per visit"):
        visit_kappa(1.0, 1.0, [1.0], [1.0, 2.0])


def test_bound_check_first_order_change_matches_the_finite_change_for_a_small_step():
    model = tiny_gpt(R=2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    snap = {n: (p.detach().clone(), p.grad.clone()) for n, p in model.named_parameters()}
    chk = bound_check(lp.attach(model), IDX, lm_loss, lr=1e-4, max_iter=10)
    assert chk.dF_first == pytest.approx(chk.dF_true, rel=1e-3)
    expected = chk.M_g * chk.kappa * (model.cfg.beta / model.cfg.alpha) ** 2
    assert chk.prediction == pytest.approx(expected, rel=1e-12)
    assert chk.C == pytest.approx(chk.dF_true / expected, rel=1e-12)
    for n, p in model.named_parameters():  # the step was taken on clones
        assert torch.equal(p, snap[n][0]) and torch.equal(p.grad, snap[n][1])


def test_bound_check_scope_all_also_moves_embeddings_and_head():
    model = tiny_gpt(R=2)
    probe = lp.attach(model)
    looped = bound_check(probe, IDX, lm_loss, lr=1e-2, max_iter=5)
    every = bound_check(probe, IDX, lm_loss, lr=1e-2, scope="all", report=looped.report)
    assert every.dF_true > looped.dF_true
    assert every.kappa == looped.kappa


def test_bound_check_needs_alpha_and_beta_when_the_model_has_no_config():
    model = make(SharedBlockModel)
    x, target = randn(2, 6), randn(2, 3, seed=7)
    with pytest.raises(ValueError, match="pass alpha= and beta="):
        bound_check(lp.attach(model), x, mse(target))
    chk = bound_check(lp.attach(model), x, mse(target), alpha=1.0, beta=1.0, max_iter=5)
    assert chk.prediction == pytest.approx(4 * chk.kappa)


def test_bound_sweep_returns_one_row_per_R_and_the_fitted_slopes():
    sweep = bound_sweep(lambda R: tiny_gpt(R), [1, 2, 4], IDX, lm_loss, lr=1e-2, max_iter=5)
    frame = sweep.to_frame()
    assert list(frame.R) == [1, 2, 4] and list(frame.M) == [4, 8, 16]
    assert math.isfinite(sweep.slope) and math.isfinite(sweep.slope_first)
    assert sweep.C_ratio == pytest.approx(frame.C.max() / frame.C.min(), rel=1e-12)
    assert abs(sweep.slope) < 0.5  # DeepLoop at init: the change does not grow with R


class NanGradient(nn.Module):
    """Finite forward, but the backward through visit r=1 produces inf/NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for r in range(3):
            x = self.lin(x)
            if r == 1:
                x = x + torch.sqrt(x - x.detach())  # value + 0, gradient inf
        return x


def test_non_finite_gradient_names_the_visit_where_it_appears():
    model = make(NanGradient)
    with pytest.raises(FloatingPointError, match=r"visit r=1 of sublayer 'lin'"):
        lp.visit_alignment(lp.attach(model), randn(2, 4), lambda out, _: out.sum())


def test_exception_mid_probe_leaves_model_hooks_and_mode_as_they_were():
    model = make(ForLoopModel).train()
    params = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}

    def bad_loss(out, inputs):
        raise KeyError("loss failed")

    with pytest.raises(KeyError, match="loss failed"):
        lp.visit_alignment(lp.attach(model), randn(2, 5), bad_loss)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    assert model.training
    for n, p in model.named_parameters():
        assert p is params[n][0] and torch.equal(p, params[n][1])


def test_low_memory_alignment_gives_the_same_kappa_without_G_gram_matrices():
    model = make(SharedBlockModel, R=3)
    x, target = randn(3, 6), randn(3, 3, seed=7)
    probe = lp.attach(model)
    full = visit_alignment(probe, x, mse(target), max_iter=10)
    low = visit_alignment(probe, x, mse(target), max_iter=10, memory="low")
    assert low.kappa == pytest.approx(full.kappa, rel=1e-12)
    assert low.gram_G == {} and "block" in low.gram_UTw


def test_kappa_bar_is_the_visit_weighted_mean_of_kappa_j_and_at_most_kappa_R():
    model = make(TruncatedModel, C=2, C_L=3)
    x, target = randn(3, 6), randn(3, 6, seed=7)
    rep = visit_alignment(lp.attach(model), x, mse(target), max_iter=20)
    sub = rep.sublayers
    assert rep.kappa_bar == pytest.approx(float((sub.R_g * sub.kappa).sum()) / rep.M_g)
    assert rep.kappa_bar <= rep.kappa


@pytest.mark.slow  # the reference ladder R 1..16 under two norms
def test_acceptance_deepnorm_change_grows_like_R_deeploop_stays_flat_C_within_factor_two():
    # LoopedGPT at init, K=2, R in {1,...,16}, one SGD step (seed 002, Eq. 13-16).
    def sweep(norm):
        def factory(R):
            cfg = GPTConfig(vocab_size=16, seq_len=8, d_model=16, n_heads=2, K=2, R=R, norm=norm)
            return LoopedGPT(cfg, generator=torch.Generator().manual_seed(0)).double()

        return bound_sweep(
            factory, [1, 2, 4, 8, 16], IDX, lm_loss, lr=1e-2, method="lanczos", max_iter=8
        )

    deepnorm, deeploop = sweep("deepnorm"), sweep("deeploop")
    assert deepnorm.slope == pytest.approx(1.0, abs=0.15)
    assert deeploop.slope == pytest.approx(0.0, abs=0.15)
    assert deepnorm.C_ratio < 2.0 and deeploop.C_ratio < 2.0


class BatchNormLoop(nn.Module):
    """A looped block with BatchNorm in train mode: every forward updates running stats."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = self.bn(torch.tanh(self.lin(x)))
        return x


def test_probing_a_train_mode_batchnorm_model_leaves_its_running_stats_unchanged():
    model = make(BatchNormLoop).train()
    x, target = randn(5, 4), randn(5, 4, seed=7)
    stats = {n: b.clone() for n, b in model.named_buffers()}
    probe = lp.attach(model, sublayers=["lin"])
    chk = lp.bound_check(probe, x, mse(target), alpha=1.0, beta=1.0, max_iter=5)
    assert chk.M == 3 and math.isfinite(chk.C)
    for n, b in model.named_buffers():
        assert torch.equal(b, stats[n]), n
