"""Fixed points: residual traces and the spectrum of one round against the unit circle."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from loopprobe.plots._base import REF, check_frame, colored_groups, legend_below, log_y, new_figure

# ---------------------------------------------------------------------------- fixed points


def fixed_point_residuals(
    df: pd.DataFrame,
    *,
    x: str = "iteration",
    y: str = "residual",
    hue: str | None = "variant",
    tol: float | None = None,
    title: str = "Fixed-point residual ‖T(h) − h‖ / ‖h‖",
) -> Figure:
    """Residual traces of ``h <- T(h)`` on a log y axis, one line per variant.

    Columns: ``x`` (iteration), ``y`` (relative residual, as in ``FixedPoint.to_frame()``),
    ``hue`` (variant, e.g. recall/outer-norm setting; None for one trace). ``tol`` draws
    the convergence tolerance. Straight lines on this plot are linear convergence with
    rate = ρ(∂T/∂h). Reference: docs/definitions.md §4 (reachability).
    """
    df = check_frame("fixed_point_residuals", df, {"x": x, "y": y, "hue": hue})
    df = df[df[y] > 0]
    fig, axes = new_figure(size=(5.5, 4.8))
    ax = axes[0, 0]
    for color, level, sub in colored_groups(df, hue):
        sub = sub.sort_values(x)
        ax.plot(sub[x], sub[y], color=color, label=str(level) if hue else y)
    if tol is not None:
        ax.axhline(tol, label=f"tol {tol:g}", **REF)
    log_y(ax)
    ax.set(xlabel="iteration k", ylabel="‖T(h_k) − h_k‖ / ‖h_k‖", title=title)
    legend_below(fig, ax)
    return fig


def eigenvalues(
    df: pd.DataFrame,
    *,
    real: str = "real",
    imag: str = "imag",
    hue: str | None = "variant",
    title: str = "Top eigenvalues of ∂T/∂h and the unit circle",
) -> Figure:
    """Eigenvalues of the round Jacobian in the complex plane, against the unit circle.

    Columns: ``real``, ``imag`` (as in ``SpectralRadius.to_frame()``), ``hue`` (variant).
    The legend gives ρ(∂T/∂h) = max |λ| per variant: inside the circle, iterating the round
    contracts locally. Reference: docs/definitions.md §4 (geometry).
    """
    df = check_frame("eigenvalues", df, {"real": real, "imag": imag, "hue": hue})
    fig, axes = new_figure(size=(5.0, 5.6))
    ax = axes[0, 0]
    t = np.linspace(0, 2 * np.pi, 361)
    ax.plot(np.cos(t), np.sin(t), label="|λ| = 1", **REF)
    markers = ["o", "s", "^", "D", "v", "P", "X"]
    for i, (color, level, sub) in enumerate(colored_groups(df, hue)):
        rho = float(np.hypot(sub[real], sub[imag]).max()) if len(sub) else math.nan
        name = str(level) if hue else "λ"
        ax.plot(
            sub[real],
            sub[imag],
            linestyle="none",
            marker=markers[i % len(markers)],
            color=color,
            alpha=0.8,
            label=f"{name}: ρ = {rho:.3g}",
        )
    ax.axhline(0, color="0.85", linewidth=0.8)
    ax.axvline(0, color="0.85", linewidth=0.8)
    lim = 1.15 * max(1.0, float(np.hypot(df[real], df[imag]).max()) if len(df) else 1.0)
    ax.set(xlim=(-lim, lim), ylim=(-lim, lim))
    ax.set_aspect("equal", adjustable="box")
    ax.set(xlabel="Re λ", ylabel="Im λ", title=title)
    legend_below(fig, ax)
    return fig
