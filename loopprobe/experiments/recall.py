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
import math
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


# --------------------------------------------------------- many inputs per run

BASE_ITER, HARD_CAP, RATE_WINDOW, NOT_CONTRACTING = 300, 4000, 50, 0.999


def _rel_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per input (dim 0): ||a|| / ||b||."""
    return a.flatten(1).norm(dim=1) / b.flatten(1).norm(dim=1)


def picard_many(
    step, x: torch.Tensor, h0: torch.Tensor, *, tol: float = 1e-7, base_iter: int = BASE_ITER,
    hard_cap: int = HARD_CAP, window: int = RATE_WINDOW, slow: float = NOT_CONTRACTING,
) -> dict:  # fmt: skip
    """Picard ``h <- step(h, x)`` for a batch of inputs, each judged on its own residual
    ``||T(h) - h|| / ||h||``, with the cap set from each input's observed contraction rate.

    Every input gets ``base_iter`` iterations; one not at ``tol`` then has rate
    ``q = (r_base / r_{base-window})^(1/window)``: if ``q >= slow`` it stops (not contracting),
    else it may run to ``base_iter + ceil(2 k)``, ``k = log(tol / r_base) / log q`` (at most
    ``hard_cap``). Inputs must not interact in ``step`` (a transformer's batch rows do not).
    Returns per-input tensors: ``h`` (the state where it stopped), ``reached``,
    ``iterations``, ``residual``, ``rate`` (over the last ``window`` iterations it ran),
    ``cap`` and ``reach_2x`` (reached, or its last rate would reach ``tol`` within
    2 x ``hard_cap``). The twin of :func:`~loopprobe.fixed_point` per input (tests).
    """
    if base_iter <= window or hard_cap < base_iter:
        raise ValueError(f"picard_many: need window < base_iter <= hard_cap, got {window}, "
                         f"{base_iter}, {hard_cap}")  # fmt: skip
    B = h0.shape[0]
    h = h0.clone()
    reached = torch.zeros(B, dtype=torch.bool)
    stop = torch.full((B,), -1, dtype=torch.long)
    cap = torch.full((B,), hard_cap, dtype=torch.long)
    hist: list[torch.Tensor] = []
    with torch.no_grad():
        for k in range(hard_cap + 1):
            Th = step(h, x)
            r = _rel_rows(Th - h, h)
            r = torch.where(torch.isfinite(r), r, torch.full_like(r, math.inf))
            live = stop < 0
            hist.append(torch.where(live, r, hist[-1] if hist else r))
            hit = live & (r <= tol)
            reached |= hit
            stop[hit] = k
            if k == base_iter:
                q = (hist[k] / hist[k - window]) ** (1.0 / window)
                need = torch.log(tol / hist[k]) / torch.log(q)
                cap = torch.where(q < slow, (base_iter + torch.ceil(2 * need)).clamp(
                    max=hard_cap), torch.full_like(q, base_iter)).long()  # fmt: skip
            done = (stop < 0) & ((k >= cap) | ~torch.isfinite(r))
            stop[done] = k
            live = stop < 0
            if not live.any():
                break
            h = torch.where(live.view(-1, *([1] * (h.dim() - 1))), Th, h)
    stop[stop < 0] = k
    H = torch.stack(hist)  # (iterations + 1, B)
    idx = torch.arange(B)
    res = H[stop, idx]
    rate = (res / H[(stop - window).clamp(min=0), idx]) ** (1.0 / window)
    more = torch.log(tol / res) / torch.log(rate)
    reach_2x = reached | ((rate < 1) & (stop + more <= 2 * hard_cap))
    return {"h": h, "reached": reached, "iterations": stop, "residual": res, "rate": rate,
            "cap": cap, "reach_2x": reach_2x}  # fmt: skip


def distinct_points(h: torch.Tensor, delta: float = 1e-3) -> dict:
    """Cluster states ``h`` (dim 0 indexes them) into distinct fixed points: ``i`` and ``j``
    are the same when ``||h_i - h_j|| / max(||h_i||, ||h_j||) <= delta`` (single linkage:
    the connected components of that graph). Returns ``count``, ``labels``, ``gap`` (the
    smallest distance between different clusters; inf for one) and ``spread`` (the largest
    distance inside a cluster; 0 for singletons)."""
    from scipy.sparse.csgraph import connected_components

    flat = h.flatten(1).double()
    n = flat.norm(dim=1)
    d = torch.cdist(flat, flat) / torch.maximum(n[:, None], n[None, :]).clamp_min(1e-300)
    count, labels = connected_components((d <= delta).numpy(), directed=False)
    same = torch.as_tensor(labels[:, None] == labels[None, :])
    gap = float(d[~same].min()) if (~same).any() else math.inf
    return {"count": int(count), "labels": labels, "gap": gap,
            "spread": float(d[same].max()) if len(flat) else 0.0}  # fmt: skip


def reach_probe(
    model: LoopedGPT, idx: torch.Tensor, targets: torch.Tensor, *, tol: float = 1e-7,
    delta: float = 1e-3, n_rho: int = 8, eps: float = 1e-3, seed: int = 0, **cap,
) -> dict:  # fmt: skip
    """Reachability of a float64 model on many inputs ``idx`` (one row of numbers per run).

    :func:`picard_many` from ``h0 = x``; reach fractions (at the cap rule and with 2 x the
    hard cap), the misses' reasons, rho(dT/dh) on the first ``n_rho`` reached inputs
    (:func:`~loopprobe.spectral_radius`), :func:`distinct_points` among the reached ones,
    the distinct predicted outputs there and the accuracy at the fixed point, and local
    constancy: ``x`` (and so ``h0``) moved by ``eps ||x||`` at random, solved again, the
    median ``||h*(x') - h*(x)|| / ||x' - x||`` over inputs reached both times.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        x = model.embed(idx)
    fp = picard_many(model.step, x, x, tol=tol, **cap)
    ok = fp["reached"]
    n_ok = int(ok.sum())
    out = {"inputs": len(idx), "reached": n_ok, "reach_frac": n_ok / len(idx),
           "reach_frac_2x": float(fp["reach_2x"].double().mean()),
           "miss_not_contracting": int((~ok & (fp["rate"] >= NOT_CONTRACTING)).sum()),
           "miss_hard_cap": int((~ok & (fp["cap"] >= cap.get("hard_cap", HARD_CAP))).sum()),
           "iter_median": float(fp["iterations"][ok].double().median()) if n_ok else math.nan,
           "iter_max": int(fp["iterations"].max()),
           "rate_median": float(fp["rate"].double().median())}  # fmt: skip
    rho = []
    for i in torch.nonzero(ok).flatten()[:n_rho].tolist():
        xi = x[i : i + 1]
        sr = spectral_radius(lambda h, xi=xi: model.step(h, xi), fp["h"][i : i + 1], k=4,
                             generator=gen)  # fmt: skip
        rho.append(sr.value)
    out.update(rho_n=len(rho), rho_median=float(np_median(rho)),
               rho_max=max(rho) if rho else math.nan)  # fmt: skip
    nan = {"distinct": math.nan, "distinct_frac": math.nan, "gap": math.nan, "spread": math.nan,
           "distinct_outputs": math.nan, "distinct_inputs": math.nan, "acc_fixed": math.nan,
           "local_sensitivity": math.nan}  # fmt: skip
    if n_ok == 0:
        return {**out, **nan}
    hs = fp["h"][ok]
    dp = distinct_points(hs, delta)
    with torch.no_grad():
        pred = model.head(hs).argmax(-1)
    out.update(distinct=dp["count"], distinct_frac=dp["count"] / n_ok, gap=dp["gap"],
               spread=dp["spread"], distinct_outputs=int(torch.unique(pred, dim=0).shape[0]),
               distinct_inputs=int(torch.unique(idx[ok], dim=0).shape[0]),
               acc_fixed=float((pred == targets[ok]).double().mean()))  # fmt: skip
    u = torch.randn(x[ok].shape, generator=gen, dtype=x.dtype)
    scale = eps * x[ok].flatten(1).norm(dim=1) / u.flatten(1).norm(dim=1)
    xp = x[ok] + scale.view(-1, *([1] * (x.dim() - 1))) * u
    fp2 = picard_many(model.step, xp, xp, tol=tol, **cap)
    both = fp2["reached"]
    moved = (fp2["h"] - hs).flatten(1).norm(dim=1) / (xp - x[ok]).flatten(1).norm(dim=1)
    s = moved[both]
    out["local_sensitivity"] = float(s.median()) if both.any() else math.nan
    return out


def np_median(values: list) -> float:
    return float(torch.tensor(values, dtype=torch.float64).median()) if values else math.nan
