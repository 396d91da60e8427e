"""Silent paths and crashes on models written the way third-party code is (issue 40).

Each model here is small, float64 and knows nothing about loopprobe; each test compares a
loopprobe number with a brute-force twin (a dense ``jacrev`` or a plain re-run) and checks
that probing leaves the model as it was.
"""

from __future__ import annotations

import time
import warnings

import pytest
import torch
from torch import nn
from torch.func import jacrev

import loopprobe as lp
from tests.thirdparty_models import make, randn

# ------------------------------------------------------------------ BatchNorm in train mode


class BNBlock(nn.Module):
    """``h -> 0.5 h + 0.4 tanh(BN(W h)) + e``: a contracting round with a BatchNorm inside."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return 0.5 * h + 0.4 * torch.tanh(self.bn(self.lin(h))) + e


class BNLoop(nn.Module):
    def __init__(self, d: int = 6, R: int = 8) -> None:
        super().__init__()
        self.R = R
        self.inp = nn.Linear(3, d)
        self.block = BNBlock(d)
        self.head = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.inp(x)
        h = e
        for _ in range(self.R):
            h = self.block(h, e)
        return self.head(h)


def bn_model() -> tuple[BNLoop, torch.Tensor]:
    model, x = make(BNLoop), randn(10, 3)
    with torch.no_grad():  # running statistics far from the batch's: the two rounds differ
        model.block.bn.running_mean.fill_(0.0)
        model.block.bn.running_var.fill_(25.0)
    return model.train(), x


def dense_rho_of_the_eval_round(model: BNLoop, x: torch.Tensor, rounds: int = 500) -> float:
    """rho of one eval-mode round after ``rounds`` rounds (500: at its fixed point), from a
    dense Jacobian (the twin)."""
    model.eval()
    with torch.no_grad():
        e = model.inp(x)
        h = e
        for _ in range(rounds):
            h = model.block(h, e)
        J = jacrev(lambda s: model.block(s, e))(h).reshape(h.numel(), h.numel())
    model.train()
    return float(torch.linalg.eigvals(J).abs().max())


def replay(model: nn.Module, inputs: torch.Tensor) -> lp.RoundMap:
    return lp.replay_round(model, inputs, "block", input_arg=1)


def test_train_mode_batchnorm_rho_is_the_eval_round_in_health_monitor_and_replay():
    model, x = bn_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rho = dense_rho_of_the_eval_round(model, x)
    rm = replay(model, x)
    assert "eval mode" in rm.reason
    fp = lp.fixed_point(rm.T, rm.h0, tol=1e-12, max_iter=500)
    direct = lp.spectral_radius(rm.T, fp.h, k=2)
    assert direct.value == pytest.approx(rho, rel=1e-6)
    h = lp.health(model, x, step=replay, alpha=1.0, beta=1.0, progress=False)
    row = h.frame.set_index("check").loc["spectral radius"]
    assert row["value"] == pytest.approx(rho, rel=1e-4)  # at health's fixed point, tol 1e-6
    assert "eval mode" in h.frame.set_index("check").loc["fixed point"]["measured"]
    mon = lp.Monitor(model, x, diagnostics=["rho"], every=1, options={"rho": {"round": replay}})
    mon.step(0)
    got = mon.frame.query("quantity == 'rho'")
    at_R = dense_rho_of_the_eval_round(model, x, model.R)  # the Monitor's rho: at h_R
    assert float(got["value"].iloc[0]) == pytest.approx(at_R, rel=1e-6)
    assert model.training and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


# --------------------------------------- a parametrization that writes state under torch.func


class SNBlock(nn.Module):
    """A residual block whose first weight is spectrally normalised (torch's parametrization,
    in train mode: every forward runs one power-iteration step and writes ``u``/``v``)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.utils.parametrizations.spectral_norm(nn.Linear(d, d))
        self.fc = nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + 0.5 * torch.tanh(self.fc(torch.tanh(self.lin(h))))


class SNLoop(nn.Module):
    def __init__(self, d: int = 5, R: int = 3) -> None:
        super().__init__()
        self.R = R
        self.inp = nn.Linear(3, d)
        self.block = SNBlock(d)
        self.head = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for _ in range(self.R):
            h = self.block(h)
        return self.head(h)


def sn_model() -> SNLoop:
    model = make(SNLoop)
    sn = model.block.lin.parametrizations.weight[0]
    with torch.no_grad():  # before the power iteration settles: each step moves u, v a lot
        sn._u.copy_(torch.nn.functional.normalize(randn(5, seed=3), dim=0))
        sn._v.copy_(torch.nn.functional.normalize(randn(5, seed=4), dim=0))
    return model.train()


def squared(out: torch.Tensor, _inputs: object) -> torch.Tensor:
    return out.pow(2).mean()


def sn_brute_kappa(model: SNLoop, x: torch.Tensor) -> float:
    """kappa of the block from dense per-visit Jacobians of an explicitly untied F (the twin):
    visit r computes with its own copy of the block's parameters, the power step (no grad)
    on that copy's weight from the u, v the previous visit left, as torch's parametrization
    does in train mode."""
    blk, sn = model.block, model.block.lin.parametrizations.weight[0]
    names = ["lin.parametrizations.weight.original", "lin.bias", "fc.weight", "fc.bias"]
    params = dict(blk.named_parameters())
    sizes = [params[n].numel() for n in names]

    def F(*thetas: torch.Tensor) -> torch.Tensor:
        u, v = sn._u.clone(), sn._v.clone()
        h = model.inp(x)
        for theta in thetas:
            W, b, Wf, bf = (
                t.view_as(params[n]) for t, n in zip(theta.split(sizes), names, strict=True)
            )
            with torch.no_grad():
                u = torch.nn.functional.normalize(W.detach() @ v, dim=0, eps=sn.eps)
                v = torch.nn.functional.normalize(W.detach().T @ u, dim=0, eps=sn.eps)
            Wn = W / torch.dot(u, W @ v)
            h = h + 0.5 * torch.tanh(torch.tanh(h @ Wn.T + b) @ Wf.T + bf)
        return model.head(h).reshape(-1)

    theta = torch.cat([params[n].detach().reshape(-1) for n in names])
    thetas = [theta.clone().requires_grad_() for _ in range(model.R)]
    J = torch.autograd.functional.jacobian(F, tuple(thetas))
    G = torch.autograd.grad(F(*thetas).pow(2).mean(), thetas)
    norm2 = lambda m: float(torch.linalg.matrix_norm(m, 2))  # noqa: E731
    return (norm2(sum(J)) * float(sum(G).norm())) / (
        model.R * max(norm2(j) for j in J) * max(float(g.norm()) for g in G)
    )


def test_spectral_norm_in_train_mode_kappa_matches_an_untied_twin_and_the_model_is_unchanged():
    model, x = sn_model(), randn(4, 3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    got = lp.visit_alignment(lp.attach(model, sublayers=["block"]), x, squared, tol=1e-10)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} moved by probing"
    assert got.converged
    assert got.kappa == pytest.approx(sn_brute_kappa(model, x), rel=1e-6)


# ------------------------------------------------------- a torch.Generator owned by a module


class OwnDropout(nn.Module):
    """Dropout drawing from the module's own generator (as some codebases do for
    reproducibility), in train mode."""

    def __init__(self, p: float, seed: int) -> None:
        super().__init__()
        self.p = p
        self.gen = torch.Generator().manual_seed(seed)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return h
        keep = torch.rand(h.shape, generator=self.gen, dtype=h.dtype) >= self.p
        return h * keep / (1 - self.p)


class GenLoop(nn.Module):
    def __init__(self, d: int = 5, R: int = 3, masks: list | None = None) -> None:
        super().__init__()
        self.R, self.masks = R, masks
        self.inp = nn.Linear(3, d)
        self.block = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d))
        self.drop = OwnDropout(0.3, seed=7)
        self.head = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for r in range(self.R):
            branch = self.block(h)
            if self.masks is None:
                h = h + self.drop(branch)
            else:  # the twin: the masks the generator draws, fixed
                h = h + branch * self.masks[r] / (1 - self.drop.p)
        return self.head(h)


def test_a_generator_a_module_owns_is_not_advanced_and_every_evaluation_draws_the_same_masks():
    model, x = make(GenLoop).train(), randn(4, 3)
    state = model.drop.gen.get_state()
    with torch.no_grad():
        sample = model.inp(x)
    gen = torch.Generator()
    gen.set_state(state)
    masks = [torch.rand(sample.shape, generator=gen, dtype=x.dtype) >= 0.3 for _ in range(3)]
    twin = make(GenLoop, masks=masks).train()
    probe = lp.attach(model, sublayers=["block"])
    got = lp.visit_alignment(probe, x, squared, tol=1e-10)
    assert torch.equal(model.drop.gen.get_state(), state), "probing advanced model.drop.gen"
    want = lp.visit_alignment(lp.attach(twin, sublayers=["block"]), x, squared, tol=1e-10)
    assert got.converged and got.kappa == pytest.approx(want.kappa, rel=1e-8)
    h = lp.health(model, x, alpha=1.0, beta=1.0, progress=False)
    assert h.values["kappa"] == pytest.approx(want.kappa, rel=1e-3)
    assert torch.equal(model.drop.gen.get_state(), state), "lp.health advanced model.drop.gen"


# ------------------------------------------------------------------------ complex parameters


class ComplexMix(nn.Module):
    """A block mixing features with a complex weight (as spectral / unitary-RNN code does)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(0.3 * torch.randn(d, d, dtype=torch.complex128))
        self.fc = nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        z = h.to(torch.complex128) @ self.w
        return h + torch.tanh(self.fc(z.real + z.imag))


class ComplexLoop(nn.Module):
    def __init__(self, d: int = 4, R: int = 3) -> None:
        super().__init__()
        self.R = R
        self.inp = nn.Linear(3, d)
        self.block = ComplexMix(d)
        self.head = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for _ in range(self.R):
            h = self.block(h)
        return self.head(h)


ENTRIES = {
    "per_visit_updates": lambda probe, x: lp.per_visit_updates(probe, x, squared),
    "sensitivity_norms": lambda probe, x: lp.sensitivity_norms(probe, x),
    "visit_alignment": lambda probe, x: lp.visit_alignment(probe, x, squared),
}


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_a_complex_parameter_is_refused_up_front_naming_it(entry):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = ComplexLoop().double()
    probe, x = lp.attach(model, sublayers=["block"]), randn(4, 3)
    with pytest.raises(TypeError, match="parameter 'block.w' of sublayer 'block' is complex"):
        ENTRIES[entry](probe, x)


# --------------------------------------------------- an ordinary embedding <-> output-layer tie


class TiedIO(nn.Module):
    """Token embedding tied to the output layer, each wrapped in ``nn.Sequential`` (a head
    with a norm and a biased projection), a shared residual block looped in between."""

    def __init__(self, V: int = 7, d: int = 4, R: int = 3) -> None:
        super().__init__()
        self.R = R
        self.embed = nn.Sequential(nn.Embedding(V, d), nn.Dropout(0.0))
        self.block = nn.Sequential(nn.Linear(d, d), nn.Tanh())
        self.head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, V))
        self.head[1].weight = self.embed[0].weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for _ in range(self.R):
            h = h + self.block(h)
        return self.head(h)


def test_an_embedding_tied_to_the_output_layer_is_not_called_a_partial_tie():
    model, idx = make(TiedIO), torch.tensor([[1, 4, 2, 6]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        table = lp.attach(model).visit_table(idx)
    assert "block" in set(table["sublayer"]) and not table["note"].astype(bool).any()


# ------------------------------------------------ discovery cache and class-level state


class ClassTiedLoop(nn.Module):
    """Reuses one block every round when the class attribute ``SHARED`` is set, else runs a
    stack of distinct blocks (a config some codebases keep on the class)."""

    SHARED = True

    def __init__(self, d: int = 4, R: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(3, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(R))
        self.head = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for r in range(len(self.blocks)):
            h = h + self.blocks[0 if type(self).SHARED else r](h)
        return self.head(h)


def test_discovery_is_not_reused_when_a_class_attribute_that_steers_the_loop_changed():
    model, x = make(ClassTiedLoop), randn(2, 3)
    table = lambda: lp.attach(model).visit_table(x).set_index("sublayer").visits  # noqa: E731
    assert table().to_dict() == {"blocks.0": 3}
    ClassTiedLoop.SHARED = False  # now nothing is looped: a fresh discovery says so
    try:
        with pytest.raises(ValueError, match="nothing is looped in ClassTiedLoop"):
            table()
    finally:
        ClassTiedLoop.SHARED = True


# ------------------------------------------------------------- planted-change catchers


class OwnLossOut:
    """A Hugging Face-style output: logits and the model's own loss."""

    def __init__(self, logits: torch.Tensor, loss: torch.Tensor) -> None:
        self.logits, self.loss = logits, loss


class DecayLoop(nn.Module):
    """Its own ``.loss`` adds weight decay on every parameter: the shared block's weight is
    read outside the block's calls, a real part of its tied gradient no visit holds."""

    def __init__(self, d: int = 4, R: int = 3, decay: float = 0.01) -> None:
        super().__init__()
        self.R, self.decay = R, decay
        self.inp = nn.Linear(3, d)
        self.block = nn.Sequential(nn.Linear(d, d), nn.Tanh())
        self.head = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> OwnLossOut:
        h = self.inp(x)
        for _ in range(self.R):
            h = h + self.block(h)
        logits = self.head(h)
        wd = sum(p.pow(2).sum() for p in self.parameters())
        return OwnLossOut(logits, logits.pow(2).mean() + self.decay * wd)


def test_a_parameter_read_outside_its_visits_by_the_models_own_loss_is_flagged_with_its_share():
    model, x = make(DecayLoop), randn(5, 3)
    ups = lp.per_visit_updates(lp.attach(model, sublayers=["block"]), x)
    # the twin: the decay term's gradient against the whole tied gradient, by plain autograd
    params = list(model.block.parameters())
    tied = torch.autograd.grad(model(x).loss, params)
    outside = [2 * model.decay * p.detach() for p in params]
    share = float(torch.cat([o.reshape(-1) for o in outside]).norm()) / float(
        torch.cat([t.reshape(-1) for t in tied]).norm()
    )
    assert 1e-3 < share < 0.05  # a real share, far above roundoff, far below 1
    assert ups.outside_share[0] == pytest.approx(share, rel=1e-10)
    assert not ups.converged and "'block'" in ups.reason and "outside" in ups.reason


class SkewedBackward(torch.autograd.Function):
    """``0.5 x`` whose hand-written backward is off by 1e-3 (its jvp is right): the kind of
    slip a fused kernel's backward makes."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
        pass

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return 0.5 * (1 + 1e-3) * g

    @staticmethod
    def jvp(ctx, t: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return 0.5 * t


def test_eigenpairs_from_a_skewed_backward_fail_the_jvp_check_and_are_not_converged():
    W = randn(6, 6, seed=5) / 3
    e = randn(6, seed=6)
    step = lambda h: SkewedBackward.apply(torch.tanh(W @ h + e))  # noqa: E731
    h = randn(6, seed=7)
    J = jacrev(lambda s: 0.5 * torch.tanh(W @ s + e))(h)  # the true Jacobian (twin)
    rho = float(torch.linalg.eigvals(J).abs().max())
    sr = lp.spectral_radius(step, h, k=2, method="dense")
    assert sr.value == pytest.approx(rho * (1 + 1e-3), rel=1e-9)  # the pairs of the VJP's J
    assert not sr.converged and "eigenpair check failed" in sr.reason
    assert sr.rel_change == pytest.approx(1e-3, rel=1e-2)
    plain = lp.spectral_radius(lambda s: 0.5 * torch.tanh(W @ s + e), h, k=2, method="dense")
    assert plain.converged and plain.value == pytest.approx(rho, rel=1e-10)


# ------------------------------------------------ an implicit gradient (torchdeq-style)


class ImplicitBackward(torch.autograd.Function):
    """Identity forward; the backward solves ``u = g + J^T u`` at the fixed point by calling
    the block again (the implicit-function-theorem gradient of DEQ code)."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, x: torch.Tensor, block: nn.Module) -> torch.Tensor:  # noqa: ANN001
        ctx.block = block
        ctx.save_for_backward(z, x)
        return z.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: ANN001, ANN205
        z, x = ctx.saved_tensors
        with torch.enable_grad():
            z0 = z.detach().requires_grad_()
            fz = ctx.block(z0, x)
            u = g
            for _ in range(30):
                u = g + torch.autograd.grad(fz, z0, u, retain_graph=True)[0]
        return u, None, None


class DEQCell(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * torch.tanh(self.lin(z)) + x


class TinyDEQ(nn.Module):
    """Solver under no_grad, one grad-mode call of the cell, the implicit-gradient Function."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(3, d)
        self.cell = DEQCell(d)
        self.head = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.inp(x)
        with torch.no_grad():
            z = torch.zeros_like(e)
            for _ in range(20):
                z = self.cell(z, e)
        z = self.cell(z, e)
        if self.training:
            z = ImplicitBackward.apply(z, e, self.cell)
        return self.head(z)


def test_an_implicit_gradient_calling_the_module_in_backward_is_refused_naming_the_function():
    model, x = make(TinyDEQ).train(), randn(4, 3)
    probe = lp.attach(model, sublayers=["cell"])
    with pytest.raises(RuntimeError, match="ImplicitBackward") as err:
        lp.per_visit_updates(probe, x, squared)
    assert "checkpoint" not in str(err.value)


def test_the_unchanged_model_check_passes_every_entry_point_on_a_train_mode_spectral_norm():
    import loopprobe.testing as lpt

    model, x = sn_model(), randn(4, 3)
    ran = lpt.check_probe_leaves_model_unchanged(
        model, x, squared, alpha=1.0, beta=1.0, increment="delta"
    )
    assert "bound_check" in ran and "sensitivity_norms" in ran  # bound's JVP: reverse mode


class HookDEQ(nn.Module):
    """locuslab/deq-style training forward: the solver under no_grad, one grad-mode call of
    the cell, and an implicit-gradient hook on its output that removes itself through
    ``self.hook`` (which the next forward overwrites)."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(3, d)
        self.cell = DEQCell(d)
        self.head = nn.Linear(d, 2)
        self.hook = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.inp(x)
        with torch.no_grad():
            z = torch.zeros_like(e)
            for _ in range(20):
                z = self.cell(z, e)
        z1 = z.requires_grad_()
        new_z1 = self.cell(z1, e)
        if self.training:

            def backward_hook(grad: torch.Tensor) -> torch.Tensor:
                if self.hook is not None:
                    self.hook.remove()
                y = torch.zeros_like(grad)
                for _ in range(5):
                    y = torch.autograd.grad(new_z1, z1, y, retain_graph=True)[0] + grad
                return y

            self.hook = new_z1.register_hook(backward_hook)
        return self.head(new_z1)


def test_an_implicit_gradient_hook_left_attached_is_a_clear_error_at_once_not_a_blow_up():
    # Unguarded, the recursion runs to Python's limit, torch loses the RecursionError and
    # the hook's loop goes on: 0.8 s at recursion limit 150, 190 s at 300 (exponential).
    model, x = make(HookDEQ).train(), randn(4, 3)
    start = time.process_time()
    with pytest.raises(RuntimeError, match="recursed without end: a tensor hook registered"):
        lp.visit_alignment(lp.attach(model, sublayers=["cell"]), x, squared, max_iter=5)
    assert time.process_time() - start < 20
