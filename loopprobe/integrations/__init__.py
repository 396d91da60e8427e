"""Thin adapters that call :class:`loopprobe.Monitor` from trainers' callback hooks.

- :mod:`loopprobe.integrations.huggingface`: ``MonitorCallback`` (a ``TrainerCallback``):
  the numbers in ``trainer.state.log_history`` and the Trainer's ``logs``, the monitor's
  state in ``trainer_state.json``;
- :mod:`loopprobe.integrations.lightning`: ``MonitorCallback``, a Lightning ``Callback``:
  the numbers in ``trainer.loggers``, the monitor's state in Lightning checkpoints.

Each module imports its trainer library only when ``MonitorCallback`` is first looked up,
so ``import loopprobe`` (and importing these modules) never imports transformers or lightning.
"""
