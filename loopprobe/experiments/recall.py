"""Recall x outer normalization: the fixed-point study on single-block looped models.

Seed 000/003 (the fixed-point framework, Labovich, arXiv 2604.15259) claims: without
recall the fixed points cannot depend strongly on the input; recall with an outer
normalization gives fixed points that are reachable (rho(dT/dh) < 1) and smooth in the
input. This module trains a one-block :class:`~loopprobe.models.LoopedGPT` briefly on a
shipped task for every recall placement and outer-norm setting, then measures at a probe
input: reachability (:func:`~loopprobe.fixed_point`, the model's own R rounds), geometry
(:func:`~loopprobe.spectral_radius`, :func:`~loopprobe.jacobian_norm`) and input-dependence
(:func:`~loopprobe.input_dependence`, implicit and unrolled). Reference: docs/definitions.md §4.

Example::

    df = recall_study(tasks=("prefix_sums",), seeds=(0, 1))
    df.pivot_table(index="recall", columns="outer_norm", values="input_dependence")
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pandas as pd
import torch
import torch.nn.functional as F

from loopprobe import tasks
from loopprobe.differentiate.roundmap import round_map
from loopprobe.estimate.fixedpoint import (
    fixed_point,
    jacobian_norm,
    round_residuals,
    spectral_radius,
)
from loopprobe.estimate.implicit import input_dependence
from loopprobe.models import GPTConfig, LoopedGPT

RECALLS = ("none", "add", "linear", "internal")
TASKS = ("prefix_sums", "sudoku_like")


def task_batch(task: str, batch: int, seq_len: int, generator: torch.Generator):
    """``(inputs, targets, vocab)`` of a shipped task; targets at every position.

    ``prefix_sums``: running parity of ``seq_len`` bits (vocabulary 2). ``sudoku_like``:
    a 4 x 4 Latin square with half the cells masked (16 positions, vocabulary 5; the loss
    covers every cell, as a denoising objective). Seed 003 trains on both kinds.
    """
    if task == "prefix_sums":
        inputs, targets = tasks.prefix_sums(batch, seq_len, generator)
        return inputs, targets, 2
    if task == "sudoku_like":
        inputs, targets = tasks.sudoku_like(batch, generator, n=4)
        return inputs, targets, 5
    raise ValueError(f"task_batch: task={task!r} is unknown; use one of {list(TASKS)}")


def train(
    task: str,
    recall: str,
    outer_norm: bool,
    *,
    seed: int = 0,
    steps: int = 40,
    batch: int = 32,
    seq_len: int = 16,
    d_model: int = 32,
    n_heads: int = 4,
    R: int = 4,
    lr: float = 3e-3,
) -> tuple[LoopedGPT, list[float]]:
    """A one-block LoopedGPT (K=1, pre-norm) trained ``steps`` AdamW steps; returns the losses."""
    g = torch.Generator().manual_seed(seed)
    inputs, _, vocab = task_batch(task, 1, seq_len, g)
    cfg = GPTConfig(vocab_size=vocab, seq_len=inputs.shape[1], d_model=d_model,
                    n_heads=n_heads, K=1, R=R, recall=recall, outer_norm=outer_norm)  # fmt: skip
    with torch.random.fork_rng(devices=[]):  # nn.Linear's default init draws from the global RNG
        model = LoopedGPT(cfg, generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        inputs, targets, _ = task_batch(task, batch, seq_len, g)
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model.eval(), losses


def probe(
    model: LoopedGPT, idx: torch.Tensor, *, tol: float = 1e-6, max_iter: int = 200,
    k: int = 4, norm_tol: float = 1e-6, solve_tol: float = 1e-10, seed: int = 0,
) -> dict:  # fmt: skip
    """Reachability, geometry and input-dependence of one round at ``idx`` (flat dict).

    The fixed point is sought from ``h0 = x`` (the embedding, where the model starts);
    the implicit ``||dh*/dx||`` exists only at a fixed point, so it is NaN where the
    iteration did not converge (the unrolled one is always measured).
    ``rounds_residual`` is ``||T(h_R) - h_R|| / ||h_R||`` after the model's own R rounds.
    """
    rm = round_map(model, idx)
    fp = fixed_point(rm.T, rm.h0, tol=tol, max_iter=max_iter)
    gen = torch.Generator().manual_seed(seed)
    sr = spectral_radius(rm.T, fp.h, k=k, generator=gen)
    jn = jacobian_norm(rm.T, fp.h, generator=gen, tol=norm_tol)
    dep = input_dependence(rm.step, fp.h, rm.x, rounds=rm.rounds, norm_tol=norm_tol,
                               tol=solve_tol, implicit=fp.converged, generator=gen)  # fmt: skip
    rr = round_residuals(rm.T, rm.h0, rm.rounds)
    return {
        "converged": fp.converged,
        "iterations": fp.iterations,
        "residual": fp.residual,
        "rate": fp.rate,
        "rounds_residual": rr.residual,
        "spectral_radius": sr.value,
        "spectral_radius_converged": sr.converged,
        "jacobian_norm": jn.value,
        "input_dependence": dep.value,
        "input_dependence_unrolled": dep.unrolled.value,
        "input_dependence_gap": dep.gap,
        "input_dependence_converged": dep.converged,
    }


def recall_study(
    tasks: Sequence[str] = TASKS,
    recalls: Sequence[str] = RECALLS,
    outer_norms: Sequence[bool] = (False, True),
    seeds: Sequence[int] = (0,),
    *,
    steps: int = 40,
    seq_len: int = 16,
    d_model: int = 32,
    n_heads: int = 4,
    R: int = 4,
    probe_tol: float = 1e-6,
    max_iter: int = 200,
    norm_tol: float = 1e-6,
    solve_tol: float = 1e-10,
) -> pd.DataFrame:
    """One row per (task, recall, outer_norm, seed): training loss and the probe's numbers.

    Training runs in float32; the probe in float64 on one held-out example. Columns:
    ``task, recall, outer_norm, seed, train_loss`` (mean of the last 5 steps),
    ``eval_loss, eval_accuracy`` (256 fresh examples), then :func:`probe`'s keys.
    """
    rows = []
    for task, recall, outer, seed in itertools.product(tasks, recalls, outer_norms, seeds):
        model, losses = train(task, recall, outer, seed=seed, steps=steps, seq_len=seq_len,
                              d_model=d_model, n_heads=n_heads, R=R)  # fmt: skip
        g = torch.Generator().manual_seed(10_000 + seed)
        inputs, targets, _ = task_batch(task, 256, seq_len, g)
        with torch.no_grad():
            logits = model(inputs)
        eval_loss = float(F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
        accuracy = float((logits.argmax(-1) == targets).double().mean())
        numbers = probe(model.double(), inputs[:1], tol=probe_tol, max_iter=max_iter,
                        norm_tol=norm_tol, solve_tol=solve_tol, seed=seed)  # fmt: skip
        rows.append({"task": task, "recall": recall, "outer_norm": outer, "seed": seed,
                     "train_loss": sum(losses[-5:]) / len(losses[-5:]),
                     "eval_loss": eval_loss, "eval_accuracy": accuracy, **numbers})  # fmt: skip
    return pd.DataFrame(rows)
