"""Where :func:`~loopprobe.estimate.sensitivity.sensitivity_norms` starts its operators.

Random starts; an earlier call's top vectors (``start=``); or, within one call,
``warm_visits``: the visits by visit number from the last to the first, each from the line
through its sublayer's two visits estimated just before, then the tied operators from the
sum of their visits' top vectors. Reference: seed 002, Eq. 12.
"""

from __future__ import annotations

import torch

#: Relative size of the random part mixed into a warm start from other operators' top
#: vectors (``warm_visits``): a top direction they miss can still be found (the Krylov
#: caveat: the start must overlap the top singular vector). Small, because the extrapolated
#: start (:func:`_visit_start`) is within about 1e-3 of the top vector on LoopedGPT: with
#: 0.1 the warm visits took 3.93 Lanczos steps on average, with 1e-3 2.57 (d 64 R 8, error
#: <= 1e-2; benchmarks/bench_kappa_starts.py).
VISIT_NOISE = 1e-3
#: The same for a tied operator started from its visits' top vectors (0.01 against 0.1 cut
#: its products 9 -> 5 at d 64 R 4; smaller values not measured): its upper end is mostly
#: the visits' sum (:func:`~loopprobe.estimate.kappa_bounds.tied_top`) and its first
#: product then gives the lower end; where its own upper end is in use the
#: cross-check (:func:`~loopprobe.estimate.sensitivity_runs.beaten`) applies it to each
#: visit's vector.
TIED_NOISE = 0.01
#: ``warm_visits=None`` turns the warm starts on from this operator size (parameters).
WARM_VISITS_N = 16384


def _phases(visits, keys, narrow: bool) -> list[list[int]]:
    """The operators in the order ``warm_visits`` estimates them: the visits by visit number
    r from the last to the first (with ``narrow`` one phase per r, the groups
    :func:`~loopprobe.estimate.sensitivity_runs._product_groups` runs one after another
    anyway; else all visits at once), then
    the tied operators. Last first: the cold start falls on the cheapest products (a JVP
    from visit R-1 on, a VJP back to it), the whole-loop products of r = 0 start warm."""
    by: dict[tuple, list[int]] = {}
    for b, key in enumerate(keys):
        phase = (0, -visits[b].r if narrow else 0) if key[0] == "visit" else (1, 0)
        by.setdefault(phase, []).append(b)
    return [by[k] for k in sorted(by)]


def _warm_start(phase, visits, keys, found, vectors, v0) -> None:
    """Start vectors of the operators ``phase`` from those estimated before (``found``):
    a visit of sublayer j from its neighbours' top vectors (:func:`_visit_start`), the tied
    operator of j from the sum of its visits' top vectors (signs aligned with the largest
    visit's, weighted by the norms), each plus a random part of relative size
    ``VISIT_NOISE`` (``TIED_NOISE``). Operators with nothing before them keep their random
    start."""
    for b in phase:
        key = keys[b]
        j = visits[b].j if key[0] == "visit" else key[1]
        prior = [c for c in found if keys[c][0] == "visit" and visits[c].j == j]
        if not prior:
            continue
        if key[0] == "visit":
            top = _visit_start(b, prior, visits, vectors)
        else:
            ref = vectors[max(prior, key=lambda c: found[c].value)]
            top = sum(
                found[c].value * torch.sign((vectors[c] * ref).sum()) * vectors[c] for c in prior
            )
        noise = VISIT_NOISE if key[0] == "visit" else TIED_NOISE
        v0[b] = top / top.norm().clamp_min(1e-300) + noise * v0[b] / v0[b].norm()


def _visit_start(b, prior, visits, vectors) -> torch.Tensor:
    """The start of visit b (visit number r) from the top vectors of its sublayer's visits
    ``prior``: the line through the nearest one, at r+s, and the one at r+2s, ``2 v_{r+s} -
    v_{r+2s}`` (signs aligned), where both are there, else the nearest one's vector. A visit's
    top vector drifts smoothly with r: on LoopedGPT (d 64, R 4 and 8) ``1 - cos`` to the
    converged top vector is 4e-5 to 4e-4 from the neighbour's and 2e-9 to 8e-7 from the line
    (medians per sublayer, benchmarks/bench_kappa_starts.py), so the visit needs 2-3 Lanczos
    steps, not 4-7."""
    r = visits[b].r
    near = sorted(prior, key=lambda c: abs(visits[c].r - r))
    top = vectors[near[0]]
    two = [c for c in near[1:] if visits[c].r == 2 * visits[near[0]].r - r]
    if not two:
        return top
    far = vectors[two[0]]
    return 2 * top - torch.sign((far * top).sum()) * far


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
    if hasattr(start, "start_vectors"):  # a Sensitivity
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
