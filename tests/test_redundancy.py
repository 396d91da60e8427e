"""lp.redundancy: FlashLoop's observations per loop, against numpy brute force and known answers.

The oracle tensors never come from loopprobe: LoopedGPT is re-implemented in numpy from its
weights (an explicit, untied loop), and x-transformers' K, V and probabilities come from
the test's own hooks on its q/k/v projections. Every metric is then recomputed in numpy
loops (``_redundancy_oracle``) and compared row by row with the library's frame.
"""

from __future__ import annotations

import math

import _redundancy_oracle as oracle
import numpy as np
import pytest
import torch
from _oracles import assert_unchanged, snapshot
from thirdparty_models import ForLoopModel
from torch import nn

import loopprobe as lp
from loopprobe.estimate.redundancy import redundancy
from loopprobe.estimate.redundancy.quant import fake_quant, residual_quantization

FR, KFR, BITS, GROUP = (0.1, 0.25, 0.5), (0.1, 0.2, 0.3, 0.5), (2, 4), 4


def tiny_gpt(R: int = 4) -> lp.models.LoopedGPT:
    cfg = lp.models.GPTConfig(vocab_size=11, seq_len=8, d_model=12, n_heads=2, K=2, R=R)
    return lp.models.LoopedGPT(cfg, generator=torch.Generator().manual_seed(0)).double()


def ids(B: int = 2, T: int = 6, vocab: int = 11) -> torch.Tensor:
    return torch.randint(vocab, (B, T), generator=torch.Generator().manual_seed(1))


def first_tensor(out):
    return out if isinstance(out, torch.Tensor) else out[0]


def frame_rows(res) -> dict:
    return {
        (r.observation, r.layer, r.tensor, r.loop, r.metric, r.param): r.value
        for r in res.frame.itertuples()
    }


def assert_rows_match(got: dict, want: dict, rtol: float = 1e-9) -> None:
    def key(k: tuple) -> tuple:  # NaN params compare equal
        return tuple("nan" if isinstance(x, float) and math.isnan(x) else x for x in k)

    norm = {key(k): v for k, v in got.items()}
    want = {key(k): v for k, v in want.items()}
    assert norm.keys() == want.keys()
    for k, v in want.items():
        assert norm[k] == pytest.approx(v, rel=rtol, abs=1e-12), k


# --------------------------------------------------------------------------- brute force


def test_every_row_on_a_tiny_looped_gpt_matches_a_numpy_loop_written_from_its_weights():
    model, idx = tiny_gpt(), ids()
    states, kv, logits = oracle.numpy_looped_gpt(model, idx)
    np.testing.assert_allclose(logits, model(idx).detach().numpy(), rtol=1e-10, atol=1e-12)
    res = redundancy(model, idx, fractions=FR, key_fractions=KFR, bits=BITS, group=GROUP)
    want = oracle.expected_rows(states, kv, FR, KFR, BITS, GROUP)
    assert len(want) == len(res.frame) == 2 * (18 + 12 + 18 + 6) + 2 * (2 * (18 + 12) + 2 * 24 + 24)
    assert_rows_match(frame_rows(res), want)
    assert res.converged and res.notes == [] and res.layers == {"blocks.0": 4, "blocks.1": 4}


def test_every_row_on_x_transformers_looped_matches_numpy_from_the_tests_own_projection_hooks():
    from realmodels import make_xt_looped

    case = make_xt_looped(R=4)
    m = case.model
    attn = m.get_submodule("attn_layers.layers.0.1")
    got: dict[str, list] = {"q": [], "k": [], "v": [], "state": []}

    def keep(name: str, pick=lambda out: out):
        return lambda mod, args, out: got[name].append(pick(out).detach().numpy())

    hooks = [getattr(attn, f"to_{n}").register_forward_hook(keep(n)) for n in "qkv"]
    hooks.append(m.attn_layers.register_forward_hook(keep("state", lambda out: out[0])))
    with torch.no_grad():
        m(case.inputs)
    for h in hooks:
        h.remove()
    B, T, _ = got["q"][0].shape
    H = 2

    def heads(x):
        return x.reshape(B, T, H, -1).transpose(0, 2, 1, 3)

    caps = []
    for q, k, v in zip(got["q"], got["k"], got["v"], strict=True):
        q, k, v = heads(q), heads(k), heads(v)
        s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1])
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        caps.append((k, v, p / p.sum(-1, keepdims=True)))
    kv = {"attn_layers.layers.0.1.attend": caps}
    want = oracle.expected_rows({"attn_layers": got["state"]}, kv, FR, KFR, BITS, GROUP)
    res = redundancy(m, case.inputs, fractions=FR, key_fractions=KFR, bits=BITS, group=GROUP)
    # x-transformers' softmax runs in float32 (Attend.attn_fn): its probabilities carry 1e-7
    assert_rows_match(frame_rows(res), want, rtol=1e-6)
    assert res.attention == {"attn_layers.layers.0.1.attend": 4}


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("mask", ["none", "bool", "float"])
def test_the_multihead_attention_adapter_gives_torchs_own_per_head_probabilities(batch_first, mask):
    from loopprobe.estimate.redundancy.attention import torch_multihead_attention

    gen = torch.Generator().manual_seed(0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        mha = nn.MultiheadAttention(8, 2, batch_first=batch_first).double()
    x = torch.randn(2, 5, 8, generator=gen, dtype=torch.float64)
    x = x if batch_first else x.transpose(0, 1)
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    additive = torch.randn(5, 5, generator=gen, dtype=torch.float64)
    kw = {"none": {}, "bool": {"attn_mask": causal}, "float": {"attn_mask": additive}}[mask]
    out, want = mha(x, x, x, need_weights=True, average_attn_weights=False, **kw)
    k, v, p = torch_multihead_attention(mha, (x, x, x), kw, None)
    torch.testing.assert_close(p, want, rtol=1e-12, atol=1e-14)
    y = (p @ v).transpose(1, 2).reshape(2, 5, 8) @ mha.out_proj.weight.T + mha.out_proj.bias
    torch.testing.assert_close(y, out if batch_first else out.transpose(0, 1))


def test_a_looped_torch_encoder_layer_has_its_attention_recognised_and_a_bypassed_one_is_noted():
    from realmodels import make_torch_encoder

    case = make_torch_encoder(R=3)
    res = redundancy(case.model, case.inputs)
    assert res.attention == {"layer.self_attn": 3} and res.converged and res.notes == []
    assert set(res.frame.observation) >= {"attention", "quantization"}
    case.model.eval()  # no fused fast path: the hooks see self_attn in eval mode too
    assert redundancy(case.model, case.inputs).attention == {"layer.self_attn": 3}


def test_lazy_update_matches_the_numpy_loop_that_freezes_the_quiet_tokens_by_hand():
    from loopprobe.estimate.redundancy.lazy import lazy_update

    model, idx = tiny_gpt(), ids()
    targets = ids().roll(1, dims=1)
    df = lazy_update(model, idx, fractions=(0.25, 0.5, 1.0), targets=targets).set_index("f")
    _, _, dense = oracle.numpy_looped_gpt(model, idx)

    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    def ce(x):
        lp_ = log_softmax(x).reshape(-1, x.shape[-1])
        return -lp_[np.arange(lp_.shape[0]), targets.numpy().ravel()].mean()

    for f in (0.25, 0.5):
        _, _, lazy = oracle.numpy_looped_gpt(model, idx, lazy=f)
        P, Q = log_softmax(dense), log_softmax(lazy)
        assert df.loc[f, "kl"] == pytest.approx((np.exp(P) * (P - Q)).sum(-1).mean(), rel=1e-9)
        want = np.linalg.norm(lazy - dense) / np.linalg.norm(dense)
        assert df.loc[f, "rel_change"] == pytest.approx(want, rel=1e-9)
        assert df.loc[f, "loss_change"] == pytest.approx(ce(lazy) - ce(dense), rel=1e-9)
        kept = math.ceil(f * 6)  # of 6 tokens, in loops 3 and 4 of 4, in both blocks
        assert df.loc[f, "saved"] == pytest.approx((6 - kept) / 6 * 2 / 4)
    assert df.loc[1.0, ["kl", "rel_change", "saved", "loss_change"]].tolist() == [0, 0, 0, 0]


def test_random_selection_freezes_as_many_tokens_but_other_ones_without_drawing_from_torch():
    from loopprobe.estimate.redundancy.lazy import lazy_update

    model, idx = tiny_gpt(), ids()
    rng = torch.get_rng_state()
    by_score = lazy_update(model, idx, fractions=(0.25, 0.5, 1.0))
    by_chance = lazy_update(model, idx, fractions=(0.25, 0.5, 1.0), select="random")
    assert torch.equal(rng, torch.get_rng_state())
    assert by_chance.saved.tolist() == by_score.saved.tolist()
    assert list(by_chance["select"]) == ["random"] * 3
    assert by_chance.kl.iloc[-1] == 0.0 and (by_chance.kl.iloc[:2] != by_score.kl.iloc[:2]).all()
    again = lazy_update(model, idx, fractions=(0.25, 0.5, 1.0), select="random")
    assert again.kl.tolist() == by_chance.kl.tolist()  # seeded: the same draw


def test_lazy_update_leaves_the_model_unchanged_and_rejects_bad_arguments():
    from loopprobe.estimate.redundancy.lazy import lazy_update

    model, idx = tiny_gpt(R=3), ids()
    before = snapshot(model)
    lazy_update(model, idx)
    assert_unchanged(before, model)
    with pytest.raises(ValueError, match=r"lazy_update: start=2 must be an integer >= 3"):
        lazy_update(model, idx, start=2)
    with pytest.raises(ValueError, match=r"lazy_update: fractions=\(1.5,\) must lie in"):
        lazy_update(model, idx, fractions=(1.5,))
    with pytest.raises(ValueError, match=r"lazy_update: select='top' must be 'score' or"):
        lazy_update(model, idx, select="top")
    with pytest.raises(ValueError, match=r"lazy_update: the layers are visited unequally"):
        lazy_update(model, idx, layers=["blocks.0", "final_norm"])


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_every_row_on_hf_albert_matches_numpy_from_its_returned_attentions(implementation):
    from realmodels import make_albert

    case = make_albert(R=3)
    m = case.model
    m.set_attn_implementation(implementation)
    group = "encoder.albert_layer_groups.0"
    attn = m.get_submodule(f"{group}.albert_layers.0.attention")
    got: dict[str, list] = {"key": [], "value": [], "state": []}

    def keep(name: str, pick=lambda out: out):
        return lambda mod, args, out: got[name].append(pick(out).detach().numpy())

    hooks = [getattr(attn, n).register_forward_hook(keep(n)) for n in ("key", "value")]
    hooks.append(m.get_submodule(group).register_forward_hook(keep("state", first_tensor)))
    with torch.no_grad():
        probs = m(case.inputs, output_attentions=True).attentions  # HF's own, one per call
    for h in hooks:
        h.remove()
    B, T, _ = got["key"][0].shape

    def heads(x):
        return x.reshape(B, T, 2, -1).transpose(0, 2, 1, 3)

    if implementation == "sdpa":
        assert not probs  # HF returns no attentions without the eager path
        probs = [None] * 3
    triples = zip(got["key"], got["value"], probs, strict=True)
    attn_name = f"{group}.albert_layers.0.attention"
    kv = {attn_name: [(heads(k), heads(v), p if p is None else p.numpy()) for k, v, p in triples]}
    want = oracle.expected_rows({group: got["state"]}, kv, FR, KFR, BITS, GROUP)
    res = redundancy(m, case.inputs, fractions=FR, key_fractions=KFR, bits=BITS, group=GROUP)
    if implementation == "sdpa":  # no probabilities: no sparsity rows, and a note
        assert "gave no probabilities" in res.notes[0]
    assert_rows_match(frame_rows(res), want, rtol=1e-8)
    assert res.attention == {attn_name: 3}


# --------------------------------------------------------------------------- known answers


class TwoTokenRound(nn.Module):
    """One round that adds 1 to every channel of token 1 and 3 to every channel of token 4."""

    def __init__(self) -> None:
        super().__init__()
        self.size = nn.Parameter(torch.tensor([1.0, 3.0], dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bump = torch.zeros_like(x)
        bump[:, 1], bump[:, 4] = self.size[0], self.size[1]
        return x + bump


class TwoTokenLoop(nn.Module):
    def __init__(self, R: int = 3) -> None:
        super().__init__()
        self.R, self.round = R, TwoTokenRound()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.R):
            x = self.round(x)
        return x


def test_a_loop_that_changes_exactly_two_tokens_puts_all_change_in_the_top_two():
    # h_t = 1 everywhere but token 1 (1 + t) and token 4 (1 + 3t), over 4 channels:
    # ||dh|| is 2 and 6, score 1/(1+t) and 3/(1+3t): token 4 first, carrying 36/40.
    res = redundancy(TwoTokenLoop(), torch.ones(1, 8, 4, dtype=torch.float64))
    conc = res.frame.query("observation == 'concentration'")
    share = conc.set_index(["metric", "loop", "param"]).value
    for loop, metric in [(2, "share"), (3, "share"), (2, "share_oracle"), (3, "share_oracle")]:
        assert share[(metric, loop, 0.1)] == pytest.approx(0.9)  # ceil(0.8) = 1 token
        assert share[(metric, loop, 0.25)] == 1.0 and share[(metric, loop, 0.5)] == 1.0
    sim = res.frame.query("observation == 'similarity' and loop == 2").set_index("metric").value
    assert sim["rel_prev"] == pytest.approx(math.sqrt(40) / math.sqrt(4 * (6 + 4 + 16)))


def test_residual_quantization_of_a_repeated_tensor_wins_by_two_to_the_bits_minus_one():
    gen = torch.Generator().manual_seed(0)
    K1 = torch.rand(1, 2, 4096, 8, generator=gen, dtype=torch.float64)
    K2 = K1 + 1e-9 * torch.randn(K1.shape, generator=gen, dtype=torch.float64)
    for bits in (2, 4):
        rows = residual_quantization([K1, K2], bits, 64, dim=-2)
        assert rows[0]["ratio"] == 1.0
        # the residual is loop 1's rounding error, spread over one step: 2^b - 1 levels again
        assert rows[1]["ratio"] == pytest.approx(1 / (2**bits - 1), rel=0.1)


def test_a_value_change_on_the_keys_every_query_favours_is_captured_whole_by_that_choice():
    from loopprobe.estimate.redundancy.attention import sparsity

    gen = torch.Generator().manual_seed(0)
    logits = torch.rand(1, 2, 5, 5, generator=gen, dtype=torch.float64)
    logits[..., 2] += 5.0  # key 2 has the largest probability for every query
    p = logits.softmax(-1)
    v0 = torch.randn(1, 2, 5, 3, generator=gen, dtype=torch.float64)
    v1 = v0.clone()
    v1[:, :, 2] += 1.0  # only key 2's value changes: all oracle energy is on key 2
    rows = sparsity(p, v0, p, v1, (0.1, 0.2, 0.5))
    assert [r["fraction"] for r in rows] == [0.1, 0.2, 0.5]
    assert [r["captured"] for r in rows] == pytest.approx([1.0, 1.0, 1.0])
    # k = 1 for f = 0.1, 0.2 (5 keys); at k = 3 the oracle's 2nd and 3rd keys score 0 (a tie)
    assert [r["recall"] for r in rows[:2]] == [1.0, 1.0]
    v1 = v0.clone()
    v1[:, :, 4] += 1.0  # now only the least likely key changes: the top-1 choice misses it
    assert sparsity(p, v0, p, v1, (0.2,))[0]["captured"] == 0.0


def test_fake_quant_keeps_a_constant_group_exactly_and_rounds_to_the_min_max_grid():
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0, 5.0, 5.0]], dtype=torch.float64)
    got = fake_quant(x, 1, 4, dim=-1)  # groups [0, 1, 2, 3] and [5, 5]; 1 bit: {min, max}
    assert got.tolist() == [[0.0, 0.0, 3.0, 3.0, 5.0, 5.0]]  # 0.5 and 1.5 round half to even


# --------------------------------------------------------------------------- safety and input


def test_measuring_leaves_the_model_and_torchs_rng_as_they_were():
    model, idx = tiny_gpt(R=3), ids()
    model.train()
    before = snapshot(model)
    redundancy(model, idx)
    assert_unchanged(before, model)


def test_a_failing_adapter_names_the_module_and_leaves_no_hook_behind():
    model, idx = tiny_gpt(R=3), ids()
    before = snapshot(model)

    def broken(module, args, kwargs, output):
        raise RuntimeError("boom")

    with pytest.raises(
        RuntimeError, match=r"redundancy: the attention adapter of 'blocks.0.attn.f'"
    ):
        redundancy(model, idx, attention={"blocks.0.attn.f": broken})
    assert_unchanged(before, model)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"fractions": (0.0, 0.5)}, ValueError, r"redundancy: fractions=\(0.0, 0.5\) must be"),
        ({"key_fractions": ()}, ValueError, r"redundancy: key_fractions=\(\) must be"),
        ({"bits": (0,)}, ValueError, r"redundancy: bits=\(0,\) must be integers >= 1"),
        ({"group": 0}, ValueError, r"redundancy: group=0 must be an integer >= 1"),
        ({"attention": "blocks.0.attn.f"}, TypeError, r"redundancy: attention='blocks.0.attn.f'"),
        ({"attention": {"nope.*": print}}, ValueError, r"pattern 'nope.\*' matches no module"),
    ],
)
def test_bad_arguments_raise_naming_the_call_the_value_and_the_fix(kwargs, error, match):
    with pytest.raises(error, match=match):
        redundancy(tiny_gpt(R=2), ids(), **kwargs)


def test_an_attention_module_that_is_never_called_is_noted():
    model = TwoTokenLoop()
    model.unused = nn.Linear(4, 4)
    res = redundancy(model, torch.ones(1, 8, 4), attention={"unused": print})
    assert res.attention == {"unused": 0}
    assert res.notes == ["attention unused: never called (a fused fast path may bypass it)"]


def test_a_model_without_recognised_attention_gets_hidden_state_rows_and_a_note():
    model = ForLoopModel().double()
    x = torch.randn(2, 5, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    res = redundancy(model, x)
    assert set(res.frame.observation) == {"similarity", "extrapolation", "concentration"}
    assert res.layers == {"layers.0": 3, "layers.1": 3} and res.attention == {}
    assert "no attention module recognised" in res.notes[0]


def test_a_layer_visited_once_is_reported_as_untrustworthy():
    cfg = lp.models.GPTConfig(vocab_size=11, seq_len=8, d_model=12, n_heads=2, K=1, R=1)
    model = lp.models.LoopedGPT(cfg, generator=torch.Generator().manual_seed(0)).double()
    res = redundancy(model, ids())
    assert not res.converged
    assert res.reason == "layer blocks.0 has 1 loop(s), fewer than 2"
    assert "called once" in res.notes[0]


def test_summary_has_one_column_per_loop_in_order():
    res = redundancy(tiny_gpt(), ids(), group=GROUP)
    wide = res.summary()
    assert list(wide.columns) == [1, 2, 3, 4]
    share = wide.loc[("concentration", "output", "share")]
    assert list(share.index) == [0.1, 0.25, 0.5]
    mean = res.frame.query(
        "observation == 'concentration' and metric == 'share' and param == 0.25 and loop == 3"
    )
    assert share.loc[0.25, 3] == pytest.approx(mean.value.mean())


# --------------------------------------------------------------------------- CLI and plots


def test_cli_prints_the_compact_table_and_json_with_every_row(capsys):
    import json

    from loopprobe.cli import main

    assert main(["redundancy", "--seq-len", "8", "--batch", "1"]) == 0
    text = capsys.readouterr().out
    assert "layers (loops): {'blocks.0': 4, 'blocks.1': 4}" in text
    assert "concentration output share" in text and "quantization  K" in text
    assert "cos_median" not in text  # headline rows only without --all
    assert main(["redundancy", "--seq-len", "8", "--batch", "1", "--json", "--lazy"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["f"] for r in out["lazy"]] == [0.1, 0.25, 0.5, 1.0]
    assert out["converged"] and out["attention"] == {"blocks.0.attn.f": 4, "blocks.1.attn.f": 4}
    res = redundancy(
        lp.models.LoopedGPT(lp.models.GPTConfig(), generator=torch.Generator().manual_seed(0)),
        torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0)),
    )
    assert len(out["rows"]) == len(res.frame)
    got = {(r["observation"], r["layer"], r["tensor"], r["loop"], r["metric"]): r["value"]
           for r in out["rows"] if r["observation"] == "similarity"}  # fmt: skip
    for r in res.frame.query("observation == 'similarity'").itertuples():
        assert got[(r.observation, r.layer, r.tensor, r.loop, r.metric)] == r.value


def test_each_plot_draws_one_line_per_group_and_rejects_a_frame_without_its_rows():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from loopprobe.plots import redundancy as rp

    df = redundancy(tiny_gpt(), ids(), group=GROUP).to_frame()
    ax = rp.token_concentration(df)
    assert len(ax.get_legend().get_texts()) == 3  # f = 0.1, 0.25, 0.5
    ax = rp.kv_quantization(df)
    assert {t.get_text() for t in ax.get_legend().get_texts()} >= {"K", "V", "2 bit", "4 bit"}
    assert len(rp.attention_sparsity(df).get_legend().get_texts()) == 3  # loops 2, 3, 4
    assert len(rp.loop_similarity(df).get_legend().get_texts()) == 3  # output, K, V
    from loopprobe.estimate.redundancy.lazy import lazy_update

    lazy = lazy_update(tiny_gpt(), ids(), fractions=(0.25, 1.0))
    ax = rp.lazy_update_cost(lazy)
    assert [t.get_text() for t in ax.texts] == ["f=0.25", "f=1"]
    plt.close("all")
    with pytest.raises(ValueError, match="lazy_update_cost: the frame needs the columns 'saved'"):
        rp.lazy_update_cost(df)
    hidden_only = df[df.tensor == "output"]
    with pytest.raises(ValueError, match="kv_quantization: the frame has no 'quantization'"):
        rp.kv_quantization(hidden_only)
