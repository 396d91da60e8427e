"""kappa with every operator in one batch (``narrow=False``), as the report's small cells run it."""

from __future__ import annotations

import dataclasses

import pytest
from test_kappa_err import brute_kappas, mse
from thirdparty_models import AlbertModel, ForLoopModel, make, randn

import loopprobe as lp
from loopprobe.estimate.alignment import visit_alignment
from loopprobe.report import sections_alignment as sa
from loopprobe.report.config import ReportConfig


@pytest.mark.parametrize("seed", [0, 1])
def test_one_batch_kappa_is_within_its_certified_bound_against_dense_jacobians(
    seed, restricted_copies
):
    model = make(ForLoopModel, seed=seed, K=2, R=3)
    x, target = randn(3, 5, seed=seed + 1), randn(3, 5, seed=seed + 7)
    calls = restricted_copies
    rep = visit_alignment(lp.attach(model), x, mse(target), max_iter=80, tol=1e-6, narrow=False)
    assert calls == []  # no per-visit groups: every product over every visit
    assert rep.converged, rep.reason
    brute = brute_kappas(model, x, target, K=2, R=3)
    for row, exact in zip(rep.sublayers.itertuples(), brute, strict=True):
        assert row.kappa_lo <= exact <= row.kappa_hi
        assert abs(row.kappa - exact) <= row.kappa_err <= 1e-6
    assert abs(rep.kappa - max(brute)) <= rep.kappa_err
    grouped = visit_alignment(lp.attach(model), x, mse(target), max_iter=80, tol=1e-6)
    assert calls  # the default groups the visits by r
    assert abs(grouped.kappa - rep.kappa) <= grouped.kappa_err + rep.kappa_err


def test_one_batch_and_grouped_kappa_agree_on_an_albert_style_model():
    model = make(AlbertModel)
    x = randn(2, 4, 6, seed=3)
    loss = lambda out, inputs: out.pow(2).sum()  # noqa: E731
    a = visit_alignment(lp.attach(model), x, loss, max_iter=80, tol=1e-6, narrow=False)
    b = visit_alignment(lp.attach(model), x, loss, max_iter=80, tol=1e-6)
    assert a.converged and b.converged, (a.reason, b.reason)
    assert a.kappa_lo <= b.kappa_hi and b.kappa_lo <= a.kappa_hi
    assert abs(a.kappa - b.kappa) <= a.kappa_err + b.kappa_err


class _Stop(Exception):
    pass


@pytest.mark.parametrize(("d_model", "narrow"), [(16, False), (32, False), (64, True)])
def test_the_report_cells_batch_kappa_in_one_group_only_below_the_measured_width(
    d_model, narrow, monkeypatch
):
    import loopprobe.estimate.bound as bound

    seen = {}

    def capture(*args, **kw):
        seen.update(kw)
        raise _Stop

    monkeypatch.setattr(bound, "bound_check", capture)
    cfg = dataclasses.asdict(dataclasses.replace(ReportConfig(), d_model=d_model))
    with pytest.raises(_Stop):
        sa._alignment_cell({**cfg, "norm": "deeploop", "R": 2})
    assert seen["narrow"] is narrow
    assert seen["tol"] == sa.report_tol(sa._gpt(ReportConfig(), K=2, R=2, norm="deeploop"))
