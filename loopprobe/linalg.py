"""Matrix-free linear algebra on operators given as functions.

Estimators here take ``matvec``/``rmatvec`` callables, never modules, so they can be
tested on plain matrices. Every iterative estimate carries its diagnostics
(:class:`Estimate`): value, iterations used, converged flag and last relative change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch

MatVec = Callable[[torch.Tensor], torch.Tensor]
#: ``stop(idx, sigma, residual) -> bool`` for the operators ``idx`` still running: a
#: caller's stopping rule (e.g. the error bound of a quantity computed from several norms).
StopRule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
#: Roundoff allowance of a norm estimate, in units of its dtype's eps (relative): the
#: products, the Rayleigh quotient and the tridiagonal eigensolve each round.
ROUNDOFF_EPS = 100
#: A residual above this bounds nothing (:func:`norm_bounds`): early Ritz values sit near
#: an eigenvalue below the top (tests/test_kappa_err.py: after 2 Lanczos steps, residual
#: 0.4, the estimate was 2.32, the certificate's upper end 2.74, the top 3.54).
TRUST_RESIDUAL = 1e-2


@dataclass(frozen=True)
class Estimate:
    """The result of an iterative estimator, with the diagnostics needed to trust it.

    ``residual`` is the certificate: the relative Ritz residual ``||A^T A v - s^2 v|| / s^2``
    of the returned value ``s`` with its unit vector ``v``. Some eigenvalue of ``A^T A`` lies
    within ``residual * s^2`` of ``s^2`` (so some singular value within about
    ``residual / 2`` of ``s``, relative); not necessarily the top one: a start vector that
    misses the top singular vector converges to another. ``converged`` is judged on it.
    """

    value: float
    iterations: int
    converged: bool
    rel_change: float
    method: str = "power"
    residual: float = float("nan")

    def to_dict(self) -> dict:
        return asdict(self)


def norm_bounds(value: float, residual: float, eps: float) -> tuple[float, float]:
    """An interval ``[lo, hi]`` holding ``||A||`` from an estimate ``s`` and its certificate.

    Power and Lanczos estimates are Rayleigh quotients, so ``s^2 <= lambda_max(A^T A)``;
    the residual certificate puts an eigenvalue within ``residual * s^2`` of ``s^2``, and
    when it is the top one (the caveat of every Krylov method: a start vector orthogonal
    to the top singular vector finds another) ``||A|| <= s * sqrt(1 + residual)``. Both ends
    are widened by ``ROUNDOFF_EPS * eps`` for roundoff (``eps`` of the coarsest dtype the
    operator's arithmetic rounds in). An unknown estimate (NaN value or residual) gives
    ``[0, inf]``; one whose residual is above ``TRUST_RESIDUAL`` gives ``[lo, inf]``: its
    eigenvalue need not be the top one (the early iterations of a Krylov method resolve
    lower ones first).
    """
    rho = ROUNDOFF_EPS * eps
    if not (value == value and residual == residual):  # NaN: not estimated (yet)
        return 0.0, float("inf")
    if residual > TRUST_RESIDUAL:
        return value * (1 - rho), float("inf")
    return value * (1 - rho), value * (1 + max(residual, 0.0)) ** 0.5 * (1 + rho)


def residual_tol(dtype: torch.dtype) -> float:
    """The default bound on the relative Ritz residual: 1e-6 in float64, 1e-5 in float32,
    1e-3 in half precision (whose estimates callers do not certify)."""
    if dtype in (torch.float16, torch.bfloat16):
        return 1e-3
    return 1e-6 if dtype == torch.float64 else 1e-5


def operator_norm(
    matvec: MatVec,
    rmatvec: MatVec,
    v0: torch.Tensor,
    *,
    max_iter: int = 100,
    tol: float = 1e-10,
    rtol: float | None = None,
    out: torch.Tensor | None = None,
    subset: bool = False,
    stop: StopRule | None = None,
) -> list[Estimate]:
    """Spectral norm ``||A||`` of a batch of operators by power iteration on ``A^T A``.

    ``v0`` has shape ``(B, n)``: one start vector per operator in the batch. ``matvec``
    maps ``(B, n) -> (B, m)`` (``A_b v_b`` for every b) and ``rmatvec`` maps
    ``(B, m) -> (B, n)`` (``A_b^T u_b``). Batching is the caller's (e.g. ``torch.vmap``
    over JVPs); this loop only normalises and checks convergence.

    The estimate after each step is ``sigma = ||A v||`` with ``||v|| = 1``, a lower bound
    on the true norm that increases monotonically. The relative change of ``sigma``
    between two steps does not bound its error (with a top gap of 1e-5 it fell below
    1e-10 at an error of 7e-6), so an operator stops only when it is below ``tol`` *and*
    the Ritz residual ``r = A^T A v - sigma^2 v`` (the ``A^T`` product of the step, which
    the next step needs anyway) has ``||r|| <= rtol * sigma^2`` (default
    :func:`residual_tol`: 1e-6 in float64). That certifies that ``sigma^2`` is within
    ``||r||`` of *some* eigenvalue of ``A^T A``, not necessarily the top one (a start
    vector orthogonal to the top singular vector converges to another): the caveat of
    Lanczos too. ``Estimate.residual`` is ``||r|| / sigma^2``; operators that never get
    there come back with ``converged=False``. ``out`` (shape of ``v0``), if given,
    receives the last unit vector of each operator (its top right singular vector
    estimate; a warm start for a later call). ``subset=True``: converged operators drop
    out of the batch (see :func:`operator_norm_krylov`). ``stop``: a caller's rule in place
    of ``tol``/``rtol`` (see :func:`operator_norm_krylov`).

    Example: ``operator_norm(lambda v: v @ A.T, lambda u: u @ A, torch.randn(1, n))``.
    """
    _check_start("operator_norm", v0, max_iter)
    rtol = residual_tol(v0.dtype) if rtol is None else rtol
    batch = v0.shape[0]
    tiny = torch.finfo(v0.dtype).tiny
    v = _normalize(v0)
    sigma = torch.zeros(batch, dtype=v0.dtype, device=v0.device)
    rel = torch.full((batch,), float("inf"), dtype=v0.dtype, device=v0.device)
    res = torch.full((batch,), float("inf"), dtype=v0.dtype, device=v0.device)
    done = torch.zeros(batch, dtype=torch.bool)
    iters = torch.full((batch,), max_iter, dtype=torch.long)
    act = torch.arange(batch)
    for it in range(1, max_iter + 1):
        full = None if subset else matvec(v)
        u = matvec(v[act], act) if full is None else full[act]
        new_sigma = u.flatten(1).norm(dim=1)
        old = sigma[act]
        step_rel = (new_sigma - old).abs() / new_sigma.clamp_min(tiny)
        rel[act] = step_rel
        sigma[act] = new_sigma
        w = rmatvec(u, act) if full is None else rmatvec(full)[act]
        theta = new_sigma.square()
        r = (w - theta[:, None] * v[act]).flatten(1).norm(dim=1) / theta.clamp_min(tiny)
        res[act] = r
        if stop is None:
            newly = ((step_rel < tol) & (r <= rtol)).cpu()
        else:
            newly = _as_mask(stop(act, new_sigma.detach().double().cpu(), r.double().cpu()))
        iters[act[newly]] = it
        done[act[newly]] = True
        if bool(done.all()):
            break
        act, w = act[~newly], w[~newly]
        v = v.clone()
        v[act] = _normalize(w)
    if out is not None:
        out.copy_(v)
    return [
        Estimate(
            float(sigma[b]), int(iters[b]), bool(done[b]), float(rel[b]), "power", float(res[b])
        )
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
    basis: int | None = None,
    stop: StopRule | None = None,
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
    ``rel_change`` is the last relative change of the estimate, ``residual`` the last
    ``r / theta``. ``out`` (shape of
    ``v0``), if given, receives each operator's top Ritz vector (its top right singular
    vector estimate; a warm start for a later call). ``subset=True``: converged
    operators drop out of the batch; ``matvec(v, idx)`` and ``rmatvec(u, idx)`` then get
    the rows of the operators ``idx`` (a CPU ``LongTensor``) still running and return
    theirs. Memory: ``basis`` vectors of shape ``(B, n)`` (default ``max_iter``, at least 2),
    each holding only the rows of the operators still running (a finished operator's rows
    are dropped, and no copy of the basis is made per step):
    when the basis is full and an operator has not converged, it restarts from its top
    Ritz vector with an empty basis (explicit restart; the total number of products is
    still ``max_iter``). Each cycle's residual is that of its own Krylov space, so the
    certificate is the same. ``stop``: a caller's stopping rule in place of ``tol``,
    called after every step with the operators still running (``idx``, positions in the
    batch), their estimates and relative residuals; the operators it returns True for stop
    and count as converged (an exhausted Krylov space, an exact answer, stops too).
    """
    _check_start("operator_norm_krylov", v0, max_iter)
    if basis is not None and basis < 2:
        raise ValueError(
            f"operator_norm_krylov: basis={basis}; a restarted Lanczos needs at least 2 "
            "vectors (with 1 it restarts from its own start vector); pass basis >= 2"
        )
    cap = max_iter if basis is None else min(basis, max_iter)
    B = v0.shape[0]
    tiny = torch.finfo(v0.dtype).tiny
    qa = _normalize(v0)  # the next basis vector of the operators still running (act)
    Q: list[torch.Tensor] = []  # this cycle's Krylov basis, rows of the operators in act
    alphas = torch.zeros(B, cap, dtype=torch.float64)
    betas = torch.zeros(B, cap, dtype=torch.float64)
    sigma = torch.zeros(B, dtype=torch.float64)
    rel = torch.full((B,), float("inf"), dtype=torch.float64)
    res = torch.full((B,), float("inf"), dtype=torch.float64)
    done = torch.zeros(B, dtype=torch.bool)
    iters = torch.full((B,), max_iter, dtype=torch.long)
    ritz: list[torch.Tensor] = [torch.ones(1, dtype=torch.float64)] * B
    act = torch.arange(B)
    for it in range(1, max_iter + 1):
        Q.append(qa)
        m = len(Q)
        if subset:
            w = rmatvec(matvec(qa, act), act)
        else:  # every operator's row, the finished ones' zero
            q = torch.zeros_like(v0)
            q[act] = qa
            w = rmatvec(matvec(q))[act]
        a = (w * qa).sum(1)
        w = w - a[:, None] * qa
        if m > 1:
            w = w - betas[act, m - 2].to(w.dtype).to(w.device)[:, None] * Q[-2]
        for _ in range(2):  # full reorthogonalisation, twice is enough
            for qi in Q:
                w = w - (w * qi).sum(1)[:, None] * qi
        b = w.norm(dim=1)
        alphas[act, m - 1] = a.detach().double().cpu()
        betas[act, m - 1] = b.detach().double().cpu()
        newly = torch.zeros(B, dtype=torch.bool)
        exact = torch.zeros(B, dtype=torch.bool)
        for k in act.tolist():
            theta, err, ritz[k] = _ritz(alphas[k, :m], betas[k, :m], tiny)
            new = theta**0.5
            rel[k] = abs(new - float(sigma[k])) / max(new, tiny)
            sigma[k], res[k] = new, err
            exhausted = float(betas[k, m - 1]) <= 1e-12 * max(theta, tiny)
            newly[k] = err < tol or exhausted
            exact[k] = exhausted
        if stop is not None:
            newly[act] = exact[act] | _as_mask(stop(act, sigma[act], res[act]))
        iters[newly] = it
        done |= newly
        last = bool(done.all()) or it == max_iter
        finished = newly if not last else (newly | ~done) & torch.isin(torch.arange(B), act)
        if out is not None:  # while this cycle's basis still holds their Ritz vectors
            for p, k in enumerate(act.tolist()):
                if finished[k]:
                    out[k] = _combine(ritz[k], Q, p, v0)
        if last:
            break
        keep = ~newly[act]
        act, w, b = act[keep], w[keep], b[keep]
        if not bool(keep.all()):  # drop the finished operators' rows, one vector at a time
            for i in range(m):
                Q[i] = Q[i][keep]
        if m == cap:  # the basis is full: restart from the top Ritz vectors
            Y = torch.stack([ritz[k] for k in act.tolist()]).to(v0.dtype).to(v0.device)
            x = sum(Y[:, i, None] * Q[i] for i in range(m))
            qa = _normalize(x)
            Q = []
        else:
            safe = b.clamp_min(tiny)[:, None]
            qa = torch.where((b > 0)[:, None], w / safe, torch.zeros_like(w))
    return [
        Estimate(
            float(sigma[k]), int(iters[k]), bool(done[k]), float(rel[k]), "lanczos", float(res[k])
        )
        for k in range(B)
    ]


def _check_start(call: str, v0: torch.Tensor, max_iter: int) -> None:
    if v0.dim() != 2:
        raise ValueError(
            f"{call}: v0 must have shape (batch, n), got {tuple(v0.shape)}; "
            "use v0.unsqueeze(0) for a single operator"
        )
    if max_iter < 1:
        raise ValueError(f"{call}: max_iter must be >= 1, got {max_iter}")


def _as_mask(m: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(m, dtype=torch.bool).cpu().reshape(-1)


def _combine(y: torch.Tensor, Q: list[torch.Tensor], k: int, like: torch.Tensor) -> torch.Tensor:
    """``sum_i y_i Q_i[k]``: the Ritz vector of the operator in row k of its cycle's basis."""
    y = y.to(like.dtype).to(like.device)
    return sum(y[i] * Q[i][k] for i in range(len(y)))


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


def eig_residual(mv, lam: complex, v: np.ndarray) -> float:
    """``||J v - lam v|| / (|lam| ||v||)`` for a complex v of a real operator J (``mv``: numpy
    in and out; a complex v costs two products)."""
    Jv = mv(v.real) + 1j * mv(v.imag) if np.iscomplexobj(v) else mv(v)
    scale = max(abs(lam), np.finfo(float).tiny) * np.linalg.norm(v)
    return float(np.linalg.norm(Jv - lam * v) / scale)


def arnoldi_ritz(mv, v0: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Ritz pairs of a ``steps``-step Arnoldi run on ``mv`` (numpy in and out) from ``v0``,
    with full reorthogonalisation: exact when ``steps = n``, or on breakdown."""
    n = len(v0)
    V = np.zeros((n, steps + 1))
    H = np.zeros((steps + 1, steps))
    V[:, 0] = v0 / np.linalg.norm(v0)
    m = steps
    for j in range(steps):
        w = mv(V[:, j])
        for _ in range(2):  # twice: re-orthogonalisation keeps the basis orthonormal
            c = V[:, : j + 1].T @ w
            w = w - V[:, : j + 1] @ c
            H[: j + 1, j] += c
        H[j + 1, j] = np.linalg.norm(w)
        if H[j + 1, j] <= 1e-14 * max(1.0, np.abs(H[: j + 1, j]).max()):
            m = j + 1  # invariant subspace found: the spectrum restricted to it is exact
            break
        V[:, j + 1] = w / H[j + 1, j]
    vals, y = np.linalg.eig(H[:m, :m])
    return vals, V[:, :m] @ y
