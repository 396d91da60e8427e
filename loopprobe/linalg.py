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
    out: torch.Tensor | None = None,
    subset: bool = False,
) -> list[Estimate]:
    """Spectral norm ``||A||`` of a batch of operators by power iteration on ``A^T A``.

    ``v0`` has shape ``(B, n)``: one start vector per operator in the batch. ``matvec``
    maps ``(B, n) -> (B, m)`` (``A_b v_b`` for every b) and ``rmatvec`` maps
    ``(B, m) -> (B, n)`` (``A_b^T u_b``). Batching is the caller's (e.g. ``torch.vmap``
    over JVPs); this loop only normalises and checks convergence.

    The estimate after each step is ``sigma = ||A v||`` with ``||v|| = 1``, a lower bound
    on the true norm that increases monotonically. An operator counts as converged once
    the relative change of ``sigma`` between two steps drops below ``tol``; operators
    that never get there come back with ``converged=False``. ``out`` (shape of ``v0``), if
    given, receives the last unit vector of each operator (its top right singular vector
    estimate; a warm start for a later call). ``subset=True``: converged operators drop
    out of the batch (see :func:`operator_norm_krylov`).

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
    done = torch.zeros(batch, dtype=torch.bool)
    iters = torch.full((batch,), max_iter, dtype=torch.long)
    act = torch.arange(batch)
    for it in range(1, max_iter + 1):
        full = None if subset else matvec(v)
        u = matvec(v[act], act) if full is None else full[act]
        new_sigma = u.flatten(1).norm(dim=1)
        old = sigma[act]
        step_rel = (new_sigma - old).abs() / new_sigma.clamp_min(torch.finfo(v.dtype).tiny)
        rel[act] = step_rel
        sigma[act] = new_sigma
        newly = (step_rel < tol).cpu()
        iters[act[newly]] = it
        done[act[newly]] = True
        if bool(done.all()):
            break
        act, u = act[~newly], u[~newly]
        w = rmatvec(u, act) if full is None else rmatvec(full)[act]
        v = v.clone()
        v[act] = _normalize(w)
    if out is not None:
        out.copy_(v)
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
    out: torch.Tensor | None = None,
    subset: bool = False,
) -> list[Estimate]:
    """Spectral norm of a batch of operators by Lanczos on ``A^T A`` (batched, matrix-free).

    Same calling convention as :func:`operator_norm` (``v0`` is ``(B, n)``, ``matvec``
    ``(B, n) -> (B, m)``, ``rmatvec`` back), one ``A^T A`` product per step, but the
    estimate is the top Ritz value of the Krylov space built so far (full
    reorthogonalisation), which converges far faster than power iteration when the top
    singular values are close.

    Converged when the Ritz residual ``r = |b_k y_k|`` of the top Ritz value ``theta`` of
    ``A^T A`` is below ``tol * theta``: an eigenvalue lies within ``r`` of ``theta`` and,
    for a top value separated by ``gap``, the error is about ``r^2 / gap``. The sharper
    stopping rule ``min(r, r^2 / (theta - theta_2))`` (Kahan-Parlett-Jiang with the Ritz
    gap) was measured and dropped: a second singular value that the Krylov space has not
    yet resolved from the first (a cluster narrower than ``r``) makes the Ritz gap far
    too large, and the estimate stopped up to the cluster width (10^4 x tol) off
    (tests/test_linalg.py).
    ``rel_change`` is the last relative change of the estimate. ``out`` (shape of
    ``v0``), if given, receives each operator's top Ritz vector (its top right singular
    vector estimate; a warm start for a later call). ``subset=True``: converged
    operators drop out of the batch; ``matvec(v, idx)`` and ``rmatvec(u, idx)`` then get
    the rows of the operators ``idx`` (a CPU ``LongTensor``) still running and return
    theirs. Memory: ``max_iter`` vectors of shape ``(B, n)``.
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
    alphas = torch.zeros(B, max_iter, dtype=torch.float64)
    betas = torch.zeros(B, max_iter, dtype=torch.float64)
    sigma = torch.zeros(B, dtype=torch.float64)
    rel = torch.full((B,), float("inf"), dtype=torch.float64)
    done = torch.zeros(B, dtype=torch.bool)
    iters = torch.full((B,), max_iter, dtype=torch.long)
    ritz: list[torch.Tensor] = [torch.ones(1, dtype=torch.float64)] * B
    act = torch.arange(B)
    for it in range(1, max_iter + 1):
        basis.append(q)
        qa = q[act]
        w = rmatvec(matvec(qa, act), act) if subset else rmatvec(matvec(q))[act]
        a = (w * qa).sum(1)
        w = w - a[:, None] * qa
        if it > 1:
            w = w - betas[act, it - 2].to(w.dtype).to(w.device)[:, None] * basis[-2][act]
        prior = [qi[act] for qi in basis]
        for _ in range(2):  # full reorthogonalisation, twice is enough
            for qi in prior:
                w = w - (w * qi).sum(1)[:, None] * qi
        b = w.norm(dim=1)
        alphas[act, it - 1] = a.detach().double().cpu()
        betas[act, it - 1] = b.detach().double().cpu()
        newly = torch.zeros(B, dtype=torch.bool)
        for k in act.tolist():
            theta, err, ritz[k] = _ritz(alphas[k, :it], betas[k, :it], tiny)
            new = theta**0.5
            rel[k] = abs(new - float(sigma[k])) / max(new, tiny)
            sigma[k] = new
            exhausted = float(betas[k, it - 1]) <= 1e-12 * max(theta, tiny)
            newly[k] = err < tol or exhausted
        iters[newly] = it
        done |= newly
        if bool(done.all()):
            break
        keep = ~newly[act]
        safe = b.clamp_min(tiny)[:, None]
        q = q.clone()
        q[act] = torch.where((b > 0)[:, None], w / safe, torch.zeros_like(w))
        act = act[keep]
    if out is not None:
        for k in range(B):
            y = ritz[k].to(v0.dtype).to(v0.device)
            out[k] = sum(y[i] * basis[i][k] for i in range(len(y)))
    return [
        Estimate(float(sigma[k]), int(iters[k]), bool(done[k]), float(rel[k]), "lanczos")
        for k in range(B)
    ]


def _ritz(
    alpha: torch.Tensor, beta: torch.Tensor, tiny: float
) -> tuple[float, float, torch.Tensor]:
    """Top Ritz value of the Lanczos matrix, its relative residual, its eigenvector."""
    T = torch.diag(alpha) + torch.diag(beta[:-1], 1) + torch.diag(beta[:-1], -1)
    evals, evecs = torch.linalg.eigh(T)
    theta = float(evals[-1].clamp_min(0))
    r = abs(float(beta[-1]) * float(evecs[-1, -1]))
    return theta, r / max(theta, tiny), evecs[:, -1]


def _normalize(v: torch.Tensor) -> torch.Tensor:
    norms = v.flatten(1).norm(dim=1).clamp_min(torch.finfo(v.dtype).tiny)
    return v / norms.view(-1, *[1] * (v.dim() - 1))
