"""Forward increments: oracle unrolls, grouping, errors, the growth regimes at init, the CLI."""

from __future__ import annotations

import importlib
import json
import math

import numpy as np
import pytest
import torch
from thirdparty_models import ForLoopModel, SharedBlockModel, make, randn

import loopprobe as lp
from loopprobe.cli import main
from loopprobe.models import GPTConfig, LoopedGPT

inc_mod = importlib.import_module("loopprobe.increments")

# small and fast, but wide enough for the statistics (see test_growth_*)
SIZE = {"d_model": 64, "seq_len": 16, "batch": 4}
SEEDS = (0, 1, 2)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many small ops: one thread is faster, and robust to a busy box
    yield
    torch.set_num_threads(threads)


def _tiny(**kw) -> LoopedGPT:
    cfg = {"vocab_size": 11, "seq_len": 8, "d_model": 16, "n_heads": 2, "K": 1, "R": 4, **kw}
    return LoopedGPT(GPTConfig(**cfg), generator=torch.Generator().manual_seed(0)).double()


def _idx(B: int = 3, T: int = 8, V: int = 11) -> torch.Tensor:
    return torch.randint(V, (B, T), generator=torch.Generator().manual_seed(5))


def _manual_unroll(model: LoopedGPT, idx: torch.Tensor):
    """The pre-norm loop written out by hand: increments per (round, branch) and h_0, h_N."""
    h0 = model.embed(idx)
    h, incs = h0, {"attn": [], "mlp": []}
    for r in range(model.cfg.R):
        blk = model.blocks[0] if model.cfg.tied else model.blocks[r]
        for name in ("attn", "mlp"):
            z = getattr(blk, name)(h)
            incs[name].append(z)
            h = h + z
    return h0, h, incs


def _cos(zs: list[torch.Tensor]) -> np.ndarray:
    Z = torch.stack([z.reshape(-1) for z in zs])
    Z = Z / Z.norm(dim=1, keepdim=True)
    return (Z @ Z.T).detach().numpy()


# --------------------------------------------------------------------------- oracles


def test_increments_of_a_tied_loop_match_a_hand_unrolled_loop():
    model, idx = _tiny(R=4, residual="1/sqrt(N)"), _idx()
    with torch.no_grad():
        h0, hN, incs = _manual_unroll(model, idx)
        inc = lp.increments(model, idx)
    assert inc.grouping == "sublayer" and inc.groups == ["blocks.0.attn", "blocks.0.mlp"]
    for g, name in enumerate(("attn", "mlp")):
        np.testing.assert_allclose(inc.cos[g], _cos(incs[name]), atol=1e-6)
        Z = torch.stack([z.reshape(-1) for z in incs[name]])
        ratio = float(Z.sum(0).norm() ** 2 / (Z.norm(dim=1) ** 2).sum())
        assert inc.ratio[g] == pytest.approx(ratio, rel=1e-6)
    assert inc.hN_source == "forward output"
    assert inc.growth == pytest.approx(float((hN - h0).norm() / h0.norm()), rel=1e-10)
    assert inc.h0_rms == pytest.approx(float(h0.pow(2).mean().sqrt()), rel=1e-10)
    # stream RMS after the last visit is h_N's RMS; after visit 0 it is h_0 + inc_0
    assert inc.stream_rms[-1] == pytest.approx(float(hN.pow(2).mean().sqrt()), rel=1e-10)
    first = h0 + incs["attn"][0]
    assert inc.stream_rms[0] == pytest.approx(float(first.pow(2).mean().sqrt()), rel=1e-10)


def test_ratio_is_the_norm_weighted_sum_of_the_cosine_matrix():
    inc = lp.increments(_tiny(R=5), _idx())
    df = inc.to_frame()
    for g, name in enumerate(inc.groups):
        n = df[df.group == name].sort_values("k")["inc_norm"].to_numpy()
        expected = (np.outer(n, n) * inc.cos[g]).sum() / (n**2).sum()
        assert inc.ratio[g] == pytest.approx(expected, rel=1e-9)
        assert 0.0 <= inc.ratio[g] <= len(n) + 1e-9


def test_untied_stack_is_grouped_by_role_across_its_layers():
    model, idx = _tiny(R=4, tied=False), _idx()
    with torch.no_grad():
        _, _, incs = _manual_unroll(model, idx)
    inc = lp.increments(model, idx)
    assert inc.grouping == "role"
    assert inc.groups == ["blocks.*.attn", "blocks.*.mlp"]
    assert [len(c) for c in inc.cos] == [4, 4]
    np.testing.assert_allclose(inc.cos[1], _cos(incs["mlp"]), atol=1e-6)
    by_sublayer = lp.increments(model, idx, group_by="sublayer")
    assert len(by_sublayer.groups) == 8 and math.isnan(by_sublayer.mean_offdiag_cos)


def test_delta_mode_reads_blocks_that_return_the_updated_stream():
    model, x = make(SharedBlockModel, R=4), randn(3, 6)
    h, zs = x, []
    with torch.no_grad():
        for _ in range(4):
            new = model.block(h)
            zs.append(new - h)
            h = new
    inc = lp.increments(model, x, increment="delta")
    assert inc.hN_source == "last visit input + increment"  # head output is (3, 3)
    assert inc.growth == pytest.approx(float((h - x).norm() / x.norm()), rel=1e-10)
    np.testing.assert_allclose(inc.cos[0], _cos(zs), atol=1e-10)


def test_callable_increment_picks_the_tensor():
    model, x = make(ForLoopModel, K=2, R=3), randn(2, 5)
    a = lp.increments(model, x, increment=lambda rec: rec.output - rec.args[0])
    b = lp.increments(model, x, increment="delta")
    np.testing.assert_allclose(a.cos[0], b.cos[0])
    assert a.groups == ["layers.0", "layers.1"] and a.growth == b.growth


def test_probing_leaves_parameters_grads_mode_and_hooks_unchanged():
    model = _tiny(R=3)
    model.train()
    before = [p.detach().clone() for p in model.parameters()]
    lp.increments(model, _idx())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())
    assert model.training
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == 0


# --------------------------------------------------------------------------- bad input


def test_non_residual_shaped_sublayer_raises_naming_it_and_the_fix():
    probe = lp.attach(make(ForLoopModel, K=1, R=3), sublayers=["layers.*.fc1"])
    with pytest.raises(ValueError, match=r"layers\.0\.fc1.*shape \(2, 8\).*\(2, 6\)") as err:
        lp.increments(probe, randn(2, 5))
    assert "sublayers=" in str(err.value) and "increment='delta'" in str(err.value)


def test_tuple_output_raises_and_suggests_a_callable():
    model, x = make(ForLoopModel, K=1, R=2), randn(2, 5)
    with pytest.raises(ValueError, match="is a tuple.*increment=lambda"):
        lp.increments(model, x, increment=lambda rec: (rec.output,))


def test_bad_group_by_and_increment_raise():
    with pytest.raises(ValueError, match="group_by='layer'"):
        lp.increments(_tiny(), _idx(), group_by="layer")
    with pytest.raises(ValueError, match="increment='out'"):
        lp.increments(_tiny(), _idx(), increment="out")
    with pytest.raises(ValueError, match="tying='shared'"):
        lp.reference_growth("shared", "1/N")


# --------------------------------------------------------------------------- regimes at init


@pytest.fixture(scope="module")
def growths() -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many small ops: one thread is faster, and robust to a busy box
    try:
        return {
            (t, r): lp.reference_growth(t, r, seeds=SEEDS, **SIZE)
            for t, r in [
                ("tied", "1/sqrt(N)"),
                ("tied", "1/N"),
                ("untied", "1/sqrt(N)"),
                ("untied", "1/N"),
            ]
        }
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "tying,residual,slope",
    [("tied", "1/sqrt(N)", 0.5), ("tied", "1/N", 0.0), ("untied", "1/sqrt(N)", 0.0),
     ("untied", "1/N", -0.5)],
)  # fmt: skip
def test_growth_exponent_at_init_matches_the_regime_for_every_seed(growths, tying, residual, slope):
    g = growths[(tying, residual)]
    assert sorted(g.rows["N"].unique()) == [1, 2, 4, 8, 16, 32]
    assert not g.rows["diverged"].any()
    assert g.slope == pytest.approx(slope, abs=0.1)
    assert len(g.slope_per_seed) == len(SEEDS)
    for s in g.slope_per_seed.values():
        assert s == pytest.approx(slope, abs=0.1)


def test_tied_increments_are_aligned_and_untied_ones_uncorrelated(growths):
    # tied under 1/N: the state stays within O(1) of h_0 and the block reads nearly the same
    # input every round; under 1/sqrt(N) it drifts sqrt(N) away and the cosine is lower
    assert growths[("tied", "1/N")].mean_offdiag_cos >= 0.9
    assert growths[("tied", "1/sqrt(N)")].mean_offdiag_cos >= 0.7
    for r in ("1/sqrt(N)", "1/N"):
        assert abs(growths[("untied", r)].mean_offdiag_cos) <= 0.1
    # R = ||sum inc||^2 / sum ||inc||^2: about N when aligned, about 1 when not
    assert growths[("tied", "1/N")].mean_ratio > 0.8 * 32
    assert growths[("untied", "1/N")].mean_ratio == pytest.approx(1.0, abs=0.2)


def test_regimes_are_named(growths):
    assert "under-scaled" in growths[("tied", "1/sqrt(N)")].regime
    assert "loop-scaled" in growths[("tied", "1/N")].regime
    assert "depth-scaled" in growths[("untied", "1/sqrt(N)")].regime
    assert "over-damped" in growths[("untied", "1/N")].regime
    assert lp.regime_name(1.05, 0.8).startswith("correlated, grows like linear")
    assert lp.regime_name(0.3, 0.35) == "partly correlated, between regimes"
    assert lp.regime_name(math.nan, 0.9).startswith("undetermined")


def test_growth_frames_and_figures(growths):
    g = growths[("tied", "1/N")]
    per_N = g.per_N()
    assert list(per_N["N"]) == [1, 2, 4, 8, 16, 32] and (per_N["seeds"] == len(SEEDS)).all()
    fig = g.plot()
    assert len(fig.axes) == 1
    inc = lp.increments(_tiny(R=3), _idx())
    assert len(inc.heatmap().axes) >= 2  # two panels (+ colour bar)
    assert len(inc.cosine_frame()) == 2 * 9
    assert len(inc.stream_plot().axes) == 1


def test_model_embedding_start_keeps_the_first_visit_transient():
    # with the reference model's own embedding (RMS ~0.03) one increment is ~20x h_0
    g = lp.reference_growth("tied", "1/N", Ns=(1, 2), seeds=(0,), h0_rms=None, **SIZE)
    assert g.rows["h0_rms"].max() < 0.05
    assert g.rows["growth"].min() > 10


# --------------------------------------------------------------------------- divergence as data


def test_a_diverging_cell_is_a_row_with_diverged_true_and_the_fit_skips_it():
    def make_model(N: int, seed: int) -> LoopedGPT:
        model = _tiny(R=N, residual="1/N")
        if N == 4:
            with torch.no_grad():
                model.blocks[0].mlp.f.fc2.weight.fill_(float("nan"))
        return model

    g = lp.growth_sweep(make_model, lambda s: _idx(), Ns=(1, 2, 4, 8), seeds=(0,))
    bad = g.rows[g.rows["diverged"]]
    assert list(bad["N"]) == [4] and "non-finite" in bad["error"].iloc[0]
    assert math.isfinite(g.slope)
    assert g.summary()["diverged_rows"] == 1


def test_a_raising_cell_is_data_too():
    def make_model(N: int, seed: int):
        if N == 2:
            raise RuntimeError("boom")
        return _tiny(R=N)

    g = lp.growth_sweep(make_model, lambda s: _idx(), Ns=(1, 2, 4), seeds=(0,))
    assert g.rows.set_index("N").loc[2, "diverged"]
    assert "boom" in g.rows.set_index("N").loc[2, "error"]


# --------------------------------------------------------------------------- CLI


def test_cli_increments_json_has_slope_cosine_regime_and_rows(capsys):
    code = main(["increments", "--tying", "tied", "--residual", "1/N", "--N", "1,2,4",
                 "--seeds", "2", "--d-model", "32", "--seq-len", "8", "--batch", "2",
                 "--json"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert {"growth_slope", "mean_offdiag_cos", "regime", "per_N", "rows"} <= set(out)
    assert len(out["rows"]) == 3 * 2 and [r["N"] for r in out["per_N"]] == [1, 2, 4]
    assert abs(out["growth_slope"]) < 0.2


def test_cli_increments_table_and_bad_values(capsys, tmp_path):
    code = main(["increments", "--tying", "untied", "--residual", "1/sqrt(N)", "--N", "1,2",
                 "--seeds", "1", "--d-model", "16", "--seq-len", "8", "--batch", "2",
                 "--out", str(tmp_path)])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0 and "growth slope" in text and "regime:" in text
    assert (tmp_path / "increments.csv").exists() and (tmp_path / "growth.png").exists()
    with pytest.raises(SystemExit):
        main(["increments", "--residual", "1/M"])
    assert main(["increments", "--N", "1,2", "--h0-rms", "-1"]) == 2
    assert "--h0-rms" in capsys.readouterr().err


def test_module_and_function_names_do_not_collide_for_imports():
    assert callable(lp.increments) and inc_mod.increments is lp.increments
    assert inc_mod.role("blocks.12.attn") == "blocks.*.attn"


def test_outputs_edited_in_place_after_the_visit_are_cloned_unless_copy_is_false():
    from thirdparty_models import InplaceModel

    model, x = make(InplaceModel, R=3), randn(2, 6)
    with torch.no_grad():
        first = model.block(x)  # the block's output before the caller's y.mul_(0.5)
    kept = lp.increments(model, x, increment="output")  # (the block returns the state)
    refs = lp.increments(model, x, increment="output", copy=False)
    assert kept.inc_norm[0] == pytest.approx(float(first.norm()), rel=1e-12)
    assert refs.inc_norm[0] == pytest.approx(0.5 * float(first.norm()), rel=1e-12)
    assert kept.hN_source == "forward output"  # the model returns the (B, d) stream


def test_stream_edited_in_place_after_the_last_visit_cannot_give_h_N():
    class InplaceStream(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blk = torch.nn.Linear(6, 6)
            self.head = torch.nn.Linear(6, 3)

        def forward(self, x):
            h = x.clone()
            for _ in range(3):
                h += 0.1 * self.blk(h)  # the stream the visit read is edited in place
            return self.head(h), h

    model, x = make(InplaceStream), randn(2, 6)
    scaled = lambda rec: 0.1 * rec.output  # noqa: E731
    with pytest.raises(ValueError, match="modified in place.*forward="):
        lp.increments(model, x, increment=scaled)
    inc = lp.increments(model, x, increment=scaled, forward=lambda m, v: m(v)[1])
    assert inc.hN_source == "forward output" and inc.stream_rms.shape == (3,)
    h = x.clone()
    with torch.no_grad():
        rms = []
        for _ in range(3):
            rms.append(float(h.pow(2).mean().sqrt()))
            h += 0.1 * model.blk(h)
    # stream RMS after visits 0 and 1 = what visits 1 and 2 read, taken at call time
    assert inc.stream_rms[:2] == pytest.approx(rms[1:], rel=1e-12)
    assert inc.stream_rms[2] == pytest.approx(float(h.pow(2).mean().sqrt()), rel=1e-12)
