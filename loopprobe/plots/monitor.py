"""Figures of a :class:`loopprobe.Monitor` frame: kappa_R and loss vs step, heat maps.

Both functions take the monitor's long frame (``monitor.frame``, or
:func:`loopprobe.monitor.sinks.read_frame` of a saved file), redraw it without recomputing
anything, and return a :class:`matplotlib.figure.Figure` (built without pyplot state;
``fig.savefig(...)`` or ``plt.savefig(...)`` after ``plt.figure(fig)`` both work).
matplotlib and seaborn are imported on call, never with this module.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["kappa_vs_step", "visit_heatmap"]

_COLUMNS = ("step", "sublayer", "visit", "quantity", "value")


def _check(call: str, frame: pd.DataFrame) -> None:
    if not isinstance(frame, pd.DataFrame):
        raise TypeError(f"{call}: expected the monitor's frame (monitor.frame), got {type(frame)}")
    missing = [c for c in _COLUMNS if c not in frame.columns]
    if missing:
        raise ValueError(
            f"{call}: the frame lacks columns {missing}; pass monitor.frame or "
            "loopprobe.monitor.sinks.read_frame(path)"
        )


def kappa_vs_step(
    frame: pd.DataFrame, *, loss: bool = True, title: str = "Visit alignment during training"
) -> Figure:
    """kappa_R (thick) and each sublayer's kappa_j against step; the loss in a second panel.

    Reads quantities ``kappa_R`` and ``kappa`` (from the ``"kappa"`` diagnostic) and, with
    ``loss``, ``loss`` (passed to ``monitor.step``) and ``probe_loss``. Unconverged kappa_R
    points are drawn hollow. Reference: seed 002, Eq. 12.
    """
    from loopprobe.plots._base import new_figure, palette

    call = "kappa_vs_step"
    _check(call, frame)
    kR = frame[frame.quantity == "kappa_R"].sort_values("step")
    if kR.empty:
        raise ValueError(
            f"{call}: the frame has no kappa_R rows; monitor with diagnostics including "
            "'kappa', e.g. Monitor(..., diagnostics={'updates': 1, 'kappa': 10})"
        )
    losses = [q for q in ("loss", "probe_loss") if (frame.quantity == q).any()] if loss else []
    fig, axes = new_figure(ncols=2 if losses else 1)
    ax = axes[0, 0]
    kj = frame[(frame.quantity == "kappa") & frame.sublayer.notna()]
    names = list(pd.unique(kj.sublayer))
    for color, name in zip(palette(len(names)), names, strict=True):
        sub = kj[kj.sublayer == name].sort_values("step")
        ax.plot(sub.step, sub.value, color=color, linewidth=1, alpha=0.8, label=f"κ {name}")
    ok = kR.converged.fillna(False).astype(bool) if "converged" in kR else True
    ax.plot(kR.step, kR.value, color="black", linewidth=2, label="κ_R")
    ax.scatter(kR.step[ok], kR.value[ok], color="black", s=14, zorder=3)
    ax.scatter(kR.step[~ok], kR.value[~ok], facecolors="none", edgecolors="black", s=14, zorder=3)
    ax.set(xlabel="step", ylabel="κ", title="κ_R and κ_j (hollow: not converged)")
    ax.legend(fontsize="x-small")
    if losses:
        ax2 = axes[0, 1]
        for q, color in zip(losses, ("C0", "C1"), strict=False):
            sub = frame[frame.quantity == q].sort_values("step")
            ax2.plot(sub.step, sub.value, marker="o", markersize=3, color=color, label=q)
        ax2.set(xlabel="step", ylabel="loss", title="loss")
        ax2.legend(fontsize="x-small")
    fig.suptitle(title)
    return fig


def visit_heatmap(
    frame: pd.DataFrame,
    *,
    quantity: str = "G_norm",
    log: bool = True,
    max_panels: int = 4,
    title: str | None = None,
) -> Figure:
    """Step x visit heat map of a per-visit quantity, one panel per sublayer (up to max_panels).

    Rows are the monitored steps (top: first), columns the visits r, colour the value
    (log10 with ``log``). Quantities: ``G_norm``, ``U_norm``, ``inc_rms``, ``cos_G_prev``.
    Reference: seed 002, Eq. 11-12 (||G_r,j||, ||U_r,j||).
    """
    from loopprobe.plots._base import new_figure

    call = "visit_heatmap"
    _check(call, frame)
    df = frame[(frame.quantity == quantity) & frame.visit.notna()]
    if df.empty:
        have = sorted(set(frame.quantity[frame.visit.notna()]))
        raise ValueError(
            f"{call}: no per-visit rows of quantity={quantity!r}; the frame has {have}"
        )
    names = list(pd.unique(df.sublayer))[:max_panels]
    fig, axes = new_figure(ncols=len(names), size=(3.4, 3.2))
    values = df.value.to_numpy(float)
    if log:
        values = np.where(values > 0, values, np.nan)
    finite = values[np.isfinite(values)]
    lo, hi = (finite.min(), finite.max()) if finite.size else (0.0, 1.0)
    norm = _norm(log, lo, hi)
    for ax, name in zip(axes[0], names, strict=True):
        sub = df[df.sublayer == name]
        grid = sub.pivot_table(index="step", columns="visit", values="value", aggfunc="mean")
        data = grid.to_numpy(float)
        if log:
            data = np.where(data > 0, data, np.nan)
        steps, visits = grid.index.to_numpy(), grid.columns.to_numpy()
        im = ax.imshow(data, aspect="auto", interpolation="nearest", cmap="viridis", norm=norm)
        ax.set_xticks(range(len(visits)), [str(int(v)) for v in visits])
        ticks = np.unique(np.linspace(0, len(steps) - 1, min(len(steps), 6)).round().astype(int))
        ax.set_yticks(ticks, [str(int(steps[t])) for t in ticks])
        ax.set(xlabel="visit r", ylabel="step", title=str(name))
        ax.grid(False)
    fig.colorbar(im, ax=axes[0, -1], label=quantity + (" (log scale)" if log else ""))
    fig.suptitle(title or f"{quantity} per visit over training")
    return fig


def _norm(log: bool, lo: float, hi: float):
    from matplotlib.colors import LogNorm, Normalize

    if log and lo > 0 and math.isfinite(lo) and hi > lo:
        return LogNorm(lo, hi)
    return Normalize(lo, hi if hi > lo else lo + 1)


def training_watch(frame: pd.DataFrame, *, R: int | None = None) -> Figure:
    """Four panels per scheme against step: kappa_R / R, training loss, the mean per-visit
    ``||G_r||``, and rho of one round (``loopprobe watch``'s frame: a ``scheme`` column).

    ``R``: divide kappa_R by it (default: the largest visit index + 1 in the frame).
    Reference: seed 002, Eq. 12 (kappa_R); docs/definitions.md §4 (rho).
    """
    from loopprobe.plots._base import level_colors, new_figure

    call = "training_watch"
    _check(call, frame)
    if "scheme" not in frame:
        raise ValueError(f"{call}: the frame needs a 'scheme' column (loopprobe watch's frame)")
    if R is None:
        visits = frame["visit"].dropna()
        R = int(visits.max()) + 1 if len(visits) else 1
    fig, axes = new_figure(ncols=2, nrows=2)
    schemes = list(pd.unique(frame["scheme"]))
    colors = level_colors(schemes)
    panels = [
        ("kappa_R", f"κ_R / R (R = {R})", 1.0 / R, False),
        ("loss", "training loss", 1.0, False),
        ("G_norm", "mean per-visit ‖G_r‖", 1.0, True),
        ("rho", "ρ(∂T/∂h) of one round", 1.0, False),
    ]
    for ax, (quantity, label, scale, logy) in zip(axes.flat, panels, strict=True):
        for scheme in schemes:
            sub = frame[(frame.scheme == scheme) & (frame.quantity == quantity)]
            if sub.empty:
                continue
            series = sub.groupby("step")["value"].mean() * scale
            ax.plot(series.index, series.values, marker="o" if len(series) < 8 else None,
                    markersize=4, color=colors[scheme], label=scheme)  # fmt: skip
        if logy:
            ax.set_yscale("log")
        ax.set(xlabel="training step", ylabel=label)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle("Training with the monitor on: alignment, loss, updates, round map")
    return fig
