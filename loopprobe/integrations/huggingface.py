"""``MonitorCallback``: a Hugging Face ``TrainerCallback`` that calls ``Monitor.step``.

Example::

    from loopprobe.integrations.huggingface import MonitorCallback

    mon = lp.Monitor(model, probe_batch, every=50)  # loss: the model's own .loss
    trainer = transformers.Trainer(model=model, ..., callbacks=[MonitorCallback(mon)])

To have the numbers in ``report_to``'s loggers (TensorBoard, wandb, MLflow) too, add the
callback with :meth:`add_to` instead of ``callbacks=``::

    MonitorCallback(mon).add_to(trainer)  # before report_to's callbacks, which log first

``on_step_end`` (after the optimizer step; ``state.global_step`` already counts it, so the
first monitored step is 1) runs ``mon.step(state.global_step)`` and asks the Trainer to log
that step; ``on_log`` adds the step's numbers (named as the sinks name them:
``loopprobe/G_norm/<sublayer>/r<visit>``; ``per_visit=False`` leaves the per-visit numbers
out of the Trainer's logs, which keeps model- and sublayer-level ones) to the Trainer's
``logs`` and to its entry of ``state.log_history``. The Trainer calls callbacks in order,
``report_to``'s own first, and they write ``logs`` when their ``on_log`` runs: a callback
passed in ``callbacks=`` adds its numbers after them, so only ``log_history`` gets them;
:meth:`add_to` puts it first. Only the main process (``state.is_world_process_zero``)
monitors and logs. The monitor's :meth:`~loopprobe.Monitor.state_dict` goes into every
checkpoint's ``trainer_state.json`` (``stateful_callbacks``, transformers' ``ExportableState``)
and is read back when training resumes from it (``restore_callback_states_from_checkpoint``
is for callbacks without arguments; leave it False); ``state_rows`` (default 5000) caps the
frame rows it carries to the latest ones, since every checkpoint rewrites them (every
number is in ``log_history`` as well; a :class:`~loopprobe.monitor.sinks.FileSink` keeps
all). ``on_train_end`` closes the sinks. Instead of a monitor, pass ``Monitor``'s arguments
(``MonitorCallback(inputs=probe_batch, every=50)``) and it is built on the Trainer's model
when training begins, with the Trainer's optimizer as its ``update=`` (torch's SGD, Adam or
AdamW inside accelerate's wrapper; any other: the raw gradient, with a warning; ``update=``
given to the callback wins). transformers is imported when ``MonitorCallback`` is first looked
up, not with this module.
"""

from __future__ import annotations

from typing import Any

from loopprobe.integrations import lazy_callback, training_optimizer

__all__ = ["MonitorCallback"]  # noqa: F822 - built on first lookup (module __getattr__)

CALL = "MonitorCallback"
STATE_ROWS = 5000  # frame rows each checkpoint's trainer_state.json carries (the latest)


def _callback_class() -> type:
    try:
        from transformers import TrainerCallback
        from transformers.trainer_callback import ExportableState
    except ImportError as err:
        raise ImportError(
            "loopprobe.integrations.huggingface needs transformers; pip install transformers"
        ) from err

    from loopprobe.monitor.monitor import Monitor
    from loopprobe.monitor.sinks import scalars

    class MonitorCallback(TrainerCallback, ExportableState):
        """Runs a :class:`loopprobe.Monitor` after every optimizer step it schedules."""

        def __init__(
            self,
            monitor: Monitor | None = None,
            *,
            per_visit: bool = True,
            state_rows: int | None = STATE_ROWS,
            **monitor_kwargs: Any,
        ) -> None:
            if (monitor is None) == (not monitor_kwargs):
                raise ValueError(
                    f"{CALL}: pass a Monitor, or Monitor's arguments (inputs=..., "
                    "loss_fn=..., every=...) to build one on the Trainer's model; not both. "
                    "(Resuming with restore_callback_states_from_checkpoint=True rebuilds "
                    "callbacks without arguments: leave it False, the callback reads its "
                    "monitor's state from the checkpoint itself)"
                )
            if monitor is not None and not isinstance(monitor, Monitor):
                raise TypeError(
                    f"{CALL}: expected a loopprobe Monitor, got {type(monitor).__name__}"
                )
            if not isinstance(per_visit, bool):
                raise TypeError(f"{CALL}: per_visit must be True or False, got {per_visit!r}")
            if state_rows is not None and (
                isinstance(state_rows, bool) or not isinstance(state_rows, int) or state_rows < 0
            ):
                raise ValueError(
                    f"{CALL}: state_rows={state_rows!r}; pass the number of latest frame rows "
                    "each checkpoint keeps (an integer >= 0), or None for all"
                )
            self.monitor, self._kwargs = monitor, monitor_kwargs
            self.per_visit, self.state_rows = per_visit, state_rows
            self._pending: dict[str, float] = {}  # this step's numbers, until the Trainer logs

        def add_to(self, trainer: Any) -> MonitorCallback:
            """Put this callback first in ``trainer``'s callbacks (moving it if it is there
            already), so that ``report_to``'s loggers, which write the Trainer's ``logs``
            when their own ``on_log`` runs, see loopprobe's numbers; returns the callback."""
            handler = getattr(trainer, "callback_handler", None)
            if not isinstance(getattr(handler, "callbacks", None), list):
                raise TypeError(
                    f"{CALL}.add_to: expected a transformers.Trainer, got {type(trainer).__name__}"
                )
            handler.callbacks[:] = [c for c in handler.callbacks if c is not self]
            handler.callbacks.insert(0, self)
            return self

        def state(self) -> dict:
            saved = None if self.monitor is None else self.monitor.state_dict()
            if saved is not None and self.state_rows is not None:
                saved["rows"] = saved["rows"][max(0, len(saved["rows"]) - self.state_rows) :]
            return {"args": {}, "attributes": {"monitor_state": saved}}

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if self.monitor is None:
                if model is None:
                    raise ValueError(f"{CALL}: the Trainer passed no model to build on")
                kw = dict(self._kwargs)
                if "update" not in kw:  # the Trainer's own optimizer step, read not written
                    kw["update"] = training_optimizer(kwargs.get("optimizer"), CALL)
                self.monitor = Monitor(model, **kw)
            elif model is not None and not any(m is self.monitor.model for m in model.modules()):
                raise ValueError(
                    f"{CALL}: the monitor watches a model that is not (part of) the "
                    "Trainer's model; build the Monitor on the model you pass to Trainer"
                )
            saved = (state.stateful_callbacks or {}).get(type(self).__name__)
            saved = saved[0] if isinstance(saved, list) and saved else saved
            mine = (saved or {}).get("attributes", {}).get("monitor_state")
            if state.global_step > 0 and mine:  # resumed: continue the saved frame
                self.monitor.load_state_dict(mine)

        def on_step_end(self, args, state, control, **kwargs):
            if self.monitor.due(state.global_step):
                # on every process: the Trainer's log gathers the loss across them. The
                # numbers then land in the logs of their own step.
                control.should_log = True
            if state.is_world_process_zero:
                rows = self.monitor.step(state.global_step)
                if rows is not None and len(rows):
                    self._pending = dict(scalars(rows, per_visit=self.per_visit))
            return control

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not self._pending:
                return control
            if logs is not None:
                logs.update(self._pending)
            last = state.log_history[-1] if state.log_history else None
            if last is not None and last.get("step") == state.global_step:
                last.update(self._pending)
            else:
                state.log_history.append({**self._pending, "step": state.global_step})
            self._pending = {}
            return control

        def on_train_end(self, args, state, control, **kwargs):
            self.monitor.close()

    return MonitorCallback


__getattr__ = lazy_callback(__name__, _callback_class)
