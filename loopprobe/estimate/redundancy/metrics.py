"""Adjacent-loop similarity, extrapolation and token-change concentration, on plain tensors.

The definitions are in :mod:`loopprobe.estimate.redundancy` (which records the per-loop tensors);
every function here takes ``(B, T, C)`` tensors of consecutive loops and computes in float64.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def tokens(x: torch.Tensor) -> torch.Tensor:
    """``(B, T, C)`` float64 view: ``(T, D)`` -> one sequence; K/V ``(B, H, T, d)`` -> ``H*d``."""
    x = x.double()
    if x.dim() == 2:
        return x[None]
    if x.dim() == 4:
        return x.transpose(1, 2).flatten(2)
    return x


def similarity(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """Adjacent-loop similarity of ``b`` (loop t) with ``a`` (loop t-1), ``(B, T, C)``."""
    a, b = a.double(), b.double()
    na, nb = a.norm(dim=-1), b.norm(dim=-1)
    ok = (na > 0) & (nb > 0)
    cos = ((a * b).sum(-1)[ok] / (na * nb)[ok]).flatten()
    d = float((b - a).norm())
    empty = cos.numel() == 0
    return {
        "cos_mean": math.nan if empty else float(cos.mean()),
        "cos_median": math.nan if empty else float(cos.quantile(0.5)),
        "cos_p5": math.nan if empty else float(cos.quantile(0.05)),
        "rel_reuse": _ratio(d, float(b.norm())),
        "rel_prev": _ratio(d, float(a.norm())),
        "norm_ratio": _ratio(float(b.norm()), float(a.norm())),
    }


def extrapolation(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> dict[str, float]:
    """How well loops t-2 (``a``) and t-1 (``b``) predict loop t (``c``)."""
    a, b, c = a.double(), b.double(), c.double()
    dp, dn = b - a, c - b
    pp, nn_, pn = float((dp * dp).sum()), float(dn.norm()), float((dp * dn).sum())
    alpha = pn / pp if pp > 0 else 0.0
    nc = float(c.norm())
    return {
        "cos_deltas": _ratio(pn, math.sqrt(pp) * nn_),
        "delta_ratio": _ratio(nn_, math.sqrt(pp)),
        "alpha": alpha if pp > 0 else math.nan,
        "err_reuse": _ratio(nn_, nc),
        "err_linear": _ratio(float((c - b - dp).norm()), nc),
        "err_oracle": _ratio(float((c - b - alpha * dp).norm()), nc),
    }


def change_score(prev: torch.Tensor, cur: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token ``||cur - prev||`` and ``s = ||cur - prev|| / ||cur||`` (inf where cur = 0)."""
    change = (cur - prev).norm(dim=-1)  # (B, T)
    size = cur.norm(dim=-1)
    return change, torch.where(size > 0, change / torch.where(size > 0, size, 1.0), math.inf)


def concentration(
    prev: torch.Tensor,
    cur: torch.Tensor,
    fractions: Sequence[float],
    before: torch.Tensor | None = None,
) -> dict[float, dict[str, float]]:
    """Per ``f``, the share of the squared change ``prev -> cur`` carried by the top
    ``ceil(f T)`` tokens: by its own score ``s_i`` (``share``), by the change itself
    (``share_oracle``, the upper bound) and, given the loop ``before``, by the previous
    change's score (``share_prev``: the tokens a lazy update picks before computing)."""
    prev, cur = prev.double(), cur.double()
    change, score = change_score(prev, cur)
    keys = {"share": score, "share_oracle": change}
    if before is not None:
        keys["share_prev"] = change_score(before.double(), prev)[1]
    total = (change**2).sum(-1)
    live = total > 0
    T = cur.shape[-2]
    out: dict[float, dict[str, float]] = {}
    for f in fractions:
        top = max(1, math.ceil(f * T))
        out[float(f)] = {}
        for name, key in keys.items():
            order = key.argsort(dim=-1, descending=True, stable=True)[..., :top]
            share = (change.gather(-1, order) ** 2).sum(-1)[live] / total[live]
            out[float(f)][name] = float(share.mean()) if share.numel() else math.nan
    return out


def _ratio(x: float, y: float) -> float:
    return x / y if y > 0 else math.nan
