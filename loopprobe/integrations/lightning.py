"""``MonitorCallback``: a PyTorch Lightning ``Callback`` that calls ``Monitor.step``.

Example::

    from loopprobe.integrations.lightning import MonitorCallback

    mon = lp.Monitor(lit_module.model, probe_idx, loss_fn, every=50)
    lightning.Trainer(max_steps=1000, callbacks=[MonitorCallback(mon)]).fit(lit_module, data)

``on_train_batch_end`` runs ``mon.step(trainer.global_step, loss=...)`` once per optimizer
step (with gradient accumulation, on the batch that completed the step; the first
monitored step is 1). The loss is the mean over the step's batches of what
``training_step`` returned (Lightning hands callbacks that loss divided by
``accumulate_grad_batches``; it is multiplied back). The step's numbers go to every
``trainer.loggers`` (``log_metrics(..., step=global_step)``: TensorBoard, CSV, wandb, MLflow
loggers), named as the sinks name them (``loopprobe/kappa_R``); not through
``pl_module.log_dict``, whose values reach the loggers only every ``log_every_n_steps``.
Only the global-zero process monitors and logs. ``state_dict``/``load_state_dict`` put the
monitor's frame and schedule phase into Lightning checkpoints, so ``fit(ckpt_path=...)``
continues them. ``on_train_end`` closes the sinks. lightning (or pytorch_lightning) is
imported when ``MonitorCallback`` is first looked up, not with this module.
"""

from __future__ import annotations

from collections.abc import Mapping

from loopprobe.integrations import lazy_callback

__all__ = ["MonitorCallback"]  # noqa: F822 - built on first lookup (module __getattr__)

CALL = "MonitorCallback"


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


def _callback_class() -> type:
    from loopprobe.monitor.monitor import Monitor
    from loopprobe.monitor.sinks import scalars

    class MonitorCallback(_base()):
        """Runs a :class:`loopprobe.Monitor` after every optimizer step it schedules."""

        def __init__(self, monitor: Monitor) -> None:
            if not isinstance(monitor, Monitor):
                raise TypeError(
                    f"{CALL}: expected a loopprobe Monitor, got {type(monitor).__name__}"
                )
            self.monitor = monitor
            self._last_step = -1
            self._losses: list[float] = []  # this optimizer step's batches so far

        def state_dict(self) -> dict:
            return {"monitor": self.monitor.state_dict()}

        def load_state_dict(self, state_dict: dict) -> None:
            self.monitor.load_state_dict(state_dict["monitor"])

        def on_train_start(self, trainer, pl_module):
            self._last_step = trainer.global_step  # resumed runs start past 0
            self._losses = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
            if loss is not None:
                scale = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
                self._losses.append(float(loss) * scale)
            step = trainer.global_step
            if step == self._last_step:
                return  # gradient accumulation: no optimizer step since the last batch
            self._last_step = step
            losses, self._losses = self._losses, []
            if not trainer.is_global_zero:
                return
            mean = sum(losses) / len(losses) if losses else None
            rows = self.monitor.step(step, loss=mean)
            if rows is not None and len(rows):
                metrics = dict(scalars(rows))
                for logger in trainer.loggers:
                    logger.log_metrics(metrics, step=step)

        def on_train_end(self, trainer, pl_module):
            self.monitor.close()

    return MonitorCallback


__getattr__ = lazy_callback(__name__, _callback_class)
