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
  (:func:`loopprobe.spectral_radius`), the round in eval mode (BatchNorm with its running
  statistics, as :func:`loopprobe.replay_round` builds it, whatever the training mode);
  reference models out of the box, others with
  ``options={"rho": {"round": lambda model, inputs: lp.replay_round(model, inputs, "layer")}}``;
- ``"bound"``: ``C``, ``C_first``, ``dF_true``, ``dF_first``, ``prediction`` of
  :func:`loopprobe.bound_check` (reuses the step's kappa report when there is one), judging
  the step of ``update``: pass the training optimizer and an Adam/AdamW step is judged with
  the Adam form of the bound, its real moments read on a copy.

Safe to leave on: a diagnostic that raises (increments a model's layout leaves undecided, a
loss that cannot be taken) becomes one row ``quantity="<name>_failed"`` with value NaN,
``converged=False`` and the error in ``reason``, plus one warning per diagnostic; a sink
that raises (a package it needs is missing, a full disk) likewise becomes a row
``quantity="<SinkClass>_failed"`` (``"TensorBoardSink_failed"``) and one warning per sink; the
training loop never sees the exception unless ``strict=True``. ``budget=`` caps the share of
wall time the monitor takes (see :class:`Monitor`). ``state_dict``/``load_state_dict``
carry the frame and the schedule's phase across a resumed run.

Reference: seed 002, Eq. 11-14 (G, U, kappa, C); docs/definitions.md §3-4 (increments, rho).
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import pandas as pd
import torch
from torch import nn

from loopprobe.monitor.diagnostics import (
    _RUN,
    CALL,
    DIAGNOSTICS,
    KAPPA_TOL,
    _Context,
    _custom,
    _diagnostics,
    _options,
    _schedule,
    dense_early,
    run_custom,
)
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
    "KAPPA_TOL",
    "Monitor",
    "TensorBoardSink",
    "dense_early",
]

_clock = time.perf_counter  # the budget's clock (module level, so a test can replace it)
logger = logging.getLogger("loopprobe.monitor")


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
    a sink's failure likewise (``<SinkClass>_failed``, one warning per sink); ``True``
    raises. ``on_error``: the former spelling (``"raise"``: strict, ``"warn"``).
    ``custom``: your own diagnostics, ``{name: fn}`` with ``fn(model, inputs)`` returning a
    number (a row ``quantity=name``) or ``{sublayer: number}``; they run after the built-in
    ones on every scheduled step, or every n-th with ``diagnostics={..., name: n}``, under
    the same guards (the training state untouched, a failure a ``<name>_failed`` row).
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
        custom: Mapping[str, Callable] | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"{CALL}: model must be an nn.Module, got {type(model).__name__}")
        self.model, self.inputs, self.loss_fn = model, inputs, loss_fn
        self.forward, self.output, self.update, self.seed = forward, output, update, seed
        self.custom = _custom(custom)
        self.diagnostics = _diagnostics(diagnostics, self.custom)
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
        self._kappa_start: Any = None  # the last kappa's U: the next one's start vectors
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
            if not self.skipped:  # a notice, once: the steps it leaves out are in .skipped
                logger.info(
                    "%s: step %d skipped to keep within budget=%g (%.3g s of %.3g s so far); "
                    "later skips are listed in .skipped", CALL, step, self.budget, self._spent,
                    now - self._start,
                )  # fmt: skip
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
        failed = [row for sink in self.sinks for row in self._write(sink, step, rows)]
        if failed:  # in the frame and the returned rows; the sinks get the step as it was
            rows = typed_frame(ctx.rows + failed)
        self._frames.append(rows)
        self._frame = None
        self._spent += _clock() - now
        return rows

    def _write(self, sink: Sink, step: int, rows: pd.DataFrame) -> list[dict]:
        """``sink.write``; unless strict, its failure is a ``<Sink>_failed`` row and one warning.

        A sink never stops the training: a missing package, a full disk or a closed writer
        costs that sink's numbers, not the run (the other sinks and the frame still get them).
        """
        try:
            sink.write(step, rows)
            return []
        except Exception as err:
            if self.strict:
                raise
            name = f"{type(sink).__name__}_failed"
            self.errors.append((step, name, err))
            if name not in self._warned:
                self._warned.add(name)
                warnings.warn(
                    f"{CALL}.step: sink {type(sink).__name__} failed at step {step}: "
                    f"{type(err).__name__}: {err}. The training goes on; this and later "
                    f"failures of the sink are rows quantity={name!r}, converged=False with "
                    "the error as reason (no further warning); pass strict=True to raise instead",
                    RuntimeWarning,
                    stacklevel=4,
                )
            why = f"{type(err).__name__}: {err}"
            return [dict(step=step, sublayer=None, visit=None, quantity=name,
                         value=float("nan"), converged=False, reason=why)]  # fmt: skip

    def _run(self, name: str, ctx: _Context) -> None:
        """One diagnostic; unless strict, its failure becomes a row (and a first warning)."""
        kept = len(ctx.rows)
        try:
            if name in self.custom:
                run_custom(self.custom[name], name, self, ctx)
            else:
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
