"""Which factory (and batch) a model drawn by :func:`loopprobe.testing.configs` came from.

Kept outside the model (a weak map), so the checks that need the family (slopes in R) can
rebuild it at other R without the model carrying anything of loopprobe's.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

# model -> rebuild(R) -> (model at R, its batch)
_FAMILIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def remember(model: nn.Module, rebuild: Callable[[int], tuple[nn.Module, Any]]) -> None:
    _FAMILIES[model] = rebuild


def rebuilder(model_or_factory: Any, batch: Any, call: str) -> Callable[[int], tuple]:
    """``R -> (model, batch)`` for a drawn model, or for a factory ``R -> model``."""
    if isinstance(model_or_factory, nn.Module):
        rebuild = _FAMILIES.get(model_or_factory)
        if rebuild is None:
            raise TypeError(
                f"{call}: a statement about R needs the model family, and this "
                f"{type(model_or_factory).__name__} was not drawn by loopprobe.testing.configs;"
                " pass a factory R -> model instead (e.g. lambda R: MyLoop(R=R))"
            )
        return rebuild
    if callable(model_or_factory):
        return lambda R: (
            (m := model_or_factory(R)),
            batch(m) if callable(batch) else batch,
        )
    raise TypeError(
        f"{call}: expected an nn.Module drawn by loopprobe.testing.configs or a factory "
        f"R -> model, got {type(model_or_factory).__name__}"
    )
