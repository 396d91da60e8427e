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
One forward-mode product of the whole graph (a random offset at every visit) and each
iteration check ``<U^T U v, v> = ||U v||^2``: a mismatch means forward-mode tangents and
the backward graph disagree (a ``no_grad`` region after a visit, or randomness that the
seed does not control) and raises instead of returning a number.
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

from loopprobe._html import HTMLView
from loopprobe._memory import auto_chunk_size
from loopprobe.differentiate.jacobian import VisitJacobian
from loopprobe.estimate.sensitivity_clusters import clustered_tops, second_starts
from loopprobe.estimate.sensitivity_runs import (  # noqa: F401 - default_tol: public here too
    RunContext,
    _estimate,
    _product_groups,
    beaten,
    default_tol,
    forward_probe,
    graph_copy,
    missed_note,
    outside_reads,
    precision_note,
    repair_tops,
    still_valid,
    tied_on_visits,
    visits_on_tied,
)
from loopprobe.estimate.sensitivity_starts import WARM_VISITS_N, _phases, _start, _warm_start
from loopprobe.linalg import Estimate, StopRule
from loopprobe.precision import lowest_precision
from loopprobe.record.probe import Probe
from loopprobe.record.types import Forward, Output, Visit


@dataclass
class Sensitivity(HTMLView):
    """Operator norms ``||U_{r,j}||`` per visit and ``||sum_r U_{r,j}||`` per sublayer.

    ``visits[k]`` and ``visit_norms[k]`` line up; ``tied_norms[j]`` is keyed by sublayer
    index. ``UTw[j]`` has one row ``U_{r,j}^T w`` per included visit of j, for a random unit
    output direction ``w`` (its Gram matrix shows how the visits read the output).
    ``problems``: invariants of the evaluation of F that failed (from
    :class:`~loopprobe.differentiate.jacobian.VisitJacobian`, e.g. F at zero offsets is not
    the model's output), and operators that still missed their top singular value after
    :func:`~loopprobe.estimate.sensitivity_runs.repair_tops`; any makes the result not
    converged. ``basis``: the vectors one
    Lanczos operator held (below ``max_iter``: restarted, :func:`lanczos_basis`). ``eps``:
    machine epsilon of the coarsest dtype any arithmetic of the forward rounds in (a float32
    zero pad does not count, :func:`~loopprobe.precision.dtypes_on_path`; the roundoff allowance
    of :func:`~loopprobe.linalg.norm_bounds`).
    """

    _html_keys = ("F_norm", "method")

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
    memory: str = "full",
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
    ``WARM_VISITS_N`` parameters): the visits are estimated from the last visit number r to
    the first (with ``narrow`` these groups run one after another anyway) and each starts from
    the line ``2 v_{r+1} - v_{r+2}`` through its sublayer's two visits before it (for
    r = R-2 the one), then every tied operator from the sum of its visits' top vectors
    (signs aligned), each plus a small random part (module ``sensitivity_starts``).
    With aligned visits the tied operator's first product
    already gives a lower end that :func:`~loopprobe.estimate.alignment.kappa_interval`
    pairs with ``sum_r ||U_r||`` (measured in benchmarks/bench_kappa_cost.py). An
    earlier order was the reverse (tied first, visits from it: 17-18% fewer
    products than cold starts at the default tolerance, bench_convergence.py --work).
    ``stop`` (replaces ``tol``): a rule over all operators at once, for a quantity computed
    from several norms (:func:`~loopprobe.estimate.alignment.visit_alignment` stops each
    operator once kappa's error bound is met, :class:`~loopprobe.estimate.kappa_bounds.KappaStop`):
    ``stop(ops, sigma, residual)`` gets the
    operator numbers still running (a ``LongTensor``, positions in ``Sensitivity.keys``) and
    the latest estimate and relative residual of *every* operator (NaN: not run yet) and
    returns True for those that may stop; they come back ``converged``. A rule with a
    ``bind(run)`` method gets the :class:`~loopprobe.estimate.sensitivity_runs.RunContext`
    (precision computed in, warm start) before the first product and is replaced by what
    ``bind`` returns.
    ``narrow`` (default): the visit operators run in groups by visit number r, each with
    offsets at the visits ``(r, .)`` only (:meth:`VisitJacobian.restricted`: one more
    forward per group, and its JVPs and VJPs do only the work from visit r on), and each tied
    operator with its own sublayer's visits only (its VJP computes no other sublayer's weight
    gradients); the cross-check's products run on the same kind of copies; ``False``:
    every product carries every visit (the same numbers, more work).
    ``memory``: ``"full"`` (default) forms ``U t`` by reverse over reverse, through the graph
    of the VJP's own backward (fastest; that graph is about one more forward's activations);
    ``"low"`` by forward-mode JVPs, without it (the same numbers to roundoff; at d 256 R 4:
    0.79x the peak for 1.7x the CPU time, benchmarks/bench_kappa_memory.py). Either way the
    batched products run in chunks of one forward's activations and the whole graph waits
    while narrowed groups run (:mod:`loopprobe._memory`: the peak stays near three training
    steps').
    Reference: seed 002, Eq. 12 (``||U_{r,j}|| <= C_U beta/alpha``).
    """
    call = "sensitivity_norms"
    if method not in ("auto", "power", "lanczos"):
        raise ValueError(f"{call}: method={method!r}; choose 'auto', 'power' or 'lanczos'")
    if memory not in ("full", "low"):
        raise ValueError(f"{call}: memory={memory!r}; choose 'full' or 'low'")
    alone = visits is None  # every F-visible visit: Sigma_r U_r^T w is the whole use
    visits, jac = _visible_jacobian(probe, inputs, visits, forward, output, seed, call)
    jac.reverse_over_reverse = memory == "full"
    ops, keys = _operators(visits)
    masks = jac.masks(ops)
    if method == "auto":
        method = choose_method(jac.n_max, max_iter, jac.dtype)
    basis = lanczos_basis(jac.n_max, max_iter, jac.dtype) if method == "lanczos" else 0
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    # the chunk first: its probing forward and the VJP graph are never held at once
    chunk_size = auto_chunk_size(jac, len(ops)) if chunk_size is None else chunk_size
    jac.vjp_fn()
    assert jac.F0 is not None
    m = jac.F0.numel()
    ranks = probe.ranks  # the global batch's operator (loopprobe.distributed)
    if ranks is None and jac.reverse_over_reverse and chunk_size != 0:
        forward_probe(jac, gen.initial_seed() + 2, call, chunk_size)  # the forward check, once
    if narrow:  # the first products run on narrowed copies: the whole graph can wait
        jac.release()
    v0 = _start(jac, ops, keys, gen, start, call)
    v0 = v0 if ranks is None else ranks.mean(v0)  # the same start vectors on every rank
    vectors = torch.empty_like(v0)
    if warm_visits is None:
        warm_visits = jac.n_max >= WARM_VISITS_N
    low = lowest_precision(jac.dtypes)
    eps = float(torch.finfo(low).eps)
    if hasattr(stop, "bind"):  # a rule that needs the precision and the warm start
        stop = stop.bind(RunContext(low, eps, bool(warm_visits and start is None)))
    phases = (
        _phases(visits, keys, narrow) if start is None and warm_visits else [[*range(len(ops))]]
    )
    group = len(ops)
    if method == "lanczos":
        group = lanczos_group(len(ops), jac.n_max, max_iter, jac.dtype)
    state = torch.full((2, len(ops)), float("nan"), dtype=torch.float64)  # sigma, residual
    estimate = partial(
        _estimate, method=method, max_iter=max_iter, tol=tol, chunk_size=chunk_size,
        call=call, ranks=ranks, basis=basis, stop=stop, state=state,
    )  # fmt: skip

    made: dict = {}  # the first cross-check's tied rows, made on the tied runs' copies

    def run(rows: list[int], first: bool = False) -> list[Estimate]:  # groups that fit
        out: dict[int, Estimate] = {}
        for ks, part in _product_groups(visits, ops, rows, narrow):
            sub, sub_masks = graph_copy(jac, masks, ks)  # the whole graph waits meanwhile
            for at in range(0, len(part), group):
                g = part[at : at + group]
                out.update(zip(g, estimate(sub, sub_masks[g], v0[g], vectors, g), strict=True))
            if first and sub is not jac:  # the visits ran before: their vectors are final
                est = {**found, **out}
                made.update(tied_on_visits(sub, sub_masks, visits, keys, vectors, est, part,
                                           eps, chunk_size, ranks))  # fmt: skip
            del sub  # its VJP graph
        return [out[b] for b in rows]

    found: dict[int, Estimate] = {}
    for phase in phases:  # each from the top vectors of the phases before it
        _warm_start(phase, visits, keys, found, vectors, v0)
        found.update(zip(phase, run(phase, first=True), strict=True))
    again = torch.Generator(device=gen.device).manual_seed(gen.initial_seed() + 1)
    n_of = [jac.n[ks[0]] for ks in ops]
    groups = partial(_product_groups, visits, ops, narrow=narrow)
    on_tied = [visits_on_tied(jac, masks, visits, keys, vectors, chunk_size, ranks, groups)]
    tops = clustered_tops(visits, keys, vectors, found, low, on_tied[0])
    second_starts(run, v0, vectors, found, tops, n_of, again, ranks)
    near = {visits[b].j for b in tops}  # sublayers with a cluster seen: neighbours too

    def check() -> dict:  # the first reads the products made before (on vectors still theirs)
        known = {**on_tied.pop(), **still_valid(made, vectors)} if on_tied else None
        return beaten(jac, masks, visits, keys, vectors, found, eps, chunk_size, ranks, near,
                      known, groups)  # fmt: skip

    def unmet() -> list[int]:  # operators the stopping rule would not stop now
        if stop is None:
            return []
        sigma = torch.tensor([found[b].value for b in range(len(ops))], dtype=torch.float64)
        res = torch.tensor([found[b].residual for b in range(len(ops))], dtype=torch.float64)
        may = stop(torch.arange(len(ops)), sigma, res)
        return [b for b in range(len(ops)) if not bool(may[b])]

    left = repair_tops(run, v0, vectors, found, check, unmet)

    def label(b: int) -> str:  # visit operators come first, in the order of ``visits``
        if keys[b][0] == "visit":
            return f"{visits[b].sublayer} r={visits[b].r}"
        return f"{jac.groups[keys[b][1]].sublayer.name} (tied)"

    ests = [found[b] for b in range(len(ops))]
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
    problems += missed_note([label(b) for b in left])  # operators that missed their top
    if alone and ranks is None:  # visit_alignment checks the same through sum_r G
        problems += outside_reads(jac, per, w, eps)
    return Sensitivity(
        visits, names, visit_norms, tied, UTw, F_norm, method, mode, precision, vectors, keys,
        problems, basis, eps,
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
