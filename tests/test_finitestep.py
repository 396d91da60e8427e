"""Finite-step geometry (arXiv 2609.16665): exact identity, derivatives, classification.

Oracles: Proposition 3.4 (``phi(1) = A - mean KL`` for affine-in-alpha logits) to 1e-8 in
float64; float64 finite differences of ``phi`` for A and Q; hand-built transitions whose
label is known.
"""

import numpy as np
import pytest
import torch

import loopprobe as lp
from loopprobe.estimate.finitestep import path_gains, reference_logprob
from loopprobe.models import GPTConfig, LoopedGPT

f64 = torch.float64


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def problem(seed: int, B: int = 3, T: int = 5, d: int = 8, V: int = 11):
    """A nonlinear transition, a linear head (affine in alpha) and reference targets."""
    g = gen(seed)
    W = torch.randn(d, d, generator=g, dtype=f64)
    head = torch.randn(V, d, generator=g, dtype=f64)
    bias = torch.randn(V, generator=g, dtype=f64)
    H = torch.randn(B, T, d, generator=g, dtype=f64)
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[:, 0] = -100  # the first position is not a reference token
    return (lambda h: torch.tanh(h @ W.T)), (lambda h: h @ head.T + bias), H, targets


@pytest.mark.parametrize("seed", range(5))
def test_full_step_gain_is_slope_minus_kl_for_an_affine_readout(seed):
    F, readout, H, targets = problem(seed)
    fs = lp.finite_step(F, H, readout, targets)
    np.testing.assert_allclose(fs.gain, fs.A - fs.kl, rtol=0, atol=1e-8)
    assert np.all(fs.kl >= 0)


def test_identity_fails_for_a_readout_that_is_not_affine_in_alpha():
    F, readout, H, targets = problem(0)
    normed = lambda h: readout(h / h.norm(dim=-1, keepdim=True))  # noqa: E731
    fs = lp.finite_step(F, H, normed, targets)
    assert np.abs(fs.gain - (fs.A - fs.kl)).max() > 1e-3


def test_slope_and_curvature_match_finite_differences_on_a_transformer_round():
    cfg = GPTConfig(vocab_size=16, seq_len=8, d_model=8, n_heads=2, K=1, R=2, recall="add")
    model = LoopedGPT(cfg, generator=gen(0)).double()
    idx = torch.randint(0, 16, (2, 6), generator=gen(1))
    x = model.embed(idx).detach()
    F = lambda h: model.step(h, x)  # noqa: E731
    targets = torch.roll(idx, -1, dims=1)
    H = F(x).detach()  # the transition from round 1 to round 2
    fs = lp.finite_step(F, H, model.head, targets)
    U = reference_logprob(model.head, targets)
    D = (F(H) - H).detach()
    with torch.no_grad():
        phi = {a: (U(H + a * D) - U(H)).numpy() for a in (-1e-3, -1e-6, 1e-6, 1e-3)}
    np.testing.assert_allclose(fs.A, (phi[1e-6] - phi[-1e-6]) / 2e-6, rtol=1e-6)
    np.testing.assert_allclose(fs.Q, (phi[1e-3] + phi[-1e-3]) / (2 * 1e-6), rtol=1e-4)
    assert all(p.grad is None for p in model.parameters())


def test_quadratic_model_error_shrinks_like_the_cube_of_the_step():
    F, readout, H, targets = problem(3)
    errors = []
    for eps in (1e-1, 1e-2):
        fs = lp.finite_step(lambda h, eps=eps: h + eps * (F(h) - h), H, readout, targets)
        errors.append(np.abs(fs.gain - fs.predicted).max())
    assert errors[1] < errors[0] / 300  # O(eps^3): 1000x in theory


def labelled_transitions():
    """Uniform readout at H = 0 (identity head, V = 32), target token 0 everywhere."""
    V = 32
    H = torch.zeros(3, 1, V, dtype=f64)
    D = torch.zeros(3, 1, V, dtype=f64)
    D[0, 0, 0] = 1.0  # raise the target: helpful
    D[1, 0, 0] = -1.0  # lower the target: wrong direction
    D[2, 0, 0], D[2, 0, 1] = 0.5, 10.0  # raise it a little, a rival a lot: overshoot
    targets = torch.zeros(3, 1, dtype=torch.long)
    return (lambda h: h + D), (lambda h: h), H, targets


def test_transitions_are_labelled_helpful_directional_and_finite_step_failures():
    F, readout, H, targets = labelled_transitions()
    fs = lp.finite_step(F, H, readout, targets)
    assert fs.label == ["helpful", "directional failure", "finite-step failure"]
    assert fs.A[2] > 0 > fs.gain[2]
    assert 0 < fs.alpha_hat[2] < 1
    assert fs.alpha_hat[2] == pytest.approx(-fs.A[2] / (2 * fs.Q[2]), rel=1e-12)
    assert fs.gain_at_alpha_hat[2] > 0  # the shorter step along the same direction helps
    assert list(fs.to_frame().columns) == [
        "example", "A", "Q", "predicted", "gain", "kl", "alpha_hat", "gain_at_alpha_hat", "label",
    ]  # fmt: skip


def test_alpha_hat_without_negative_curvature_is_the_better_endpoint_of_q():
    """Paper Eq. 8 / App. A.4: for Q >= 0, alpha_hat = 1 if A + Q > 0, else 0."""
    F, readout, H, targets = problem(1)
    fs = lp.finite_step(F, H, readout, targets, utility=lambda h: (h**2).flatten(1).sum(1))
    assert np.all(fs.Q > 0)
    np.testing.assert_array_equal(fs.alpha_hat, np.where(fs.A + fs.Q > 0, 1.0, 0.0))
    down = lp.finite_step(lambda h: 0.5 * h, H, readout, targets,
                          utility=lambda h: (h**2).flatten(1).sum(1))  # fmt: skip
    assert np.all(down.Q > 0) and np.all(down.A + down.Q < 0) and np.all(down.alpha_hat == 0)
    np.testing.assert_allclose(fs.gain, fs.predicted, rtol=1e-12)  # a quadratic utility


def test_path_gains_start_at_zero_and_end_at_the_full_step_gain():
    F, readout, H, targets = problem(2)
    path = path_gains(F, H, readout, targets)
    fs = lp.finite_step(F, H, readout, targets)
    assert len(path) == 3 * 21
    assert np.all(path[path.alpha == 0].gain == 0)
    np.testing.assert_allclose(path[path.alpha == 1].gain.to_numpy(), fs.gain, rtol=1e-12)


def test_bad_transitions_and_targets_are_errors_naming_the_call():
    F, readout, H, targets = problem(0)
    with pytest.raises(ValueError, match=r"finite_step: F changed the state from \(3, 5, 8\)"):
        lp.finite_step(lambda h: h[:, :2], H, readout, targets)
    with pytest.raises(ValueError, match="finite_step: F\\(H\\) contains NaN"):
        lp.finite_step(lambda h: h * float("nan"), H, readout, targets)
    with pytest.raises(ValueError, match="targets must match the logits"):
        lp.finite_step(F, H, readout, targets[:, :2])
    with pytest.raises(TypeError, match="finite_step: targets must be a LongTensor"):
        lp.finite_step(F, H, readout, targets.double())
    empty = targets.clone()
    empty[1] = -100
    with pytest.raises(ValueError, match="finite_step: example 1 has no reference token"):
        lp.finite_step(F, H, readout, empty)
