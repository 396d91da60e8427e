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
