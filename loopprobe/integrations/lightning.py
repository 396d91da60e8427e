"""``MonitorCallback``: a PyTorch Lightning ``Callback`` that calls ``Monitor.step``.

Example::

    from loopprobe.integrations.lightning import MonitorCallback

    mon = lp.Monitor(lit_module.model, probe_idx, loss_fn, every=50)
    lightning.Trainer(max_steps=1000, callbacks=[MonitorCallback(mon)]).fit(lit_module, data)

``on_train_batch_end`` runs ``mon.step(trainer.global_step, loss=...)`` once per optimizer
step (with gradient accumulation, on the batch that completed the step; the first
monitored step is 1), with the loss ``training_step`` returned; ``on_train_end`` closes
the sinks. lightning (or pytorch_lightning) is imported when ``MonitorCallback`` is first
looked up, not with this module.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

__all__ = ["MonitorCallback"]  # noqa: F822 - built on first lookup (module __getattr__)


def _base() -> type:
    try:
        from lightning.pytorch import Callback
    except ImportError:
        try:
            from pytorch_lightning import Callback
        except ImportError as err:
            raise ImportError(
                "loopprobe.integrations.lightning needs lightning; pip install lightning"
            ) from err
    return Callback


@functools.cache
def _callback_class() -> type:
    from loopprobe.monitor.monitor import Monitor

    class MonitorCallback(_base()):
        """Runs a :class:`loopprobe.Monitor` after every optimizer step it schedules."""

        def __init__(self, monitor: Monitor) -> None:
            if not isinstance(monitor, Monitor):
                raise TypeError(
                    f"MonitorCallback: expected a loopprobe Monitor, got {type(monitor).__name__}"
                )
            self.monitor = monitor
            self._last_step = -1

        def on_train_start(self, trainer, pl_module):
            self._last_step = trainer.global_step  # resumed runs start past 0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step = trainer.global_step
            if step == self._last_step:
                return  # gradient accumulation: no optimizer step since the last batch
            self._last_step = step
            loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
            self.monitor.step(step, loss=loss)

        def on_train_end(self, trainer, pl_module):
            self.monitor.close()

    MonitorCallback.__module__ = __name__
    return MonitorCallback


def __getattr__(name: str) -> Any:
    if name == "MonitorCallback":
        return _callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
