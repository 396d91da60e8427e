"""Per-visit sensitivities ``U_{r,j}``: operator norms of ``delta_{r,j} -> dF`` by power iteration.

``U_{r,j}`` is the linear map from a perturbation of sublayer j's parameters at visit
``(r, j)`` alone to the change of the output F (the whole batch tensor, flattened); the
tied map ``sum_r U_{r,j}`` perturbs every visit of j by the same vector. Its action on a
direction is one JVP (``torch.func.jvp``), its transpose one VJP (``torch.func.vjp``),
and ``||U||`` is the top singular value, found by power iteration on ``U^T U``
(:func:`loopprobe.linalg.operator_norm`) or by Lanczos (``method="lanczos"``).

All operators (every visit and every tied sum) are estimated together: the function
``F(delta_1, ..., delta_M)`` is evaluated once unbatched (so data-dependent control flow
such as ACT halting works), tangents and cotangents are batched with ``torch.vmap``, and
the VJP graph is built once and reused by every iteration. No dense Jacobian is formed.
Each iteration checks ``<U^T U v, v> = ||U v||^2``: a mismatch means forward-mode
tangents and the backward graph disagree (a ``no_grad`` region after a visit, or
randomness that the seed does not control) and raises instead of returning a number.
Reference: seed 002, Eq. 11-12 and Assumption 3.1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
from torch.func import jvp, vjp, vmap

from loopprobe.linalg import Estimate, operator_norm, operator_norm_krylov
from loopprobe.visits import Forward, Output, Probe, Visit, call_model, pick_output, seeded


@dataclass
class Sensitivity:
    """Operator norms ``||U_{r,j}||`` per visit and ``||sum_r U_{r,j}||`` per sublayer.

    ``visits[k]`` and ``visit_norms[k]`` line up; ``tied_norms[j]`` is keyed by sublayer
    index. ``UTw[j]`` has one row ``U_{r,j}^T w`` per included visit of j, for a random unit
    output direction ``w`` (its Gram matrix shows how the visits read the output).
    """

    visits: list[Visit]
    sublayers: list[str]
    visit_norms: list[Estimate]
    tied_norms: dict[int, Estimate]
    UTw: dict[int, torch.Tensor] = field(default_factory=dict)
    F_norm: float = float("nan")
    method: str = "power"

    def to_frame(self) -> pd.DataFrame:
        rows = []
        for v, est in zip(self.visits, self.visit_norms, strict=True):
            rows.append(
                {
                    "sublayer": v.sublayer,
                    "j": v.j,
                    "r": v.r,
                    "i": v.i,
                    "module": v.module,
                    "U_norm": est.value,
                    "converged": est.converged,
                    "iterations": est.iterations,
                    "rel_change": est.rel_change,
                    "method": est.method,
                }
            )
        return pd.DataFrame(rows)


class VisitJacobian:
    """F as a function of per-visit offsets, with batched JVP/VJP for a set of operators.

    ``visits`` are the visits that get an offset input (others compute with the plain
    parameters). An *operator* is a sublayer j and a subset S of its visits: the map
    ``t -> sum_{i in S} U_i t`` on ``R^{n_j}``. Vectors are padded to ``n_max``.
    """

    def __init__(
        self,
        probe: Probe,
        inputs: Any,
        visits: Sequence[Visit],
        *,
        forward: Forward | None = None,
        output: Output | None = None,
        seed: int | None = 0,
        call: str = "sensitivity",
    ) -> None:
        self.probe, self.inputs, self.forward, self.output = probe, inputs, forward, output
        self.groups = probe.groups(inputs, forward, seed=seed)
        self.visits = list(visits)
        self.pos = {v.i: k for k, v in enumerate(self.visits)}
        self.n = [self.groups[v.j].sublayer.numel for v in self.visits]
        self.n_max = max(g.sublayer.numel for g in self.groups)
        p0 = self.groups[0].params[0]
        self.dtype, self.device = p0.dtype, p0.device
        self.seed, self.call = seed, call
        # Primals are the parameter values themselves (shared, not copied): offset 0.
        self.primals = tuple(
            tuple(p.detach() for p in self.groups[v.j].params) for v in self.visits
        )
        self.shapes = [[p.shape for p in self.groups[v.j].params] for v in self.visits]
        self._expected: list[tuple[int, int]] | None = None
        self._vjp_fn = None
        self.F0: torch.Tensor | None = None

    # -- the function --------------------------------------------------------------
    def f(self, *deltas: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Flattened F, computing with ``deltas[k]`` (one tensor per parameter, the value
        ``phi_j + delta``) in place of ``phi_j`` at the k-th selected visit."""

        def enter(v: Visit, module: Any, args: tuple, kwargs: dict) -> Sequence | None:
            k = self.pos.get(v.i)
            if k is None:
                return None
            if self.visits[k].j != v.j:
                self._diverged(v)
            return deltas[k]

        with seeded(self.seed, self.device), self.probe.session(enter, call=self.call) as trace:
            out = call_model(self.probe.model, self.inputs, self.forward)
            F = pick_output(out, self.output, call=self.call)
        seen = [(v.i, v.j) for v in trace.visits]
        if self._expected is None:
            self._expected = seen
        elif seen != self._expected:
            raise RuntimeError(
                f"{self.call}: the model took a different path on re-evaluation "
                f"({len(seen)} visits instead of {len(self._expected)}); its trip counts "
                "depend on randomness that the seed does not control. Use model.eval() or "
                "a deterministic forward="
            )
        return F.reshape(-1)

    def _diverged(self, v: Visit) -> None:
        raise RuntimeError(
            f"{self.call}: visit {v.i} is sublayer {v.sublayer!r} now but was another one "
            "when the visits were counted; the execution order is not reproducible"
        )

    def vjp_fn(self) -> Any:
        if self._vjp_fn is None:
            # Outer no_grad: torch.func still differentiates, but no autograd graph is
            # recorded for the model's own parameters (much faster, less memory).
            with torch.no_grad():
                self.F0, self._vjp_fn = vjp(self.f, *self.primals)
            if not torch.isfinite(self.F0).all():
                from loopprobe.updates import first_nonfinite_visit

                raise FloatingPointError(
                    f"{self.call}: the output F is not finite; "
                    + first_nonfinite_visit(self.probe, self.inputs, self.forward, self.seed)
                )
        return self._vjp_fn

    # -- operators -----------------------------------------------------------------
    def masks(self, operators: Sequence[Sequence[int]]) -> torch.Tensor:
        """``(B, K)`` 0/1 matrix: operator b uses the selected visits in ``operators[b]``."""
        m = torch.zeros(len(operators), len(self.visits), dtype=self.dtype, device=self.device)
        for b, ks in enumerate(operators):
            m[b, list(ks)] = 1
        return m

    def unflatten(self, k: int, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out, off = [], 0
        for shape in self.shapes[k]:
            n = shape.numel()
            out.append(t[off : off + n].view(shape))
            off += n
        return tuple(out)

    def jvp_one(self, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        tangents = tuple(self.unflatten(k, mask[k] * v[: self.n[k]]) for k in range(len(self.n)))
        return jvp(self.f, self.primals, tangents)[1]

    def vjp_one(self, u: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        grads = self.flat_grads(self.vjp_fn()(u))
        w = torch.zeros(self.n_max, dtype=self.dtype, device=self.device)
        for k, g in enumerate(grads):
            w = w + torch.nn.functional.pad(mask[k] * g, (0, self.n_max - self.n[k]))
        return w

    @staticmethod
    def flat_grads(grads: tuple) -> list[torch.Tensor]:
        return [torch.cat([t.reshape(-1) for t in g]) for g in grads]

    def matvec(self, V: torch.Tensor, masks: torch.Tensor, chunk_size: int | None = None):
        """``U_b v_b`` for every operator b: one vmapped JVP (``chunk_size=0``: a loop)."""
        with torch.no_grad():
            if chunk_size == 0:
                return torch.stack([self.jvp_one(v, m) for v, m in zip(V, masks, strict=True)])
            return vmap(self.jvp_one, randomness="same", chunk_size=chunk_size)(V, masks)

    def rmatvec(self, U: torch.Tensor, masks: torch.Tensor, chunk_size: int | None = None):
        """``U_b^T u_b`` for every operator b, reusing one VJP graph (``chunk_size=0``: a loop)."""
        self.vjp_fn()
        with torch.no_grad():
            if chunk_size == 0:
                return torch.stack([self.vjp_one(u, m) for u, m in zip(U, masks, strict=True)])
            return vmap(self.vjp_one, randomness="same", chunk_size=chunk_size)(U, masks)

    def transpose_all(self, u: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``U_i^T u`` for every selected visit i, flattened (one backward)."""
        fn = self.vjp_fn()
        with torch.no_grad():
            return tuple(self.flat_grads(fn(u)))


def sensitivity_norms(
    probe: Probe,
    inputs: Any,
    *,
    forward: Forward | None = None,
    output: Output | None = None,
    visits: Sequence[Visit] | None = None,
    method: str = "power",
    max_iter: int = 100,
    tol: float | None = None,
    generator: torch.Generator | None = None,
    seed: int | None = 0,
    chunk_size: int | None = None,
) -> Sensitivity:
    """``||U_{r,j}||`` for every included visit and ``||sum_r U_{r,j}||`` for every sublayer.

    ``visits``: which visits carry an offset (default: the gradient-visible ones, measured
    with respect to F). Every operator is estimated in one batch: ``method="power"`` by
    power iteration (``tol`` on the relative change of the estimate; default 1e-10 in
    float64 and 1e-5 in lower precision, where 1e-10 is below roundoff), ``"lanczos"`` by
    Lanczos on ``U^T U`` (:func:`loopprobe.linalg.operator_norm_krylov`; ``tol`` on the
    Ritz residual; far fewer iterations when the top singular values are close, memory
    ``max_iter`` vectors per operator). ``generator`` draws the start vectors and the
    probe direction w; ``seed`` fixes torch's RNG for every model evaluation (same
    dropout masks throughout); ``chunk_size`` bounds how many operators are batched at
    once (memory); ``chunk_size=0`` evaluates them one by one in a Python loop (the
    unbatched baseline, and a fallback for models ``torch.vmap`` cannot batch).
    Reference: seed 002, Eq. 12 (``||U_{r,j}|| <= C_U beta/alpha``).
    """
    call = "sensitivity_norms"
    if method not in ("power", "lanczos"):
        raise ValueError(f"{call}: method={method!r}; choose 'power' or 'lanczos'")
    if visits is None:
        every = probe.visits(inputs, forward=forward, output=output, seed=seed)
        visits = [v for v in every if v.grad_visible]
    visits = list(visits)
    if not visits:
        raise ValueError(
            f"{call}: no visit is gradient-visible from F; check output= (F must depend on "
            "the looped sublayers with gradient enabled)"
        )
    jac = VisitJacobian(probe, inputs, visits, forward=forward, output=output, seed=seed, call=call)
    ops, keys = _operators(visits)
    masks = jac.masks(ops)
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    jac.vjp_fn()
    assert jac.F0 is not None
    m = jac.F0.numel()
    ests = _estimate(jac, ops, masks, gen, method, max_iter, tol, chunk_size, call)
    w = torch.randn(m, generator=gen, dtype=torch.float64).to(jac.dtype).to(jac.device)
    w = w / w.norm()
    per = jac.transpose_all(w)
    UTw = {}
    for j in sorted({v.j for v in visits}):
        UTw[j] = torch.stack([per[k] for k, v in enumerate(visits) if v.j == j])
    names = [g.sublayer.name for g in jac.groups]
    visit_norms = [ests[b] for b, key in enumerate(keys) if key[0] == "visit"]
    tied = {key[1]: ests[b] for b, key in enumerate(keys) if key[0] == "tied"}
    for k, v in enumerate(visits):
        if v.j not in tied and sum(w.j == v.j for w in visits) == 1:
            tied[v.j] = visit_norms[k]
    return Sensitivity(visits, names, visit_norms, tied, UTw, float(jac.F0.norm()), method)


def _operators(visits: Sequence[Visit]) -> tuple[list[list[int]], list[tuple[str, int]]]:
    """One operator per visit, plus one tied operator per sublayer with >= 2 visits (with
    a single visit the tied map *is* the visit map and shares its estimate)."""
    ops: list[list[int]] = [[k] for k in range(len(visits))]
    keys: list[tuple[str, int]] = [("visit", v.i) for v in visits]
    for j in sorted({v.j for v in visits}):
        mine = [k for k, v in enumerate(visits) if v.j == j]
        if len(mine) > 1:
            ops.append(mine)
            keys.append(("tied", j))
    return ops, keys


def _estimate(jac, ops, masks, gen, method, max_iter, tol, chunk_size, call) -> list[Estimate]:
    n_of = [jac.n[ks[0]] for ks in ops]
    v0 = torch.randn(len(ops), jac.n_max, generator=gen, dtype=torch.float64)
    v0 = v0.to(jac.dtype).to(jac.device)
    for b, n in enumerate(n_of):
        v0[b, n:] = 0
    adj_tol = 1e-7 if jac.dtype == torch.float64 else 1e-2
    last: dict[str, torch.Tensor] = {}

    def matvec(v: torch.Tensor) -> torch.Tensor:
        last["v"] = v
        return jac.matvec(v, masks, chunk_size)

    def rmatvec(u: torch.Tensor) -> torch.Tensor:
        w = jac.rmatvec(u, masks, chunk_size)
        # Adjointness <U^T U v, v> = ||U v||^2, up to roundoff on the scale of ||U||^2.
        uu = (u * u).sum(1)
        wv = (w * last["v"]).sum(1) / last["v"].square().sum(1).clamp_min(1e-300)
        uu = uu / last["v"].square().sum(1).clamp_min(1e-300)
        scale = torch.maximum(last.get("scale", uu), uu)
        last["scale"] = scale
        bad = (wv - uu).abs() > adj_tol * scale + 1e-300
        if bool(bad.any()):
            b = int(bad.nonzero()[0])
            raise RuntimeError(
                f"{call}: the JVP and VJP of operator {b} disagree "
                f"(<U^T U v, v> = {float(wv[b]):.6g} but ||U v||^2 = {float(uu[b]):.6g}): "
                "forward-mode tangents pass where the backward graph does not (a no_grad "
                "region or .data use after a visit), or the model's randomness is not "
                "controlled by torch's RNG; exclude that visit or make the forward deterministic"
            )
        return w

    if tol is None:
        tol = 1e-10 if jac.dtype == torch.float64 else 1e-5
    solver = operator_norm if method == "power" else operator_norm_krylov
    return solver(matvec, rmatvec, v0, max_iter=max_iter, tol=tol)
