"""Forward increments and training sweeps: growth over N, stream RMS, coord check, LR transfer."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from loopprobe._stats import loglog_slope
from loopprobe.plots._base import (
    REF,
    check_frame,
    groups,
    legend_below,
    level_colors,
    line,
    log2_x,
    log_y,
    new_figure,
    order,
    side_legend,
)

# ----------------------------------------------------------------------------- increments


def increment_growth(
    df: pd.DataFrame,
    *,
    x: str = "N",
    y: str = "growth",
    hue: str | None = "residual",
    style: str | None = "tying",
    slopes: Sequence[float] = (0.5, 0.0),
    title: str = "Increment growth ‖h_N − h_0‖ / ‖h_0‖ vs N",
) -> Figure:
    """Relative state change against N (log-log), a line per residual rule (and tying).

    Columns: ``x`` (N, loop count), ``y`` (‖h_N − h_0‖/‖h_0‖), ``hue`` (residual rule, e.g.
    ``1/sqrt(N)``, ``1/N``), ``style`` (``tied``/``untied``; None for one style). Seeds
    are averaged. The dashed reference lines are the regimes' slopes (½: correlated
    increments under 1/√N; 0: flat), anchored at the first point. Reference: docs/definitions.md §3.
    """
    df = check_frame("increment_growth", df, {"x": x, "y": y, "hue": hue, "style": style})
    fig, axes = new_figure(size=(5.5, 4.8))
    ax = axes[0, 0]
    colors = level_colors(order(df, hue))
    dashes = ["-", "-.", ":", (0, (5, 1))]
    for si, (slevel, ssub) in enumerate(groups(df, style)):
        for level, sub in groups(ssub, hue):
            if sub.empty:
                continue
            fit = loglog_slope(sub[x], sub[y])
            parts = [str(v) for v in (level, slevel) if v is not None]
            line(
                ax,
                sub,
                x,
                y,
                color=colors[level],
                linestyle=dashes[si % len(dashes)],
                label=f"{' '.join(parts) or y} (slope {fit:.2f})",
            )
    xs = np.sort(df[x].unique().astype(float))
    if len(xs):
        y0 = float(df[df[x] == xs[0]][y].mean())
        for s in slopes:
            ax.plot(xs, y0 * (xs / xs[0]) ** s, label=f"slope {s:g}", **REF)
        log2_x(ax, xs)
    log_y(ax)
    ax.set(xlabel="N (loops)", ylabel="‖h_N − h_0‖ / ‖h_0‖", title=title)
    legend_below(fig, ax)
    return fig


def coord_check(
    df: pd.DataFrame,
    *,
    x: str = "N",
    y: str = "value",
    col: str = "step",
    hue: str | None = "group",
    max_cols: int = 4,
    logy: bool = True,
    ylabel: str | None = None,
    title: str = "Coordinate check across loop count N",
) -> Figure:
    """One panel per optimizer step, N on a log2 x axis, one line per sublayer group.

    Columns: ``x`` (N), ``y`` (activation size or its change since step 0, e.g. RMS),
    ``col`` (step; one panel each, at most ``max_cols`` spread evenly), ``hue`` (sublayer
    or visit group). ``ylabel`` defaults to the rows' ``quantity`` when they hold one
    (e.g. ``RMS(h_N(t) − h_N(0))  (state_change)``), else to ``y``. Seeds are averaged.
    Flat lines mean the parameterization is stable in N (the looped analogue of mup's
    coord check).
    Reference: docs/definitions.md §5; seed 004 (Loop-μP).
    """
    df = check_frame("coord_check", df, {"x": x, "y": y, "col": col, "hue": hue})
    steps = sorted(df[col].unique())
    if not steps:
        raise ValueError("coord_check: no rows to draw (empty frame after dropping NaN)")
    if len(steps) > max_cols:
        steps = [steps[i] for i in np.linspace(0, len(steps) - 1, max_cols).round().astype(int)]
    fig, axes = new_figure(ncols=len(steps), size=(3.4, 3.0))
    colors = level_colors(order(df, hue))
    for ax, step in zip(axes[0], steps, strict=True):
        for level, sub in groups(df[df[col] == step], hue):
            if not sub.empty:
                line(ax, sub, x, y, color=colors[level], label=str(level) if hue else y)
        log2_x(ax, df[x].unique())
        if logy:
            log_y(ax)
        ax.set(xlabel="N (loops)", title=f"{col} {step}")
    axes[0, 0].set_ylabel(ylabel or _quantity_label(df, y))
    side_legend(fig, axes[0, -1], title=hue)
    fig.suptitle(title)
    return fig


#: axis labels of the coordinate check's quantities (loopprobe.theory.COORD_QUANTITIES)
QUANTITY_LABELS = {
    "increment": "RMS of the visit's increment",
    "increment_change": "RMS(inc(t) − inc(0))",
    "state": "RMS of the final state h_N",
    "state_change": "RMS(h_N(t) − h_N(0))",
}


def _quantity_label(df: pd.DataFrame, y: str) -> str:
    """The y label when none is given: the quantity the rows hold (one ``quantity``
    value: its description and name), else the column name."""
    values = df["quantity"].unique() if "quantity" in df.columns else []
    if len(values) != 1:
        return y
    q = str(values[0])
    return f"{QUANTITY_LABELS[q]}  ({q})" if q in QUANTITY_LABELS else q


def lr_transfer(
    df: pd.DataFrame,
    *,
    x: str = "lr",
    y: str = "loss",
    hue: str = "N",
    col: str | None = None,
    title: str = "Loss vs learning rate per loop count N",
) -> Figure:
    """Final loss against learning rate (log x), a line per N, the argmin marked with a star.

    Columns: ``x`` (learning rate), ``y`` (loss after training), ``hue`` (N), ``col``
    (optional panel variable, e.g. the residual rule). Seeds are averaged. The best lr
    staying put across N is transfer. Reference: seed 004 (Loop-μP).
    """
    df = check_frame("lr_transfer", df, {"x": x, "y": y, "hue": hue, "col": col})
    panels = order(df, col)
    fig, axes = new_figure(ncols=len(panels))
    levels = sorted(df[hue].unique())
    colors = level_colors(levels)
    for ax, (plevel, psub) in zip(axes[0], groups(df, col), strict=True):
        for level in levels:
            sub = psub[psub[hue] == level]
            if sub.empty:
                continue
            line(ax, sub, x, y, color=colors[level], label=f"{hue}={level}")
            means = sub.groupby(x)[y].mean()
            ax.plot(
                [means.idxmin()],
                [means.min()],
                marker="*",
                markersize=12,
                color=colors[level],
                linestyle="none",
            )
        ax.set_xscale("log")
        ax.set(xlabel="learning rate", ylabel=y, title=str(plevel) if col else title)
    axes[0, -1].legend(fontsize="small")
    if col:
        fig.suptitle(title)
    return fig


def stream_plot(df: pd.DataFrame, *, x: str = "i", y: str = "stream_rms") -> Figure:
    """Stream RMS ``d^-1/2 ||h||`` after every visit against the visit index (log y).

    Columns: ``x`` (execution index), ``y`` (stream RMS), ``group`` (marker colour).
    Growth across visits is the residual explosion of the Fully Looped Transformer
    abstract. Reference: docs/definitions.md §3.
    """
    fig, axes = new_figure()
    ax = axes[0, 0]
    ax.plot(df[x], df[y], color="0.5", linewidth=1.0)
    sns.scatterplot(data=df, x=x, y=y, hue="group", ax=ax, s=25, palette="colorblind")
    ax.set_yscale("log")
    ax.set(xlabel="visit (execution order)", ylabel="stream RMS after visit")
    ax.set_title("Residual stream RMS per visit")
    return fig
