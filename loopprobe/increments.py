"""Forward residual increments per visit: correlation across visits, growth with N, regimes.

A visit's *increment* is what its residual branch adds to the stream, with the model's own
scaling (pre-norm ``h <- h + eps f(Norm(h))``: the increment is ``eps f(Norm(h))``). It is
read from the visit recording of :meth:`loopprobe.Probe.record` (no second hook layer):

- ``increment="output"``: the sublayer's output *is* the increment (the reference
  models' ``blocks[k].attn`` / ``.mlp`` branch modules);
- ``increment="delta"``: the sublayer returns the updated stream (a whole residual block
  ``x + f(x)``, most third-party loop bodies); the increment is ``output - input``;
- ``increment="auto"`` (default): one of the two per sublayer, read off the forward pass
  (does the next visit read the output, or input + output?); the result's ``measured``
  and ``evidence`` say which and why;
- a callable ``increment(record) -> Tensor`` for anything else (``record`` is a
  :class:`loopprobe.VisitRecord` with ``args``, ``kwargs`` and ``output``).

Per group of visits (a physical sublayer's visits; for an untied stack, where each
sublayer is visited once, the visits of the same *role*, ``blocks.*.attn``) it reports
the cosine matrix of the increments, the mean off-diagonal cosine and the ratio
``R = ||sum_r inc_r||^2 / sum_r ||inc_r||^2`` (1 when the increments are uncorrelated,
the number of visits when they are aligned); per visit the RMS of the stream after it;
and ``||h_N - h_0|| / ||h_0||``. :func:`growth_sweep` fits the log-log exponent of that
ratio over N and :func:`regime_name` names what it sees: a shared block under ``1/sqrt(N)``
grows like ``sqrt(N)``, under ``1/N`` it stays flat; an untied stack under ``1/sqrt(N)``
stays flat and under ``1/N`` shrinks like ``N^(-1/2)``.
Reference: docs/definitions.md §3; seed 004 (Loop-muP abstract), seed 003 (residual scaling).

Example::

    inc = lp.increments(model, idx)                  # model.hidden is used as h_N if present
    inc.group_frame()                                # mean_offdiag_cos, ratio per sublayer
    g = lp.reference_growth("tied", "1/sqrt(N)")     # slope ~ 0.5, regime named
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from loopprobe._checks import Trust
from loopprobe._increment_record import Collector, IncrementFn, caller_rng, refuse_routing
from loopprobe._stats import cosine_matrix, loglog_slope
from loopprobe.sweeps import grid, sweep
from loopprobe.visits import Forward, Probe, Visit, VisitRecord

if TYPE_CHECKING:  # plotting is imported on call (.heatmap, .plot): import stays light
    from matplotlib.figure import Figure

__all__ = [
    "Growth",
    "Increments",
    "growth_sweep",
    "increments",
    "reference_growth",
    "regime_name",
]

GROUPINGS = ("auto", "sublayer", "role")
MODES = ("auto", "output", "delta")
GROWTH_RELATIVE = "||h_N - h_0|| / ||h_0||"
GROWTH_ABSOLUTE = "RMS(h_N - h_0) (h_0 = 0, so no relative change)"


# --------------------------------------------------------------------------- result


@dataclass
class Increments(Trust):
    """Increments of one forward pass, grouped for the cross-visit statistics.

    ``visits[i]`` (execution order) belongs to ``groups[group_of[i]]``. ``cos[g]`` is the
    cosine matrix of group g's increments in visit order, ``ratio[g]`` its
    ``||sum inc||^2 / sum ||inc||^2``. ``stream_rms[i]`` is the RMS of the stream after
    visit i (as the next visit reads it; the final state for the last visit).
    ``measured[sublayer]`` is what was taken as its increment (``"output"``,
    ``"output - input"`` or ``"callable"``) and ``evidence[sublayer]`` why. ``growth`` is
    ``growth_measure`` (the relative change, or an absolute RMS when ``h_0 = 0``).
    ``converged`` is True when every increment and the growth are finite, no increment is
    zero (its cosines would be undefined) and nothing contradicts what was measured (a
    group with one visit has no cross-visit cosine by definition: NaN, not a failure);
    ``reason`` says what is not ("" when converged).
    """

    visits: list[Visit]
    grouping: str
    groups: list[str]
    group_of: list[int]
    inc_norm: np.ndarray
    inc_rms: np.ndarray
    stream_rms: np.ndarray
    cos: list[np.ndarray]
    ratio: list[float]
    h0_rms: float
    hN_rms: float
    growth: float
    hN_source: str
    growth_measure: str = GROWTH_RELATIVE
    measured: dict[str, str] = field(default_factory=dict)
    evidence: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    attrs: dict = field(default_factory=dict)

    def _not_converged(self) -> list[str]:
        why = list(self.problems)
        for name in ("growth", "hN_rms", "h0_rms"):
            if not math.isfinite(getattr(self, name)):
                why.append(f"{name} is {getattr(self, name)}")
        bad = [k for k in range(len(self.visits)) if not np.isfinite(self.inc_norm[k])]
        zero = [k for k in range(len(self.visits)) if self.inc_norm[k] == 0]
        for k, what in [*((k, "non-finite") for k in bad), *((k, "zero") for k in zero)]:
            v = self.visits[k]
            why.append(
                f"the increment of {v.sublayer!r} at r={v.r} is {what}, so its cosines are "
                "undefined"
            )
        return why

    @property
    def increment(self) -> str:
        """What was measured as the increment: one kind, or ``mixed (...)`` per sublayer."""
        kinds = set(self.measured.values())
        if len(kinds) == 1:
            return kinds.pop()
        return "mixed (" + ", ".join(f"{s}: {m}" for s, m in self.measured.items()) + ")"

    @property
    def mean_offdiag_cos(self) -> float:
        """Mean over groups (with two or more visits) of their mean off-diagonal cosine."""
        vals = [_offdiag_mean(c) for c in self.cos if len(c) > 1]
        return float(np.mean(vals)) if vals else math.nan

    @property
    def mean_ratio(self) -> float:
        """Mean over groups of ``||sum inc||^2 / sum ||inc||^2``."""
        return float(np.mean(self.ratio)) if self.ratio else math.nan

    def to_frame(self) -> pd.DataFrame:
        """One row per visit: who, its group, increment size, stream RMS after it."""
        rows = []
        pos = [0] * len(self.groups)
        for k, v in enumerate(self.visits):
            g = self.group_of[k]
            rows.append(
                {
                    "i": v.i,
                    "sublayer": v.sublayer,
                    "j": v.j,
                    "r": v.r,
                    "module": v.module,
                    "group": self.groups[g],
                    "k": pos[g],
                    "measured": self.measured.get(v.sublayer, ""),
                    "inc_norm": float(self.inc_norm[k]),
                    "inc_rms": float(self.inc_rms[k]),
                    "stream_rms": float(self.stream_rms[k]),
                }
            )
            pos[g] += 1
        df = pd.DataFrame(rows)
        df.attrs.update(self.summary())
        return df

    def group_frame(self) -> pd.DataFrame:
        """One row per group: visits, mean off-diagonal cosine, ratio R."""
        return pd.DataFrame(
            {
                "group": self.groups,
                "visits": [len(c) for c in self.cos],
                "mean_offdiag_cos": [_offdiag_mean(c) for c in self.cos],
                "ratio": self.ratio,
            }
        )

    def cosine_frame(self) -> pd.DataFrame:
        """Long frame ``sublayer`` (the group), ``r``, ``s``, ``cosine`` for heatmaps."""
        rows = [
            {"sublayer": name, "r": r, "s": s, "cosine": float(c[r, s])}
            for name, c in zip(self.groups, self.cos, strict=True)
            for r in range(len(c))
            for s in range(len(c))
        ]
        return pd.DataFrame(rows, columns=["sublayer", "r", "s", "cosine"])

    def summary(self) -> dict:
        return {
            "grouping": self.grouping,
            "visits": len(self.visits),
            "mean_offdiag_cos": self.mean_offdiag_cos,
            "mean_ratio": self.mean_ratio,
            "h0_rms": self.h0_rms,
            "hN_rms": self.hN_rms,
            "growth": self.growth,
            "growth_measure": self.growth_measure,
            "hN_source": self.hN_source,
            "increment": self.increment,
            "measured": dict(self.measured),
            "evidence": dict(self.evidence),
            "converged": self.converged,
            "reason": self.reason,
        }

    def __str__(self) -> str:
        lines = [f"Increments of {len(self.visits)} visits, grouped by {self.grouping}:"]
        for name, c, ratio in zip(self.groups, self.cos, self.ratio, strict=True):
            lines.append(
                f"  {name}: {len(c)} visits, mean off-diagonal cos {_offdiag_mean(c):.3f}, "
                f"ratio {ratio:.3g}"
            )
        for s, m in self.measured.items():
            lines.append(f"  {s}: measured {m} ({self.evidence.get(s, '')})")
        lines.append(f"growth {self.growth_measure} = {self.growth:.4g} (h_N: {self.hN_source})")
        lines.append(_converged_line(self.converged, self.reason))
        return "\n".join(lines)

    def heatmap(self, max_panels: int = 4) -> Figure:
        """Seaborn heatmaps of the increment cosine matrices (one panel per group)."""
        from loopprobe import plots

        return plots.visit_cosines(
            self.cosine_frame(),
            max_panels=max_panels,
            title="Increment cosines cos(inc_r, inc_s) across visits",
        )

    def stream_plot(self) -> Figure:
        """Line plot: stream RMS after each visit (execution order), a marker per group."""
        return stream_plot(self.to_frame())


def _converged_line(converged: bool, reason: str) -> str:
    return "converged: yes" if converged else f"converged: NO ({reason})"


def stream_plot(df: pd.DataFrame, *, x: str = "i", y: str = "stream_rms") -> Figure:
    """Stream RMS ``d^-1/2 ||h||`` after every visit against the visit index (log y).

    Columns: ``x`` (execution index), ``y`` (stream RMS), ``group`` (marker colour).
    Growth across visits is the residual explosion of the Fully Looped Transformer
    abstract. Reference: docs/definitions.md §3.
    """
    import seaborn as sns
    from matplotlib.figure import Figure

    with sns.axes_style("whitegrid"), sns.plotting_context("notebook", font_scale=0.9):
        fig = Figure(figsize=(5.0, 3.6), layout="constrained")
        ax = fig.subplots()
    ax.plot(df[x], df[y], color="0.5", linewidth=1.0)
    sns.scatterplot(data=df, x=x, y=y, hue="group", ax=ax, s=25, palette="colorblind")
    ax.set_yscale("log")
    ax.set(xlabel="visit (execution order)", ylabel="stream RMS after visit")
    ax.set_title("Residual stream RMS per visit")
    return fig


# --------------------------------------------------------------------------- measuring


def increments(
    model: nn.Module | Probe,
    inputs: Any,
    *,
    forward: Forward | None = None,
    increment: str | IncrementFn = "auto",
    group_by: str = "auto",
    sublayers: Sequence[str] | None = None,
    copy: bool = True,
) -> Increments:
    """Record every visit's residual increment and its statistics across visits.

    ``model`` is an ``nn.Module`` (a probe is attached, with ``sublayers`` if given) or
    an attached :class:`loopprobe.Probe`. ``forward(model, inputs)`` replaces the call;
    when it returns a tensor shaped like the stream, that tensor is ``h_N``. Without
    ``forward``, a model with a ``hidden`` method (the reference-model interface) is run
    through ``model.hidden(inputs)``; otherwise ``h_N`` is the last visit's input plus its
    increment (exact for additive pre-norm residuals; ``hN_source`` says which was used).
    ``h_0`` is the first visit's input; when it is zero (a zero-initialised state) the
    relative change is undefined and ``growth`` is the RMS of ``h_N - h_0`` instead
    (``growth_measure`` says which).

    ``increment`` says what a visit adds to the stream (the *stream* is the visit's first
    floating-point tensor argument shaped like its output, positional or keyword):
    ``"output"`` (a residual branch), ``"delta"`` (``output - input``: a block returning
    the updated stream), a callable ``record -> Tensor``, or ``"auto"`` (default), decided
    per sublayer from the forward pass itself: when the next visit (or the model output)
    reads this visit's output, the sublayer returns the state and ``delta`` is measured;
    when it reads input + output, ``output`` is. Without such a chain, by size:
    ``||output - input|| <= ||input|| / 2`` at every visit is a state, ``||output|| <=
    ||input|| / 2`` an increment; anything else is a ValueError asking for the choice.
    An explicit choice that the chain contradicts is measured as asked but makes the
    result ``converged=False`` with the reason. ``measured`` and ``evidence`` record,
    per sublayer, what was measured and why.

    Nothing but the increments (cloned unless ``copy=False``, which is faster but only
    right for models that do not edit a branch output in place after it returns), the
    first input and per-visit stream norms is kept: one visit session of the probe, no
    full recording. The caller's RNG state is restored afterwards (dropout in training
    mode draws from a fork). Reference: docs/definitions.md §3.
    """
    call = "increments"
    if group_by not in GROUPINGS:
        raise ValueError(f"{call}: group_by={group_by!r}; choose one of {list(GROUPINGS)}")
    if not (callable(increment) or increment in MODES):
        raise ValueError(
            f"{call}: increment={increment!r}; use 'auto' (decided from the forward pass), "
            "'output' (the sublayer returns the increment), 'delta' (it returns the updated "
            "stream) or a callable record -> Tensor"
        )
    probe = model if isinstance(model, Probe) else Probe(_module(model, call), sublayers)
    if forward is None and callable(getattr(probe.model, "hidden", None)):
        forward = _hidden
    with caller_rng(probe.model):
        col = Collector(increment, copy, call)
        out = col.run(probe, inputs, forward)
    visits, h0, incs = col.visits, col.h0, col.incs
    if isinstance(out, torch.Tensor) and out.shape == h0.shape:
        hN, source = out.detach(), "forward output"
    else:
        x, version, k = col.last
        if x._version != version:
            raise ValueError(
                f"{call}: the stream read by the last visit ({visits[-1].sublayer!r}) was "
                "modified in place afterwards, so h_N cannot be rebuilt as input + increment; "
                "pass forward=lambda m, x: ... returning the final state"
            )
        hN, source = x.detach() + incs[k], "last visit input + increment"
        if hN.shape != h0.shape:
            raise ValueError(
                f"{call}: the first visit reads a stream of shape {tuple(h0.shape)} but the "
                f"last one {tuple(x.shape)}, so ||h_N - h_0|| is undefined; pass "
                "forward=lambda m, x: ... returning the final state shaped like h_0"
            )
    grouping, keys = _group_keys(visits, group_by)
    names = list(dict.fromkeys(keys))
    group_of = [names.index(k) for k in keys]
    with torch.no_grad():
        n = h0.numel()
        # the stream after visit i is what visit i+1 read (its RMS taken at call time)
        stream_rms = torch.stack([*col.x_rms[1:], torch.linalg.vector_norm(hN) / math.sqrt(n)])
        h0_norm = float(torch.linalg.vector_norm(h0.double()))
        dist = float(torch.linalg.vector_norm((hN - h0).double()))
        cos, ratio = [], []
        inc_norm = np.zeros(len(incs))
        for g, name in enumerate(names):
            idx = [k for k in range(len(keys)) if group_of[k] == g]
            _same_shapes(call, name, [visits[k] for k in idx], [incs[k] for k in idx])
            Zg = torch.stack([incs[k].reshape(-1) for k in idx])
            gram = (Zg @ Zg.T).double()  # dot products in the model's dtype
            inc_norm[idx] = gram.diagonal().clamp_min(0).sqrt().cpu().numpy()
            cos.append(cosine_matrix(gram).cpu().numpy())
            tr = float(gram.trace())
            ratio.append(float(gram.sum()) / tr if tr > 0 else math.nan)
    if h0_norm > 0:
        growth, measure = dist / h0_norm, GROWTH_RELATIVE
    else:
        growth, measure = dist / math.sqrt(n), GROWTH_ABSOLUTE
    return Increments(
        visits=visits,
        grouping=grouping,
        groups=names,
        group_of=group_of,
        inc_norm=inc_norm,
        inc_rms=inc_norm / math.sqrt(n),
        stream_rms=stream_rms.double().cpu().numpy(),
        cos=cos,
        ratio=ratio,
        h0_rms=h0_norm / math.sqrt(n),
        hN_rms=_rms(hN),
        growth=growth,
        hN_source=source,
        growth_measure=measure,
        measured=col.measured,
        evidence=col.evidence,
        problems=col.problems,
    )


def _same_shapes(call: str, group: str, visits: list[Visit], incs: list[torch.Tensor]) -> None:
    if len({tuple(z.shape) for z in incs}) > 1:
        pairs = list(zip(visits, incs, strict=True))[:4]
        refuse_routing(call, group, [f"{v.sublayer} r={v.r}: {tuple(z.shape)}" for v, z in pairs])


def _hidden(model: nn.Module, inputs: Any) -> Any:
    return model.hidden(*inputs) if isinstance(inputs, tuple) else model.hidden(inputs)


def _module(model: Any, call: str) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{call}: expected an nn.Module or an lp.Probe, got {type(model).__name__}")
    return model


def _group_keys(visits: list[VisitRecord], group_by: str) -> tuple[str, list[str]]:
    if group_by == "auto":
        counts: dict[str, int] = {}
        for v in visits:
            counts[v.sublayer] = counts.get(v.sublayer, 0) + 1
        group_by = "sublayer" if max(counts.values()) > 1 else "role"
    if group_by == "sublayer":
        return group_by, [v.sublayer for v in visits]
    return group_by, [role(v.sublayer) for v in visits]


def role(name: str) -> str:
    """A sublayer's role: its name with every integer path segment replaced by ``*``."""
    return ".".join("*" if re.fullmatch(r"\d+", part) else part for part in name.split("."))


def _offdiag_mean(c: np.ndarray) -> float:
    n = len(c)
    if n < 2:
        return math.nan
    mask = ~np.eye(n, dtype=bool)
    return float(np.nanmean(c[mask])) if np.isfinite(c[mask]).any() else math.nan


def _rms(t: torch.Tensor) -> float:
    return float(t.double().pow(2).mean().sqrt())


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
class Growth(Trust):
    """A growth sweep: rows per (N, seed), the fitted log-log slope and the named regime.

    ``slope`` is the least-squares slope of ``log growth`` on ``log N`` over every
    finite row (seeds pooled); ``slope_per_seed`` fits each seed alone.
    ``mean_offdiag_cos`` and ``mean_ratio`` are the seed means at the largest N.
    ``converged`` is True when every cell ran, is finite and converged, all cells measure
    growth the same way, every slope is defined and the regime has a name; ``reason``
    says what is not ("" when converged).
    """

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


# --------------------------------------------------------------------------- reference sweep

TYINGS = ("tied", "untied")


def reference_growth(
    tying: str = "tied",
    residual: str = "1/N",
    Ns: Sequence[int] = (1, 2, 4, 8, 16, 32),
    seeds: Sequence[int] = (0, 1, 2),
    *,
    d_model: int = 64,
    n_heads: int = 4,
    seq_len: int = 32,
    batch: int = 8,
    vocab_size: int = 256,
    h0_rms: float | None = 1.0,
    cache_dir: str | None = None,
    progress: bool = False,
) -> Growth:
    """:func:`growth_sweep` on the pre-norm reference :class:`~loopprobe.models.LoopedGPT`.

    ``tying="tied"``: one physical block (K=1) applied for N rounds; ``"untied"``: N
    distinct blocks applied once. ``residual``: the branch multiplier rule
    (``none``, ``1/sqrt(N)``, ``1/N``, ``loop-mup``). Inputs are uniform random tokens.
    ``h0_rms``: the loop starts from the embedding rescaled to this RMS, ``d^-1/2 ||h_0||``
    (seed 004's init assumption ``||h_0||^2 / d = Theta(1)``); ``None`` keeps the model's
    own embedding (std 0.02, RMS about 0.03: then a single increment is some twenty times
    ``h_0`` and the ratio mostly measures the first visit). Reference: docs/definitions.md §3.
    """
    call = "reference_growth"
    if tying not in TYINGS:
        raise ValueError(f"{call}: tying={tying!r}; choose one of {list(TYINGS)}")
    if h0_rms is not None and not (isinstance(h0_rms, (int, float)) and h0_rms > 0):
        raise ValueError(f"{call}: h0_rms={h0_rms!r} must be a positive number or None")
    Ns, seeds = _positive_ints(call, "Ns", Ns), _ints(call, "seeds", seeds)
    base = {
        "tying": tying,
        "residual": residual,
        "d_model": d_model,
        "n_heads": n_heads,
        "seq_len": seq_len,
        "batch": batch,
        "vocab_size": vocab_size,
        "h0_rms": h0_rms,
    }
    _reference_model({**base, "N": 1, "seed": 0})  # validates the config before sweeping
    df = sweep(
        grid(**{k: [v] for k, v in base.items()}, N=Ns, seed=seeds),
        _reference_cell,
        cache_dir,
        progress,
    )
    return _fit(df, base)


def _reference_model(cfg: dict) -> nn.Module:
    from loopprobe.models import GPTConfig, LoopedGPT

    gcfg = GPTConfig(
        vocab_size=cfg["vocab_size"],
        seq_len=cfg["seq_len"],
        d_model=cfg["d_model"],
        n_heads=cfg["n_heads"],
        K=1,
        R=cfg["N"],
        norm="pre",
        residual=cfg["residual"],
        tied=cfg["tying"] == "tied",
    )
    return LoopedGPT(gcfg, generator=torch.Generator().manual_seed(cfg["seed"]))


def start_at_rms(h0_rms: float | None) -> Forward:
    """A ``forward`` for the reference models: the loop from ``embed`` rescaled to RMS h0_rms."""

    def forward(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
        x = model.embed(idx)
        if h0_rms is not None:
            x = x * (h0_rms / x.pow(2).mean().sqrt())
        return model.loop(x)

    return forward


def _reference_cell(cfg: dict) -> dict:
    from loopprobe import tasks

    model = _reference_model(cfg)
    gen = torch.Generator().manual_seed(10_000 + cfg["seed"])
    idx, _ = tasks.random_tokens(cfg["batch"], cfg["seq_len"], cfg["vocab_size"], gen)
    inc = increments(model, idx, forward=start_at_rms(cfg["h0_rms"]), copy=False)
    return _row(inc)


def _row(inc: Increments) -> dict:
    """A sweep row; only a non-finite state is divergence (one visit has no cosine: NaN)."""
    row = {k: v for k, v in inc.summary().items() if not isinstance(v, dict)}
    bad = [k for k in ("growth", "hN_rms") if not math.isfinite(row[k])]
    row["diverged"] = bool(bad)
    row["error"] = f"non-finite {', '.join(bad)}" if bad else None
    return row


_reference_cell.version = 2
