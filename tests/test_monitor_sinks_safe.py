"""A sink never stops training: a sink that raises becomes a ``<Sink>_failed`` row and one
warning (``strict=True`` raises), and ``loopprobe[monitor]`` works without matplotlib (the
TensorBoard and W&B heat maps are skipped with one notice; the scalars are all written).
matplotlib is hidden from imports as on an install without it (tests/_hide.py)."""

from __future__ import annotations

import logging
import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _hide import hide

import loopprobe as lp
from loopprobe.monitor.monitor import Monitor
from loopprobe.monitor.sinks import FileSink, TensorBoardSink

IDX, TGT = lp.tasks.random_tokens(2, 6, 16, generator=torch.Generator().manual_seed(1))


def tiny() -> lp.models.LoopedGPT:
    cfg = lp.models.GPTConfig(K=1, R=3, d_model=8, n_heads=2, seq_len=6, vocab_size=16)
    return lp.models.LoopedGPT(cfg, generator=torch.Generator().manual_seed(0)).double()


def loss_fn(out: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), TGT.flatten())


def train_and_watch(mon: Monitor, steps: int, between=None) -> None:
    opt = torch.optim.SGD(mon.model.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(2)
    for s in range(steps):
        idx, tgt = lp.tasks.random_tokens(2, 6, 16, generator=gen)
        opt.zero_grad()
        F.cross_entropy(mon.model(idx).flatten(0, 1), tgt.flatten()).backward()
        opt.step()
        mon.step(s, loss=float(s))
        if between is not None:
            between(s)


def test_the_tensorboard_sink_without_matplotlib_writes_every_scalar_and_skips_heat_maps_once(
    tmp_path, monkeypatch, caplog
):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    hide(monkeypatch, "matplotlib", "seaborn")
    with pytest.raises(ImportError):
        import matplotlib  # noqa: F401 - the hiding works
    sink = TensorBoardSink(tmp_path / "tb", heatmap_every=1)  # a heat map due at every write
    mon = Monitor(tiny(), IDX, loss_fn, diagnostics=["updates"], every=1, sinks=[sink])
    with caplog.at_level(logging.WARNING, logger="loopprobe"), warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning either: the notice is a log record
        train_and_watch(mon, 3)
        mon.close()
    f = mon.frame
    assert not f.quantity.str.endswith("_failed").any()
    notices = [r for r in caplog.records if r.name.startswith("loopprobe")]
    assert len(notices) == 1 and "heat maps skipped" in notices[0].getMessage()
    assert "loopprobe[plots]" in notices[0].getMessage()
    ea = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "images": 0})
    ea.Reload()
    assert ea.Tags()["images"] == []
    g = f[(f.quantity == "G_norm") & (f.sublayer == "blocks.0.attn") & (f.visit == 1)]
    got = [e.value for e in ea.Scalars("loopprobe/G_norm/blocks.0.attn/r1")]
    np.testing.assert_allclose(got, g.value, rtol=1e-6)
    assert [e.step for e in ea.Scalars("loopprobe/loss")] == [0, 1, 2]


def test_a_sink_that_raises_becomes_a_failed_row_and_one_warning_while_training_goes_on(tmp_path):
    csv = tmp_path / "m.csv"
    got: list[dict] = []

    def break_the_file(step: int) -> None:  # after step 0 the CSV path becomes a folder
        if step == 0:
            csv.unlink()
            csv.mkdir()

    mon = Monitor(
        tiny(), IDX, loss_fn, diagnostics=["updates"], every=1, sinks=[FileSink(csv), got.append]
    )
    with pytest.warns(RuntimeWarning, match="sink FileSink failed at step 1") as caught:
        train_and_watch(mon, 3, between=break_the_file)
    assert len([w for w in caught if "FileSink" in str(w.message)]) == 1  # one, not per step
    f = mon.frame
    failed = f[f.quantity == "FileSink_failed"]
    assert failed.step.tolist() == [1, 2]
    assert failed.value.map(math.isnan).all() and (~failed.converged).all()
    assert failed.reason.str.startswith("IsADirectoryError").all()
    assert [d["step"] for d in got] == [0, 1, 2]  # the other sink got every step
    assert (
        set(f.step) == {0, 1, 2} and (f.quantity == "G_norm").sum() == 3 * 2 * 3
    )  # steps x sublayers x visits
    assert [(s, n) for s, n, _ in mon.errors] == [(1, "FileSink_failed"), (2, "FileSink_failed")]


def test_a_strict_monitor_raises_the_sinks_error(tmp_path):
    csv = tmp_path / "m.csv"
    mon = Monitor(tiny(), IDX, loss_fn, diagnostics=["updates"], every=1, strict=True,
                  sinks=[FileSink(csv)])  # fmt: skip
    mon.step(0)
    csv.unlink()
    csv.mkdir()
    with pytest.raises(IsADirectoryError):
        mon.step(1)


def test_the_notice_is_silenced_like_any_library_logger(tmp_path, monkeypatch, caplog):
    hide(monkeypatch, "matplotlib", "seaborn")
    logger = logging.getLogger("loopprobe")
    monkeypatch.setattr(logger, "level", logging.ERROR)  # what a user sets; restored after
    sink = TensorBoardSink(tmp_path / "tb", heatmap_every=1)
    mon = Monitor(tiny(), IDX, loss_fn, diagnostics=["updates"], every=1, sinks=[sink])
    with caplog.at_level(logging.DEBUG):  # the root handler would show any record
        train_and_watch(mon, 1)
        mon.close()
    assert not [r for r in caplog.records if "heat maps" in r.getMessage()]
    assert sink.heatmaps == ()  # skipped all the same


def test_the_wandb_sink_without_matplotlib_logs_its_charts_and_skips_heat_maps_once(
    tmp_path, monkeypatch, caplog
):
    wandb = pytest.importorskip("wandb")
    from loopprobe.monitor.wandb_sink import WandbSink

    hide(monkeypatch, "matplotlib", "seaborn")
    settings = wandb.Settings(console="off", silent=True, x_disable_stats=True, save_code=False)
    run = wandb.init(mode="offline", dir=str(tmp_path), project="lp-test", settings=settings)
    logged: list[dict] = []
    real_log = run.log

    def log(data, **kw):  # the real run.log, and what it was given
        logged.append(dict(data))
        return real_log(data, **kw)

    monkeypatch.setattr(run, "log", log)
    try:
        sink = WandbSink(run, charts_every=1)
        mon = Monitor(tiny(), IDX, loss_fn, diagnostics=["updates"], every=1, sinks=[sink])
        with caplog.at_level(logging.WARNING, logger="loopprobe"):
            train_and_watch(mon, 2)
            mon.close()
    finally:
        run.finish()
    assert not mon.frame.quantity.str.endswith("_failed").any()
    notices = [r for r in caplog.records if "heat maps skipped" in r.getMessage()]
    assert len(notices) == 1 and sink.heatmaps == ()
    keys = set().union(*logged)
    assert "loopprobe/visits/G_norm" in keys and "loopprobe/loss" in keys
    assert not [k for k in keys if "heatmap" in k]
