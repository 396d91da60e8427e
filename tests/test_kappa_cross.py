"""The cross-check of kappa's operators: which products it makes, and that none is made twice.

``beaten`` applies each sublayer's operators to each other's top vectors. The tied operator
on its visits' vectors is needed only while the tied norm's own upper end is in use: where
``sum_r hi_r`` is no larger, that sum holds the exact tied norm whatever the tied run found.
The visits on the tied vector are made once and read by both ``clustered_tops`` and the
first ``beaten``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from thirdparty_models import ForLoopModel, make, randn

import loopprobe as lp
from loopprobe.estimate import sensitivity_runs
from loopprobe.linalg import Estimate

EPS = float(torch.finfo(torch.float64).eps)


class TableJac:
    """``U_b v_c`` with the norm ``table[b, c]``: every operator's top vector is a basis
    vector ``e_c``, so the column of a product is read off the vector it gets."""

    def __init__(self, table: dict):
        self.table, self.made = table, []

    def matvec(self, V, ops, chunk_size):
        out = torch.zeros(len(V), 3, dtype=torch.float64)
        for q, (v, b) in enumerate(zip(V, ops[:, 0].tolist(), strict=True)):
            c = int(v.abs().argmax())
            self.made.append((b, c))
            out[q, 0] = self.table.get((b, c), 0.0)
        return out


def _run(tied_value: float, tied_residual: float, table: dict, near=()):
    visits = [SimpleNamespace(j=0, r=0), SimpleNamespace(j=0, r=1)]
    keys = [("visit", 0), ("visit", 1), ("tied", 0)]
    found = {
        0: Estimate(1.0, 5, True, 0.0, "lanczos", 1e-4),
        1: Estimate(1.0, 5, True, 0.0, "lanczos", 1e-4),
        2: Estimate(tied_value, 2, True, 0.0, "lanczos", tied_residual),
    }
    jac = TableJac(table)
    masks = torch.arange(3)[:, None]
    out = sensitivity_runs.beaten(
        jac, masks, visits, keys, torch.eye(3), found, EPS, None, None, near
    )
    return out, sorted(jac.made)


def test_the_tied_operator_is_checked_only_while_its_own_upper_end_is_in_use():
    # residual 0.5 > TRUST_RESIDUAL: own upper end infinite, the visits' sum (about 2.0001)
    # holds the tied norm; a tied product of 3 on a visit's vector cannot happen then (the
    # triangle inequality), so no product of the tied operator is made
    out, made = _run(1.99, 0.5, {(2, 0): 3.0})
    assert made == [(0, 2), (1, 2)] and out == {}
    # a tight tied estimate (own upper end 1.5 < 2.0001) is the end in use: it is checked,
    # and a visit's vector that beats it is found
    out, made = _run(1.5, 1e-6, {(2, 0): 1.7})
    assert made == [(0, 2), (1, 2), (2, 0), (2, 1)] and out == {2: 0}
    # where a cluster is seen (near) the tied operator is checked whatever end is in use:
    # its repair from a visit's vector is what made two cold cluster kappas of
    # bench_kappa_clusters (R 6 and 8, plain, seed 1) converge; without it they did not
    _, made = _run(1.99, 0.5, {}, near={0})
    assert (2, 0) in made and (2, 1) in made and (0, 1) in made  # and the neighbours


def test_products_already_made_on_the_same_vectors_are_not_made_again():
    known = {(0, 2): 1.0, (1, 2): 1.0}
    visits = [SimpleNamespace(j=0, r=0), SimpleNamespace(j=0, r=1)]
    keys = [("visit", 0), ("visit", 1), ("tied", 0)]
    jac = TableJac({})
    on_tied = sensitivity_runs.visits_on_tied(jac, torch.arange(3)[:, None], visits, keys,
                                              torch.eye(3), None, None)  # fmt: skip
    assert sorted(jac.made) == [(0, 2), (1, 2)] and set(on_tied) == set(known)
    jac.made.clear()
    norms = sensitivity_runs.cross_norms(
        jac, torch.arange(3)[:, None], torch.eye(3), [0, 1, 2], [2, 2, 0], None, None, known
    )
    assert jac.made == [(2, 0)] and norms == [1.0, 1.0, 0.0]


def test_a_kappa_makes_each_cross_product_once(monkeypatch):
    model = make(ForLoopModel, seed=0, K=2, R=3)
    x, target = randn(3, 5, seed=1), randn(3, 5, seed=7)
    made: list[tuple[int, int]] = []
    real = sensitivity_runs.cross_norms

    def spy(jac, masks, vectors, rows, cols, chunk_size, ranks, known=None, groups=None):
        made.extend(p for p in zip(rows, cols, strict=True) if p not in (known or {}))
        return real(jac, masks, vectors, rows, cols, chunk_size, ranks, known, groups)

    monkeypatch.setattr(sensitivity_runs, "cross_norms", spy)
    rep = lp.visit_alignment(
        lp.attach(model), x, lambda out, inp: ((out - target) ** 2).sum(), tol=1e-6
    )
    assert rep.converged, rep.reason
    assert made and len(made) == len(set(made))  # no repair here: every pair once


@pytest.mark.parametrize("kind", ["lp", "plain"])
def test_the_products_read_again_are_those_the_vectors_give_then(monkeypatch, kind):
    # The first cross-check reads the visits' products on the tied vectors made before the
    # second starts: valid while those runs leave the tied vectors alone. Cluster members
    # that need a second start (R 3 seed 2, as LinearLoop and as a plain third-party-style
    # module), each read checked against a fresh one.
    from _small_steps import family_member

    model, x, y = family_member(3, kind, 2)
    reads: list[tuple[float, float]] = []
    real = sensitivity_runs.cross_norms

    def spy(jac, masks, vectors, rows, cols, chunk_size, ranks, known=None, groups=None):
        if known:
            pairs = [p for p in zip(rows, cols, strict=True) if p in known]
            fresh = real(jac, masks, vectors, [b for b, _ in pairs], [c for _, c in pairs],
                         chunk_size, ranks, groups=groups)  # fmt: skip
            reads.extend(zip((known[p] for p in pairs), fresh, strict=True))
        return real(jac, masks, vectors, rows, cols, chunk_size, ranks, known, groups)

    monkeypatch.setattr(sensitivity_runs, "cross_norms", spy)
    from loopprobe.estimate import sensitivity

    seconds: list[list[int]] = []
    second = sensitivity.second_starts

    def counting(run, v0, vectors, found, rows, *rest):
        seconds.append(list(rows))
        return second(run, v0, vectors, found, rows, *rest)

    monkeypatch.setattr(sensitivity, "second_starts", counting)
    lp.visit_alignment(lp.attach(model), x, lambda out, inp: 0.5 * (out - y).pow(2).sum(),
                       method="lanczos", max_iter=30)  # fmt: skip
    assert seconds and seconds[0]  # a second start ran between the products and their read
    assert reads
    for cached, fresh in reads:
        assert cached == pytest.approx(fresh, rel=1e-12, abs=0)


@pytest.mark.parametrize("R", [3, 4])
def test_the_cross_products_on_narrowed_copies_are_the_whole_graphs(restricted_copies, R):
    # each visit's products run on the copy of the graph from its visit number on and each
    # tied operator's on its sublayer's visits alone: the same numbers as on the whole graph
    # (a pair sent to the wrong copy, or the copy's masks misread, changes them)
    from functools import partial

    from loopprobe.differentiate.jacobian import VisitJacobian
    from loopprobe.estimate.sensitivity import _operators

    probe, x = lp.attach(make(ForLoopModel, seed=0, K=2, R=R)), randn(3, 5)
    visits = [v for v in probe.visits(x) if v.grad_visible]
    jac = VisitJacobian(probe, x, visits)
    ops, _ = _operators(visits)
    masks = jac.masks(ops)
    vectors = randn(len(ops), jac.n_max, seed=3)
    for b, ks in enumerate(ops):
        vectors[b, jac.n[ks[0]] :] = 0
    same_j = [(b, c) for b in range(len(ops)) for c in range(len(ops))
              if visits[ops[b][0]].j == visits[ops[c][0]].j]  # fmt: skip
    rows, cols = [b for b, _ in same_j], [c for _, c in same_j]
    whole = sensitivity_runs.cross_norms(jac, masks, vectors, rows, cols, None, None)
    groups = partial(sensitivity_runs._product_groups, visits, ops, narrow=True)
    narrowed = sensitivity_runs.cross_norms(
        jac, masks, vectors, rows, cols, None, None, groups=groups
    )
    assert narrowed == pytest.approx(whole, rel=1e-12)
    assert sorted(restricted_copies) == [2] * R + [R, R]  # each r (two sublayers), two tied


def test_the_tied_rows_are_made_on_the_tied_copy_only_where_its_own_end_is_in_use():
    # right after a tied operator's run, on its copy: the products the first beaten would
    # ask for (its own upper end in use), each with the vector it was made on; none where
    # the visits' summed upper ends hold the tied norm (own residual above TRUST_RESIDUAL)
    visits = [SimpleNamespace(j=0, r=0), SimpleNamespace(j=0, r=1)]
    keys = [("visit", 0), ("visit", 1), ("tied", 0)]
    visit = Estimate(1.0, 5, True, 0.0, "lanczos", 1e-4)
    masks, vectors = torch.arange(3)[:, None], torch.eye(3)
    loose = {0: visit, 1: visit, 2: Estimate(1.99, 2, True, 0.0, "lanczos", 0.5)}
    jac = TableJac({(2, 0): 1.2, (2, 1): 1.3})
    args = (jac, masks, visits, keys, vectors)
    assert sensitivity_runs.tied_on_visits(*args, loose, [2], EPS, None, None) == {}
    assert jac.made == []
    tight = {**loose, 2: Estimate(1.5, 2, True, 0.0, "lanczos", 1e-6)}
    assert sensitivity_runs.tied_on_visits(*args, tight, [0, 1], EPS, None, None) == {}
    made = sensitivity_runs.tied_on_visits(*args, tight, [2], EPS, None, None)
    assert sorted(jac.made) == [(2, 0), (2, 1)]
    assert {p: x for p, (x, _) in made.items()} == {(2, 0): 1.2**2, (2, 1): 1.3**2}
    assert torch.equal(made[2, 1][1], vectors[1])
    # a vector changed since (a second start) drops its product: beaten makes it again
    vectors[1] = torch.tensor([0.0, 0.6, 0.8])
    assert sensitivity_runs.still_valid(made, vectors) == {(2, 0): 1.2**2}


def test_a_warm_kappa_reads_the_tied_rows_of_the_tied_runs_copies(monkeypatch, restricted_copies):
    # from converged vectors each tied operator's own upper end is in use, so the first
    # cross-check applies it to its visits' vectors: those rows are made on the copy of its
    # Lanczos run (no tied copy is built again), equal the whole graph's, and change nothing
    from loopprobe.estimate import sensitivity

    R = 3
    model = make(ForLoopModel, seed=0, K=2, R=R)
    x, target = randn(3, 5, seed=1), randn(3, 5, seed=7)
    probe = lp.attach(model)

    def loss(out, inp):
        return ((out - target) ** 2).sum()

    ref = lp.visit_alignment(probe, x, loss, tol=1e-10)
    reads: list[tuple[float, float]] = []
    real = sensitivity_runs.cross_norms
    tied = len(ref.sensitivity.visits)  # operators from here on are the tied ones

    def spy(jac, masks, vectors, rows, cols, chunk_size, ranks, known=None, groups=None):
        pairs = [p for p in zip(rows, cols, strict=True) if p in (known or {}) and p[0] >= tied]
        if pairs:  # each read against the same product on the whole graph
            fresh = real(jac, masks, vectors, [b for b, _ in pairs], [c for _, c in pairs],
                         chunk_size, ranks)  # fmt: skip
            reads.extend(zip((known[p] for p in pairs), fresh, strict=True))
        return real(jac, masks, vectors, rows, cols, chunk_size, ranks, known, groups)

    monkeypatch.setattr(sensitivity_runs, "cross_norms", spy)
    restricted_copies.clear()
    warm = lp.visit_alignment(probe, x, loss, tol=1e-6, start=ref)
    assert warm.converged, warm.reason
    assert len(reads) == 2 * R  # both sublayers' tied operators on each of their visits
    for cached, fresh in reads:
        assert cached == pytest.approx(fresh, rel=1e-12, abs=0)
    assert restricted_copies.count(R) == 2  # the two tied runs' copies, no more
    monkeypatch.setattr(sensitivity, "tied_on_visits", lambda *a, **k: {})
    restricted_copies.clear()
    again = lp.visit_alignment(probe, x, loss, tol=1e-6, start=ref)
    assert restricted_copies.count(R) == 4  # beaten builds the tied copies again
    assert (again.kappa, again.kappa_lo, again.kappa_hi) == (
        warm.kappa, warm.kappa_lo, warm.kappa_hi
    )
