"""Lazy-update simulation: what skipping the quiet tokens in late loops would cost.

FlashLoop's token-sparse update, simulated by hooks on any looped model: in loops
``t >= start`` only the top fraction ``f`` of tokens (per sequence) by the change score of
the previous loop, ``s_i = ||h_{t-1,i} - h_{t-2,i}|| / ||h_{t-1,i}||`` on the loop's output
(the output of the last layer visited in the round), is recomputed; every other token
carries its previous-loop output in every layer of the loop (so the layers after it see the
previous loop's rows, as a reused K/V cache would give them). The last token is always
recomputed when ``keep_last`` (FlashLoop does so for generation).

Nothing is skipped for real: the model computes every token and the hook overwrites the
frozen rows, so the output is exactly what the lazy scheme produces and ``saved`` counts
the token-layer updates it would not compute. Reported per ``f``: ``kl`` (mean over
positions of KL(dense || lazy) of ``softmax(F)`` over the last axis, F = the model output as
logits), ``rel_change`` ``= ||F_lazy - F_dense|| / ||F_dense||``, ``loss_change`` (with
``targets``: cross-entropy lazy minus dense) and ``saved``. Reference: FlashLoop (arXiv
2609.29812), the digest in shared/PAPERS.md §7.

Example::

    df = lazy_update(model, idx, targets=targets)    # one row per f
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from loopprobe.estimate.redundancy import default_layers
from loopprobe.estimate.redundancy.metrics import change_score
from loopprobe.record.probe import Probe
from loopprobe.record.types import call_model, pick_output, seeded

FRACTIONS = (0.1, 0.25, 0.5, 1.0)


def _with_first(out: Any, new: torch.Tensor) -> Any:
    return new if isinstance(out, torch.Tensor) else (new, *out[1:])


def _first(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out[0]


def _active(
    prev2: torch.Tensor, prev1: torch.Tensor, f: float, keep_last: bool, gen: torch.Generator | None
) -> torch.Tensor:
    """``(B, T)`` mask of the top ``ceil(f T)`` tokens by the change score, per sequence
    (by a uniform random score drawn from ``gen`` when it is given)."""
    score = change_score(prev2.double(), prev1.double())[1]
    if gen is not None:
        score = torch.rand(score.shape, generator=gen, dtype=score.dtype).to(score.device)
    if keep_last:
        score[..., -1] = math.inf
    top = max(1, math.ceil(f * score.shape[-1]))
    idx = score.argsort(dim=-1, descending=True, stable=True)[..., :top]
    return torch.zeros_like(score, dtype=torch.bool).scatter_(-1, idx, True)


def _run(
    model: nn.Module,
    inputs: Any,
    modules: dict[str, list[nn.Module]],
    order: list[str] | None,
    f: float | None,
    start: int,
    keep_last: bool,
    gen: torch.Generator | None,
    forward: Callable | None,
    output: Callable | None,
    seed: int | None,
) -> tuple[torch.Tensor, list[str], int, int]:
    """One forward; ``f=None`` is dense. Returns F, the layers in call order, and frozen and
    total token-layer updates."""
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in modules}
    sequence: list[str] = []
    loop_out: list[torch.Tensor] = []  # the round's output (the last layer of the round)
    counts = [0, 0]
    mask: dict[int, torch.Tensor] = {}

    def hook(name: str) -> Callable:
        def fn(module: nn.Module, args: tuple, out: Any) -> Any:
            t = len(seen[name]) + 1  # 1-based loop of this visit
            h = _first(out)
            if h.dim() != 3:
                raise ValueError(
                    f"lazy_update: layer {name!r} returned shape {tuple(h.shape)}; the "
                    "simulation needs (batch, tokens, features) outputs"
                )
            counts[1] += h.shape[0] * h.shape[1]
            if f is not None and t >= start and len(loop_out) >= 2:
                if t not in mask:
                    mask[t] = _active(loop_out[-2], loop_out[-1], f, keep_last, gen)
                keep = mask[t]
                counts[0] += int((~keep).sum())
                h = torch.where(keep[..., None], h, seen[name][-1])
                out = _with_first(out, h)
            seen[name].append(h.detach())
            sequence.append(name)
            if order is not None and name == order[-1]:
                loop_out.append(h.detach())
            return out

        return fn

    handles = [m.register_forward_hook(hook(n)) for n, ms in modules.items() for m in ms]
    try:
        with seeded(seed), torch.no_grad():
            Fx = pick_output(call_model(model, inputs, forward), output, call="lazy_update")
    finally:
        for h in handles:
            h.remove()
    return Fx.detach().double(), sequence, counts[0], counts[1]


def lazy_update(
    model: nn.Module,
    inputs: Any,
    *,
    fractions: Sequence[float] = FRACTIONS,
    start: int = 3,
    layers: Sequence[str] | None = None,
    targets: torch.Tensor | None = None,
    keep_last: bool = True,
    select: str = "score",
    forward: Callable | None = None,
    output: Callable | None = None,
    seed: int | None = 0,
) -> pd.DataFrame:
    """Output change and saved work of the lazy token update, one row per fraction ``f``.

    ``layers``: the per-loop state modules as in :func:`loopprobe.estimate.redundancy.redundancy`
    (each visited once per loop). ``start``: the first lazy loop (1-based; FlashLoop: 3).
    ``targets``: token ids for ``loss_change`` (cross-entropy of ``F`` flattened).
    ``select``: ``score`` (FlashLoop's change score) or ``random`` (the same number of
    tokens drawn uniformly from a generator seeded with ``seed``: the baseline the score
    has to beat).
    The model is not changed (forward hooks for one call each, removed on exit).
    """
    call = "lazy_update"
    if not fractions or any(not isinstance(f, (int, float)) or not 0 < f <= 1 for f in fractions):
        raise ValueError(f"{call}: fractions={fractions!r} must lie in (0, 1], e.g. (0.1, 0.5)")
    if isinstance(start, bool) or not isinstance(start, int) or start < 3:
        raise ValueError(
            f"{call}: start={start!r} must be an integer >= 3 (the score needs two loops)"
        )
    if select not in ("score", "random"):
        raise ValueError(f"{call}: select={select!r} must be 'score' or 'random'")
    layers = default_layers(model) if layers is None else list(layers)
    probe = Probe(model, layers)
    subs = [s for s in probe.sublayers(inputs, forward=forward, seed=seed) if s.role == "body"]
    named = dict(model.named_modules())
    modules = {s.name: [named[m] for m in s.modules] for s in subs}
    run = (model, inputs, modules)
    dense, sequence, _, _ = _run(*run, None, None, start, keep_last, None, forward, output, seed)
    per_layer = {n: sequence.count(n) for n in modules}
    if len(set(per_layer.values())) != 1:
        raise ValueError(
            f"{call}: the layers are visited unequally often ({per_layer}); name layers visited "
            "once per loop with layers=[...]"
        )
    order = sequence[: len(modules)]  # call order within a round
    rows = []
    for f in fractions:
        gen = torch.Generator().manual_seed(seed or 0) if select == "random" else None
        lazy, _, frozen, total = _run(*run, order, f, start, keep_last, gen, forward, output, seed)
        p, q = dense.log_softmax(-1), lazy.log_softmax(-1)
        row = {
            "f": float(f),
            "select": select,
            "kl": float((p.exp() * (p - q)).sum(-1).mean()),
            "rel_change": float((lazy - dense).norm() / dense.norm()),
            "saved": frozen / total,
            "loops": next(iter(per_layer.values())),
        }
        if targets is not None:
            ce = [F.cross_entropy(x.flatten(0, -2), targets.flatten()) for x in (dense, lazy)]
            row["loss_change"] = float(ce[1] - ce[0])
        rows.append(row)
    return pd.DataFrame(rows)
