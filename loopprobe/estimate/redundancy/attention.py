"""Per-loop K, V and attention probabilities, and the sparsity of their cross-loop difference.

Capture: an *adapter* is a function ``adapter(module, args, kwargs, output)`` called by a
forward hook on an attention module after each call; it returns ``(k, v, probs)`` with
``k, v`` of shape ``(B, H, T, d)`` and ``probs`` of shape ``(B, H, T, T)`` (or ``None`` when
the probabilities are not available). :func:`attention_from_qkv` turns ``(q, k, v)`` into
that triple, so a user's adapter for their own module is a few lines::

    def my_adapter(module, args, kwargs, output):
        x = args[0]
        q, k, v = (heads(p(x)) for p in (module.wq, module.wk, module.wv))
        return lp.redundancy_attention.attention_from_qkv(q, k, v, causal=True)

Adapters are known for the reference models' ``CausalSelfAttention``, torch's
``nn.MultiheadAttention``, x-transformers' ``Attend`` (which returns its post-softmax
probabilities) and Hugging Face BERT-family attention (``query``/``key``/``value``, e.g.
ALBERT; probabilities with ``attn_implementation="eager"`` only); :func:`known_adapter`
finds them. A module that is never called (a fused
fast path that bypasses it, e.g. ``nn.TransformerEncoderLayer`` in eval mode) is noted.

Attention-difference sparsity (FlashLoop's second observation): per query ``i`` and head,
the oracle score of key ``j`` is ``s_ij = ||p_t[i,j] v_t[j] - p_{t-1}[i,j] v_{t-1}[j]||^2``;
keep the top ``k_i = max(1, ceil(f * n_i))`` keys by the *previous* loop's probability
(``n_i``: keys with positive probability in either loop); report the share of the oracle
energy they capture and their recall of the oracle top ``k_i``, averaged over the queries
(and heads, batch) whose energy is positive. Reference: FlashLoop (arXiv 2609.29812), the
digest in shared/PAPERS.md §7.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

Adapter = Callable[[nn.Module, tuple, dict, Any], tuple]


def attention_from_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(k, v, softmax(q k^T * scale + causal mask))`` for ``(B, H, T, d)`` inputs.

    ``scale`` defaults to ``d ** -0.5``. The probabilities are computed in float64.
    """
    qd, kd = q.double(), k.double()
    s = (qd @ kd.transpose(-2, -1)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if causal:
        T, S = s.shape[-2:]
        mask = torch.ones(T, S, dtype=torch.bool, device=s.device).tril(S - T)
        s = s.masked_fill(~mask, float("-inf"))
    return k, v, s.softmax(dim=-1)


def looped_gpt_attention(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> tuple:
    """Adapter for :class:`loopprobe.models.layers.CausalSelfAttention` (the reference models):
    recomputes q, k, v from the call's input with the module's weights."""
    x = args[0] if args else kwargs["x"]
    B, T, D = x.shape
    H = module.n_heads

    def heads(lin: nn.Linear) -> torch.Tensor:  # (B, T, D) -> (B, H, T, D/H)
        y = torch.nn.functional.linear(x, lin.weight, lin.bias)
        return y.view(B, T, H, D // H).transpose(1, 2)

    return attention_from_qkv(heads(module.q), heads(module.k), heads(module.v), causal=True)


def x_transformers_attend(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> tuple:
    """Adapter for x-transformers' ``Attend``: q, k, v are its arguments, the probabilities
    its ``post_softmax_attn`` (``None`` on the flash path or with extra sink/zero keys)."""
    k, v = args[1], args[2]
    probs = getattr(output[1], "post_softmax_attn", None) if isinstance(output, tuple) else None
    if probs is not None and probs.shape[-1] != k.shape[-2]:
        probs = None
    return k, v, probs


def torch_multihead_attention(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> tuple:
    """Adapter for ``nn.MultiheadAttention`` (packed or separate projections): recomputes q,
    k, v and the probabilities with ``attn_mask``/``is_causal``; probabilities ``None``
    with a key padding mask, ``bias_k`` or ``add_zero_attn``."""
    names = ("query", "key", "value")
    q_in, k_in, v_in = (args[i] if len(args) > i else kwargs[n] for i, n in enumerate(names))
    if not module.batch_first:  # (T, B, D) -> (B, T, D)
        q_in, k_in, v_in = (t.transpose(0, 1) for t in (q_in, k_in, v_in))
    D, H = module.embed_dim, module.num_heads
    if module.in_proj_weight is not None:
        ws = module.in_proj_weight.split(D)
    else:
        ws = (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight)
    bs = module.in_proj_bias.split(D) if module.in_proj_bias is not None else (None,) * 3

    def heads(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        y = torch.nn.functional.linear(x, w, b)
        return y.view(y.shape[0], y.shape[1], H, D // H).transpose(1, 2)

    q, k, v = (heads(x, w, b) for x, w, b in zip((q_in, k_in, v_in), ws, bs, strict=True))
    if (
        kwargs.get("key_padding_mask") is not None
        or module.bias_k is not None
        or module.add_zero_attn
    ):
        return k, v, None
    mask = kwargs.get("attn_mask")
    if mask is None:
        return attention_from_qkv(q, k, v, causal=bool(kwargs.get("is_causal", False)))
    s = (q.double() @ k.double().transpose(-2, -1)) * q.shape[-1] ** -0.5
    s = s.masked_fill(mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    return k, v, s.softmax(dim=-1)


def hf_qkv_attention(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> tuple:
    """Adapter for Hugging Face BERT-family attention (``query``/``key``/``value`` Linears,
    no rotary embedding, e.g. ALBERT): K and V recomputed from ``hidden_states``; the
    probabilities are the module's returned attention weights, which only the ``eager``
    implementation returns (``attn_implementation="eager"``), else ``None``."""
    x = args[0] if args else kwargs["hidden_states"]
    H, dh = module.num_attention_heads, module.attention_head_size

    def heads(lin: nn.Linear) -> torch.Tensor:  # (B, T, H*dh) -> (B, H, T, dh)
        y = torch.nn.functional.linear(x, lin.weight, lin.bias)
        return y.view(*x.shape[:-1], H, dh).transpose(1, 2)

    probs = output[1] if isinstance(output, tuple) and len(output) > 1 else None
    if not isinstance(probs, torch.Tensor) or probs.shape[-1] != x.shape[-2]:
        probs = None
    return heads(module.key), heads(module.value), probs


def _is_hf_qkv(module: nn.Module) -> bool:
    return (
        type(module).__module__.startswith("transformers.")
        and all(isinstance(getattr(module, n, None), nn.Linear) for n in ("query", "key", "value"))
        and isinstance(getattr(module, "num_attention_heads", None), int)
        and isinstance(getattr(module, "attention_head_size", None), int)
    )


def known_adapter(module: nn.Module) -> Adapter | None:
    """The built-in adapter for ``module``'s class, or ``None``."""
    from loopprobe.models.layers import CausalSelfAttention

    if isinstance(module, CausalSelfAttention):
        return looped_gpt_attention
    if isinstance(module, nn.MultiheadAttention):
        return torch_multihead_attention
    if _is_hf_qkv(module):
        return hf_qkv_attention
    cls = type(module)
    if cls.__name__ == "Attend" and cls.__module__.startswith("x_transformers"):
        return x_transformers_attend
    return None


def sparsity(
    p0: torch.Tensor,
    v0: torch.Tensor,
    p1: torch.Tensor,
    v1: torch.Tensor,
    fractions: Sequence[float],
) -> list[dict[str, float]]:
    """Energy share and oracle recall of the top keys by the previous loop's probabilities.

    ``p0, v0``: loop t-1; ``p1, v1``: loop t; ``p`` is ``(B, H, T, S)``, ``v`` ``(B, H, S, d)``.
    One dict per fraction: ``fraction``, ``captured`` and ``recall``.
    """
    p0, v0, p1, v1 = (t.double() for t in (p0, v0, p1, v1))
    score = oracle_scores(p0, v0, p1, v1)
    valid = (p0 > 0) | (p1 > 0)
    n = valid.sum(-1)
    total = score.sum(-1)
    live = total > 0
    rank_prev = _ranks(torch.where(valid, p0, -1.0))
    rank_oracle = _ranks(torch.where(valid, score, -1.0))
    rows = []
    for f in fractions:
        k = torch.clamp(torch.ceil(f * n.double()), min=1)[..., None]
        chosen = rank_prev < k
        oracle = rank_oracle < k
        captured = (score * chosen).sum(-1) / torch.where(live, total, 1.0)
        recall = (chosen & oracle).sum(-1) / k[..., 0]
        rows.append(
            {
                "fraction": float(f),
                "captured": _mean(captured[live]),
                "recall": _mean(recall[live]),
            }
        )
    return rows


def oracle_scores(
    p0: torch.Tensor, v0: torch.Tensor, p1: torch.Tensor, v1: torch.Tensor, chunk: int = 2**24
) -> torch.Tensor:
    """``s_ij = ||p1[i,j] v1[j] - p0[i,j] v0[j]||^2``, ``(B, H, T, S)``, in query chunks whose
    ``(B, H, c, S, d)`` difference has at most ``chunk`` entries (the difference is formed
    explicitly: expanding the square would leave rounding noise on unchanged keys)."""
    B, H, T, S = p1.shape
    step = max(1, chunk // max(1, B * H * S * v1.shape[-1]))
    out = []
    for i in range(0, T, step):
        a = p1[..., i : i + step, :, None] * v1[..., None, :, :]
        b = p0[..., i : i + step, :, None] * v0[..., None, :, :]
        out.append((a - b).pow(2).sum(-1))
    return torch.cat(out, dim=-2)


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Rank of every entry along the last dimension, 0 for the largest."""
    order = x.argsort(dim=-1, descending=True, stable=True)
    return order.argsort(dim=-1).double()


def _mean(x: torch.Tensor) -> float:
    return float(x.mean()) if x.numel() else math.nan
