"""Weights & Biases sink for :class:`loopprobe.Monitor`: a step metric, grouped visits, heat maps.

``sinks=[wandb.log]`` works but gives one chart per visit and a chart for ``step`` itself.
:class:`WandbSink` logs instead, per scheduled step, the model- and sublayer-level scalars
(``loopprobe/kappa_R``, ``loopprobe/G_tied/<sublayer>``) against a step metric of its own
(``loopprobe/step``, set up with ``run.define_metric``), and every ``charts_every``-th write
and at :meth:`WandbSink.close`: one line chart per per-visit quantity (all sublayers' visits
in one ``wandb.plot.line_series``, key ``loopprobe/visits/<quantity>``) and the step x visit
heat maps (``wandb.Image`` of :func:`loopprobe.plots.monitor.visit_heatmap`, key
``loopprobe/heatmap/<quantity>``). wandb is imported when a sink is made, never with this module.
"""

from __future__ import annotations

import importlib
import io
import sys
from typing import Any

import pandas as pd

from loopprobe.monitor.sinks import HEATMAPS, Sink, heatmap_function, scalars

__all__ = ["WandbSink"]

CALL = "WandbSink"


class WandbSink(Sink):
    """Monitor rows to a wandb run (default: the active ``wandb.run``), charts grouped by quantity.

    Each write is one ``run.log`` without ``step=`` (wandb's own step counter goes on as with
    the Hugging Face and Lightning loggers) holding ``step_metric: step``; every
    ``<prefix>/*`` key is plotted against that step metric, so your own ``wandb.log`` calls
    keep their steps. Pass ``step_metric="train/global_step"`` (or Lightning's
    ``"trainer/global_step"``) to share your x-axis. If your own calls pass ``step=``, make
    them before ``mon.step(step)``: wandb ignores a ``step=`` below its counter. Per-visit
    rows go into the line charts only; ``per_visit=True`` also logs each visit as a scalar.
    Call ``mon.close()`` before ``run.finish()``: it logs the charts of all steps.
    """

    def __init__(
        self,
        run: Any = None,
        *,
        prefix: str = "loopprobe",
        step_metric: str | None = None,
        per_visit: bool = False,
        heatmaps: tuple[str, ...] = HEATMAPS,
        charts_every: int = 10,
    ) -> None:
        self.wandb = _import_wandb()
        if run is None:
            run = self.wandb.run
            if run is None:
                raise ValueError(
                    f"{CALL}: no wandb run is active; call wandb.init(...) first, or pass "
                    "run=wandb.init(project=...)"
                )
        if not all(callable(getattr(run, a, None)) for a in ("log", "define_metric")):
            raise TypeError(
                f"{CALL}: run={run!r} has no log/define_metric; pass the object "
                "wandb.init(...) returns"
            )
        if isinstance(charts_every, bool) or not isinstance(charts_every, int):
            raise TypeError(f"{CALL}: charts_every must be an int, got {charts_every!r}")
        if charts_every < 1:
            raise ValueError(f"{CALL}: charts_every={charts_every}; pass >= 1")
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"{CALL}: prefix={prefix!r}; pass a non-empty string")
        self.run, self.prefix, self.per_visit = run, prefix, per_visit
        self.step_metric = step_metric or f"{prefix}/step"
        self.heatmaps, self.charts_every = tuple(heatmaps), charts_every
        run.define_metric(self.step_metric, hidden=step_metric is None)  # an axis, not a chart
        run.define_metric(f"{prefix}/*", step_metric=self.step_metric)
        self._history: list[pd.DataFrame] = []
        self._writes = 0
        self._last: int | None = None  # the last step written, and whether it drew the charts
        self._charted = False

    def write(self, step: int, rows: pd.DataFrame) -> None:
        data: dict[str, Any] = {self.step_metric: step}
        data.update(scalars(rows, self.prefix, self.per_visit))
        visits = rows[rows.visit.notna()]
        if len(visits):
            self._history.append(visits)
        self._charted = bool(self._history) and self._writes % self.charts_every == 0
        if self._charted:
            data.update(self.charts())
        self.run.log(data)
        self._writes, self._last = self._writes + 1, step

    def close(self) -> None:
        """Log the charts of every step so far, unless the last write already did."""
        if self._history and not self._charted:
            self.run.log({self.step_metric: self._last, **self.charts()})
            self._charted = True

    def charts(self) -> dict[str, Any]:
        """``{key: chart}``: a line series per per-visit quantity, a heat map per ``heatmaps``."""
        history = pd.concat(self._history, ignore_index=True)
        out: dict[str, Any] = {}
        for q, rows in history.groupby("quantity", sort=False):
            xs, ys, keys = [], [], []
            for (name, r), line in rows.groupby(["sublayer", "visit"], sort=False):
                xs.append(line.step.tolist())
                ys.append(line.value.tolist())
                keys.append(f"{name} r{int(r)}")
            title = f"{q} per visit"
            chart = self.wandb.plot.line_series(xs, ys, keys, title=title, xname="step")
            out[f"{self.prefix}/visits/{q}"] = chart
        drawn = [q for q in self.heatmaps if (history.quantity == q).any()]  # () once skipped
        visit_heatmap = heatmap_function(self) if drawn else None
        if visit_heatmap is not None:
            for q in drawn:
                out[f"{self.prefix}/heatmap/{q}"] = self._image(visit_heatmap(history, quantity=q))
        return out

    def _image(self, fig: Any) -> Any:
        """A ``wandb.Image`` of a figure, as PNG (wandb takes only exact matplotlib types)."""
        from PIL import Image  # matplotlib's own dependency

        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
        if "matplotlib.pyplot" in sys.modules:  # a pyplot user's figure: do not keep it open
            sys.modules["matplotlib.pyplot"].close(fig)
        return self.wandb.Image(Image.open(buf))


def _import_wandb() -> Any:
    try:
        return importlib.import_module("wandb")
    except ImportError as err:
        raise ImportError(f"{CALL}: the wandb package is not installed; pip install wandb") from err
