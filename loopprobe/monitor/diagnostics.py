"""The monitor's diagnostics: one function per name, each a direct call of a public estimator.

Each ``_run_<name>(monitor, ctx)`` appends its numbers to ``ctx.rows`` (one row per number,
the columns of :data:`loopprobe.monitor.sinks.COLUMNS`); ``kappa`` runs first so that its
report feeds ``updates``, ``sensitivity`` and ``bound`` of the same step. The options and
schedule parsing shared with :class:`loopprobe.Monitor` are here too.

Reference: seed 002, Eq. 11-14 (G, U, kappa, C); docs/definitions.md §3-4 (increments, rho).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from loopprobe.differentiate.roundmap import round_map
from loopprobe.estimate.alignment import AlignmentReport, visit_alignment
from loopprobe.estimate.bound import bound_check
from loopprobe.estimate.fixedpoint import spectral_radius
from loopprobe.estimate.increments import increments
from loopprobe.estimate.sensitivity import Sensitivity, sensitivity_norms
from loopprobe.estimate.updates import Updates, per_visit_updates

#: The diagnostics below take the running :class:`loopprobe.Monitor` as ``mon`` (typed ``Any``:
#: this module sits under ``monitor.py``, which imports it, and imports nothing back).
Monitor = Any

DIAGNOSTICS = ("updates", "increments", "kappa", "sensitivity", "rho", "bound")
CALL = "Monitor"
KAPPA_TOL = 1e-2  # the monitor's default bound on kappa's error (options={"kappa": {"tol": ...}})


def dense_early(until: int = 100, early_every: int = 10, late_every: int = 100) -> Callable:
    """A schedule: every ``early_every`` steps before ``until``, every ``late_every`` after.

    Example: ``Monitor(..., schedule=dense_early(200, 10, 100))`` watches steps 0, 10, ...,
    190, 200, 300, ... (the early phase, where alignment changes fastest, in detail).
    """
    for name, v in (("until", until), ("early_every", early_every), ("late_every", late_every)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "until" else 1):
            raise ValueError(f"dense_early: {name}={v!r}; pass a positive integer")

    def due(step: int) -> bool:
        return step % (early_every if step < until else late_every) == 0

    return due


@dataclass
class _Context:
    """What one scheduled step's diagnostics share (the kappa report feeds the others)."""

    step: int
    report: AlignmentReport | None = None
    rows: list[dict] = field(default_factory=list)

    def add(self, quantity, value, sublayer=None, visit=None, converged=None, reason=None):
        ok = None if converged is None else bool(converged)
        why = (reason or None) if ok is False else None  # the estimator's why, if it failed
        row = dict(sublayer=sublayer, visit=visit, quantity=quantity, converged=ok)
        self.rows.append({"step": self.step, **row, "value": float(value), "reason": why})

    def failed(self, name: str, err: Exception) -> None:
        """The row a diagnostic that raised leaves: NaN, not converged, the error as reason."""
        row = dict(sublayer=None, visit=None, quantity=f"{name}_failed", converged=False)
        why = f"{type(err).__name__}: {err}"
        self.rows.append({"step": self.step, **row, "value": math.nan, "reason": why})


# ------------------------------------------------------------------------ diagnostics


def _run_kappa(mon: Monitor, ctx: _Context) -> None:
    # a diagnostic during training needs kappa to 1e-2, not to the last digit; each U starts
    # from its top vector of the monitor's last kappa (options={"kappa": {"start": None}}:
    # cold), which moves little once training settles (benchmarks/bench_kappa_warm.py)
    kw = {"tol": KAPPA_TOL, "start": mon._kappa_start}
    kw.update(mon._kw("kappa", "forward", "output", "seed"))
    rep = visit_alignment(mon.probe, mon.inputs, mon.loss_fn, update=mon.update, **kw)
    sens = rep.sensitivity  # its top vectors kept in host memory, off the training device
    vectors = None if sens.vectors is None else sens.vectors.detach().cpu()
    mon._kappa_start = replace(sens, vectors=vectors, UTw={})
    ctx.report = rep
    ctx.add("kappa_R", rep.kappa, converged=rep.converged, reason=rep.reason)
    ctx.add("kappa_bar", rep.kappa_bar, converged=rep.converged, reason=rep.reason)
    ctx.add("kappa_err", rep.kappa_err, converged=rep.converged, reason=rep.reason)
    for row in rep.sublayers.itertuples():
        ok = bool(row.kappa_ok) and _is_true(getattr(row, "converged", True))
        ctx.add("kappa", row.kappa, sublayer=row.sublayer, converged=ok, reason=rep.reason)
    _update_rows(ctx, rep.updates)
    _sensitivity_rows(ctx, rep.sensitivity)


def _run_updates(mon: Monitor, ctx: _Context) -> None:
    if ctx.report is None:
        kw = mon._kw("updates", "forward", "seed")
        ups = per_visit_updates(mon.probe, mon.inputs, mon.loss_fn, update=mon.update, **kw)
        _update_rows(ctx, ups)


def _run_sensitivity(mon: Monitor, ctx: _Context) -> None:
    if ctx.report is None:
        kw = mon._kw("sensitivity", "forward", "output", "seed")
        _sensitivity_rows(ctx, sensitivity_norms(mon.probe, mon.inputs, **kw))


def _update_rows(ctx: _Context, ups: Updates | None) -> None:
    assert ups is not None
    ctx.add("probe_loss", ups.loss)
    for j, name in enumerate(ups.sublayers):
        norms, visible = ups.norms(j), ups.visible[j]
        for r in range(len(norms)):
            ctx.add("G_norm", norms[r], sublayer=name, visit=r)
        ctx.add("G_tied", ups.tied(j).norm(), sublayer=name)
        if ups.G is None or int(visible.sum()) < 2:
            continue  # memory="low" keeps no per-visit G; one visit has no neighbour
        cos = ups.cosine(j)  # over the gradient-visible visits, in visit order
        rs = [r for r in range(len(norms)) if bool(visible[r])]
        for k in range(1, len(rs)):
            ctx.add("cos_G_prev", cos[k - 1, k], sublayer=name, visit=rs[k])
        ctx.add("cos_G_adjacent", cos.diagonal(1).mean(), sublayer=name)


def _sensitivity_rows(ctx: _Context, sens: Sensitivity | None) -> None:
    assert sens is not None
    for v, est in zip(sens.visits, sens.visit_norms, strict=True):
        ctx.add("U_norm", est.value, sublayer=v.sublayer, visit=v.r, converged=est.converged)
    for j, est in sens.tied_norms.items():
        ctx.add("U_tied", est.value, sublayer=sens.sublayers[j], converged=est.converged)


def _run_increments(mon: Monitor, ctx: _Context) -> None:
    kw = {**getattr(mon, "_pinned_increment", {}), **mon._kw("increments", "forward")}
    inc = increments(mon.probe, mon.inputs, **kw)
    if "increment" not in kw and any("by size only" in e for e in inc.evidence.values()):
        # a decision by size can flip as the model trains: keep the first one, so every step
        # measures the same thing (a later contradiction is converged=False with the reason)
        mode = {"output": "output", "output - input": "delta"}.get(inc.increment)
        mon._pinned_increment = {"increment": mode} if mode else {}
    ok, why = inc.converged, inc.reason
    for k, v in enumerate(inc.visits):
        ctx.add("inc_rms", inc.inc_rms[k], v.sublayer, v.r, converged=ok, reason=why)
    for g in inc.group_frame().itertuples():
        ctx.add("inc_ratio", g.ratio, sublayer=g.group, converged=ok, reason=why)
        ctx.add("inc_cos", g.mean_offdiag_cos, sublayer=g.group, converged=ok, reason=why)
    ctx.add("growth", inc.growth, converged=ok, reason=why)


def _run_rho(mon: Monitor, ctx: _Context) -> None:
    opts = dict(mon.options["rho"])
    build = opts.pop("round", None)
    at = opts.pop("at", "final")
    rm = build(mon.model, mon.inputs) if build is not None else round_map(mon.model, mon.inputs)
    h = _round_state(rm, at)
    sr = spectral_radius(rm.T, h, **{"k": 2, **opts})
    ctx.add("rho", sr.value, converged=sr.converged, reason=sr.reason)


def _round_state(rm: Any, at: str) -> torch.Tensor:
    """The state rho is taken at: after the model's own rounds (``final``) or at ``h0``."""
    if at == "h0":
        return rm.h0
    if at != "final":
        raise ValueError(f"{CALL}: options['rho']['at']={at!r}; choose 'final' or 'h0'")
    if rm.rounds is None:
        raise ValueError(
            f"{CALL}: the round map does not say how many rounds the model runs; pass "
            "options={'rho': {'at': 'h0'}} or a round map with rounds set"
        )
    h = rm.h0
    with torch.no_grad():
        for _ in range(rm.rounds):
            h = rm.T(h)
    return h


def _run_bound(mon: Monitor, ctx: _Context) -> None:
    kw = {"optimizer": mon.update, **mon._kw("bound", "forward", "output", "seed")}
    bc = bound_check(mon.probe, mon.inputs, mon.loss_fn, report=ctx.report, **kw)
    for name in ("C", "C_first", "dF_true", "dF_first", "prediction"):
        ctx.add(name, getattr(bc, name), converged=bc.converged, reason=bc.reason)


# kappa first: its report feeds "updates", "sensitivity" and "bound" of the same step.
_RUN = {
    "kappa": _run_kappa,
    "updates": _run_updates,
    "sensitivity": _run_sensitivity,
    "increments": _run_increments,
    "rho": _run_rho,
    "bound": _run_bound,
}


def _is_true(x: Any) -> bool:
    """A converged flag from a frame cell (NaN/None where a sublayer has no estimate)."""
    return x is not None and not (isinstance(x, float) and math.isnan(x)) and bool(x)


def _diagnostics(diagnostics: Any, custom: Mapping[str, Callable] | None = None) -> dict[str, int]:
    """Names in run order (kappa first, the user's ``custom`` ones last), each with its
    every-n-th-scheduled-step multiplier (a custom one not named in ``diagnostics``: 1)."""
    custom = _custom(custom)
    if isinstance(diagnostics, str):
        raise TypeError(
            f"{CALL}: diagnostics={diagnostics!r} is one string; pass a list, e.g. "
            f"diagnostics=[{diagnostics!r}]"
        )
    if isinstance(diagnostics, Mapping):
        every = dict(diagnostics)
    elif isinstance(diagnostics, Iterable):
        every = dict.fromkeys(diagnostics, 1)
    else:
        raise TypeError(f"{CALL}: diagnostics must be a list of names or a {{name: n}} mapping")
    every = {**every, **{c: 1 for c in custom if c not in every}}
    unknown = [d for d in every if d not in DIAGNOSTICS and d not in custom]
    if unknown or not every:
        raise ValueError(
            f"{CALL}: diagnostics={list(every)}; choose one or more of {list(DIAGNOSTICS)}"
            + (", or define your own with custom={name: fn}" if unknown else "")
        )
    for name, n in every.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{CALL}: diagnostics[{name!r}]={n!r}; pass an integer n >= 1")
    return {d: every[d] for d in [*_RUN, *custom] if d in every}


def _custom(custom: Any) -> dict[str, Callable]:
    if custom is None:
        return {}
    if not isinstance(custom, Mapping):
        raise TypeError(f"{CALL}: custom must be a {{name: fn}} mapping, got {type(custom)}")
    for name, fn in custom.items():
        if not isinstance(name, str) or not name or name in DIAGNOSTICS or "/" in name:
            raise ValueError(
                f"{CALL}: custom diagnostic name {name!r}; pass a new name (not one of "
                f"{list(DIAGNOSTICS)}, no '/')"
            )
        if not callable(fn):
            raise TypeError(f"{CALL}: custom[{name!r}] must be callable (model, inputs) -> value")
    return dict(custom)


def run_custom(fn: Callable, name: str, mon: Monitor, ctx: _Context) -> None:
    """A user's diagnostic: ``fn(model, inputs)`` gives a number (one model-level row
    ``quantity=name``) or a ``{sublayer: number}`` mapping (one row per sublayer)."""
    value = fn(mon.model, mon.inputs)
    if isinstance(value, Mapping):
        for sublayer, v in value.items():
            ctx.add(name, _number(name, v), sublayer=str(sublayer))
    else:
        ctx.add(name, _number(name, value))


def _number(name: str, v: Any) -> float:
    if torch.is_tensor(v) and v.numel() == 1:
        v = v.detach().item()
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise TypeError(
            f"custom diagnostic {name!r} returned {type(v).__name__}; return a number, a "
            "one-element tensor, or a {sublayer: number} mapping"
        )
    return float(v)


def _options(options: Any, diagnostics: dict[str, int]) -> dict[str, dict]:
    options = dict(options or {})
    unknown = [k for k in options if k not in DIAGNOSTICS]
    if unknown:
        raise ValueError(f"{CALL}: options for {unknown}; keys are diagnostics {list(DIAGNOSTICS)}")
    for name, kw in options.items():
        if not isinstance(kw, Mapping):
            raise TypeError(f"{CALL}: options[{name!r}] must be a dict of keyword arguments")
    return {d: dict(options.get(d, {})) for d in DIAGNOSTICS}


def _schedule(every: Any, schedule: Any) -> Callable[[int], bool]:
    if every is not None and schedule is not None:
        raise ValueError(f"{CALL}: pass every= or schedule=, not both")
    if schedule is None:
        every = 50 if every is None else every
        if isinstance(every, bool) or not isinstance(every, int):
            raise TypeError(f"{CALL}: every must be an integer >= 1, got {every!r}")
        if every < 1:
            raise ValueError(f"{CALL}: every={every}; pass an integer >= 1 (1: every step)")
        return lambda step: step % every == 0
    if callable(schedule):
        return schedule
    if isinstance(schedule, Iterable) and not isinstance(schedule, str | bytes):
        steps = set(schedule)
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in steps):
            raise TypeError(f"{CALL}: schedule must hold integer steps, got {list(steps)[:5]}")
        return steps.__contains__
    raise TypeError(
        f"{CALL}: schedule must be a callable step -> bool or an iterable of steps, "
        f"got {type(schedule).__name__}; e.g. schedule=lp.monitor.dense_early(100, 10, 100)"
    )
