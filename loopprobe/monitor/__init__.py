"""Watch a looped model while it trains: :class:`Monitor` and where its rows go.

:mod:`.monitor` (the :class:`Monitor`: which diagnostics, how often, a tidy frame),
:mod:`.diagnostics` (what each built-in diagnostic computes; your own with ``custom=``),
:mod:`.sinks` (TensorBoard, CSV/Parquet, any callable) and :mod:`.wandb_sink`
(Weights & Biases, per-visit values grouped). Trainer adapters are in
:mod:`loopprobe.integrations`; figures of the frame in :mod:`loopprobe.plots`.
"""

from loopprobe.monitor.monitor import Monitor, dense_early
from loopprobe.monitor.sinks import CallableSink, FileSink, TensorBoardSink, read_frame
from loopprobe.monitor.wandb_sink import WandbSink

__all__ = [
    "CallableSink",
    "FileSink",
    "Monitor",
    "TensorBoardSink",
    "WandbSink",
    "dense_early",
    "read_frame",
]
