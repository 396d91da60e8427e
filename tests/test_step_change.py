"""step_change and bound_check under a real optimizer: per-visit Delta F against an untied twin."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from test_sensitivity import dense_blocks, top_sv
from thirdparty_models import (
    ForLoopModel,
    MLPBlock,
    make,
    randn,
)
from torch import nn
from torch.func import functional_call, jvp

import loopprobe as lp
from loopprobe.estimate.steps import optimizer_family, optimizer_step

X, TARGET = randn(3, 5), randn(3, 5, seed=7)


def mse(out: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    return ((out - TARGET) ** 2).sum()


def trained(steps: int = 3, **kw) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A ForLoopModel after ``steps`` AdamW steps (weight decay on): Adam's moments have history."""
    model = make(ForLoopModel, K=2, R=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **kw)
    for _ in range(steps):
        opt.zero_grad()
        mse(model(X), X).backward()
        opt.step()
    return model, opt


def twin_step(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Delta theta by name, the plain way: copy model and optimizer together, backward the loss,
    keep the gradients of the loop body only (``layers.*``), step, subtract."""
    m2, o2 = copy.deepcopy((model, opt))
    o2.zero_grad(set_to_none=True)
    mse(m2(X), X).backward()
    for n, p in m2.named_parameters():
        if not n.startswith("layers."):
            p.grad = None
    before = {n: p.detach().clone() for n, p in m2.named_parameters()}
    o2.step()
    return {n: p.detach() - before[n] for n, p in m2.named_parameters()}


def test_per_visit_changes_equal_the_untied_twins_per_copy_jvps_and_sum_to_the_tied_jvp():
    model, opt = trained()
    sc = lp.step_change(lp.attach(model), X, mse, optimizer=opt, norms=False)
    step = twin_step(model, opt)
    twin = model.untied()  # steps[i]: a private copy of the module of visit i
    names = [n.removeprefix("layers.") for n, _ in model.named_parameters() if "layers." in n]
    params = {n: p.detach() for n, p in twin.named_parameters()}
    for i in range(6):  # ForLoopModel, K=2, R=3: visit i is layers[i % 2]
        tangent = {n: torch.zeros_like(p) for n, p in params.items()}
        for n in names:
            k, rest = n.split(".", 1)
            if int(k) == i % 2:
                tangent[f"steps.{i}.{rest}"] = step[f"layers.{n}"]
        _, dF_i = jvp(lambda ps: functional_call(twin, ps, (X,)), (params,), (tangent,))
        assert torch.allclose(sc.terms[i], dF_i.reshape(-1), rtol=1e-10, atol=1e-14), i
    # the delta the library took is the real optimizer's step
    flat = torch.cat([d.reshape(-1) for d in sc.delta])
    want = torch.cat([step[n].reshape(-1) for n, _ in model.named_parameters() if "layers." in n])
    assert torch.equal(flat, want)
    full = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    full.update({n: step[n] for n in full if n.startswith("layers.")})
    mp = {n: p.detach() for n, p in model.named_parameters()}
    _, dF = jvp(lambda ps: functional_call(model, ps, (X,)), (mp,), (full,))
    assert float((sc.terms.sum(0) - dF.reshape(-1)).norm() / dF.norm()) < 1e-8
    assert sc.sum_error < 1e-8 and sc.converged, sc.reason
    assert sc.optimizer == "AdamW (step 3)"
    assert sc.visits.dF.tolist() == pytest.approx(
        [float(t.norm()) / sc.F_norm for t in sc.terms], rel=1e-12
    )


def test_the_users_model_and_optimizer_stay_bit_identical():
    model, opt = trained()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}  # left by training
    state = copy.deepcopy(opt.state_dict())
    lp.step_change(lp.attach(model), X, mse, optimizer=opt, scope="all", norms=False)
    lp.bound_check(lp.attach(model), X, mse, optimizer=opt, alpha=1.0, beta=1.0, max_iter=5)
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n]) and torch.equal(p.grad, grads[n]), n
    after = opt.state_dict()
    assert after["param_groups"] == state["param_groups"]
    for k, s in state["state"].items():
        for key, v in s.items():
            assert torch.equal(torch.as_tensor(after["state"][k][key]), torch.as_tensor(v))


def test_the_bound_is_each_sublayers_dense_tied_norm_times_its_step_and_holds():
    model, opt = trained()
    sc = lp.step_change(
        lp.attach(model), X, mse, optimizer=opt, method="lanczos", max_iter=80, tol=1e-12
    )
    twin = model.untied()
    J = dense_blocks(twin, X, [f"steps.{i}." for i in range(6)])
    for row in sc.sublayers.itertuples():
        dense = top_sv(sum(J[row.j :: 2]))
        assert row.U_tied == pytest.approx(dense, rel=1e-6)
        assert row.bound == pytest.approx(row.U_tied * row.step_norm / sc.F_norm, rel=1e-12)
        assert 0 <= row.kappa_step <= row.R + 1e-12
    assert sc.dF_first <= sc.bound
    assert sc.bound == pytest.approx(float(sc.sublayers.bound.sum()), rel=1e-12)


def test_scope_all_puts_the_parameters_outside_every_sublayer_in_the_rest_term():
    model, opt = trained()
    sc = lp.step_change(lp.attach(model), X, mse, optimizer=opt, scope="all", norms=False)
    assert sc.dF_rest > 0 and sc.sum_error < 1e-8
    looped = lp.step_change(lp.attach(model), X, mse, optimizer=opt, norms=False)
    assert looped.dF_rest == 0 and not math.isclose(looped.dF_jvp, sc.dF_jvp)


class ReadOutside(nn.Module):
    """A looped block whose first matrix is also read by the parent's forward (a tied read-out)."""

    def __init__(self, d: int = 5) -> None:
        super().__init__()
        self.block = MLPBlock(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = self.block(x)
        return x + nn.functional.linear(x, self.block.fc1.weight).sum(-1, keepdim=True)


def test_a_parameter_read_outside_the_visits_is_reported_not_converged():
    model = make(ReadOutside)
    sc = lp.step_change(lp.attach(model), X, mse, optimizer="adamw", norms=False)
    assert not sc.converged and "do not cover the stepped parameters" in sc.reason
    assert sc.sum_error > 1e-3


def test_optimizer_step_of_an_instance_equals_the_optimizers_own_step():
    for cls, kw in [(torch.optim.SGD, {"momentum": 0.9}), (torch.optim.Adagrad, {})]:
        model = make(ForLoopModel, K=2, R=3)
        opt = cls(model.parameters(), lr=1e-2, **kw)
        for _ in range(2):
            opt.zero_grad()
            mse(model(X), X).backward()
            opt.step()
        params = list(model.parameters())
        grads = torch.autograd.grad(mse(model(X), X), params)
        delta, notes = optimizer_step(params, grads, opt)
        before = [p.detach().clone() for p in params]
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()
        for d, p, b in zip(delta, params, before, strict=True):
            assert torch.equal(d, p.detach() - b)
        assert notes == []
    assert optimizer_family(opt) == "other"


def test_bound_check_with_the_training_adamw_uses_the_adam_form():
    model, opt = trained()
    chk = lp.bound_check(lp.attach(model), X, mse, optimizer=opt, alpha=2.0, beta=0.5, max_iter=30)
    rows = chk.report.sublayers
    kU = (rows.U_tied / rows.U_max).max()
    assert chk.family == "adam" and chk.optimizer == "AdamW (step 3)" and chk.lr == 1e-2
    assert chk.prediction == pytest.approx(2 * kU * 0.25, rel=1e-12)
    assert chk.prediction_sgd == pytest.approx(chk.M_g * chk.kappa * 0.25**2, rel=1e-12)
    sc = lp.step_change(lp.attach(model), X, mse, optimizer=opt, norms=False)
    assert chk.dF_first == pytest.approx(sc.dF_jvp, rel=1e-12)


def test_sgd_with_momentum_history_has_no_prediction_and_says_so():
    model = make(ForLoopModel, K=2, R=3)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    assert optimizer_family(opt) == "sgd"  # no momentum buffer yet: the first step is SGD's
    mse(model(X), X).backward()
    opt.step()
    chk = lp.bound_check(lp.attach(model), X, mse, optimizer=opt, alpha=1.0, beta=1.0, max_iter=5)
    assert chk.family == "other" and math.isnan(chk.prediction) and math.isnan(chk.C)
    assert "no prediction is derived" in chk.reason


def test_bad_optimizer_arguments_name_the_fix():
    model, opt = trained()
    probe = lp.attach(model)
    with pytest.raises(ValueError, match="step_change: lr=0.1 given with an optimizer instance"):
        lp.step_change(probe, X, mse, optimizer=opt, lr=0.1)
    with pytest.raises(TypeError, match="not a torch.optim.Optimizer"):
        lp.step_change(probe, X, mse, optimizer=torch.zeros(1))
    with pytest.raises(ValueError, match="bound_check: optimizer='lion'; choose one of"):
        lp.bound_check(probe, X, mse, optimizer="lion", alpha=1.0, beta=1.0)
    with pytest.raises(ValueError, match="step_change: scope='body'"):
        lp.step_change(probe, X, mse, scope="body")


def test_adam_forms_closed_forms_and_their_exponent_against_scales():
    from loopprobe import theory

    assert theory.adam_bound_exponent(0.25, 1.0) == 0.5  # DeepNorm aligned: sqrt(R)
    assert theory.adam_bound_exponent(0.5, 1.0) == 0.0  # DeepLoop aligned: flat
    assert theory.adam_exponent_threshold(1.0) == 0.5 == theory.exponent_threshold(1.0)
    assert theory.adam_exponent_threshold(0.0) == 0.0 < theory.exponent_threshold(0.0)
    for p in (0.25, 0.375, 0.5, 0.625):  # aligned (kappa_U = R), K = 2: slope 1 - 2p in R
        vals = [theory.adam_bound(4, R, theory.scales(2 * R, "postp", p).ratio) for R in (1, 16)]
        slope = math.log(vals[1] / vals[0]) / math.log(16)
        assert slope == pytest.approx(theory.adam_bound_exponent(p, 1.0), abs=1e-12)
    with pytest.raises(ValueError, match="adam_bound_exponent: gamma must lie in"):
        theory.adam_bound_exponent(0.5, 1.5)
    with pytest.raises(TypeError, match="adam_bound: kappa_U must be a real number"):
        theory.adam_bound(4, "R", 0.1)


# ------------------------------------------------------------- the reference ladder, AdamW

IDX = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(1))


def lm_loss(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    v = logits.shape[-1]
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, v), idx[:, 1:].reshape(-1))


def ladder_gpt(R: int, norm: str) -> nn.Module:
    from loopprobe.models import GPTConfig, LoopedGPT

    cfg = GPTConfig(vocab_size=16, seq_len=8, d_model=16, n_heads=2, K=2, R=R, norm=norm)
    return LoopedGPT(cfg, generator=torch.Generator().manual_seed(0)).double()


@pytest.mark.slow  # the reference ladder R 1..16, twice
@pytest.mark.parametrize("norm, aligned", [("deepnorm", 0.5), ("deeploop", 0.0)])
def test_acceptance_adamw_first_step_follows_the_adam_form_not_the_sgd_form(norm, aligned):
    sweep = lp.bound_sweep(
        lambda R: ladder_gpt(R, norm), [1, 4, 16], IDX, lm_loss, lr=1e-3,
        optimizer="adamw", method="lanczos", max_iter=8,
    )  # fmt: skip
    f = sweep.frame
    assert (f.family == "adam").all()
    assert sweep.slope == pytest.approx(sweep.slope_prediction, abs=0.15)
    assert sweep.slope_prediction == pytest.approx(aligned, abs=0.1)  # kappa_U ~ R at init
    assert sweep.C_ratio < 2.0
    sgd_C = f.dF_true / f.prediction_sgd  # the SGD form judging the same Adam steps
    if norm == "deepnorm":
        assert sgd_C.max() / sgd_C.min() > 2.0


def test_along_adamw_training_the_read_side_stays_exact_and_the_bound_holds():
    # The Adam *form* breaks along training (docs/results/tied-bound.md: v_hat's history
    # shrinks the step and kappa_U stops tracking the step's alignment); the read side and
    # the optimizer-free bound must hold at every step whatever the optimizer's state.
    gen = torch.Generator().manual_seed(5)
    data = [torch.randint(0, 16, (2, 8), generator=gen) for _ in range(4)]
    model = ladder_gpt(4, "deeploop")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    for t in range(30):
        opt.zero_grad()
        lm_loss(model(data[t % 4]), data[t % 4]).backward()
        opt.step()
    sc = lp.step_change(lp.attach(model), IDX, lm_loss, optimizer=opt, max_iter=40)
    assert sc.converged, sc.reason
    assert sc.sum_error < 1e-8 and sc.dF_first <= sc.bound
    assert sc.dF_first == pytest.approx(sc.dF_true, rel=0.05)  # lr 1e-3: first order
    rms = sc.step_norm / (sum(d.numel() for d in sc.delta) ** 0.5 * 1e-3)
    assert 0 < rms < 1.0  # with history the step is below lr per coordinate (A2 at step one)


def test_health_on_an_adamw_trained_model_states_its_bound_under_adamw():
    model = ladder_gpt(4, "deepnorm")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    for _ in range(3):
        opt.zero_grad()
        lm_loss(model(IDX), IDX).backward()
        opt.step()
    loss = lambda out, x: lm_loss(out, x)  # noqa: E731
    h = lp.health(model, IDX, loss_fn=loss, optimizer=opt, max_iter=30, progress=False)
    sgd = lp.health(model, IDX, loss_fn=loss, max_iter=30, progress=False)
    row = h.frame.set_index("check").loc["bound"]
    rep = lp.visit_alignment(lp.attach(model), IDX, loss, max_iter=30)
    body = rep.sublayers
    kU = float((body.U_tied / body.U_max).max())
    ratio = model.cfg.beta / model.cfg.alpha
    assert h.values["optimizer"] == "AdamW (step 3)" and "AdamW (step 3)" in row.claim
    assert row.value == pytest.approx(len(body) * kU * ratio, rel=1e-6)
    assert h.values["bound_form"] == "J_g κ^U_R (β/α)"
    # kappa_U b/a ~ 3.9 x 0.177 ~ 0.7 <= 1: fine; SGD: M_g kappa_R (b/a)^2 ~ 16 x 3.9/32: risk
    assert row.reading == "fine" and sgd.frame.set_index("check").loc["bound"].reading == "risk"
    scaling = h.frame.set_index("check").loc["scaling"]
    assert "γ_U/2" in scaling.predicted and "at N = 8" in scaling.advice  # M_g / 2 = 16 / 2
    assert scaling.value == pytest.approx(sgd.frame.set_index("check").loc["scaling"].value)
    with pytest.raises(ValueError, match="health: optimizer='lamb'"):
        lp.health(model, IDX, loss_fn=loss, optimizer="lamb", progress=False)
