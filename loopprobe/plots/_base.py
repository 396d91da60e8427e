"""What every figure shares: the figure factory (pyplot-aware), frame checks, axes styling."""

from __future__ import annotations

import io
import math
import sys
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

#: whether the caller had imported pyplot before loopprobe's plots were loaded (seaborn
#: imports pyplot itself, so a later import cannot be told apart from seaborn's)
CALLER_PYPLOT = "matplotlib.pyplot" in sys.modules

import seaborn as sns  # noqa: E402 - after the check above
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter  # noqa: E402

REF = {"color": "0.45", "linestyle": "--", "linewidth": 1.0}  # reference (theory) lines


class PlotFigure(Figure):
    """A matplotlib Figure that shows itself as a PNG in Jupyter (no pyplot needed)."""

    def _repr_png_(self) -> bytes:
        buf = io.BytesIO()
        self.savefig(buf, format="png", dpi=100)
        return buf.getvalue()


def new_figure(ncols: int = 1, nrows: int = 1, size: tuple[float, float] = (5.0, 3.6)):
    """A Figure with seaborn's whitegrid style applied to its axes only (no global rc).

    When the caller uses pyplot (had imported ``matplotlib.pyplot`` before the first
    loopprobe plot), the figure is made by ``plt.figure`` and is pyplot's current figure;
    otherwise it is a bare ``Figure`` that pyplot does not track (nothing to close).
    """
    figsize = (size[0] * ncols, size[1] * nrows)
    with sns.axes_style("whitegrid"), sns.plotting_context("notebook", font_scale=0.9):
        if CALLER_PYPLOT:  # a pyplot user: the new figure is pyplot's current figure,
            import matplotlib.pyplot as plt  # so plt.savefig / plt.show see it

            fig = plt.figure(figsize=figsize, layout="constrained", FigureClass=PlotFigure)
        else:  # no pyplot state, no GUI: headless, in tests and notebooks alike
            fig = PlotFigure(figsize=figsize, layout="constrained")
        axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def check_frame(call: str, df: pd.DataFrame, columns: Mapping[str, str | None]) -> pd.DataFrame:
    """Check the frame has each named column; drop diverged rows and NaNs in those columns."""
    if not isinstance(df, pd.DataFrame):
        raise TypeError(
            f"{call}: expected a pandas DataFrame (e.g. from lp.sweep or .to_frame()), "
            f"got {type(df).__name__}"
        )
    for arg, col in columns.items():
        if col is not None and col not in df.columns:
            raise ValueError(
                f"{call}: the frame has no column {col!r} (columns: {list(df.columns)}); "
                f"pass {arg}='<column>' naming the one to use"
            )
    if "diverged" in df.columns:
        df = df[~df["diverged"].fillna(False).astype(bool)]
    used = [c for c in columns.values() if c is not None]
    return df.dropna(subset=used)


def order(df: pd.DataFrame, col: str | None) -> list:
    if col is None:
        return [None]
    return list(pd.unique(df[col]))


def groups(df: pd.DataFrame, col: str | None):
    """(level, sub-frame) pairs in order of first appearance; one group when col is None."""
    for level in order(df, col):
        yield level, (df if col is None else df[df[col] == level])


def palette(n: int) -> list:
    return sns.color_palette("colorblind", max(n, 1))


def level_colors(levels: Sequence) -> dict:
    """One colour of :func:`palette` per level, in the order given."""
    return dict(zip(levels, palette(len(levels)), strict=True))


def colored_groups(df: pd.DataFrame, col: str | None):
    """(colour, level, sub-frame) per level of ``col``: :func:`groups` coloured in order."""
    colors = level_colors(order(df, col))
    for level, sub in groups(df, col):
        yield colors[level], level, sub


def line(ax: Axes, sub: pd.DataFrame, x: str, y: str, **kw) -> None:
    """Mean over repeated x (seeds) with markers; the spread as a band when there is one."""
    stats = sub.groupby(x, sort=True)[y].agg(["mean", "min", "max", "count"])
    ax.plot(stats.index, stats["mean"], marker="o", markersize=4, **kw)
    if (stats["count"] > 1).any():
        ax.fill_between(
            stats.index, stats["min"], stats["max"], alpha=0.15, color=kw.get("color"), linewidth=0
        )


def reference_slope(ax: Axes, xs: np.ndarray, ys: np.ndarray, slope: float, label: str) -> None:
    """A dashed power law ``c x^slope`` through the geometric centre of the points."""
    xs, ys = np.asarray(xs, float), np.asarray(ys, float)
    ok = (xs > 0) & (ys > 0)
    if not ok.any():
        return
    lx, ly = np.log(xs[ok]), np.log(ys[ok])
    c = ly.mean() - slope * lx.mean()
    grid = np.array([xs[ok].min(), xs[ok].max()])
    ax.plot(grid, np.exp(c) * grid**slope, label=label, **REF)


def side_legend(fig: Figure, ax: Axes, title: str | None = None) -> None:
    """One legend for a multi-panel figure, outside on the right (never over the data)."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside right upper", fontsize="small", title=title)


def legend_below(fig: Figure, ax: Axes) -> None:
    """A legend under a one-panel figure with many entries (never over the data)."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside lower center", fontsize="small", ncols=2)


def _log_ticks_within(lo: float, hi: float) -> int:
    """How many of the log axis's ticks (1..9 x 10^k) lie in ``[lo, hi]``."""
    first, last = math.floor(math.log10(lo)), math.floor(math.log10(hi))
    return sum(lo <= m * 10.0**e <= hi for e in range(first, last + 1) for m in range(1, 10))


def log_y(ax: Axes) -> None:
    """Log y axis; plain ``%.3g`` labels up to two decades of data, decades only above."""
    ax.set_yscale("log")
    lo, hi = ax.get_ylim()
    if lo > 0 and hi / lo < 10:
        fmt = FuncFormatter(lambda v, _: f"{v:.3g}")
        if _log_ticks_within(lo, hi) < 2:  # e.g. 2.31e-3 .. 2.36e-3: no 1-9 x 10^k inside
            ax.yaxis.set_major_locator(MaxNLocator(4))
            ax.yaxis.set_minor_formatter(NullFormatter())
        else:
            ax.yaxis.set_minor_formatter(fmt)
        ax.yaxis.set_major_formatter(fmt)
    elif lo > 0 and hi / lo < 100:  # one or two decades: label 2x and 5x as well
        fmt = FuncFormatter(lambda v, _: f"{v:.3g}")
        ax.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
        ax.yaxis.set_major_formatter(fmt)
        ax.yaxis.set_minor_formatter(fmt)
    else:
        ax.yaxis.set_minor_formatter(NullFormatter())


def log2_x(ax: Axes, values: Sequence[float]) -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted({float(v) for v in values if v > 0})
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()


def two_decimals(x: float) -> str:
    """Two decimals, without the "-0.00" a slope of -0.001 would print."""
    text = f"{x:.2f}"
    return "0.00" if text == "-0.00" else text
