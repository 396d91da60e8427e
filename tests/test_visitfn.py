"""``lp.visit_function``: the output as a pure function of per-visit offsets, composed with
plain ``torch.func``, against an explicitly untied copy of the model (float64)."""

from __future__ import annotations

import pytest
import torch
from thirdparty_models import ForLoopModel, make, randn
from torch.func import functional_call, grad, jacrev

import loopprobe as lp


def untied_jacobians(model: ForLoopModel, x: torch.Tensor) -> list[torch.Tensor]:
    """Dense dF/d(params of step i) of the untied twin, one block per visit."""
    twin = model.untied()
    params = {n: p.detach() for n, p in twin.named_parameters()}
    J = jacrev(lambda ps: functional_call(twin, ps, (x,)).reshape(-1))(params)
    steps = len(twin.steps)
    return [
        torch.cat(
            [J[n].reshape(J[n].shape[0], -1) for n in params if n.startswith(f"steps.{i}.")], 1
        )
        for i in range(steps)
    ]


def test_F_at_zero_offsets_is_the_models_output_and_the_model_is_untouched():
    model = make(ForLoopModel, K=2, R=3)
    x = randn(4, 5)
    before = [p.detach().clone() for p in model.parameters()]
    F, d0 = lp.visit_function(model, x)
    assert len(F.visits) == len(d0) == 6
    torch.testing.assert_close(F(d0), model(x).reshape(-1), rtol=0, atol=0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))
    assert all(p.grad is None for p in model.parameters())


def test_torch_func_grad_of_F_gives_every_per_visit_update():
    model = make(ForLoopModel, K=2, R=3)
    x = randn(4, 5)
    F, d0 = lp.visit_function(model, x)
    G = grad(lambda d: F(d).square().mean())(d0)
    twin = model.untied()
    want = torch.autograd.grad(twin(x).square().mean(), list(twin.steps.parameters()))
    n = len(list(model.layers[0].parameters()))
    for k, v in enumerate(F.visits):
        for got, exp in zip(G[k], want[v.i * n : (v.i + 1) * n], strict=True):
            torch.testing.assert_close(got, exp, rtol=1e-12, atol=1e-14)


def test_the_dense_jacobian_of_F_per_slot_is_the_untied_models():
    model = make(ForLoopModel, K=2, R=3)
    x = randn(2, 5)
    F, d0 = lp.visit_function(model, x)
    J = jacrev(F)(d0)
    oracle = untied_jacobians(model, x)
    for k, v in enumerate(F.visits):
        mine = torch.cat([t.reshape(t.shape[0], -1) for t in J[k]], 1)
        torch.testing.assert_close(mine, oracle[v.i], rtol=1e-12, atol=1e-13)
    top = float(torch.linalg.matrix_norm(oracle[0], 2))
    est = lp.sensitivity_norms(lp.attach(model), x, tol=1e-12).visit_norms[0].value
    assert est == pytest.approx(top, rel=1e-8)


def test_F_refuses_the_wrong_number_of_offset_tuples():
    model = make(ForLoopModel, K=1, R=2)
    F, d0 = lp.visit_function(model, randn(2, 5))
    with pytest.raises(ValueError, match="one tuple of offsets per visit"):
        F(d0[:1])


def op_norm_by_jvp_vjp(F, d0, k: int, iters: int = 200) -> float:
    """The README's example: ||U_k|| by power iteration with plain torch.func.jvp / vjp."""
    t = tuple(torch.randn_like(p) for p in d0[k])
    for _ in range(iters):  # power iteration on U_k^T U_k
        tangent = tuple(
            t if i == k else tuple(map(torch.zeros_like, ps)) for i, ps in enumerate(d0)
        )
        _, u = torch.func.jvp(F, (d0,), (tangent,))  # U_k t
        t = torch.func.vjp(F, d0)[1](u)[0][k]  # U_k^T U_k t
        scale = torch.sqrt(sum(x.square().sum() for x in t))
        t = tuple(x / scale for x in t)
    return float(scale.sqrt())  # ||U_k||


def test_one_visit_norm_by_plain_jvp_and_vjp_is_the_untied_jacobians_top_singular_value():
    model = make(ForLoopModel, K=2, R=3)
    x = randn(2, 5)
    F, d0 = lp.visit_function(model, x)
    oracle = untied_jacobians(model, x)
    torch.manual_seed(0)
    for k in (0, 3):
        want = float(torch.linalg.matrix_norm(oracle[F.visits[k].i], ord=2))
        assert op_norm_by_jvp_vjp(F, d0, k) == pytest.approx(want, rel=1e-8)
