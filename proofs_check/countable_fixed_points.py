"""Without recall the fixed points do not depend on the input except through selection.

Statement (seeds 000/003, the abstract of arXiv 2604.15259; PAPERS.md 4): "looped
networks without recall have countable fixed points and cannot achieve strong
input-dependence at any spectral regime". The full text is not available; the testable
form used here: for a loop h <- f(h) whose step does not read the input x (x enters only
through h_0 = E x), every limit h*(x) is a fixed point of the same x-free map f, so the
set of limits is one set for all inputs, and at an attracting fixed point (spectral
radius of df(h*) < 1) the limit is locally constant in x: dh*/dx = 0, the input only
selects which fixed point (a basin) is reached. With recall, h <- f(h, x), the limit moves
with x: dh*/dx = (I - d_h f)^(-1) d_x f.

Check (exact, float64): plain ``nn.Module`` loops h <- tanh(W h + b) (+ V x with recall),
W random symmetric positive semi-definite with spectral radius g in {0.5, 1.5, 3} (one
attracting fixed point for 0.5, several for 1.5 and 3), 48 random inputs each, two seeds.
Limits by 4000 plain iterations (converged: |f(h) - h| <= 1e-13 per input); the
step's Jacobian at each limit, diag(1 - h*^2) W (checked against ``jacrev`` on one), for
its spectral radius; the input derivative of the
limit by central differences of the converged iteration (step 1e-5, three random unit
directions). Assert (no recall) every converged attracting limit satisfies
|f(h*) - h*| <= 1e-10 with the x-free f, |dh*/dx| <= 1e-6, and the limits form at most
as many clusters (1e-6) as there are attracting fixed points found, far fewer than inputs.

Wrong variant: the same claim for the loop WITH recall (the misreading "a contraction has
one fixed point, so no loop's fixed points depend on x"): its limits are all distinct and
|dh*/dx| is O(1).

What a check cannot establish: countability for transformers in general (we test small
tanh loops, whose attracting fixed points are isolated), or anything about "strong
input-dependence" beyond the local derivative and the count of distinct limits.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import jacrev

from proofs_check._registry import Outcome, Profile, statement, wrong_variant

REF = "seeds 000/003, arXiv 2604.15259 (abstract)"
f64 = torch.float64
GAINS = (0.5, 1.5, 3.0)


class Loop(nn.Module):
    """h <- tanh(W h + b), plus V x when ``recall``; x embedded as h_0 = E x.

    W is symmetric positive semi-definite (gain = its spectral radius), so the synchronous
    iteration settles on fixed points (no 2-cycles).
    """

    def __init__(self, d: int, gain: float, recall: bool, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        M = torch.randn(d, d, generator=g, dtype=f64)
        S = M @ M.T
        self.W = nn.Parameter(gain * S / torch.linalg.eigvalsh(S).max())
        self.b = nn.Parameter(0.1 * torch.randn(d, generator=g, dtype=f64))
        self.E = nn.Parameter(2 * torch.randn(d, d, generator=g, dtype=f64))
        self.V = nn.Parameter(torch.randn(d, d, generator=g, dtype=f64) / d**0.5)
        self.recall = recall

    def step(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        z = h @ self.W.T + self.b
        return torch.tanh(z + x @ self.V.T if self.recall else z)

    @torch.no_grad()
    def limit(self, x: torch.Tensor, iters: int = 4000) -> tuple[torch.Tensor, torch.Tensor]:
        """Iterate from E x; the last state and whether |step(h) - h| <= 1e-13 per row."""
        h = x @ self.E.T
        for _ in range(iters):
            h = self.step(h, x)
        return h, (self.step(h, x) - h).norm(dim=-1) <= 1e-13


def measure(recall: bool, gain: float, seed: int, n: int = 48, d: int = 4) -> dict:
    m = Loop(d, gain, recall, seed)
    g = torch.Generator().manual_seed(seed + 1)
    X = torch.randn(n, d, generator=g, dtype=f64)
    V = torch.randn(3, n, d, generator=g, dtype=f64)
    V = V / V.norm(dim=-1, keepdim=True)
    eps = 1e-5
    batch = torch.cat([X, *(X + eps * V), *(X - eps * V)])  # one batched iteration
    Hall, okall = m.limit(batch)
    H, ok = Hall[:n], okall.view(7, n).all(0)
    Hp, Hm = Hall[n : 4 * n].view(3, n, d), Hall[4 * n :].view(3, n, d)
    deriv = ((Hp - Hm).norm(dim=-1) / (2 * eps)).max(0).values
    free = lambda h: torch.tanh(h @ m.W.T + m.b)  # noqa: E731  the x-free map
    resid = (free(H) - H).norm(dim=-1) if not recall else torch.zeros(n, dtype=f64)
    # d step / d h at the limit is diag(1 - h*^2) W (the limit is a tanh); jacrev checks one
    J0 = jacrev(lambda v: m.step(v[None], X[:1])[0])(H[0])
    J = (1 - H**2).unsqueeze(-1) * m.W.detach()
    assert torch.allclose(J0, J[0], atol=1e-12), "closed-form Jacobian disagrees with jacrev"
    rho = torch.linalg.eigvals(J).abs().max(-1).values.tolist()
    keep = [i for i in range(n) if bool(ok[i]) and rho[i] < 1 - 1e-6]
    reps: list[torch.Tensor] = []
    for i in keep:
        if all(float((H[i] - r).norm()) > 1e-6 for r in reps):
            reps.append(H[i])
    return {
        "kept": len(keep),
        "n": n,
        "distinct": len(reps),
        "resid": max((float(resid[i]) for i in keep), default=0.0),
        "deriv": max((float(deriv[i]) for i in keep), default=0.0),
    }


def _check(profile: Profile, recall: bool) -> Outcome:
    seeds = range(profile.seeds)
    rows = [(gain, s, measure(recall, gain, s)) for gain in GAINS for s in seeds]
    kept = sum(r["kept"] for _, _, r in rows)
    total = sum(r["n"] for _, _, r in rows)
    deriv = max(r["deriv"] for _, _, r in rows)
    resid = max(r["resid"] for _, _, r in rows)
    distinct = {f"g={g}": r["distinct"] for g, s, r in rows if s == 0}
    ok = (
        kept >= 0.9 * total
        and deriv <= 1e-6
        and resid <= 1e-10
        and all(r["distinct"] <= r["kept"] // 4 for _, _, r in rows)
    )
    return Outcome(
        ok,
        f"{kept}/{total} limits converged and attracting; max |dh*/dx| = {deriv:.1e} "
        f"(want <= 1e-6), max |f(h*) - h*| (x-free f) = {resid:.0e}; distinct limits of "
        f"48 inputs (seed 0): " + ", ".join(f"{k} {v}" for k, v in distinct.items()),
    )


@statement("No recall: limits are fixed points of the x-free map, dh*/dx = 0", REF, "exact")
def check(profile: Profile) -> Outcome:
    return _check(profile, recall=False)


@wrong_variant("With recall too: limits do not depend on x (dh*/dx = 0)", REF, "exact")
def wrong_recall(profile: Profile) -> Outcome:
    return _check(profile, recall=True)
