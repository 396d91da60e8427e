"""Fixed points: reachability, spectral radius, Jacobian norm, input-dependence.

Definitions: docs/definitions.md §4.

Oracles: closed forms of linear loops (LinearLoop and plain matrices), dense ``jacrev``
Jacobians with ``eigvals``/SVD at d <= 32, float64 finite differences; failure modes:
the rotation, NaN, divergence, shape changes.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import loopprobe as lp
from loopprobe.estimate.fixedpoint import jacobian_norm
from loopprobe.models import GPTConfig, LinearLoop, LinearLoopConfig, LoopedGPT

f64 = torch.float64


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def tanh_round(d: int, seed: int, gain: float = 0.9):
    """T(h; x) = tanh(W h + U x + b), a contraction for gain < 1."""
    g = gen(seed)
    W = gain * torch.randn(d, d, generator=g, dtype=f64) / d**0.5
    U = torch.randn(d, d, generator=g, dtype=f64) / d**0.5
    b = 0.5 * torch.randn(d, generator=g, dtype=f64)
    x = torch.randn(d, generator=g, dtype=f64)
    return (lambda h, x: torch.tanh(W @ h + U @ x + b)), x


def rotation(n: int, rho: float) -> torch.Tensor:
    """Block-diagonal rho * rotations with distinct angles: every |eigenvalue| = rho."""
    A = torch.zeros(n, n, dtype=f64)
    for i, a in enumerate(torch.linspace(0.1, 3.0, n // 2, dtype=f64)):
        c, s = math.cos(a), math.sin(a)
        A[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = rho * torch.tensor([[c, -s], [s, c]], dtype=f64)
    return A


def dense_jacobian(T, h: torch.Tensor) -> torch.Tensor:
    return torch.func.jacrev(T)(h).reshape(h.numel(), h.numel()).detach()


def linear_loop(d: int = 8, seed: int = 0) -> LinearLoop:
    cfg = LinearLoopConfig(d=d, R=4, spectrum=tuple(-np.linspace(0.4, 3.6, d)), recall=True)
    return LinearLoop(cfg, generator=gen(seed)).double()


# ------------------------------------------------------------------------- reachability


def test_picard_reaches_the_closed_form_fixed_point_of_a_linear_loop():
    model = linear_loop()
    A = model.transition_matrix()
    x = torch.randn(3, 8, generator=gen(1), dtype=f64)
    fp = lp.fixed_point(model.step, x, x=x, tol=1e-13, max_iter=500)
    h_star = torch.linalg.solve(torch.eye(8, dtype=f64) - A, model.U.weight.detach() @ x.T).T
    assert fp.converged and fp.method == "picard"
    torch.testing.assert_close(fp.h, h_star, rtol=1e-11, atol=1e-11)
    rho = torch.linalg.eigvals(A).abs().max().item()  # 0.9: eigenvalues 1 + eps * spectrum
    assert fp.rate == pytest.approx(rho, rel=1e-3)


def test_residual_trace_is_relative_step_length():
    T, x = tanh_round(6, 0)
    h0 = torch.ones(6, dtype=f64)
    fp = lp.fixed_point(T, h0, x=x, max_iter=3, tol=1e-300)
    h1 = T(h0, x)
    assert len(fp.residuals) == 4 and fp.iterations == 3
    assert fp.residuals[0] == pytest.approx(((h1 - h0).norm() / h0.norm()).item(), rel=1e-14)
    assert fp.residuals[1] == pytest.approx(((T(h1, x) - h1).norm() / h1.norm()).item(), rel=1e-14)
    assert list(fp.to_frame().columns) == ["iteration", "residual"] and len(fp.to_frame()) == 4


def test_anderson_reaches_the_same_point_in_fewer_rounds():
    T, x = tanh_round(16, 3, gain=1.0)
    h0 = torch.zeros(16, dtype=f64)
    picard = lp.fixed_point(T, h0, x=x, tol=1e-10, max_iter=2000)
    anderson = lp.fixed_point(T, h0, x=x, tol=1e-10, method="anderson", memory=5)
    assert picard.converged and anderson.converged
    assert anderson.iterations < picard.iterations / 2
    torch.testing.assert_close(anderson.h, picard.h, rtol=1e-8, atol=1e-8)


def test_rotation_never_converges_and_says_it_is_not_contracting():
    A = rotation(8, 1.0)
    fp = lp.fixed_point(lambda h: A @ h, torch.ones(8, dtype=f64), max_iter=50)
    assert not fp.converged
    assert fp.rate == pytest.approx(1.0, abs=1e-9)
    assert "max_iter=50" in fp.reason and "not contracting" in fp.reason


def test_nan_and_divergence_come_back_unconverged_with_the_reason():
    h0 = torch.ones(4, dtype=f64)
    nan = lp.fixed_point(lambda h: h / 0 * 0, h0)
    assert not nan.converged and "NaN/inf at iteration 0" in nan.reason
    torch.testing.assert_close(nan.h, h0)
    grow = lp.fixed_point(lambda h: 2 * h, h0)
    assert not grow.converged and grow.reason.startswith("diverged")
    assert grow.iterations == 26  # ||T(h_26)|| = 2^27 * 2 > 1e8 * ||h0|| = 2e8


def test_a_step_that_changes_the_shape_is_a_value_error_naming_the_call():
    with pytest.raises(ValueError, match=r"fixed_point: step changed the state from \(4,\)"):
        lp.fixed_point(lambda h: torch.cat([h, h]), torch.ones(4))
    with pytest.raises(ValueError, match="spectral_radius: step changed the state"):
        lp.spectral_radius(lambda h: h[:2], torch.ones(4, dtype=f64))
    with pytest.raises(ValueError, match="method='newton' is unknown"):
        lp.fixed_point(lambda h: h, torch.ones(4), method="newton")
    with pytest.raises(TypeError, match="fixed_point: the state must be a floating-point"):
        lp.fixed_point(lambda h: h, torch.ones(4, dtype=torch.long))
    with pytest.raises(ValueError, match="spectral_radius: k must be an integer >= 1"):
        lp.spectral_radius(lambda h: h, torch.ones(4, dtype=f64), k=0)


def test_round_residuals_measure_where_the_models_rounds_stop():
    model = linear_loop()
    x = torch.randn(2, 8, generator=gen(2), dtype=f64)
    h_star = lp.fixed_point(model.step, x, x=x, tol=1e-13, max_iter=500).h
    rr = lp.round_residuals(model.step, x, 4, x=x, h_star=h_star)
    torch.testing.assert_close(rr.h, model(x).detach())
    hR = model(x).detach()
    assert rr.residual == pytest.approx(((model.step(hR, x) - hR).norm() / hR.norm()).item())
    assert rr.distance == pytest.approx(((hR - h_star).norm() / h_star.norm()).item())
    d = rr.to_frame()["distance"].to_numpy()
    assert len(d) == 5 and np.all(np.diff(d) < 0)  # a contraction: every round gets closer


def test_round_map_of_a_reference_model_restores_its_modes_and_parameters():
    cfg = GPTConfig(vocab_size=16, seq_len=8, d_model=8, n_heads=2, K=1, R=3, recall="add")
    model = LoopedGPT(cfg, generator=gen(0)).double().train()
    model.blocks[0].mlp.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rm = lp.round_map(model, torch.randint(0, 16, (1, 4), generator=gen(1)))
    fp = lp.fixed_point(rm.T, rm.h0, max_iter=5)
    lp.spectral_radius(rm.T, fp.h, k=2)
    assert rm.rounds == 3 and rm.x.shape == (1, 4, 8)
    assert model.training and not model.blocks[0].mlp.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(TypeError, match="round_map: Linear has no method 'step'"):
        lp.round_map(torch.nn.Linear(2, 2), torch.zeros(1, 2))


# ----------------------------------------------------------------------------- geometry


@given(seed=st.integers(0, 10_000), d=st.integers(2, 16))
@example(seed=0, d=2)  # too small for ARPACK: the full Arnoldi path
@example(seed=1, d=8)  # k + 2 = 8: the smallest ARPACK case
def test_spectral_radius_matches_eigvals_of_the_dense_jacobian(seed, d):
    T, x = tanh_round(d, seed, gain=1.5)
    h = torch.randn(d, generator=gen(seed + 1), dtype=f64)
    dense = torch.linalg.eigvals(dense_jacobian(lambda h: T(h, x), h)).abs()
    for method in ("arnoldi", "dense"):  # auto takes "dense" at these sizes
        sr = lp.spectral_radius(T, h, x=x, k=6, method=method)
        assert sr.converged, sr.reason
        assert sr.method == (method if method == "dense" or d >= 8 else "full-arnoldi")
        assert sr.value == pytest.approx(dense.max().item(), rel=1e-4)
        top = np.sort(dense.numpy())[::-1][: len(sr.eigenvalues)]
        np.testing.assert_allclose(np.abs(sr.eigenvalues), top, rtol=1e-4)


def test_spectral_radius_of_a_transformer_round_matches_the_dense_jacobian():
    cfg = GPTConfig(vocab_size=16, seq_len=8, d_model=8, n_heads=2, K=1, R=4, recall="add",
                    outer_norm=True)  # fmt: skip
    model = LoopedGPT(cfg, generator=gen(0)).double()
    rm = lp.round_map(model, torch.randint(0, 16, (1, 4), generator=gen(0)))
    dense = torch.linalg.eigvals(dense_jacobian(rm.T, rm.h0)).abs().max().item()
    for method in ("arnoldi", "dense", "auto"):
        sr = lp.spectral_radius(rm.T, rm.h0, k=4, method=method)
        assert sr.converged and sr.value == pytest.approx(dense, rel=1e-4)
        assert sr.residuals.max() <= 1e-6  # each pair checked by fresh JVPs


def test_auto_takes_the_dense_jacobian_up_to_its_crossover_only(monkeypatch):
    from loopprobe.estimate import fixedpoint

    n = 300  # more than one chunk of batched JVPs (256 columns each)
    noise = torch.randn(n, n, generator=gen(3), dtype=f64) / n  # not symmetric
    A = torch.diag(0.9 ** torch.arange(n, dtype=f64)) + noise
    rho = torch.linalg.eigvals(A).abs().max().item()
    for limit, method in ((n, "dense"), (n - 1, "arnoldi")):
        monkeypatch.setattr(fixedpoint, "DENSE_N", limit)
        sr = lp.spectral_radius(lambda h: A @ h, torch.ones(n, dtype=f64), k=3)
        assert sr.method == method and sr.converged
        assert sr.value == pytest.approx(rho, rel=1e-8)
    with pytest.raises(ValueError, match="method='qr'"):
        lp.spectral_radius(lambda h: A @ h, torch.ones(40, dtype=f64), method="qr")


def test_the_dense_path_finds_the_top_pairs_by_arpack_or_by_eig_where_arpack_fails(monkeypatch):
    import scipy.sparse.linalg

    from loopprobe.estimate import eigenpairs

    n, k = 200, 5  # above DENSE_ARPACK_N; a real non-normal map: complex pairs on top
    A = torch.randn(n, n, generator=gen(5), dtype=f64) / n**0.5
    A += torch.diag(torch.linspace(-0.5, 0.5, n, dtype=f64))
    top = np.sort(np.abs(torch.linalg.eigvals(A).numpy()))[::-1]
    runs = []
    for case in ("arpack", "eig", "arpack fails"):
        monkeypatch.setattr(eigenpairs, "DENSE_ARPACK_N", 10**9 if case == "eig" else 128)
        if case == "arpack fails":

            def refuse(*args, **kwargs):
                raise scipy.sparse.linalg.ArpackNoConvergence("planted", np.zeros(0), None)

            monkeypatch.setattr(scipy.sparse.linalg, "eigs", refuse)
        sr = lp.spectral_radius(lambda h: A @ h, torch.ones(n, dtype=f64), k=k, method="dense")
        assert sr.converged and sr.method == "dense", sr.reason
        got = np.abs(sr.eigenvalues)
        np.testing.assert_allclose(got, top[: len(got)], rtol=1e-8)  # ARPACK tol 1e-8
        runs.append(got)
    np.testing.assert_allclose(runs[0][:k], runs[1][:k], rtol=1e-8)


def test_spectral_radius_of_a_linear_loop_is_the_top_eigenvalue_of_its_transition():
    model = linear_loop(d=24)
    x = torch.randn(24, dtype=f64, generator=gen(5))
    sr = lp.spectral_radius(model.step, x, x=x, k=3)
    closed = torch.linalg.eigvalsh(model.transition_matrix()).abs().max().item()
    assert sr.converged and sr.value == pytest.approx(closed, rel=1e-10)


@pytest.mark.parametrize("k", [1, 2, 6])
def test_rotation_comes_back_right_or_unconverged_never_converged_and_wrong(k):
    A = rotation(40, 0.9)
    sr = lp.spectral_radius(lambda h: A @ h, torch.ones(40, dtype=f64), k=k)
    assert len(sr.eigenvalues) == k or not sr.converged
    if sr.converged:
        np.testing.assert_allclose(np.abs(sr.eigenvalues), 0.9, rtol=1e-8)
        assert sr.residuals.max() <= 1e-6


def test_arpack_failure_is_reported_not_raised_with_an_uncertified_ritz_value():
    A = rotation(40, 0.9)
    sr = lp.spectral_radius(
        lambda h: A @ h, torch.ones(40, dtype=f64), k=6, max_iter=1, method="arnoldi"
    )
    assert not sr.converged and sr.method == "arnoldi-ritz"
    assert sr.reason.startswith("ARPACK did not converge: 0 of 6")
    assert 0 < sr.value <= 0.9 + 1e-12  # Ritz values of a normal matrix lie in its field of values
    assert sr.estimate().converged is False


def test_a_nan_jacobian_is_reported_not_raised():
    for method in ("arnoldi", "dense"):
        sr = lp.spectral_radius(torch.sqrt, torch.zeros(8, dtype=f64), method=method)
        assert not sr.converged and "JVP of the step returned NaN/inf" in sr.reason


def test_spectral_radius_frame_has_one_row_per_eigenvalue():
    A = torch.diag(torch.tensor([0.5, -0.9, 0.1, 0.2, 0.3, 0.05, 0.01, 0.02], dtype=f64))
    sr = lp.spectral_radius(lambda h: A @ h, torch.ones(8, dtype=f64), k=3)
    frame = sr.to_frame()
    assert list(frame["modulus"].round(12)) == [0.9, 0.5, 0.3]
    assert frame["real"].iloc[0] == pytest.approx(-0.9)


def test_jacobian_norm_matches_the_svd_of_the_dense_jacobian():
    T, x = tanh_round(12, 4, gain=2.0)
    h = torch.randn(12, dtype=f64, generator=gen(9))
    est = jacobian_norm(T, h, x=x)
    dense = torch.linalg.matrix_norm(dense_jacobian(lambda h: T(h, x), h), 2).item()
    assert est.converged and est.value == pytest.approx(dense, rel=1e-6)


# --------------------------------------------------------------------- input-dependence


def implicit_oracle(T, h_star, x):
    Jh = dense_jacobian(lambda h: T(h, x), h_star)
    Jx = torch.func.jacrev(lambda u: T(h_star, u))(x).reshape(h_star.numel(), x.numel())
    return torch.linalg.solve(torch.eye(h_star.numel(), dtype=f64) - Jh, Jx)


def test_implicit_derivative_matches_finite_differences_of_the_fixed_point():
    T, x = tanh_round(10, 6)
    h0 = torch.zeros(10, dtype=f64)
    h_star = lp.fixed_point(T, h0, x=x, tol=1e-15, max_iter=5000).h
    u = torch.randn(2, 10, dtype=f64, generator=gen(7))
    dep = lp.input_dependence(T, h_star, x, directions=u)
    delta = 1e-5
    for i in range(2):
        hp = lp.fixed_point(T, h_star, x=x + delta * u[i], tol=1e-15, max_iter=5000).h
        hm = lp.fixed_point(T, h_star, x=x - delta * u[i], tol=1e-15, max_iter=5000).h
        fd = (hp - hm) / (2 * delta)
        assert ((dep.tangents[i] - fd).norm() / fd.norm()).item() < 1e-5
    S = implicit_oracle(T, h_star, x)
    assert dep.converged and dep.value == pytest.approx(
        torch.linalg.matrix_norm(S, 2).item(), rel=1e-6
    )


def test_linear_loop_input_dependence_is_the_closed_form():
    model = linear_loop()
    x = torch.randn(8, dtype=f64, generator=gen(3))
    h_star = lp.fixed_point(model.step, x, x=x, tol=1e-14, max_iter=1000).h
    dep = lp.input_dependence(model.step, h_star, x, rounds=4)
    A, U = model.transition_matrix(), model.U.weight.detach()
    closed = torch.linalg.solve(torch.eye(8, dtype=f64) - A, U)  # dh*/dx = (I - A)^-1 U
    unrolled = torch.linalg.matrix_power(A, 4) + sum(torch.linalg.matrix_power(A, r) @ U
                                                     for r in range(4))  # fmt: skip
    assert dep.value == pytest.approx(torch.linalg.matrix_norm(closed, 2).item(), rel=1e-8)
    assert dep.unrolled.value == pytest.approx(
        torch.linalg.matrix_norm(unrolled, 2).item(), rel=1e-8
    )


def test_unrolled_derivative_approaches_the_implicit_one_as_rounds_grow():
    T, x = tanh_round(8, 11)
    h_star = lp.fixed_point(T, torch.zeros(8, dtype=f64), x=x, tol=1e-15, max_iter=5000).h
    u = torch.randn(8, dtype=f64, generator=gen(1))
    deps = [lp.input_dependence(T, h_star, x, rounds=R, directions=u) for R in (2, 8, 40)]
    gaps = [dep.gap for dep in deps]
    assert gaps[0] > gaps[1] > gaps[2] and gaps[2] < 1e-8
    frame = deps[-1].to_frame()
    assert list(frame["probe"]) == ["operator", "direction 0"] and frame["gap"].max() < 1e-6


def test_without_recall_the_fixed_point_ignores_the_input_but_the_rounds_do_not():
    g = gen(4)
    W = 0.5 * torch.randn(6, 6, generator=g, dtype=f64) / 6**0.5
    T = lambda h, x: torch.tanh(W @ h) + 0.1  # noqa: E731 - no recall: x is never read
    x = torch.randn(6, generator=g, dtype=f64)
    h_star = lp.fixed_point(T, x, x=x, tol=1e-14, max_iter=1000).h
    dep = lp.input_dependence(T, h_star, x, rounds=3)  # h0 = x: the rounds start at the input
    assert dep.value == 0.0 and dep.unrolled.value > 1e-3 and dep.gap == 1.0


def test_input_dependence_rejects_bad_directions_and_start():
    T, x = tanh_round(4, 0)
    h = torch.zeros(4, dtype=f64)
    with pytest.raises(ValueError, match=r"input_dependence: directions have shape \(3,\)"):
        lp.input_dependence(T, h, x, directions=torch.ones(3, dtype=f64))
    with pytest.raises(ValueError, match="input_dependence: h0=None starts the rounds at x"):
        lp.input_dependence(lambda h, x: h, torch.zeros(5, dtype=f64), x, rounds=2)


def test_traced_jvps_agree_with_plain_jvps(monkeypatch):
    from loopprobe.differentiate.roundmap import TracedJVP

    monkeypatch.setattr(TracedJVP, "min_seconds", 0.0)
    cfg = GPTConfig(vocab_size=16, seq_len=8, d_model=8, n_heads=2, K=1, R=2, recall="internal")
    model = LoopedGPT(cfg, generator=gen(0)).double()
    rm = lp.round_map(model, torch.randint(0, 16, (1, 4), generator=gen(1)))
    jvp = TracedJVP(rm.T, rm.h0, trace=True)
    vs = torch.randn(12, *rm.h0.shape, dtype=f64, generator=gen(2))
    outs = [jvp(v) for v in vs]
    assert jvp.traced is not None  # traced after 10 plain calls
    for v, out in zip(vs, outs, strict=True):
        torch.testing.assert_close(
            out, torch.func.jvp(rm.T, (rm.h0,), (v,))[1], rtol=1e-12, atol=1e-12
        )


@pytest.mark.parametrize("recall, input_arg", [("none", None), ("internal", "inject")])
def test_replayed_round_of_a_recorded_block_is_the_models_own_round(recall, input_arg):
    cfg = GPTConfig(vocab_size=16, seq_len=8, d_model=8, n_heads=2, K=1, R=3, recall=recall)
    model = LoopedGPT(cfg, generator=gen(0)).double()
    idx = torch.randint(0, 16, (1, 4), generator=gen(1))
    replay = lp.replay_round(model, idx, "blocks.0", input_arg=input_arg)
    own = lp.round_map(model, idx)
    h = torch.randn(1, 4, 8, dtype=f64, generator=gen(2))
    assert replay.rounds == 3 and torch.equal(replay.h0, own.h0)
    assert torch.equal(replay.T(h), own.T(h))
    if input_arg is not None:  # the recorded input is x: input-dependence sees the recall
        torch.testing.assert_close(replay.x, own.x)
        a = lp.input_dependence(replay.step, h, replay.x, norm_tol=1e-6).value
        b = lp.input_dependence(own.step, h, own.x, norm_tol=1e-6).value
        assert a == pytest.approx(b, rel=1e-5) and a > 0


class KeywordCell(torch.nn.Module):
    """A recurrent cell called with keyword-only arguments, as block(x=..., h=...)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = torch.nn.Linear(d, d)

    def forward(self, *, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.w(h) + x)


class KeywordRecurrence(torch.nn.Module):
    def __init__(self, d: int = 4, R: int = 3) -> None:
        super().__init__()
        self.R, self.inject, self.cell = R, torch.nn.Linear(d, d), KeywordCell(d)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        x = self.inject(u)
        h = torch.zeros_like(x)
        for _ in range(self.R):
            h = self.cell(x=x, h=h)
        return h


def test_replay_takes_the_state_and_input_as_keyword_arguments():
    torch.manual_seed(0)
    model = KeywordRecurrence().double()
    u = torch.randn(2, 4, dtype=f64, generator=gen(1))
    h = torch.randn(2, 4, dtype=f64, generator=gen(2))
    x = model.inject(u).detach()
    cell = lambda h, x: torch.tanh(model.cell.w(h) + x)  # noqa: E731
    replay = lp.replay_round(model, u, "cell", state_arg="h", input_arg="x")
    assert replay.rounds == 3 and torch.equal(replay.h0, torch.zeros(2, 4, dtype=f64))
    torch.testing.assert_close(replay.x, x, rtol=0, atol=0)
    torch.testing.assert_close(replay.T(h), cell(h, x), rtol=0, atol=0)
    x2 = torch.randn(2, 4, dtype=f64, generator=gen(3))  # step substitutes the keyword input
    torch.testing.assert_close(replay.step(h, x2), cell(h, x2), rtol=0, atol=0)
    state_only = lp.replay_round(model, u, "cell", state_arg="h")
    torch.testing.assert_close(state_only.T(h), cell(h, x), rtol=0, atol=0)
    with pytest.raises(TypeError, match="replay_round: .* position \\(int\\) or keyword"):
        lp.replay_round(model, u, "cell", state_arg=1.5)


def test_replay_refuses_calls_that_do_not_chain_into_rounds():
    cfg = GPTConfig(vocab_size=16, seq_len=8, d_model=8, n_heads=2, K=1, R=3, recall="add")
    model = LoopedGPT(cfg, generator=gen(0)).double()
    with pytest.raises(ValueError, match="replay_round: call 1 of 'blocks.0' does not receive"):
        lp.replay_round(model, torch.zeros(1, 4, dtype=torch.long), "blocks.0")


def test_a_singular_implicit_system_gives_nan_and_the_reason_quickly():
    A = torch.diag(torch.tensor([1.0, 0.5, 0.2, 0.1], dtype=f64))  # 1 is an eigenvalue of dT/dh
    T = lambda h, x: A @ h + x  # noqa: E731
    x = torch.ones(4, dtype=f64)
    dep = lp.input_dependence(T, torch.zeros(4, dtype=f64), x, rounds=3, solve_max_iter=40)
    assert math.isnan(dep.value) and not dep.converged and dep.solver_failures == 1
    assert "implicit: GMRES missed rtol 1e-10 within 40 JVPs" in dep.reason
    assert "not a fixed point" in dep.reason  # 1 is an eigenvalue: no fixed point exists
    assert dep.unrolled.value == pytest.approx(4.0)  # d h_3/dx = A^3 + A^2 + A + I on e_0
