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
from loopprobe.estimate.growth import regime_name
from loopprobe.models import GPTConfig, LoopedGPT

inc_mod = importlib.import_module("loopprobe.estimate.increments")

# small and fast, but wide enough for the statistics (see test_growth_*)
SIZE = {"d_model": 64, "seq_len": 16, "batch": 4}
SEEDS = (0, 1, 2)


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
        lp.experiments.reference_growth("shared", "1/N")


# --------------------------------------------------------------------------- regimes at init


@pytest.fixture(scope="module")
def growths() -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many small ops: one thread is faster, and robust to a busy box
    try:
        return {
            (t, r): lp.experiments.reference_growth(t, r, seeds=SEEDS, **SIZE)
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
    assert regime_name(1.05, 0.8).startswith("correlated, grows like linear")
    assert regime_name(0.3, 0.35) == "partly correlated, between regimes"
    assert regime_name(math.nan, 0.9).startswith("undetermined")


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
    g = lp.experiments.reference_growth("tied", "1/N", Ns=(1, 2), seeds=(0,), h0_rms=None, **SIZE)
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
    assert not g.converged and g.reason.startswith("1 of 4 cells diverged (N=4 seed=0")


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
    assert out["converged"] is True and out["reason"] == ""


def test_cli_increments_table_and_bad_values(capsys, tmp_path):
    code = main(["increments", "--tying", "untied", "--residual", "1/sqrt(N)", "--N", "1,2",
                 "--seeds", "1", "--d-model", "16", "--seq-len", "8", "--batch", "2",
                 "--out", str(tmp_path)])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0 and "growth slope" in text and "regime:" in text
    assert "converged: yes" in text
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


# --------------------------------------------------------------------------- what is measured


class ZeroInitModel(torch.nn.Module):
    """A recurrent cell from a zero state, called as cell(h, x): h_0 = 0 (issue 11.8)."""

    def __init__(self, d: int = 6, R: int = 4) -> None:
        super().__init__()
        self.R = R
        self.fc = torch.nn.Linear(d, d)
        self.cell = Cell(self.fc)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros_like(x)
        for _ in range(self.R):
            h = self.cell(h, x)
        return h


class Cell(torch.nn.Module):
    def __init__(self, fc: torch.nn.Linear) -> None:
        super().__init__()
        self.fc = fc

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(h + x))


class RoutedModel(torch.nn.Module):
    """Mixture-of-depths style: round r sends only the first S - r tokens through the block."""

    def __init__(self, d: int = 6, R: int = 3) -> None:
        super().__init__()
        self.R = R
        self.block = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.clone()
        for r in range(self.R):
            k = h.shape[1] - r
            h = torch.cat([h[:, :k] + torch.tanh(self.block(h[:, :k])), h[:, k:]], dim=1)
        return h


class GateModel(torch.nn.Module):
    """A looped per-token gate: its output is (B, S, 1), the stream (B, S, D)."""

    def __init__(self, d: int = 6, R: int = 3) -> None:
        super().__init__()
        self.R = R
        self.gate = torch.nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.R):
            x = x + torch.sigmoid(self.gate(x)) * x
        return x


def _deltas(blocks, h: torch.Tensor, call=lambda b, h: b(h)) -> list[torch.Tensor]:
    zs = []
    with torch.no_grad():
        for b in blocks:
            new = call(b, h)
            zs.append(new - h)
            h = new
    return zs


def test_auto_measures_output_minus_input_when_the_block_returns_the_state():
    # an untied stack of whole residual blocks x + f(x), as most third-party code writes it
    model, x = make(ForLoopModel, K=1, R=6).untied(), randn(3, 5)
    with torch.no_grad():
        zs = _deltas(model.steps, model.inp(x))
    inc = lp.increments(lp.attach(model, ["steps.*"]), x)
    np.testing.assert_allclose(inc.cos[0], _cos(zs), atol=1e-10)
    assert inc.groups == ["steps.*"] and inc.increment == "output - input"
    assert "next visit reads its output" in inc.evidence["steps.0"]
    assert inc.converged and inc.reason == ""


def test_output_on_a_block_that_returns_the_state_is_measured_but_flagged():
    model, x = make(SharedBlockModel, R=4), randn(3, 6)
    inc = lp.increments(model, x, increment="output")
    assert inc.measured == {"block": "output"}
    assert not inc.converged
    assert "increment='output' but the next visit reads its output" in inc.reason
    assert "increment='delta'" in inc.reason and "converged: NO" in str(inc)
    assert inc.summary()["converged"] is False and inc.to_frame().attrs["reason"] == inc.reason


def test_auto_measures_the_output_of_residual_branches():
    inc = lp.increments(_tiny(R=3), _idx())
    assert inc.measured == {"blocks.0.attn": "output", "blocks.0.mlp": "output"}
    assert all("reads input + output" in e for e in inc.evidence.values())
    assert inc.converged and inc.to_frame().attrs["converged"] is True
    assert set(inc.to_frame()["measured"]) == {"output"} and "converged: yes" in str(inc)


def test_auto_refuses_to_guess_when_the_forward_pass_contradicts_itself():
    # the first cycle starts from z_H = 0, so low's first output looks like an increment
    from thirdparty_models import TruncatedModel

    with pytest.raises(ValueError, match=r"cannot tell whether sublayer 'low'.*says both") as e:
        lp.increments(make(TruncatedModel), randn(3, 6))
    assert "increment='output'" in str(e.value) and "increment='delta'" in str(e.value)
    assert lp.increments(make(TruncatedModel), randn(3, 6), increment="delta").converged


def test_delta_mode_works_for_keyword_only_calls():
    from thirdparty_models import KeywordModel

    model, x = make(KeywordModel, R=4), randn(3, 6)
    zs, h = [], x
    with torch.no_grad():
        for r in range(4):
            new = model.block(hidden=h, scale=1.0 / (r + 1))
            zs.append(new - h)
            h = new
    for mode in ("delta", "auto"):
        inc = lp.increments(model, x, increment=mode)
        np.testing.assert_allclose(inc.cos[0], _cos(zs), atol=1e-10)
        assert inc.growth == pytest.approx(float((h - x).norm() / x.norm()), rel=1e-10)


def test_visits_of_different_shapes_are_refused_naming_routing():
    model, x = make(RoutedModel), randn(2, 5, 6)
    for mode in ("delta", "auto"):
        with pytest.raises(
            ValueError, match=r"different shapes \(r=0: \(2, 5, 6\), r=1: \(2, 4, 6\)"
        ):
            lp.increments(model, x, increment=mode)


def test_a_b_s_1_output_is_not_broadcast_against_the_b_s_d_stream():
    probe = lp.attach(make(GateModel), sublayers=["gate"])
    for mode in ("delta", "auto", "output"):
        with pytest.raises(ValueError, match=r"shape \(2, 5, 1\).*\(2, 5, 6\).*not broadcast"):
            lp.increments(probe, randn(2, 5, 6), increment=mode)


def test_increments_do_not_advance_the_callers_rng_or_change_the_model():
    from thirdparty_models import DropoutLoopModel

    model, x = make(DropoutLoopModel, R=3), randn(3, 6)
    model.train()  # dropout draws from the global RNG
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    lp.increments(model, x, increment="delta")
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert model.training


def test_zero_initial_state_reports_the_absolute_change_and_says_so():
    model, x = make(ZeroInitModel, R=4), randn(3, 6)
    with torch.no_grad():
        zs = _deltas([model.cell] * 4, torch.zeros_like(x), lambda b, h: b(h, x))
    hN = sum(zs)
    inc = lp.increments(model, x)
    assert inc.growth == pytest.approx(float(hN.pow(2).mean().sqrt()), rel=1e-12)
    assert inc.h0_rms == 0.0 and inc.growth_measure.startswith("RMS(h_N - h_0)")
    assert inc.converged and "RMS(h_N - h_0) (h_0 = 0" in str(inc)
    np.testing.assert_allclose(inc.cos[0], _cos(zs), atol=1e-10)
    # at N = 1 the only visit reads h_0 = 0: output and output - input coincide
    g = lp.growth_sweep(
        lambda N, s: make(ZeroInitModel, R=N), lambda s: x, (1, 2, 4), (0,), sublayers=["cell"]
    )
    assert not g.rows["diverged"].any() and math.isfinite(g.slope)
    assert set(g.rows["growth_measure"]) == {inc.growth_measure}


def test_a_zero_increment_makes_the_result_unconverged():
    model = _tiny(R=3)
    with torch.no_grad():
        model.blocks[0].mlp.f.fc2.weight.zero_()
    inc = lp.increments(model, _idx())
    assert np.isnan(inc.cos[1]).all() and not inc.converged
    assert "'blocks.0.mlp' at r=0 is zero, so its cosines are undefined" in inc.reason


def test_growth_sweep_results_carry_converged_and_reason(growths):
    g = growths[("tied", "1/N")]
    assert g.converged and g.reason == "" and "converged: yes" in str(g)
    assert g.summary()["converged"] is True and g.to_frame().attrs["reason"] == ""
    assert g.rows["converged"].all() and set(g.rows["increment"]) == {"output"}


def test_auto_keeps_undecided_outputs_from_in_place_edits_like_delta_does():
    from thirdparty_models import InplaceModel

    model, x = make(InplaceModel, R=3), randn(2, 6)
    auto, delta = lp.increments(model, x), lp.increments(model, x, increment="delta")
    assert auto.measured == {"block": "output - input"}
    with torch.no_grad():
        first = model.block(x) - x  # at the visit's return, before the caller's y.mul_(0.5)
    assert auto.inc_norm[0] == pytest.approx(float(first.norm()), rel=1e-12)
    np.testing.assert_array_equal(auto.inc_norm, delta.inc_norm)
