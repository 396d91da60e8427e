"""Batched operator norms (power iteration, Lanczos) on plain matrices against torch.linalg.svd."""

from __future__ import annotations

import pytest
import torch

from loopprobe.linalg import operator_norm, operator_norm_krylov


def matrices(top_gap: float, seed: int = 0, B: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """``B`` random 30 x 20 matrices whose second singular value is ``1 - top_gap`` times the
    first, and their singular values."""
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(B, 30, 20, generator=g, dtype=torch.float64)
    U, S, Vh = torch.linalg.svd(A, full_matrices=False)
    S[:, 1] = S[:, 0] * (1 - top_gap)
    return U @ torch.diag_embed(S) @ Vh, S


def products(A: torch.Tensor, calls: list | None = None):
    def mv(v, idx=None):
        if calls is not None:
            calls.append(None if idx is None else idx.tolist())
        M = A if idx is None else A[idx]
        return torch.einsum("bmn,bn->bm", M, v)

    def rmv(u, idx=None):
        M = A if idx is None else A[idx]
        return torch.einsum("bmn,bm->bn", M, u)

    return mv, rmv


@pytest.mark.parametrize("top_gap", [1e-3, 0.05, 0.5])
def test_lanczos_stops_only_once_its_error_bound_holds(top_gap):
    A, S = matrices(top_gap)
    v0 = torch.randn(4, 20, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for tol in (1e-4, 1e-8):
        ests = operator_norm_krylov(*products(A), v0, max_iter=20, tol=tol)
        for est, s in zip(ests, S, strict=True):
            assert est.converged
            # sigma^2 known to a relative tol, so sigma to tol / 2
            assert abs(est.value - float(s[0])) <= tol / 2 * float(s[0])


def test_lanczos_with_a_looser_tolerance_stops_sooner():
    A, _ = matrices(0.05)
    v0 = torch.randn(4, 20, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    loose = operator_norm_krylov(*products(A), v0, max_iter=20, tol=1e-4)
    tight = operator_norm_krylov(*products(A), v0, max_iter=20, tol=1e-12)
    assert all(a.iterations < b.iterations for a, b in zip(loose, tight, strict=True))


@pytest.mark.parametrize("solver", [operator_norm, operator_norm_krylov])
def test_both_methods_hand_back_the_top_right_singular_vectors(solver):
    A, _ = matrices(0.5)
    v0 = torch.randn(4, 20, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = torch.zeros_like(v0)
    solver(*products(A), v0, max_iter=200, tol=1e-13, out=out)
    top = torch.linalg.svd(A).Vh[:, 0]
    cos = (out * top).sum(1) / out.norm(dim=1)
    assert torch.allclose(cos.abs(), torch.ones(4, dtype=torch.float64), atol=1e-6)


@pytest.mark.parametrize("solver", [operator_norm, operator_norm_krylov])
def test_converged_operators_leave_the_batch_and_the_answers_do_not_change(solver):
    A, _ = matrices(0.5)
    A[0] = A[0][:, :1] @ A[0][:1, :]  # rank one: converges at once
    v0 = torch.randn(4, 20, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    calls: list = []
    sub = solver(*products(A, calls), v0, max_iter=100, tol=1e-12, subset=True)
    full = solver(*products(A), v0, max_iter=100, tol=1e-12)
    for a, b in zip(sub, full, strict=True):
        assert a.iterations == b.iterations and a.value == pytest.approx(b.value, rel=1e-12)
    assert calls[0] == [0, 1, 2, 3]
    assert all(0 not in c for c in calls[sub[0].iterations :])  # the rank-one one left
    assert len(calls[-1]) < 4


def test_a_start_at_the_top_singular_vector_stops_after_one_or_two_products():
    A, S = matrices(0.05)
    top = torch.linalg.svd(A).Vh[:, 0]
    est = operator_norm_krylov(*products(A), top, max_iter=20, tol=1e-10)
    for e, s in zip(est, S, strict=True):
        assert e.converged and e.iterations <= 2
        assert e.value == pytest.approx(float(s[0]), rel=1e-12)
