"""Brute-force twins of loopprobe.estimate.redundancy in plain numpy loops (tests only).

``numpy_looped_gpt`` re-implements the pre-norm LoopedGPT from its weights (an explicit,
untied loop, optionally freezing tokens as the lazy update does). Every other function
restates a definition of issue 15 / FlashLoop element by element (Python
loops over sequences, tokens, queries and quantization groups), shares no code with the
library, and returns the rows ``lp.redundancy`` should report as a dict
``(observation, layer, tensor, loop, metric, param) -> value``.
"""

from __future__ import annotations

import math

import numpy as np

NAN = float("nan")


def numpy_looped_gpt(model, idx, lazy: float | None = None):
    """The pre-norm LoopedGPT written out in numpy: per-loop block outputs, K, V, probs.

    ``lazy=f``: from loop 3 on, only the top ceil(f T) tokens (the last one always) by the
    previous loop's change score keep their new block outputs; the others keep loop t-1's.
    """
    W = {n: p.detach().numpy() for n, p in model.named_parameters()}
    cfg = model.cfg
    B, T = idx.shape
    H, dh = cfg.n_heads, cfg.d_model // cfg.n_heads
    erf = np.vectorize(math.erf)

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w

    def heads(x):
        return x.reshape(B, T, H, dh).transpose(0, 2, 1, 3)

    h = W["tok_emb.weight"][idx.numpy()] + W["pos_emb.weight"][:T]
    states = {f"blocks.{k}": [] for k in range(cfg.K)}
    kv = {f"blocks.{k}.attn.f": [] for k in range(cfg.K)}
    rounds = []
    for r in range(cfg.R):
        keep = np.ones((B, T), bool)
        if lazy is not None and r >= 2:
            a, b = rounds[-2], rounds[-1]
            keep[:] = False
            for s in range(B):
                score = [
                    np.linalg.norm(b[s, i] - a[s, i]) / np.linalg.norm(b[s, i]) for i in range(T)
                ]
                score[-1] = math.inf
                keep[s, sorted(range(T), key=lambda i: -score[i])[: math.ceil(lazy * T)]] = True
        for k in range(cfg.K):
            b, eps = f"blocks.{k}.", model.blocks[k].attn.eps
            u = rms(h, W[b + "attn.norm.weight"])
            q, kk, v = (heads(u @ W[b + f"attn.f.{n}.weight"].T) for n in "qkv")
            s = q @ kk.transpose(0, 1, 3, 2) / math.sqrt(dh)
            s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            y = (p @ v).transpose(0, 2, 1, 3).reshape(B, T, H * dh)
            h = h + eps * (y @ W[b + "attn.f.o.weight"].T)
            u = rms(h, W[b + "mlp.norm.weight"]) @ W[b + "mlp.f.fc1.weight"].T
            h = h + eps * ((0.5 * u * (1 + erf(u / math.sqrt(2)))) @ W[b + "mlp.f.fc2.weight"].T)
            if not keep.all():
                h = np.where(keep[..., None], h, states[f"blocks.{k}"][-1])
            states[f"blocks.{k}"].append(h.copy())
            kv[f"blocks.{k}.attn.f"].append((kk, v, p))
        rounds.append(h.copy())
    logits = rms(h, W["final_norm.weight"]) @ W["tok_emb.weight"].T
    return states, kv, logits


def kv_tokens(x: np.ndarray) -> np.ndarray:
    """(B, H, T, d) -> (B, T, H*d)."""
    B, H, T, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, H * d)


def similarity(a: np.ndarray, b: np.ndarray) -> dict:
    cos = []
    for s in range(a.shape[0]):
        for t in range(a.shape[1]):
            na, nb = np.linalg.norm(a[s, t]), np.linalg.norm(b[s, t])
            if na > 0 and nb > 0:
                cos.append(float(a[s, t] @ b[s, t]) / (na * nb))
    d = np.linalg.norm(b - a)
    return {
        "cos_mean": np.mean(cos),
        "cos_median": np.median(cos),
        "cos_p5": np.percentile(cos, 5),
        "rel_reuse": d / np.linalg.norm(b),
        "rel_prev": d / np.linalg.norm(a),
        "norm_ratio": np.linalg.norm(b) / np.linalg.norm(a),
    }


def extrapolation(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> dict:
    dp, dn = (b - a).ravel(), (c - b).ravel()
    alpha = float(dp @ dn) / float(dp @ dp)
    nc = np.linalg.norm(c)
    return {
        "cos_deltas": float(dp @ dn) / (np.linalg.norm(dp) * np.linalg.norm(dn)),
        "delta_ratio": np.linalg.norm(dn) / np.linalg.norm(dp),
        "alpha": alpha,
        "err_reuse": np.linalg.norm(c - b) / nc,
        "err_linear": np.linalg.norm(c - (b + (b - a))) / nc,
        "err_oracle": np.linalg.norm(c - (b + alpha * (b - a))) / nc,
    }


def concentration(prev: np.ndarray, cur: np.ndarray, f: float, before=None) -> dict:
    out: dict[str, list] = {"share": [], "share_oracle": [], "share_prev": []}
    for s in range(cur.shape[0]):
        T = cur.shape[1]
        change = [np.linalg.norm(cur[s, t] - prev[s, t]) for t in range(T)]
        rank = {
            "share": [change[t] / np.linalg.norm(cur[s, t]) for t in range(T)],
            "share_oracle": change,
        }
        if before is not None:
            rank["share_prev"] = [
                np.linalg.norm(prev[s, t] - before[s, t]) / np.linalg.norm(prev[s, t])
                for t in range(T)
            ]
        k = max(1, math.ceil(f * T))
        total = sum(c * c for c in change)
        for name, key in rank.items():
            top = sorted(range(T), key=lambda t, key=key: -key[t])[:k]
            if total > 0:
                out[name].append(sum(change[t] ** 2 for t in top) / total)
    return {name: np.mean(v) for name, v in out.items() if v}


def sparsity(p0, v0, p1, v1, f: float) -> tuple[float, float]:
    captured, recall = [], []
    B, H, T, S = p0.shape
    for b in range(B):
        for h in range(H):
            for i in range(T):
                keys = [j for j in range(S) if p0[b, h, i, j] > 0 or p1[b, h, i, j] > 0]
                score = {
                    j: float(
                        np.sum((p1[b, h, i, j] * v1[b, h, j] - p0[b, h, i, j] * v0[b, h, j]) ** 2)
                    )
                    for j in keys
                }
                total = sum(score.values())
                if total == 0:
                    continue
                k = max(1, math.ceil(f * len(keys)))
                chosen = sorted(keys, key=lambda j: -p0[b, h, i, j])[:k]
                oracle = sorted(keys, key=lambda j: -score[j])[:k]
                captured.append(sum(score[j] for j in chosen) / total)
                recall.append(len(set(chosen) & set(oracle)) / k)
    return float(np.mean(captured)), float(np.mean(recall))


def quantize_groups(x: np.ndarray, bits: int, group: int, along_tokens: bool) -> np.ndarray:
    """K: per (b, h, channel) over token groups; V: per (b, h, token) over channel groups."""
    out = np.empty_like(x)
    B, H, T, d = x.shape
    levels = 2**bits - 1
    for b in range(B):
        for h in range(H):
            lines = range(d) if along_tokens else range(T)
            for line in lines:
                vec = x[b, h, :, line] if along_tokens else x[b, h, line, :]
                res = np.empty_like(vec)
                for start in range(0, len(vec), group):
                    g = vec[start : start + group]
                    lo, hi = g.min(), g.max()
                    if hi == lo:
                        res[start : start + group] = g
                        continue
                    scale = (hi - lo) / levels
                    q = np.clip(np.round((g - lo) / scale), 0, levels)
                    res[start : start + group] = q * scale + lo
                if along_tokens:
                    out[b, h, :, line] = res
                else:
                    out[b, h, line, :] = res
    return out


def quantization(xs: list[np.ndarray], bits: int, group: int, along_tokens: bool) -> list[dict]:
    rows, prev = [], None
    for x in xs:
        direct = quantize_groups(x, bits, group, along_tokens)
        hat = (
            direct if prev is None else prev + quantize_groups(x - prev, bits, group, along_tokens)
        )
        e_d = np.linalg.norm(direct - x) / np.linalg.norm(x)
        e_r = np.linalg.norm(hat - x) / np.linalg.norm(x)
        rows.append({"err_direct": e_d, "err_residual": e_r, "ratio": e_r / e_d})
        prev = hat
    return rows


def expected_rows(states: dict, kv: dict, fractions, key_fractions, bits, group) -> dict:
    """All rows from per-loop numpy tensors: ``states[layer] = [(B, T, D), ...]``,
    ``kv[module] = [(k, v, probs), ...]`` with (B, H, T, d) / (B, H, T, T)."""
    rows = {}

    def put(obs, layer, tensor, loop, metrics, param=NAN):
        for m, v in metrics.items():
            rows[(obs, layer, tensor, loop, m, param)] = float(v)

    def hidden(layer, tensor, hs, fracs):
        for t in range(2, len(hs) + 1):
            a, b = hs[t - 2], hs[t - 1]
            put("similarity", layer, tensor, t, similarity(a, b))
            if t >= 3:
                put("extrapolation", layer, tensor, t, extrapolation(hs[t - 3], a, b))
            for f in fracs:
                before = hs[t - 3] if t >= 3 else None
                put("concentration", layer, tensor, t, concentration(a, b, f, before), f)

    for layer, hs in states.items():
        hidden(layer, "output", hs, fractions)
    for name, caps in kv.items():
        for i, t in enumerate(("K", "V")):
            xs = [c[i] for c in caps]
            hidden(name, t, [kv_tokens(x) for x in xs], ())
            for b in bits:
                for loop, r in enumerate(quantization(xs, b, group, t == "K"), 1):
                    put("quantization", name, t, loop, r, float(b))
        if any(c[2] is None for c in caps):  # no probabilities, no sparsity
            continue
        for loop in range(2, len(caps) + 1):
            (_, v0, p0), (_, v1, p1) = caps[loop - 2], caps[loop - 1]
            for f in key_fractions:
                cap, rec = sparsity(p0, v0, p1, v1, f)
                put("attention", name, "probs", loop, {"captured": cap, "recall": rec}, f)
    return rows
