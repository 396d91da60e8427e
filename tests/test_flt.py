"""FullyLoopedGPT (issue 30.5): shapes, tying, the injection path against a hand-written twin."""

from __future__ import annotations

import math

import pytest
import torch

import loopprobe as lp
from loopprobe.models import FullyLoopedGPT, GPTConfig, LoopedGPT

CFG = GPTConfig(vocab_size=16, seq_len=8, d_model=8, n_heads=2, K=2, R=3)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def tokens(B=2, T=8, seed=1) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (B, T), generator=gen(seed))


def twin(sd: dict, cfg: GPTConfig, idx: torch.Tensor, inject: bool = True) -> torch.Tensor:
    """The paper's equations on raw tensors (float64), no loopprobe module involved:
    every loop restarts from the embedding x; for t > 1 each layer's attention reads
    queries W_Q Norm(h_L^(t-1)) and keys/values W_K, W_V Norm(z)."""
    sd = {k: v.double() for k, v in sd.items()}
    T, D, H = idx.shape[1], cfg.d_model, cfg.n_heads

    def norm(v, w):
        return v / v.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * w

    def attn(p, qin, kvin):
        def split(t):
            return t.reshape(t.shape[0], T, H, D // H).transpose(1, 2)

        q, k, v = (split(inp @ sd[f"{p}.{n}.weight"].T) for n, inp in
                   (("q", qin), ("k", kvin), ("v", kvin)))  # fmt: skip
        s = q @ k.transpose(-1, -2) / math.sqrt(D // H)
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf)
        y = (s.softmax(-1) @ v).transpose(1, 2).reshape(-1, T, D)
        return y @ sd[f"{p}.o.weight"].T

    x = sd["tok_emb.weight"][idx] + sd["pos_emb.weight"][:T]
    h = None
    for t in range(cfg.R):
        z = x
        for b in range(cfg.K):
            w = sd[f"blocks.{b}.attn.norm.weight"]
            zn = norm(z, w)
            qn = zn if (t == 0 or not inject) else norm(h, w)
            z = z + attn(f"blocks.{b}.attn.f", qn, zn)
            m = norm(z, sd[f"blocks.{b}.mlp.norm.weight"])
            fc1, fc2 = sd[f"blocks.{b}.mlp.f.fc1.weight"], sd[f"blocks.{b}.mlp.f.fc2.weight"]
            z = z + torch.nn.functional.gelu(m @ fc1.T) @ fc2.T
        h = z
    return norm(h, sd["final_norm.weight"]) @ sd["tok_emb.weight"].T


def test_logits_and_hidden_have_the_lm_shapes():
    model = FullyLoopedGPT(CFG, generator=gen())
    idx = tokens(B=3, T=5)
    assert model(idx).shape == (3, 5, CFG.vocab_size)
    assert model.hidden(idx).shape == (3, 5, CFG.d_model)


def test_flt_has_exactly_the_lt_parameters_and_the_same_init_for_one_seed():
    lt, flt = LoopedGPT(CFG, generator=gen(3)), FullyLoopedGPT(CFG, generator=gen(3))
    a, b = lt.state_dict(), flt.state_dict()
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.allclose(lt(tokens()), flt(tokens()))  # same weights, other computation


def test_forward_matches_the_hand_written_equations_in_float64():
    model = FullyLoopedGPT(CFG, generator=gen()).double()
    idx = tokens()
    with torch.no_grad():
        out = model(idx)
    torch.testing.assert_close(out, twin(model.state_dict(), CFG, idx), rtol=1e-10, atol=1e-12)


def test_without_injection_every_loop_repeats_the_first_so_it_is_a_one_loop_lt():
    flt = FullyLoopedGPT(CFG, generator=gen(), inject=False).double()
    one = LoopedGPT(GPTConfig(**{**CFG.__dict__, "R": 1})).double()
    one.load_state_dict(flt.state_dict())
    idx = tokens()
    with torch.no_grad():
        torch.testing.assert_close(flt(idx), one(idx))
        assert not torch.allclose(FullyLoopedGPT(CFG, generator=gen()).double()(idx), flt(idx))


def test_the_carried_state_enters_through_the_queries_position_by_position():
    # one block: h at j moves only the query at j (with K = 2, output j is also a key of
    # the second block, so later positions would move too)
    model = FullyLoopedGPT(GPTConfig(**{**CFG.__dict__, "K": 1}), generator=gen()).double()
    idx = tokens(B=1)
    j = 5
    with torch.no_grad():
        x = model.embed(idx)
        h = torch.randn(x.shape, generator=gen(7), dtype=x.dtype)
        h2 = h.clone()
        h2[:, j] += 1.0
        base, moved = model.step(h, x, r=1), model.step(h2, x, r=1)
        assert torch.equal(base[:, :j], moved[:, :j])  # a query at j changes only output j
        assert (base[:, j] - moved[:, j]).abs().max() > 1e-3
        assert torch.equal(base[:, j + 1 :], moved[:, j + 1 :])
        assert torch.equal(model.step(h, x, r=0), model.step(h2, x, r=0))  # loop 1: plain


def test_attach_finds_one_physical_block_pair_visited_every_loop():
    model = FullyLoopedGPT(CFG, generator=gen())
    with lp.attach(model) as probe:
        table = probe.visit_table(tokens())
    assert list(table["sublayer"]) == [f"blocks.{k}.{s}" for k in range(2) for s in ("attn", "mlp")]
    assert set(table["visits"]) == {CFG.R}
    assert table.attrs["M"] == CFG.M


def test_per_visit_gradients_of_the_injected_attention_sum_to_the_tied_gradient():
    model = FullyLoopedGPT(CFG, generator=gen()).double()
    idx, tgt = tokens(), tokens(seed=2)
    with lp.attach(model) as probe:
        ups = lp.per_visit_updates(probe, idx, lambda out, _i: lp.tasks.lm_loss(out, tgt))
    assert ups.converged, ups.reason
    lp.tasks.lm_loss(model(idx), tgt).backward()
    grad = torch.cat([p.grad.flatten() for p in model.blocks[0].attn.parameters()])
    assert float(ups.tied(0).norm()) == pytest.approx(float(grad.norm()), rel=1e-9)
    assert model.blocks[0].attn.f.q.weight.grad.abs().sum() > 0


def test_construction_is_deterministic_and_leaves_the_global_rng_alone():
    state = torch.random.get_rng_state()
    a, b = FullyLoopedGPT(CFG, generator=gen(5)), FullyLoopedGPT(CFG, generator=gen(5))
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    c = FullyLoopedGPT(CFG, generator=gen(6))
    assert not torch.equal(a.blocks[0].attn.f.q.weight, c.blocks[0].attn.f.q.weight)


@pytest.mark.parametrize(
    "field", [{"norm": "post"}, {"recall": "add"}, {"outer_norm": True}, {"tied": False}]
)
def test_unsupported_config_fields_are_a_value_error_naming_them(field):
    cfg = GPTConfig(**{**CFG.__dict__, **field})
    with pytest.raises(ValueError, match=next(iter(field))):
        FullyLoopedGPT(cfg)
    with pytest.raises(TypeError, match="GPTConfig"):
        FullyLoopedGPT({"K": 2})
