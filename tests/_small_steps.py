"""The small-step cluster family and its exact kappa, shared by tests/test_kappa_err.py,
tests/test_kappa_clusters.py and benchmarks/bench_kappa_clusters.py (whose worker imports it
against an older tree too, so it needs only torch and ``loopprobe.models.LinearLoop``).

Small steps ``x + eps W x`` (eps 1e-6, d 8, float64), as ``lp.models.LinearLoop`` or as a
plain module written the way third-party code is: every visit ``U_r`` has a cluster of d top
singular values split by ~1e-6 relative. The exact kappa comes from the dense Jacobian of an
untied twin (one weight per visit).
"""

from __future__ import annotations

import torch

D, EPS = 8, 1e-6


class SmallSteps(torch.nn.Module):
    """Written the way third-party code is: one Linear applied R times, h + eps W h."""

    def __init__(self, R: int, eps: float = EPS):
        super().__init__()
        self.R, self.eps = R, eps
        self.W = torch.nn.Linear(D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.R):
            x = x + self.eps * self.W(x)
        return x


def family_member(R: int, kind: str, seed: int):
    """The model (``kind`` "lp": LinearLoop, "plain": :class:`SmallSteps`), inputs and targets
    of one member of the family."""
    from loopprobe.models import LinearLoop, LinearLoopConfig

    if kind == "lp":
        gen = torch.Generator().manual_seed(R + 100 * seed)
        model = LinearLoop(LinearLoopConfig(d=D, R=R, eps=EPS), generator=gen).double()
    else:
        torch.manual_seed(R + 100 * seed)
        model = SmallSteps(R).double()
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(7 + seed), dtype=torch.float64)
    gen_y = torch.Generator().manual_seed(11 + seed)
    y = torch.randn(x.shape, generator=gen_y, dtype=torch.float64)
    return model, x, y


def top_sv(A: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(A, 2))


def exact_small_step_kappa(model, x, y, R: int, eps: float = EPS) -> float:
    """kappa of a small-step loop ``h + eps h W^T`` (square loss) from the dense Jacobian of
    its untied twin (one weight per visit): the oracle of the cluster tests."""
    from torch.func import jacrev

    W = model.W.weight.detach()
    d = W.shape[0]

    def untied(Ws):
        h = x
        for r in range(R):
            h = h + eps * h @ Ws[r].T
        return h.reshape(-1)

    J = jacrev(untied)(W.expand(R, d, d).clone())
    Us = [J[:, r].reshape(J.shape[0], -1) for r in range(R)]
    Gs = [U.t() @ (untied(W.expand(R, d, d)) - y.reshape(-1)) for U in Us]
    kappa = top_sv(sum(Us)) * float(sum(Gs).norm())
    return kappa / (R * max(top_sv(U) for U in Us) * max(float(g.norm()) for g in Gs))
