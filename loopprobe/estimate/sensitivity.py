"""Per-visit sensitivities ``U_{r,j}``: operator norms of ``delta_{r,j} -> dF`` by Lanczos.

``U_{r,j}`` is the linear map from a perturbation of sublayer j's parameters at visit
``(r, j)`` alone to the change of the output F (the whole batch tensor, flattened); the
tied map ``sum_r U_{r,j}`` perturbs every visit of j by the same vector. Its action on a
direction is one JVP (``torch.func.jvp``), its transpose one VJP (``torch.func.vjp``),
and ``||U||`` is the top singular value, found by Lanczos on ``U^T U`` (the default;
:func:`loopprobe.linalg.operator_norm_krylov`, restarted with a capped basis where a full
one would not fit in memory) or by power iteration (``method="power"``,
:func:`loopprobe.linalg.operator_norm`). Either way ``converged`` is judged on the Ritz
residual of the returned value (``Estimate.residual``), not on how much it last changed.

All operators (every visit and every tied sum) are estimated together: the function
``F(delta_1, ..., delta_M)`` is evaluated once unbatched (so data-dependent control flow
such as ACT halting works), tangents and cotangents are batched with ``torch.vmap``, and
the VJP graph is built once and reused by every iteration. No dense Jacobian is formed.
Each iteration checks ``<U^T U v, v> = ||U v||^2``: a mismatch means forward-mode
tangents and the backward graph disagree (a ``no_grad`` region after a visit, or
randomness that the seed does not control) and raises instead of returning a number.
:func:`sensitivity_operators` hands the same products to other tools: every ``U`` as a
``scipy.sparse.linalg.LinearOperator`` (``svds``, ``eigsh``, curvature libraries).
Reference: seed 002, Eq. 11-12 and Assumption 3.1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import pandas as pd
import torch

from loopprobe._memory import auto_chunk_size
from loopprobe.autodiff import is_half, lowest_precision
from loopprobe.differentiate.jacobian import VisitJacobian
from loopprobe.linalg import Estimate, StopRule, operator_norm, operator_norm_krylov
from loopprobe.record.probe import Probe
from loopprobe.record.types import Forward, Output, Visit


@dataclass
class Sensitivity:
    """Operator norms ``||U_{r,j}||`` per visit and ``||sum_r U_{r,j}||`` per sublayer.

    ``visits[k]`` and ``visit_norms[k]`` line up; ``tied_norms[j]`` is keyed by sublayer
    index. ``UTw[j]`` has one row ``U_{r,j}^T w`` per included visit of j, for a random unit
    output direction ``w`` (its Gram matrix shows how the visits read the output).
    ``problems``: invariants of the evaluation of F that failed (from
    :class:`~loopprobe.differentiate.jacobian.VisitJacobian`, e.g. F at zero offsets is not
    the model's output); any makes the result not converged. ``basis``: the vectors one
    Lanczos operator held (below ``max_iter``: restarted, :func:`lanczos_basis`). ``eps``:
    machine epsilon of the lowest precision the forward computes in (the roundoff allowance
    of :func:`~loopprobe.linalg.norm_bounds`).
    """

    visits: list[Visit]
    sublayers: list[str]
    visit_norms: list[Estimate]
    tied_norms: dict[int, Estimate]
    UTw: dict[int, torch.Tensor] = field(default_factory=dict)
    F_norm: float = float("nan")
    method: str = "power"
    jvp_mode: str = "forward mode"
    precision: str = ""
    vectors: torch.Tensor | None = field(default=None, repr=False)
    keys: list[tuple[str, int]] = field(default_factory=list, repr=False)
    problems: list[str] = field(default_factory=list)
    basis: int = 0
    eps: float = float(torch.finfo(torch.float64).eps)

    def start_vectors(self) -> dict[tuple[str, int], torch.Tensor]:
        """Each operator's top right singular vector estimate, keyed ``("visit", i)`` or
        ``("tied", j)``: what ``sensitivity_norms(start=...)`` restarts from."""
        if self.vectors is None:
            return {}
        return dict(zip(self.keys, self.vectors, strict=True))

    @property
    def converged(self) -> bool:
        """Every operator-norm estimate (each visit and each tied sum) converged (its residual
        certificate holds) and no invariant of the evaluation of F failed."""
        return not self.problems and self._norms_converged

    @property
    def _norms_converged(self) -> bool:
        return all(e.converged for e in (*self.visit_norms, *self.tied_norms.values()))

    @property
    def reason(self) -> str:
        """What did not converge, in words ("" when everything did)."""
        if self._norms_converged:
            return "; ".join(self.problems)
        bad = [
            f"{v.sublayer} r={v.r}"
            for v, e in zip(self.visits, self.visit_norms, strict=True)
            if not e.converged
        ]
        bad += [
            f"{self.sublayers[j]} (tied)" for j, e in self.tied_norms.items() if not e.converged
        ]
        ests = [*self.visit_norms, *self.tied_norms.values()]
        it = max(e.iterations for e in ests)
        worst = max((e.residual for e in ests if not e.converged), default=float("nan"))
        text = f"{len(bad)} operator-norm estimate(s) not converged after up to {it} iterations"
        text += f" ({self.method}): " + ", ".join(bad[:6]) + (" ..." if len(bad) > 6 else "")
        text += f"; largest relative Ritz residual {worst:.2g}"
        if "not certified" in self.precision:
            text += f"; precision: {self.precision}"
        return "; ".join([text, *self.problems])

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
                    "residual": est.residual,
                    "method": est.method,
                }
            )
        df = pd.DataFrame(rows)
        df.attrs.update(converged=self.converged, reason=self.reason, jvp=self.jvp_mode)
        df.attrs["precision"] = self.precision
        return df


def sensitivity_norms(
    probe: Probe,
    inputs: Any,
    *,
    forward: Forward | None = None,
    output: Output | None = None,
    visits: Sequence[Visit] | None = None,
    method: str = "auto",
    max_iter: int = 100,
    tol: float | None = None,
    generator: torch.Generator | None = None,
    seed: int | None = 0,
    chunk_size: int | None = None,
    start: Any = None,
    warm_visits: bool | None = None,
    stop: StopRule | None = None,
    narrow: bool = True,
) -> Sensitivity:
    """``||U_{r,j}||`` for every included visit and ``||sum_r U_{r,j}||`` for every sublayer.

    ``visits``: which visits carry an offset (default: the gradient-visible ones, measured
    with respect to F). Operators are estimated in one batch: ``method="auto"`` (the
    default) is Lanczos (:func:`choose_method`; operators whose bases do not fit together in
    1 GiB run in groups, :func:`lanczos_group`, and an operator whose own basis does not fit
    restarts with a capped one, :func:`lanczos_basis`); ``method="power"`` by
    power iteration (``tol`` on the relative change of the estimate; default from the
    lowest precision the forward computes in: 1e-10 in float64, 1e-5 in float32, see
    :func:`default_tol`; converged only once the Ritz residual, the Lanczos certificate,
    is also below the Lanczos tolerance, or ``tol`` where that is looser), ``"lanczos"`` by
    Lanczos on ``U^T U`` (:func:`loopprobe.linalg.operator_norm_krylov`; ``tol`` on the
    relative Ritz residual, a bound on the error of ``||U||^2``: default 1e-6 in float64,
    1e-5 in float32; far fewer iterations when the top singular values are close, memory
    ``max_iter`` vectors per operator). ``generator`` draws the start vectors and the
    probe direction w; ``seed`` fixes torch's RNG for every model evaluation (same
    dropout masks throughout); ``chunk_size`` bounds how many operators are batched at
    once (memory); ``chunk_size=0`` evaluates them one by one in a Python loop (the
    unbatched baseline, and a fallback for models ``torch.vmap`` cannot batch).
    ``start``: a warm start, the :class:`Sensitivity` (or an :class:`AlignmentReport`
    holding one) of an earlier call on the same model, e.g. a few hundred training steps
    before: every operator starts from its earlier top right singular vector (matched by
    visit index and sublayer; operators it lacks start at random), which converges in a
    few iterations while the model has drifted little. Only the start changes: the
    tolerance, the stopping rule and the ``converged`` flags are those of a cold start;
    like every Krylov start, it finds the top singular value only if it overlaps its
    vector (after large changes, e.g. a loss spike, start cold).
    A tensor ``(operators, n_max)`` in the order of ``Sensitivity.keys`` is accepted too.
    ``warm_visits`` (without ``start``; default ``None``: when an operator has at least
    ``WARM_VISITS_N`` parameters, where products outweigh the per-iteration overhead of
    the second phase): the tied operators are estimated first
    and every visit operator of sublayer j then starts from the top vector of
    ``sum_r U_{r,j}`` (the visits of a sublayer read the output through nearly the same
    direction) plus a random part of relative size ``VISIT_NOISE``. Measured on LoopedGPT
    (benchmarks/bench_convergence.py --work): 17-18% fewer operator products at the
    default tolerance, 41-49% fewer at ``tol=1e-4``; the second phase adds sequential
    iterations: CPU time +83% at d_model 16 (n 2048), +15% at 32 (n 8192), -13% at 64
    (n 32768), hence the default.
    ``stop`` (replaces ``tol``): a rule over all operators at once, for a quantity computed
    from several norms (:func:`~loopprobe.estimate.alignment.visit_alignment` stops each
    operator once kappa's error bound is met): ``stop(ops, sigma, residual)`` gets the
    operator numbers still running (a ``LongTensor``, positions in ``Sensitivity.keys``) and
    the latest estimate and relative residual of *every* operator (NaN: not run yet) and
    returns True for those that may stop; they come back ``converged``.
    ``narrow`` (default): the visit operators run in groups by visit number r, each with
    offsets at the visits ``(r, .)`` only (:meth:`VisitJacobian.restricted`: one more
    forward per group, and its JVPs and VJPs do only the work from visit r on); ``False``:
    every product carries every visit (the same numbers, more work).
    Reference: seed 002, Eq. 12 (``||U_{r,j}|| <= C_U beta/alpha``).
    """
    call = "sensitivity_norms"
    if method not in ("auto", "power", "lanczos"):
        raise ValueError(f"{call}: method={method!r}; choose 'auto', 'power' or 'lanczos'")
    visits, jac = _visible_jacobian(probe, inputs, visits, forward, output, seed, call)
    ops, keys = _operators(visits)
    masks = jac.masks(ops)
    if method == "auto":
        method = choose_method(jac.n_max, max_iter, jac.dtype)
    basis = lanczos_basis(jac.n_max, max_iter, jac.dtype) if method == "lanczos" else 0
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    jac.vjp_fn()
    assert jac.F0 is not None
    m = jac.F0.numel()
    chunk_size = auto_chunk_size(jac, len(ops)) if chunk_size is None else chunk_size
    ranks = probe.ranks  # the global batch's operator (loopprobe.distributed)
    v0 = _start(jac, ops, keys, gen, start, call)
    v0 = v0 if ranks is None else ranks.mean(v0)  # the same start vectors on every rank
    vectors = torch.empty_like(v0)
    if warm_visits is None:
        warm_visits = jac.n_max >= WARM_VISITS_N
    first = _first_phase(visits, keys) if start is None and warm_visits else [*range(len(ops))]
    group = len(ops)
    if method == "lanczos":
        group = lanczos_group(len(ops), jac.n_max, max_iter, jac.dtype)
    state = torch.full((2, len(ops)), float("nan"), dtype=torch.float64)  # sigma, residual
    estimate = partial(
        _estimate, method=method, max_iter=max_iter, tol=tol, chunk_size=chunk_size,
        call=call, ranks=ranks, basis=basis, stop=stop, state=state,
    )  # fmt: skip

    def run(rows: list[int]) -> list[Estimate]:  # in groups whose Krylov bases fit
        out: dict[int, Estimate] = {}
        for ks, part in _product_groups(visits, ops, rows, narrow):
            sub = jac if len(ks) == len(visits) else jac.restricted(ks)
            sub_masks = masks if sub is jac else masks[:, ks]  # restricted() may refuse
            for at in range(0, len(part), group):
                g = part[at : at + group]
                out.update(zip(g, estimate(sub, sub_masks[g], v0[g], vectors, g), strict=True))
            del sub  # its VJP graph
        return [out[b] for b in rows]

    ests = dict(zip(first, run(list(first)), strict=True))
    rest = [b for b in range(len(ops)) if b not in ests]
    if rest:  # every visit from its sublayer's tied top vector, plus a random part
        tied_of = {key[1]: b for b, key in enumerate(keys) if key[0] == "tied"}
        for b in rest:
            top = vectors[tied_of[visits[b].j]]
            v0[b] = top / top.norm().clamp_min(1e-300) + VISIT_NOISE * v0[b] / v0[b].norm()
        ests.update(zip(rest, run(rest), strict=True))
    ests = [ests[b] for b in range(len(ops))]
    precision, certified = precision_note(jac.dtypes)
    if not certified:
        ests = [replace(e, converged=False) for e in ests]
    w = torch.randn(m, generator=gen, dtype=torch.float64, device=gen.device)
    w = w.to(jac.dtype).to(jac.device)
    w = w / (w.norm() if ranks is None else ranks.sum(w.square().sum()).sqrt())
    per = [t if ranks is None else ranks.sum(t) for t in jac.transpose_all(w)]
    F_norm = jac.F0.norm() if ranks is None else ranks.sum(jac.F0.square().sum()).sqrt()
    UTw = {}
    for j in sorted({v.j for v in visits}):
        UTw[j] = torch.stack([per[k] for k, v in enumerate(visits) if v.j == j])
    names = [g.sublayer.name for g in jac.groups]
    visit_norms = [ests[b] for b, key in enumerate(keys) if key[0] == "visit"]
    tied = {key[1]: ests[b] for b, key in enumerate(keys) if key[0] == "tied"}
    for k, v in enumerate(visits):
        if v.j not in tied and sum(w.j == v.j for w in visits) == 1:
            tied[v.j] = visit_norms[k]
    F_norm, mode = float(F_norm), jac.jvp.mode
    problems = list(getattr(jac, "problems", []))  # invariants of F that failed
    return Sensitivity(
        visits, names, visit_norms, tied, UTw, F_norm, method, mode, precision, vectors, keys,
        problems, basis, float(torch.finfo(lowest_precision(jac.dtypes)).eps),
    )  # fmt: skip


def sensitivity_operators(
    probe: Probe,
    inputs: Any,
    *,
    forward: Forward | None = None,
    output: Output | None = None,
    visits: Sequence[Visit] | None = None,
    seed: int | None = 0,
    chunk_size: int | None = None,
) -> dict[tuple[str, int | str], Any]:
    """Every per-visit map ``U_{r,j}`` and every tied map ``sum_r U_{r,j}`` as a
    ``scipy.sparse.linalg.LinearOperator``, for tools that take one (``svds``, ``eigsh`` on
    ``U^T U``, ``lsqr``, curvature and spectrum libraries).

    Keys: ``(sublayer, r)`` for the visit r of a sublayer, ``(sublayer, "tied")`` for the
    sum over its included visits (every sublayer has one). Each operator has shape
    ``(F.numel(), n_j)`` and dtype float64, takes and returns numpy arrays, and computes in
    the model's dtype: ``op @ v`` (``matvec``/``matmat``) is ``U v``, one JVP vmapped over
    the columns, ``op.T @ u`` (``rmatvec``/``rmatmat``) is ``U^T u`` through one VJP graph
    shared by all operators, the products :func:`sensitivity_norms` iterates on (so
    ``svds(op, k=1)`` gives its ``||U||``). ``visits``, ``forward``, ``output``, ``seed``:
    as in :func:`sensitivity_norms`; ``chunk_size`` bounds how many columns one vmapped
    product carries (default from free memory; ``0`` one at a time). With DDP
    (``probe.ranks``) an operator is this process's block of the global one.
    Raises ``RuntimeError`` when F at zero offsets is not the model's output (the
    operators would not be the model's). Reference: seed 002, Eq. 11.

    Example::

        ops = lp.sensitivity_operators(lp.attach(model), x)
        top = scipy.sparse.linalg.svds(ops[("block", 0)], k=1, return_singular_vectors=False)
    """
    call = "sensitivity_operators"
    visits, jac = _visible_jacobian(probe, inputs, visits, forward, output, seed, call)
    jac.vjp_fn()
    if jac.problems:
        raise RuntimeError(f"{call}: " + "; ".join(jac.problems))
    chunk_size = auto_chunk_size(jac, jac.n_max) if chunk_size is None else chunk_size
    out: dict[tuple[str, int | str], Any] = {}
    for k, v in enumerate(visits):
        out[(v.sublayer, v.r)] = jac.linear_operator([k], chunk_size)
    for j in sorted({v.j for v in visits}):
        mine = [k for k, v in enumerate(visits) if v.j == j]
        out[(visits[mine[0]].sublayer, "tied")] = jac.linear_operator(mine, chunk_size)
    return out


def _visible_jacobian(probe, inputs, visits, forward, output, seed, call) -> tuple:
    """The visits measured (default: the gradient-visible ones) and their VisitJacobian."""
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
    return visits, jac


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


LANCZOS_BYTES = 2**30


def choose_method(n: int, max_iter: int, dtype: torch.dtype) -> str:
    """``"lanczos"`` at every size: operators whose bases do not fit in ``LANCZOS_BYTES``
    (1 GiB) together run in groups (:func:`lanczos_group`), and one whose own basis
    (``max_iter x n`` numbers) does not fit restarts with the basis that does
    (:func:`lanczos_basis`). Power iteration only when asked for (``method="power"``): on
    the reference models Lanczos converges in 17-35 iterations where power iteration has
    not after 100 (README), and power's stopping rule needs a residual check to be
    trusted (:func:`loopprobe.linalg.operator_norm`)."""
    return "lanczos"


def lanczos_basis(n: int, max_iter: int, dtype: torch.dtype) -> int:
    """How many vectors one Lanczos operator holds: ``max_iter`` while they fit in
    ``LANCZOS_BYTES``, else as many as fit (at least 2); below ``max_iter`` the operator
    restarts from its top Ritz vector each time its basis is full
    (:func:`loopprobe.linalg.operator_norm_krylov`)."""
    fit = LANCZOS_BYTES // _basis_bytes(n, 1, dtype)
    return int(max(2, min(max_iter, fit)))


def lanczos_group(operators: int, n: int, max_iter: int, dtype: torch.dtype) -> int:
    """How many operators one Lanczos run carries: as many as have their bases
    (``max_iter x n`` numbers each, or the capped :func:`lanczos_basis`) in ``LANCZOS_BYTES``
    together, at least 1. The groups run one after another; each product still batches
    its group's operators."""
    basis = lanczos_basis(n, max_iter, dtype)
    return max(1, min(operators, LANCZOS_BYTES // _basis_bytes(n, basis, dtype)))


def _basis_bytes(n: int, max_iter: int, dtype: torch.dtype) -> int:
    return max(1, max_iter * n * torch.finfo(dtype).bits // 8)


def default_tol(dtype: torch.dtype, method: str = "power") -> float:
    """The default stopping tolerance. Power iteration (relative change of the estimate):
    1e-10 in float64. Lanczos (relative Ritz residual ``r / theta``): 1e-6 in float64, because
    an eigenvalue of ``U^T U`` lies within ``r`` of the Ritz value ``theta``, so ``||U||^2``
    is within 1e-6 and ``||U||`` within 5e-7 relative of the top value the Krylov space
    holds (the actual error is about ``r^2 / gap``, far smaller: README, issue 18.2). Both
    methods: 1e-5 in float32; half precision 1e-3, and its estimates are never reported
    converged (see ``precision``)."""
    if is_half(dtype):
        return 1e-3
    if dtype != torch.float64:
        return 1e-5
    return 1e-6 if method == "lanczos" else 1e-10


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _names(dtypes: set[torch.dtype]) -> str:
    return ", ".join(sorted(_name(d) for d in dtypes)) or "none"


def precision_note(dtypes: set[torch.dtype]) -> tuple[str, bool]:
    """What the path computes in, and whether estimates can be certified in it."""
    low = lowest_precision(dtypes)
    text = _names(dtypes)
    if len(dtypes) > 1:
        text += f" (mixed: tolerances from {_name(low)})"
    if is_half(low):
        eps = torch.finfo(low).eps
        return (
            f"{text}; {_name(low)} roundoff (eps {eps:.1g}) is the precision floor: estimates "
            "are not certified; cast the model to float32 or float64 to certify them",
            False,
        )
    return text, True


#: Relative size of the random part mixed into a visit's start from its tied operator's
#: vector (``warm_visits``): a top direction the tied vector misses can still be found
#: (measured under a Ritz-gap stopping rule: about one iteration more than none; not
#: re-measured under the residual rule in use).
VISIT_NOISE = 0.1
#: ``warm_visits=None`` turns the two phases on from this operator size (parameters).
WARM_VISITS_N = 16384


def _first_phase(visits, keys) -> list[int]:
    """The operators estimated first under ``warm_visits``: the tied ones, and the visits
    of sublayers that have none (a single visit); the other visits start from them."""
    tied = {key[1] for key in keys if key[0] == "tied"}
    return [b for b, key in enumerate(keys) if key[0] == "tied" or visits[b].j not in tied]


def _start(jac, ops, keys, gen, start, call) -> torch.Tensor:
    """Start vectors ``(operators, n_max)``: random, or an earlier call's top vectors.

    A warm start is the old vector as it is: any random part large enough to matter keeps
    the Ritz residual above the tolerance for as many iterations as it takes to remove it
    (with a part of 1e-5, a start at the exact answer took more than 3), so a top singular value
    that moved to a direction orthogonal to the old vector is found only through the
    drift and roundoff components, as the docstring of ``sensitivity_norms`` says."""
    n_of = [jac.n[ks[0]] for ks in ops]
    v0 = torch.randn(len(ops), jac.n_max, generator=gen, dtype=torch.float64, device=gen.device)
    v0 = v0.to(jac.dtype).to(jac.device)
    for b, n in enumerate(n_of):
        v0[b, n:] = 0
    if start is None:
        return v0
    old = _warm_vectors(start, keys, jac.n_max, call)
    for b, key in enumerate(keys):
        prev = old.get(key)
        if prev is None or not bool(prev[: n_of[b]].any()):
            continue
        v0[b] = prev.to(jac.dtype).to(jac.device)
    return v0


def _warm_vectors(start, keys, n_max, call) -> dict:
    start = getattr(start, "sensitivity", start)  # an AlignmentReport holds one
    if isinstance(start, Sensitivity):
        if start.vectors is None:
            raise ValueError(
                f"{call}: start= is a Sensitivity without vectors; pass the "
                "result of a sensitivity_norms call (or start=None)"
            )
        old = start.start_vectors()
    elif isinstance(start, torch.Tensor):
        if start.dim() != 2 or start.shape[0] != len(keys):
            raise ValueError(
                f"{call}: start= has shape {tuple(start.shape)}; a tensor start needs one "
                f"row per operator, ({len(keys)}, {n_max}), in the order of Sensitivity.keys"
            )
        old = dict(zip(keys, start, strict=True))
    else:
        raise TypeError(
            f"{call}: start= is a {type(start).__name__}; pass an earlier Sensitivity, an "
            "AlignmentReport, a tensor (operators, n_max), or None for a random start"
        )
    width = {v.shape[-1] for v in old.values()}
    if width and width != {n_max}:
        raise ValueError(
            f"{call}: start= vectors have length {sorted(width)} but this model's operators "
            f"need {n_max}: the start comes from another model; pass start=None"
        )
    return old


def _product_groups(visits, ops, rows, narrow: bool) -> list[tuple[list[int], list[int]]]:
    """The operators ``rows`` by the visits their products need: ``(ks, operators)``, where
    ``ks`` are the visits that carry offsets. Tied operators need every visit; with
    ``narrow`` the operators of the r-th visits of all sublayers share the visits ``(r, .)``
    alone (their JVPs start at visit r, their VJPs end there), else every visit."""
    every = list(range(len(visits)))
    by: dict[Any, list[int]] = {}
    for b in rows:
        key = visits[ops[b][0]].r if narrow and len(ops[b]) == 1 else "all"
        by.setdefault(key, []).append(b)
    out = []
    for key, part in by.items():
        ks = every if key == "all" else sorted(ops[b][0] for b in part)
        out.append((ks, part))
    return out


def _estimate(
    jac,
    masks,
    v0,
    vectors,
    rows,
    *,
    method,
    max_iter,
    tol,
    chunk_size,
    call,
    ranks=None,
    basis=0,
    stop=None,
    state=None,
) -> list[Estimate]:
    """Estimates for the operators ``rows`` (their masks and start vectors given); their top
    vectors land in ``vectors[rows]``. With ``ranks`` the operator is the global batch's: its
    blocks ``U^{(q)}`` live on the ranks, the start vectors are identical on every rank,
    ``U v`` carries one extra entry holding the other ranks' part of ``||U v||`` and
    ``U^T u`` is summed over ranks, so the solver sees ``U^T U = sum_q U^{(q)T} U^{(q)}``."""
    low = lowest_precision(jac.dtypes)
    adj_tol = 1e-7 if low == torch.float64 else 1e-2 if not is_half(low) else 1e-1
    last: dict[str, torch.Tensor] = {}
    scale = torch.zeros(len(v0), dtype=v0.dtype, device=v0.device)

    def matvec(v: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        last["v"], last["idx"] = v, idx
        u = jac.matvec(v, masks[idx], chunk_size)
        if ranks is None:
            return u
        mine = u.square().sum(1)
        others = (ranks.sum(mine) - mine).clamp_min(0).sqrt()
        return torch.cat([u, others[:, None]], 1)

    def rmatvec(u: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        w = jac.rmatvec(u if ranks is None else u[:, :-1], masks[idx], chunk_size)
        w = w if ranks is None else ranks.sum(w)
        # Adjointness <U^T U v, v> = ||U v||^2, up to roundoff on the scale of ||U||^2.
        v = last["v"][torch.isin(last["idx"], idx)]  # the solver may have dropped rows
        vv = v.square().sum(1).clamp_min(1e-300)
        wv = (w * v).sum(1) / vv
        uu = (u * u).sum(1) / vv
        scale[idx] = torch.maximum(scale[idx], uu)
        gap = (wv - uu).abs() / scale[idx].clamp_min(1e-300)
        bad = gap > adj_tol
        if bool(bad.any()):
            b = rows[int(idx[int(bad.nonzero()[0])])]  # the operator number in the whole call
            raise RuntimeError(
                f"{call}: the JVP and VJP of operator {b} disagree: <U^T U v, v> = "
                f"{float(wv[bad][0]):.10g} but ||U v||^2 = {float(uu[bad][0]):.10g}, a "
                f"relative gap of {float(gap[bad][0]):.2g} > {adj_tol:g} (the tolerance for "
                f"{_name(low)}, the lowest precision computed in: {_names(jac.dtypes)}). "
                "Causes: forward-mode tangents pass where the backward graph does not (a "
                "no_grad region or .data "
                "use after a visit), randomness that torch's RNG does not control, or "
                "roundoff of a dtype the model casts to internally; exclude that visit or make "
                "the forward deterministic"
            )
        return w

    rtol = default_tol(low, "lanczos")  # the residual certificate, for both methods
    if tol is None:
        tol = default_tol(low, method)
    out = torch.empty_like(v0)
    kw: dict[str, Any] = {"max_iter": max_iter, "out": out, "subset": True}
    if stop is not None:
        ops = torch.as_tensor(rows, dtype=torch.long)

        def rule(idx: torch.Tensor, sigma: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
            state[0, ops[idx]], state[1, ops[idx]] = sigma.double(), res.double()
            return stop(ops[idx], state[0], state[1])

        kw["stop"] = rule
    if method == "power":  # the residual bound at the Lanczos tolerance, or tol if looser
        ests = operator_norm(matvec, rmatvec, v0, tol=tol, rtol=max(tol, rtol), **kw)
    else:
        ests = operator_norm_krylov(matvec, rmatvec, v0, tol=tol, basis=basis or None, **kw)
    vectors[rows] = out
    return ests
