"""Forward residual increments per visit: correlation across visits, growth with N, regimes.

A visit's *increment* is what its residual branch adds to the stream, with the model's own
scaling (pre-norm ``h <- h + eps f(Norm(h))``: the increment is ``eps f(Norm(h))``). It is
read from the visit recording of :meth:`loopprobe.Probe.record` (no second hook layer):

- ``increment="output"`` (default): the sublayer's output *is* the increment (the
  reference models' ``blocks[k].attn`` / ``.mlp`` branch modules);
- ``increment="delta"``: the sublayer returns the updated stream (a whole residual block
  ``x + f(x)``); the increment is ``output - input``;
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
Reference: DESIGN.md §3; seed 004 (Loop-muP abstract), seed 003 (residual scaling).

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
from typing import Any

import numpy as np
import pandas as pd
import seaborn as sns
import torch
from matplotlib.figure import Figure
from torch import nn

from loopprobe import plots
from loopprobe.sweeps import grid, sweep
from loopprobe.visits import Forward, Probe, Visit, VisitRecord, attach, call_model

__all__ = [
    "Growth",
    "Increments",
    "growth_sweep",
    "increments",
    "reference_growth",
    "regime_name",
]

IncrementFn = Callable[[VisitRecord], torch.Tensor]
GROUPINGS = ("auto", "sublayer", "role")


# --------------------------------------------------------------------------- result


@dataclass
class Increments:
    """Increments of one forward pass, grouped for the cross-visit statistics.

    ``visits[i]`` (execution order) belongs to ``groups[group_of[i]]``. ``cos[g]`` is the
    cosine matrix of group g's increments in visit order, ``ratio[g]`` its
    ``||sum inc||^2 / sum ||inc||^2``. ``stream_rms[i]`` is the RMS of the stream after
    visit i (as the next visit reads it; the final state for the last visit).
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
    attrs: dict = field(default_factory=dict)

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
            "hN_source": self.hN_source,
        }

    def heatmap(self, max_panels: int = 4) -> Figure:
        """Seaborn heatmaps of the increment cosine matrices (one panel per group)."""
        return plots.visit_cosines(
            self.cosine_frame(),
            max_panels=max_panels,
            title="Increment cosines cos(inc_r, inc_s) across visits",
        )

    def stream_plot(self) -> Figure:
        """Line plot: stream RMS after each visit (execution order), a marker per group."""
        return stream_plot(self.to_frame())


def stream_plot(df: pd.DataFrame, *, x: str = "i", y: str = "stream_rms") -> Figure:
    """Stream RMS ``d^-1/2 ||h||`` after every visit against the visit index (log y).

    Columns: ``x`` (execution index), ``y`` (stream RMS), ``group`` (marker colour).
    Growth across visits is the residual explosion of the Fully Looped Transformer
    abstract. Reference: DESIGN.md §3.
    """
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
    increment: str | IncrementFn = "output",
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
    ``h_0`` is the first visit's input. ``group_by``: ``"sublayer"`` (the visits of one
    physical sublayer), ``"role"`` (sublayers whose names agree up to their integer
    indices, e.g. ``blocks.*.attn``: the unrolled positions of an untied stack) or
    ``"auto"`` (``sublayer`` if any sublayer is visited twice, else ``role``).
    Nothing but the increments (cloned unless ``copy=False``, which is faster but only
    right for models that do not edit a branch output in place after it returns), the
    first input and per-visit stream norms is kept: one visit session of the probe, no
    full recording.
    Reference: DESIGN.md §3.
    """
    call = "increments"
    if group_by not in GROUPINGS:
        raise ValueError(f"{call}: group_by={group_by!r}; choose one of {list(GROUPINGS)}")
    inc_fn = _increment_fn(increment, call)
    probe = model if isinstance(model, Probe) else attach(_module(model, call), sublayers)
    if forward is None and callable(getattr(probe.model, "hidden", None)):
        forward = _hidden
    visits, h0, x_rms, incs, out, last = _collect(probe, inputs, forward, inc_fn, increment, copy)
    if isinstance(out, torch.Tensor) and out.shape == h0.shape:
        hN, source = out.detach(), "forward output"
    else:
        x, z, version = last
        if x._version != version:
            raise ValueError(
                f"{call}: the stream read by the last visit ({visits[-1].sublayer!r}) was "
                "modified in place afterwards, so h_N cannot be rebuilt as input + increment; "
                "pass forward=lambda m, x: ... returning the final state"
            )
        hN, source = x.detach() + z, "last visit input + increment"
    grouping, keys = _group_keys(visits, group_by)
    names = list(dict.fromkeys(keys))
    group_of = [names.index(k) for k in keys]
    with torch.no_grad():
        n = h0.numel()
        # the stream after visit i is what visit i+1 read (its RMS taken at call time)
        stream_rms = torch.stack([*x_rms[1:], torch.linalg.vector_norm(hN) / math.sqrt(n)])
        h0_norm = float(torch.linalg.vector_norm(h0.double()))
        dist = float(torch.linalg.vector_norm((hN - h0).double()))
        cos, ratio = [], []
        inc_norm = np.zeros(len(incs))
        for g in range(len(names)):
            idx = [k for k in range(len(keys)) if group_of[k] == g]
            Zg = torch.stack([incs[k].reshape(-1) for k in idx])
            gram = (Zg @ Zg.T).double().cpu().numpy()  # dot products in the model's dtype
            inc_norm[idx] = np.sqrt(np.clip(np.diag(gram), 0.0, None))
            cos.append(_cosine(gram))
            tr = float(np.trace(gram))
            ratio.append(float(gram.sum() / tr) if tr > 0 else math.nan)
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
        h0_rms=h0_norm / math.sqrt(h0.numel()),
        hN_rms=_rms(hN),
        growth=dist / h0_norm if h0_norm > 0 else math.inf,
        hN_source=source,
    )


def _collect(probe: Probe, inputs: Any, forward: Forward | None, inc_fn, increment, copy: bool):
    """One forward through the probe's visit session, keeping per visit only what is needed.

    At each visit's return: the RMS of the stream it read, its increment (a clone when
    ``copy``, so later in-place edits cannot change it), a clone of the first visit's
    input (``h_0``), and the last visit's input with its version counter (``h_N`` falls
    back to input + increment and must detect an in-place edit of that input).
    """
    probe.sublayers(inputs, forward=forward)  # discovery (once per probe) needs the inputs
    visits, x_rms, incs = [], [], []
    keep: dict[str, Any] = {}

    def leave(v: Visit, args: tuple, kwargs: dict, out: Any) -> None:
        rec = VisitRecord(v, args, kwargs, out)
        x = _stream_in(rec, "increments")
        z = inc_fn(rec)
        _check_increment(rec, x, z, increment, "increments")
        if not visits:
            keep["h0"] = x.detach().clone()
        visits.append(v)
        x_rms.append(torch.linalg.vector_norm(x.detach()) / math.sqrt(x.numel()))
        fresh = increment == "delta"  # out - x is a new tensor nobody else holds
        incs.append(z.detach().clone() if copy and not fresh else z.detach())
        keep["last"] = (x, incs[-1], x._version)

    with torch.no_grad(), probe.session(None, leave, call="increments"):
        out = call_model(probe.model, inputs, forward)
    if not visits:
        raise ValueError("increments: the forward pass made no visit to any sublayer; check inputs")
    return visits, keep["h0"], x_rms, incs, out, keep["last"]


def _hidden(model: nn.Module, inputs: Any) -> Any:
    return model.hidden(*inputs) if isinstance(inputs, tuple) else model.hidden(inputs)


def _module(model: Any, call: str) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{call}: expected an nn.Module or an lp.Probe, got {type(model).__name__}")
    return model


def _increment_fn(increment: str | IncrementFn, call: str) -> IncrementFn:
    if increment == "output":
        return lambda v: v.output
    if increment == "delta":
        return lambda v: v.output - v.args[0] if isinstance(v.output, torch.Tensor) else v.output
    if callable(increment):
        return increment
    raise ValueError(
        f"{call}: increment={increment!r}; use 'output' (the sublayer returns the increment), "
        "'delta' (it returns the updated stream) or a callable record -> Tensor"
    )


_HOW = (
    "point the probe at the residual branch whose output is the increment as added to the "
    "stream, e.g. lp.attach(model, sublayers=['blocks.*.attn', 'blocks.*.mlp']), pass "
    "increment='delta' if the sublayer returns the updated stream x + f(x), or "
    "increment=lambda rec: ... to pick the tensor from rec.args/rec.output"
)


def _stream_in(v: VisitRecord, call: str) -> torch.Tensor:
    x = v.args[0] if v.args else next(iter(v.kwargs.values()), None)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(
            f"{call}: visit r={v.r} of sublayer {v.sublayer!r} (module {v.module!r}) has no "
            f"floating-point tensor input to take as the residual stream; {_HOW}"
        )
    return x


def _check_increment(v: VisitRecord, x: torch.Tensor, z: Any, increment: Any, call: str) -> None:
    if not isinstance(z, torch.Tensor):
        raise ValueError(
            f"{call}: the increment of sublayer {v.sublayer!r} (module {v.module!r}) is a "
            f"{type(z).__name__}, not a tensor (increment={increment!r}); {_HOW}"
        )
    if z.shape != x.shape:
        raise ValueError(
            f"{call}: cannot locate the residual increment of sublayer {v.sublayer!r} "
            f"(module {v.module!r}): its output has shape {tuple(z.shape)} but the stream it "
            f"reads has shape {tuple(x.shape)}, so it is not a residual-shaped branch output; "
            f"{_HOW}"
        )


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


def _cosine(gram: np.ndarray) -> np.ndarray:
    d = np.sqrt(np.clip(np.diag(gram), 0.0, None))
    with np.errstate(divide="ignore", invalid="ignore"):
        c = gram / np.outer(d, d)
    c[np.outer(d, d) == 0] = np.nan
    return c


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
    depth); linear = unscaled correlated increments. Reference: DESIGN.md §3, seed 004.
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
class Growth:
    """A growth sweep: rows per (N, seed), the fitted log-log slope and the named regime.

    ``slope`` is the least-squares slope of ``log growth`` on ``log N`` over every
    finite row (seeds pooled); ``slope_per_seed`` fits each seed alone.
    ``mean_offdiag_cos`` and ``mean_ratio`` are the seed means at the largest N.
    """

    rows: pd.DataFrame
    slope: float
    slope_per_seed: dict
    mean_offdiag_cos: float
    mean_ratio: float
    regime: str
    config: dict = field(default_factory=dict)

    def to_frame(self) -> pd.DataFrame:
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
        }

    def plot(self, **kw: Any) -> Figure:
        hue = "residual" if "residual" in self.rows else None
        style = "tying" if "tying" in self.rows else None
        return plots.increment_growth(self.rows, hue=hue, style=style, **kw)


def growth_sweep(
    make_model: Callable[[int, int], nn.Module],
    make_inputs: Callable[[int], Any],
    Ns: Sequence[int] = (1, 2, 4, 8, 16, 32),
    seeds: Sequence[int] = (0, 1, 2),
    *,
    forward: Forward | None = None,
    increment: str | IncrementFn = "output",
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
    Reference: DESIGN.md §3.
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
    for col in ("growth", "mean_offdiag_cos", "mean_ratio", "hN_rms"):
        if col not in df:
            df[col] = math.nan
    ok = df[~df["diverged"]]
    slope = plots.loglog_slope(ok["N"], ok["growth"])
    per_seed = {int(s): plots.loglog_slope(g["N"], g["growth"]) for s, g in ok.groupby("seed")}
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
    ``h_0`` and the ratio mostly measures the first visit). Reference: DESIGN.md §3.
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
    row = inc.summary()
    bad = [k for k in ("growth", "hN_rms") if not math.isfinite(row[k])]
    row["diverged"] = bool(bad)
    row["error"] = f"non-finite {', '.join(bad)}" if bad else None
    return row


_reference_cell.version = 1
