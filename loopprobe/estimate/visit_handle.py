"""One visit as a handle: its recorded input and output, and its U and G on demand.

``lp.visit(probe, "block", r, inputs)`` names visit ``r`` of a sublayer the way nnsight users
name a module's call (``model.block.output``), and each attribute is the library's own
function restricted to that visit: ``.output``/``.input`` come from :meth:`Probe.record`,
``.G()`` from :func:`~loopprobe.estimate.updates.per_visit_updates`, ``.U()`` from
:func:`~loopprobe.estimate.sensitivity.sensitivity_operators` and ``.U_norm()`` from
:func:`~loopprobe.estimate.sensitivity.sensitivity_norms`. Nothing runs until an attribute is
read; the recording is kept (one forward), U and G are computed per call (their arguments
vary). It is a function of the probe rather than a method of it because the recording layer
(``Probe``) sits below the estimators that U and G need. Reference: seed 002, Eq. 11.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from loopprobe.estimate.sensitivity import sensitivity_norms, sensitivity_operators
from loopprobe.estimate.updates import per_visit_updates
from loopprobe.linalg import Estimate
from loopprobe.record.probe import Probe
from loopprobe.record.types import Forward, LossFn, Output, Visit, VisitRecord

CALL = "lp.visit"


class VisitHandle:
    """Visit ``visit.r`` of sublayer ``visit.sublayer`` on ``inputs``; see :func:`visit`."""

    def __init__(
        self,
        probe: Probe,
        visit: Visit,
        inputs: Any,
        forward: Forward | None,
        output: Output | None,
        seed: int | None,
    ) -> None:
        self.probe, self.visit, self.inputs = probe, visit, inputs
        self._forward, self._output, self._seed = forward, output, seed
        self._record: VisitRecord | None = None

    def __repr__(self) -> str:
        v = self.visit
        return f"VisitHandle(sublayer={v.sublayer!r}, r={v.r}, module={v.module!r}, i={v.i})"

    @property
    def record(self) -> VisitRecord:
        """The visit's :class:`VisitRecord` from ``probe.record(inputs)`` (one forward, kept)."""
        if self._record is None:
            rec = self.probe.record(self.inputs, forward=self._forward, seed=self._seed)
            self._record = rec.visits[self.visit.i]
        return self._record

    @property
    def args(self) -> tuple:
        """The visit's positional arguments (detached copies taken at call time)."""
        return self.record.args

    @property
    def kwargs(self) -> dict:
        """The visit's keyword arguments (detached copies)."""
        return self.record.kwargs

    @property
    def input(self) -> Any:
        """The visit's first positional argument (the stream it reads), else its kwargs."""
        return self.args[0] if self.args else self.kwargs

    @property
    def output(self) -> Any:
        """What the visit returned (a detached copy)."""
        return self.record.output

    def G(  # noqa: N802 - the paper's symbol
        self, loss_fn: LossFn | None = None, *, update: str | torch.optim.Optimizer = "sgd"
    ) -> torch.Tensor:
        """``G_{r,j}``, flattened (shape ``(n_j,)``): this visit's row of
        ``per_visit_updates(probe, inputs, loss_fn, update=update).G[j]``."""
        upd = per_visit_updates(
            self.probe, self.inputs, loss_fn, forward=self._forward, update=update, seed=self._seed
        )
        return upd.G[self.visit.j][self.visit.r]

    def U(self, **kwargs: Any) -> Any:  # noqa: N802 - the paper's symbol
        """``U_{r,j}`` as a ``scipy.sparse.linalg.LinearOperator`` of shape ``(F.numel(), n_j)``
        (``op @ v`` is ``U v``); ``kwargs`` (``chunk_size``) go to ``sensitivity_operators``."""
        ops = sensitivity_operators(
            self.probe, self.inputs, visits=[self.visit], **self._common(), **kwargs
        )
        return ops[(self.visit.sublayer, self.visit.r)]

    def U_norm(self, **kwargs: Any) -> Estimate:  # noqa: N802 - the paper's symbol
        """``||U_{r,j}||`` as an :class:`~loopprobe.linalg.Estimate` (``value``, ``converged``,
        ``residual``); ``kwargs`` (``tol``, ``max_iter``, ``generator``, ``method``) go to
        ``sensitivity_norms``, which estimates only this visit's operator."""
        sens = sensitivity_norms(
            self.probe, self.inputs, visits=[self.visit], **self._common(), **kwargs
        )
        return sens.visit_norms[0]

    def _common(self) -> dict[str, Any]:
        return dict(forward=self._forward, output=self._output, seed=self._seed)


def visit(
    model: nn.Module | Probe,
    sublayer: str,
    r: int,
    inputs: Any,
    *,
    forward: Forward | None = None,
    output: Output | None = None,
    seed: int | None = 0,
) -> VisitHandle:
    """A handle on visit ``r`` of ``sublayer`` in the forward on ``inputs``.

    ``sublayer``: a sublayer's name (``probe.visit_table(inputs).sublayer``; ``r`` counts all
    its visits, as ``Visit.r``) or the name of one module of it (``r`` counts that module's
    calls, for ALBERT-style tying where each layer instance is called once). ``r`` is
    0-based; negative counts from the last visit. ``model``: a probe, or a module (attached
    here). ``forward``/``output``/``seed``: as in :func:`~loopprobe.estimate.sensitivity.
    sensitivity_norms`. Raises ``ValueError`` naming the known sublayers or the visit count.

    Example::

        v = lp.visit(probe, "block", 1, x)
        v.input, v.output                 # what visit 1 of "block" read and returned
        v.G(loss_fn)                      # its row of per_visit_updates(...).G
        v.U_norm().value                  # ||U_{1,block}||
    """
    probe = model if isinstance(model, Probe) else Probe(model)
    if not isinstance(sublayer, str):
        raise TypeError(f"{CALL}: sublayer={sublayer!r}; pass a sublayer or module name (str)")
    if isinstance(r, bool) or not isinstance(r, int):
        raise TypeError(f"{CALL}: r={r!r}; pass the visit number as an int (0-based)")
    visits = probe.visits(inputs, forward=forward, output=output, seed=seed)
    mine = [v for v in visits if v.sublayer == sublayer]
    if not mine:
        mine = [v for v in visits if v.module == sublayer]
    if not mine:
        names = sorted({v.sublayer for v in visits})
        modules = sorted({v.module for v in visits} - set(names))
        also = f" (or one of their modules: {modules})" if modules else ""
        raise ValueError(
            f"{CALL}: no sublayer or module {sublayer!r} is visited; the sublayers are "
            f"{names}{also}; see probe.visit_table(inputs)"
        )
    if not -len(mine) <= r < len(mine):
        raise ValueError(
            f"{CALL}: r={r} but {sublayer!r} has {len(mine)} visit(s) on these inputs; "
            f"pass 0 <= r < {len(mine)} (or a negative r from the last)"
        )
    return VisitHandle(probe, mine[r], inputs, forward, output, seed)
