"""kappa's forward-mode check made once per call, on the whole graph.

Products by reverse over reverse come from the backward graph itself, so only a forward-mode
product can show a backward graph that misses what the forward computes (a ``no_grad``
region after a visit). ``sensitivity_norms`` makes one such product on the whole graph, a
random tangent at every visit, checks it for adjointness, and its narrowed copies then start
by reverse over reverse.
"""

from __future__ import annotations

import pytest
import torch
from test_kappa_plants import NoGradSide
from test_sensitivity import NoGradAfterVisit
from thirdparty_models import ForLoopModel, make, randn

import loopprobe as lp
from loopprobe.autodiff import JVP
from loopprobe.estimate.sensitivity import sensitivity_norms


def counting(monkeypatch) -> list[int]:
    """Count the forward-mode JVPs (``JVP.__call__``; vmapped rows count once per call)."""
    calls: list[int] = []
    real = JVP.__call__

    def spy(self, f, primals, tangents):
        calls.append(1)
        return real(self, f, primals, tangents)

    monkeypatch.setattr(JVP, "__call__", spy)
    return calls


def test_one_forward_mode_product_serves_every_narrowed_copy(monkeypatch):
    model = make(ForLoopModel, K=2, R=4)
    calls = counting(monkeypatch)
    sens = sensitivity_norms(lp.attach(model), randn(3, 5), max_iter=40)
    assert sens.converged and sens.jvp_mode == "forward mode"
    assert len(calls) == 1  # the probe; before, one per narrowed copy and one for the whole


def test_without_the_probe_each_copy_checks_itself(monkeypatch):
    # the copies inherit the probe's check only: a graph that was not probed (the DDP path,
    # or a VisitJacobian used directly) still makes its first product in forward mode
    model = make(ForLoopModel, K=2, R=4)
    from loopprobe.estimate import sensitivity

    monkeypatch.setattr(sensitivity, "forward_probe", lambda *args: None)
    calls = counting(monkeypatch)
    sensitivity_norms(lp.attach(model), randn(3, 5), max_iter=40)
    # four narrowed copies (r = 0..3) and one per tied operator; the cross-check's copies
    # (restricted(..., check=False)) make none
    assert len(calls) == 6


@pytest.mark.parametrize("cls", [NoGradAfterVisit, NoGradSide])
def test_the_probe_refuses_a_backward_graph_that_misses_part_of_the_forward(cls):
    model = make(cls)
    x = randn(2, 4) if cls is NoGradAfterVisit else randn(3, 6)
    with pytest.raises(RuntimeError, match=r"JVP and VJP of the visits disagree.*relative gap"):
        sensitivity_norms(lp.attach(model), x, max_iter=20)


@pytest.mark.parametrize("kw", [{"memory": "low"}, {"chunk_size": 0}])
def test_without_the_probe_every_product_is_still_checked(kw):
    # forward-mode products throughout (memory="low"), or one at a time (chunk_size=0): no
    # probe, and the check on each product names the operator that failed it
    with pytest.raises(RuntimeError, match=r"JVP and VJP of operator \d+ disagree"):
        sensitivity_norms(lp.attach(make(NoGradAfterVisit)), randn(2, 4), max_iter=20, **kw)


def test_the_probe_leaves_the_numbers_as_they_were():
    # the probe draws from its own stream: the start vectors, so the estimates, are unchanged
    model = make(ForLoopModel, K=2, R=3)
    probe, x = lp.attach(model), randn(3, 5)
    with_probe = sensitivity_norms(probe, x, max_iter=40)
    forward = sensitivity_norms(probe, x, max_iter=40, memory="low")  # every product forward
    for a, b in zip(with_probe.visit_norms, forward.visit_norms, strict=True):
        assert a.iterations == b.iterations
        assert a.value == pytest.approx(b.value, rel=1e-12)
    assert torch.equal(with_probe.UTw[0], forward.UTw[0])
