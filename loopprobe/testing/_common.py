"""What every check shares: the failure message, and the blame for a probe that crashes
because the model's own forward writes its state (private)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn

from loopprobe.record.types import call_model
from loopprobe.testing._snapshot import _differences, _snapshot


def _fmt(xs: Sequence[float]) -> str:
    return "[" + ", ".join(f"{float(x):.4g}" for x in xs) + "]"


def _fail(call: str, what: str, figures: str, fix: str = "") -> None:
    __tracebackhide__ = True  # pytest shows the user's line, not this one
    msg = f"{call}: {what}\n  {figures}"
    raise AssertionError(msg + (f"\n  {fix}" if fix else ""))


def _own_forward_changes(model: nn.Module, batch: Any, forward: Callable | None) -> list[str]:
    """What a plain forward of a copy of the model changes in it (nothing, for a sane model)."""
    import random

    twin = copy.deepcopy(model)
    before = _snapshot(twin)
    py, npy = random.getstate(), np.random.get_state()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            # an odd state: a forward that redraws its weights from torch's RNG must not
            # redraw exactly the values a probe's seeded forward left behind
            torch.manual_seed(20261201)
            call_model(twin, copy.deepcopy(batch), forward)
        # torch's RNG is forked here; the global ones a forward draws from are the model's
        return [d for d in _differences(before, twin) if "torch's" not in d or "RNG" not in d]
    finally:
        random.setstate(py)
        np.random.set_state(npy)


@contextmanager
def _blame_model(call: str, model: nn.Module, batch: Any, forward: Callable | None) -> Iterator:
    """A probe that crashes because the model's own forward writes its parameters (a block
    re-initialised at every visit) becomes an AssertionError that says so."""
    try:
        yield
    except RuntimeError as exc:
        own = _own_forward_changes(model, batch, forward)
        if not own:
            raise
        raise AssertionError(
            f"{call}: the model's own forward changes its state, so no derivative of it is "
            f"meaningful (a block re-initialised at every visit?)\n  a plain forward changed: "
            + "; ".join(own[:4])
            + f"\n  (the probe stopped with: {str(exc).splitlines()[0][:160]})"
        ) from exc
