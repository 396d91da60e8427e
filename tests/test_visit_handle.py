"""``lp.visit(probe, sublayer, r, inputs)``: one visit's input, output, U and G, against the
library's own functions and against an explicitly untied copy of the model (float64)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from thirdparty_models import AlbertModel, ForLoopModel, make, randn
from torch.func import functional_call, jacrev

import loopprobe as lp


def loss_fn(out, _inputs):
    return out.square().mean()


@pytest.fixture(scope="module")
def loop():
    model = make(ForLoopModel, K=2, R=3)
    return model, randn(2, 5)


def untied_step_jacobian(model: ForLoopModel, x: torch.Tensor, i: int) -> torch.Tensor:
    """Dense dF/d(params of step i) of the untied twin: the oracle for U of visit i."""
    twin = model.untied()
    params = {n: p.detach() for n, p in twin.named_parameters()}
    J = jacrev(lambda ps: functional_call(twin, ps, (x,)).reshape(-1))(params)
    return torch.cat(
        [J[n].reshape(J[n].shape[0], -1) for n in params if n.startswith(f"steps.{i}.")], 1
    )


def test_the_handle_gives_the_recorded_input_and_output_of_that_visit(loop):
    model, x = loop
    probe = lp.attach(model)
    rec = probe.record(x)
    for r in range(3):
        v = lp.visit(probe, "layers.1", r, x)
        want = [t for t in rec.visits if t.sublayer == "layers.1"][r]
        assert (v.visit.r, v.visit.i, v.visit.module) == (r, want.i, "layers.1")
        torch.testing.assert_close(v.output, want.output, rtol=0, atol=0)
        torch.testing.assert_close(v.input, want.args[0], rtol=0, atol=0)
    twin = model.untied()  # independent: the untied model's step 3 is visit (r=1, layers.1)
    seen = {}
    twin.steps[3].register_forward_hook(lambda _m, a, o: seen.update(inp=a[0], out=o))
    twin(x)
    v = lp.visit(probe, "layers.1", 1, x)
    torch.testing.assert_close(v.input, seen["inp"], rtol=1e-13, atol=1e-14)
    torch.testing.assert_close(v.output, seen["out"], rtol=1e-13, atol=1e-14)
    assert lp.visit(probe, "layers.1", -1, x).visit.r == 2


def test_the_handles_G_is_per_visit_updates_row_and_the_untied_gradient(loop):
    model, x = loop
    probe = lp.attach(model)
    upd = lp.per_visit_updates(probe, x, loss_fn)
    twin = model.untied()
    grads = torch.autograd.grad(loss_fn(twin(x), x), list(twin.steps.parameters()))
    n = len(list(model.layers[0].parameters()))
    for sub, j in (("layers.0", 0), ("layers.1", 1)):
        for r in range(3):
            v = lp.visit(probe, sub, r, x)
            G = v.G(loss_fn)
            torch.testing.assert_close(G, upd.G[j][r], rtol=0, atol=0)
            i = v.visit.i
            oracle = torch.cat([g.reshape(-1) for g in grads[i * n : (i + 1) * n]])
            torch.testing.assert_close(G, oracle, rtol=1e-11, atol=1e-14)
    adam = lp.visit(probe, "layers.0", 2, x).G(loss_fn, update="adam")
    want = lp.per_visit_updates(probe, x, loss_fn, update="adam").G[0][2]
    torch.testing.assert_close(adam, want, rtol=0, atol=0)


def test_the_handles_U_is_the_untied_jacobian_and_its_norm_the_top_singular_value(loop):
    model, x = loop
    probe = lp.attach(model)
    sens = lp.sensitivity_norms(probe, x)
    for sub, r in (("layers.0", 0), ("layers.1", 2)):
        v = lp.visit(probe, sub, r, x)
        J = untied_step_jacobian(model, x, v.visit.i)
        op = v.U()
        assert op.shape == tuple(J.shape)
        w = np.random.default_rng(0).standard_normal(J.shape[1])
        np.testing.assert_allclose(
            op @ w, (J @ torch.from_numpy(w)).numpy(), rtol=1e-10, atol=1e-12
        )
        est = v.U_norm()
        top = torch.linalg.matrix_norm(J, ord=2).item()
        assert est.converged and est.value == pytest.approx(top, rel=1e-6)
        k = sens.visits.index(v.visit)
        assert est.value == pytest.approx(sens.visit_norms[k].value, rel=1e-6)


def test_a_module_name_counts_that_modules_calls_under_albert_style_tying():
    model = make(AlbertModel, d=6, R=3)
    x = randn(2, 3, 6)
    probe = lp.attach(model)
    rec = probe.record(x)
    v = lp.visit(probe, "layers.2.mix", 0, x)  # the module's only call is the sublayer's visit 2
    assert (v.visit.sublayer, v.visit.r, v.visit.module) == ("layers.0.mix", 2, "layers.2.mix")
    torch.testing.assert_close(v.output, rec.visits[v.visit.i].output, rtol=0, atol=0)
    same = lp.visit(probe, "layers.0.mix", 2, x)  # the sublayer's name counts all its visits
    assert same.visit == v.visit
    upd = lp.per_visit_updates(probe, x, loss_fn)
    torch.testing.assert_close(v.G(loss_fn), upd.G[0][2], rtol=0, atol=0)


def test_unknown_sublayers_and_visit_numbers_are_refused_with_the_fix(loop):
    model, x = loop
    probe = lp.attach(model)
    with pytest.raises(
        ValueError, match=r"'blocks\.0'.*sublayers are \['layers\.0', 'layers\.1'\]"
    ):
        lp.visit(probe, "blocks.0", 0, x)
    with pytest.raises(ValueError, match=r"r=3 but 'layers\.0' has 3 visit\(s\).*0 <= r < 3"):
        lp.visit(probe, "layers.0", 3, x)
    with pytest.raises(ValueError, match="r=-4"):
        lp.visit(probe, "layers.0", -4, x)
    with pytest.raises(TypeError, match="r='1'.*int"):
        lp.visit(probe, "layers.0", "1", x)
    with pytest.raises(TypeError, match="sublayer=0"):
        lp.visit(probe, 0, 0, x)


def test_the_handle_leaves_the_model_as_it_was(loop):
    model, x = loop
    before = {k: t.clone() for k, t in model.state_dict().items()}
    v = lp.visit(model, "layers.0", 1, x)  # a module is attached here
    v.output, v.G(loss_fn), v.U_norm()
    assert all(torch.equal(before[k], t) for k, t in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert not model._forward_hooks and not model.layers[0]._forward_hooks
    assert repr(v) == "VisitHandle(sublayer='layers.0', r=1, module='layers.0', i=2)"
