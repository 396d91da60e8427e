"""``loopprobe watch`` / ``watch_training``: the monitor's frame per scheme, at a tiny size."""

from __future__ import annotations

import json

import pytest

from loopprobe.cli import main
from loopprobe.experiments.watch import watch_training
from loopprobe.monitor.monitor import Monitor

TINY = dict(R=2, steps=10, every=5, kappa_every=10, d_model=8, n_heads=2, seq_len=8, batch=2)


@pytest.fixture(scope="module")
def watched():
    return watch_training(["deepnorm", "deeploop"], **TINY)


def test_each_scheme_gets_kappa_rho_and_G_at_the_scheduled_steps_and_a_val_loss(watched):
    df = watched
    for scheme, sub in df.groupby("scheme"):
        kappa_steps = sorted(sub[sub.quantity == "kappa_R"].step)
        assert kappa_steps == [0, 10], scheme  # init and the end (every 10)
        assert sorted(sub[sub.quantity == "rho"].step) == [0, 10]
        assert sorted(sub[sub.quantity == "loss"].step) == [5, 10]  # training loss, not at 0
        assert sorted(pd_unique(sub[sub.quantity == "G_norm"].step)) == [0, 5, 10]
        assert (sub.quantity == "val_loss").sum() == 1


def pd_unique(s):
    return list(dict.fromkeys(s))


def test_the_numbers_at_initialization_equal_a_direct_monitor_on_the_same_model(watched):
    import torch

    from loopprobe.experiments.watch import SCHEMES
    from loopprobe.models import GPTConfig, LoopedGPT
    from loopprobe.tasks import lm_loss, stdlib_text

    df = watch_training(["deeploop"], **TINY)
    cfg = GPTConfig(
        vocab_size=256, seq_len=8, d_model=8, n_heads=2, K=2, R=2, **SCHEMES["deeploop"]
    )
    model = LoopedGPT(cfg, generator=torch.Generator().manual_seed(0))
    x, y = stdlib_text(8, 8, torch.Generator().manual_seed(1), "val")
    mon = Monitor(model, x, lambda out, _: lm_loss(out, y), diagnostics=("kappa",), update="sgd")
    direct = mon.step(0)
    mine = df[(df.step == 0) & (df.quantity == "kappa_R")].value.iloc[0]
    assert mine == pytest.approx(direct[direct.quantity == "kappa_R"].value.iloc[0], rel=1e-12)


def test_bad_schemes_and_cadence_raise_with_the_fix():
    with pytest.raises(ValueError, match="choose from"):
        watch_training(["postnorm"], **TINY)
    with pytest.raises(ValueError, match="multiple of every"):
        watch_training(["deeploop"], **{**TINY, "kappa_every": 7})


def test_the_cli_writes_csv_and_png_and_prints_a_row_per_scheme(tmp_path, capsys):
    args = ["watch", "--schemes", "deeploop", "--R", "2", "--steps", "10", "--every", "5",
            "--kappa-every", "10", "--d-model", "8", "--heads", "2", "--seq", "8", "--batch", "2",
            "--out", str(tmp_path), "--no-progress", "--json"]  # fmt: skip
    assert main(args) == 0
    rep = json.loads(capsys.readouterr().out)
    (row,) = rep["schemes"]
    assert row["scheme"] == "deeploop" and row["kappa_steps"] == [0, 10]
    assert (tmp_path / "watch.csv").stat().st_size > 0
    assert (tmp_path / "watch.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["watch", "--schemes", "nope", "--out", str(tmp_path)]) == 2
