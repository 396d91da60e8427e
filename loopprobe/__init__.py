"""loopprobe: visit-resolved diagnostics for looped (weight-tied, depth-recurrent) Transformers.

One import path, ``import loopprobe as lp``; every name below is one concept. The package
reads in four layers, each importing only the ones before it:

**Record** (:mod:`loopprobe.record`): find the physical sublayers and their visits.
    ``attach(model) -> Probe``; ``Probe.visits / visit_table / record -> Recording``.

**Differentiate** (:mod:`loopprobe.differentiate`): the model as pure functions.
    ``visit_function(model, inputs) -> (F, deltas0)``: the output as a function of
    per-visit offsets (compose it with ``torch.func``); ``round_map`` / ``replay_round``:
    one round ``T(h, x)`` of a looped model, as a :class:`RoundMap`.

**Estimate** (:mod:`loopprobe.estimate`): the theory's quantities, with ``converged`` and
``reason``. Per visit: ``per_visit_updates -> Updates`` (G), ``sensitivity_norms ->
Sensitivity`` (‖U‖), ``visit_alignment -> AlignmentReport`` (κ_j, κ_R), ``bound_check ->
BoundCheck`` and ``bound_sweep -> BoundSweep`` (the bound and C), ``step_change ->
StepChange`` (your optimizer's real step: ΔF per visit and its bound), ``increments ->
Increments`` and ``growth_sweep -> Growth`` (increment correlation, growth exponent).
Per round: ``fixed_point -> FixedPoint``, ``round_residuals -> RoundResiduals``,
``spectral_radius -> SpectralRadius``, ``input_dependence -> InputDependence``,
``finite_step -> FiniteStep``. For curvature tools: ``sensitivity_operators`` (each U as a
``scipy.sparse.linalg.LinearOperator``); ``visit(probe, "block", r, inputs)``: one visit's
input, output, U and G. Training health: ``instability -> Instability``.
Scaling law: ``fit_recurrence_law`` (and :mod:`lp.scaling <loopprobe.estimate.scaling>`).
Loop redundancy (FlashLoop's observations): ``redundancy -> Redundancy``.
The result types (``Updates``, ``AlignmentReport``, ...) are in :mod:`lp.results
<loopprobe.results>`, for annotations and ``isinstance``; the top level keeps what you call.

**Watch training** (:mod:`loopprobe.monitor`): ``Monitor(model, inputs, loss_fn, ...)``;
``monitor.step(step)`` after ``optimizer.step()``; sinks for TensorBoard, files, callables;
trainer callbacks in :mod:`loopprobe.integrations`.

**Present**: :mod:`lp.plots <loopprobe.plots>` (figures from the tidy frames) and
:mod:`loopprobe.report` (``loopprobe report``).

The layer packages (``loopprobe.record``, ``.differentiate``, ``.estimate``, ``.monitor``) are
importable for code that extends loopprobe but are not listed here. Around them: ``sweep`` and
``grid`` (cached grids of runs), ``threads`` (opt-in thread
count for a block), ``transform_safe`` (a block where ``torch.func`` runs through fused
attention, checkpointing and buffer writes, for any code), and the submodules
``lp.models`` (reference looped models), ``lp.tasks`` (data that needs no download),
``lp.theory`` (closed forms), ``lp.experiments`` (drivers that train models to test a
seed's claim), ``lp.linalg`` (matrix-free operator norms) and ``lp.testing`` (property
tests for your model family).

Names are imported on first use, so ``import loopprobe`` costs little beyond ``import
torch`` (benchmarks/bench_startup.py). Definitions of every quantity: docs/definitions.md.
"""

from __future__ import annotations

import importlib
import logging
import warnings
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_NAMES = {
    # record
    "attach": "loopprobe.record.probe",
    "Probe": "loopprobe.record.probe",
    # differentiate
    "visit_function": "loopprobe.differentiate.visitfn",
    "round_map": "loopprobe.differentiate.roundmap",
    "replay_round": "loopprobe.differentiate.roundmap",
    "RoundMap": "loopprobe.differentiate.roundmap",
    # estimate: per visit
    "per_visit_updates": "loopprobe.estimate.updates",
    "sensitivity_norms": "loopprobe.estimate.sensitivity",
    "sensitivity_operators": "loopprobe.estimate.sensitivity",
    "visit_alignment": "loopprobe.estimate.alignment",
    "visit": "loopprobe.estimate.visit_handle",
    "bound_check": "loopprobe.estimate.bound",
    "bound_sweep": "loopprobe.estimate.bound",
    "step_change": "loopprobe.estimate.step_change",
    "increments": "loopprobe.estimate.increments",
    "growth_sweep": "loopprobe.estimate.growth",
    # estimate: per round
    "fixed_point": "loopprobe.estimate.fixedpoint",
    "round_residuals": "loopprobe.estimate.fixedpoint",
    "spectral_radius": "loopprobe.estimate.fixedpoint",
    "input_dependence": "loopprobe.estimate.implicit",
    "finite_step": "loopprobe.estimate.finitestep",
    # estimate: training health, fits
    "instability": "loopprobe.estimate.instability",
    "health": "loopprobe.estimate.health",
    "fit_recurrence_law": "loopprobe.estimate.scaling",
    "redundancy": "loopprobe.estimate.redundancy",
    # watch training
    "Monitor": "loopprobe.monitor.monitor",
    # around the layers
    "sweep": "loopprobe.sweeps",
    "grid": "loopprobe.sweeps",
    "threads": "loopprobe._threads",
    "transform_safe": "loopprobe.autodiff",
}

_SUBMODULES = {
    "models": "loopprobe.models",
    "tasks": "loopprobe.tasks",
    "theory": "loopprobe.theory",
    "plots": "loopprobe.plots",
    "experiments": "loopprobe.experiments",
    "linalg": "loopprobe.linalg",
    "testing": "loopprobe.testing",
    "results": "loopprobe.results",
    "scaling": "loopprobe.estimate.scaling",
    "report": "loopprobe.report",
    "integrations": "loopprobe.integrations",
    "distributed": "loopprobe.distributed",
}

#: the layer packages: importable (``import loopprobe.record``) for code that extends
#: loopprobe, reachable as ``lp.record`` etc., but not listed, so autocomplete shows the verbs
_LAYERS = {name: f"loopprobe.{name}" for name in ("record", "differentiate", "estimate", "monitor")}

__all__ = ["__version__", *_NAMES, *_SUBMODULES]

# Notices (not warnings about your results) go to the "loopprobe" logger; the library adds
# no handler of its own (the convention for libraries), so the application decides.
logging.getLogger("loopprobe").addHandler(logging.NullHandler())


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use (PEP 562) and keep the name here."""
    if name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name]), name)
    elif name in _SUBMODULES or name in _LAYERS:
        value = importlib.import_module({**_SUBMODULES, **_LAYERS}[name])
    elif name in _moved():
        warnings.warn(
            f"lp.{name} is now lp.results.{name} (the top level keeps what you call); "
            "the old name will be removed in 0.2",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module("loopprobe.results"), name)
    else:
        raise AttributeError(f"module 'loopprobe' has no attribute {name!r}")
    globals()[name] = value
    return value


def _moved() -> dict[str, str]:
    """Result types that moved to ``lp.results``: the old ``lp.X`` still works."""
    return importlib.import_module("loopprobe.results")._NAMES


def __dir__() -> list[str]:
    """What ``__all__`` lists, not this module's own imports and helpers (autocomplete)."""
    return sorted(__all__)


if TYPE_CHECKING:  # for type checkers and IDEs; at run time names load on first use
    from loopprobe import experiments, linalg, models, plots, results, tasks, theory
    from loopprobe._threads import threads
    from loopprobe.autodiff import transform_safe
    from loopprobe.differentiate.roundmap import RoundMap, replay_round, round_map
    from loopprobe.differentiate.visitfn import visit_function
    from loopprobe.estimate import scaling
    from loopprobe.estimate.alignment import visit_alignment
    from loopprobe.estimate.bound import bound_check, bound_sweep
    from loopprobe.estimate.finitestep import finite_step
    from loopprobe.estimate.fixedpoint import fixed_point, round_residuals, spectral_radius
    from loopprobe.estimate.growth import growth_sweep
    from loopprobe.estimate.health import health
    from loopprobe.estimate.implicit import input_dependence
    from loopprobe.estimate.increments import increments
    from loopprobe.estimate.instability import instability
    from loopprobe.estimate.redundancy import redundancy
    from loopprobe.estimate.scaling import fit_recurrence_law
    from loopprobe.estimate.sensitivity import sensitivity_norms, sensitivity_operators
    from loopprobe.estimate.step_change import step_change
    from loopprobe.estimate.updates import per_visit_updates
    from loopprobe.estimate.visit_handle import visit
    from loopprobe.monitor.monitor import Monitor
    from loopprobe.record.probe import Probe, attach
    from loopprobe.sweeps import grid, sweep
