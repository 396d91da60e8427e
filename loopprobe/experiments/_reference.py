"""The reference LoopedGPT of one sweep cell, built the same way by every reference driver."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from loopprobe.models import GPTConfig, LoopedGPT


def reference_gpt(cell: Mapping[str, Any], *, vocab_size: int = 256, **config: Any) -> LoopedGPT:
    """The cell's ``LoopedGPT``: its ``seq_len``, ``d_model`` and ``n_heads``, initialised from
    its ``seed``; ``config`` gives the rest of the :class:`GPTConfig` (``K``, ``R``, ``norm``,
    ``residual``, ``tied``). The vocabulary is the bytes of ``lp.tasks.stdlib_text``."""
    cfg = GPTConfig(
        vocab_size=vocab_size,
        seq_len=cell["seq_len"],
        d_model=cell["d_model"],
        n_heads=cell["n_heads"],
        **config,
    )
    return LoopedGPT(cfg, generator=torch.Generator().manual_seed(cell["seed"]))
