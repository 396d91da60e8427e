"""loopprobe: visit-resolved diagnostics for looped (weight-tied, depth-recurrent) Transformers.

One import path: ``import loopprobe as lp``.
"""

__version__ = "0.1.0"

from loopprobe import models, plots, tasks, theory
from loopprobe.linalg import Estimate, operator_norm, operator_norm_lanczos
from loopprobe.sweeps import grid, sweep
from loopprobe.visits import Probe, Recording, Sublayer, Visit, VisitRecord, attach

__all__ = [
    "__version__",
    "Estimate",
    "Probe",
    "Recording",
    "Sublayer",
    "Visit",
    "VisitRecord",
    "attach",
    "grid",
    "models",
    "operator_norm",
    "operator_norm_lanczos",
    "plots",
    "sweep",
    "tasks",
    "theory",
]
