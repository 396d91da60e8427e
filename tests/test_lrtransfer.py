"""LR transfer machinery: argmin and drift bookkeeping, divergence as data, tiny sweep, CLI."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch

import loopprobe as lp
from loopprobe import tasks
from loopprobe.cli import main
from loopprobe.experiments.lrtransfer import LRTransfer, train_short
from loopprobe.models import GPTConfig, LoopedGPT

LRS = [1e-3, 3e-3, 1e-2, 3e-2]


def _synthetic(best: dict[int, int], diverge: set[tuple[int, int]] = frozenset()) -> LRTransfer:
    """Parabolic loss in log lr with its minimum at grid index best[N]."""
    rows = []
    for N, b in best.items():
        for i, lr in enumerate(LRS):
            for seed in (0, 1):
                bad = (N, i) in diverge
                loss = math.nan if bad else 2.0 + 0.1 * (i - b) ** 2 + 0.01 * seed
                rows.append({"N": N, "lr": lr, "seed": seed, "loss": loss, "diverged": bad})
    return LRTransfer(pd.DataFrame(rows), LRS)


def test_best_lr_and_drift_are_counted_in_grid_steps():
    lt = _synthetic({1: 1, 2: 1, 4: 2, 8: 3})
    best = lt.best()
    assert list(best.best_index) == [1, 1, 2, 3]
    assert list(best.best_lr) == [3e-3, 3e-3, 1e-2, 3e-2]
    d = lt.drift().iloc[0]
    assert d.drift == 2 and d.spread == 2 and d.edge  # index 3 is the grid's last point
    flat = _synthetic({1: 2, 2: 2, 4: 2}).drift().iloc[0]
    assert flat.drift == 0 and flat.spread == 0 and not flat.edge


def test_parabola_fit_locates_the_optimum_between_grid_points():
    best = _synthetic({1: 1, 2: 2, 8: 3}).best().set_index("N")
    assert best.loc[1, "fit_log2_lr"] == pytest.approx(math.log2(3e-3), abs=0.1)
    assert best.loc[2, "fit_log2_lr"] == pytest.approx(math.log2(1e-2), abs=0.1)
    assert math.isnan(best.loc[8, "fit_log2_lr"])  # argmin at the grid edge
    # a loss whose true optimum lies between two grid points
    rows = [{"N": 1, "lr": lr, "seed": 0, "loss": (math.log2(lr) - math.log2(5e-3)) ** 2,
             "diverged": False} for lr in LRS]  # fmt: skip
    fit = LRTransfer(pd.DataFrame(rows), LRS).best().fit_log2_lr.item()
    assert fit == pytest.approx(math.log2(5e-3), abs=1e-9)


def test_diverged_cells_are_never_the_argmin():
    lt = _synthetic({1: 1, 2: 1}, diverge={(2, 1), (2, 0)})
    best = lt.best().set_index("N")
    assert best.loc[2, "best_index"] == 2 and best.loc[2, "diverged_cells"] == 4
    assert best.loc[1, "best_index"] == 1


def test_tiny_reference_sweep_trains_every_cell_and_plots_a_panel_per_rule():
    lt = lp.experiments.reference_lr_transfer(
        ["1/sqrt(N)", "1/N"], Ns=[1, 2], lrs=[1e-3, 1e-2], steps=3, d_model=16,
        seq_len=8, batch=2, eval_batches=1,
    )  # fmt: skip
    df = lt.to_frame()
    assert len(df) == 2 * 2 * 2 and not df.diverged.any()
    assert (df.steps_done == 3).all() and df.loss.between(0, 10).all()
    # N = 1: 1/sqrt(N) and 1/N are the same model, so the same losses
    one = df[df.N == 1].pivot_table(index="lr", columns="residual", values="loss")
    assert one["1/N"].tolist() == pytest.approx(one["1/sqrt(N)"].tolist(), rel=1e-6)
    assert set(lt.drift().residual) == {"1/sqrt(N)", "1/N"}
    assert len(lt.plot().axes) == 2


def test_a_nan_loss_stops_training_and_is_recorded_as_diverged():
    model = LoopedGPT(GPTConfig(vocab_size=256, seq_len=8, d_model=16, n_heads=2, K=1, R=2))
    with torch.no_grad():
        model.tok_emb.weight[:] = float("nan")
    evals = [tasks.stdlib_text(2, 8, torch.Generator().manual_seed(0), split="val")]
    out = train_short(
        model, lambda t, g: tasks.stdlib_text(2, 8, g), evals, steps=5, lr=1e-3,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    assert out["diverged"] and math.isnan(out["loss"]) and out["steps_done"] == 0


def test_generic_sweep_turns_a_raising_cell_into_a_diverged_row():
    def make(N, seed):
        if N == 2:
            raise RuntimeError("no such model")
        return LoopedGPT(GPTConfig(vocab_size=256, seq_len=8, d_model=16, n_heads=2, K=1, R=N))

    evals = [tasks.stdlib_text(2, 8, torch.Generator().manual_seed(0), split="val")]
    lt = lp.experiments.lr_transfer(
        make, lambda t, g: tasks.stdlib_text(2, 8, g), evals, Ns=[1, 2], lrs=[1e-3], steps=2
    )
    rows = lt.to_frame().set_index("N")
    assert rows.loc[2, "diverged"] and "no such model" in rows.loc[2, "error"]
    assert not rows.loc[1, "diverged"]
    assert list(lt.best().best_index) == [0, -1]


def test_bad_grids_raise():
    with pytest.raises(ValueError, match="increasing"):
        lp.experiments.reference_lr_transfer(lrs=[1e-2, 1e-3])
    with pytest.raises(ValueError, match="positive"):
        lp.experiments.reference_lr_transfer(lrs=[0.0, 1e-3])
    with pytest.raises(ValueError, match="residuals"):
        lp.experiments.reference_lr_transfer(["1/N^2"])


def test_cli_lr_transfer_json_reports_best_and_drift(tmp_path, capsys):
    code = main(["lr-transfer", "--residual", "1/N", "--N", "1,2", "--lr", "1e-3,1e-2",
                 "--steps", "2", "--d-model", "16", "--seq-len", "8", "--batch", "2",
                 "--eval-batches", "1", "--out", str(tmp_path), "--json"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert [r["N"] for r in out["best"]] == [1, 2] and len(out["rows"]) == 4
    assert out["drift"][0]["residual"] == "1/N"
    assert (tmp_path / "lr_transfer.csv").exists() and (tmp_path / "lr_transfer.png").exists()
