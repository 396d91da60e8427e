"""``MonitorCallback``: a Hugging Face ``TrainerCallback`` that calls ``Monitor.step``.

Example::

    from loopprobe.integrations.huggingface import MonitorCallback

    mon = lp.Monitor(model, probe_ids, loss_fn, every=50, sinks=[TensorBoardSink("runs/x")])
    trainer = transformers.Trainer(model=model, ..., callbacks=[MonitorCallback(mon)])

``on_step_end`` (after the optimizer step; ``state.global_step`` already counts it, so the
first monitored step is 1) runs ``mon.step(state.global_step)``; ``on_train_end`` closes
the sinks. The Trainer logs its loss after ``on_step_end``, so the frame's loss is the
monitor's own ``probe_loss``. Instead of a monitor, pass ``Monitor``'s arguments
(``MonitorCallback(inputs=probe_ids, loss_fn=..., every=50)``) and it is built on the
Trainer's model when training begins. transformers is imported when ``MonitorCallback``
is first looked up, not with this module.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["MonitorCallback"]  # noqa: F822 - built on first lookup (module __getattr__)


@functools.cache
def _callback_class() -> type:
    try:
        from transformers import TrainerCallback
    except ImportError as err:
        raise ImportError(
            "loopprobe.integrations.huggingface needs transformers; pip install transformers"
        ) from err

    from loopprobe.monitor.monitor import Monitor

    class MonitorCallback(TrainerCallback):
        """Runs a :class:`loopprobe.Monitor` after every optimizer step it schedules."""

        def __init__(self, monitor: Monitor | None = None, **monitor_kwargs: Any) -> None:
            if (monitor is None) == (not monitor_kwargs):
                raise ValueError(
                    "MonitorCallback: pass a Monitor, or Monitor's arguments (inputs=..., "
                    "loss_fn=..., every=...) to build one on the Trainer's model; not both"
                )
            if monitor is not None and not isinstance(monitor, Monitor):
                raise TypeError(
                    f"MonitorCallback: expected a loopprobe Monitor, got {type(monitor).__name__}"
                )
            self.monitor, self._kwargs = monitor, monitor_kwargs

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if self.monitor is None:
                if model is None:
                    raise ValueError("MonitorCallback: the Trainer passed no model to build on")
                self.monitor = Monitor(model, **self._kwargs)
            elif model is not None and not any(m is self.monitor.model for m in model.modules()):
                raise ValueError(
                    "MonitorCallback: the monitor watches a model that is not (part of) the "
                    "Trainer's model; build the Monitor on the model you pass to Trainer"
                )

        def on_step_end(self, args, state, control, **kwargs):
            self.monitor.step(state.global_step)

        def on_train_end(self, args, state, control, **kwargs):
            self.monitor.close()

    MonitorCallback.__module__ = __name__
    return MonitorCallback


def __getattr__(name: str) -> Any:
    if name == "MonitorCallback":
        return _callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
