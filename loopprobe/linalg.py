"""Matrix-free linear algebra on operators given as functions.

Estimators here take ``matvec``/``rmatvec`` callables, never modules, so they can be
tested on plain matrices. Every iterative estimate carries its diagnostics
(:class:`Estimate`): value, iterations used, converged flag and last relative change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

MatVec = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Estimate:
    """The result of an iterative estimator, with the diagnostics needed to trust it."""

    value: float
    iterations: int
    converged: bool
    rel_change: float
    method: str = "power"

    def to_dict(self) -> dict:
        return asdict(self)


def operator_norm(
    matvec: MatVec,
    rmatvec: MatVec,
    v0: torch.Tensor,
    *,
    max_iter: int = 100,
    tol: float = 1e-10,
) -> list[Estimate]:
    """Spectral norm ``||A||`` of a batch of operators by power iteration on ``A^T A``.

    ``v0`` has shape ``(B, n)``: one start vector per operator in the batch. ``matvec``
    maps ``(B, n) -> (B, m)`` (``A_b v_b`` for every b) and ``rmatvec`` maps
    ``(B, m) -> (B, n)`` (``A_b^T u_b``). Batching is the caller's (e.g. ``torch.vmap``
    over JVPs); this loop only normalises and checks convergence.

    The estimate after each step is ``sigma = ||A v||`` with ``||v|| = 1``, a lower bound
    on the true norm that increases monotonically. An operator counts as converged once
    the relative change of ``sigma`` between two steps drops below ``tol``; operators
    that never get there come back with ``converged=False``.

    Example: ``operator_norm(lambda v: v @ A.T, lambda u: u @ A, torch.randn(1, n))``.
    """
    if v0.dim() != 2:
        raise ValueError(
            f"operator_norm: v0 must have shape (batch, n), got {tuple(v0.shape)}; "
            "use v0.unsqueeze(0) for a single operator"
        )
    if max_iter < 1:
        raise ValueError(f"operator_norm: max_iter must be >= 1, got {max_iter}")
    batch = v0.shape[0]
    v = _normalize(v0)
    sigma = torch.zeros(batch, dtype=v0.dtype, device=v0.device)
    rel = torch.full((batch,), float("inf"), dtype=v0.dtype, device=v0.device)
    done = torch.zeros(batch, dtype=torch.bool, device=v0.device)
    iters = torch.full((batch,), max_iter, dtype=torch.long)
    for it in range(1, max_iter + 1):
        u = matvec(v)
        new_sigma = u.flatten(1).norm(dim=1)
        step_rel = (new_sigma - sigma).abs() / new_sigma.clamp_min(torch.finfo(v.dtype).tiny)
        rel = torch.where(done, rel, step_rel)
        sigma = torch.where(done, sigma, new_sigma)
        newly = (~done) & (step_rel < tol)
        iters[newly.cpu()] = it
        done = done | newly
        if bool(done.all()):
            break
        w = rmatvec(u)
        v = torch.where(done.view(-1, *[1] * (v.dim() - 1)), v, _normalize(w))
    return [
        Estimate(float(sigma[b]), int(iters[b]), bool(done[b]), float(rel[b]), "power")
        for b in range(batch)
    ]


def operator_norm_krylov(
    matvec: MatVec,
    rmatvec: MatVec,
    v0: torch.Tensor,
    *,
    max_iter: int = 50,
    tol: float = 1e-10,
) -> list[Estimate]:
    """Spectral norm of a batch of operators by Lanczos on ``A^T A`` (batched, matrix-free).

    Same calling convention as :func:`operator_norm` (``v0`` is ``(B, n)``, ``matvec``
    ``(B, n) -> (B, m)``, ``rmatvec`` back), one ``A^T A`` product per step, but the
    estimate is the top Ritz value of the Krylov space built so far (full
    reorthogonalisation), which converges far faster than power iteration when the top
    singular values are close. Converged when the Ritz residual ``|b_k y_k|`` is below
    ``tol`` times the Ritz value (the eigenvalue error is then about its square);
    ``rel_change`` is the last relative change of the estimate. Memory: ``max_iter``
    vectors of shape ``(B, n)``.
    """
    if v0.dim() != 2:
        raise ValueError(
            f"operator_norm_krylov: v0 must have shape (batch, n), got {tuple(v0.shape)}"
        )
    if max_iter < 1:
        raise ValueError(f"operator_norm_krylov: max_iter must be >= 1, got {max_iter}")
    B = v0.shape[0]
    tiny = torch.finfo(v0.dtype).tiny
    q = _normalize(v0)
    basis: list[torch.Tensor] = []
    alphas: list[torch.Tensor] = []
    betas: list[torch.Tensor] = []
    sigma = torch.zeros(B, dtype=torch.float64)
    rel = torch.full((B,), float("inf"), dtype=torch.float64)
    done = torch.zeros(B, dtype=torch.bool)
    iters = torch.full((B,), max_iter, dtype=torch.long)
    for it in range(1, max_iter + 1):
        basis.append(q)
        w = rmatvec(matvec(q))
        a = (w * q).sum(1)
        w = w - a[:, None] * q
        if betas:
            w = w - betas[-1].to(w.dtype)[:, None] * basis[-2]
        for _ in range(2):  # full reorthogonalisation, twice is enough
            for qi in basis:
                w = w - (w * qi).sum(1)[:, None] * qi
        b = w.norm(dim=1)
        alphas.append(a.detach().double().cpu())
        betas.append(b.detach().double().cpu())
        A = torch.stack(alphas, 1)
        Bt = torch.stack(betas, 1)
        new_sigma = torch.empty(B, dtype=torch.float64)
        resid = torch.empty(B, dtype=torch.float64)
        for k in range(B):
            Tk = torch.diag(A[k]) + torch.diag(Bt[k, :-1], 1) + torch.diag(Bt[k, :-1], -1)
            evals, evecs = torch.linalg.eigh(Tk)
            theta = float(evals[-1].clamp_min(0))
            new_sigma[k] = theta**0.5
            resid[k] = abs(float(Bt[k, -1]) * float(evecs[-1, -1])) / max(theta, tiny)
        step_rel = (new_sigma - sigma).abs() / new_sigma.clamp_min(tiny)
        rel = torch.where(done, rel, step_rel)
        sigma = torch.where(done, sigma, new_sigma)
        exhausted = Bt[:, -1] <= 1e-12 * new_sigma.square().clamp_min(tiny)
        newly = (~done) & ((resid < tol) | exhausted)
        iters[newly] = it
        done = done | newly
        if bool(done.all()):
            break
        safe = b.clamp_min(tiny)[:, None]
        q = torch.where((b > 0)[:, None], w / safe, torch.zeros_like(w))
    return [
        Estimate(float(sigma[k]), int(iters[k]), bool(done[k]), float(rel[k]), "lanczos")
        for k in range(B)
    ]


def _normalize(v: torch.Tensor) -> torch.Tensor:
    norms = v.flatten(1).norm(dim=1).clamp_min(torch.finfo(v.dtype).tiny)
    return v / norms.view(-1, *[1] * (v.dim() - 1))
