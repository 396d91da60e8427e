"""Cross-loop KV-residual quantization (FlashLoop's third observation), on plain tensors.

Asymmetric min-max fake quantization with ``b`` bits of a group ``g``:
``scale = (max g - min g) / (2^b - 1)``, ``q = clamp(round((x - min g) / scale), 0, 2^b - 1)``,
``x_hat = q * scale + min g`` (a constant group is kept exactly). KIVI-style grouping, as the
authors' reference code does it: K (``(B, H, T, d)``) per channel over token groups of
``group`` tokens, V per token over channel groups of ``group`` channels; a last, shorter
group is quantized on its own.

Residual scheme: loop 1 stores ``Q(X_1)``; loop t stores ``Q(X_t - X_hat_{t-1})`` against the
*reconstructed* previous loop, so ``X_hat_t = X_hat_{t-1} + Q(X_t - X_hat_{t-1})``.
Reference: FlashLoop (arXiv 2609.29812), the digest in shared/PAPERS.md §7.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Along which dimension each tensor's groups run (K: tokens, V: channels).
GROUP_DIM = {"K": -2, "V": -1}


def fake_quant(x: torch.Tensor, bits: int, group: int, dim: int) -> torch.Tensor:
    """Asymmetric min-max fake quantization of ``x`` in groups of ``group`` along ``dim``.

    Each group is the slice of ``group`` consecutive entries along ``dim`` at fixed indices
    of every other dimension (K per channel over tokens: ``dim=-2``; V per token over
    channels: ``dim=-1``).
    """
    levels = 2**bits - 1
    out = []
    for chunk in x.split(group, dim=dim):
        lo = chunk.amin(dim=dim, keepdim=True)
        hi = chunk.amax(dim=dim, keepdim=True)
        scale = (hi - lo) / levels
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = ((chunk - lo) / safe).round().clamp(0, levels)
        out.append(torch.where(scale > 0, q * scale + lo, chunk))
    return torch.cat(out, dim=dim)


def _rel(err: torch.Tensor, ref: torch.Tensor) -> float:
    n = float(ref.norm())
    return float(err.norm()) / n if n > 0 else float("nan")


def residual_quantization(
    xs: Sequence[torch.Tensor], bits: int, group: int, dim: int
) -> list[dict[str, float]]:
    """Per loop: relative reconstruction error of direct ``Q(X_t)`` and of the residual chain.

    ``xs``: the tensor at loops 1..R. Returns one dict per loop with ``err_direct``
    ``= ||Q(X_t) - X_t|| / ||X_t||``, ``err_residual`` ``= ||X_hat_t - X_t|| / ||X_t||`` and
    ``ratio = err_residual / err_direct`` (below 1: the residual scheme wins).
    """
    rows = []
    prev = None
    for x in xs:
        direct = fake_quant(x, bits, group, dim)
        hat = direct if prev is None else prev + fake_quant(x - prev, bits, group, dim)
        e_d, e_r = _rel(direct - x, x), _rel(hat - x, x)
        ratio = e_r / e_d if e_d > 0 else float("nan")
        rows.append({"err_direct": e_d, "err_residual": e_r, "ratio": ratio})
        prev = hat
    return rows
