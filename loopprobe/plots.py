"""Figures from the tidy frames that the diagnostics and :func:`loopprobe.sweep` return.

Every function takes a long-format pandas DataFrame (one row per config/visit/step, as
mup's coord check does), returns a :class:`matplotlib.figure.Figure` and never calls
``plt.show``: figures are built on ``Figure()`` directly (no pyplot state, no GUI), so
they work headless, in tests and in notebooks alike. Save one with
``fig.savefig("kappa.png")``. Column names are keyword arguments with the producers'
names as defaults; each docstring lists the columns it reads. Rows with
``diverged=True`` are left out of every figure.

Notation follows the papers: κ_R (visit alignment), ‖ΔF‖ (output change after one
step), β/α (update-to-residual ratio), ρ(∂T/∂h) (spectral radius of one round).
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from loopprobe import theory
from loopprobe._stats import loglog_slope

__all__ = [
    "coord_check",
    "delta_f_vs_R",
    "eigenvalues",
    "fixed_point_residuals",
    "increment_growth",
    "kappa_vs_R",
    "loglog_slope",
    "lr_transfer",
    "predicted_slopes",
    "visit_cosines",
    "visit_norms",
]

_REF = {"color": "0.45", "linestyle": "--", "linewidth": 1.0}  # reference (theory) lines


# ------------------------------------------------------------------------------ helpers


class PlotFigure(Figure):
    """A matplotlib Figure that shows itself as a PNG in Jupyter (no pyplot needed)."""

    def _repr_png_(self) -> bytes:
        buf = io.BytesIO()
        self.savefig(buf, format="png", dpi=100)
        return buf.getvalue()


def _figure(ncols: int = 1, nrows: int = 1, size: tuple[float, float] = (5.0, 3.6)):
    """A Figure with seaborn's whitegrid style applied to its axes only (no global rc)."""
    with sns.axes_style("whitegrid"), sns.plotting_context("notebook", font_scale=0.9):
        fig = PlotFigure(figsize=(size[0] * ncols, size[1] * nrows), layout="constrained")
        axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def _frame(call: str, df: pd.DataFrame, columns: Mapping[str, str | None]) -> pd.DataFrame:
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


def _order(df: pd.DataFrame, col: str | None) -> list:
    if col is None:
        return [None]
    return list(pd.unique(df[col]))


def _groups(df: pd.DataFrame, col: str | None):
    """(level, sub-frame) pairs in order of first appearance; one group when col is None."""
    for level in _order(df, col):
        yield level, (df if col is None else df[df[col] == level])


def _palette(n: int) -> list:
    return sns.color_palette("colorblind", max(n, 1))


def _line(ax: Axes, sub: pd.DataFrame, x: str, y: str, **kw) -> None:
    """Mean over repeated x (seeds) with markers; the spread as a band when there is one."""
    stats = sub.groupby(x, sort=True)[y].agg(["mean", "min", "max", "count"])
    ax.plot(stats.index, stats["mean"], marker="o", markersize=4, **kw)
    if (stats["count"] > 1).any():
        ax.fill_between(
            stats.index, stats["min"], stats["max"], alpha=0.15, color=kw.get("color"), linewidth=0
        )


def _reference_slope(ax: Axes, xs: np.ndarray, ys: np.ndarray, slope: float, label: str) -> None:
    """A dashed power law ``c x^slope`` through the geometric centre of the points."""
    xs, ys = np.asarray(xs, float), np.asarray(ys, float)
    ok = (xs > 0) & (ys > 0)
    if not ok.any():
        return
    lx, ly = np.log(xs[ok]), np.log(ys[ok])
    c = ly.mean() - slope * lx.mean()
    grid = np.array([xs[ok].min(), xs[ok].max()])
    ax.plot(grid, np.exp(c) * grid**slope, label=label, **_REF)


def _side_legend(fig: Figure, ax: Axes, title: str | None = None) -> None:
    """One legend for a multi-panel figure, outside on the right (never over the data)."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside right upper", fontsize="small", title=title)


def _legend_below(fig: Figure, ax: Axes) -> None:
    """A legend under a one-panel figure with many entries (never over the data)."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside lower center", fontsize="small", ncols=2)


def _log_y(ax: Axes) -> None:
    """Log y axis; plain ``%.3g`` labels up to two decades of data, decades only above."""
    ax.set_yscale("log")
    lo, hi = ax.get_ylim()
    if lo > 0 and hi / lo < 10:
        fmt = FuncFormatter(lambda v, _: f"{v:.3g}")
        ax.yaxis.set_major_formatter(fmt)
        ax.yaxis.set_minor_formatter(fmt)
    elif lo > 0 and hi / lo < 100:  # one or two decades: label 2x and 5x as well
        fmt = FuncFormatter(lambda v, _: f"{v:.3g}")
        ax.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
        ax.yaxis.set_major_formatter(fmt)
        ax.yaxis.set_minor_formatter(fmt)
    else:
        ax.yaxis.set_minor_formatter(NullFormatter())


def _log2_x(ax: Axes, values: Sequence[float]) -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted({float(v) for v in values if v > 0})
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()


# ------------------------------------------------------------------------ visit alignment


def predicted_slopes(schemes: Sequence[str], gamma: float = 1.0) -> dict[str, float]:
    """Predicted log-log slope of ``M κ_R (β/α)²`` in R (fixed K) per named scheme.

    ``1 + gamma - 4p`` (seed 002, Eqs. 14-16): aligned visits (gamma = 1) give 1 for
    DeepNorm (p = 1/4) and 0 for DeepLoop (p = 1/2). Names ``theory.scales`` does not know,
    and ``"postp"`` (whose p is not in its name), are left out.
    """
    out = {}
    for s in schemes:
        if isinstance(s, str) and s in theory.ALLOWED_NORMS and s != "postp":
            out[s] = theory.bound_exponent(theory.scales(1, s).p, gamma)
    return out


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
    df = _frame("kappa_vs_R", df, {"x": x, "y": y, "hue": hue})
    fig, axes = _figure()
    ax = axes[0, 0]
    levels = _order(df, hue)
    for color, (level, sub) in zip(_palette(len(levels)), _groups(df, hue), strict=True):
        _line(ax, sub, x, y, color=color, label=str(level) if hue else y)
    rs = np.sort(df[x].unique().astype(float))
    if len(rs):
        ax.plot(rs, rs, label="κ_R = R (aligned)", **_REF)
        ax.plot(
            rs,
            np.ones_like(rs),
            label="κ_R = 1 (decorrelated)",
            color="0.7",
            linestyle=":",
            linewidth=1.0,
        )
        _log2_x(ax, rs)
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
    df = _frame("delta_f_vs_R", df, {"x": x, "y": y, "hue": hue})
    levels = _order(df, hue)
    if slopes is None:
        slopes = predicted_slopes([lv for lv in levels if lv is not None])
    fig, axes = _figure()
    ax = axes[0, 0]
    for color, (level, sub) in zip(_palette(len(levels)), _groups(df, hue), strict=True):
        fit = loglog_slope(sub[x], sub[y])
        name = str(level) if hue else y
        _line(ax, sub, x, y, color=color, label=f"{name} (fit {_two(fit)})")
        if level in slopes:
            _reference_slope(
                ax, sub[x], sub[y], slopes[level], f"{name} predicted slope {slopes[level]:g}"
            )
            ax.lines[-1].set_color(color)
    _log_y(ax)
    _log2_x(ax, df[x].unique())
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
    df = _frame("visit_norms", df, {"x": x, "sublayer": sublayer, "U": U, "G": G})
    fig, axes = _figure(ncols=len(panels))
    levels = _order(df, sublayer)
    for ax, (col, label) in zip(axes[0], panels, strict=True):
        for color, (level, sub) in zip(_palette(len(levels)), _groups(df, sublayer), strict=True):
            _line(ax, sub, x, col, color=color, label=str(level) if sublayer else col)
        if logy:
            _log_y(ax)
        ax.set(xlabel="visit r", ylabel=label, title=label)
        ax.xaxis.get_major_locator().set_params(integer=True)
    _side_legend(fig, axes[0, -1], title="sublayer j" if sublayer else None)
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
        df = _frame(
            "visit_cosines", data, {"sublayer": sublayer, "row": row, "col": col, "value": value}
        )
        mats = {
            str(name): sub.pivot_table(index=row, columns=col, values=value).to_numpy()
            for name, sub in _groups(df, sublayer)
        }
    if not mats:
        raise ValueError("visit_cosines: no cosine matrices to draw (empty frame)")
    names = list(mats)[:max_panels]
    fig, axes = _figure(ncols=len(names), size=(3.6, 3.2))
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
    df = _frame("increment_growth", df, {"x": x, "y": y, "hue": hue, "style": style})
    fig, axes = _figure(size=(5.5, 4.8))
    ax = axes[0, 0]
    levels = _order(df, hue)
    colors = dict(zip(levels, _palette(len(levels)), strict=True))
    dashes = ["-", "-.", ":", (0, (5, 1))]
    for si, (slevel, ssub) in enumerate(_groups(df, style)):
        for level, sub in _groups(ssub, hue):
            if sub.empty:
                continue
            fit = loglog_slope(sub[x], sub[y])
            parts = [str(v) for v in (level, slevel) if v is not None]
            _line(
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
            ax.plot(xs, y0 * (xs / xs[0]) ** s, label=f"slope {s:g}", **_REF)
        _log2_x(ax, xs)
    _log_y(ax)
    ax.set(xlabel="N (loops)", ylabel="‖h_N − h_0‖ / ‖h_0‖", title=title)
    _legend_below(fig, ax)
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
    or visit group). ``ylabel`` defaults to ``y``. Seeds are averaged. Flat lines mean the
    parameterization is stable in N (the looped analogue of mup's coord check).
    Reference: docs/definitions.md §5; issue 4.
    """
    df = _frame("coord_check", df, {"x": x, "y": y, "col": col, "hue": hue})
    steps = sorted(df[col].unique())
    if not steps:
        raise ValueError("coord_check: no rows to draw (empty frame after dropping NaN)")
    if len(steps) > max_cols:
        steps = [steps[i] for i in np.linspace(0, len(steps) - 1, max_cols).round().astype(int)]
    fig, axes = _figure(ncols=len(steps), size=(3.4, 3.0))
    levels = _order(df, hue)
    colors = dict(zip(levels, _palette(len(levels)), strict=True))
    for ax, step in zip(axes[0], steps, strict=True):
        for level, sub in _groups(df[df[col] == step], hue):
            if not sub.empty:
                _line(ax, sub, x, y, color=colors[level], label=str(level) if hue else y)
        _log2_x(ax, df[x].unique())
        if logy:
            _log_y(ax)
        ax.set(xlabel="N (loops)", title=f"{col} {step}")
    axes[0, 0].set_ylabel(ylabel or y)
    _side_legend(fig, axes[0, -1], title=hue)
    fig.suptitle(title)
    return fig


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
    staying put across N is transfer. Reference: issue 4 (Loop-μP, seed 004).
    """
    df = _frame("lr_transfer", df, {"x": x, "y": y, "hue": hue, "col": col})
    panels = _order(df, col)
    fig, axes = _figure(ncols=len(panels))
    levels = sorted(df[hue].unique())
    colors = dict(zip(levels, _palette(len(levels)), strict=True))
    for ax, (plevel, psub) in zip(axes[0], _groups(df, col), strict=True):
        for level in levels:
            sub = psub[psub[hue] == level]
            if sub.empty:
                continue
            _line(ax, sub, x, y, color=colors[level], label=f"{hue}={level}")
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
    df = _frame("fixed_point_residuals", df, {"x": x, "y": y, "hue": hue})
    df = df[df[y] > 0]
    fig, axes = _figure(size=(5.5, 4.8))
    ax = axes[0, 0]
    levels = _order(df, hue)
    for color, (level, sub) in zip(_palette(len(levels)), _groups(df, hue), strict=True):
        sub = sub.sort_values(x)
        ax.plot(sub[x], sub[y], color=color, label=str(level) if hue else y)
    if tol is not None:
        ax.axhline(tol, label=f"tol {tol:g}", **_REF)
    _log_y(ax)
    ax.set(xlabel="iteration k", ylabel="‖T(h_k) − h_k‖ / ‖h_k‖", title=title)
    _legend_below(fig, ax)
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
    df = _frame("eigenvalues", df, {"real": real, "imag": imag, "hue": hue})
    fig, axes = _figure(size=(5.0, 5.6))
    ax = axes[0, 0]
    t = np.linspace(0, 2 * np.pi, 361)
    ax.plot(np.cos(t), np.sin(t), label="|λ| = 1", **_REF)
    levels = _order(df, hue)
    markers = ["o", "s", "^", "D", "v", "P", "X"]
    for i, (color, (level, sub)) in enumerate(
        zip(_palette(len(levels)), _groups(df, hue), strict=True)
    ):
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
    _legend_below(fig, ax)
    return fig


def _two(x: float) -> str:
    """Two decimals, without the "-0.00" a slope of -0.001 would print."""
    text = f"{x:.2f}"
    return "0.00" if text == "-0.00" else text
