"""The notebook view (``_repr_html_``) of every result type: status, key numbers, the frame."""

from __future__ import annotations

import dataclasses
import html
import re

import pytest
import torch
from thirdparty_models import ForLoopModel, make, randn

import loopprobe as lp
from loopprobe import results
from loopprobe._html import MAX_ROWS, HTMLView

NOT_A_RESULT = {"VisitFunction"}  # a callable F(deltas), not a report: no frame to show


def loss_fn(out, _inputs):
    return out.square().mean()


def rows(page: str) -> int:
    """Body rows of the HTML table."""
    body = page.split("<tbody>")[1].split("</tbody>")[0]
    return body.count("<tr>")


@pytest.fixture(scope="module")
def loop():
    model = make(ForLoopModel, K=2, R=3)
    return lp.attach(model), randn(2, 5)


@pytest.mark.parametrize("name", sorted(set(results.__all__) - NOT_A_RESULT))
def test_every_result_type_has_the_view_and_its_key_numbers_exist(name):
    cls = getattr(results, name)
    assert issubclass(cls, HTMLView) and callable(cls._repr_html_)
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    missing = [k for k in cls._html_keys if k not in fields and not hasattr(cls, k)]
    assert not missing, missing  # a misspelt key would be silently skipped


def test_an_alignment_report_shows_converged_kappa_with_its_interval_and_every_row(loop):
    probe, x = loop
    rep = lp.visit_alignment(probe, x, loss_fn, generator=torch.Generator().manual_seed(0))
    page = rep._repr_html_()
    assert rep.converged and "AlignmentReport</b>: <span style='color:green'>converged" in page
    for key in ("kappa", "kappa_lo", "kappa_hi"):
        assert f"{key} = {getattr(rep, key):.4g}" in page
    assert f"M = {rep.M}" in page
    assert rows(page) == len(rep.to_frame()) <= MAX_ROWS and "rows shown" not in page


def test_updates_and_sensitivity_show_their_numbers_and_one_row_per_visit(loop):
    probe, x = loop
    upd = lp.per_visit_updates(probe, x, loss_fn)
    page = upd._repr_html_()
    assert "converged" in page and f"loss = {upd.loss:.4g}" in page and rows(page) == 6
    sens = lp.sensitivity_norms(probe, x)
    page = sens._repr_html_()
    assert f"F_norm = {sens.F_norm:.4g}" in page and rows(page) == 6
    norm = f"{sens.visit_norms[0].value:.4g}"
    assert f"<td>{norm}</td>" in page  # the table's numbers are the result's


def test_a_result_that_did_not_converge_says_why_escaped_and_cuts_long_frames():
    bad = lp.fixed_point(lambda h: 2 * h + 1, torch.ones(3, dtype=torch.float64), max_iter=30)
    assert not bad.converged and len(bad.to_frame()) > MAX_ROWS
    page = bad._repr_html_()
    assert "not converged</span>: " + html.escape(bad.reason) in page
    assert "||T(h)||" in bad.reason and f"iterations = {bad.iterations}" in page
    assert rows(page) == MAX_ROWS
    assert f"{MAX_ROWS} of {len(bad.to_frame())} rows shown; .to_frame() has them all" in page
    good = lp.fixed_point(lambda h: 0.5 * h + 1, torch.zeros(3, dtype=torch.float64))
    page = good._repr_html_()
    assert good.converged and "converged" in page and "not converged" not in page
    assert f"residual = {good.residual:.4g}" in page and f"rate = {good.rate:.4g}" in page


def test_markup_in_a_reason_is_escaped():
    fp = lp.fixed_point(lambda h: 0.5 * h + 1, torch.zeros(3, dtype=torch.float64))
    odd = dataclasses.replace(fp, converged=False, reason="<script>x</script> & more")
    page = odd._repr_html_()
    assert "<script>" not in page and "&lt;script&gt;x&lt;/script&gt; &amp; more" in page


def test_a_record_without_a_flag_says_so_and_shows_its_frame(loop):
    probe, x = loop
    rec = probe.record(x)
    page = rec._repr_html_()
    assert "no convergence flag" in page and rows(page) == len(rec.to_frame()) == 6
    rr = lp.round_residuals(lambda h: 0.5 * h + 1, torch.zeros(3, dtype=torch.float64), 4)
    page = rr._repr_html_()
    assert "no convergence flag" in page and f"residual = {rr.residual:.4g}" in page
    assert re.search(r"distance = nan", page)


def test_a_health_result_shows_its_check_table_and_what_it_could_not_trust():
    import pandas as pd

    frame = pd.DataFrame({"check": [f"c{i}" for i in range(25)], "reading": ["fine"] * 25})
    h = results.Health(frame=frame, problems=["kappa_R: 2 estimates not converged"])
    page = h._repr_html_()
    assert "not converged</span>: kappa_R: 2 estimates not converged" in page
    assert rows(page) == MAX_ROWS and "<td>c19</td>" in page and "<td>c20</td>" not in page
    assert f"{MAX_ROWS} of 25 rows shown; .frame has them all" in page
