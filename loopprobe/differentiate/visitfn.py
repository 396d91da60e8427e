"""The per-visit transform: the model's output as a pure function of per-visit offsets.

``F, deltas0 = lp.visit_function(model, inputs)`` gives a function ``F(deltas)`` of one
zero-valued offset per visit and parameter (``deltas[k][t]`` has the shape of the t-th
parameter tensor of the sublayer of the k-th visit), whose value at ``deltas0`` (all
zeros) is the model's output F, flattened. Visit ``(r, j)`` computes with
``phi_j + delta_{r,j}``; everything else is unchanged. Derivatives of F therefore separate
by visit of a shared parameter, and compose with any ``torch.func`` transform:

- ``G_{r,j}``: ``torch.func.grad(lambda d: loss(F(d)))(deltas0)[k]``;
- ``U_{r,j} t``: ``torch.func.jvp(F, (deltas0,), (tangent,))`` with ``t`` in slot k only;
- ``U_{r,j}^T u``: ``torch.func.vjp(F, deltas0)[1](u)[0][k]``.

``F`` runs the model through loopprobe's one parameter-swap mechanism (the probe's
session, made transform-safe: fused attention, checkpointing) under the same seed on
every call, so dropout draws the same masks for every derivative. ``F.visits`` lists the
visits in slot order. A forward that ``torch.func`` refuses (an old-style
``autograd.Function``, ``requires_grad_()`` in the forward, ...) is one error naming what
was refused and where; ``F`` itself then still works under plain ``torch.autograd``.
Reference: seed 002, Eq. 11 (per-visit offsets).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from loopprobe.differentiate.jacobian import VisitJacobian
from loopprobe.record.probe import Probe
from loopprobe.record.types import Forward, Output, Visit
from loopprobe.refusals import refused_at, transform_refusal


class VisitFunction:
    """``F(deltas) -> flattened output``; see :func:`visit_function`."""

    def __init__(self, jac: VisitJacobian) -> None:
        self._jac = jac
        self.visits: list[Visit] = jac.visits

    def __call__(self, deltas: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
        if len(deltas) != len(self._jac.primals):
            raise ValueError(
                f"visit_function: F takes one tuple of offsets per visit "
                f"({len(self._jac.primals)}), got {len(deltas)}"
            )
        values = [
            tuple(p + d for p, d in zip(phi, delta, strict=True))
            for phi, delta in zip(self._jac.primals, deltas, strict=True)
        ]
        try:
            return self._jac.f(*values)
        except RuntimeError as e:
            why = transform_refusal(e)
            if why is None:
                raise
            raise RuntimeError(
                f"visit_function: torch.func cannot transform this forward: {why}"
                f"{refused_at(e, self._jac.probe.model)}. F itself works under plain "
                "torch.autograd: pass offsets that require grad (d = [tuple(t.clone()."
                "requires_grad_() for t in ts) for ts in d0]) and use torch.autograd.grad, "
                "or lp.per_visit_updates / lp.sensitivity_norms, which fall back to plain "
                f"torch.autograd themselves (torch: {str(e).splitlines()[0]})"
            ) from None


def visit_function(
    model: nn.Module | Probe,
    inputs: Any,
    *,
    sublayers: Sequence[str] | None = None,
    visits: Sequence[Visit] | None = None,
    forward: Forward | None = None,
    output: Output | None = None,
    seed: int | None = 0,
) -> tuple[Callable, tuple[tuple[torch.Tensor, ...], ...]]:
    """``(F, deltas0)``: the output as a function of per-visit offsets, and the zero offsets.

    ``model`` is an ``nn.Module`` (attached here, with ``sublayers=`` as in
    :func:`loopprobe.attach`) or a probe. ``visits`` selects which visits get an offset
    (default: every forward visit of every sublayer; others compute with the plain
    parameters). ``forward``/``output`` as elsewhere; ``seed`` fixes torch's RNG for every
    evaluation. Example (per-visit G and one ``||U||`` with plain ``torch.func``)::

        F, d0 = lp.visit_function(model, idx)
        G = torch.func.grad(lambda d: F(d).square().mean())(d0)   # G[k]: visit F.visits[k]
        k, t = 0, tuple(torch.randn_like(p) for p in d0[0])       # ||U_k||, power iteration
        for _ in range(200):
            tangent = tuple(t if i == k else tuple(map(torch.zeros_like, ps))
                            for i, ps in enumerate(d0))
            _, u = torch.func.jvp(F, (d0,), (tangent,))           # U_k t
            t = torch.func.vjp(F, d0)[1](u)[0][k]                 # U_k^T U_k t
            scale = torch.sqrt(sum(x.square().sum() for x in t))
            t = tuple(x / scale for x in t)
        norm = scale.sqrt()
    """
    probe = model if isinstance(model, Probe) else Probe(model, sublayers)
    if visits is None:
        visits = probe.visits(inputs, forward=forward, output=output, seed=seed)
    visits = list(visits)
    if not visits:
        raise ValueError("visit_function: the forward pass made no visit to any sublayer")
    jac = VisitJacobian(
        probe, inputs, visits, forward=forward, output=output, seed=seed, call="visit_function"
    )
    zeros = tuple(tuple(torch.zeros_like(p) for p in phi) for phi in jac.primals)
    return VisitFunction(jac), zeros
