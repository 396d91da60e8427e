"""Models the way researchers write them: fused attention, checkpointing, in-place buffers,
ops without forward AD, mixed precision. Each estimate is checked against an explicitly
untied copy differentiated with dense ``jacrev`` (float64), never through loopprobe's swap."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as ckpt
from thirdparty_models import make, randn
from torch import nn
from torch.func import functional_call, jacrev
from torch.nn.attention import _cur_sdpa_kernel_backends

import loopprobe as lp
from loopprobe.autodiff import transform_safe
from loopprobe.estimate.sensitivity import sensitivity_norms
from loopprobe.estimate.updates import per_visit_updates

REL = 1e-6


class ViewAttention(nn.Module):
    """Self-attention written as in nanoGPT: SDPA, then ``.transpose(1, 2).view``."""

    def __init__(self, d: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.qkv, self.proj, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        q, k, v = self.qkv(x).split(D, dim=2)
        q, k, v = (t.view(B, S, self.heads, D // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(y.transpose(1, 2).view(B, S, D))  # needs SDPA's own layout


class Looped(nn.Module):
    """``block`` applied R times; ``wrap(block, h)`` is how each visit is called."""

    def __init__(self, block: nn.Module, R: int = 3, d: int = 8, wrap=None) -> None:
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(d, d), block, nn.Linear(d, 5)
        self.R, self.wrap = R, wrap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for _ in range(self.R):
            h = self.block(h) if self.wrap is None else self.wrap(self.block, h)
        return self.out(h)

    def untied(self) -> nn.Module:
        twin = copy.deepcopy(self)
        blocks = nn.ModuleList([copy.deepcopy(self.block) for _ in range(self.R)])
        twin.block, twin.blocks, twin.wrap = None, blocks, None
        twin.forward = lambda x: twin.out(functools.reduce(lambda h, b: b(h), blocks, twin.inp(x)))
        return twin


def dense_visit_norms(model: Looped, x: torch.Tensor) -> list[float]:
    twin = model.untied()
    params = {n: p.detach() for n, p in twin.named_parameters()}
    J = jacrev(lambda ps: functional_call(twin, ps, (x,)).reshape(-1))(params)
    norms = []
    for r in range(model.R):
        names = [n for n in params if n.startswith(f"blocks.{r}.")]
        block = torch.cat([J[n].reshape(J[n].shape[0], -1) for n in names], 1)
        norms.append(float(torch.linalg.matrix_norm(block, 2)))
    return norms


def untied_grads(model: Looped, x: torch.Tensor, loss) -> list[torch.Tensor]:
    twin = model.untied()
    g = torch.autograd.grad(loss(twin(x), x), [p for b in twin.blocks for p in b.parameters()])
    n = len(list(model.block.parameters()))
    return [torch.cat([t.reshape(-1) for t in g[r * n : (r + 1) * n]]) for r in range(model.R)]


def loss(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in (*model.parameters(), *model.buffers())]


def assert_unchanged(model: nn.Module, before: list[torch.Tensor]) -> None:
    now = [*model.parameters(), *model.buffers()]
    assert all(torch.equal(a, b) for a, b in zip(now, before, strict=True))
    assert all(p.grad is None for p in model.parameters())


# --------------------------------------------------------------------------- attention


@pytest.mark.parametrize("layout", ["bhsd", "bshd", "sbhd"])
def test_attention_under_probes_keeps_the_memory_layout_of_the_users_kernel(layout):
    base = randn(2, 5, 2, 4)  # (B, S, H, D)
    q = {
        "bhsd": base.transpose(1, 2).contiguous(),
        "bshd": base.transpose(1, 2),
        "sbhd": base.permute(1, 0, 2, 3).contiguous().permute(1, 2, 0, 3),
    }[layout]
    expected = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    with transform_safe():
        got = torch.func.jvp(
            lambda t: F.scaled_dot_product_attention(t, t, t, is_causal=True), (q,), (q,)
        )[0]
    assert got.stride() == expected.stride()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_sdpa_model_that_views_the_output_gets_U_norms_of_the_dense_jacobian():
    model = make(Looped, block=ViewAttention())
    x = randn(2, 4, 8)
    before = snapshot(model)
    sens = sensitivity_norms(lp.attach(model), x, method="lanczos", max_iter=60, tol=1e-12)
    assert sens.converged, sens.reason
    assert sens.jvp_mode == "forward mode"
    got = [e.value for e in sens.visit_norms]
    assert got == pytest.approx(dense_visit_norms(model, x), rel=REL)
    assert_unchanged(model, before)
    assert _cur_sdpa_kernel_backends()[0] != torch.nn.attention.SDPBackend.MATH  # restored


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_looped_transformer_encoder_layer_gets_exact_G_and_U(mode):
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    model = make(Looped, block=layer)
    getattr(model, mode)()
    x = randn(2, 4, 8)
    probe = lp.attach(model)
    ups = per_visit_updates(probe, x, loss)
    for got, want in zip(ups.G[0], untied_grads(model, x, loss), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13)
    sens = sensitivity_norms(probe, x, method="lanczos", max_iter=60, tol=1e-12)
    got = [e.value for e in sens.visit_norms]
    assert got == pytest.approx(dense_visit_norms(model, x), rel=REL)


# --------------------------------------------------------------------------- checkpointing

CHECKPOINTS = {
    "non-reentrant": lambda b, h: ckpt.checkpoint(b, h, use_reentrant=False),
    "reentrant": lambda b, h: ckpt.checkpoint(b, h, use_reentrant=True),
    "hf-partial": functools.partial(ckpt.checkpoint, use_reentrant=False),
}


@pytest.mark.parametrize("kind", list(CHECKPOINTS))
def test_checkpointed_model_has_the_visits_G_and_kappa_of_the_plain_one(kind):
    plain = make(Looped, block=nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)))
    checked = make(Looped, block=plain.block, wrap=CHECKPOINTS[kind])
    checked.load_state_dict(plain.state_dict())
    x = randn(3, 8)
    before = snapshot(checked)
    with lp.attach(plain) as p0, lp.attach(checked) as p1:
        t0, t1 = p0.visit_table(x), p1.visit_table(x)
        assert (t1.attrs["M"], t1.attrs["M_g"]) == (t0.attrs["M"], t0.attrs["M_g"]) == (3, 3)
        a0, a1 = lp.visit_alignment(p0, x, loss), lp.visit_alignment(p1, x, loss)
    torch.testing.assert_close(a1.updates.G[0], a0.updates.G[0], rtol=0, atol=0)
    assert a1.kappa == pytest.approx(a0.kappa, rel=1e-9)
    assert_unchanged(checked, before)
    assert ckpt.CheckpointFunction.__name__ == "CheckpointFunction"  # patch undone


def test_reentrant_checkpoint_on_inputs_without_grad_passes_no_gradient_as_in_training():
    model = make(Looped, block=nn.Linear(8, 8), wrap=CHECKPOINTS["reentrant"])
    model.inp = nn.Identity()  # the raw input requires no grad: the known reentrant pitfall
    x = randn(3, 8)
    with pytest.warns(UserWarning):
        tied = torch.autograd.grad(loss(model(x), x), model.block.weight, allow_unused=True)[0]
    assert tied is None  # training gives the block no gradient ...
    with pytest.warns(UserWarning):
        table = lp.attach(model).visit_table(x)
    assert table.attrs["M_g"] == 0  # ... and loopprobe says so


class Recompute(torch.autograd.Function):
    """A home-made checkpoint: recomputes the block inside backward."""

    @staticmethod
    def forward(block, h):
        with torch.no_grad():
            return block(h)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.block, ctx.h = inputs[0], inputs[1]

    @staticmethod
    def backward(ctx, g):
        with torch.enable_grad():
            h = ctx.h.detach().requires_grad_()
            return None, torch.autograd.grad(ctx.block(h), h, g)[0]


class TwoBlocks(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return Recompute.apply(self.b, torch.tanh(self.a(h)))


def test_a_recompute_in_backward_that_is_not_torch_checkpoint_is_a_clear_error():
    model = make(Looped, block=TwoBlocks())
    with pytest.raises(RuntimeError, match="called during a backward pass"):
        lp.attach(model, ["block.a", "block.b"]).visit_table(randn(3, 8))


# --------------------------------------------------------------------------- fallbacks


class GridBlock(nn.Module):
    """A block whose op (``grid_sample``) has no forward-AD rule but a double backward."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        y = self.lin(h)
        grid = torch.tanh(h[:2]).reshape(1, 2, -1, 2)
        s = F.grid_sample(y.reshape(1, 1, *h.shape), grid, align_corners=False).reshape(-1)
        return h + 0.1 * s.mean() * torch.tanh(y)


class CdistBlock(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + 0.1 * torch.cdist(self.lin(h), h) @ h


def test_an_op_without_forward_ad_falls_back_to_reverse_mode_and_says_so():
    model = make(Looped, block=GridBlock())
    x = randn(3, 8)
    sens = sensitivity_norms(lp.attach(model), x, method="lanczos", max_iter=60, tol=1e-12)
    assert "reverse mode" in sens.jvp_mode and "grid_sampler_2d" in sens.jvp_mode
    assert [e.value for e in sens.visit_norms] == pytest.approx(
        dense_visit_norms(model, x), rel=REL
    )


def test_an_op_with_neither_rule_is_one_error_naming_the_op_and_the_module():
    model = make(Looped, block=CdistBlock())
    with pytest.raises(RuntimeError, match=r"_cdist_forward \(in module 'block'\)"):
        sensitivity_norms(lp.attach(model), randn(3, 8))


class CachingBlock(nn.Module):
    """Writes its buffers in place during a training forward (a cache and a counter)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.register_buffer("cache", torch.zeros(3, d))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.lin(h))
        if self.training:
            self.cache.copy_(y.detach())
            self.calls += 1
        return h + y


def test_in_place_buffer_writes_are_functionalized_and_give_the_dense_norms():
    model = make(Looped, block=CachingBlock())
    x = randn(3, 8)
    before = snapshot(model)
    sens = sensitivity_norms(lp.attach(model), x, method="lanczos", max_iter=60, tol=1e-12)
    assert "block.cache" in sens.jvp_mode and "block.calls" in sens.jvp_mode
    model.eval()  # the writes do not change F: the eval-mode twin is the oracle
    assert [e.value for e in sens.visit_norms] == pytest.approx(
        dense_visit_norms(model, x), rel=REL
    )
    assert_unchanged(model, before)


def test_bound_check_on_a_model_that_writes_buffers_matches_the_eval_mode_twin():
    model = make(Looped, block=CachingBlock())
    x = randn(3, 8)
    loss = lambda out, _: out.square().mean()  # noqa: E731
    before = snapshot(model)
    chk = lp.bound_check(lp.attach(model), x, loss, alpha=1.0, beta=1.0, max_iter=20)
    assert_unchanged(model, before)
    model.eval()  # the writes do not change F: the eval-mode twin (no writes) is the oracle
    twin = lp.bound_check(lp.attach(model), x, loss, alpha=1.0, beta=1.0, max_iter=20)
    assert chk.dF_first == pytest.approx(twin.dF_first, rel=1e-12)
    assert chk.dF_true == pytest.approx(twin.dF_true, rel=1e-9)


# --------------------------------------------------------------------------- precision


class Float32Head(Looped):
    """A float64 model whose output F is cast to float32 (as mixed-precision code does)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).float()


def test_a_float32_output_on_a_float64_model_takes_float32_tolerances_without_false_alarm():
    model = make(Float32Head, block=nn.Sequential(nn.Linear(8, 8), nn.Tanh()), R=4)
    sens = sensitivity_norms(lp.attach(model), randn(6, 8), max_iter=200)
    assert "mixed" in sens.precision and "float32" in sens.precision
    assert sens.converged, sens.reason
    assert max(e.iterations for e in sens.visit_norms) > 3  # 1e-5, not a loose tolerance


def test_a_bfloat16_model_is_never_reported_converged_and_names_the_precision_floor():
    model = make(Looped, block=nn.Sequential(nn.Linear(8, 8), nn.Tanh())).to(torch.bfloat16)
    sens = sensitivity_norms(lp.attach(model), randn(3, 8).to(torch.bfloat16), max_iter=30)
    assert not sens.converged
    assert "precision floor" in sens.reason and "bfloat16" in sens.reason


def test_the_spectral_radius_of_a_round_with_grid_sample_uses_reverse_mode_jvps():
    block = make(GridBlock)
    h = randn(3, 8)
    T = lambda s: block(s)  # noqa: E731
    sr = lp.spectral_radius(T, h, k=1)
    J = jacrev(T)(h).reshape(h.numel(), h.numel())
    rho = float(torch.linalg.eigvals(J.detach()).abs().max())
    assert sr.converged, sr.reason
    assert sr.value == pytest.approx(rho, rel=1e-6)
