"""A second, independent start for a visit whose top singular value is clustered.

The cross-check of :func:`~loopprobe.estimate.sensitivity_runs.beaten` compares the top
vectors of one sublayer's operators with each other; when they all settled on lower members
of one cluster of nearly equal top singular values it sees nothing. :func:`clustered_tops`
finds, from the same vectors, the largest visits whose top is clustered, and
:func:`second_starts` runs them again from independent random starts. Called from
:func:`~loopprobe.estimate.sensitivity.sensitivity_norms`. Reference: seed 002, Eq. 12.
"""

from __future__ import annotations

import math

import torch

from loopprobe.estimate.sensitivity_runs import _rerun, default_tol, tied_families

#: A direction orthogonal to an operator's top vector whose Rayleigh quotient is within this
#: many residual tolerances of the top value shows a cluster (:func:`clustered_tops`).
CLUSTER_TOLS = 100


def clustered_tops(visits, keys, vectors, found, dtype, on_tied) -> list:
    """The largest visit of each sublayer with a tied operator whose top singular value is
    shown to be clustered by the tied operator's top vector.

    For the largest visit b (top vector ``v``, value ``s``) and the tied operator's unit top
    vector ``u = a v + c w`` (``w`` orthogonal to ``v``), ``||U_b u||^2 = a^2 s^2 + c^2 q +
    2 a c <U_b^T U_b v, w>``, where ``q`` is the Rayleigh quotient of ``w`` and the cross term
    is at most ``2 |a c|`` residual ``s^2``. A ``q`` within ``CLUSTER_TOLS`` residual
    tolerances of ``s^2`` is a second direction nearly as large as the top: a cluster, where
    a Krylov run can settle on a lower member with a small residual and every vector of the
    cross-check of :func:`~loopprobe.estimate.sensitivity_runs.beaten` can lie in the same
    lower members. Parallel vectors (aligned visits) say nothing and flag nothing, nor does
    a largest visit not converged (its result is not certified anyway). ``on_tied``: the
    products ``{(b, t): ||U_b u||^2}`` of
    :func:`~loopprobe.estimate.sensitivity_runs.visits_on_tied`, which the cross-check of
    ``beaten`` reads too: this test makes no product of its own."""
    tau = CLUSTER_TOLS * default_tol(dtype, "lanczos")
    rows, cols = [], []
    for t, mine in tied_families(keys, visits):
        top = max(mine, key=lambda b: found[b].value)
        if found[top].converged:  # not converged: not certified anyway, nothing to add
            rows.append(top)
            cols.append(t)
    out = []
    for b, t in zip(rows, cols, strict=True):
        u, v = vectors[t].double(), vectors[b].double()
        a = float((u / u.norm().clamp_min(1e-300)) @ (v / v.norm().clamp_min(1e-300)))
        c2 = max(1.0 - a * a, 0.0)
        s2, res = found[b].value ** 2, found[b].residual
        if c2 < tau or not s2 > 0 or math.isnan(res):  # parallel: no second direction seen
            continue
        cross = 2 * abs(a) * c2**0.5 * res * s2
        quotient = (on_tied[b, t] - a * a * s2 + cross) / c2  # an upper end of q
        if quotient >= s2 * (1 - tau):
            out.append(b)
    return out


def second_starts(run, v0, vectors, found, rows, n_of, gen, ranks=None) -> None:
    """Run the operators ``rows`` (:func:`clustered_tops`) once more, from fresh random
    starts, keeping the larger Ritz value (:func:`repair_tops`'s rule).

    The cross-check of :func:`beaten` compares vectors of one family: when every visit of a
    sublayer and its tied operator settled on lower members of a cluster of top singular
    values, no vector need beat another, and the largest visit's upper end, which sets
    kappa's lower end, is wrong (seen on a small step ``x + eps W x``, R 3, cold starts). A
    start drawn independently of the first (``gen``, a stream of its own) overlaps the top
    member afresh; what it finds then reaches the other operators through the cross-check."""
    if not rows:
        return
    fresh = torch.randn(len(rows), v0.shape[1], generator=gen, dtype=torch.float64,
                        device=gen.device).to(v0.dtype).to(v0.device)  # fmt: skip
    for q, b in enumerate(rows):
        fresh[q, n_of[b] :] = 0
    fresh = fresh if ranks is None else ranks.mean(fresh)
    _rerun(run, v0, vectors, found, rows, fresh)
