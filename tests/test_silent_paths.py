"""Silent paths and crashes on models written the way third-party code is (issue 40).

Each model here is small, float64 and knows nothing about loopprobe; each test compares a
loopprobe number with a brute-force twin (a dense ``jacrev`` or a plain re-run) and checks
that probing leaves the model as it was.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import jacrev

import loopprobe as lp
from tests.thirdparty_models import make, one_thread, randn  # noqa: F401


# ------------------------------------------------------------------ BatchNorm in train mode


class BNBlock(nn.Module):
    """``h -> 0.5 h + 0.4 tanh(BN(W h)) + e``: a contracting round with a BatchNorm inside."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return 0.5 * h + 0.4 * torch.tanh(self.bn(self.lin(h))) + e


class BNLoop(nn.Module):
    def __init__(self, d: int = 6, R: int = 8) -> None:
        super().__init__()
        self.R = R
        self.inp = nn.Linear(3, d)
        self.block = BNBlock(d)
        self.head = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.inp(x)
        h = e
        for _ in range(self.R):
            h = self.block(h, e)
        return self.head(h)


def bn_model() -> tuple[BNLoop, torch.Tensor]:
    model, x = make(BNLoop), randn(10, 3)
    with torch.no_grad():  # running statistics far from the batch's: the two rounds differ
        model.block.bn.running_mean.fill_(0.0)
        model.block.bn.running_var.fill_(25.0)
    return model.train(), x


def dense_rho_of_the_eval_round(model: BNLoop, x: torch.Tensor, rounds: int = 500) -> float:
    """rho of one eval-mode round after ``rounds`` rounds (500: at its fixed point), from a
    dense Jacobian (the twin)."""
    model.eval()
    with torch.no_grad():
        e = model.inp(x)
        h = e
        for _ in range(rounds):
            h = model.block(h, e)
        J = jacrev(lambda s: model.block(s, e))(h).reshape(h.numel(), h.numel())
    model.train()
    return float(torch.linalg.eigvals(J).abs().max())


def replay(model: nn.Module, inputs: torch.Tensor) -> lp.RoundMap:
    return lp.replay_round(model, inputs, "block", input_arg=1)


def test_train_mode_batchnorm_rho_is_the_eval_round_in_health_monitor_and_replay():
    model, x = bn_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rho = dense_rho_of_the_eval_round(model, x)
    rm = replay(model, x)
    assert "eval mode" in rm.reason
    fp = lp.fixed_point(rm.T, rm.h0, tol=1e-12, max_iter=500)
    direct = lp.spectral_radius(rm.T, fp.h, k=2)
    assert direct.value == pytest.approx(rho, rel=1e-6)
    h = lp.health(model, x, step=replay, alpha=1.0, beta=1.0, progress=False)
    row = h.frame.set_index("check").loc["spectral radius"]
    assert row["value"] == pytest.approx(rho, rel=1e-4)  # at health's fixed point, tol 1e-6
    assert "eval mode" in h.frame.set_index("check").loc["fixed point"]["measured"]
    mon = lp.Monitor(model, x, diagnostics=["rho"], every=1, options={"rho": {"round": replay}})
    mon.step(0)
    got = mon.frame.query("quantity == 'rho'")
    at_R = dense_rho_of_the_eval_round(model, x, model.R)  # the Monitor's rho: at h_R
    assert float(got["value"].iloc[0]) == pytest.approx(at_R, rel=1e-6)
    assert model.training and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
