"""Where :class:`loopprobe.Monitor` sends each step's rows: TensorBoard, files, callables.

A sink is any object with ``write(step, rows)`` (``rows``: the step's long frame, columns
``step, sublayer, visit, quantity, value, converged``) and ``close()``. A plain callable in
``Monitor(sinks=[...])`` becomes a :class:`CallableSink`, so ``sinks=[wandb.log]`` works.
Scalar names are ``<prefix>/<quantity>`` (model level: ``loopprobe/kappa_R``),
``<prefix>/<quantity>/<sublayer>`` and ``<prefix>/<quantity>/<sublayer>/r<visit>``.
For Weights & Biases, :class:`loopprobe.monitor.wandb_sink.WandbSink` groups the visits
(one chart per quantity) where ``wandb.log`` gives one chart per visit.
Nothing here imports tensorboard, pyarrow or matplotlib until a sink that needs it is made;
without matplotlib (``loopprobe[monitor]`` alone) the sinks skip their heat maps, with one
notice on the ``loopprobe.monitor`` logger.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import pathlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import pandas as pd

__all__ = [
    "CallableSink",
    "FileSink",
    "Sink",
    "TensorBoardSink",
    "as_sink",
    "read_frame",
    "scalars",
    "typed_frame",
]

logger = logging.getLogger("loopprobe.monitor")

COLUMNS = ["step", "sublayer", "visit", "quantity", "value", "converged", "reason"]
HEATMAPS = ("G_norm", "U_norm")


def typed_frame(rows: list[dict]) -> pd.DataFrame:
    """The monitor's long frame from row dicts: columns :data:`COLUMNS`, fixed dtypes."""
    df = pd.DataFrame(rows, columns=COLUMNS)
    types = {"step": "int64", "sublayer": "object", "visit": "Int64", "quantity": "object"}
    df = df.astype({**types, "value": "float64", "converged": "boolean", "reason": "object"})
    df["reason"] = df["reason"].where(df["reason"].notna(), None)  # None where converged
    return df


class Sink:
    """Base class: ``write(step, rows)`` per scheduled step, ``close()`` at the end."""

    def write(self, step: int, rows: pd.DataFrame) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


def as_sink(obj: Any, call: str = "Monitor") -> Sink:
    """``obj`` if it has ``write``; a :class:`CallableSink` around a plain callable."""
    if callable(getattr(obj, "write", None)):
        return obj
    if callable(obj):
        return CallableSink(obj)
    raise TypeError(
        f"{call}: sink {obj!r} has no write(step, rows) and is not callable; pass "
        "TensorBoardSink(log_dir), WandbSink(), FileSink('monitor.csv') or a function "
        "metrics -> None"
    )


def scalars(rows: pd.DataFrame, prefix: str = "loopprobe", per_visit: bool = True) -> Iterator:
    """``(name, value)`` per row: model-, sublayer- and (with ``per_visit``) visit-level."""
    for row in rows.itertuples(index=False):
        name = f"{prefix}/{row.quantity}" if prefix else str(row.quantity)
        if row.sublayer is not None and not _missing(row.sublayer):
            name += f"/{row.sublayer}"
        if not _missing(row.visit):
            if not per_visit:
                continue
            name += f"/r{int(row.visit)}"
        yield name, float(row.value)


def heatmap_function(sink: Any) -> Callable | None:
    """:func:`loopprobe.plots.monitor.visit_heatmap`, or None without matplotlib/seaborn.

    Without them (``pip install 'loopprobe[monitor]'`` alone) the sink drops its heat maps
    (``sink.heatmaps = ()``) and says so once on the ``loopprobe`` logger; its scalars go on.
    """
    try:
        from loopprobe.plots.monitor import visit_heatmap  # loopprobe.plots: needs both
    except ImportError as err:
        sink.heatmaps = ()
        logger.warning(
            "%s: heat maps skipped, the scalars are written (%s)",
            type(sink).__name__,
            err,
        )
        return None
    return visit_heatmap


def _missing(x: Any) -> bool:
    return x is None or x is pd.NA or (isinstance(x, float) and math.isnan(x))


class CallableSink(Sink):
    """Calls ``fn(metrics)`` once per scheduled step with a flat ``{name: value}`` dict.

    ``step_key``: the key the step goes under (default ``"step"``); ``None`` calls
    ``fn(metrics, step=step)`` instead (``wandb.log`` takes ``step=``, which must then be the
    step your other ``wandb.log`` calls use). For wandb, ``WandbSink`` groups the visits.
    """

    def __init__(
        self,
        fn: Callable,
        *,
        prefix: str = "loopprobe",
        step_key: str | None = "step",
        per_visit: bool = True,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"CallableSink: fn must be callable, got {type(fn).__name__}")
        self.fn, self.prefix, self.step_key, self.per_visit = fn, prefix, step_key, per_visit

    def write(self, step: int, rows: pd.DataFrame) -> None:
        metrics = dict(scalars(rows, self.prefix, self.per_visit))
        if self.step_key is None:
            self.fn(metrics, step=step)
        else:
            self.fn({self.step_key: step, **metrics})


class TensorBoardSink(Sink):
    """Scalars and per-visit heat maps through ``torch.utils.tensorboard.SummaryWriter``.

    Every row is a scalar (``loopprobe/kappa_R`` is the kappa_R-vs-step curve,
    ``loopprobe/kappa/<sublayer>`` one per sublayer; per-visit rows too unless
    ``per_visit=False``), and a custom scalars layout (TensorBoard's CUSTOM SCALARS tab,
    category ``<prefix> per visit``) draws each per-visit quantity's visits, all sublayers,
    in one chart. Every ``heatmap_every``-th write (the first included) adds, per
    quantity in ``heatmaps``, an image of the step x visit heat map of all steps so far
    (one panel per sublayer, :func:`loopprobe.plots.monitor.visit_heatmap`; drawing it
    costs about 0.2 s, several training steps of a small model, hence not every write).
    Pass ``log_dir`` or an open ``writer`` (then :meth:`close` only flushes it). Needs the
    ``tensorboard`` package: ``pip install 'loopprobe[monitor]'``.
    """

    def __init__(
        self,
        log_dir: str | pathlib.Path | None = None,
        *,
        writer: Any = None,
        prefix: str = "loopprobe",
        per_visit: bool = True,
        heatmaps: tuple[str, ...] = HEATMAPS,
        heatmap_every: int = 10,
    ) -> None:
        if writer is None:
            if importlib.util.find_spec("tensorboard") is None:
                raise ImportError(
                    "TensorBoardSink: the tensorboard package is not installed; "
                    "pip install 'loopprobe[monitor]' (or pip install tensorboard)"
                )
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(None if log_dir is None else str(log_dir))
        elif log_dir is not None:
            raise ValueError("TensorBoardSink: pass log_dir= or writer=, not both")
        if isinstance(heatmap_every, bool) or not isinstance(heatmap_every, int):
            raise TypeError(f"TensorBoardSink: heatmap_every must be an int, got {heatmap_every!r}")
        if heatmap_every < 1:
            raise ValueError(f"TensorBoardSink: heatmap_every={heatmap_every}; pass >= 1")
        self.writer, self._owned = writer, log_dir is not None or writer is None
        self.prefix, self.per_visit = prefix, per_visit
        self.heatmaps, self.heatmap_every = tuple(heatmaps), heatmap_every
        self._history: list[pd.DataFrame] = []
        self._writes = 0
        self._per_visit: list[str] = []  # quantities in the custom scalars layout

    @property
    def log_dir(self) -> str:
        return self.writer.log_dir

    def write(self, step: int, rows: pd.DataFrame) -> None:
        for name, value in scalars(rows, self.prefix, self.per_visit):
            self.writer.add_scalar(name, value, step)
        new = [q for q in pd.unique(rows.quantity[rows.visit.notna()]) if q not in self._per_visit]
        if self.per_visit and new:
            self._per_visit += new  # TensorBoard shows the layout written last
            self.writer.add_custom_scalars(self.layout())
        kept = rows[rows.quantity.isin(self.heatmaps) & rows.visit.notna()]
        if len(kept):
            self._history.append(kept)
        if self.heatmaps and self._history and self._writes % self.heatmap_every == 0:
            visit_heatmap = heatmap_function(self)
            history = pd.concat(self._history, ignore_index=True) if visit_heatmap else None
            for q in self.heatmaps if visit_heatmap else ():
                if (history.quantity == q).any():
                    fig = visit_heatmap(history, quantity=q)
                    self.writer.add_figure(f"{self.prefix}/heatmap/{q}", fig, step, close=True)
        self._writes += 1

    def layout(self) -> dict:
        """``{category: {quantity: ["Multiline", [tag regex]]}}``: one chart per quantity."""
        p = re.escape(f"{self.prefix}/" if self.prefix else "")
        charts = {q: ["Multiline", [rf"^{p}{re.escape(q)}/.+/r\d+$"]] for q in self._per_visit}
        return {f"{self.prefix or 'loopprobe'} per visit": charts}

    def close(self) -> None:
        self.writer.flush()
        if self._owned:
            self.writer.close()


class FileSink(Sink):
    """Appends each step's rows to a CSV file, or rewrites a Parquet file (by suffix).

    The file is started afresh when the sink is made. Parquet needs ``pyarrow`` (or
    ``fastparquet``), which loopprobe does not install. :func:`read_frame` reads either
    back with the monitor's column types.
    """

    def __init__(self, path: str | pathlib.Path) -> None:
        self.path = pathlib.Path(path)
        self.kind = self.path.suffix.lower().lstrip(".")
        if self.kind not in ("csv", "parquet"):
            raise ValueError(
                f"FileSink: path {str(path)!r} ends in {self.path.suffix!r}; name a .csv or "
                ".parquet file"
            )
        if self.kind == "parquet" and not _parquet_engine():
            raise ImportError(
                "FileSink: writing .parquet needs pyarrow or fastparquet, neither is "
                "installed; pip install pyarrow, or write a .csv file"
            )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)
        self._rows: list[pd.DataFrame] = []

    def write(self, step: int, rows: pd.DataFrame) -> None:
        if self.kind == "csv":
            rows.to_csv(self.path, mode="a", header=not self.path.exists(), index=False)
        else:
            self._rows.append(rows)
            pd.concat(self._rows, ignore_index=True).to_parquet(self.path, index=False)


def _parquet_engine() -> bool:
    return any(importlib.util.find_spec(m) is not None for m in ("pyarrow", "fastparquet"))


def read_frame(path: str | pathlib.Path) -> pd.DataFrame:
    """A :class:`FileSink` file back as the monitor's frame (same columns and types)."""
    path = pathlib.Path(path)
    df = pd.read_parquet(path) if path.suffix.lower() == ".parquet" else pd.read_csv(path)
    for col in ("sublayer", "reason"):  # a CSV reads None back as NaN
        if col in df:
            df[col] = df[col].astype(object).where(df[col].notna(), None)
    return typed_frame(df.to_dict("records"))
