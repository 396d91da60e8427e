"""Where looping is redundant: FlashLoop's three observations, measured per loop by hooks.

One forward records, per loop (visit) of every looped layer, the layer's output, and for
every attention module an adapter can read (:mod:`loopprobe.estimate.redundancy.attention`), its K,
V and attention probabilities. Loop ``t`` of a layer is its t-th call (1-based in the
frames). From these, with the definitions of the authors' reference code:

- **similarity** of a per-loop tensor ``b`` (layer output, K, V) with the previous loop
  ``a``: per-token cosine (``cos_mean``, ``cos_median``, ``cos_p5``), ``rel_reuse``
  ``= ||b - a|| / ||b||``, ``rel_prev`` ``= ||b - a|| / ||a||``, ``norm_ratio`` ``= ||b||/||a||``;
- **extrapolation** from loops ``a, b`` to ``c``: ``d_prior = b - a``, ``d_next = c - b``;
  ``cos_deltas``, ``delta_ratio`` ``= ||d_next|| / ||d_prior||``, ``alpha``
  ``= <d_prior, d_next> / ||d_prior||^2`` and the relative errors ``||c - c_hat|| / ||c||`` of
  reuse (``err_reuse``), ``b + d_prior`` (``err_linear``) and ``b + alpha d_prior``
  (``err_oracle``);
- **concentration** (observation 1): per token ``s_i = ||h_t,i - h_{t-1},i|| / ||h_t,i||`` on
  the layer output; the share of the squared change ``sum ||h_t,i - h_{t-1},i||^2`` carried
  by the top ``ceil(f T)`` tokens by ``s_i`` (``share``; ``share_oracle``: the top tokens by
  the change itself; ``share_prev``, loops >= 3: the top tokens by the *previous* loop's
  score, which is what a lazy update can know), per sequence, averaged over the batch (a
  uniform change gives ``f``);
- **attention** (observation 2) and **quantization** (observation 3): see
  :func:`loopprobe.estimate.redundancy.attention.sparsity` and
  :func:`loopprobe.estimate.redundancy.quant.residual_quantization`.

Tokens are the second-to-last axis of a ``(B, T, D)`` output (a ``(T, D)`` one is one
sequence); K and V are ``(B, H, T, d)`` and count as tokens of ``H*d`` channels for the
similarity. Every number is computed in float64. Reference: FlashLoop (arXiv 2609.29812),
the digest in shared/PAPERS.md §7.

Example::

    res = lp.redundancy(model, idx)
    res.to_frame()        # observation, layer, tensor, loop, metric, param, value
    res.summary()         # one row per (observation, tensor, metric, param), one column per loop
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
from torch import nn

from loopprobe._checks import Trust
from loopprobe._html import HTMLView
from loopprobe.estimate.redundancy import attention as ra
from loopprobe.estimate.redundancy.metrics import concentration, extrapolation, similarity, tokens
from loopprobe.estimate.redundancy.quant import GROUP_DIM, residual_quantization
from loopprobe.record.probe import Probe

FRACTIONS = (0.1, 0.25, 0.5)
KEY_FRACTIONS = (0.1, 0.2, 0.3, 0.5)
BITS = (2, 4)
ORDER = ("observation", "tensor", "metric")  # summary rows in the order they were measured
COLUMNS = ["observation", "layer", "tensor", "loop", "metric", "param", "value"]


# --------------------------------------------------------------------------- the result


@dataclass
class Redundancy(Trust, HTMLView):
    """The four measurements as one tidy long frame, plus what could not be measured.

    ``frame``: one row per (observation, layer, tensor, loop, metric, param); ``param`` is
    the token fraction ``f`` (concentration), the key fraction (attention), the bit width
    (quantization), NaN otherwise. ``layers``: loops recorded per layer; ``attention``:
    calls recorded per attention module; ``notes``: what was skipped and why.
    ``converged`` is False when a layer had fewer than two loops or a number is not finite
    (``reason`` names them).
    """

    frame: pd.DataFrame
    layers: dict[str, int]
    attention: dict[str, int]
    notes: list[str] = field(default_factory=list)

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def summary(self) -> pd.DataFrame:
        """Mean over layers: rows (observation, tensor, metric, param), columns loop."""
        df = self.frame.fillna({"param": -1.0})
        first = {c: {v: i for i, v in enumerate(df[c].unique())} for c in ORDER}
        wide = df.pivot_table(
            index=[*ORDER, "param"], columns="loop", values="value", aggfunc="mean"
        )
        wide = wide.sort_index(key=lambda ix: ix.map(first[ix.name]) if ix.name in first else ix)
        return wide.sort_index(axis=1).rename(index={-1.0: float("nan")}, level="param")

    def _not_converged(self) -> list[str]:
        out = [f"layer {n} has {r} loop(s), fewer than 2" for n, r in self.layers.items() if r < 2]
        bad = self.frame[~self.frame["value"].map(math.isfinite)]
        if len(bad):
            what = sorted({f"{o}/{m}" for o, m in zip(bad.observation, bad.metric, strict=True)})
            out.append(f"{len(bad)} non-finite values ({', '.join(what)})")
        return out


# --------------------------------------------------------------------------- capture


def default_layers(model: nn.Module) -> list[str] | None:
    """The modules whose output is the state: the blocks of a LoopedGPT, else discovery."""
    from loopprobe.models import LoopedGPT

    return ["blocks.*"] if isinstance(model, LoopedGPT) else None


def _first_tensor(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)) and x:
        return _first_tensor(x[0])
    for key in ("last_hidden_state", "hidden_states"):
        if isinstance(getattr(x, key, None), torch.Tensor):
            return getattr(x, key)
    return None


def _adapters(model: nn.Module, attention: Any, call: str) -> dict[str, ra.Adapter]:
    if attention is None:
        found = {n: ra.known_adapter(m) for n, m in model.named_modules()}
        return {n: a for n, a in found.items() if a is not None}
    if attention is False:
        return {}
    if not isinstance(attention, Mapping):
        raise TypeError(
            f"{call}: attention={attention!r} must be None (recognise known modules), False "
            "(none) or a dict {module name or glob: adapter(module, args, kwargs, output)}"
        )
    names = [n for n, _ in model.named_modules()]
    out = {}
    for pat, fn in attention.items():
        if not callable(fn):
            raise TypeError(
                f"{call}: the adapter for {pat!r} is a {type(fn).__name__}, not callable"
            )
        hits = [n for n in names if fnmatch.fnmatchcase(n, pat)]
        if not hits:
            raise ValueError(f"{call}: attention pattern {pat!r} matches no module of the model")
        out.update(dict.fromkeys(hits, fn))
    return out


def _capture(
    model: nn.Module,
    inputs: Any,
    layers: Sequence[str] | None,
    adapters: dict[str, ra.Adapter],
    forward: Callable | None,
    seed: int | None,
    call: str,
) -> tuple[dict[str, list[torch.Tensor]], dict[str, list[tuple]]]:
    probe = Probe(model, layers)
    subs = probe.sublayers(inputs, forward=forward, seed=seed)  # discovery before our hooks
    body = {s.name for s in subs if s.role == "body"}
    kv: dict[str, list[tuple]] = {n: [] for n in adapters}
    modules = dict(model.named_modules())

    def hook(name: str) -> Callable:
        def record(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            try:
                got = adapters[name](module, args, kwargs, output)
                k, v, p = got
            except Exception as err:
                raise type(err)(f"{call}: the attention adapter of {name!r} failed: {err}") from err
            kv[name].append(tuple(None if t is None else t.detach().double() for t in (k, v, p)))

        return record

    handles = [modules[n].register_forward_hook(hook(n), with_kwargs=True) for n in adapters]
    try:
        with torch.no_grad():
            rec = probe.record(inputs, forward=forward, seed=seed)
    finally:
        for h in handles:
            h.remove()
    states: dict[str, list[torch.Tensor]] = {}
    for v in rec.visits:
        out = _first_tensor(v.output)
        if v.sublayer in body and out is not None:
            states.setdefault(v.sublayer, []).append(out.detach().double())
    return states, kv


# --------------------------------------------------------------------------- the measurement


def redundancy(
    model: nn.Module,
    inputs: Any,
    *,
    layers: Sequence[str] | None = None,
    attention: Mapping[str, ra.Adapter] | bool | None = None,
    forward: Callable | None = None,
    fractions: Sequence[float] = FRACTIONS,
    key_fractions: Sequence[float] = KEY_FRACTIONS,
    bits: Sequence[int] = BITS,
    group: int = 64,
    seed: int | None = 0,
) -> Redundancy:
    """Adjacent-loop similarity, token-change concentration, attention-difference sparsity
    and KV-residual quantization of ``model`` on ``inputs``, per layer and loop.

    ``layers``: module names/globs whose output is the per-loop state (default: the blocks
    of a :class:`~loopprobe.models.LoopedGPT`, else the discovered loop body, see
    :func:`loopprobe.attach`). ``attention``: ``None`` recognises the reference models'
    attention and x-transformers' ``Attend``; a dict ``{name or glob: adapter}`` names your
    own (see :mod:`loopprobe.estimate.redundancy.attention`); ``False`` skips K/V. ``fractions``:
    token fractions f; ``key_fractions``: kept key fractions; ``bits``/``group``: the
    quantizer. ``seed``: torch's RNG for the forward (the caller's state is restored).
    The model is not changed (one forward under ``no_grad`` with temporary hooks).
    """
    call = "redundancy"
    if not isinstance(model, nn.Module):
        raise TypeError(f"{call}: expected an nn.Module, got {type(model).__name__}")
    for name, fs in (("fractions", fractions), ("key_fractions", key_fractions)):
        if not fs or any(not isinstance(f, (int, float)) or not 0 < f <= 1 for f in fs):
            raise ValueError(f"{call}: {name}={fs!r} must be fractions in (0, 1], e.g. (0.1, 0.5)")
    if not bits or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in bits):
        raise ValueError(f"{call}: bits={bits!r} must be integers >= 1, e.g. (2, 4)")
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ValueError(f"{call}: group={group!r} must be an integer >= 1 (64 in FlashLoop)")
    adapters = _adapters(model, attention, call)
    layers = default_layers(model) if layers is None else list(layers)
    states, kv = _capture(model, inputs, layers, adapters, forward, seed, call)
    rows: list[dict] = []
    notes: list[str] = []

    def add(obs: str, layer: str, tensor: str, loop: int, metrics: dict, param=math.nan):
        for m, val in metrics.items():
            rows.append(dict(zip(COLUMNS, (obs, layer, tensor, loop, m, param, val), strict=True)))

    for name, hs in states.items():
        hs = [tokens(h) for h in hs]
        if len({h.shape for h in hs}) > 1:
            notes.append(f"layer {name}: the output shape changes across loops; skipped")
            continue
        _hidden_rows(add, name, "output", hs, fractions)
    for name, caps in kv.items():
        if len(caps) < 2:
            notes.append(
                f"attention {name}: called once, no adjacent loops"
                if caps
                else f"attention {name}: never called (a fused fast path may bypass it)"
            )
            continue
        for i, t in enumerate(("K", "V")):
            xs = [c[i] for c in caps]
            _hidden_rows(add, name, t, [tokens(x) for x in xs], ())
            for b in bits:
                for loop, r in enumerate(residual_quantization(xs, b, group, GROUP_DIM[t]), 1):
                    add("quantization", name, t, loop, r, float(b))
        probs = [c[2] for c in caps]
        if any(p is None for p in probs):
            notes.append(
                f"attention {name}: the adapter gave no probabilities (fused kernels return "
                "none; Hugging Face: attn_implementation='eager'); no sparsity"
            )
            continue
        for loop in range(2, len(caps) + 1):
            (_, v0, p0), (_, v1, p1) = caps[loop - 2], caps[loop - 1]
            if p1.shape[1] != v1.shape[1]:
                notes.append(f"attention {name}: grouped K/V heads; no sparsity")
                break
            for r in ra.sparsity(p0, v0, p1, v1, key_fractions):
                f = r.pop("fraction")
                add("attention", name, "probs", loop, r, f)
    if not adapters:
        notes.append(
            "no attention module recognised: hidden-state measurements only; name yours with "
            "attention={'path.to.attn': adapter} (see loopprobe.estimate.redundancy.attention)"
        )
    frame = pd.DataFrame(rows, columns=COLUMNS)
    return Redundancy(
        frame, {n: len(h) for n, h in states.items()}, {n: len(c) for n, c in kv.items()}, notes
    )


def _hidden_rows(add: Callable, name: str, tensor: str, hs: list, fractions: Sequence) -> None:
    for loop in range(2, len(hs) + 1):
        a, b = hs[loop - 2], hs[loop - 1]
        add("similarity", name, tensor, loop, similarity(a, b))
        if loop >= 3:
            add("extrapolation", name, tensor, loop, extrapolation(hs[loop - 3], a, b))
        before = hs[loop - 3] if loop >= 3 else None
        for f, shares in concentration(a, b, fractions, before).items():
            add("concentration", name, tensor, loop, shares, f)
