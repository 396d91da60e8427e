"""loopprobe's parts that serve code it did not write: ``lp.transform_safe`` for any
``torch.func`` call, each U as a scipy ``LinearOperator``, the coord check in mup's format.

Every transform_safe test first shows torch's own refusal without the block, then checks
the answer inside it against a float64 oracle torch computes without loopprobe (reverse
mode through the fused kernel, a central finite difference, or the unwritten function).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as ckpt
from scipy.sparse.linalg import svds
from thirdparty_models import (
    ForLoopModel,
    SharedBlockModel,
    make,
    randn,
)
from torch import nn
from torch.func import functional_call, jacrev, jvp
from torch.nn.attention import _cur_sdpa_kernel_backends

import loopprobe as lp

FUSED = "forward AD with _scaled_dot_product_flash_attention_for_cpu"


def attention(q: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, q, q, is_causal=True)


def jacobian_times(f, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``J v`` from torch's reverse mode, outside any loopprobe block (the oracle)."""
    J = jacrev(f)(x)
    return (J.reshape(-1, x.numel()) @ v.reshape(-1)).reshape(J.shape[: J.dim() - x.dim()])


# --------------------------------------------------------------------------- transform_safe


def test_sdpa_jvp_that_torch_refuses_matches_reverse_mode_and_finite_differences_inside():
    q, v = randn(2, 2, 5, 4), randn(2, 2, 5, 4, seed=2)
    with pytest.raises(NotImplementedError, match=FUSED):
        jvp(attention, (q,), (v,))
    with lp.transform_safe():
        out, Jv = jvp(attention, (q,), (v,))
    eps = 1e-6
    fd = (attention(q + eps * v) - attention(q - eps * v)) / (2 * eps)
    torch.testing.assert_close(out, attention(q), rtol=0, atol=1e-14)
    torch.testing.assert_close(Jv, jacobian_times(attention, q, v), rtol=0, atol=1e-12)
    torch.testing.assert_close(Jv, fd, rtol=0, atol=1e-8)


@pytest.mark.parametrize("training", [True, False])
def test_multihead_attention_jvp_matches_reverse_mode_through_the_fused_kernel(training):
    mha = make(nn.MultiheadAttention, embed_dim=8, num_heads=2, batch_first=True)
    mha.train(training)
    x, v = randn(2, 5, 8), randn(2, 5, 8, seed=2)

    def f(t: torch.Tensor) -> torch.Tensor:
        return mha(t, t, t, need_weights=False)[0]

    with pytest.raises(NotImplementedError, match=FUSED):
        jvp(f, (x,), (v,))
    with lp.transform_safe():
        _, Jv = jvp(f, (x,), (v,))
        J = torch.func.jacfwd(f)(x)
    torch.testing.assert_close(Jv, jacobian_times(f, x, v), rtol=0, atol=1e-12)
    torch.testing.assert_close(J, jacrev(f)(x), rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("use_reentrant", "transform", "refusal"),
    [
        (True, "jvp", "setup_context"),
        (False, "jacrev", "saved tensor hooks"),
    ],
)
def test_checkpointed_segments_run_inline_under_the_transform_torch_refuses(
    use_reentrant, transform, refusal
):
    block = make(lambda: nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)))
    x, v = randn(3, 6), randn(3, 6, seed=2)

    def f(t: torch.Tensor) -> torch.Tensor:
        return ckpt.checkpoint(block, t, use_reentrant=use_reentrant).sin()

    def plain(t: torch.Tensor) -> torch.Tensor:
        return block(t).sin()

    run = {
        "jvp": lambda fn: jvp(fn, (x,), (v,))[1],
        "jacrev": lambda fn: jacrev(fn)(x),
    }[transform]
    with pytest.raises(RuntimeError, match=refusal):
        run(f)
    with lp.transform_safe():
        got = run(f)
    torch.testing.assert_close(got, run(plain), rtol=0, atol=1e-14)


def test_buffers_written_in_forward_are_copies_under_a_transform_and_left_as_they_were():
    bn = make(nn.BatchNorm1d, num_features=4)  # train mode: writes running statistics
    x, v = randn(6, 4), randn(6, 4, seed=2)
    before = {n: b for n, b in bn.named_buffers()}
    with pytest.raises(RuntimeError, match="mutate a captured Tensor"):
        jvp(bn, (x,), (v,))

    def stateless(t: torch.Tensor) -> torch.Tensor:  # the same batch norm, writing nothing
        return F.batch_norm(t, None, None, bn.weight, bn.bias, training=True)

    with lp.transform_safe(bn):
        _, Jv = jvp(bn, (x,), (v,))
        J = jacrev(bn)(x)
        assert {n: b for n, b in bn.named_buffers()} == before  # the same tensors, unwritten
        assert int(bn.num_batches_tracked) == 0
        bn(x)  # outside a transform the module trains as usual
        assert int(bn.num_batches_tracked) == 1
    torch.testing.assert_close(Jv, jvp(stateless, (x,), (v,))[1], rtol=0, atol=1e-13)
    torch.testing.assert_close(J, jacrev(stateless)(x), rtol=0, atol=1e-13)
    assert not bn._forward_hooks and not bn._forward_pre_hooks


def test_leaving_the_block_restores_the_kernel_choice_and_checkpoint_also_on_error():
    backends, function = _cur_sdpa_kernel_backends(), ckpt.CheckpointFunction
    q = randn(1, 1, 3, 2)
    with pytest.raises(ZeroDivisionError), lp.transform_safe():
        assert ckpt.CheckpointFunction is not function
        1 / 0  # noqa: B018
    assert _cur_sdpa_kernel_backends() == backends
    assert ckpt.CheckpointFunction is function
    with pytest.raises(NotImplementedError, match=FUSED):
        jvp(attention, (q,), (q,))


def test_transform_safe_refuses_what_is_not_a_module_and_says_what_to_pass():
    with pytest.raises(TypeError, match=r"transform_safe: got a Tensor; pass the nn.Module"):
        with lp.transform_safe(torch.zeros(1)):
            pass


# --------------------------------------------------------------------------- LinearOperator


def dense_blocks(model: nn.Module, x: torch.Tensor, prefixes: list[str]) -> list[np.ndarray]:
    """Dense dF/d(params under each prefix) of an explicitly untied copy (the oracle)."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    J = jacrev(lambda ps: functional_call(model, ps, (x,)).reshape(-1))(params)
    return [
        torch.cat([J[n].reshape(J[n].shape[0], -1) for n in params if n.startswith(p)], 1).numpy()
        for p in prefixes
    ]


@pytest.fixture(scope="module")
def loop():
    model = make(ForLoopModel, K=2, R=3)  # visit (r, k) is step 2r + k of the untied copy
    x = randn(3, 5)
    blocks = dense_blocks(model.untied(), x, [f"steps.{i}." for i in range(6)])
    return model, x, blocks


def test_operators_are_the_dense_jacobian_blocks_of_the_untied_copy(loop):
    model, x, blocks = loop
    ops = lp.sensitivity_operators(lp.attach(model), x)
    names = ["layers.0", "layers.1"]
    assert set(ops) == {(s, r) for s in names for r in range(3)} | {(s, "tied") for s in names}
    for k, s in enumerate(names):
        mine = blocks[k::2]
        for r, op in [*((r, ops[(s, r)]) for r in range(3)), ("tied", ops[(s, "tied")])]:
            want = sum(mine) if r == "tied" else mine[r]
            m, n = want.shape
            assert op.shape == (m, n) and op.dtype == np.float64
            np.testing.assert_allclose(op.matmat(np.eye(n)), want, rtol=0, atol=1e-12)
            np.testing.assert_allclose(op.rmatmat(np.eye(m)), want.T, rtol=0, atol=1e-12)
            v = np.linspace(-1, 1, n)
            assert (op @ v).shape == (m,)
            np.testing.assert_allclose(op.T @ (op @ v), want.T @ (want @ v), atol=1e-12)


def test_svds_of_each_operator_gives_sensitivity_norms_and_the_dense_top_singular_value(loop):
    model, x, blocks = loop
    probe = lp.attach(model)
    ops = lp.sensitivity_operators(probe, x)
    sens = lp.sensitivity_norms(probe, x, method="lanczos", max_iter=80, tol=1e-12)
    assert sens.converged, sens.reason
    for v, est in zip(sens.visits, sens.visit_norms, strict=True):
        top = float(svds(ops[(v.sublayer, v.r)], k=1, return_singular_vectors=False)[0])
        dense = float(np.linalg.norm(blocks[2 * v.r + v.j], 2))
        assert top == pytest.approx(est.value, rel=1e-8)
        assert top == pytest.approx(dense, rel=1e-8)
    for j, est in sens.tied_norms.items():
        top = float(svds(ops[(sens.sublayers[j], "tied")], k=1, return_singular_vectors=False)[0])
        assert top == pytest.approx(est.value, rel=1e-8)
        assert top == pytest.approx(float(np.linalg.norm(sum(blocks[j::2]), 2)), rel=1e-8)


# --------------------------------------------------------------------------- mup's format

D = 6
PROBE_X = randn(4, D, seed=7)


def make_model(N: int, seed: int) -> nn.Module:
    return make(SharedBlockModel, seed=seed, d=D, R=N)


def batch_fn(step: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(4, D, generator=gen, dtype=torch.float64)
    return x, x[:, :3].sin()


@pytest.fixture(scope="module")
def cc() -> lp.experiments.CoordCheck:
    return lp.experiments.coord_check(
        make_model, batch_fn, PROBE_X, Ns=(1, 2, 4), seeds=(0, 1), steps=2, lr=1e-2,
        loss_fn=F.mse_loss, sublayers=["block"],
    )  # fmt: skip


def test_to_mup_has_mups_columns_with_t_from_1_and_the_coord_checks_own_values(cc):
    df = cc.to_mup()
    assert list(df.columns[:4]) == ["width", "module", "t", "l1"]  # mup's get_coord_data
    assert set(df.module) == {"block first", "block last", "h_N"}
    assert sorted(set(df.t)) == [1, 2, 3]  # mup's t: the forward after t - 1 updates
    assert (df.width == df.N).all() and set(df.width) == {1, 2, 4}
    assert (df.optimizer == "adam").all() and (df.lr == 1e-2).all()
    own = cc.plot_frame("increment")
    own = pd.concat([own, cc.plot_frame("state")])
    own = own.set_index(["N", "seed", "step", "group"])["value"].sort_index()
    mine = df.assign(step=df.t - 1).set_index(["N", "seed", "step", "module"])["l2"]
    np.testing.assert_array_equal(mine.sort_index().to_numpy(), own.to_numpy())
    change = cc.to_mup(change=True)
    assert sorted(set(change.t)) == [1, 2]  # from the first update
    assert (change.l1 > 0).all()


@pytest.mark.parametrize("N", [1, 4])
def test_to_mup_l1_at_t_1_is_the_mean_absolute_activation_of_the_fresh_model(cc, N):
    df = cc.to_mup()
    for seed in (0, 1):
        fresh = make_model(N, seed)
        with torch.no_grad():
            first = fresh.block(PROBE_X)
            h = PROBE_X
            for _ in range(N):
                h = fresh.block(h)
            want = {"block first": first, "block last": h, "h_N": fresh(PROBE_X)}
        rows = df[(df.N == N) & (df.seed == seed) & (df.t == 1)].set_index("module")
        for module, z in want.items():
            assert rows.loc[module, "l1"] == pytest.approx(float(z.abs().mean()), rel=1e-12)
            assert rows.loc[module, "l2"] == pytest.approx(float(z.square().mean().sqrt()))


def test_mups_plot_coord_data_draws_the_frame(cc, tmp_path):
    coord = pytest.importorskip("mup.coord_check")
    import matplotlib
    import matplotlib.pyplot as plt

    matplotlib.use("Agg")
    df = cc.to_mup().query("seed == 0")  # one row per point: no bootstrap intervals to draw
    with matplotlib.rc_context():  # mup calls seaborn.set(), a global style change
        fig = coord.plot_coord_data(df, save_to=str(tmp_path / "cc.png"))
    try:
        assert len(fig.axes) == 3  # one panel per t
        assert all(len(ax.lines) >= 3 for ax in fig.axes)  # a line per module
        image = plt.imread(tmp_path / "cc.png")
        assert image.shape[0] > 100 and float(image[..., :3].std()) > 0.05
    finally:
        plt.close(fig)


def test_to_mup_asks_for_a_scheme_when_the_rows_hold_several_and_for_l1(cc):
    rows = cc.to_frame()
    two = lp.experiments.CoordCheck(
        pd.concat([rows.assign(scheme="a"), rows.assign(scheme="b")]), cc.config
    )
    with pytest.raises(ValueError, match=r"to_mup: the rows hold 2 schemes \['a', 'b'\]"):
        two.to_mup()
    assert len(two.to_mup("b")) == len(cc.to_mup())
    old = lp.experiments.CoordCheck(rows.drop(columns="l1"), cc.config)
    with pytest.raises(ValueError, match="no 'l1' column"):
        old.to_mup()
