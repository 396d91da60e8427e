"""Growth of the residual stream over loop count N: the fitted exponent and its regime.

:func:`growth_sweep` runs :func:`loopprobe.estimate.increments` on ``make_model(N, seed)`` for each
N, fits the log-log slope of ``||h_N - h_0|| / ||h_0||`` on N and names the regime with
:func:`regime_name` (linear, sqrt(N), flat, 1/sqrt(N)) from the slope and the mean
off-diagonal increment cosine. Definitions: docs/definitions.md §3; seeds 003 and 004.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pandas as pd
from torch import nn

from loopprobe._checks import Trust
from loopprobe._html import HTMLView
from loopprobe._stats import loglog_slope
from loopprobe.estimate.increments import Increments, _converged_line, increments
from loopprobe.record.increments import IncrementFn
from loopprobe.record.types import Forward
from loopprobe.sweeps import grid, sweep

if TYPE_CHECKING:  # plotting is imported on call
    from matplotlib.figure import Figure

# --------------------------------------------------------------------------- regimes

_SLOPES = {1.0: "linear", 0.5: "sqrt(N)", 0.0: "flat", -0.5: "1/sqrt(N)"}


def regime_name(slope: float, cos: float, *, tol: float = 0.15) -> str:
    """Name the growth regime from the log-log slope and the mean off-diagonal cosine.

    Growth: the nearest of 1 (linear), 1/2 (``sqrt(N)``), 0 (flat), -1/2 (``1/sqrt(N)``)
    within ``tol``, else "between". Correlation: ``cos >= 0.5`` correlated, ``|cos| <= 0.2``
    uncorrelated, else partly correlated. The combinations the theory names:
    correlated + sqrt(N) = a shared block under depth-muP ``1/sqrt(N)`` (under-scaled);
    correlated + flat = loop-scaled (``1/N``); uncorrelated + flat = depth-scaled untied
    stack (``1/sqrt(N)``); uncorrelated + 1/sqrt(N) = over-damped (``1/N`` on untied
    depth); linear = unscaled correlated increments. Reference: docs/definitions.md §3, seed 004.
    """
    if not math.isfinite(slope):
        return "undetermined (no finite growth slope)"
    near = min(_SLOPES, key=lambda s: abs(slope - s))
    growth = f"grows like {_SLOPES[near]}" if abs(slope - near) <= tol else "between regimes"
    if near == 0.0 and abs(slope) <= tol:
        growth = "flat"
    if near == -0.5 and abs(slope - near) <= tol:
        growth = "shrinks like 1/sqrt(N)"
    if not math.isfinite(cos):
        corr = "correlation unknown"
    elif cos >= 0.5:
        corr = "correlated"
    elif abs(cos) <= 0.2:
        corr = "uncorrelated"
    else:
        corr = "partly correlated"
    meaning = {
        ("correlated", "grows like sqrt(N)"): "shared block under-scaled (1/sqrt(N) on a loop)",
        ("correlated", "flat"): "loop-scaled (1/N on a shared block)",
        ("correlated", "grows like linear"): "unscaled shared block",
        ("uncorrelated", "flat"): "depth-scaled (1/sqrt(N) on untied depth)",
        ("uncorrelated", "shrinks like 1/sqrt(N)"): "over-damped (1/N on untied depth)",
        ("uncorrelated", "grows like sqrt(N)"): "unscaled untied depth (random walk)",
    }.get((corr, growth))
    name = f"{corr}, {growth}"
    return f"{name}: {meaning}" if meaning else name


# --------------------------------------------------------------------------- growth sweeps


@dataclass
class Growth(Trust, HTMLView):
    """A growth sweep: rows per (N, seed), the fitted log-log slope and the named regime.

    ``slope`` is the least-squares slope of ``log growth`` on ``log N`` over every
    finite row (seeds pooled); ``slope_per_seed`` fits each seed alone.
    ``mean_offdiag_cos`` and ``mean_ratio`` are the seed means at the largest N.
    ``converged`` is True when every cell ran, is finite and converged, all cells measure
    growth the same way, every slope is defined and the regime has a name; ``reason``
    says what is not ("" when converged).
    """

    _html_keys = ("slope", "regime")

    rows: pd.DataFrame
    slope: float
    slope_per_seed: dict
    mean_offdiag_cos: float
    mean_ratio: float
    regime: str
    config: dict = field(default_factory=dict)

    def _not_converged(self) -> list[str]:
        rows, why = self.rows, []
        cell = lambda r: f"N={r['N']} seed={r['seed']}"  # noqa: E731
        bad = rows[rows["diverged"]]
        if len(bad):
            first = bad.iloc[0]
            why.append(
                f"{len(bad)} of {len(rows)} cells diverged ({cell(first)}: {first['error']})"
            )
        if "converged" in rows:
            weak = rows[~rows["diverged"] & (rows["converged"] != True)]  # noqa: E712
            why += [f"{cell(r)}: {r['reason']}" for _, r in weak.head(3).iterrows()]
            if len(weak) > 3:
                why.append(f"{len(weak) - 3} more cells not converged")
        measures = rows.loc[~rows["diverged"], "growth_measure"].dropna().unique()
        if len(measures) > 1:
            why.append(
                f"cells measure growth differently ({', '.join(measures)}): one slope over "
                "them is meaningless"
            )
        if not math.isfinite(self.slope):
            why.append(
                "the growth slope is undefined (fewer than two N with positive finite growth)"
            )
        nan_seeds = [s for s, v in self.slope_per_seed.items() if not math.isfinite(v)]
        if nan_seeds:
            why.append(f"the growth slope of seeds {nan_seeds} is undefined")
        if (
            self.regime.startswith("undetermined")
            or "between" in self.regime
            or "unknown" in self.regime
        ):
            why.append(f"the regime is inconclusive ({self.regime})")
        return why

    def to_frame(self) -> pd.DataFrame:
        self.rows.attrs.update(self.summary())
        return self.rows

    def per_N(self) -> pd.DataFrame:
        """Seed means (and the growth's std) per N, finite rows only."""
        ok = self.rows[~self.rows["diverged"]]
        agg = ok.groupby("N").agg(
            growth=("growth", "mean"),
            growth_std=("growth", "std"),
            mean_offdiag_cos=("mean_offdiag_cos", "mean"),
            mean_ratio=("mean_ratio", "mean"),
            hN_rms=("hN_rms", "mean"),
            seeds=("seed", "count"),
        )
        return agg.reset_index()

    def summary(self) -> dict:
        return {
            **self.config,
            "growth_slope": self.slope,
            "growth_slope_per_seed": self.slope_per_seed,
            "mean_offdiag_cos": self.mean_offdiag_cos,
            "mean_ratio": self.mean_ratio,
            "regime": self.regime,
            "diverged_rows": int(self.rows["diverged"].sum()),
            "converged": self.converged,
            "reason": self.reason,
        }

    def __str__(self) -> str:
        Ns = sorted(int(n) for n in self.rows["N"].unique())
        lines = [
            f"growth slope {self.slope:.3f} over N = {Ns}",
            f"mean off-diagonal cosine at largest N: {self.mean_offdiag_cos:.3f}",
            f"regime: {self.regime}",
            _converged_line(self.converged, self.reason),
        ]
        return "\n".join(lines)

    def plot(self, **kw: Any) -> Figure:
        hue = "residual" if "residual" in self.rows else None
        style = "tying" if "tying" in self.rows else None
        from loopprobe import plots

        return plots.increment_growth(self.rows, hue=hue, style=style, **kw)


def growth_sweep(
    make_model: Callable[[int, int], nn.Module],
    make_inputs: Callable[[int], Any],
    Ns: Sequence[int] = (1, 2, 4, 8, 16, 32),
    seeds: Sequence[int] = (0, 1, 2),
    *,
    forward: Forward | None = None,
    increment: str | IncrementFn = "auto",
    group_by: str = "auto",
    sublayers: Sequence[str] | None = None,
    cache_dir: str | None = None,
    name: str | None = None,
    progress: bool = False,
) -> Growth:
    """Growth of ``||h_N - h_0|| / ||h_0||`` over N at init, its exponent and regime.

    ``make_model(N, seed)`` builds the model at loop count N; ``make_inputs(seed)`` the
    batch. Each (N, seed) cell runs :func:`increments` through :func:`loopprobe.sweep`, so
    a cell that raises or gives NaN/inf becomes a row with ``diverged=True`` and the fit
    skips it. ``cache_dir`` caches cells (then ``name`` must identify the factories).
    Reference: docs/definitions.md §3.
    """
    call = "growth_sweep"
    Ns, seeds = _positive_ints(call, "Ns", Ns), _ints(call, "seeds", seeds)
    if cache_dir is not None and name is None:
        raise ValueError(f"{call}: caching needs name='...' identifying make_model/make_inputs")

    def cell(cfg: dict) -> dict:
        model = make_model(cfg["N"], cfg["seed"])
        inc = increments(
            model,
            make_inputs(cfg["seed"]),
            forward=forward,
            increment=increment,
            group_by=group_by,
            sublayers=sublayers,
            copy=False,
        )
        return _row(inc)

    df = sweep(grid(N=Ns, seed=seeds), cell, cache_dir, progress, name=name or f"{call}-cell")
    return _fit(df, {})


def _fit(df: pd.DataFrame, config: dict) -> Growth:
    for col in ("growth", "mean_offdiag_cos", "mean_ratio", "hN_rms", "growth_measure"):
        if col not in df:
            df[col] = math.nan
    ok = df[~df["diverged"]]
    slope = loglog_slope(ok["N"], ok["growth"])
    per_seed = {int(s): loglog_slope(g["N"], g["growth"]) for s, g in ok.groupby("seed")}
    top = ok[ok["N"] == ok["N"].max()] if len(ok) else ok
    cos = float(top["mean_offdiag_cos"].mean()) if len(top) else math.nan
    ratio = float(top["mean_ratio"].mean()) if len(top) else math.nan
    return Growth(df, slope, per_seed, cos, ratio, regime_name(slope, cos), config)


def _ints(call: str, name: str, values: Sequence[int]) -> list[int]:
    vals = list(values)
    if not vals or not all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
        raise ValueError(f"{call}: {name} must be a non-empty list of integers, got {values!r}")
    return vals


def _positive_ints(call: str, name: str, values: Sequence[int]) -> list[int]:
    vals = _ints(call, name, values)
    if min(vals) < 1:
        raise ValueError(f"{call}: {name} must be integers >= 1, got {values!r}")
    return vals


def _row(inc: Increments) -> dict:
    """A sweep row; only a non-finite state is divergence (one visit has no cosine: NaN)."""
    row = {k: v for k, v in inc.summary().items() if not isinstance(v, dict)}
    bad = [k for k in ("growth", "hN_rms") if not math.isfinite(row[k])]
    row["diverged"] = bool(bad)
    row["error"] = f"non-finite {', '.join(bad)}" if bad else None
    return row
