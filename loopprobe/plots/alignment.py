"""Visit alignment: κ_R and ‖ΔF‖ over R, per-visit norms and cosines."""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from loopprobe._stats import loglog_slope
from loopprobe.plots._base import (
    REF,
    check_frame,
    colored_groups,
    groups,
    line,
    log2_x,
    log_y,
    new_figure,
    order,
    reference_slope,
    side_legend,
    two_decimals,
)
from loopprobe.theory import predicted_slopes  # noqa: F401 - lp.plots.predicted_slopes

# ------------------------------------------------------------------------ visit alignment


def kappa_vs_R(
    df: pd.DataFrame,
    *,
    x: str = "R",
    y: str = "kappa",
    hue: str | None = "norm",
    title: str = "Visit alignment κ_R vs loop count R",
) -> Figure:
    """κ_R against R, one line per scheme, with the bounds κ_R = 1 and κ_R = R drawn.

    Columns: ``x`` (R, loop count), ``y`` (κ_R), ``hue`` (scheme, e.g. ``norm``; None for
    one line). Repeated rows per (hue, R), e.g. seeds, are averaged with their range shaded.
    Reference: seed 002, Eq. 12 (0 ≤ κ_R ≤ R).
    """
    df = check_frame("kappa_vs_R", df, {"x": x, "y": y, "hue": hue})
    fig, axes = new_figure()
    ax = axes[0, 0]
    for color, level, sub in colored_groups(df, hue):
        line(ax, sub, x, y, color=color, label=str(level) if hue else y)
    rs = np.sort(df[x].unique().astype(float))
    if len(rs):
        ax.plot(rs, rs, label="κ_R = R (aligned)", **REF)
        ax.plot(
            rs,
            np.ones_like(rs),
            label="κ_R = 1 (decorrelated)",
            color="0.7",
            linestyle=":",
            linewidth=1.0,
        )
        log2_x(ax, rs)
    ax.set(xlabel="R (rounds)", ylabel="κ_R", title=title)
    ax.legend(fontsize="small")
    return fig


def delta_f_vs_R(
    df: pd.DataFrame,
    *,
    x: str = "R",
    y: str = "delta_F",
    hue: str | None = "norm",
    slopes: Mapping[str, float] | None = None,
    ylabel: str = "‖ΔF‖ / ‖F‖",
    title: str = "Output change after one step vs R",
) -> Figure:
    """‖ΔF‖ against R on log-log axes, the fitted slope per scheme and the predicted one.

    Columns: ``x`` (R), ``y`` (measured ‖ΔF‖/‖F‖, or any positive quantity such as the
    predicted bound), ``hue`` (scheme). ``slopes`` maps hue levels to predicted log-log
    slopes, drawn as dashed lines through each scheme's points; by default
    :func:`predicted_slopes` of the levels (aligned regime). Reference: seed 002, Eq. 14.
    """
    df = check_frame("delta_f_vs_R", df, {"x": x, "y": y, "hue": hue})
    levels = order(df, hue)
    if slopes is None:
        slopes = predicted_slopes([lv for lv in levels if lv is not None])
    fig, axes = new_figure()
    ax = axes[0, 0]
    for color, level, sub in colored_groups(df, hue):
        fit = loglog_slope(sub[x], sub[y])
        name = str(level) if hue else y
        line(ax, sub, x, y, color=color, label=f"{name} (fit {two_decimals(fit)})")
        if level in slopes:
            reference_slope(
                ax, sub[x], sub[y], slopes[level], f"{name} predicted slope {slopes[level]:g}"
            )
            ax.lines[-1].set_color(color)
    log_y(ax)
    log2_x(ax, df[x].unique())
    ax.set(xlabel="R (rounds)", ylabel=ylabel, title=title)
    ax.legend(fontsize="small")
    return fig


def visit_norms(
    df: pd.DataFrame,
    *,
    x: str = "r",
    sublayer: str | None = "sublayer",
    U: str = "U_norm",
    G: str = "G_norm",
    logy: bool = True,
    title: str = "Per-visit sensitivity ‖U_r,j‖ and update ‖G_r,j‖",
) -> Figure:
    """Two panels, ‖U_{r,j}‖ and ‖G_{r,j}‖ against the visit index r, a line per sublayer j.

    Columns: ``x`` (visit/round index r of the sublayer), ``sublayer`` (physical sublayer
    name j), ``U`` and ``G`` (the per-visit norms; either may be None to skip its panel).
    Reference: seed 002, Eq. 11-12; docs/definitions.md §2.
    """
    panels = [(c, lab) for c, lab in ((U, "‖U_r,j‖"), (G, "‖G_r,j‖")) if c is not None]
    if not panels:
        raise ValueError("visit_norms: U and G are both None; name at least one column")
    df = check_frame("visit_norms", df, {"x": x, "sublayer": sublayer, "U": U, "G": G})
    fig, axes = new_figure(ncols=len(panels))
    for ax, (col, label) in zip(axes[0], panels, strict=True):
        for color, level, sub in colored_groups(df, sublayer):
            line(ax, sub, x, col, color=color, label=str(level) if sublayer else col)
        if logy:
            log_y(ax)
        ax.set(xlabel="visit r", ylabel=label, title=label)
        ax.xaxis.get_major_locator().set_params(integer=True)
    side_legend(fig, axes[0, -1], title="sublayer j" if sublayer else None)
    fig.suptitle(title)
    return fig


def visit_cosines(
    data: pd.DataFrame | Mapping[str, np.ndarray],
    *,
    sublayer: str = "sublayer",
    row: str = "r",
    col: str = "s",
    value: str = "cosine",
    max_panels: int = 4,
    title: str = "Visit cosines cos(G_r,j, G_s,j)",
) -> Figure:
    """Heatmaps of the cosine matrix across visits, one panel per sublayer (up to max_panels).

    ``data`` is a long frame with columns ``sublayer``, ``row`` (r), ``col`` (s), ``value``
    (cos between visits r and s), or a mapping ``{sublayer: (R, R) array}``. Cosines near 1
    off the diagonal mean aligned visits (κ_R → R); negative ones between neighbours are
    gradient oscillation. Reference: docs/definitions.md §2 (visit Gram/cosine matrices).
    """
    if isinstance(data, Mapping):
        mats = {str(k): np.asarray(v, float) for k, v in data.items()}
    else:
        df = check_frame(
            "visit_cosines", data, {"sublayer": sublayer, "row": row, "col": col, "value": value}
        )
        mats = {
            str(name): sub.pivot_table(index=row, columns=col, values=value).to_numpy()
            for name, sub in groups(df, sublayer)
        }
    if not mats:
        raise ValueError("visit_cosines: no cosine matrices to draw (empty frame)")
    names = list(mats)[:max_panels]
    fig, axes = new_figure(ncols=len(names), size=(3.6, 3.2))
    for i, (ax, name) in enumerate(zip(axes[0], names, strict=True)):
        with warnings.catch_warnings():  # seaborn 0.13 calls the deprecated cmap.set_bad
            warnings.simplefilter("ignore", PendingDeprecationWarning)
            sns.heatmap(
                mats[name],
                ax=ax,
                vmin=-1,
                vmax=1,
                center=0,
                cmap="vlag",
                square=True,
                cbar=i == len(names) - 1,
                annot=len(mats[name]) <= 6,
                fmt=".2f",
                annot_kws={"fontsize": 7},
            )
        ax.set(xlabel="visit s", ylabel="visit r", title=name)
    fig.suptitle(title)
    return fig
