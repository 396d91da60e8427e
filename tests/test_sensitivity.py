"""||U_{r,j}|| and ||sum_r U_{r,j}|| against dense jacrev Jacobians of untied twins (float64)."""

from __future__ import annotations

import pytest
import torch
from thirdparty_models import (
    AlbertModel,
    DropoutLoopModel,
    ForLoopModel,
    HaltingModel,
    MLPBlock,
    SharedBlockModel,
    TruncatedModel,
    make,
    randn,
)
from torch import nn
from torch.func import functional_call, jacrev

import loopprobe as lp
from loopprobe.estimate.sensitivity import sensitivity_norms

REL = 1e-6


def dense_blocks(model: nn.Module, x: torch.Tensor, prefixes: list[str]) -> list[torch.Tensor]:
    """Dense d(F)/d(params under each prefix) of ``model`` at ``x`` (the brute-force twin)."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    J = jacrev(lambda ps: functional_call(model, ps, (x,)).reshape(-1))(params)
    return [
        torch.cat([J[n].reshape(J[n].shape[0], -1) for n in params if n.startswith(pre)], 1)
        for pre in prefixes
    ]


def top_sv(A: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(A, 2))


def assert_matches(sens, blocks_by_visit, tied_blocks):
    for v, est in zip(sens.visits, sens.visit_norms, strict=True):
        assert est.converged
        assert est.value == pytest.approx(top_sv(blocks_by_visit[v.i]), rel=REL)
    for j, blocks in tied_blocks.items():
        assert sens.tied_norms[j].value == pytest.approx(top_sv(sum(blocks)), rel=REL)


def test_for_loop_visit_and_tied_norms_match_the_top_singular_value_of_dense_jacobians():
    model = make(ForLoopModel, K=2, R=3)
    x = randn(3, 5)
    sens = sensitivity_norms(lp.attach(model), x, method="lanczos", max_iter=80, tol=1e-12)
    blocks = dense_blocks(model.untied(), x, [f"steps.{i}." for i in range(6)])
    assert_matches(sens, blocks, {j: blocks[j::2] for j in range(2)})


def test_albert_tying_norms_match_dense_jacobians_of_the_untied_copy():
    model = make(AlbertModel, R=3)
    x = randn(3, 6)
    sens = sensitivity_norms(lp.attach(model), x, max_iter=1000, tol=1e-14)
    blocks = dense_blocks(model.untied(), x, [f"layers.{r}.mix." for r in range(3)])
    assert_matches(sens, blocks, {0: blocks})


def test_power_iteration_and_lanczos_both_match_dense_svd():
    model = make(SharedBlockModel, R=3)
    x = randn(2, 6)
    probe = lp.attach(model)
    blocks = dense_blocks(model.untied(), x, [f"steps.{i}." for i in range(3)])
    power = sensitivity_norms(probe, x, method="power", max_iter=1000, tol=1e-14)
    lan = sensitivity_norms(probe, x, method="lanczos", max_iter=80, tol=1e-12)
    assert_matches(power, blocks, {0: blocks})
    assert_matches(lan, blocks, {0: blocks})
    assert all(e.method == "lanczos" for e in lan.visit_norms)
    assert max(e.iterations for e in lan.visit_norms) < max(e.iterations for e in power.visit_norms)


def test_chunked_batching_gives_the_same_estimates():
    model = make(SharedBlockModel, R=3)
    x = randn(2, 6)
    probe = lp.attach(model)
    a = sensitivity_norms(probe, x, max_iter=30)
    b = sensitivity_norms(probe, x, max_iter=30, chunk_size=2)
    for ea, eb in zip(a.visit_norms, b.visit_norms, strict=True):
        assert ea.value == pytest.approx(eb.value, rel=1e-12)


def test_non_convergence_is_reported_not_hidden():
    model = make(ForLoopModel, K=2, R=3)
    sens = sensitivity_norms(lp.attach(model), randn(3, 5), max_iter=2, tol=1e-14)
    assert not any(e.converged for e in sens.visit_norms)
    assert all(e.iterations == 2 and e.rel_change > 1e-14 for e in sens.visit_norms)
    frame = sens.to_frame()
    assert list(frame.columns[:5]) == ["sublayer", "j", "r", "i", "module"]
    assert not frame.converged.any()


def test_only_gradient_visible_visits_of_truncated_cycles_get_operators():
    model = make(TruncatedModel, C=3, C_L=2)
    sens = sensitivity_norms(lp.attach(model), randn(2, 6), max_iter=200)
    assert [(v.sublayer, v.r) for v in sens.visits] == [("low", 4), ("low", 5), ("high", 2)]
    # One visit of "high": its tied map is the visit map, the same estimate.
    assert sens.tied_norms[1] is sens.visit_norms[2]


def test_data_dependent_halting_is_evaluated_once_unbatched_and_works():
    model = make(HaltingModel, max_steps=12, threshold=1.5)
    sens = sensitivity_norms(lp.attach(model, sublayers=["step"]), randn(2, 6), max_iter=300)
    assert len(sens.visits) >= 2
    assert all(e.converged and e.value > 0 for e in sens.visit_norms)


def test_dropout_uses_one_sample_for_every_derivative_of_an_estimate():
    model = make(DropoutLoopModel, R=3).train()
    x = randn(3, 6)
    state = torch.random.get_rng_state()
    sens = sensitivity_norms(lp.attach(model), x, method="lanczos", max_iter=80, seed=5)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's RNG is untouched
    with torch.random.fork_rng():
        torch.manual_seed(5)
        twin = model.untied()  # same dropout draws in the same order
        blocks = dense_blocks(twin, x, [f"steps.{2 * i}." for i in range(3)])
    assert_matches(sens, blocks, {0: blocks})


#: A generator at module level, owned by no module: probing cannot put it back.
NOISE = torch.Generator().manual_seed(0)


class UncontrolledNoise(nn.Module):
    """Randomness from a generator no module owns: the seed cannot make evaluations agree."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            mask = torch.rand(x.shape, generator=NOISE, dtype=x.dtype) > 0.5
            x = self.lin(x) * mask
        return x


def test_randomness_the_seed_cannot_control_is_refused_with_a_clear_error():
    model = make(UncontrolledNoise)
    with pytest.raises(RuntimeError, match="JVP and VJP .* disagree|different path"):
        sensitivity_norms(lp.attach(model), randn(2, 4), max_iter=20)


class OwnNoise(nn.Module):
    """Randomness from a generator the module owns (``self.gen``): put back with the model
    before every evaluation, so the norms are those of the masks its state draws next."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.gen = torch.Generator().manual_seed(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            mask = torch.rand(x.shape, generator=self.gen, dtype=x.dtype) > 0.5
            x = self.lin(x) * mask
        return x


def test_a_module_owned_generator_gives_the_norm_of_its_next_draw_and_is_not_advanced():
    model, x = make(OwnNoise), randn(2, 4)
    state = model.gen.get_state()
    sens = sensitivity_norms(lp.attach(model), x, max_iter=40, tol=1e-12)
    assert torch.equal(model.gen.get_state(), state) and sens.converged, sens.reason

    def F(params):
        model.gen.set_state(state)
        return functional_call(model, params, (x,)).reshape(-1)

    J = jacrev(F)({n: p.detach() for n, p in model.named_parameters()})
    model.gen.set_state(state)
    tied = torch.cat([J[n].reshape(J[n].shape[0], -1) for n in ("lin.weight", "lin.bias")], 1)
    assert sens.tied_norms[0].value == pytest.approx(top_sv(tied), rel=1e-9)


def test_output_selects_F():
    model = make(SharedBlockModel, R=2)
    x = randn(2, 6)
    full = sensitivity_norms(lp.attach(model), x, max_iter=300)
    part = sensitivity_norms(lp.attach(model), x, output=lambda out: out[:, :1], max_iter=300)
    assert part.F_norm < full.F_norm
    assert all(
        p.value <= f.value * (1 + 1e-9)
        for p, f in zip(part.visit_norms, full.visit_norms, strict=True)
    )


def test_krylov_operator_norm_matches_svd_on_matrices_with_nearly_equal_top_values():
    g = torch.Generator().manual_seed(0)
    A = torch.randn(4, 30, 20, generator=g, dtype=torch.float64)
    U, S, Vh = torch.linalg.svd(A, full_matrices=False)
    S[:, 1] = S[:, 0] * (1 - 1e-4)
    A = U @ torch.diag_embed(S) @ Vh
    v0 = torch.randn(4, 20, generator=g, dtype=torch.float64)

    def mv(v):
        return torch.einsum("bmn,bn->bm", A, v)

    def rmv(u):
        return torch.einsum("bmn,bm->bn", A, u)

    kry = lp.linalg.operator_norm_krylov(mv, rmv, v0, max_iter=40, tol=1e-12)
    power = lp.linalg.operator_norm(mv, rmv, v0, max_iter=40, tol=1e-12)
    for k in range(4):
        assert kry[k].converged and kry[k].method == "lanczos"
        assert kry[k].value == pytest.approx(float(S[k, 0]), rel=1e-12)
        assert not power[k].converged  # the power method cannot separate them in 40 steps


def test_visit_by_visit_loop_gives_the_same_estimates_as_the_batched_run():
    model = make(SharedBlockModel, R=3)
    x = randn(2, 6)
    probe = lp.attach(model)
    batched = sensitivity_norms(probe, x, max_iter=15)
    looped = sensitivity_norms(probe, x, max_iter=15, chunk_size=0)
    for a, b in zip(batched.visit_norms, looped.visit_norms, strict=True):
        assert a.value == pytest.approx(b.value, rel=1e-12)


def test_non_finite_output_names_the_first_visit_where_it_appears():
    class Overflow(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(4):
                x = self.lin(x) * 1e160
            return x

    with pytest.raises(FloatingPointError, match=r"visit r=2 of sublayer 'lin'"):
        sensitivity_norms(lp.attach(make(Overflow)), randn(2, 4), visits=None)


def test_a_warm_start_from_the_exact_answer_converges_in_at_most_three_iterations():
    model = make(ForLoopModel, K=2, R=3)
    x = randn(3, 5)
    probe = lp.attach(model)
    cold = sensitivity_norms(probe, x, method="lanczos", max_iter=80)
    warm = sensitivity_norms(probe, x, method="lanczos", max_iter=80, start=cold)
    blocks = dense_blocks(model.untied(), x, [f"steps.{i}." for i in range(6)])
    assert_matches(warm, blocks, {j: blocks[j::2] for j in range(2)})
    for a, b in zip(cold.visit_norms, warm.visit_norms, strict=True):
        assert b.converged and b.iterations <= 3 and b.value == pytest.approx(a.value, rel=1e-9)
    assert all(e.iterations <= 3 for e in warm.tied_norms.values())


def test_a_warm_start_after_the_model_moved_converges_to_the_new_dense_norms():
    model = make(SharedBlockModel, R=3)
    x = randn(2, 6)
    probe = lp.attach(model)
    before = sensitivity_norms(probe, x, method="power", max_iter=1000, tol=1e-14)
    with torch.no_grad():  # a "training" step: every parameter moves by ~5%
        for p in model.parameters():
            p.mul_(1 + 0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    blocks = dense_blocks(model.untied(), x, [f"steps.{i}." for i in range(3)])
    for method in ("lanczos", "power"):
        warm = sensitivity_norms(probe, x, method=method, max_iter=1000, tol=1e-14, start=before)
        assert_matches(warm, blocks, {0: blocks})


def test_visits_started_from_their_tied_vector_match_dense_svd_and_a_cold_start():
    model = make(ForLoopModel, K=2, R=3)
    x = randn(3, 5)
    probe = lp.attach(model)
    blocks = dense_blocks(model.untied(), x, [f"steps.{i}." for i in range(6)])
    warm = sensitivity_norms(probe, x, method="lanczos", max_iter=80, tol=1e-12, warm_visits=True)
    cold = sensitivity_norms(probe, x, method="lanczos", max_iter=80, tol=1e-12, warm_visits=False)
    for sens in (warm, cold):
        assert_matches(sens, blocks, {j: blocks[j::2] for j in range(2)})
    # The kept vectors are the top right singular vectors of the dense blocks.
    for v, (key, vec) in zip(warm.visits, warm.start_vectors().items(), strict=False):
        assert key == ("visit", v.i)
        top = torch.linalg.svd(blocks[v.i]).Vh[0]
        assert abs(float(vec[: top.numel()] @ top)) == pytest.approx(1, abs=1e-8)


def test_a_start_from_another_model_or_of_the_wrong_kind_is_refused():
    x = randn(2, 6)
    probe = lp.attach(make(SharedBlockModel, R=2))
    with pytest.raises(TypeError, match="start= is a list"):
        sensitivity_norms(probe, x, max_iter=5, start=[1, 2])
    with pytest.raises(ValueError, match=r"start= has shape \(2, 7\)"):
        sensitivity_norms(probe, x, max_iter=5, start=torch.zeros(2, 7))
    other = sensitivity_norms(lp.attach(make(AlbertModel, R=2)), randn(3, 6), max_iter=5)
    with pytest.raises(ValueError, match="start= vectors have length"):
        sensitivity_norms(probe, x, max_iter=5, start=other)


class NoGradAfterVisit(nn.Module):
    """A correction computed under ``no_grad`` after every visit: forward-mode tangents see
    it, the backward graph does not, so the two halves of a U product disagree."""

    def __init__(self) -> None:
        super().__init__()
        self.block = MLPBlock(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = self.block(x)
            with torch.no_grad():
                c = torch.tanh(x)
            x = x + 0.5 * c
        return x


def test_products_by_reverse_over_reverse_match_forward_mode_and_keep_the_adjoint_check():
    # issue 29.3: from the second product on U t is a backward of the backward; the first
    # stays forward mode, so a no_grad region after a visit is still refused.
    from loopprobe.differentiate.jacobian import VisitJacobian

    model = make(ForLoopModel, K=2, R=3)
    x = randn(3, 5)
    probe = lp.attach(model)
    visits = [v for v in probe.visits(x) if v.grad_visible]
    jac = VisitJacobian(probe, x, visits)
    masks = jac.masks([[0], [1, 3, 5], [2]])
    V = randn(3, jac.n_max, seed=4)
    first, second = jac.matvec(V, masks), jac.matvec(V, masks)
    assert jac._jvp2  # the second product took the reverse route
    torch.testing.assert_close(second, first, rtol=1e-12, atol=1e-14)
    with pytest.raises(RuntimeError, match="JVP and VJP .* disagree"):
        sensitivity_norms(lp.attach(make(NoGradAfterVisit)), randn(2, 4), max_iter=20)
