"""The result types the estimators return, in one namespace: ``lp.results.AlignmentReport``.

You rarely build one: ``lp.visit_alignment(...)`` returns an :class:`AlignmentReport`, and so
on. They live here, not at ``lp.``, so that the top level's autocomplete shows what you call
(``attach``, ``visit_alignment``, ``Monitor``, ...); import them from here for annotations and
``isinstance`` checks. Every result carries ``converged`` and ``reason`` and has
``to_frame()`` (tidy pandas). Names load on first use, like ``lp.``'s.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_NAMES = {
    "Recording": "loopprobe.record.types",
    "VisitFunction": "loopprobe.differentiate.visitfn",
    "Updates": "loopprobe.estimate.updates",
    "Sensitivity": "loopprobe.estimate.sensitivity",
    "AlignmentReport": "loopprobe.estimate.alignment",
    "BoundCheck": "loopprobe.estimate.bound",
    "BoundSweep": "loopprobe.estimate.bound",
    "StepChange": "loopprobe.estimate.step_change",
    "Increments": "loopprobe.estimate.increments",
    "Growth": "loopprobe.estimate.growth",
    "FixedPoint": "loopprobe.estimate.fixedpoint",
    "RoundResiduals": "loopprobe.estimate.fixedpoint",
    "SpectralRadius": "loopprobe.estimate.fixedpoint",
    "InputDependence": "loopprobe.estimate.implicit",
    "FiniteStep": "loopprobe.estimate.finitestep",
    "Instability": "loopprobe.estimate.instability",
    "Health": "loopprobe.estimate.health",
    "Redundancy": "loopprobe.estimate.redundancy",
}

__all__ = list(_NAMES)


def __getattr__(name: str) -> Any:
    """Import a result type's module on first use (PEP 562) and keep the name here."""
    if name not in _NAMES:
        raise AttributeError(f"module 'loopprobe.results' has no attribute {name!r}")
    value = getattr(importlib.import_module(_NAMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """What ``__all__`` lists, not this module's own imports and helpers (autocomplete)."""
    return sorted(__all__)


if TYPE_CHECKING:  # for type checkers and IDEs; at run time names load on first use
    from loopprobe.differentiate.visitfn import VisitFunction
    from loopprobe.estimate.alignment import AlignmentReport
    from loopprobe.estimate.bound import BoundCheck, BoundSweep
    from loopprobe.estimate.finitestep import FiniteStep
    from loopprobe.estimate.fixedpoint import FixedPoint, RoundResiduals, SpectralRadius
    from loopprobe.estimate.growth import Growth
    from loopprobe.estimate.health import Health
    from loopprobe.estimate.implicit import InputDependence
    from loopprobe.estimate.increments import Increments
    from loopprobe.estimate.instability import Instability
    from loopprobe.estimate.redundancy import Redundancy
    from loopprobe.estimate.sensitivity import Sensitivity
    from loopprobe.estimate.step_change import StepChange
    from loopprobe.estimate.updates import Updates
    from loopprobe.record.types import Recording
