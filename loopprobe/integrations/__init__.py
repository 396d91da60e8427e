"""Thin adapters that call :class:`loopprobe.Monitor` from trainers' callback hooks.

- :mod:`loopprobe.integrations.huggingface`: ``MonitorCallback`` (a ``TrainerCallback``):
  the numbers in ``trainer.state.log_history`` and the Trainer's ``logs``, the monitor's
  state in ``trainer_state.json``;
- :mod:`loopprobe.integrations.lightning`: ``MonitorCallback``, a Lightning ``Callback``:
  the numbers in ``trainer.loggers``, the monitor's state in Lightning checkpoints.

Each module imports its trainer library only when ``MonitorCallback`` is first looked up,
so ``import loopprobe`` (and importing these modules) never imports transformers or lightning.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def lazy_callback(module: str, build: Callable[[], type]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of an adapter: ``MonitorCallback`` is built by ``build``
    (which imports the trainer library) on its first lookup, once, and given ``module`` as
    its ``__module__`` (and its own name as ``__qualname__``); every other name is an
    AttributeError."""

    @functools.cache
    def callback_class() -> type:
        cls = build()
        cls.__module__ = module
        cls.__qualname__ = cls.__name__  # not _callback_class.<locals>.X: keys, pickles, reprs
        return cls

    def __getattr__(name: str) -> Any:
        if name == "MonitorCallback":
            return callback_class()
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


def training_optimizer(optimizer: Any, call: str) -> Any:
    """The trainer's optimizer as a monitor's ``update=``: the torch SGD/Adam/AdamW inside
    the trainer's wrappers (accelerate's ``AcceleratedOptimizer``, Lightning's
    ``LightningOptimizer``), or ``"sgd"`` with a warning for any other optimizer (its step
    has no per-visit form here: G is then the raw gradient)."""
    import warnings

    import torch

    seen = optimizer
    for _ in range(8):  # wrappers keep the wrapped optimizer as .optimizer / ._optimizer
        inner = getattr(seen, "optimizer", None) or getattr(seen, "_optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is seen:
            break
        seen = inner
    if isinstance(seen, torch.optim.SGD | torch.optim.Adam | torch.optim.AdamW):
        return seen
    if optimizer is not None:
        warnings.warn(
            f"{call}: the trainer's optimizer ({type(seen).__name__}) has no per-visit update "
            "rule in loopprobe (SGD, Adam, AdamW do): G is the raw per-visit gradient "
            "(update='sgd'); pass update= to the callback to choose",
            stacklevel=3,
        )
    return "sgd"
