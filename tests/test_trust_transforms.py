"""Forwards that torch.func refuses, and the F(0) invariant (issue 24: no wrong number is
ever reported as valid).

Models are written the way third-party code is (plain ``nn.Module``, not loopprobe.models):
an old-style ``autograd.Function``, ``requires_grad_()`` on a fresh tensor, a tensor hook,
``torch.autograd.grad`` inside the forward. Each estimate is checked in float64 against a
dense Jacobian of an explicitly untied copy (``torch.autograd.functional.jacobian``, or
``jacrev`` on a plain-ops twin where the model's own op cannot be transformed), never
through loopprobe's swap. Sublayers are named by hand (``sublayers=["block"]``) so that
discovery is not under test here.
"""

from __future__ import annotations

import copy
import functools
import math
import re

import pytest
import torch
from thirdparty_models import make, randn
from torch import nn
from torch.autograd.function import once_differentiable
from torch.func import functional_call, jacrev

import loopprobe as lp
from loopprobe.differentiate.jacobian import VisitJacobian
from loopprobe.record.types import seeded

REL = 1e-10
LANCZOS = {"method": "lanczos", "max_iter": 80, "tol": 1e-11}  # tol: the bound on kappa's error


class OldTanhLinear(torch.autograd.Function):
    """Old-style: ``ctx`` in ``forward``, no ``setup_context`` (torch.func refuses it)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.tanh(x @ w)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        y = torch.tanh(x @ w)
        gy = g * (1 - y * y)
        return gy @ w.T, x.T @ gy


class OnceTanhLinear(OldTanhLinear):
    """The same, with a backward that cannot be differentiated again."""

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        return OldTanhLinear.backward(ctx, g)


class FunctionBlock(nn.Module):
    """``h + tanh(h W)`` through a custom Function (``plain=True``: the same math in ops)."""

    def __init__(self, d: int = 6, fn: type = OldTanhLinear) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d**0.5)
        self.fn, self.plain = fn, False

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.plain:
            return h + torch.tanh(h @ self.w)
        return h + self.fn.apply(h, self.w)


class FreshRequiresGrad(nn.Module):
    """Calls ``requires_grad_(False)`` and ``requires_grad_()`` on tensors it makes."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(h.shape[-1], dtype=h.dtype).requires_grad_(False)
        bias = torch.zeros_like(h).requires_grad_()
        return h + torch.tanh(self.lin(h)) * mask + bias


class HookBlock(nn.Module):
    """Registers a gradient hook on an activation in every forward (a gradient monitor)."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.lin(h))
        y.register_hook(lambda g: g)
        return h + y


class EnergyStep(nn.Module):
    """``h - eta dE/dh`` with ``torch.autograd.grad`` inside the forward (energy models)."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        energy = torch.tanh(self.lin(h)).square().sum()
        (dE,) = torch.autograd.grad(energy, h, create_graph=True)
        return h - 0.1 * dE


class Looped(nn.Module):
    def __init__(self, block: nn.Module, R: int = 3, d: int = 6) -> None:
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(d, d), block, nn.Linear(d, 4)
        self.R = R

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for _ in range(self.R):
            h = self.block(h)
        return self.out(h)

    def untied(self, plain: bool = False) -> nn.Module:
        """R deep copies of the block in sequence (``plain``: Functions as plain ops)."""
        twin = copy.deepcopy(self)
        blocks = nn.ModuleList([copy.deepcopy(self.block) for _ in range(self.R)])
        for b in blocks:
            b.plain = plain
        twin.block, twin.blocks = None, blocks
        twin.forward = lambda x: twin.out(functools.reduce(lambda h, b: b(h), blocks, twin.inp(x)))
        return twin


BLOCKS = {
    "old-style Function": FunctionBlock,
    "requires_grad_ on a fresh tensor": FreshRequiresGrad,
    "tensor hook": HookBlock,
    "autograd.grad inside": EnergyStep,
}
REFUSED = {
    "old-style Function": r"autograd.Function without setup_context \(OldTanhLinear.apply",
    "requires_grad_ on a fresh tensor": r"Tensor.requires_grad_\(\) on a tensor made",
    "tensor hook": r"tensor hook \(Tensor.register_hook\)",
    "autograd.grad inside": r"torch.autograd.grad \(or .backward\) inside the forward",
}


def loss(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def dense_blocks(model: Looped, x: torch.Tensor) -> list[torch.Tensor]:
    """``dF/dphi_r`` of the untied twin, one (m, n) matrix per visit r, in float64.

    ``jacrev`` on the plain-ops twin where there is one; else plain reverse-mode
    ``torch.autograd.functional.jacobian`` (torch.func refuses these forwards)."""
    has_plain = hasattr(model.block, "plain")
    twin = model.untied(plain=has_plain)
    params = dict(twin.named_parameters())  # live: EnergyStep needs h to require grad
    names = [n for n in params if n.startswith("blocks.")]

    def F(*ps: torch.Tensor) -> torch.Tensor:
        return functional_call(twin, {**params, **dict(zip(names, ps, strict=True))}, (x,)).reshape(
            -1
        )

    ps = tuple(params[n] for n in names)
    J = jacrev(F, argnums=tuple(range(len(ps))))(*ps) if has_plain else None
    J = J if J is not None else torch.autograd.functional.jacobian(F, ps)
    by = dict(zip(names, J, strict=True))
    return [
        torch.cat(
            [by[n].reshape(by[n].shape[0], -1) for n in names if n.startswith(f"blocks.{r}.")], 1
        )
        for r in range(model.R)
    ]


def spectral(A: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(A.detach(), 2))


def dense_kappa(model: Looped, x: torch.Tensor) -> float:
    """kappa_j of docs/definitions.md from the untied twin's G and the dense U blocks."""
    Js = dense_blocks(model, x)
    twin = model.untied()
    g = torch.autograd.grad(loss(twin(x), x), [p for b in twin.blocks for p in b.parameters()])
    n = len(list(model.block.parameters()))
    G = [torch.cat([t.reshape(-1) for t in g[r * n : (r + 1) * n]]) for r in range(model.R)]
    U_tied, G_tied = spectral(sum(Js)), float(sum(G).norm())
    U_max, G_max = max(map(spectral, Js)), max(float(t.norm()) for t in G)
    return U_tied * G_tied / (model.R * U_max * G_max)


# --------------------------------------------------------------------------- case 9


@pytest.mark.parametrize("kind", list(BLOCKS))
def test_a_forward_torch_func_refuses_gets_the_dense_U_norms_by_plain_autograd(kind):
    model = make(Looped, block=BLOCKS[kind]())
    x = randn(3, 6)
    sens = lp.sensitivity_norms(lp.attach(model, ["block"]), x, **LANCZOS)
    assert sens.converged, sens.reason
    assert "plain torch.autograd" in sens.jvp_mode
    assert re.search(REFUSED[kind], sens.jvp_mode), sens.jvp_mode
    Js = dense_blocks(model, x)
    assert [e.value for e in sens.visit_norms] == pytest.approx(list(map(spectral, Js)), rel=REL)
    assert sens.tied_norms[0].value == pytest.approx(spectral(sum(Js)), rel=REL)


@pytest.mark.parametrize("kind", ["old-style Function", "autograd.grad inside"])
def test_kappa_of_a_forward_torch_func_refuses_is_the_untied_twins(kind):
    model = make(Looped, block=BLOCKS[kind]())
    x = randn(3, 6)
    rep = lp.visit_alignment(lp.attach(model, ["block"]), x, loss, **LANCZOS)
    assert rep.converged, rep.reason
    assert rep.kappa == pytest.approx(dense_kappa(model, x), rel=REL)


def test_the_refusal_names_the_module_and_the_line_of_user_code():
    model = make(Looped, block=FreshRequiresGrad())
    sens = lp.sensitivity_norms(lp.attach(model, ["block"]), randn(3, 6), max_iter=5)
    assert "in module 'block'" in sens.jvp_mode
    assert "test_trust_transforms.py:" in sens.jvp_mode and "requires_grad_(False)" in sens.jvp_mode


def test_a_function_whose_backward_is_once_differentiable_is_one_error_naming_it_and_the_way_out():
    model = make(Looped, block=FunctionBlock(fn=OnceTanhLinear))
    with pytest.raises(RuntimeError) as err:
        lp.sensitivity_norms(lp.attach(model, ["block"]), randn(3, 6), max_iter=5)
    msg = str(err.value)
    assert msg.startswith("sensitivity_norms: torch.func refuses this forward")
    assert "OnceTanhLinear.apply" in msg and "in module 'block'" in msg
    assert "once_differentiable" in msg and "setup_context" in msg


def test_visit_function_of_a_refused_forward_names_it_and_works_under_plain_autograd():
    model = make(Looped, block=FunctionBlock())
    x = randn(3, 6)
    F, d0 = lp.visit_function(lp.attach(model, ["block"]), x)
    with pytest.raises(
        RuntimeError,
        match=r"visit_function: torch.func cannot transform .*"
        r"OldTanhLinear.apply.*plain torch.autograd",
    ):
        torch.func.grad(lambda d: F(d).square().mean())(d0)
    d = [tuple(t.clone().requires_grad_() for t in ts) for ts in d0]
    G = torch.autograd.grad(F(d).square().mean(), [t for ts in d for t in ts])
    twin = model.untied(plain=True)
    want = torch.autograd.grad(twin(x).square().mean(), [b.w for b in twin.blocks])
    for got, w in zip(G, want, strict=True):
        torch.testing.assert_close(got, w, rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------------------- F(0) invariant


class PackedIfNotParameter(nn.Module):
    """Treats a weight that is not an ``nn.Parameter`` as stored transposed (a packed
    format), as quantization-aware code does: under any parameter swap it computes
    something else."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d**0.5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        w = self.w if isinstance(self.w, nn.Parameter) else self.w.T
        return h + torch.tanh(h @ w)


CALLS = [0]


class CountingBlock(nn.Module):
    """Reads a global call counter (a warm-up schedule kept outside the module)."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        CALLS[0] += 1
        return h + min(CALLS[0], 50) / 50 * torch.tanh(self.lin(h))


def checked_jacobian(model: nn.Module, x: torch.Tensor, **kw) -> VisitJacobian:
    probe = lp.attach(model, **kw)
    jac = VisitJacobian(probe, x, [v for v in probe.visits(x) if v.grad_visible])
    jac.vjp_fn()
    return jac


@pytest.mark.parametrize("block", [PackedIfNotParameter, CountingBlock])
def test_F0_that_is_not_the_models_output_is_a_problem_with_the_relative_difference(block):
    model = make(Looped, block=block())
    x = randn(3, 6)
    jac = checked_jacobian(model, x, sublayers=["block"])
    with torch.no_grad():
        ref = model(x).reshape(-1)
    rel = float((jac.F0 - ref).abs().max() / ref.abs().max())
    assert rel > 1e-3  # the plant: the probed function is another function
    assert len(jac.problems) == 1
    assert jac.problems[0].startswith("the F(0) check failed")
    assert "not the model" in jac.problems[0]
    said = float(re.search(r"output by ([0-9.e+-]+) ", jac.problems[0]).group(1))
    assert said > 1e-3
    if block is PackedIfNotParameter:  # deterministic: the figure is the difference itself
        assert said == pytest.approx(rel, rel=1e-2)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_F0_of_looped_gpt_is_the_models_output_bit_for_bit_also_with_dropout(dropout):
    cfg = lp.models.GPTConfig(vocab_size=16, seq_len=8, d_model=16, n_heads=2, K=1, R=3,
                              dropout=dropout)  # fmt: skip
    model = lp.models.LoopedGPT(cfg, generator=torch.Generator().manual_seed(0)).double().train()
    x = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(1))
    jac = checked_jacobian(model, x)
    assert jac.problems == []
    with seeded(0), torch.enable_grad():
        assert torch.equal(jac.F0, model(x).reshape(-1).detach())


@pytest.mark.parametrize("kind", list(BLOCKS))
def test_F0_of_a_forward_torch_func_refuses_is_the_models_output(kind):
    jac = checked_jacobian(make(Looped, block=BLOCKS[kind]()), randn(3, 6), sublayers=["block"])
    assert jac.problems == []


def test_F0_check_passes_with_dropout_in_train_mode_and_leaves_the_model_untouched():
    model = make(Looped, block=nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.3), nn.Tanh()))
    model.train()
    before = [t.detach().clone() for t in model.state_dict().values()]
    jac = checked_jacobian(model, randn(3, 6), sublayers=["block.0"])
    assert jac.problems == [] and jac.F0 is not None and math.isfinite(float(jac.F0.sum()))
    assert all(torch.equal(a, b) for a, b in zip(before, model.state_dict().values(), strict=True))
    assert all(p.grad is None for p in model.parameters())
