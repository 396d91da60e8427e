"""Coordinate check across N: row layout, oracle changes, the N-scaling it shows, CLI."""

from __future__ import annotations

import importlib
import json
import math

import numpy as np
import pytest
import torch

import loopprobe as lp
from loopprobe import tasks
from loopprobe.cli import main
from loopprobe.models import GPTConfig, LoopedGPT

cc_mod = importlib.import_module("loopprobe.experiments.coordcheck")

SMALL = {"d_model": 32, "seq_len": 16, "batch": 4}


@pytest.fixture(scope="module")
def prenorm() -> lp.experiments.CoordCheck:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return lp.experiments.reference_coord_check(
            ["pre:none", "pre:1/sqrt(N)", "pre:1/N"], Ns=(1, 2, 4, 8), seeds=(0, 1), steps=2,
            lr=1e-3, **SMALL,
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)


def test_rows_cover_every_N_seed_step_visit_and_quantity(prenorm):
    df = prenorm.to_frame()
    one = df[(df.scheme == "pre:1/N") & (df.N == 4) & (df.seed == 1)]
    # 3 steps x (2 sublayers x 4 visits + h_N) x 2 quantities (size, change)
    assert len(one) == 3 * (2 * 4 + 1) * 2
    assert set(df.quantity) == set(cc_mod.QUANTITIES)
    assert not df.diverged.any()
    step0 = df[(df.step == 0) & df.quantity.str.endswith("_change")]
    assert (step0.value == 0).all()
    pos = one[(one.sublayer == "blocks.0.attn") & (one.step == 0) & (one.quantity == "increment")]
    assert list(pos.sort_values("r").position) == ["first", "mid", "mid", "last"]


def test_change_since_step_0_matches_a_hand_written_training_loop():
    cfg = GPTConfig(vocab_size=256, seq_len=8, d_model=16, n_heads=2, K=1, R=3, residual="1/N")
    probe_idx = torch.randint(256, (2, 8), generator=torch.Generator().manual_seed(3))

    def batch_fn(step, gen):
        return tasks.stdlib_text(2, 8, gen)

    def make(N, seed):
        return LoopedGPT(cfg, generator=torch.Generator().manual_seed(seed))

    cc = lp.experiments.coord_check(make, batch_fn, probe_idx, Ns=[3], seeds=[0], steps=2, lr=1e-2)
    # the same run by hand
    model = make(3, 0)
    opt = cc_mod.make_optimizer(model, "adam", 1e-2)
    gen = torch.Generator().manual_seed(1_000)
    with torch.no_grad():
        h0 = model.hidden(probe_idx)
    for step in range(2):
        x, y = batch_fn(step, gen)
        opt.zero_grad()
        cc_mod.lm_loss(model(x), y).backward()
        opt.step()
    with torch.no_grad():
        h2 = model.hidden(probe_idx)
    df = cc.to_frame()
    got = df[(df.step == 2) & (df.quantity == "state_change")].value.item()
    assert got == pytest.approx(float((h2 - h0).pow(2).mean().sqrt()), rel=1e-6)
    size = df[(df.step == 2) & (df.quantity == "state")].value.item()
    assert size == pytest.approx(float(h2.pow(2).mean().sqrt()), rel=1e-6)


def test_final_state_change_grows_with_N_unless_the_branch_is_scaled_by_1_over_N(prenorm):
    flat = prenorm.flatness("state_change").set_index("scheme")
    slope = flat.loc[flat.group == "h_N", "slope"]
    # Adam moves each shared weight by ~lr and the N visits add that coherently, so
    # ||Delta h_N|| ~ lr eps N (seed 004 Thm 2): slopes 1, 1/2, 0. Measured at this size
    # (d=32, 2 steps, h_0 RMS 1): about 1.4, 0.75, 0.15 (see README)
    assert slope["pre:none"] > 1.0
    assert 0.45 < slope["pre:1/sqrt(N)"] < 1.0
    assert abs(slope["pre:1/N"]) < 0.3
    assert slope["pre:none"] - slope["pre:1/sqrt(N)"] > 0.3
    assert slope["pre:1/sqrt(N)"] - slope["pre:1/N"] > 0.3


def test_plot_has_one_panel_per_step_and_a_line_per_group(prenorm):
    fig = prenorm.plot("pre:1/N", "increment_change")
    assert len(fig.axes) == 2  # steps 1 and 2 (step 0 has no change)
    groups = set(prenorm.plot_frame("increment_change", "pre:1/N").group)
    assert groups == {"attn first", "attn last", "mlp first", "mlp last"}
    # N = 1: the single visit is both the first and the last
    pf = prenorm.plot_frame("increment", "pre:1/N")
    assert set(pf[pf.N == 1].group) == {"attn first", "attn last", "mlp first", "mlp last"}
    assert len(prenorm.plot("pre:none", "state").axes) == 3
    with pytest.raises(ValueError, match="scheme='pre:2/N'"):
        prenorm.plot("pre:2/N")
    with pytest.raises(ValueError, match="quantity='size'"):
        prenorm.plot_frame("size")


def test_postnorm_deeploop_is_flatter_in_N_than_deepnorm_after_one_step():
    cc = lp.experiments.reference_coord_check(
        ["deepnorm", "deeploop"], Ns=(1, 2, 4, 8), seeds=(0,), steps=1, lr=1e-4, **SMALL
    )
    f = cc.flatness("state_change").set_index("scheme")
    assert f.loc["deeploop", "slope"] < f.loc["deepnorm", "slope"]
    assert abs(f.loc["deeploop", "slope"]) < 0.15


def test_places_group_untied_layers_by_role_and_name_clashing_sublayers():
    names = ["blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp"]
    assert cc_mod._places(names) == [
        ("attn", "first"), ("mlp", "first"), ("attn", "last"), ("mlp", "last")
    ]  # fmt: skip
    tied2 = ["blocks.0.attn", "blocks.1.attn", "blocks.0.attn", "blocks.1.attn"]
    assert cc_mod._places(tied2)[0] == ("blocks.0.attn", "first")
    assert cc_mod._places(["blocks.0.attn"]) == [("attn", "only")]


def test_divergence_is_recorded_as_rows_with_diverged_true():
    cfg = GPTConfig(vocab_size=256, seq_len=8, d_model=16, n_heads=2, K=1, R=2)

    def make(N, seed):
        m = LoopedGPT(cfg, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            m.tok_emb.weight.mul_(1e30)  # softmax/linear overflow -> NaN loss
            m.tok_emb.weight[0, 0] = math.inf
        return m

    def batch_fn(step, gen):
        x = torch.zeros(2, 8, dtype=torch.long)
        return x, x

    cc = lp.experiments.coord_check(
        make, batch_fn, torch.zeros(2, 8, dtype=torch.long), Ns=[2], seeds=[0]
    )
    df = cc.to_frame()
    assert df.diverged.any()
    assert df[df.diverged].step.min() >= 0 and df.step.max() <= 1


def test_bad_arguments_raise_with_the_fix():
    with pytest.raises(ValueError, match="scheme 'pre:2/N'"):
        lp.experiments.reference_coord_check(["pre:2/N"])
    with pytest.raises(ValueError, match="multiple of K=2"):
        lp.experiments.reference_coord_check(["pre:1/N"], Ns=[1, 2], K=2)
    with pytest.raises(ValueError, match="steps=0"):
        lp.experiments.reference_coord_check(["pre:1/N"], steps=0)
    with pytest.raises(ValueError, match="optimizer='lion'"):
        cc_mod.make_optimizer(torch.nn.Linear(2, 2), "lion", 1e-3)


def test_the_reference_model_of_a_sweep_cell_is_seeded_by_the_cell_and_built_from_its_config():
    from loopprobe.experiments._reference import reference_gpt

    cell = {"seq_len": 8, "d_model": 8, "n_heads": 2, "seed": 3, "N": 2}
    spec = dict(K=1, R=2, norm="pre", residual="1/N", tied=False)
    a, again = reference_gpt(cell, **spec), reference_gpt(dict(cell), **spec)
    other = reference_gpt({**cell, "seed": 4}, **spec)
    sa, s_again, s_other = (m.state_dict() for m in (a, again, other))
    assert all(torch.equal(sa[k], s_again[k]) for k in sa)  # the same cell, the same model
    drawn = [k for k in sa if sa[k].dim() == 2]  # embeddings and matrices (norms start at 1)
    assert drawn and not any(torch.equal(sa[k], s_other[k]) for k in drawn)
    c = a.cfg
    assert (c.vocab_size, c.seq_len, c.d_model, c.n_heads, c.K, c.R, c.residual, c.tied) == (
        256, 8, 8, 2, 1, 2, "1/N", False)  # fmt: skip
    assert reference_gpt(cell, vocab_size=11, **spec).cfg.vocab_size == 11


def test_cli_coord_check_writes_csv_and_one_figure_per_scheme_and_quantity(tmp_path, capsys):
    code = main(["coord-check", "--schemes", "pre:1/sqrt(N),deeploop", "--N", "1,2",
                 "--seeds", "1", "--steps", "1", "--d-model", "16", "--seq-len", "8",
                 "--batch", "2", "--out", str(tmp_path), "--json"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert (tmp_path / "coord_check.csv").exists()
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == [
        "deeploop_increment_change.png", "deeploop_state_change.png",
        "pre_1_sqrt_N_increment_change.png", "pre_1_sqrt_N_state_change.png",
    ]  # fmt: skip
    slopes = out["flatness"]["state_change"]
    assert {r["scheme"] for r in slopes} == {"pre:1/sqrt(N)", "deeploop"}
    assert all(np.isfinite(r["slope"]) for r in slopes)
    assert main(["coord-check", "--out", str(tmp_path), "--quantities", "speed"]) == 2
