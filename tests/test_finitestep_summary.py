"""Failure summary (arXiv 2609.16665 Def. 3.2, Eq. 14, Sec. 3.4) against brute force.

Oracle: explicit re-evaluation in float64 of U at every scale on a tiny third-party-style
model (nn.Module transition, linear head), counted by hand; planted data for the
bootstrap verdicts.
"""

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from loopprobe.estimate.finitestep import reference_logprob
from loopprobe.estimate.finitestep_summary import (
    failure_summary,
    paired_bootstrap,
    summarize,
    verdict,
)

f64 = torch.float64


class Block(nn.Module):
    def __init__(self, d: int, gain: float, g: torch.Generator) -> None:
        super().__init__()
        self.W = nn.Parameter(gain * torch.randn(d, d, generator=g, dtype=f64) / d**0.5)

    def forward(self, h):
        return h + torch.tanh(h @ self.W.T)


def problem(seed=0, B=64, T=3, d=6, V=5, gain=3.0):
    g = torch.Generator().manual_seed(seed)
    block = Block(d, gain, g)
    head = nn.Linear(d, V).double()
    with torch.no_grad():
        head.weight.copy_(2 * torch.randn(V, d, generator=g, dtype=f64))
    H = torch.randn(B, T, d, generator=g, dtype=f64)
    targets = torch.randint(0, V, (B, T), generator=g)
    return block, head, H, targets


def test_summary_matches_explicit_reevaluation_at_every_scale():
    block, head, H, targets = problem()
    s = failure_summary(block, H, head, targets)
    df = s.to_frame()
    U = reference_logprob(head, targets)
    with torch.no_grad():
        D = block(H) - H
        Ua = {a: U(H + a * D).numpy() for a in (0, 0.25, 0.5, 0.75, 1)}
    dU = Ua[1] - Ua[0]
    np.testing.assert_allclose(df.gain, dU, atol=1e-12)
    np.testing.assert_allclose(df.U_halt, np.maximum(Ua[0], Ua[1]), atol=1e-12)
    np.testing.assert_allclose(df.U_step, np.max(np.stack(list(Ua.values())), 0), atol=1e-12)
    assert np.all(df.U_step >= df.U_halt - 1e-15)
    # A by float64 central differences, the label by hand
    eps = 1e-6
    with torch.no_grad():
        A_fd = (U(H + eps * D) - U(H - eps * D)).numpy() / (2 * eps)
    np.testing.assert_allclose(df.A, A_fd, rtol=1e-6, atol=1e-8)
    fsf = (dU < 0) & (A_fd > 0)
    assert s.n_finite_step == int(fsf.sum()) > 3
    assert s.n_harmful == int((dU < 0).sum())
    assert s.share == pytest.approx(fsf.sum() / (dU < 0).sum())
    rec = (Ua[0.25] - Ua[0])[fsf] > 0
    assert s.recovery_quarter == pytest.approx(rec.mean())
    assert s.mean_gain_quarter == pytest.approx((Ua[0.25] - Ua[0])[fsf].mean())
    sgn = np.mean(np.sign(df.A + df.Q) == np.sign(dU))
    assert s.sign_acc_AQ == pytest.approx(sgn)


def test_recovery_by_alpha_hat_reevaluates_the_gain_at_alpha_hat():
    block, head, H, targets = problem(seed=1)
    s = failure_summary(block, H, head, targets)
    df = s.to_frame()
    U = reference_logprob(head, targets)
    with torch.no_grad():
        D = block(H) - H
        a = torch.tensor(df.alpha_hat.to_numpy()).view(-1, 1, 1)
        g_hat = (U(H + a * D) - U(H)).numpy()
    np.testing.assert_allclose(df.gain_at_alpha_hat, g_hat, atol=1e-12)
    fsf = df.finite_step.to_numpy()
    assert s.recovery_hat == pytest.approx((g_hat[fsf] > 0).mean())


def test_bad_scales_and_alpha_c_are_rejected():
    block, head, H, targets = problem(B=4)
    with pytest.raises(ValueError, match="contain 0 and 1"):
        failure_summary(block, H, head, targets, scales=(0.25, 1.0))
    with pytest.raises(ValueError, match="alpha_c"):
        failure_summary(block, H, head, targets, alpha_c=1.0)


def planted(n=400, recover=0.8, seed=0):
    """Transitions whose statistics are known: half finite-step failures, a known share
    of them recovered by the quarter step; A + Q = gain exactly."""
    rng = np.random.default_rng(seed)
    gain = rng.normal(size=n)
    fs = gain < 0
    rec = fs & (rng.random(n) < recover)
    return pd.DataFrame({
        "A": np.where(fs, 0.1, gain), "Q": np.where(fs, gain - 0.1, 0.0),
        "predicted": gain, "gain": gain, "harmful": gain < 0, "finite_step": fs,
        "gain_quarter": np.where(rec, 0.05, -0.05), "gain_at_alpha_hat": np.where(fs, 0.1, 0),
        "U_step": 1.0, "U_halt": 1.0, **{c: rng.normal(size=n) for c in
        ("update_norm", "rel_change", "cos_change", "kl", "entropy_change")},
    })  # fmt: skip


def test_summarize_recovers_planted_rates():
    df = planted(recover=0.8)
    st = summarize(df)
    truth = (df.gain_quarter[df.finite_step] > 0).mean()
    assert st["recovery_quarter"] == pytest.approx(truth)
    assert st["sign_acc_AQ"] == 1.0 and st["spearman_AQ"] == pytest.approx(1.0)
    assert st["spearman_generic_max"] < 0.2 and st["share"] == 1.0


@pytest.mark.parametrize(
    ("recover", "expected"), [(0.95, "holds"), (0.45, "fails"), (0.72, "undecided")]
)
def test_verdict_on_planted_recovery_rates(recover, expected):
    df = planted(n=400, recover=recover, seed=3)
    boot = paired_bootstrap(df, n=300, seed=1)
    v = verdict(boot.recovery_quarter, 0.72, ">=")
    assert v["verdict"] == expected, v
    assert v["lo"] <= summarize(df)["recovery_quarter"] <= v["hi"]


def test_verdict_upper_criterion_and_empty_subsets():
    assert verdict(pd.Series([0.1, 0.2, 0.25]), 0.29, "<=")["verdict"] == "holds"
    assert verdict(pd.Series([0.5, 0.6]), 0.29, "<=")["verdict"] == "fails"
    assert verdict(pd.Series([np.nan, np.nan]), 0.5, ">=")["verdict"] == "undecided"
    with pytest.raises(ValueError, match="direction"):
        verdict(pd.Series([1.0]), 0.5, ">")
