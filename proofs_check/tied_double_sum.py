"""Eq. 11: the tied first-order change is a double sum over visits.

Statement (seed 002, Eq. 11). With residual-sublayer parameters tied across the R rounds,
the update of phi_j is proportional to sum_t G_{t,j} and every visit reads it:

    Delta F_tied = -eta sum_j (sum_r U_{r,j}) (sum_t G_{t,j}) + O(eta^2),

where U_{r,j} is the output sensitivity of visit (r, j) and G_{r,j} = U_{r,j}^T dL/dF the
update that visit would get if it had its own parameters.

Checks (exact, float64, tiny LoopedGPT d = 8, K = 2, R = 3, DeepNorm and DeepLoop):
- U_{r,j} and G_{r,j} are built by brute force on the explicitly untied twin (block
  r K + k a copy of tied block k; dense ``jacrev``), independently of the tied model;
- sum_r G_{r,j} equals the tied model's autograd gradient (rel. 1e-10);
- -eta sum_j (sum_r U)(sum_t G) equals the tied model's own JVP along -eta g (rel. 1e-10);
- the finite change F(theta - eta g) - F(theta) approaches it at first order: the relative
  gap falls with log-log slope 1 in eta (0.9..1.1 over eta = 1e-2..1e-4) and is < 1e-3 at
  eta = 1e-4.

Wrong variant: the untied-style diagonal sum -eta sum_{r,j} U_{r,j} G_{r,j} (no cross
terms between visits) as the first-order change of the tied model: its relative gap to the
finite change does not vanish as eta -> 0.

What a check cannot establish: the O(eta^2) constant at training-size steps, or the
optimizer-dependent constants Eq. 11 absorbs into U and G (here plain SGD).
"""

from __future__ import annotations

import functools

import torch

from proofs_check._common import (
    loglog_slope,
    looped_names,
    one_sgd_step_change,
    per_visit,
    tiny_gpt,
    tokens,
)
from proofs_check._registry import Outcome, Profile, statement, wrong_variant

REF = "seed 002, Eq. 11"
ETAS = (1e-2, 1e-3, 1e-4)


@functools.cache
def _case(norm: str, seed: int, K: int = 2, R: int = 3):
    m = tiny_gpt(K, R, norm, seed=seed)
    idx, tgt = tokens(16, 2, 4, seed)
    pv = per_visit(m, idx, tgt)
    step = one_sgd_step_change(m, idx, tgt, 1.0)
    names = looped_names(m)
    g_tied = [
        torch.cat([step["g"][n].reshape(-1) for n in names if n.startswith(lab + ".")])
        for lab in pv["labels"]
    ]
    return m, idx, tgt, pv, g_tied


def _gaps(norm: str, seed: int, diagonal: bool) -> dict:
    m, idx, tgt, pv, g_tied = _case(norm, seed)
    U, G = pv["U"], pv["G"]
    sumG_err = max(
        float((sum(Gj) - gj).norm() / gj.norm()) for Gj, gj in zip(G, g_tied, strict=True)
    )
    if diagonal:
        first = -sum(
            Ur @ Gr for Uj, Gj in zip(U, G, strict=True) for Ur, Gr in zip(Uj, Gj, strict=True)
        )
    else:
        first = -sum(sum(Uj) @ sum(Gj) for Uj, Gj in zip(U, G, strict=True))
    jvp1 = one_sgd_step_change(m, idx, tgt, 1.0, first_order=True)["dF1"].reshape(-1)
    jvp_err = float((first - jvp1).norm() / jvp1.norm())
    gaps = []
    for eta in ETAS:
        dF = one_sgd_step_change(m, idx, tgt, eta)["dF"].reshape(-1)
        gaps.append(float((dF - eta * first).norm() / (eta * first).norm()))
    return {"sumG": sumG_err, "jvp": jvp_err, "gaps": gaps, "slope": loglog_slope(ETAS, gaps)}


@statement("Eq 11: tied dF = -eta sum_j (sum_r U)(sum_t G) + O(eta^2)", REF, "exact")
def check(profile: Profile) -> Outcome:
    res = [_gaps(norm, s, False) for norm in ("deepnorm", "deeploop") for s in range(profile.seeds)]
    sumG = max(r["sumG"] for r in res)
    jv = max(r["jvp"] for r in res)
    slopes = [r["slope"] for r in res]
    last = max(r["gaps"][-1] for r in res)
    ok = sumG < 1e-10 and jv < 1e-10 and all(0.9 <= s <= 1.1 for s in slopes) and last < 1e-3
    return Outcome(
        ok,
        f"sum_r G = tied grad to {sumG:.0e}; double sum = JVP to {jv:.0e}; finite gap "
        f"{last:.1e} at eta=1e-4, slope in eta {min(slopes):.2f}..{max(slopes):.2f}",
    )


@wrong_variant("untied-style diagonal sum_(r,j) U_rj G_rj is the tied first-order dF", REF, "exact")
def wrong_diagonal(profile: Profile) -> Outcome:
    res = [_gaps(norm, s, True) for norm in ("deepnorm", "deeploop") for s in range(profile.seeds)]
    last = min(r["gaps"][-1] for r in res)
    return Outcome(
        last < 1e-3,
        f"relative gap to finite dF at eta=1e-4: >= {last:.2f} (first order would be < 1e-3)",
    )
