"""The coord check of the reference LoopedGPT (``lp.experiments.reference_coord_check``).

:func:`loopprobe.experiments.coordcheck.coord_check` takes any model family; this module runs
it on the reference :class:`~loopprobe.models.LoopedGPT` per residual scheme, one cached sweep
cell per (scheme, N, seed), on byte-level text (``lp.tasks.stdlib_text``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from loopprobe.experiments._reference import reference_gpt
from loopprobe.experiments.coordcheck import CoordCheck, _check, _run_one
from loopprobe.sweeps import sweep
from loopprobe.tasks import lm_loss
from loopprobe.theory import SCHEMES

__all__ = ["parse_scheme", "reference_coord_check"]


def parse_scheme(spec: str) -> tuple[str, str]:
    """``"pre:1/N"`` -> ``("pre", "1/N")``; ``"deeploop"`` -> ``("deeploop", "none")``."""
    if spec not in SCHEMES:
        raise ValueError(f"scheme {spec!r} is not one of {list(SCHEMES)}")
    norm, _, residual = spec.partition(":")
    return norm, residual or "none"


def reference_coord_check(
    schemes: Sequence[str] = SCHEMES[:4],
    Ns: Sequence[int] = (1, 2, 4, 8, 16),
    seeds: Sequence[int] = (0, 1),
    *,
    K: int = 1,
    steps: int = 4,
    lr: float = 1e-2,
    optimizer: str = "adam",
    d_model: int = 64,
    n_heads: int = 4,
    seq_len: int = 32,
    batch: int = 8,
    h0_rms: float | None = 1.0,
    cache_dir: str | None = None,
    progress: bool = False,
) -> CoordCheck:
    """:func:`coord_check` of the reference LoopedGPT (K blocks, R = N/K rounds, tied).

    ``schemes``: ``pre:<residual>`` (pre-norm with ``none``, ``1/sqrt(N)``, ``1/N``,
    ``loop-mup``) and the post-norm ``post``, ``deepnorm``, ``deeploop``. Training and
    probe batches are byte-level windows of ``lp.tasks.stdlib_text`` (train split), the
    probe batch fixed per seed. With K = 1, ``loop-mup`` (``1/(R sqrt(K))``) equals
    ``1/N``. ``h0_rms``: the embedding output is multiplied by a constant, fixed at init,
    that gives the probe batch's loop input ``h_0`` this RMS (seed 004 assumes
    ``||h_0||^2/d = Theta(1)``); ``None`` trains the model as built (embedding std 0.02,
    ``h_0`` RMS about 0.03: the first visit's RMSNorm then divides by 0.03, so each Adam
    step on the embedding swings the first increments, and that transient adds to the
    N-dependence). Reference: docs/definitions.md §5; seed 004; seed 002 (DeepNorm vs DeepLoop).
    """
    call = "reference_coord_check"
    specs = [parse_scheme(s) for s in schemes]
    _check(call, Ns, seeds, steps, lr)
    bad = [n for n in Ns if n % K]
    if bad:
        raise ValueError(f"{call}: every N must be a multiple of K={K}; got {bad}")
    base = {
        "K": K,
        "steps": steps,
        "lr": lr,
        "optimizer": optimizer,
        "d_model": d_model,
        "n_heads": n_heads,
        "seq_len": seq_len,
        "batch": batch,
        "h0_rms": h0_rms,
    }
    if h0_rms is not None and not (isinstance(h0_rms, (int, float)) and h0_rms > 0):
        raise ValueError(f"{call}: h0_rms={h0_rms!r} must be a positive number or None")
    items = [
        {"scheme": s, **base, "N": N, "seed": seed}
        for s, _ in zip(schemes, specs, strict=True)
        for N in Ns
        for seed in seeds
    ]
    df = sweep(items, _reference_cell, cache_dir, progress)
    return CoordCheck(df, base)


def _reference_cell(cfg: dict) -> list[dict]:
    from loopprobe import tasks

    norm, residual = parse_scheme(cfg["scheme"])
    model = reference_gpt(cfg, K=cfg["K"], R=cfg["N"] // cfg["K"], norm=norm, residual=residual)
    probe_idx, _ = tasks.stdlib_text(
        cfg["batch"], cfg["seq_len"], torch.Generator().manual_seed(50_000 + cfg["seed"])
    )

    def batch_fn(step: int, gen: torch.Generator):
        return tasks.stdlib_text(cfg["batch"], cfg["seq_len"], gen)

    c = 1.0
    if cfg.get("h0_rms") is not None:
        with torch.no_grad():
            c = cfg["h0_rms"] / float(model.embed(probe_idx).pow(2).mean().sqrt())

    def state(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m.loop(c * m.embed(x))

    return _run_one(
        model,
        cfg["N"],
        cfg["seed"],
        steps=cfg["steps"],
        lr=cfg["lr"],
        optimizer=cfg["optimizer"],
        batch_fn=batch_fn,
        probe_inputs=probe_idx,
        loss_fn=lm_loss,
        forward=state,
        sublayers=None,
        train_forward=lambda m, x: m.head(state(m, x)),
    )


_reference_cell.version = 3  # 3: rows carry l1
