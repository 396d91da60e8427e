"""Learning-rate transfer across loop count N: loss vs lr per N, the argmin and its drift.

Each (N, lr, seed) cell trains a fresh model for a short run and reports the held-out
loss; the best lr per N (seed-mean loss) is located on the lr grid and its *drift* is
counted in grid steps: ``drift = index(best lr at the largest N) - index(at the
smallest N)`` (positive = moves right) and ``spread = max - min`` of the indices over
N. Transfer means drift and spread 0. Cells run through :func:`loopprobe.sweep`: a run
whose loss becomes NaN/inf is a row with ``diverged=True`` (and never an argmin).
Expectation (seed 004, Loop-muP; PAPERS.md §2b): under ``1/N`` the best lr stays put,
under ``1/sqrt(N)`` it moves right with N.

Example::

    lt = lp.experiments.reference_lr_transfer(["1/sqrt(N)", "1/N"], Ns=[1, 2, 4, 8],
                                  lrs=[1e-3, 2e-3, 4e-3, 8e-3], steps=200)
    lt.best(); lt.drift(); lt.plot().savefig("lr.png")
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from loopprobe.experiments._reference import reference_gpt
from loopprobe.experiments.coordcheck import make_optimizer
from loopprobe.sweeps import sweep
from loopprobe.tasks import lm_loss

if TYPE_CHECKING:  # plotting is imported on call (.plot): import stays light
    from matplotlib.figure import Figure

__all__ = ["LRTransfer", "lr_transfer", "reference_lr_transfer", "train_short"]

BatchFn = Callable[[int, torch.Generator], tuple[Any, torch.Tensor]]


# --------------------------------------------------------------------------- training


def train_short(
    model: nn.Module,
    batch_fn: BatchFn,
    eval_batches: Sequence[tuple[Any, torch.Tensor]],
    *,
    steps: int,
    lr: float,
    optimizer: str = "adamw",
    warmup: float = 0.05,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] = lm_loss,
    generator: torch.Generator,
    clip: float | None = 1.0,
) -> dict:
    """Train with linear warmup (``warmup`` fraction) and linear decay to 0; evaluate.

    Returns ``loss`` (mean held-out loss over ``eval_batches``), ``train_loss`` (mean of
    the last tenth of the steps), ``steps_done``, ``diverged`` (a non-finite loss stopped
    the run; ``loss`` is then NaN) and ``seconds``.
    """
    opt = make_optimizer(model, optimizer, lr)
    n_warm = max(1, int(warmup * steps))

    def factor(t: int) -> float:
        return min((t + 1) / n_warm, max(0.0, (steps - t) / max(1, steps - n_warm)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    start, tail, done = time.perf_counter(), [], 0
    model.train()
    for t in range(steps):
        inputs, targets = batch_fn(t, generator)
        loss = loss_fn(model(inputs), targets)
        if not torch.isfinite(loss):
            return _result(math.nan, math.nan, t, True, start, f"non-finite loss at step {t}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        done = t + 1
        if t >= steps - max(1, steps // 10):
            tail.append(float(loss.detach()))
    model.eval()
    with torch.no_grad():
        val = float(np.mean([float(loss_fn(model(x), y)) for x, y in eval_batches]))
    if not math.isfinite(val):
        return _result(math.nan, float(np.mean(tail)), done, True, start, "non-finite eval loss")
    return _result(val, float(np.mean(tail)), done, False, start, None)


def _result(loss, train_loss, steps_done, diverged, start, error) -> dict:
    return {
        "loss": loss,
        "train_loss": train_loss,
        "steps_done": steps_done,
        "seconds": time.perf_counter() - start,
        "diverged": diverged,
        "error": error,
    }


# --------------------------------------------------------------------------- result


@dataclass
class LRTransfer:
    """Rows per (panel, N, lr, seed); ``panel`` is the column that separates curves
    (e.g. ``residual``) or None."""

    rows: pd.DataFrame
    lrs: list[float]
    panel: str | None = None
    config: dict = field(default_factory=dict)

    def to_frame(self) -> pd.DataFrame:
        return self.rows

    def _panels(self):
        if self.panel is None:
            yield None, self.rows
        else:
            yield from self.rows.groupby(self.panel, sort=False)

    def best(self) -> pd.DataFrame:
        """Per (panel, N): the lr with the lowest seed-mean loss and its grid index."""
        out = []
        for level, sub in self._panels():
            for N, g in sub.groupby("N"):
                ok = g[~g["diverged"]]
                means = ok.groupby("lr")["loss"].mean()
                row = {"N": int(N), "diverged_cells": int(g["diverged"].sum())}
                if self.panel is not None:
                    row = {self.panel: level, **row}
                if means.empty:
                    row.update(best_lr=math.nan, best_index=-1, best_loss=math.nan)
                else:
                    lr = float(means.idxmin())
                    row.update(best_lr=lr, best_index=_index(self.lrs, lr), best_loss=means.min())
                row["fit_log2_lr"] = _vertex(means)
                out.append(row)
        return pd.DataFrame(out)

    def drift(self) -> pd.DataFrame:
        """Per panel: argmin indices over N, drift (last N - first N) and spread, in grid steps,
        and the drift of the parabola-fitted optimum in log2 lr (octaves)."""
        best = self.best()
        rows = []
        for level, sub in best.groupby(self.panel, sort=False) if self.panel else [(None, best)]:
            sub = sub[sub["best_index"] >= 0].sort_values("N")
            idx = [int(i) for i in sub["best_index"]]
            fit = [float(x) for x in sub["fit_log2_lr"]]
            row = {
                "N": [int(n) for n in sub["N"]],
                "best_index": idx,
                "best_lr": [float(x) for x in sub["best_lr"]],
                "drift": idx[-1] - idx[0] if idx else math.nan,
                "fit_log2_lr": fit,
                "fit_drift_log2": fit[-1] - fit[0] if fit else math.nan,
                "spread": max(idx) - min(idx) if idx else math.nan,
                "edge": bool(idx) and (min(idx) == 0 or max(idx) == len(self.lrs) - 1),
            }
            rows.append({self.panel: level, **row} if self.panel else row)
        return pd.DataFrame(rows)

    def plot(self, **kw: Any) -> Figure:
        """Loss vs lr (log x), a line per N, the argmin starred; a panel per ``panel``."""
        from loopprobe import plots

        return plots.lr_transfer(self.rows, col=self.panel, **kw)


def _vertex(means: pd.Series) -> float:
    """log2 of the lr at the vertex of the parabola through the argmin and its neighbours.

    Finer than the grid argmin (which moves in whole grid steps); NaN when the argmin is
    at the grid's edge or the three points are not convex.
    """
    means = means.sort_index()
    if len(means) < 3:
        return math.nan
    i = int(np.argmin(means.to_numpy()))
    if i == 0 or i == len(means) - 1:
        return math.nan
    x = np.log2(means.index.to_numpy(dtype=float)[i - 1 : i + 2])
    y = means.to_numpy()[i - 1 : i + 2]
    a, b, _ = np.polyfit(x, y, 2)
    return float(-b / (2 * a)) if a > 0 else math.nan


def _index(grid: Sequence[float], lr: float) -> int:
    return int(np.argmin([abs(math.log(g) - math.log(lr)) for g in grid]))


# --------------------------------------------------------------------------- sweeps


def lr_transfer(
    make_model: Callable[[int, int], nn.Module],
    batch_fn: BatchFn,
    eval_batches: Sequence[tuple[Any, torch.Tensor]],
    Ns: Sequence[int],
    lrs: Sequence[float],
    seeds: Sequence[int] = (0,),
    *,
    steps: int = 200,
    optimizer: str = "adamw",
    warmup: float = 0.05,
    cache_dir: str | None = None,
    name: str | None = None,
    progress: bool = False,
) -> LRTransfer:
    """LR-transfer sweep of any model family: ``make_model(N, seed)``, train, evaluate.

    ``batch_fn(step, generator)`` gives training batches (the generator is seeded per
    seed, so every lr sees the same data); ``eval_batches`` is a fixed list of held-out
    ``(inputs, targets)``. Reference: seed 004.
    """
    call = "lr_transfer"
    lrs = _check(call, Ns, lrs, seeds, steps)
    if cache_dir is not None and name is None:
        raise ValueError(f"{call}: caching needs name='...' identifying make_model/batch_fn")

    def cell(cfg: dict) -> dict:
        model = make_model(cfg["N"], cfg["seed"])
        gen = torch.Generator().manual_seed(7_000 + cfg["seed"])
        return train_short(
            model,
            batch_fn,
            eval_batches,
            steps=steps,
            lr=cfg["lr"],
            optimizer=optimizer,
            warmup=warmup,
            generator=gen,
        )

    items = [{"N": N, "lr": lr, "seed": s} for N in Ns for lr in lrs for s in seeds]
    df = sweep(items, cell, cache_dir, progress, name=name or call)
    return LRTransfer(df, lrs, None, {"steps": steps, "optimizer": optimizer})


def _check(call: str, Ns, lrs, seeds, steps) -> list[float]:
    if not list(Ns) or any(not isinstance(n, int) or n < 1 for n in Ns):
        raise ValueError(f"{call}: Ns={Ns!r} must be a non-empty list of integers >= 1")
    lrs = [float(x) for x in lrs]
    if not lrs or any(not (math.isfinite(x) and x > 0) for x in lrs):
        raise ValueError(f"{call}: lrs={lrs!r} must be a non-empty list of positive numbers")
    if lrs != sorted(set(lrs)):
        raise ValueError(f"{call}: lrs={lrs!r} must be increasing without repeats")
    if not list(seeds) or any(not isinstance(s, int) for s in seeds):
        raise ValueError(f"{call}: seeds={seeds!r} must be a non-empty list of integers")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"{call}: steps={steps!r} must be an integer >= 1")
    return lrs


def reference_lr_transfer(
    residuals: Sequence[str] = ("1/sqrt(N)", "1/N"),
    Ns: Sequence[int] = (1, 2, 4, 8),
    lrs: Sequence[float] = (1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2),
    seeds: Sequence[int] = (0,),
    *,
    steps: int = 200,
    d_model: int = 64,
    n_heads: int = 4,
    seq_len: int = 64,
    batch: int = 16,
    eval_batches: int = 8,
    optimizer: str = "adamw",
    cache_dir: str | None = None,
    progress: bool = False,
) -> LRTransfer:
    """:func:`lr_transfer` of the pre-norm reference LoopedGPT (K = 1 block looped N times)
    on byte-level ``lp.tasks.stdlib_text``, one panel per residual rule.

    Held-out loss is the mean over ``eval_batches`` fixed batches of the ``val`` split.
    Reference: seed 004 (best lr flat in N under 1/N), PAPERS.md §2b.
    """
    call = "reference_lr_transfer"
    lrs = _check(call, Ns, lrs, seeds, steps)
    from loopprobe.models.gpt import RESIDUALS

    bad = [r for r in residuals if r not in RESIDUALS]
    if bad or not residuals:
        raise ValueError(f"{call}: residuals={list(residuals)!r}; choose from {list(RESIDUALS)}")
    base = {
        "steps": steps,
        "d_model": d_model,
        "n_heads": n_heads,
        "seq_len": seq_len,
        "batch": batch,
        "eval_batches": eval_batches,
        "optimizer": optimizer,
    }
    items = [
        {"residual": r, **base, "N": N, "lr": lr, "seed": s}
        for r in residuals
        for N in Ns
        for lr in lrs
        for s in seeds
    ]
    df = sweep(items, _reference_cell, cache_dir, progress)
    return LRTransfer(df, lrs, "residual", base)


def _reference_cell(cfg: dict) -> dict:
    from loopprobe import tasks

    model = reference_gpt(cfg, K=1, R=cfg["N"], norm="pre", residual=cfg["residual"])
    B, T = cfg["batch"], cfg["seq_len"]
    val_gen = torch.Generator().manual_seed(123)
    evals = [tasks.stdlib_text(B, T, val_gen, split="val") for _ in range(cfg["eval_batches"])]
    return train_short(
        model,
        lambda step, gen: tasks.stdlib_text(B, T, gen),
        evals,
        steps=cfg["steps"],
        lr=cfg["lr"],
        optimizer=cfg["optimizer"],
        generator=torch.Generator().manual_seed(7_000 + cfg["seed"]),
    )


_reference_cell.version = 1
