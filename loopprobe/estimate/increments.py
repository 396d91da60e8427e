"""Forward residual increments per visit: correlation across visits, growth with N, regimes.

A visit's *increment* is what its residual branch adds to the stream, with the model's own
scaling (pre-norm ``h <- h + eps f(Norm(h))``: the increment is ``eps f(Norm(h))``). It is
read from the visit recording of :meth:`loopprobe.Probe.record` (no second hook layer):

- ``increment="output"``: the sublayer's output *is* the increment (the reference
  models' ``blocks[k].attn`` / ``.mlp`` branch modules);
- ``increment="delta"``: the sublayer returns the updated stream (a whole residual block
  ``x + f(x)``, most third-party loop bodies); the increment is ``output - input``;
- ``increment="auto"`` (default): one of these per sublayer, read off every pair of
  consecutive visits of the forward pass (does the next visit read the output, input +
  output, or output + the same tensor each time, an input injection ``z <- f(x + z)``
  whose increment is output + injection - input, the change of the stream between
  reads?); readings that disagree are a ValueError; the result's ``measured`` and
  ``evidence`` say which and why;
- a callable ``increment(record) -> Tensor`` for anything else (``record`` is a
  :class:`loopprobe.VisitRecord` with ``args``, ``kwargs`` and ``output``, the output
  exactly as the module returned it: a ``(hidden, extras)`` tuple stays a tuple); its
  result must have the stream's shape.

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
    g = lp.experiments.reference_growth("tied", "1/sqrt(N)")     # slope ~ 0.5, regime named
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from loopprobe._checks import Trust
from loopprobe._html import HTMLView
from loopprobe._stats import cosine_matrix
from loopprobe.distributed import scope
from loopprobe.record.increments import Collector, IncrementFn, caller_rng, refuse_routing
from loopprobe.record.probe import Probe
from loopprobe.record.types import Forward, Visit, VisitRecord, visit_row

if TYPE_CHECKING:  # plotting is imported on call (.heatmap, .plot): import stays light
    from matplotlib.figure import Figure

__all__ = ["Increments", "increments"]

GROUPINGS = ("auto", "sublayer", "role")
MODES = ("auto", "output", "delta")
GROWTH_RELATIVE = "||h_N - h_0|| / ||h_0||"
GROWTH_ABSOLUTE = "RMS(h_N - h_0) (h_0 = 0, so no relative change)"


# --------------------------------------------------------------------------- result


@dataclass
class Increments(Trust, HTMLView):
    """Increments of one forward pass, grouped for the cross-visit statistics.

    ``visits[i]`` (execution order) belongs to ``groups[group_of[i]]``. ``cos[g]`` is the
    cosine matrix of group g's increments in visit order, ``ratio[g]`` its
    ``||sum inc||^2 / sum ||inc||^2``. ``stream_rms[i]`` is the RMS of the stream after
    visit i (as the next visit reads it; the final state for the last visit).
    ``measured[sublayer]`` is what was taken as its increment (``"output"``,
    ``"output - input"``, ``"output + injection - input"`` or ``"callable"``) and
    ``evidence[sublayer]`` why. ``growth`` is ``growth_measure`` (the relative change, or
    an absolute RMS when ``h_0 = 0``).
    ``converged`` is True when every increment and the growth are finite, no increment is
    zero (its cosines would be undefined) and no pair of consecutive visits contradicts
    what was measured (an explicit ``increment=`` the forward pass refutes; a callable
    whose result the next visit reads as the stream itself); a group with one visit has
    no cross-visit cosine by definition: NaN, not a failure. ``reason`` says what is not
    ("" when converged). A decision taken by size alone is not checked by any reading
    (``evidence`` then quotes the size rule).
    """

    _html_keys = ("growth", "hN_rms", "grouping")

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
                visit_row(v)
                | {
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
            "carried": self.attrs.get("carried", ""),
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
        from loopprobe.plots import stream_plot

        return stream_plot(self.to_frame())


def _converged_line(converged: bool, reason: str) -> str:
    return "converged: yes" if converged else f"converged: NO ({reason})"


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
    per sublayer from every pair of consecutive visits (and the model output): when the
    next visit reads this visit's output, the sublayer returns the state and ``delta`` is
    measured; when it reads input + output, ``output`` is; when it reads output + the same
    tensor c at every visit (an input injection ``z <- f(x + z)``), ``output + c - input``
    is (the change of the stream between reads; ``h_N`` is then the last output + c, not
    the loop's returned ``z``). A reading two of these explain alike is no evidence (a
    zero input; a first visit whose input is the injection itself, as from a zero state);
    readings that disagree (including a next visit that reads none of these) are a
    ValueError asking for the choice. Without readings, by size: ``||output - input|| <=
    ||input|| / 2`` at every visit is a state, ``||output|| <= ||input|| / 2`` an
    increment; anything else is a ValueError. An explicit choice that the readings
    contradict is measured as asked but makes the result ``converged=False`` with the
    reason. ``measured`` and ``evidence`` record, per sublayer, what was measured and why.

    A callable gets a :class:`loopprobe.VisitRecord` whose ``output`` is what the module
    returned (a ``(hidden, extras)`` tuple stays a tuple: ``rec.output[0] - rec.args[0]``);
    a result not shaped like the stream is a ValueError naming both shapes, and a result
    that the next visit reads as the stream itself (the updated state, not what was
    added) makes the result ``converged=False``.

    Nothing but the increments (cloned unless ``copy=False``, which is faster but only
    right for models that do not edit a branch output in place after it returns), the
    first input and per-visit stream norms is kept: one visit session of the probe, no
    full recording (``"auto"`` also keeps each visit's input until the end of the pass,
    since the decision rests on all its visits). The caller's RNG state is restored
    afterwards (dropout in training mode draws from a fork). Reference: docs/definitions.md §3.
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
    # under an input injection the loop's output is its carried state z_N, not the stream
    # the visits read (x + z_N): h_N is rebuilt from the last visit like every increment
    injected = visits[-1].sublayer in col.injected
    if col.final is not None:  # the stream the loop carries: h_N is its last value
        hN, source = col.final
    elif isinstance(out, torch.Tensor) and out.shape == h0.shape and not injected:
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
        if injected:
            source += " (output + injection)"
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
        attrs={
            **col.attrs,
            **({} if probe.ranks is None else {"scope": scope(probe.ranks, per_rank=True)}),
        },
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
