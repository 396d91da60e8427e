"""``MonitorCallback``: a Hugging Face ``TrainerCallback`` that calls ``Monitor.step``.

Example::

    from loopprobe.integrations.huggingface import MonitorCallback

    mon = lp.Monitor(model, probe_batch, every=50)  # loss: the model's own .loss
    trainer = transformers.Trainer(model=model, ..., callbacks=[MonitorCallback(mon)])

``on_step_end`` (after the optimizer step; ``state.global_step`` already counts it, so the
first monitored step is 1) runs ``mon.step(state.global_step)`` and asks the Trainer to log
that step; ``on_log`` adds the step's numbers (named as the sinks name them:
``loopprobe/G_norm/<sublayer>/r<visit>``) to the Trainer's ``logs`` and to its entry of
``state.log_history``. The Trainer calls callbacks in order and puts ``report_to``'s own
(TensorBoard, wandb, MLflow) first, so for them to get the numbers too, put this callback
before them: ``trainer.callback_handler.callbacks.insert(0, MonitorCallback(mon))``. Only
the main process (``state.is_world_process_zero``) monitors and logs. The monitor's
:meth:`~loopprobe.Monitor.state_dict` goes into every checkpoint's ``trainer_state.json``
(``stateful_callbacks``, transformers' ``ExportableState``) and is read back when training
resumes from it (``restore_callback_states_from_checkpoint`` is for callbacks without
arguments; leave it False). ``on_train_end`` closes the sinks. Instead of a monitor, pass
``Monitor``'s arguments (``MonitorCallback(inputs=probe_batch, every=50)``) and it is built
on the Trainer's model when training begins. transformers is imported when
``MonitorCallback`` is first looked up, not with this module.
"""

from __future__ import annotations

from typing import Any

from loopprobe.integrations import lazy_callback

__all__ = ["MonitorCallback"]  # noqa: F822 - built on first lookup (module __getattr__)

CALL = "MonitorCallback"


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

        def __init__(self, monitor: Monitor | None = None, **monitor_kwargs: Any) -> None:
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
            self.monitor, self._kwargs = monitor, monitor_kwargs
            self._pending: dict[str, float] = {}  # this step's numbers, until the Trainer logs

        def state(self) -> dict:
            saved = None if self.monitor is None else self.monitor.state_dict()
            return {"args": {}, "attributes": {"monitor_state": saved}}

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if self.monitor is None:
                if model is None:
                    raise ValueError(f"{CALL}: the Trainer passed no model to build on")
                self.monitor = Monitor(model, **self._kwargs)
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
                    self._pending = dict(scalars(rows))
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
