"""The probe users hold: recording (:mod:`loopprobe.visits`) plus the estimators as methods.

``lp.attach(model)`` returns this :class:`Probe`. The recording layer below knows nothing
of the estimators (they import it, never the reverse); the four methods here are thin
conveniences over :func:`loopprobe.per_visit_updates`, :func:`loopprobe.sensitivity_norms`,
:func:`loopprobe.visit_alignment` and :func:`loopprobe.bound_check`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from loopprobe import visits
from loopprobe.alignment import AlignmentReport, BoundCheck, bound_check, visit_alignment
from loopprobe.sensitivity import Sensitivity, sensitivity_norms
from loopprobe.updates import Updates, per_visit_updates


class Probe(visits.Probe):
    """Visit-resolved view of a model (see :class:`loopprobe.visits.Probe`), with estimators."""

    def updates(self, inputs: Any, loss_fn: Callable, **kwargs: Any) -> Updates:
        """Per-visit updates G_{r,j}: :func:`loopprobe.updates.per_visit_updates`."""
        return per_visit_updates(self, inputs, loss_fn, **kwargs)

    def sensitivity(self, inputs: Any, **kwargs: Any) -> Sensitivity:
        """Operator norms of U_{r,j}: :func:`loopprobe.sensitivity.sensitivity_norms`."""
        return sensitivity_norms(self, inputs, **kwargs)

    def alignment(self, inputs: Any, loss_fn: Callable, **kwargs: Any) -> AlignmentReport:
        """kappa_j, kappa_R, Gram matrices: :func:`loopprobe.alignment.visit_alignment`."""
        return visit_alignment(self, inputs, loss_fn, **kwargs)

    def bound(self, inputs: Any, loss_fn: Callable, **kwargs: Any) -> BoundCheck:
        """Measured output change after one step vs M kappa (beta/alpha)^2: :func:`bound_check`."""
        return bound_check(self, inputs, loss_fn, **kwargs)


def attach(
    model: nn.Module,
    sublayers: Sequence[str] | None = None,
    *,
    exclude: Sequence[str] | None = None,
) -> Probe:
    """Attach a :class:`Probe` to ``model`` without changing its code.

    ``sublayers``: module names or dotted globs (``"blocks.*.attn"``; ``*`` is one path
    segment, ``**`` several). Modules that hold the same parameter objects are one physical
    sublayer. Default: ``model.loopprobe_sublayers`` if present, else discovery from the
    first forward (see :mod:`loopprobe.discover`). ``exclude``: patterns removed from the list.

    Example::

        with lp.attach(model) as probe:
            print(probe.visit_table(idx))
            rep = probe.alignment(idx, loss_fn)
    """
    return Probe(model, sublayers, exclude)
