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
continues them. ``on_train_end`` closes the sinks. The numbers also go into
``trainer.callback_metrics`` (as float64 tensors), so ``EarlyStopping(monitor="loopprobe/kappa_R")``
and ``ModelCheckpoint(monitor="loopprobe/kappa_R", every_n_train_steps=...)`` can watch them.

``name`` (default ``"loopprobe"``) prefixes the logged names and, with the diagnostics, keys
the checkpoint state: two callbacks in one Trainer need different names or diagnostics
(``MonitorCallback(cheap), MonitorCallback(deep, name="deep")``). ``per_visit=False`` logs
only model- and sublayer-level numbers. From configuration (``LightningCLI``, Hydra), pass
Monitor's arguments instead of a monitor (``MonitorCallback(every=50,
diagnostics=["updates", "kappa"], module="model")``): when fit begins it is built on the
LightningModule (or its submodule ``module``), the probe batch from the datamodule's
``probe_batch()`` method and the loss from the LightningModule's ``probe_loss(output,
inputs)`` method (unless ``inputs=`` / ``loss_fn=`` are given); once training starts, the
Trainer's first optimizer (torch's SGD, Adam or AdamW; any other: the raw gradient, with a
warning) is its ``update=`` unless ``update=`` is given. lightning (or
pytorch_lightning) is imported when ``MonitorCallback`` is first looked up, not with this
module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from loopprobe.integrations import lazy_callback, training_optimizer

__all__ = ["MonitorCallback"]  # noqa: F822 - built on first lookup (module __getattr__)

CALL = "MonitorCallback"
LEGACY_KEY = "_callback_class.<locals>.MonitorCallback"


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

        def __init__(
            self,
            monitor: Monitor | None = None,
            *,
            name: str = "loopprobe",
            per_visit: bool = True,
            module: str | None = None,
            **monitor_kwargs: Any,
        ) -> None:
            if monitor is not None and not isinstance(monitor, Monitor):
                raise TypeError(
                    f"{CALL}: expected a loopprobe Monitor, got {type(monitor).__name__}"
                )
            if monitor is not None and (monitor_kwargs or module is not None):
                raise ValueError(
                    f"{CALL}: pass a Monitor, or Monitor's arguments (every=..., "
                    "diagnostics=..., module=...) to build one when fit begins; not both"
                )
            if not isinstance(name, str) or not name or "/" in name:
                raise ValueError(
                    f"{CALL}: name={name!r}; pass a non-empty string without '/', the prefix "
                    "of the logged names (name/kappa_R) and of the checkpoint state"
                )
            if not isinstance(per_visit, bool):
                raise TypeError(f"{CALL}: per_visit must be True or False, got {per_visit!r}")
            self.monitor, self.name, self.per_visit = monitor, name, per_visit
            self.module, self._kwargs = module, monitor_kwargs
            self._last_step, self._built = -1, False  # _built: the monitor is this callback's
            self._losses: list[float] = []  # this optimizer step's batches so far

        @property
        def state_key(self) -> str:
            # unique per name and diagnostics, and the same in a resumed process
            what = self.monitor.diagnostics if self.monitor else self._kwargs.get("diagnostics")
            what = sorted(what) if what is not None and not isinstance(what, str) else what
            return self._generate_state_key(name=self.name, diagnostics=what)

        @property
        def _legacy_state_key(self) -> str:
            # the key checkpoints written before names existed hold a (single) monitor under
            return LEGACY_KEY if self.name == "loopprobe" else self.state_key

        def state_dict(self) -> dict:
            return {"monitor": self.monitor.state_dict()}

        def load_state_dict(self, state_dict: dict) -> None:
            self.monitor.load_state_dict(state_dict["monitor"])

        def setup(self, trainer, pl_module, stage):
            # before a checkpoint is read (Trainer._run: setup hooks, then the restore)
            if self.monitor is None and stage == "fit":
                self.monitor = _build(trainer, pl_module, self.module, self._kwargs)
                self._built = True

        def on_train_start(self, trainer, pl_module):
            # a monitor built here judges the Trainer's own optimizer step (the optimizers
            # exist only now, after setup); update= given to the callback wins
            if self._built and "update" not in self._kwargs and trainer.optimizers:
                self.monitor.update = training_optimizer(trainer.optimizers[0], CALL)
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
                metrics = dict(scalars(rows, self.name, self.per_visit))
                for logger in trainer.loggers:
                    logger.log_metrics(metrics, step=step)
                # for EarlyStopping / ModelCheckpoint(monitor="loopprobe/kappa_R"), which run
                # after this callback (Lightning puts checkpoint callbacks last)
                trainer.callback_metrics.update(
                    {k: torch.tensor(v, dtype=torch.float64) for k, v in metrics.items()}
                )

        def on_train_end(self, trainer, pl_module):
            self.monitor.close()

    return MonitorCallback


def _build(trainer: Any, pl_module: Any, module: str | None, kwargs: dict) -> Any:
    """The monitor of a callback made from configuration: on ``pl_module`` (or its submodule
    ``module``), the probe batch from the datamodule's ``probe_batch()`` unless ``inputs=``
    was given, the loss from the LightningModule's ``probe_loss(output, inputs)`` unless
    ``loss_fn=`` was."""
    from loopprobe.monitor.monitor import Monitor

    kwargs = dict(kwargs)
    model = pl_module if module is None else pl_module.get_submodule(module)
    if "inputs" not in kwargs:
        dm = getattr(trainer, "datamodule", None)
        if not callable(getattr(dm, "probe_batch", None)):
            raise ValueError(
                f"{CALL}: no probe batch; give the LightningDataModule a method "
                "probe_batch() returning the held-out batch the monitor probes (what Monitor "
                "takes as inputs), or pass inputs= to the callback"
            )
        kwargs["inputs"] = dm.probe_batch()
    if "loss_fn" not in kwargs and callable(getattr(pl_module, "probe_loss", None)):
        kwargs["loss_fn"] = pl_module.probe_loss
    return Monitor(model, **kwargs)


__getattr__ = lazy_callback(__name__, _callback_class)
