"""Watch a looped model while it trains: per-visit diagnostics on a held-out probe batch.

:class:`Monitor` is created once with the model and a probe batch, and called from the
training loop after ``optimizer.step()``::

    mon = lp.Monitor(model, probe_idx, loss_fn, every=50, sinks=[TensorBoardSink("runs/x")])
    for step, (idx, tgt) in enumerate(batches):
        ...; optimizer.step()
        mon.step(step, loss=loss.item())

On a scheduled step it runs the chosen diagnostics (each a direct call of the public
estimator, on the probe batch) and appends their numbers to :attr:`Monitor.frame`, a long
frame with columns ``step, sublayer, visit, quantity, value, converged`` (``sublayer`` is
missing for model-level numbers, ``visit`` for sublayer- and model-level ones: ``.isna()``;
``converged`` is <NA> where a number has no convergence test, e.g. G norms and the loss).
Nothing the training uses changes: parameters, ``.grad``, buffers, train/eval modes, the
optimizer state and torch's global RNG are the same afterwards, also when a diagnostic
raises (the estimators guarantee it; :func:`_untouched` adds a guard around all of them).

Diagnostics (names for ``diagnostics=``), cheapest first; the default is the cheap pair:

- ``"updates"``: per-visit ``||G_r||`` (:func:`loopprobe.per_visit_updates`, one backward),
  ``G_tied = ||sum_r G_r||``, consecutive-visit cosine ``cos_G_prev`` per visit and its
  mean ``cos_G_adjacent`` per sublayer, and ``probe_loss``;
- ``"increments"``: per-visit increment RMS, per-group ``inc_ratio`` and mean off-diagonal
  cosine ``inc_cos``, and the stream's ``growth`` (:func:`loopprobe.increments`, no backward);
- ``"kappa"``: ``kappa_R``, ``kappa_bar`` and ``kappa`` per sublayer
  (:func:`loopprobe.visit_alignment`; Krylov on JVP/VJP: hundreds of training steps' worth
  of compute); it also yields every ``"updates"`` and ``"sensitivity"`` number, from the
  same report;
- ``"sensitivity"``: per-visit ``||U_r||`` and ``U_tied`` (:func:`loopprobe.sensitivity_norms`);
- ``"rho"``: spectral radius of one round at the state after the model's own rounds
  (:func:`loopprobe.spectral_radius`); reference models out of the box, others with
  ``options={"rho": {"round": lambda model, inputs: lp.replay_round(model, inputs, "layer")}}``;
- ``"bound"``: ``C``, ``C_first``, ``dF_true``, ``dF_first``, ``prediction`` of
  :func:`loopprobe.bound_check` (reuses the step's kappa report when there is one).

Safe to leave on: a diagnostic that raises (increments a model's layout leaves undecided, a
loss that cannot be taken) becomes one row ``quantity="<name>_failed"`` with value NaN,
``converged=False`` and the error in ``reason``, plus one warning per diagnostic; the
training loop never sees the exception unless ``strict=True``. ``budget=`` caps the share of
wall time the monitor takes (see :class:`Monitor`). ``state_dict``/``load_state_dict``
carry the frame and the schedule's phase across a resumed run.

Reference: seed 002, Eq. 11-14 (G, U, kappa, C); docs/definitions.md §3-4 (increments, rho).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
from torch import nn

from loopprobe.differentiate.roundmap import round_map
from loopprobe.estimate.alignment import AlignmentReport, visit_alignment
from loopprobe.estimate.bound import bound_check
from loopprobe.estimate.fixedpoint import spectral_radius
from loopprobe.estimate.increments import increments
from loopprobe.estimate.sensitivity import Sensitivity, sensitivity_norms
from loopprobe.estimate.updates import Updates, per_visit_updates
from loopprobe.monitor.sinks import (
    COLUMNS,
    CallableSink,
    FileSink,
    Sink,
    TensorBoardSink,
    as_sink,
    typed_frame,
)
from loopprobe.record.probe import Probe
from loopprobe.record.session import restored as _restored

__all__ = [
    "COLUMNS",
    "DIAGNOSTICS",
    "CallableSink",
    "FileSink",
    "Monitor",
    "TensorBoardSink",
    "dense_early",
]

DIAGNOSTICS = ("updates", "increments", "kappa", "sensitivity", "rho", "bound")
CALL = "Monitor"
KAPPA_TOL = 1e-2  # the monitor's default bound on kappa's error (options={"kappa": {"tol": ...}})
_clock = time.perf_counter  # the budget's clock (module level, so a test can replace it)


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


class Monitor:
    """Per-visit diagnostics of ``model`` on the probe batch ``inputs``, on a schedule.

    ``inputs``: a tensor, a tuple of positional arguments, or a mapping such as a Hugging
    Face ``BatchEncoding`` (called as ``model(**inputs)``). ``loss_fn(output, inputs)`` is
    the training loss on the probe batch (used by ``updates``, ``kappa`` and ``bound``);
    ``None`` (default): the scalar ``.loss`` the model returns itself (a Hugging Face model
    given ``labels``). ``forward``/``output`` as in :func:`loopprobe.visit_alignment`.
    ``diagnostics``: names from the module docstring, or a mapping ``{name: n}`` that runs
    ``name`` on every n-th scheduled step (e.g. ``{"updates": 1, "kappa": 10}``). When to
    run: ``every=k`` (steps divisible by k), or ``schedule=`` a callable ``step -> bool`` or
    an iterable of steps (see :func:`dense_early`). ``budget``: the largest share of wall
    time (since the first :meth:`step` call) the monitor may take, e.g. ``0.05``; a
    scheduled step whose turn comes while the monitor's time so far exceeds ``budget`` times
    the time elapsed is skipped (listed in :attr:`skipped`), so the share stays within
    ``budget`` plus one call's cost over the elapsed time. ``sinks``: objects with
    ``write(step, rows)`` (see :mod:`loopprobe.monitor.sinks`) or plain callables taking a
    flat metrics dict (``wandb.log``). ``update``: what G is (``"sgd"``, ``"adam"``,
    ``"adamw"`` or the training optimizer, whose state is read, never written).
    ``options``: keyword arguments per diagnostic, passed to its estimator
    (``{"kappa": {"max_iter": 50}}``). ``seed``: torch's RNG seed inside every estimate (the
    training RNG is never advanced). The model is probed in the mode it is in: in training
    mode dropout is on, with the same masks (from ``seed``) for every estimate of a step.
    ``strict``: ``False`` (default) turns a diagnostic that raises into a ``<name>_failed``
    row (NaN, ``converged=False``, the error in ``reason``; the error also in
    :attr:`errors`) and warns once per diagnostic, while the step's other diagnostics run;
    ``True`` raises. ``on_error``: the former spelling (``"raise"``: strict, ``"warn"``).
    """

    def __init__(
        self,
        model: nn.Module,
        inputs: Any,
        loss_fn: Callable | None = None,
        *,
        forward: Callable | None = None,
        output: Callable | None = None,
        diagnostics: Sequence[str] | Mapping[str, int] = ("updates", "increments"),
        every: int | None = None,
        schedule: Callable[[int], bool] | Iterable[int] | None = None,
        budget: float | None = None,
        sinks: Sequence[Any] = (),
        update: Any = "sgd",
        options: Mapping[str, Mapping[str, Any]] | None = None,
        sublayers: Sequence[str] | None = None,
        seed: int = 0,
        strict: bool | None = None,
        on_error: str | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"{CALL}: model must be an nn.Module, got {type(model).__name__}")
        self.model, self.inputs, self.loss_fn = model, inputs, loss_fn
        self.forward, self.output, self.update, self.seed = forward, output, update, seed
        self.diagnostics = _diagnostics(diagnostics)
        self.options = _options(options, self.diagnostics)
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(
                f"{CALL}: loss_fn must be callable (output, inputs) -> scalar, or None for "
                "the .loss the model returns itself"
            )
        if "rho" in self.diagnostics and "round" not in self.options["rho"]:
            if not all(callable(getattr(model, a, None)) for a in ("step", "embed")):
                raise ValueError(
                    f"{CALL}: diagnostics include 'rho' but {type(model).__name__} has no "
                    "step/embed round map; pass options={'rho': {'round': lambda model, inputs: "
                    "lp.replay_round(model, inputs, '<module holding one round>')}}"
                )
        self.strict = _strict(strict, on_error)
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, int | float) or not 0 < budget <= 1
        ):
            raise ValueError(
                f"{CALL}: budget={budget!r}; pass the largest share of wall time the monitor "
                "may take, a number in (0, 1] (0.05: five percent), or None for no cap"
            )
        self.budget = budget
        self._due = _schedule(every, schedule)
        self.sinks: list[Sink] = [as_sink(s, CALL) for s in sinks]
        self.probe = Probe(model, sublayers)
        self.errors: list[tuple[int, str, BaseException]] = []
        self.skipped: list[int] = []  # scheduled steps left out to keep within the budget
        self._runs = 0  # scheduled steps so far (for the per-diagnostic multipliers)
        self._warned: set[str] = set()  # diagnostics whose failure was already warned about
        self._start: float | None = None  # the budget's clock: first step() call, time spent
        self._spent = 0.0
        self._frames: list[pd.DataFrame] = []
        self._frame: pd.DataFrame | None = None

    # -- the loop's call ---------------------------------------------------------
    def due(self, step: int) -> bool:
        """Whether ``step`` is scheduled."""
        return bool(self._due(step))

    def step(self, step: int, loss: float | torch.Tensor | None = None) -> pd.DataFrame | None:
        """Run the scheduled diagnostics after the optimizer step ``step``; their rows, or None.

        ``loss``: the training loss of this step, recorded as quantity ``"loss"``.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise TypeError(f"{CALL}.step: step must be an integer >= 0, got {step!r}")
        now = _clock()
        if self._start is None:
            self._start = now
        if not self.due(step):
            return None
        if self.budget is not None and self._spent > self.budget * (now - self._start):
            self.skipped.append(step)
            return None
        ctx = _Context(step)
        if loss is not None:
            if torch.is_tensor(loss) and loss.numel() == 1:
                loss = loss.detach().item()
            if isinstance(loss, bool) or not isinstance(loss, int | float):
                raise TypeError(
                    f"{CALL}.step: loss must be a number or a one-element tensor, got {loss!r}; "
                    "pass loss=loss.item() or leave it out"
                )
            ctx.add("loss", loss)
        with _untouched(self.model):
            for name, every in self.diagnostics.items():
                if self._runs % every == 0:
                    self._run(name, ctx)
        self._runs += 1
        rows = typed_frame(ctx.rows)
        self._frames.append(rows)
        self._frame = None
        for sink in self.sinks:
            sink.write(step, rows)
        self._spent += _clock() - now
        return rows

    def _run(self, name: str, ctx: _Context) -> None:
        """One diagnostic; unless strict, its failure becomes a row (and a first warning)."""
        kept = len(ctx.rows)
        try:
            _RUN[name](self, ctx)
        except Exception as err:
            if self.strict:
                raise
            del ctx.rows[kept:]  # no half of a diagnostic's numbers
            self.errors.append((ctx.step, name, err))
            ctx.failed(name, err)
            if name not in self._warned:
                self._warned.add(name)
                warnings.warn(
                    f"{CALL}.step: diagnostic {name!r} failed at step {ctx.step}: {err}. The "
                    f"training goes on; this and later failures of {name!r} are rows "
                    f"quantity={name + '_failed'!r}, converged=False with the error as reason "
                    "(no further warning); pass strict=True to raise instead",
                    RuntimeWarning,
                    stacklevel=3,
                )

    @property
    def frame(self) -> pd.DataFrame:
        """Every recorded number so far, one row each (columns :data:`COLUMNS`)."""
        if self._frame is None:
            self._frame = (
                pd.concat(self._frames, ignore_index=True) if self._frames else typed_frame([])
            )
        return self._frame

    def state_dict(self) -> dict:
        """What a resumed run needs to continue this one: the frame's rows and the schedule's
        phase (scheduled runs so far, for ``{name: n}`` multipliers) and an increment decision
        made by size alone (kept for the whole run, also across a resume), as plain Python values
        (JSON- and ``torch.save``-able); the trainer callbacks save it in their checkpoints."""
        rows = [{k: _plain(v) for k, v in r.items()} for r in self.frame.to_dict("records")]
        pinned = dict(getattr(self, "_pinned_increment", None) or {})
        return {"runs": self._runs, "rows": rows, "skipped": list(self.skipped),
                "pinned_increment": pinned}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` of a monitor of the run being resumed."""
        if not isinstance(state, Mapping) or not {"runs", "rows"} <= set(state):
            raise ValueError(
                f"{CALL}.load_state_dict: expected the dict Monitor.state_dict() returns "
                f"(keys 'runs', 'rows'), got {type(state).__name__} "
                f"{sorted(state) if isinstance(state, Mapping) else ''}"
            )
        self._runs = int(state["runs"])
        self.skipped = [int(s) for s in state.get("skipped", [])]
        self._frames = [typed_frame(list(state["rows"]))] if state["rows"] else []
        self._frame = None
        if state.get("pinned_increment"):  # the first decision by size, kept across a resume
            self._pinned_increment = dict(state["pinned_increment"])

    def close(self) -> None:
        """Close the sinks (flush TensorBoard event files, finish CSV/Parquet files)."""
        for sink in self.sinks:
            sink.close()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _kw(self, name: str, *keys: str) -> dict:
        common = {"forward": self.forward, "output": self.output, "seed": self.seed}
        return {**{k: common[k] for k in keys}, **self.options.get(name, {})}


# ------------------------------------------------------------------------ diagnostics


def _run_kappa(mon: Monitor, ctx: _Context) -> None:
    # a diagnostic during training needs kappa to 1e-2, not to the last digit (issue 29)
    kw = {"tol": KAPPA_TOL, **mon._kw("kappa", "forward", "output", "seed")}
    rep = visit_alignment(mon.probe, mon.inputs, mon.loss_fn, update=mon.update, **kw)
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
    kw = mon._kw("bound", "forward", "output", "seed")
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


# ---------------------------------------------------------------------------- helpers


@contextmanager
def _untouched(model: nn.Module) -> Iterator[None]:
    """Torch's RNG (CPU and the model's CUDA devices), modes, buffers and ``.grad`` as before.

    A guard around the estimators (which already leave all of it alone), so a diagnostic
    that fails half-way, or a user ``loss_fn`` that draws random numbers, cannot leak.
    """
    grads = [(p, p.grad) for p in model.parameters()]
    cuda = sorted({p.device.index or 0 for p, _ in grads if p.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=cuda), _restored(model), torch.enable_grad():
            yield
    finally:
        for p, g in grads:
            if p.grad is not g:
                p.grad = g


def _plain(x: Any) -> Any:
    """A frame cell as a plain Python value: None for missing, int/float/bool/str else."""
    if x is None or x is pd.NA:
        return None
    return x.item() if hasattr(x, "item") else x


def _strict(strict: Any, on_error: Any) -> bool:
    if on_error is not None and on_error not in ("raise", "warn"):
        raise ValueError(f"{CALL}: on_error={on_error!r}; choose 'raise' or 'warn' (or strict=)")
    if strict is not None and not isinstance(strict, bool):
        raise TypeError(f"{CALL}: strict must be True or False, got {strict!r}")
    if strict is not None and on_error is not None and strict != (on_error == "raise"):
        raise ValueError(
            f"{CALL}: strict={strict} and on_error={on_error!r} disagree; pass strict="
        )
    return strict if strict is not None else on_error == "raise"


def _is_true(x: Any) -> bool:
    """A converged flag from a frame cell (NaN/None where a sublayer has no estimate)."""
    return x is not None and not (isinstance(x, float) and math.isnan(x)) and bool(x)


def _diagnostics(diagnostics: Any) -> dict[str, int]:
    """Names in run order (kappa first), each with its every-n-th-scheduled-step multiplier."""
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
    unknown = [d for d in every if d not in DIAGNOSTICS]
    if unknown or not every:
        raise ValueError(
            f"{CALL}: diagnostics={list(every)}; choose one or more of {list(DIAGNOSTICS)}"
        )
    for name, n in every.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{CALL}: diagnostics[{name!r}]={n!r}; pass an integer n >= 1")
    return {d: every[d] for d in _RUN if d in every}


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
