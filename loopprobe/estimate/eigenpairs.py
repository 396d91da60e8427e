"""How :func:`~loopprobe.estimate.fixedpoint.spectral_radius` finds and checks eigenpairs on
its dense path: the round map's Jacobian from batched VJPs of one forward, the top pairs by
ARPACK on that matrix (or all of them by ``numpy.linalg.eig``), and the check of each pair
``||J v - lambda v|| / (|lambda| ||v||)`` by fresh JVPs, independent of the dense J.
Reference: docs/definitions.md §4 (geometry).
"""

from __future__ import annotations

import numpy as np
import torch

from loopprobe.differentiate.roundmap import NonFinite, quiet

#: ``spectral_radius(method="auto")`` takes the dense Jacobian up to this state size.
DENSE_N = 1024
#: From this size the dense path asks ARPACK for the top pairs instead of ``numpy.linalg.eig``
#: for all of them (n 768: 0.021 s against 0.59 s, one thread;
#: ``benchmarks/bench_spectral_radius.py --parts``).
DENSE_ARPACK_N = 128


def dense_eig(T, h: torch.Tensor, calls: list[int], k: int, v0, tol, max_iter) -> tuple:
    """The top ``k`` eigenpairs of ``J = dT/dh`` (or all), with J built row by row from
    batched VJPs of one forward (256 rows a batch)."""
    from scipy.sparse.linalg import ArpackError, ArpackNoConvergence, eigs

    chunk = 256
    n = h.numel()
    with quiet():
        _, vjp = torch.func.vjp(T, h)
        eye = torch.eye(n, dtype=h.dtype, device=h.device)
        rows = [
            torch.func.vmap(lambda e: vjp(e.view(h.shape))[0].reshape(-1))(eye[i : i + chunk])
            for i in range(0, n, chunk)
        ]
    calls[0] += n
    J = torch.cat(rows).detach()  # row i of the batch is J^T e_i, row i of J
    if not bool(torch.isfinite(J).all()):
        raise NonFinite("the JVP of the step returned NaN/inf")
    A = J.to(torch.float64).cpu().numpy()
    if n >= DENSE_ARPACK_N:
        try:
            return eigs(A, k=k, which="LM", v0=v0, tol=tol, maxiter=max_iter)
        except (ArpackNoConvergence, ArpackError):
            pass  # a cluster of nearly defective top eigenvalues: all of them, exactly
    return np.linalg.eig(A)


def checked_pairs(jvp, h: torch.Tensor, vals, vecs, calls: list[int]) -> np.ndarray:
    """``||J v - lambda v|| / (|lambda| ||v||)`` of every pair from one batch of fresh JVPs
    (real and imaginary parts), independent of the dense J the pairs came from."""
    V = np.concatenate([vecs.real, vecs.imag], axis=1).T
    X = torch.as_tensor(V, dtype=h.dtype, device=h.device).view(-1, *h.shape)
    with quiet():
        Y = torch.func.vmap(jvp)(X).detach().reshape(len(V), -1).double().cpu().numpy()
    calls[0] += len(V)
    if not np.isfinite(Y).all():
        raise NonFinite("the JVP of the step returned NaN/inf")
    k = vecs.shape[1]
    Jv = (Y[:k] + 1j * Y[k:]).T
    scale = np.maximum(np.abs(vals), np.finfo(float).tiny) * np.linalg.norm(vecs, axis=0)
    return np.linalg.norm(Jv - vecs * vals, axis=0) / scale
