"""loopprobe: visit-resolved diagnostics for looped (weight-tied, depth-recurrent) Transformers.

One import path: ``import loopprobe as lp``.
"""

__version__ = "0.1.0"

from loopprobe import models, tasks, theory
from loopprobe.alignment import (
    AlignmentReport,
    BoundCheck,
    BoundSweep,
    bound_check,
    bound_sweep,
    visit_alignment,
    visit_kappa,
)
from loopprobe.coordcheck import (
    CoordCheck,
    coord_check,
    reference_coord_check,
)
from loopprobe.finitestep import FiniteStep, finite_step, path_gains, reference_logprob
from loopprobe.fixedpoint import (
    FixedPoint,
    InputDependence,
    RoundMap,
    RoundResiduals,
    SpectralRadius,
    fixed_point,
    input_dependence,
    jacobian_norm,
    observed_rate,
    replay_round,
    round_map,
    round_residuals,
    spectral_radius,
)
from loopprobe.fixedpoint_study import recall_study
from loopprobe.increments import (
    Growth,
    Increments,
    growth_sweep,
    increments,
    reference_growth,
    regime_name,
)
from loopprobe.instability import (
    Instability,
    InstabilityRecorder,
    branch_gain,
    instability,
    record_training,
)
from loopprobe.linalg import Estimate, operator_norm, operator_norm_krylov
from loopprobe.lrtransfer import (
    LRTransfer,
    lr_transfer,
    reference_lr_transfer,
)
from loopprobe.probe import Probe, attach
from loopprobe.scaling import fit_recurrence_law  # and lp.scaling
from loopprobe.sensitivity import Sensitivity, sensitivity_norms
from loopprobe.sweeps import grid, sweep
from loopprobe.threads import threads  # opt-in: with lp.threads(1): ... (restores)
from loopprobe.updates import Updates, per_visit_updates
from loopprobe.visitfn import VisitFunction, visit_function
from loopprobe.visits import Recording, Sublayer, Visit, VisitRecord


def __getattr__(name: str):
    """``lp.plots`` is imported on first use, so ``import loopprobe`` skips seaborn/matplotlib."""
    if name == "plots":
        import importlib

        return importlib.import_module("loopprobe.plots")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "__version__",
    "AlignmentReport",
    "BoundCheck",
    "BoundSweep",
    "Sensitivity",
    "Updates",
    "bound_check",
    "bound_sweep",
    "per_visit_updates",
    "sensitivity_norms",
    "visit_alignment",
    "visit_kappa",
    "Growth",
    "Increments",
    "growth_sweep",
    "increments",
    "reference_growth",
    "regime_name",
    "LRTransfer",
    "lr_transfer",
    "reference_lr_transfer",
    "Instability",
    "InstabilityRecorder",
    "branch_gain",
    "instability",
    "record_training",
    "CoordCheck",
    "coord_check",
    "reference_coord_check",
    "Estimate",
    "FiniteStep",
    "FixedPoint",
    "InputDependence",
    "RoundMap",
    "RoundResiduals",
    "SpectralRadius",
    "finite_step",
    "fixed_point",
    "input_dependence",
    "jacobian_norm",
    "observed_rate",
    "path_gains",
    "recall_study",
    "reference_logprob",
    "replay_round",
    "round_map",
    "round_residuals",
    "spectral_radius",
    "Probe",
    "Recording",
    "Sublayer",
    "Visit",
    "VisitRecord",
    "attach",
    "grid",
    "models",
    "operator_norm",
    "operator_norm_krylov",
    "plots",
    "sweep",
    "tasks",
    "theory",
    "threads",
    "visit_function",
    "fit_recurrence_law",
    "VisitFunction",
]
