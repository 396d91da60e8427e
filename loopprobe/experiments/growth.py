"""The growth experiment on the reference model: tied vs untied, per residual rule.

:func:`reference_growth` is :func:`loopprobe.estimate.growth.growth_sweep` on the
pre-norm :class:`~loopprobe.models.LoopedGPT` (K = 1 block looped N times, or N untied
blocks), from uniform random tokens, cached by :func:`loopprobe.sweep`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from loopprobe.estimate.growth import Growth, _fit, _ints, _positive_ints, _row
from loopprobe.estimate.increments import increments
from loopprobe.experiments._reference import reference_gpt
from loopprobe.record.types import Forward
from loopprobe.sweeps import grid, sweep
from loopprobe.theory import TYINGS

# --------------------------------------------------------------------------- reference sweep


def reference_growth(
    tying: str = "tied",
    residual: str = "1/N",
    Ns: Sequence[int] = (1, 2, 4, 8, 16, 32),
    seeds: Sequence[int] = (0, 1, 2),
    *,
    d_model: int = 64,
    n_heads: int = 4,
    seq_len: int = 32,
    batch: int = 8,
    vocab_size: int = 256,
    h0_rms: float | None = 1.0,
    cache_dir: str | None = None,
    progress: bool = False,
) -> Growth:
    """:func:`growth_sweep` on the pre-norm reference :class:`~loopprobe.models.LoopedGPT`.

    ``tying="tied"``: one physical block (K=1) applied for N rounds; ``"untied"``: N
    distinct blocks applied once. ``residual``: the branch multiplier rule
    (``none``, ``1/sqrt(N)``, ``1/N``, ``loop-mup``). Inputs are uniform random tokens.
    ``h0_rms``: the loop starts from the embedding rescaled to this RMS, ``d^-1/2 ||h_0||``
    (seed 004's init assumption ``||h_0||^2 / d = Theta(1)``); ``None`` keeps the model's
    own embedding (std 0.02, RMS about 0.03: then a single increment is some twenty times
    ``h_0`` and the ratio mostly measures the first visit). Reference: docs/definitions.md §3.
    """
    call = "reference_growth"
    if tying not in TYINGS:
        raise ValueError(f"{call}: tying={tying!r}; choose one of {list(TYINGS)}")
    if h0_rms is not None and not (isinstance(h0_rms, (int, float)) and h0_rms > 0):
        raise ValueError(f"{call}: h0_rms={h0_rms!r} must be a positive number or None")
    Ns, seeds = _positive_ints(call, "Ns", Ns), _ints(call, "seeds", seeds)
    base = {
        "tying": tying,
        "residual": residual,
        "d_model": d_model,
        "n_heads": n_heads,
        "seq_len": seq_len,
        "batch": batch,
        "vocab_size": vocab_size,
        "h0_rms": h0_rms,
    }
    _reference_model({**base, "N": 1, "seed": 0})  # validates the config before sweeping
    df = sweep(
        grid(**{k: [v] for k, v in base.items()}, N=Ns, seed=seeds),
        _reference_cell,
        cache_dir,
        progress,
    )
    return _fit(df, base)


def _reference_model(cfg: dict) -> nn.Module:
    tied = cfg["tying"] == "tied"
    return reference_gpt(cfg, vocab_size=cfg["vocab_size"], K=1, R=cfg["N"], norm="pre",
                         residual=cfg["residual"], tied=tied)  # fmt: skip


def start_at_rms(h0_rms: float | None) -> Forward:
    """A ``forward`` for the reference models: the loop from ``embed`` rescaled to RMS h0_rms."""

    def forward(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
        x = model.embed(idx)
        if h0_rms is not None:
            x = x * (h0_rms / x.pow(2).mean().sqrt())
        return model.loop(x)

    return forward


def _reference_cell(cfg: dict) -> dict:
    from loopprobe import tasks

    model = _reference_model(cfg)
    gen = torch.Generator().manual_seed(10_000 + cfg["seed"])
    idx, _ = tasks.random_tokens(cfg["batch"], cfg["seq_len"], cfg["vocab_size"], gen)
    inc = increments(model, idx, forward=start_at_rms(cfg["h0_rms"]), copy=False)
    return _row(inc)


_reference_cell.version = 2
