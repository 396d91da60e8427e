"""Where kappa's forward-mode products run: the adjointness check's independent side.

Reverse over reverse gives ``U t`` from the VJP graph itself, so only a forward-mode product
can show a backward graph that forward-mode tangents do not match (a ``no_grad`` region,
``.data``). Each graph's first product was in forward mode, the narrowed copies' too (3x a
later product at d 64). Where every visit belongs to a tied operator, the tied operators'
first product on the whole graph tests every visit at once, and the narrowed copies skip it.
"""

from __future__ import annotations

import pytest
from test_kappa_plants import NoGradSide
from thirdparty_models import ForLoopModel, make, randn

import loopprobe as lp
from loopprobe.differentiate.jacobian import VisitJacobian


def forward_mode_calls(monkeypatch) -> list[int]:
    """The number of visits of each Jacobian a forward-mode product runs on."""
    seen: list[int] = []
    real = VisitJacobian.jvp_one

    def spy(self, v, mask):
        seen.append(len(self.visits))
        return real(self, v, mask)

    monkeypatch.setattr(VisitJacobian, "jvp_one", spy)
    return seen


def test_only_the_whole_graph_runs_a_forward_mode_product_when_tied_operators_cover_it(
    monkeypatch,
):
    seen = forward_mode_calls(monkeypatch)
    model = make(ForLoopModel, seed=0, K=2, R=3)
    x, target = randn(3, 5, seed=1), randn(3, 5, seed=7)
    rep = lp.visit_alignment(lp.attach(model), x, lambda out, inp: ((out - target) ** 2).sum())
    assert rep.converged, rep.reason
    assert seen and set(seen) == {6}  # the whole graph (6 visits), never a narrowed copy


def test_visits_outside_every_tied_operator_keep_their_own_forward_mode_check(monkeypatch):
    seen = forward_mode_calls(monkeypatch)
    model = make(ForLoopModel, seed=0, K=2, R=3)
    x = randn(3, 5, seed=1)
    probe = lp.attach(model)
    every = [v for v in probe.visits(x) if v.grad_visible]
    one_each = [v for v in every if v.j == 0] + [v for v in every if v.j == 1][:1]
    sens = lp.sensitivity_norms(probe, x, visits=one_each)  # sublayer 1 has no tied operator
    assert sens.converged, sens.reason
    assert any(n < len(one_each) for n in seen)  # a narrowed copy checked itself


@pytest.mark.parametrize("R", [2, 3])
def test_a_graph_break_is_still_refused_with_the_narrowed_copies_unchecked(R):
    model = make(NoGradSide, R=R)
    with pytest.raises(RuntimeError, match=r"JVP and VJP .* disagree"):
        lp.visit_alignment(lp.attach(model), randn(3, 6), lambda out, inputs: (out**2).sum())


def test_the_low_memory_mode_runs_every_product_in_forward_mode(monkeypatch):
    seen = forward_mode_calls(monkeypatch)
    model = make(ForLoopModel, seed=0, K=2, R=3)
    x, target = randn(3, 5, seed=1), randn(3, 5, seed=7)
    lp.visit_alignment(lp.attach(model), x, lambda out, inp: ((out - target) ** 2).sum(),
                       memory="low")  # fmt: skip
    assert any(n < 6 for n in seen)  # every product: the narrowed copies' too
