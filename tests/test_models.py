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
