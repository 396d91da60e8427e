"""How :func:`~loopprobe.estimate.sensitivity.sensitivity_norms` runs its operators.

Tolerances and the precision note, the cross-check of the operators' top vectors
(``beaten``, ``repair_tops``), the groups whose products share the visits they carry
(``narrow``: the copies of the graph they run on), and the batched solver call with its
adjointness check ``<U^T U v, v> = ||U v||^2`` on every product. The operators themselves
(which visits, which masks) and the result (:class:`Sensitivity`) are in ``sensitivity``,
their start vectors in ``sensitivity_starts``.
Reference: seed 002, Eq. 12.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from loopprobe.estimate.updates import OUTSIDE_EPS
from loopprobe.linalg import (
    ROUNDOFF_EPS,
    Estimate,
    norm_bounds,
    operator_norm,
    operator_norm_krylov,
)
from loopprobe.precision import is_half, lowest_precision
from loopprobe.record.session import restored
from loopprobe.record.types import call_model, pick_output, seeded


def default_tol(dtype: torch.dtype, method: str = "power") -> float:
    """The default stopping tolerance. Power iteration (relative change of the estimate):
    1e-10 in float64. Lanczos (relative Ritz residual ``r / theta``): 1e-6 in float64, because
    an eigenvalue of ``U^T U`` lies within ``r`` of the Ritz value ``theta``, so ``||U||^2``
    is within 1e-6 and ``||U||`` within 5e-7 relative of the top value the Krylov space
    holds (the actual error is about ``r^2 / gap``, far smaller, as measured). Both
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


@dataclass(frozen=True)
class RunContext:
    """How a :func:`~loopprobe.estimate.sensitivity.sensitivity_norms` call runs, handed to a
    stopping rule's ``bind`` before the first product: ``dtype`` the precision the operators
    are computed in (the coarsest dtype any arithmetic on the path rounds in), ``eps`` its
    machine epsilon, ``warm_visits`` whether the visits start warm."""

    dtype: torch.dtype
    eps: float
    warm_visits: bool


#: Restarts of operators whose top vector another operator's beats (:func:`repair_tops`).
REPAIR_ROUNDS = 2


def rounding_slack(eps: float) -> float:
    """Relative slack between two estimates of one norm reached through different products
    (``sqrt(eps)``: 1.5e-8 in float64, 3.5e-4 in float32): exactly aligned visits give
    ``||sum_r U_r|| = sum_r ||U_r||``, equal up to the estimates' rounding."""
    return max(ROUNDOFF_EPS * eps, eps**0.5)


def tied_families(keys, visits) -> list[tuple[int, list[int]]]:
    """``(t, visits of t)`` for every tied operator t (positions in ``keys``): the operators
    the cross-checks compare with each other."""
    return [(t, [b for b, k in enumerate(keys) if k[0] == "visit" and visits[b].j == key[1]])
            for t, key in enumerate(keys) if key[0] == "tied"]  # fmt: skip


def cross_norms(
    jac, masks, vectors, rows, cols, chunk_size, ranks, known=None, groups=None
) -> list[float]:
    """``||A_b v_c||^2`` for each pair ``(b, c) = (rows[q], cols[q])``: operator b applied to
    the unit top vector of operator c, one batched JVP per copy of the graph over the pairs
    not in ``known`` (a dict ``{(b, c): value}`` of products already made on the same
    vectors). ``groups`` (:func:`_product_groups` over the operators): each operator on the
    copy of the graph its products need (a visit's from its visit number on, a tied
    operator's with its sublayer's visits alone), the whole graph waiting meanwhile; the
    same numbers as on the whole graph, at 0.46-0.89x its CPU time at d 64 R 4 and 8
    (benchmarks/bench_kappa_cross.py). None: every pair on the whole graph."""
    known = {} if known is None else known
    todo = [q for q, pair in enumerate(zip(rows, cols, strict=True)) if pair not in known]
    if todo:
        V = vectors[[cols[q] for q in todo]].double()
        V = (V / V.norm(dim=1, keepdim=True).clamp_min(1e-300)).to(vectors.dtype)
        sq = torch.empty(len(todo), dtype=torch.float64, device=V.device)
        parts = groups(sorted({rows[q] for q in todo})) if groups else [(None, None)]
        for ks, part in parts:
            at = [i for i, q in enumerate(todo) if part is None or rows[q] in part]
            sub, sub_masks = graph_copy(jac, masks, ks, check=False)
            U = sub.matvec(V[at], sub_masks[[rows[todo[i]] for i in at]], chunk_size)
            sq[at] = U.double().square().sum(1)
            del sub  # its VJP graph
        sq = sq if ranks is None else ranks.sum(sq)
        made = zip(todo, sq.tolist(), strict=True)
        known = {**known, **{(rows[q], cols[q]): float(x) for q, x in made}}
    return [known[pair] for pair in zip(rows, cols, strict=True)]


def visits_on_tied(jac, masks, visits, keys, vectors, chunk_size, ranks, groups=None) -> dict:
    """``{(b, t): ||U_b v_t||^2}``: every visit b of a sublayer with a tied operator t applied
    to t's unit top vector, batched per copy of the graph (:func:`cross_norms`); the products both
    :func:`~loopprobe.estimate.sensitivity_clusters.clustered_tops` and the first
    :func:`beaten` read (made once, before either)."""
    pairs = [(b, t) for t, mine in tied_families(keys, visits) for b in mine]
    rows, cols = [b for b, _ in pairs], [t for _, t in pairs]
    if not pairs:
        return {}
    sq = cross_norms(jac, masks, vectors, rows, cols, chunk_size, ranks, groups=groups)
    return dict(zip(pairs, sq, strict=True))


def beaten(
    jac, masks, visits, keys, vectors, found, eps, chunk_size, ranks, near=(), known=None,
    groups=None,
) -> dict:  # fmt: skip
    """Operators that missed their top singular value, seen from the others' top vectors.

    A Krylov run settles on *a* singular value (its residual certificate says which is
    near), the top one only if its start overlaps the top vector, and a cluster of nearly
    equal top values (a visit of a small step ``x + eps W x``: ``d`` copies of one value,
    split by ``eps``) hides the top one from a single start for many iterations. Within a
    sublayer with a tied operator the other operators' top vectors are starts of their own:
    each visit is applied to the tied one's vector, the tied operator to each visit's where
    its own upper end is in use or a cluster is seen (``2 R_j`` JVPs at most, batched per
    copy of the graph, :func:`cross_norms`, over the pairs not in ``known``, products already
    made on the same vectors,
    :func:`visits_on_tied`), in the sublayers ``near`` (a cluster seen,
    :func:`~loopprobe.estimate.sensitivity_clusters.clustered_tops`) also each visit to its
    neighbouring visits' (``2 R_j - 2`` more; without them R 3 ``LinearLoop`` seed 1 of
    ``benchmarks/bench_kappa_clusters.py`` came back converged outside its interval), and
    an operator A whose ``||A v||`` on such a vector v
    exceeds its own certified upper end (:func:`~loopprobe.linalg.norm_bounds`, with
    :func:`rounding_slack`) missed its top. Returns ``{b: c}``: operator b is beaten most
    by operator c's vector."""
    rows, cols = [], []  # apply operator rows[q] to the vector of operator cols[q]
    for t, mine in tied_families(keys, visits):
        j = keys[t][1]
        # the tied upper end in use: its own, or sum_r hi_r when that is no larger, which
        # holds the exact norm whatever the tied run found (the triangle inequality); where
        # a cluster is seen the tied operator is checked anyway: its repair from a visit's
        # vector is what makes the family consistent there
        tied_own = j in near or own_end_in_use(found, t, mine, eps)
        for b in mine:
            rows += [t, b] if tied_own else [b]
            cols += [b, t] if tied_own else [t]
        mine.sort(key=lambda b: visits[b].r)
        pairs = zip(mine[:-1], mine[1:], strict=True) if j in near else []
        for a, b in pairs:  # neighbouring visits, each to the other's vector
            rows += [a, b]
            cols += [b, a]
    if not rows:
        return {}
    sq = cross_norms(jac, masks, vectors, rows, cols, chunk_size, ranks, known, groups)
    norms = [x**0.5 for x in sq]
    out: dict[int, tuple[float, int]] = {}
    for b, c, value in zip(rows, cols, norms, strict=True):
        hi = norm_bounds(found[b].value, found[b].residual, eps)[1]
        if value > hi * (1 + rounding_slack(eps)) and value > out.get(b, (0.0, -1))[0]:
            out[b] = (value, c)
    return {b: c for b, (_, c) in out.items()}


def own_end_in_use(found, t, mine, eps: float) -> bool:
    """The tied operator t's own upper end is below the sum of its visits' (``mine``), so
    kappa's interval uses it (:func:`~loopprobe.estimate.kappa_bounds.tied_top`) and
    :func:`beaten` checks it on its visits' vectors."""
    own = norm_bounds(found[t].value, found[t].residual, eps)[1]
    return own < sum(norm_bounds(found[b].value, found[b].residual, eps)[1] for b in mine)


def tied_on_visits(sub, sub_masks, visits, keys, vectors, found, part, eps, chunk_size, ranks):
    """``{(t, b): (||A_t v_b||^2, v_b)}``: each tied operator t of ``part`` whose own upper end
    is in use (:func:`own_end_in_use`) applied to its visits' unit top vectors, on the copy
    of the graph its Lanczos run has just used (``sub``, ``sub_masks``), the products the
    first :func:`beaten` asks for, made before the copy is dropped rather than on a copy of
    its own; each with the vector it was made on (a second start may change it since)."""
    pairs = []
    for t, mine in tied_families(keys, visits):
        if t in part and own_end_in_use(found, t, mine, eps):
            pairs += [(t, b) for b in mine]
    if not pairs:
        return {}
    rows, cols = [t for t, _ in pairs], [b for _, b in pairs]
    sq = cross_norms(sub, sub_masks, vectors, rows, cols, chunk_size, ranks)
    return {p: (x, vectors[p[1]].clone()) for p, x in zip(pairs, sq, strict=True)}


def still_valid(made: dict, vectors) -> dict:
    """The products of :func:`tied_on_visits` whose visit vector is still the one they were
    made on, as ``{(t, b): ||A_t v_b||^2}`` (the ``known`` of :func:`beaten`)."""
    return {p: x for p, (x, v) in made.items() if torch.equal(vectors[p[1]], v)}


def repair_tops(run, v0, vectors, found, check, unmet=None) -> list[int]:
    """Restart every operator :func:`beaten` (``check()``) from the vector that beat it, up
    to ``REPAIR_ROUNDS`` times, keeping the better estimate (the larger Ritz value: every
    Ritz value is a lower bound of the top singular value). Started from that vector its
    Krylov space holds it, so its new estimate is at least the ``||A v||`` that beat it.
    After each restart, the operators whose stopping rule no longer holds (``unmet()``:
    the repaired upper end can widen kappa's interval, and a tied operator stopped against
    the wrong one) resume from their top vectors. Returns the operators (positions) still
    beaten after the last round (``[]``: none)."""
    worse = check()
    for _ in range(REPAIR_ROUNDS):
        if not worse:
            return []
        rows = sorted(worse)
        _rerun(run, v0, vectors, found, rows, vectors[[worse[b] for b in rows]].clone())
        rows = unmet() if unmet is not None else []
        if rows:  # from its own vector: its new Ritz value is at least the old one
            _rerun(run, v0, vectors, found, rows, vectors[rows].clone(), better=False)
        worse = check()
    return sorted(worse)


def _rerun(run, v0, vectors, found, rows, starts, better=True) -> None:
    """Run the operators ``rows`` again from ``starts``, keeping each one's better estimate
    (and its vector; ``better=False``: the new one), with the iterations of both runs."""
    old = {b: (found[b], vectors[b].clone()) for b in rows}
    for b, start in zip(rows, starts, strict=True):
        v0[b] = start
    for b, est in zip(rows, run(rows), strict=True):
        prev, vec = old[b]
        if better and est.value < prev.value:
            est = prev
            vectors[b] = vec
        found[b] = replace(est, iterations=prev.iterations + est.iterations)


def missed_note(names: list[str]) -> list[str]:
    """The problem :func:`repair_tops` leaves, in words (``[]`` when nothing is left)."""
    if not names:
        return []
    return [
        f"{', '.join(names)}: another operator's top vector gives a larger ||A v|| than this "
        f"estimate's certified upper end after {REPAIR_ROUNDS} restarts from it, so it missed "
        "its top singular value (a cluster of nearly equal top values); raise max_iter"
    ]


def _product_groups(visits, ops, rows, narrow: bool) -> list[tuple[list[int], list[int]]]:
    """The operators ``rows`` by the visits their products need: ``(ks, operators)``, where
    ``ks`` are the visits that carry offsets. With ``narrow`` the operators of the r-th
    visits of all sublayers share the visits ``(r, .)`` alone (their JVPs start at visit r,
    their VJPs end there) and a tied operator has its sublayer's visits alone (its VJP
    computes no other sublayer's weight gradients); else every operator every visit."""
    every = list(range(len(visits)))
    by: dict[Any, list[int]] = {}
    for b in rows:
        if not narrow:
            key: Any = "all"
        elif len(ops[b]) == 1:
            key = visits[ops[b][0]].r
        else:
            key = ("tied", visits[ops[b][0]].j)
        by.setdefault(key, []).append(b)
    out = []
    for key, part in by.items():
        ks = every if key == "all" else sorted({k for b in part for k in ops[b]})
        out.append((ks, part))
    return out


def graph_copy(jac, masks, ks, check: bool = True) -> tuple:
    """The graph the products over the visits ``ks`` (a group of :func:`_product_groups`) run
    on, and the operators' masks for it: ``jac`` itself where ``ks`` is None or every visit,
    else its narrowed copy (:meth:`VisitJacobian.restricted`, ``check`` passed on), the whole
    graph released first so that the two are not held at once (the caller drops the copy
    before asking for the next)."""
    if ks is None or len(ks) == len(jac.visits):
        return jac, masks
    jac.release()
    sub = jac.restricted(ks, check=check)
    return sub, (masks if sub is jac else masks[:, ks])  # restricted() may refuse


def adjoint_tol(low: torch.dtype) -> float:
    """How far ``<U^T U v, v>`` and ``||U v||^2`` may differ, relative to ``||U||^2``: 1e-7 in
    float64, 1e-2 in float32, 1e-1 in half precision (roundoff of the lowest precision the
    forward computes in)."""
    return 1e-7 if low == torch.float64 else 1e-2 if not is_half(low) else 1e-1


def adjoint_error(w, v, u, scale, jac, call: str, what) -> str | None:
    """The error for the first row whose ``<w, v>`` (``w = U^T U v``) and ``||u||^2``
    (``u = U v``) differ by more than :func:`adjoint_tol` of ``scale`` (per row, ``||U||^2``
    seen so far), naming it ``what(row)``; None when every row agrees."""
    low = lowest_precision(jac.dtypes)
    vv = v.square().sum(1).clamp_min(1e-300)
    wv, uu = (w * v).sum(1) / vv, (u * u).sum(1) / vv
    gap = (wv - uu).abs() / scale.clamp_min(1e-300)
    bad = gap > adjoint_tol(low)
    if not bool(bad.any()):
        return None
    q = int(bad.nonzero()[0])
    return (
        f"{call}: the JVP and VJP of {what(q)} disagree: <U^T U v, v> = {float(wv[q]):.10g} but "
        f"||U v||^2 = {float(uu[q]):.10g}, a relative gap of {float(gap[q]):.2g} > "
        f"{adjoint_tol(low):g} (the tolerance for {_name(low)}, the lowest precision computed "
        f"in: {_names(jac.dtypes)}). Causes: forward-mode tangents pass where the backward "
        "graph does not (a no_grad region or .data use after a visit), randomness that "
        "torch's RNG does not control, or roundoff of a dtype the model casts to internally; "
        "exclude that visit or make the forward deterministic"
    )


def forward_probe(jac, seed: int, call: str, chunk_size: int | None = None) -> None:
    """One forward-mode product ``U t`` of the whole graph (a random ``t`` at every visit) and
    its VJP, checked for adjointness like every product of :func:`_estimate`; then the
    graph's narrowed copies (:meth:`VisitJacobian.restricted`) and its own later products run
    by reverse over reverse from their first product on. A forward that ``torch.func`` refuses
    in forward mode switches to plain autograd here, before any copy is made. Before this
    probe each copy made its first product in forward mode, at 3x the reverse-over-reverse
    cost per row: 1.05 of 5.42 CPU-s of a kappa at d 64 R 4, error <= 1e-2 (a scratch
    profile; docs/results/performance.md)."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(1, jac.n_max, generator=gen, dtype=torch.float64).to(jac.dtype).to(jac.device)
    every = torch.ones(1, len(jac.visits), dtype=jac.dtype, device=jac.device)
    u = jac.matvec(t, every, chunk_size)  # forward mode: the graph's first product
    scale = (u * u).sum(1) / t.square().sum(1)
    w = jac.rmatvec(u, every, chunk_size)
    err = adjoint_error(w, t, u, scale, jac, call, lambda q: "the visits")
    if err is not None:
        raise RuntimeError(err)
    jac.forward_probed = jac.products is None


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
        v = last["v"][torch.isin(last["idx"], idx)]  # the solver may have dropped rows
        uu = (u * u).sum(1) / v.square().sum(1).clamp_min(1e-300)
        scale[idx] = torch.maximum(scale[idx], uu)

        def name(q: int) -> str:  # the operator number in the whole call
            return f"operator {rows[int(idx[q])]}"

        err = adjoint_error(w, v, u, scale[idx], jac, call, name)
        if err is not None:
            raise RuntimeError(err)
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


def outside_reads(jac, per: list[torch.Tensor], w: torch.Tensor, eps: float) -> list[str]:
    """Sublayers whose parameters F also reads outside their module's calls (a tied read-out
    ``F.linear(h, block.weight)``, a read in the parent's forward): one VJP of the model's own
    output with respect to the real parameters, ``d<F, w>/d phi_j``, against the sum of the
    per-visit ``U_{r,j}^T w`` (``per``, every F-visible visit). They differ by more than
    roundoff (``OUTSIDE_EPS`` eps, as :func:`~loopprobe.estimate.updates.per_visit_updates`
    checks G) only when a read bypasses the visits, which ``||sum_r U_{r,j}||`` then misses.
    """
    model = jac.probe.model
    params = [p for g in jac.groups for p in g.params]
    try:
        with seeded(jac.seed, jac.device), restored(model), torch.enable_grad():
            out = call_model(model, jac.inputs, jac.forward)
            F = pick_output(out, jac.output, call=jac.call).reshape(-1)
            full = torch.autograd.grad((F * w.to(F.dtype)).sum(), params, allow_unused=True)
    except (RuntimeError, TypeError, ValueError):  # the plain forward cannot run: the F(0)
        return []  # check of VisitJacobian names that already
    out, at = [], 0
    for j, g in enumerate(jac.groups):
        mine = full[at : at + len(g.params)]
        at += len(g.params)
        total = torch.cat([(t if t is not None else torch.zeros_like(p)).reshape(-1).double()
                           for t, p in zip(mine, g.params, strict=True)])  # fmt: skip
        visits = [k for k, v in enumerate(jac.visits) if v.j == j]
        if not visits:
            continue
        summed = sum(per[k][: total.numel()].double() for k in visits)
        gap = float((total - summed).norm() / total.norm().clamp_min(1e-300))
        if gap > OUTSIDE_EPS * eps:
            out.append(
                f"{g.sublayer.name}: its parameters are also read outside its module's calls "
                f"(d<F, w>/d params differs from sum_r U_r^T w by {gap:.2g} of its norm), so "
                "||sum_r U_r|| misses that read; route the read through a call of the module, "
                "or untie it"
            )
    return out
