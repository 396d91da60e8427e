"""Checks that catch planted loosenings of kappa's safeguards (each survived the suite before):
the number of cluster-repair restarts, the JVP/VJP adjointness tolerance and the F(0)
tolerance. Models are written the way third-party code is."""

from __future__ import annotations

import pytest
import torch
from thirdparty_models import MLPBlock, SharedBlockModel, make, randn
from torch import nn

import loopprobe as lp
from loopprobe.differentiate.jacobian import VisitJacobian
from loopprobe.estimate.sensitivity_runs import repair_tops
from loopprobe.linalg import Estimate


def test_an_operator_beaten_twice_is_restarted_twice_and_repaired():
    """repair_tops restarts up to REPAIR_ROUNDS (2) times: an operator whose first restart
    still leaves it beaten (a cluster the first restart only partly resolves) is repaired by
    the second, and only then is nothing left."""
    vectors = torch.eye(3, dtype=torch.float64)
    v0 = torch.zeros(3, 3, dtype=torch.float64)
    found = {0: Estimate(1.0, 5, True, 0.0, "lanczos", 1e-9), 1: Estimate(2.0, 5, True, 0.0)}
    values = iter([1.5, 2.0])  # what each restart of operator 0 finds
    calls: list[list[int]] = []

    def run(rows: list[int]) -> list[Estimate]:
        calls.append(rows)
        return [Estimate(next(values), 3, True, 0.0, "lanczos", 1e-9) for _ in rows]

    def check() -> dict[int, int]:  # operator 0 is beaten by operator 1's vector until >= 2
        return {0: 1} if found[0].value < 2.0 else {}

    assert repair_tops(run, v0, vectors, found, check) == []
    assert calls == [[0], [0]] and found[0].value == 2.0 and found[0].iterations == 11
    assert torch.equal(v0[0], vectors[1])  # restarted from the vector that beat it


class NoGradSide(nn.Module):
    """A side branch computed under ``torch.no_grad`` (a stop-gradient feature): forward-mode
    tangents pass through it, the backward graph does not, so the products disagree by a
    relative 3.5e-4 (float64): far above roundoff, far below 1e-1."""

    def __init__(self, d: int = 6, R: int = 3) -> None:
        super().__init__()
        self.R = R
        self.block = MLPBlock(d)
        self.side = nn.Linear(d, d)
        self.out = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.R):
            x = self.block(x)
            with torch.no_grad():
                s = self.side(x)
            x = x + 1e-3 * s
        return self.out(x)


def test_products_that_disagree_by_a_small_relative_gap_are_refused():
    model = make(NoGradSide)
    with pytest.raises(RuntimeError, match=r"JVP and VJP .* disagree.* relative gap of 0\.000"):
        lp.visit_alignment(lp.attach(model), randn(3, 6), lambda out, inputs: (out**2).sum())


def test_the_F0_check_flags_a_relative_difference_of_1e_7_and_passes_roundoff():
    """F at zero offsets against the model's own output: the tolerance is sqrt(eps)
    (1.5e-8 in float64); 1e-7 is a different function (a counter-dependent scale), 1e-10 is
    roundoff."""
    model = make(NoGradSide)
    probe = lp.attach(model)
    visits = [v for v in probe.visits(randn(3, 6)) if v.grad_visible]
    jac = VisitJacobian(probe, randn(3, 6), visits)
    jac.vjp_fn()
    assert jac.problems == []
    F0 = jac.F0.clone()
    jac.F0 = F0 * (1 + 1e-7)
    assert any("F(0) check failed" in p for p in jac._F0_problems())
    jac.F0 = F0 * (1 + 1e-10)
    assert jac._F0_problems() == []


class ReadoutReusesTheBlock(nn.Module):
    """A shared block whose first weight also reads the output out (a tied read-out outside
    the block's calls)."""

    def __init__(self, d: int = 6, R: int = 3) -> None:
        super().__init__()
        self.R = R
        self.block = MLPBlock(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.R):
            x = self.block(x)
        return x @ self.block.fc1.weight.T


def test_sensitivity_norms_alone_flags_a_weight_also_read_outside_its_module():
    model = make(ReadoutReusesTheBlock)
    sens = lp.sensitivity_norms(lp.attach(model), randn(3, 6))
    assert not sens.converged
    assert any("also read outside its module's calls" in p for p in sens.problems)
    plain = lp.sensitivity_norms(lp.attach(make(SharedBlockModel, R=3)), randn(3, 6))
    assert plain.converged and plain.problems == []
