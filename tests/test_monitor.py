"""lp.Monitor: the training state is untouched, the frame equals the direct estimator calls,
schedules run the steps they say, sinks write what the frame holds, and bad input is named."""

from __future__ import annotations

import copy
import pathlib
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from _oracles import assert_unchanged, snapshot
from torch import nn

import loopprobe as lp
from loopprobe.monitor.monitor import COLUMNS, KAPPA_TOL, Monitor, dense_early
from loopprobe.monitor.sinks import CallableSink, FileSink, TensorBoardSink, read_frame
from loopprobe.plots.monitor import kappa_vs_step, visit_heatmap

EVERYTHING = ["updates", "increments", "kappa", "sensitivity", "rho", "bound"]


def tiny(dropout: float = 0.0) -> lp.models.LoopedGPT:
    cfg = lp.models.GPTConfig(
        K=1, R=3, d_model=8, n_heads=2, seq_len=6, vocab_size=16, norm="deeploop", dropout=dropout
    )
    return lp.models.LoopedGPT(cfg, generator=torch.Generator().manual_seed(0)).double()


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return lp.tasks.random_tokens(2, 6, 16, generator=torch.Generator().manual_seed(seed))


IDX, TGT = batch()


def loss_fn(out: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), TGT.flatten())


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, gen: torch.Generator):
    for _ in range(steps):
        idx, tgt = lp.tasks.random_tokens(2, 6, 16, generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(idx).flatten(0, 1), tgt.flatten()).backward()
        opt.step()


class WithBuffer(nn.Module):
    """A looped model with a buffer written in training-mode forward (a call counter)."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = tiny(dropout=0.1)
        self.register_buffer("calls", torch.zeros((), dtype=torch.float64))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        return self.gpt(idx)


def noisy_round(model: WithBuffer, inputs: torch.Tensor):
    """A user's round builder that runs the model in training mode first (dropout draws from
    the global RNG, the buffer counts the call) and leaves it in eval mode: only the
    monitor's own guard, not an estimator's, can undo that."""
    with torch.no_grad():
        model(inputs)
    model.eval()
    return lp.round_map(model.gpt, inputs)


def optimizer_state(opt: torch.optim.Optimizer) -> dict:
    return copy.deepcopy(opt.state_dict())


def assert_same_state(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for k, st in a["state"].items():
        for name, v in st.items():
            w = b["state"][k][name]
            assert torch.equal(v, w) if torch.is_tensor(v) else v == w, (k, name)


# --------------------------------------------------------------- the training is untouched


def trained_with_buffer() -> tuple[WithBuffer, torch.optim.Optimizer, torch.Generator]:
    model = WithBuffer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(7)
    train(model, opt, 2, gen)  # .grad, Adam moments and the buffer all non-trivial
    return model, opt, gen


def test_monitor_step_leaves_params_grads_buffers_modes_optimizer_and_both_rngs_unchanged():
    model, opt, gen = trained_with_buffer()
    # "bound" is left out here: bound_check's JVP refuses a forward that writes a buffer
    # (it is checked on a buffer-free model in the frame test below, with the same snapshot)
    mon = Monitor(
        model,
        IDX,
        loss_fn,
        diagnostics=EVERYTHING[:-1],
        every=1,
        update=opt,
        options={"rho": {"round": noisy_round}},
    )
    before, opt_before, gen_before = snapshot(model), optimizer_state(opt), gen.get_state()
    assert model.calls.item() == 2 and all(p.grad is not None for p in model.parameters())
    rows = mon.step(3, loss=1.5)
    assert_unchanged(before, model)
    assert_same_state(opt_before, optimizer_state(opt))
    assert torch.equal(gen.get_state(), gen_before)
    assert {"kappa_R", "rho", "G_norm", "U_norm", "inc_ratio"} <= set(rows.quantity)


@pytest.mark.parametrize("on_error", ["raise", "warn"])
def test_a_diagnostic_that_raises_half_way_leaves_the_training_state_unchanged(on_error):
    model, opt, gen = trained_with_buffer()

    def failing_output(out: torch.Tensor) -> torch.Tensor:
        torch.rand(5)
        model.gpt.blocks[0].attn.f.q.weight.grad = None  # a careless user callable
        raise RuntimeError("output picker failed")

    mon = Monitor(
        model,
        IDX,
        loss_fn,
        output=failing_output,
        diagnostics=["updates", "kappa", "increments"],
        every=1,
        on_error=on_error,
    )
    before, opt_before, gen_before = snapshot(model), optimizer_state(opt), gen.get_state()
    if on_error == "raise":
        with pytest.raises(RuntimeError, match="output picker failed"):
            mon.step(0)
    else:
        with pytest.warns(RuntimeWarning, match="diagnostic 'kappa' failed at step 0"):
            rows = mon.step(0)
        assert [(s, n) for s, n, _ in mon.errors] == [(0, "kappa")]
        assert {"G_norm", "inc_ratio"} <= set(rows.quantity)  # the others still ran
        assert "kappa_R" not in set(rows.quantity)
    assert_unchanged(before, model)
    assert_same_state(opt_before, optimizer_state(opt))
    assert torch.equal(gen.get_state(), gen_before)


# ------------------------------------------------------- the frame equals the direct calls


def values(frame: pd.DataFrame, quantity: str) -> np.ndarray:
    return frame[frame.quantity == quantity].value.to_numpy()


def test_the_frame_equals_the_direct_estimator_calls_at_that_step():
    model = tiny(dropout=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = Monitor(model, IDX, loss_fn, diagnostics=EVERYTHING, every=2)
    train(model, opt, 1, torch.Generator().manual_seed(3))
    before, opt_before = snapshot(model), optimizer_state(opt)
    mon.step(2, loss=torch.tensor(2.5))
    assert_unchanged(before, model)
    assert_same_state(opt_before, optimizer_state(opt))
    f = mon.frame
    with lp.attach(model) as probe:  # kappa to the monitor's default error bound
        rep = lp.visit_alignment(probe, IDX, loss_fn, tol=KAPPA_TOL)
        ups = lp.per_visit_updates(probe, IDX, loss_fn)
        inc = lp.increments(probe, IDX)
        bc = lp.bound_check(probe, IDX, loss_fn, report=rep)
    rm = lp.round_map(model, IDX)
    h = rm.h0
    for _ in range(rm.rounds):
        h = rm.T(h).detach()
    sr = lp.spectral_radius(rm.T, h, k=2)
    assert list(f.columns) == COLUMNS and set(f.step) == {2}
    assert values(f, "loss").tolist() == [2.5]
    assert values(f, "kappa_R").tolist() == [rep.kappa]
    assert values(f, "kappa").tolist() == rep.sublayers.kappa.tolist()
    G = [float(g) for j in range(len(ups.sublayers)) for g in ups.norms(j)]
    assert values(f, "G_norm").tolist() == G
    assert values(f, "U_norm").tolist() == [e.value for e in rep.sensitivity.visit_norms]
    assert f[f.quantity == "U_norm"].visit.tolist() == [v.r for v in rep.sensitivity.visits]
    assert values(f, "cos_G_adjacent").tolist() == rep.sublayers.cos_G_adjacent.tolist()
    assert values(f, "inc_ratio").tolist() == inc.ratio
    assert values(f, "inc_cos").tolist() == inc.group_frame().mean_offdiag_cos.tolist()
    assert values(f, "growth").tolist() == [inc.growth]
    assert values(f, "rho").tolist() == [sr.value]
    assert values(f, "C").tolist() == [bc.C]
    assert f[f.quantity == "kappa_R"].converged.tolist() == [rep.converged]
    visits = f[f.quantity == "G_norm"]
    assert visits.visit.tolist() == [0, 1, 2, 0, 1, 2]
    assert visits.sublayer.tolist() == ["blocks.0.attn"] * 3 + ["blocks.0.mlp"] * 3


def test_updates_alone_equal_a_direct_per_visit_updates_call_and_neighbour_cosines():
    model = tiny()
    mon = Monitor(model, IDX, loss_fn, diagnostics=["updates"], every=1)
    rows = mon.step(0)
    with lp.attach(model) as probe:
        ups = lp.per_visit_updates(probe, IDX, loss_fn)
    for j, name in enumerate(ups.sublayers):
        mine = rows[rows.sublayer == name]
        assert values(mine, "G_norm").tolist() == [float(g) for g in ups.norms(j)]
        assert values(mine, "G_tied").tolist() == [float(ups.tied(j).norm())]
        G = ups.G[j]
        cos = [float(F.cosine_similarity(G[r - 1], G[r], dim=0)) for r in (1, 2)]
        np.testing.assert_allclose(values(mine, "cos_G_prev"), cos, rtol=1e-12)
        assert mine[mine.quantity == "cos_G_prev"].visit.tolist() == [1, 2]
    assert "kappa_R" not in set(rows.quantity)


# ------------------------------------------------------------------------------ schedules


def scheduled(mon: Monitor, steps: range) -> list[int]:
    return [s for s in steps if mon.step(s) is not None]


def test_every_k_runs_on_the_steps_divisible_by_k_and_nothing_else():
    mon = Monitor(tiny(), IDX, diagnostics=["increments"], every=3)
    assert scheduled(mon, range(11)) == [0, 3, 6, 9]
    assert sorted(set(mon.frame.step)) == [0, 3, 6, 9]


def test_dense_early_schedule_is_dense_before_until_and_sparse_after():
    due = dense_early(until=10, early_every=2, late_every=5)
    assert [s for s in range(31) if due(s)] == [0, 2, 4, 6, 8, 10, 15, 20, 25, 30]
    mon = Monitor(tiny(), IDX, diagnostics=["increments"], schedule=due)
    assert scheduled(mon, range(12)) == [0, 2, 4, 6, 8, 10]


def test_an_iterable_schedule_runs_exactly_its_steps():
    mon = Monitor(tiny(), IDX, diagnostics=["increments"], schedule=[1, 5, 6])
    assert scheduled(mon, range(10)) == [1, 5, 6]


def test_a_diagnostic_mapping_runs_each_on_every_nth_scheduled_step():
    mon = Monitor(tiny(), IDX, loss_fn, diagnostics={"updates": 1, "increments": 2}, every=2)
    scheduled(mon, range(9))  # scheduled: 0, 2, 4, 6, 8
    f = mon.frame
    assert sorted(set(f[f.quantity == "G_norm"].step)) == [0, 2, 4, 6, 8]
    assert sorted(set(f[f.quantity == "inc_ratio"].step)) == [0, 4, 8]


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"model": "gpt"}, TypeError, "model must be an nn.Module"),
        ({"diagnostics": ["kapa"]}, ValueError, r"choose one or more of \['updates'"),
        ({"diagnostics": "kappa"}, TypeError, r"diagnostics=\['kappa'\]"),
        ({"diagnostics": {"kappa": 0}}, ValueError, "integer n >= 1"),
        ({"loss_fn": 3}, TypeError, "loss_fn must be callable"),
        ({"every": 2, "schedule": [1]}, ValueError, "every= or schedule=, not both"),
        ({"every": 0}, ValueError, "integer >= 1"),
        ({"every": 1.5}, TypeError, "every must be an integer"),
        ({"schedule": 5}, TypeError, "dense_early"),
        ({"options": {"kapa": {}}}, ValueError, "keys are diagnostics"),
        ({"sinks": [3]}, TypeError, "FileSink"),
        ({"on_error": "ignore"}, ValueError, "'raise' or 'warn'"),
    ],
)
def test_bad_monitor_arguments_raise_errors_that_name_the_fix(kwargs, error, match):
    args = {"model": tiny(), "inputs": IDX, "loss_fn": loss_fn, "diagnostics": ["updates"]}
    with pytest.raises(error, match=match):
        Monitor(**{**args, **kwargs})


def test_rho_on_a_model_without_a_round_map_asks_for_replay_round():
    model = nn.Sequential(tiny())
    with pytest.raises(ValueError, match="replay_round"):
        Monitor(model, IDX, diagnostics=["rho"])


def test_a_negative_or_non_integer_step_or_a_non_number_loss_is_a_type_error():
    mon = Monitor(tiny(), IDX, diagnostics=["increments"], every=1)
    for bad in (-1, 1.0, True):
        with pytest.raises(TypeError, match="step must be an integer >= 0"):
            mon.step(bad)
    for bad in ("0.5", torch.ones(2)):
        with pytest.raises(TypeError, match=r"pass loss=loss.item\(\)"):
            mon.step(0, loss=bad)
    assert mon.frame.empty  # nothing half-recorded


# ---------------------------------------------------------------------------------- sinks


def monitored(sinks: list, steps: int = 3) -> Monitor:
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    mon = Monitor(model, IDX, loss_fn, diagnostics=["updates", "kappa"], every=1, sinks=sinks)
    gen = torch.Generator().manual_seed(2)
    for s in range(steps):
        train(model, opt, 1, gen)
        mon.step(s, loss=float(s))
    mon.close()
    return mon


@pytest.fixture(scope="module")
def watched(tmp_path_factory) -> tuple[Monitor, list[dict], pathlib.Path]:
    """Three monitored SGD steps written to every kind of sink at once (shared by the tests)."""
    where = tmp_path_factory.mktemp("monitor")
    got: list[dict] = []
    sinks = [TensorBoardSink(where / "tb", heatmap_every=2), FileSink(where / "m.csv"), got.append]
    return monitored(sinks), got, where


def test_the_tensorboard_event_files_hold_the_frames_scalars_and_heat_maps(watched):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    mon, _, where = watched
    ea = EventAccumulator(str(where / "tb"), size_guidance={"scalars": 0, "images": 0})
    ea.Reload()
    f = mon.frame
    kR = ea.Scalars("loopprobe/kappa_R")
    assert [e.step for e in kR] == [0, 1, 2]
    np.testing.assert_allclose([e.value for e in kR], values(f, "kappa_R"), rtol=1e-6)
    mlp = [e.value for e in ea.Scalars("loopprobe/kappa/blocks.0.mlp")]
    np.testing.assert_allclose(mlp, values(f[f.sublayer == "blocks.0.mlp"], "kappa"), rtol=1e-6)
    g = f[(f.quantity == "G_norm") & (f.sublayer == "blocks.0.attn") & (f.visit == 2)]
    got = [e.value for e in ea.Scalars("loopprobe/G_norm/blocks.0.attn/r2")]
    np.testing.assert_allclose(got, g.value, rtol=1e-6)
    images = ea.Tags()["images"]
    assert {"loopprobe/heatmap/G_norm", "loopprobe/heatmap/U_norm"} <= set(images)
    assert [e.step for e in ea.Images("loopprobe/heatmap/G_norm")] == [0, 2]  # every 2nd


def test_a_plain_callable_sink_gets_one_flat_dict_per_scheduled_step(watched):
    mon, got, _ = watched
    assert [d["step"] for d in got] == [0, 1, 2]
    f = mon.frame
    assert [d["loopprobe/kappa_R"] for d in got] == values(f, "kappa_R").tolist()
    assert [d["loopprobe/loss"] for d in got] == [0.0, 1.0, 2.0]
    one = f[(f.step == 1) & (f.quantity == "G_norm") & (f.sublayer == "blocks.0.mlp")]
    assert got[1]["loopprobe/G_norm/blocks.0.mlp/r1"] == one[one.visit == 1].value.iloc[0]
    assert len(got[0]) == 1 + (f.step == 0).sum()  # every row, plus the step


def test_a_callable_sink_with_step_key_none_passes_step_as_a_keyword():
    calls: list[tuple] = []
    monitored([CallableSink(lambda m, step: calls.append((step, len(m))), step_key=None)], 2)
    assert [s for s, _ in calls] == [0, 1] and calls[0][1] > 10


def test_a_csv_file_sink_reads_back_as_the_same_frame(watched):
    mon, _, where = watched
    back = read_frame(where / "m.csv")
    pd.testing.assert_frame_equal(back, mon.frame, check_exact=False, rtol=1e-15)


def test_a_parquet_file_sink_needs_pyarrow_and_says_so(tmp_path):
    from loopprobe.monitor.sinks import _parquet_engine

    if not _parquet_engine():
        with pytest.raises(ImportError, match="pip install pyarrow"):
            FileSink(tmp_path / "m.parquet")
    else:
        mon = monitored([FileSink(tmp_path / "m.parquet")], 2)
        pd.testing.assert_frame_equal(read_frame(tmp_path / "m.parquet"), mon.frame)
    with pytest.raises(ValueError, match=r"name a \.csv or \.parquet file"):
        FileSink(tmp_path / "m.json")


# ---------------------------------------------------------------------------------- plots


def test_the_heat_map_shows_step_by_visit_values_of_each_sublayer(watched):
    mon = watched[0]
    fig = visit_heatmap(mon.frame, quantity="G_norm", log=False)
    f = mon.frame
    for ax, name in zip(fig.axes, ["blocks.0.attn", "blocks.0.mlp"], strict=False):
        sub = f[(f.quantity == "G_norm") & (f.sublayer == name)]
        want = sub.value.to_numpy().reshape(3, 3)  # rows: steps 0, 1, 2; columns: visits
        np.testing.assert_array_equal(np.asarray(ax.images[0].get_array()), want)
        assert ax.get_title() == name


def test_kappa_vs_step_draws_kappa_and_loss_and_saves_with_pyplot(watched, tmp_path):
    import matplotlib.pyplot as plt

    mon = watched[0]
    fig = kappa_vs_step(mon.frame)
    kR = [line for line in fig.axes[0].lines if line.get_label() == "κ_R"][0]
    assert kR.get_ydata().tolist() == values(mon.frame, "kappa_R").tolist()
    plt.figure(fig)  # pyplot adopts it
    plt.savefig(tmp_path / "k.png")
    plt.close("all")
    assert (tmp_path / "k.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="diagnostics including 'kappa'"):
        kappa_vs_step(mon.frame[mon.frame.quantity != "kappa_R"])


def test_importing_the_monitor_loads_neither_matplotlib_nor_tensorboard():
    code = "import sys, loopprobe.monitor.monitor, loopprobe.monitor.sinks\n"
    code += "print(sorted({m.split('.')[0] for m in sys.modules}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(eval(out.stdout))
    assert not {"matplotlib", "seaborn", "tensorboard", "transformers", "lightning"} & loaded


def test_the_bound_judges_the_step_of_the_training_optimizer_the_monitor_holds():
    model = tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    train(model, opt, 3, torch.Generator().manual_seed(3))  # Adam moments with history
    mon = Monitor(model, IDX, loss_fn, diagnostics=["kappa", "bound"], every=1, update=opt)
    before = optimizer_state(opt)
    mon.step(4)
    assert_same_state(before, optimizer_state(opt))
    with lp.attach(model) as probe:
        rep = lp.visit_alignment(probe, IDX, loss_fn, tol=KAPPA_TOL, update=opt)
        adam = lp.bound_check(probe, IDX, loss_fn, report=rep, optimizer=opt)
        sgd = lp.bound_check(probe, IDX, loss_fn, report=rep)
    got = values(mon.frame, "prediction").tolist()
    assert got == [adam.prediction] and values(mon.frame, "dF_true").tolist() == [adam.dF_true]
    assert abs(adam.prediction - sgd.prediction) > 1e-3 * abs(sgd.prediction)  # the test can fail


def _gpt_case():
    return tiny(), IDX, loss_fn


def _third_party_case():
    from thirdparty_models import SharedBlockModel, make, randn

    return make(SharedBlockModel, R=4), randn(3, 6), lambda out, inputs: (out**2).sum()


@pytest.mark.parametrize("case", [_gpt_case, _third_party_case], ids=["LoopedGPT", "third-party"])
def test_each_kappa_starts_from_the_last_ones_top_vectors_unless_told_cold(monkeypatch, case):
    import loopprobe.monitor.diagnostics as diag

    starts, reports = [], []
    real = diag.visit_alignment

    def spy(*args, **kwargs):
        starts.append(kwargs.get("start"))
        reports.append(real(*args, **kwargs))
        return reports[-1]

    monkeypatch.setattr(diag, "visit_alignment", spy)
    model, inputs, lossf = case()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = Monitor(model, inputs, lossf, diagnostics=["kappa"], every=1)
    for step in (1, 2, 3):
        opt.zero_grad()
        lossf(model(inputs), inputs).backward()
        opt.step()
        mon.step(step)
    assert starts[0] is None  # the first kappa starts cold, each next from the one before
    for start, rep in zip(starts[1:], reports[:2], strict=True):
        assert start.keys == rep.sensitivity.keys
        assert torch.equal(start.vectors, rep.sensitivity.vectors.cpu())  # kept on the host
    with lp.attach(model) as probe:  # the warm kappa is the cold one, inside both intervals
        rep = lp.visit_alignment(probe, inputs, lossf, tol=KAPPA_TOL)
    f = mon.frame[mon.frame.step == 3]
    warm, err = values(f, "kappa_R")[0], values(f, "kappa_err")[0]
    assert abs(warm - rep.kappa) <= err + rep.kappa_err
    starts.clear()
    opts = {"kappa": {"start": None}}
    cold = Monitor(model, inputs, lossf, diagnostics=["kappa"], every=1, options=opts)
    cold.step(1)
    cold.step(2)
    assert starts == [None, None]
