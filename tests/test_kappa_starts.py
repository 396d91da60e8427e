"""Where kappa's visits start under ``warm_visits``: the line through two visits before it.

A visit's top right singular vector drifts smoothly with the visit number r, so visit r
starts from ``2 v_{r+s} - v_{r+2s}`` (signs aligned; s the distance to the nearest visit
estimated) where both were estimated, else from the nearest visit's vector; the result must
still hold the dense kappa.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_kappa_err import aligned, mse
from thirdparty_models import randn

import loopprobe as lp
from loopprobe.estimate import sensitivity, sensitivity_starts
from loopprobe.estimate.sensitivity_starts import VISIT_NOISE, _visit_start

VISITS = [SimpleNamespace(r=r) for r in range(5)]


def test_a_visit_starts_from_the_line_through_two_visits_after_it():
    v = 1 + 0.1 * randn(5, 7)  # neighbouring top vectors: nearly parallel, signs agreeing
    torch.testing.assert_close(_visit_start(0, [1, 2, 3], VISITS, v), 2 * v[1] - v[2])
    flipped = v.clone()
    flipped[2] = -v[2]  # a top vector's sign is arbitrary: aligned before the line is drawn
    torch.testing.assert_close(_visit_start(0, [1, 2], VISITS, flipped), 2 * v[1] - v[2])
    assert torch.equal(_visit_start(0, [1], VISITS, v), v[1])  # one visit: its vector
    assert torch.equal(_visit_start(0, [1, 3], VISITS, v), v[1])  # no line across a gap
    assert torch.equal(_visit_start(0, [2, 3], VISITS, v), v[2])  # no r+4: the nearest
    torch.testing.assert_close(_visit_start(0, [2, 4], VISITS, v), 2 * v[2] - v[4])  # s = 2
    torch.testing.assert_close(_visit_start(4, [3, 2], VISITS, v), 2 * v[3] - v[2])


def test_the_warm_visits_get_the_extrapolated_start(monkeypatch):
    R = 5
    model = aligned(0, R)
    x, target = randn(3, 5, seed=1), randn(3, 5, seed=7)
    seen = []
    real = sensitivity._estimate

    def spy(jac, masks, v0, vectors, rows, **kw):
        seen.append((list(rows), v0.clone(), vectors.clone()))
        return real(jac, masks, v0, vectors, rows, **kw)

    monkeypatch.setattr(sensitivity, "_estimate", spy)
    rep = lp.visit_alignment(lp.attach(model), x, mse(target), max_iter=80, warm_visits=True)
    visits = rep.sensitivity.visits
    checked = 0
    for rows, starts, vectors in seen[:R]:  # the visit phases, r = R-1 first
        for b, start in zip(rows, starts, strict=True):
            r, j = visits[b].r, visits[b].j
            if r > R - 3:
                continue
            one, two = ([c for c, w in enumerate(visits) if w.j == j and w.r == r + k][0]
                        for k in (1, 2))  # fmt: skip
            line = 2 * vectors[one] - torch.sign(vectors[one] @ vectors[two]) * vectors[two]
            line = line / line.norm()
            # the line plus a random part of relative size VISIT_NOISE
            assert float((start - line).norm()) == pytest.approx(VISIT_NOISE, rel=1e-6)
            checked += 1
    assert checked == 2 * (R - 2)  # both sublayers, r = 0 .. R-3


def test_the_start_module_is_what_sensitivity_norms_reads():
    # one definition of the warm start: sensitivity_norms calls this module's functions
    assert sensitivity._warm_start is sensitivity_starts._warm_start
    assert sensitivity._start is sensitivity_starts._start
