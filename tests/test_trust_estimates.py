"""No wrong number is reported as valid: G, kappa, the bound check and operator norms check
their own invariants on every call (issue 24, cases 7 and 8)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from thirdparty_models import ForLoopModel, make, randn
from torch import nn

import loopprobe as lp
from loopprobe.estimate import sensitivity
from loopprobe.estimate.sensitivity import choose_method, lanczos_basis, lanczos_group
from loopprobe.linalg import operator_norm, operator_norm_krylov

# --------------------------------------------------------------------------- case 7


class TiedReadout(nn.Module):
    """Third-party style: the looped block's weight is also the read-out (``F.linear``)."""

    def __init__(self, d: int = 6, R: int = 3) -> None:
        super().__init__()
        self.R, self.inp, self.block = R, nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for _ in range(self.R):
            h = h + torch.tanh(self.block(h))
        return F.linear(h, self.block.weight)


class ParentReadsBias(nn.Module):
    """The parent's forward reads the looped block's bias directly, with no module call."""

    def __init__(self, d: int = 6, R: int = 3) -> None:
        super().__init__()
        self.R, self.block, self.out = R, nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for _ in range(self.R):
            h = torch.tanh(self.block(h)) + 0.5 * self.block.bias
        return self.out(h)


def mse(target: torch.Tensor):
    return lambda out, inputs: ((out - target) ** 2).sum()


def tied_gradient(model: nn.Module, x: torch.Tensor, loss) -> torch.Tensor:
    grads = torch.autograd.grad(loss(model(x), x), list(model.block.parameters()))
    return torch.cat([g.reshape(-1) for g in grads])


@pytest.mark.parametrize("memory", ["full", "low"])
def test_the_in_place_backward_and_the_hooked_one_give_the_same_G_and_leave_grads(memory):
    # a parameter with a hook of its own takes the hooked path (a backward into it would run
    # the hook); the fast path sets its .grad to a view for one backward and puts it back
    model = make(TiedReadout)
    x, target = randn(4, 6), randn(4, 6, seed=7)
    mine = torch.full_like(model.block.weight, 3.0)
    model.block.weight.grad = mine
    probe = lp.attach(model, sublayers=["block"])
    fast = lp.per_visit_updates(probe, x, mse(target), memory=memory)
    assert model.block.weight.grad is mine and bool((mine == 3.0).all())
    assert model.block.bias.grad is None
    calls = []
    handle = model.block.weight.register_hook(lambda g: calls.append(1))
    try:
        probe = lp.attach(model, sublayers=["block"])
        hooked = lp.per_visit_updates(probe, x, mse(target), memory=memory)
    finally:
        handle.remove()
    assert calls  # the hooked path ran
    assert model.block.weight.grad is mine and bool((mine == 3.0).all())
    assert hooked.outside_share[0] == pytest.approx(fast.outside_share[0], rel=1e-12)
    assert torch.allclose(hooked.tied(0), fast.tied(0), rtol=1e-12, atol=0)
    assert torch.allclose(hooked.norms(0), fast.norms(0), rtol=1e-12, atol=0)
    if memory == "full":
        assert torch.allclose(hooked.G[0], fast.G[0], rtol=1e-12, atol=0)


@pytest.mark.parametrize("memory", ["full", "low"])
@pytest.mark.parametrize("cls", [TiedReadout, ParentReadsBias])
def test_a_weight_read_outside_its_module_makes_G_not_converged_with_the_missing_share(cls, memory):
    model = make(cls)
    x, target = randn(4, 6), randn(4, 6, seed=7)
    ups = lp.per_visit_updates(lp.attach(model, sublayers=["block"]), x, mse(target), memory=memory)
    true = tied_gradient(model, x, mse(target))
    missing = float((true - ups.tied(0)).norm() / true.norm())
    assert missing > 0.05  # the toy: a real share, not roundoff
    assert not ups.converged
    assert ups.outside_share[0] == pytest.approx(missing, rel=1e-10)
    assert "'block'" in ups.reason and f"{missing:.3g}" in ups.reason


def test_fresh_adam_with_an_outside_read_uses_the_true_tied_gradient_and_reports_its_miss():
    model = make(TiedReadout)
    x, target = randn(4, 6), randn(4, 6, seed=7)
    ups = lp.per_visit_updates(lp.attach(model, sublayers=["block"]), x, mse(target), update="adam")
    twin = copy.deepcopy(model)
    opt = torch.optim.Adam(twin.parameters(), lr=1e-3)
    mse(target)(twin(x), x).backward()
    before = [p.detach().clone() for p in twin.block.parameters()]
    opt.step()
    after = twin.block.parameters()
    step = torch.cat(
        [((b - p.detach()) / 1e-3).reshape(-1) for b, p in zip(before, after, strict=True)]
    )
    missing = float((step - ups.tied(0)).norm() / step.norm())
    assert not ups.converged
    assert ups.outside_share[0] == pytest.approx(missing, rel=1e-6)


@pytest.mark.parametrize("update", ["sgd", "adam"])
@pytest.mark.parametrize("memory", ["full", "low"])
def test_a_model_that_reads_its_weights_only_inside_visits_misses_exactly_nothing(memory, update):
    model = make(ForLoopModel)
    x, target = randn(4, 5), randn(4, 5, seed=7)
    ups = lp.per_visit_updates(lp.attach(model), x, mse(target), memory=memory, update=update)
    assert ups.converged, ups.reason
    assert ups.outside_share == [0.0] * len(ups.sublayers)


def test_alignment_and_bound_check_are_not_converged_when_G_misses_part_of_the_tied_gradient():
    model = make(TiedReadout)
    x, target = randn(4, 6), randn(4, 6, seed=7)
    probe = lp.attach(model, sublayers=["block"])
    rep = lp.visit_alignment(probe, x, mse(target))
    assert not rep.converged and "differs from the tied update of sublayer 'block'" in rep.reason
    assert rep.sublayers.G_outside_share[0] > 0.05
    chk = lp.bound_check(probe, x, mse(target), alpha=1.0, beta=1.0, report=rep)
    assert not chk.converged and "'block'" in chk.reason


def test_a_frozen_parameter_is_named_as_not_checked():
    model = make(ForLoopModel)
    model.layers[0].fc1.bias.requires_grad_(False)
    x, target = randn(4, 5), randn(4, 5, seed=7)
    ups = lp.per_visit_updates(lp.attach(model), x, mse(target))
    assert ups.converged
    assert "not checked" in ups.reason and "fc1.bias" in ups.reason


# --------------------------------------------------------------------------- case 8


def planted(gap: float, n: int = 60, seed: int = 0) -> torch.Tensor:
    """A matrix with top singular values 1 and 1 - gap, the rest in [0.1, 0.5]."""
    g = torch.Generator().manual_seed(seed)
    Q1, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    Q2, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    s = torch.linspace(0.5, 0.1, n, dtype=torch.float64)
    s[0], s[1] = 1.0, 1.0 - gap
    return Q1 @ torch.diag(s) @ Q2.T


def products(A: torch.Tensor):
    return (lambda v, idx=None: v @ A.T), (lambda u, idx=None: u @ A)


def start(n: int, B: int = 1, seed: int = 1) -> torch.Tensor:
    return torch.randn(B, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_power_iteration_that_stalls_on_a_tiny_gap_is_not_reported_converged():
    A = planted(gap=1e-5)
    est = operator_norm(*products(A), start(60), max_iter=100, tol=1e-10)[0]
    # The relative change fell below 1e-10 after 11 steps (the old rule stopped there,
    # converged, 3.8e-7 off); the residual certificate does not hold.
    assert est.rel_change < 1e-10
    assert not est.converged and est.residual > 1e-6
    # The certificate is honest: sigma^2 lies within residual * sigma^2 of an eigenvalue.
    ev = torch.linalg.svdvals(A).square()
    assert float((ev - est.value**2).abs().min()) <= est.residual * est.value**2


def test_power_iteration_converges_with_its_certificate_on_a_separated_top_value():
    A = planted(gap=0.3)
    est = operator_norm(*products(A), start(60), max_iter=200, tol=1e-10)[0]
    assert est.converged and est.residual <= 1e-6
    assert est.value == pytest.approx(1.0, rel=1e-10)


@pytest.mark.parametrize("gap", [1e-2, 1e-5])
def test_lanczos_with_a_capped_basis_restarts_and_matches_the_uncapped_answer(gap):
    A = planted(gap=gap)
    v0 = start(60, B=3)
    full = operator_norm_krylov(*products(A), v0, max_iter=60, tol=1e-8)
    out = torch.empty_like(v0)
    capped = operator_norm_krylov(*products(A), v0, max_iter=60, tol=1e-8, basis=8, out=out)
    assert all(e.converged for e in capped) and all(e.iterations > 8 for e in capped)
    assert [e.value for e in capped] == pytest.approx([e.value for e in full], rel=1e-10)
    assert all(e.residual < 1e-8 for e in capped)
    top = torch.linalg.svd(A).Vh[0]  # the vectors handed back are the top singular vector
    assert (out @ top).abs().tolist() == pytest.approx([1.0] * 3, abs=1e-3)


def test_auto_uses_lanczos_at_every_size_with_a_capped_basis_where_it_would_not_fit():
    assert choose_method(10_000_000, 100, torch.float64) == "lanczos"  # 8 GB uncapped
    assert lanczos_basis(10_000_000, 100, torch.float64) == 13  # 13 x 80 MB < 1 GiB
    assert lanczos_basis(10_000, 100, torch.float64) == 100
    assert lanczos_group(20, 10_000_000, 100, torch.float64) == 1


def test_sensitivity_over_the_memory_cap_restarts_lanczos_and_gives_the_uncapped_norms(
    monkeypatch,
):
    model, x = make(ForLoopModel), randn(4, 5)
    one = lp.sensitivity_norms(lp.attach(model), x, tol=1e-9)
    probe = lp.attach(model)
    n_max = max(g.sublayer.numel for g in probe.groups(x))
    monkeypatch.setattr(sensitivity, "LANCZOS_BYTES", 10 * n_max * 8)  # 10 of 100 vectors
    capped = lp.sensitivity_norms(probe, x, tol=1e-9)
    assert capped.method == "lanczos" and capped.basis == 10 and one.basis == 100
    a = [*one.visit_norms, *one.tied_norms.values()]
    b = [*capped.visit_norms, *capped.tied_norms.values()]
    assert capped.converged, capped.reason
    assert max(e.iterations for e in b) > 10  # some operator did restart
    assert [e.value for e in b] == pytest.approx([e.value for e in a], rel=1e-10)


def test_an_invariant_failure_found_while_evaluating_F_makes_the_result_not_converged(
    monkeypatch,
):
    class Broken(sensitivity.VisitJacobian):  # a failed check that no evaluation clears
        problems = property(
            lambda self: ["F at zero offsets differs from the model's output by 0.3"],
            lambda self, value: None,
        )

    monkeypatch.setattr(sensitivity, "VisitJacobian", Broken)
    model = make(ForLoopModel)
    x, target = randn(4, 5), randn(4, 5, seed=7)
    sens = lp.sensitivity_norms(lp.attach(model), x)
    assert all(e.converged for e in sens.visit_norms)
    assert not sens.converged and "differs from the model's output" in sens.reason
    rep = lp.visit_alignment(lp.attach(model), x, mse(target))
    assert not rep.converged and "differs from the model's output" in rep.reason


class SparseEmbeddingLoop(nn.Module):
    """A sparse-gradient embedding read at every round, as recommender-style code does."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.lin = nn.Embedding(10, 4, sparse=True), nn.Linear(4, 4)

    def forward(self, i: torch.Tensor) -> torch.Tensor:
        h = self.emb(i)
        for _ in range(3):
            h = self.lin(h) + self.emb(i)
        return h


def test_a_sparse_embedding_sublayer_gets_the_same_G_in_both_memory_modes():
    model = make(SparseEmbeddingLoop)
    i, loss = torch.tensor([[1, 2, 3]]), lambda out, _: out.square().sum()
    full = lp.per_visit_updates(lp.attach(model), i, loss)
    low = lp.per_visit_updates(lp.attach(model), i, loss, memory="low")
    assert full.converged and low.converged
    grads = torch.autograd.grad(loss(model(i), i), [model.emb.weight])
    torch.testing.assert_close(full.tied(0), grads[0].to_dense().reshape(-1))
    for a, b in zip(full.G_norms, low.G_norms, strict=True):
        torch.testing.assert_close(a, b)
