"""The health check: one screen of verdicts for any looped model, from the estimators.

:func:`health` runs ``visit_alignment`` (κ_j, κ_R, per-visit G), ``increments`` and, when the
round map is known, ``fixed_point`` and ``spectral_radius`` on one model and batch, and judges
each reading against a stated threshold. Each check is a row of ``Health.frame``: its
*reading* for training the model (``fine`` / ``risk`` / ``cannot tell``, with ``advice``: what
to change, or what would tell), the theory's claim or premise as context (``verdict``:
``holds`` / ``does not hold`` / ``cannot tell``), measured, predicted, threshold, why, and
its *kind*: a ``measurement`` (this model at this R) or an ``inference`` (an extrapolation in
R, under the theory's assumptions). A line decides only when the value's uncertainty (a
certified interval, or the spread of the cosines it averages) lies on one side of its
threshold. A check that cannot run is a ``cannot tell`` row whose ``why`` names the argument
that would make it run.

The checks, their thresholds (the constants, re-exported here) and the rows they write are
:mod:`loopprobe.estimate.health_checks`; this module runs them and holds the result.

Definitions: docs/definitions.md §2-4; guide: docs/guides/health.md.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
from torch import nn
from tqdm import tqdm

from loopprobe._html import HTMLView
from loopprobe.differentiate.roundmap import EVAL_ROUND, RoundMap, _eval_mode, round_map
from loopprobe.estimate.alignment import visit_alignment
from loopprobe.estimate.health_checks import (  # noqa: F401 - the thresholds, re-exported
    ALIGNED,
    BOUND_MAX,
    COLUMNS,
    CONFIDENCE,
    CORRELATED,
    DECORRELATED,
    EXPLOSION,
    FAILS,
    FINE,
    FIX_SCALES,
    FIX_STEP,
    FIXED_POINT_TOL,
    FIXED_POINT_TOL_LOW,
    HOLDS,
    INFERENCE,
    LINEAR_RULE,
    MEASUREMENT,
    MIN_PAIRS,
    OSCILLATION,
    RHO_MAX,
    RISK,
    SCALING_TOL,
    SQRT_RULE,
    UNCORRELATED,
    UNKNOWN,
    _unknown,
    alignment_rows,
    gradient_rows,
    increment_rows,
    round_rows,
)
from loopprobe.estimate.health_optimizer import optimizer_rows
from loopprobe.estimate.steps import check_optimizer
from loopprobe.record.increments import caller_rng
from loopprobe.record.probe import Probe
from loopprobe.record.session import restored
from loopprobe.record.types import (
    DefaultLoss,
    Forward,
    LossFn,
    Output,
    check_loss,
    loss_label,
    pick_output,
)

__all__ = ["Health", "health"]


@dataclass
class Health(HTMLView):
    """One row per check in ``frame`` (columns :data:`COLUMNS`), the raw numbers in ``values``.

    ``visits`` and ``cos_G`` are the per-visit norms and gradient cosines the oscillation and
    explosion lines read (what the report draws). ``converged`` is False when an estimate a
    verdict rests on did not converge (κ_R's norms,
    the increments, the eigenpairs); ``reason`` says which. A check that could not run is a
    ``cannot tell`` row (its ``why`` names the fix), not a convergence failure.
    """

    frame: pd.DataFrame
    values: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    visits: pd.DataFrame | None = None  # per visit: ‖U_r‖, ‖G_r‖ (visit_alignment's frame)
    cos_G: dict[str, torch.Tensor] = field(default_factory=dict)  # per sublayer: cos(G_r, G_s)

    @property
    def converged(self) -> bool:
        return not self.problems

    @property
    def reason(self) -> str:
        return "; ".join(self.problems)

    def verdict(self, check: str) -> str:
        """The theory's verdict on one check (a name in ``frame.check``): context."""
        return str(self.frame.set_index("check").loc[check, "verdict"])

    def reading(self, check: str) -> str:
        """The reading of one check: ``fine``, ``risk`` or ``cannot tell`` (what to act on)."""
        return str(self.frame.set_index("check").loc[check, "reading"])

    def risks(self) -> dict[str, str]:
        """The checks read as a risk, each with what to change."""
        risky = self.frame[self.frame.reading.eq(RISK)]
        return dict(zip(risky.check, risky.advice, strict=True))

    def lines(self) -> list[str]:
        """The one-screen summary: per check the reading (fine / risk / cannot tell) with what
        was measured, the theory's premise or claim as context, then what to do."""
        v = self.values
        out = [
            f"health of {v['model']}: {v['M_g']} gradient-visible looped visits; loss: {v['loss']}"
        ]
        for r in self.frame.itertuples():
            out.append(f"[{r.reading}] {r.check} ({r.kind}): {r.measured}")
            why = f"; {r.why}" if r.why and r.why != r.advice else ""
            out.append(f"    theory: {r.claim}: {r.verdict} ({r.threshold}; {r.predicted}){why}")
            out.append(f"    → {r.advice}")
        counts = self.frame.reading.value_counts()
        out.append(", ".join(f"{counts.get(k, 0)} {k}" for k in (RISK, UNKNOWN, FINE)))
        out.append("converged: yes" if self.converged else f"converged: NO ({self.reason})")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


def health(
    model: nn.Module,
    inputs: Any,
    *,
    loss_fn: LossFn | None = None,
    alpha: float | None = None,
    beta: float | None = None,
    step: Callable[..., torch.Tensor] | RoundMap | None = None,
    increment: Any = None,
    sublayers: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    forward: Forward | None = None,
    output: Output | None = None,
    max_iter: int = 50,
    tol: float | None = None,
    fp_max_iter: int = 100,
    seed: int | None = 0,
    progress: bool = True,
    optimizer: str | torch.optim.Optimizer = "sgd",
) -> Health:
    """The health check of a looped model on one batch: a verdict per check (module docstring).

    ``loss_fn(output, inputs)``: default the one rule of every entry point (the model's own
    ``.loss`` when its output has one, else ``0.5 * mean(F²)``); ``values["loss"]`` names the
    loss actually used. ``alpha``/``beta``: the residual scale and init gain (default
    ``model.cfg.alpha/beta``, else attributes ``model.alpha/beta``; the bound line says which).
    ``step``: the round map, as ``fn(model, inputs) -> lp.RoundMap`` (what ``--step`` takes,
    e.g. returning ``lp.replay_round(model, inputs, "block")``), as one round
    ``fn(model, h, x) -> h`` with ``x = model.embed(inputs)`` (or the inputs when they are a
    float tensor) and ``h_0 = x``, or an :class:`lp.RoundMap`; default
    ``lp.round_map(model, inputs)`` when the model has ``step`` and ``embed``.
    ``increment``: as :func:`lp.increments` takes it (None: ``"auto"``).
    ``sublayers``/``exclude``: as :func:`lp.attach`; a sublayer holding several residual
    branches (a whole attention + MLP block) counts as one visit per round, so name the
    branches to get the unrolled depth N = M_g / 2 right. ``max_iter``: Lanczos steps per
    operator norm behind κ_R; ``tol``: the bound on κ_R's error (default from the precision
    the model computes in, as in :func:`lp.visit_alignment`); ``fp_max_iter``: Picard steps
    of the fixed-point check. The model, its ``.grad``, modes, buffers and torch's RNG are
    left as they were. A model whose forward or loss is not finite (a NaN weight) gives a
    first row ``finite`` (risk) naming the visit and the parameters, the rest cannot tell.
    ``optimizer``: what you train with (``"sgd"``, ``"adam"``, ``"adamw"`` or the
    ``torch.optim.Optimizer``): the bound and scaling lines use its form (Adam/AdamW:
    ``J_g κ^U_R (β/α)``, docs/definitions.md §8) and ``values["optimizer"]`` names it.

    Example::

        h = lp.health(model, idx, alpha=1.0, beta=1.0)
        print(h)                    # per check: reading, theory as context, what to do
        h.frame                     # check, claim, kind, reading, verdict, value, advice, ...
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"health: model must be a torch.nn.Module, got {type(model).__name__}")
    check_optimizer(optimizer, None, "health")
    scales = _scales(model, alpha, beta)
    loss = _loss(loss_fn, output)
    kw = dict(forward=forward, output=output, max_iter=max_iter, tol=tol, seed=seed)
    bar = tqdm(["κ_R", "increments", "round map"], desc="health", disable=not progress, leave=False)
    try:
        with caller_rng(model), Probe(model, sublayers, exclude) as probe, restored(model):
            parts = _run_parts(bar, model, inputs, probe, loss, kw, increment, step, fp_max_iter)
    except FloatingPointError as err:  # NaN/inf in the forward or the loss: a finding
        return _not_finite(model, err, loss_label(loss_fn if loss_fn is not None else loss))
    rep, inc_rows, inc_problems, fp_rows, fp_problems = parts
    rows, values = alignment_rows(rep, scales)
    rows, more = optimizer_rows(rows, rep, scales, optimizer)  # the bound under your optimizer
    values.update(more)
    rows += inc_rows + fp_rows + gradient_rows(rep)
    problems = ([f"κ_R: {rep.reason}"] if not rep.converged else []) + inc_problems + fp_problems
    label = loss_label(loss_fn if loss_fn is not None else loss)  # the loss actually used
    values.update(model=type(model).__name__, loss=label, M=int(rep.M), M_g=int(rep.M_g))
    return Health(pd.DataFrame(rows, columns=COLUMNS), values, problems, rep.visits, rep.cos_G)


def _run_parts(bar, model, inputs, probe, loss, kw, increment, step, fp_max_iter) -> tuple:
    """κ_R, the increments and the round map, one progress step each."""
    for part in bar:
        bar.set_postfix_str(part)
        if part == "κ_R":
            rep = visit_alignment(probe, inputs, loss, **kw)
        elif part == "increments":
            inc_rows, inc_problems = increment_rows(probe, inputs, kw["forward"], increment, rep)
        else:
            rm, how = _round_map(model, inputs, step)
            how = how if rm is None else f"{how}; the round in {rm.mode}"
            fp_rows, fp_problems = round_rows(rm, how, fp_max_iter)
    return rep, inc_rows, inc_problems, fp_rows, fp_problems


#: every check, in frame order, and its kind
CHECKS = {"alignment": MEASUREMENT, "bound": MEASUREMENT, "scaling": INFERENCE,
          "increments": MEASUREMENT, "growth rule": INFERENCE, "fixed point": MEASUREMENT,
          "spectral radius": MEASUREMENT, "oscillation": MEASUREMENT,
          "explosion": MEASUREMENT}  # fmt: skip


def _not_finite(model: nn.Module, err: FloatingPointError, loss: str) -> Health:
    """A model whose forward or loss is NaN/inf: one ``finite`` row saying where (the visit
    the estimators name, the non-finite parameters), every other check ``cannot tell``."""
    bad = [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    where = f"non-finite parameters: {', '.join(bad[:5])}" if bad else "every parameter is finite"
    why = "the forward pass is not finite, so no reading of it means anything"
    advice = "fix the non-finite values first (a NaN weight, an overflow, a division by zero)"
    first = dict(zip(COLUMNS, ["finite", "the forward pass and the loss are finite",
                               MEASUREMENT, RISK, FAILS, math.nan, f"{err}; {where}",
                               "finite values", "every value finite", "", advice],
                     strict=True))  # fmt: skip
    rows = [first, *_unknown(list(CHECKS), list(CHECKS.values()), why)]
    values = dict(model=type(model).__name__, loss=loss, M="?", M_g="?", non_finite=bad)
    return Health(pd.DataFrame(rows, columns=COLUMNS), values, [f"not finite: {err}"])


# --------------------------------------------------------------------------- inputs


def _scales(model: nn.Module, alpha: Any, beta: Any) -> tuple[float | None, float | None, str]:
    """(alpha, beta, where they came from): the arguments, model.cfg, or model attributes."""
    found, source = {"alpha": alpha, "beta": beta}, {}
    cfg = getattr(model, "cfg", None)
    for name, given in list(found.items()):
        if given is not None:
            source[name] = "given"
        elif getattr(cfg, name, None) is not None:
            found[name], source[name] = getattr(cfg, name), f"model.cfg.{name}"
        elif isinstance(getattr(model, name, None), (int, float)):
            found[name], source[name] = getattr(model, name), f"model.{name}"
    for name, v in found.items():
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        if v is not None and not (number and math.isfinite(v) and v > 0):
            raise ValueError(
                f"health: {name}={v!r} ({source[name]}) is not a positive number; {FIX_SCALES}"
            )
    where = ", ".join(f"{k} {source[k]}" for k in ("alpha", "beta") if k in source)
    a, b = found["alpha"], found["beta"]
    return (None if a is None else float(a)), (None if b is None else float(b)), where


def _loss(loss_fn: LossFn | None, output: Output | None) -> LossFn:
    """``loss_fn`` checked, or the one default rule (:class:`DefaultLoss`)."""
    if loss_fn is not None:
        return check_loss(loss_fn, "health")
    return DefaultLoss(lambda out: pick_output(out, output, call="health"), call="health")


# --------------------------------------------------------------------------- round map


def _round_map(model: nn.Module, inputs: Any, step: Any) -> tuple[RoundMap | None, str]:
    """The round map and how it was built, or None and why there is none."""
    if isinstance(step, RoundMap):
        return step, "the given RoundMap"
    if step is None:
        if callable(getattr(model, "step", None)) and callable(getattr(model, "embed", None)):
            return round_map(model, inputs), "model.step(h, x), x = model.embed(inputs)"
        return None, f"no round map: {FIX_STEP}"
    if not callable(step):
        raise TypeError(f"health: step={step!r}; {STEP_FORMS}")
    if _positional(step) == 2:  # step(model, inputs) -> RoundMap, as --step takes it
        rm = step(model, inputs)
        if not isinstance(rm, RoundMap):
            raise TypeError(
                f"health: step(model, inputs) returned {type(rm).__name__}; {STEP_FORMS}"
            )
        return rm, "step(model, inputs)"
    with torch.no_grad(), _eval_mode(model):
        if callable(getattr(model, "embed", None)):
            x, how = model.embed(inputs).detach(), "x = model.embed(inputs)"
        elif isinstance(inputs, torch.Tensor) and inputs.is_floating_point():
            x, how = inputs, "x = the inputs"
        else:
            return None, (
                "step= given, but its input x is unknown: the model has no embed(inputs) and "
                "the inputs are not a float tensor; pass step=lp.RoundMap(step, x, h0, R)"
            )

    def T(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        with _eval_mode(model):
            return step(model, h, x)

    rounds = getattr(model, "R", getattr(getattr(model, "cfg", None), "R", None))
    R = rounds if isinstance(rounds, int) else None
    return RoundMap(T, x, x, R, mode=EVAL_ROUND), f"step=, {how}, h_0 = x"


STEP_FORMS = "pass fn(model, h, x) -> h, fn(model, inputs) -> lp.RoundMap or an lp.RoundMap"


def _positional(fn: Callable) -> int | None:
    """The number of positional parameters of ``fn`` (None if it cannot be read)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in kinds for p in params)
