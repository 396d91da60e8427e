import math

import pytest
import torch
import torch.nn.functional as F

import loopprobe as lp
from loopprobe.models import (
    GPTConfig,
    HierarchicalLoop,
    HRMConfig,
    LinearLoop,
    LinearLoopConfig,
    LoopedGPT,
)


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def bigram_batch(g, batch=8, seq=16, vocab=16):
    """Sequences that follow a fixed permutation: the next token is a function of this one."""
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(123))
    tokens = [torch.randint(0, vocab, (batch,), generator=g)]
    for _ in range(seq):
        tokens.append(perm[tokens[-1]])
    idx = torch.stack(tokens, dim=1)
    return idx[:, :-1], idx[:, 1:]


@pytest.mark.parametrize("norm", ["pre", "post", "deepnorm", "deeploop"])
def test_looped_gpt_maps_tokens_to_logits_deterministically(norm):
    cfg = GPTConfig(vocab_size=16, seq_len=16, d_model=16, n_heads=2, K=2, R=3, norm=norm)
    idx = torch.randint(0, 16, (2, 12), generator=gen(1))
    a, b = LoopedGPT(cfg, gen(0)), LoopedGPT(cfg, gen(0))
    assert a(idx).shape == (2, 12, 16)
    assert torch.equal(a(idx), b(idx))
    assert not torch.equal(a(idx), LoopedGPT(cfg, gen(1))(idx))


def test_parameter_count_does_not_depend_on_R():
    counts = {
        R: sum(p.numel() for p in LoopedGPT(GPTConfig(K=2, R=R, norm="deeploop")).parameters())
        for R in (1, 2, 8)
    }
    assert len(set(counts.values())) == 1
    untied = LoopedGPT(GPTConfig(K=2, R=4, tied=False))
    assert len(untied.blocks) == 8


def test_forward_equals_embed_then_R_steps_then_head():
    model = LoopedGPT(GPTConfig(K=2, R=3, recall="add", outer_norm=True, prelude=1, coda=1), gen())
    idx = torch.randint(0, 64, (2, 10), generator=gen(2))
    x = model.embed(idx)
    h = x
    for r in range(3):
        h = model.step(h, x, r)
    torch.testing.assert_close(model.head(h), model(idx))


@pytest.mark.parametrize("norm", ["deepnorm", "deeploop"])
def test_beta_gain_lands_on_exactly_the_residual_branch_matrices(norm):
    cfg = GPTConfig(K=2, R=4, norm=norm, prelude=1)
    scaled, plain = (
        LoopedGPT(cfg, gen(3)),
        LoopedGPT(GPTConfig(K=2, R=4, norm="post", prelude=1), gen(3)),
    )
    beta = cfg.beta
    names = set(scaled.beta_matrices())
    assert len(names) == 4 * 2
    plain_params = dict(plain.named_parameters())
    for name, p in scaled.named_parameters():
        if name in names:
            torch.testing.assert_close(p, beta * plain_params[name])
        else:
            torch.testing.assert_close(p, plain_params[name])
    N = cfg.N
    expected = (8 * N) ** (-0.25 if norm == "deepnorm" else -0.5)
    assert math.isclose(beta, expected, rel_tol=1e-12)


def test_residual_multipliers_follow_the_named_rule():
    assert GPTConfig(K=1, R=16, residual="1/sqrt(N)").eps == pytest.approx(0.25)
    assert GPTConfig(K=1, R=16, residual="1/N").eps == pytest.approx(1 / 16)
    assert GPTConfig(K=4, R=2, residual="loop-mup", mup_lambda=2.0).eps == pytest.approx(
        2 / (2 * 2)
    )
    assert GPTConfig(norm="deeploop").eps == 1.0


def _grad_enabled_per_call(model, module, idx):
    flags = []
    handle = module.register_forward_pre_hook(lambda m, a: flags.append(torch.is_grad_enabled()))
    try:
        model(idx)
    finally:
        handle.remove()
    return flags


def test_truncated_backprop_runs_only_the_last_rounds_with_gradient():
    model = LoopedGPT(GPTConfig(K=1, R=5, grad_rounds=2), gen())
    idx = torch.randint(0, 64, (1, 8), generator=gen())
    assert _grad_enabled_per_call(model, model.blocks[0].attn, idx) == [False] * 3 + [True] * 2


def test_hierarchical_loop_gives_gradient_only_to_the_last_cycle():
    cfg = HRMConfig(K_H=1, K_L=2, C=3, C_L=2)
    model = HierarchicalLoop(cfg, gen())
    idx = torch.randint(0, 64, (1, 8), generator=gen())
    L_flags = _grad_enabled_per_call(model, model.L_blocks[0].mlp, idx)
    H_flags = _grad_enabled_per_call(model, model.H_blocks[0].attn, idx)
    assert L_flags == [False] * 4 + [True] * 2
    assert H_flags == [False, False, True]
    assert (cfg.M, cfg.M_g) == (2 * 3 * (1 + 2 * 2), 2 * (1 + 2 * 2))


def test_linear_loop_matches_its_closed_form():
    cfg = LinearLoopConfig(d=6, R=5, spectrum=(-1.0, -0.5, 0.0, 0.5, 1.0, 2.0))
    model = LinearLoop(cfg, gen()).double()
    x = torch.randn(3, 6, generator=gen(4), dtype=torch.float64)
    A = model.transition_matrix()
    torch.testing.assert_close(model(x), x @ torch.linalg.matrix_power(A, 5).t())
    eig = torch.linalg.eigvalsh(model.W.weight.detach())
    torch.testing.assert_close(eig, torch.tensor(sorted(cfg.spectrum), dtype=torch.float64))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"K": 0}, "K"),
        ({"R": 0}, "R"),
        ({"d_model": 30, "n_heads": 4}, "d_model"),
        ({"norm": "sandwich"}, "norm"),
        ({"residual": "1/N^2"}, "residual"),
        ({"norm": "postp", "p": -0.5}, "p"),
        ({"recall": "concat"}, "recall"),
    ],
)
def test_invalid_configs_raise_value_errors_that_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        GPTConfig(**kwargs)


def test_invalid_hrm_and_linear_configs_raise_value_errors():
    with pytest.raises(ValueError, match="C_L"):
        HRMConfig(C_L=0)
    with pytest.raises(ValueError, match="form"):
        LinearLoopConfig(form="tanh")


def _train(model, steps=40, lr=1e-2, seed=0):
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    g = gen(seed)
    losses = []
    for _ in range(steps):
        idx, tgt = bigram_batch(g)
        loss = F.cross_entropy(model(idx).flatten(0, 1), tgt.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "model",
    [
        LoopedGPT(
            GPTConfig(
                vocab_size=16,
                seq_len=16,
                d_model=16,
                n_heads=2,
                K=1,
                R=3,
                norm="pre",
                residual="1/N",
            ),
            gen(),
        ),
        LoopedGPT(
            GPTConfig(
                vocab_size=16,
                seq_len=16,
                d_model=16,
                n_heads=2,
                K=2,
                R=2,
                norm="deeploop",
                recall="linear",
                outer_norm=True,
            ),
            gen(),
        ),
        HierarchicalLoop(
            HRMConfig(vocab_size=16, seq_len=16, d_model=16, n_heads=2, norm="deeploop"), gen()
        ),
    ],
    ids=["gpt-pre", "gpt-deeploop", "hrm"],
)
def test_reference_models_train_with_finite_decreasing_loss(model):
    losses = _train(model)
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5


def test_linear_loop_trains_on_a_regression_target():
    model = LinearLoop(LinearLoopConfig(d=4, R=3), gen())
    target = torch.randn(4, 4, generator=gen(5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(30):
        x = torch.randn(16, 4, generator=gen(len(losses)))
        loss = (model(x) - x @ target.t()).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_models_are_reachable_from_the_single_import_path():
    assert lp.models.LoopedGPT is LoopedGPT


def test_reference_models_convert_to_float64_like_any_module():
    hrm = HierarchicalLoop(HRMConfig(), gen()).double()
    gpt = LoopedGPT(GPTConfig(), gen()).double()
    idx = torch.randint(0, 64, (1, 8), generator=gen())
    assert hrm(idx).dtype == torch.float64
    assert gpt(idx).dtype == torch.float64


def test_building_a_model_with_a_generator_leaves_the_global_rng_alone():
    before = torch.random.get_rng_state()
    LoopedGPT(GPTConfig(recall="linear", tie_embeddings=False), gen())
    HierarchicalLoop(HRMConfig(), gen())
    LinearLoop(LinearLoopConfig(recall=True), gen())
    assert torch.equal(torch.random.get_rng_state(), before)


# ---- the seed's backbone options: RoPE and an input-embedding RMSNorm (issue 39.1)


def test_rope_is_the_explicit_pair_rotation_in_float64():
    from loopprobe.models.layers import rope

    T, hd, base = 5, 6, 10_000.0
    t = torch.randn(2, 3, T, hd, generator=gen(1), dtype=torch.float64)
    want = torch.empty_like(t)
    for m in range(T):
        for i in range(hd // 2):
            a = m * base ** (-2 * i / hd)
            R = torch.tensor([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]],
                             dtype=torch.float64)  # fmt: skip
            pair = torch.stack([t[..., m, i], t[..., m, i + hd // 2]], dim=-1)
            out = pair @ R.T
            want[..., m, i], want[..., m, i + hd // 2] = out[..., 0], out[..., 1]
    torch.testing.assert_close(rope(t), want, rtol=0, atol=1e-12)


def test_rope_scores_depend_on_positions_only_through_their_difference():
    from loopprobe.models.layers import rope

    T = 7
    q = torch.randn(8, generator=gen(2), dtype=torch.float64).expand(T, 8)
    k = torch.randn(8, generator=gen(3), dtype=torch.float64).expand(T, 8)
    s = rope(q) @ rope(k).T  # s[m, n] = <R_m q, R_n k>
    for d in range(-T + 1, T):
        diag = torch.diagonal(s, offset=d)
        torch.testing.assert_close(diag, diag[:1].expand_as(diag), rtol=0, atol=1e-12)
    assert not torch.allclose(s[0, 1], s[0, 2])  # and it does depend on the difference


def test_looped_gpt_with_rope_has_no_position_table_is_causal_and_sees_order():
    # one block applied once: without positions, position 2 would be blind to the order of 0, 1
    cfg = GPTConfig(vocab_size=16, seq_len=8, d_model=16, n_heads=2, K=1, R=1, position="rope")
    model = LoopedGPT(cfg, generator=gen(0)).eval()
    assert model.pos_emb is None and "pos_emb.weight" not in model.state_dict()
    idx = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        out = model(idx)
        later = idx.clone()
        later[0, 4:] = 0
        torch.testing.assert_close(model(later)[:, :4], out[:, :4])  # causal
        swapped = idx[:, [1, 0, 2, 3, 4, 5]]
        assert (model(swapped)[0, 2] - out[0, 2]).abs().max() > 1e-4


def test_embed_norm_normalises_the_input_embedding_and_defaults_are_unchanged():
    cfg = GPTConfig(vocab_size=16, seq_len=8, d_model=16, n_heads=2, K=1, R=2, embed_norm=True)
    model = LoopedGPT(cfg, generator=gen(0))
    idx = torch.randint(0, 16, (3, 8), generator=gen(4))
    with torch.no_grad():
        x = model.embed(idx)
        e = model.tok_emb.weight[idx] + model.pos_emb.weight[:8]
    want = e / torch.sqrt(e.pow(2).mean(-1, keepdim=True) + 1e-6)  # RMSNorm, weight 1 at init
    torch.testing.assert_close(x, want, rtol=1e-5, atol=1e-6)
    assert (x.pow(2).mean(-1) - 1).abs().max() < 1e-2
    default = LoopedGPT(GPTConfig(vocab_size=16, seq_len=8, d_model=16, n_heads=2, K=1, R=2),
                        generator=gen(0))  # fmt: skip
    keys = set(default.state_dict())
    assert "pos_emb.weight" in keys and not any(k.startswith("embed_norm") for k in keys)
    assert set(model.state_dict()) == keys | {"embed_norm.weight"}
    same = {k: v for k, v in model.state_dict().items() if k in keys}
    for k, v in default.state_dict().items():  # the option draws nothing: same init
        torch.testing.assert_close(same[k], v, rtol=0, atol=0)


def test_backbone_options_are_checked_and_the_flt_refuses_them():
    with pytest.raises(ValueError, match="position='alibi'.*learned.*rope"):
        GPTConfig(position="alibi")
    with pytest.raises(ValueError, match="even head size; got d_model / n_heads = 3"):
        GPTConfig(d_model=12, n_heads=4, position="rope")
    from loopprobe.models import FullyLoopedGPT

    with pytest.raises(ValueError, match=r"\['position', 'embed_norm'\] are not supported"):
        FullyLoopedGPT(GPTConfig(position="rope", embed_norm=True))
