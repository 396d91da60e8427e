"""Thin adapters that call :class:`loopprobe.Monitor` from trainers' callback hooks.

- :mod:`loopprobe.integrations.huggingface`: ``MonitorCallback`` (a ``TrainerCallback``);
- :mod:`loopprobe.integrations.lightning`: ``MonitorCallback``, a Lightning ``Callback``.

Each module imports its trainer library only when ``MonitorCallback`` is first looked up,
so ``import loopprobe`` (and importing these modules) never imports transformers or lightning.
"""
