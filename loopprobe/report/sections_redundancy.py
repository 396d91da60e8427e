"""Section ``redundancy``: FlashLoop's observations per loop and the lazy-update cost."""

from __future__ import annotations

import math

import pandas as pd

from loopprobe.estimate.redundancy import redundancy
from loopprobe.estimate.redundancy.lazy import lazy_update
from loopprobe.report.common import _batch, _gpt
from loopprobe.report.config import Context, Fig, Result


def redundancy_section(ctx: Context) -> Result:
    """Token-change concentration, attention-difference sparsity and KV-residual quantization
    per loop (:func:`loopprobe.redundancy`), and the lazy update's output change vs work saved
    (reference model only: it needs next-token targets)."""
    cfg = ctx.cfg
    if ctx.user is not None:
        model, inputs, targets = ctx.user.model, ctx.user.inputs, None
        forward = ctx.user.forward
        how = f"{ctx.user.spec} as given"
    else:
        model = _gpt(cfg, K=cfg.K, R=max(cfg.Rs), norm="pre")
        inputs, targets = _batch(cfg)
        forward = None
        how = f"reference LoopedGPT K={cfg.K} R={max(cfg.Rs)} pre-norm at initialization"
    res = redundancy(model, inputs, forward=forward)
    frames = {"redundancy": res.to_frame()}
    figures = [
        Fig("redundancy_concentration", "Share of the squared state change carried by the "
            "top fraction f of tokens, per loop (dotted: f, a uniform change).", "redundancy",
            "token_concentration"),
    ]  # fmt: skip
    if (frames["redundancy"].observation == "quantization").any():
        figures.append(
            Fig("redundancy_quantization", "Error of quantizing the KV residual against the "
                "previous loop over quantizing K/V directly, per loop and bit width "
                "(below 1: residuals quantize better).", "redundancy", "kv_quantization")
        )  # fmt: skip
    if targets is not None:
        frames["lazy"] = lazy_update(model, inputs, targets=targets)
        figures.append(
            Fig("redundancy_lazy", "Lazy token update from loop 3: output change (KL) vs the "
                "share of per-token work saved, per kept fraction f.", "lazy", "lazy_update_cost")
        )  # fmt: skip
    summary = res.summary().reset_index()
    takeaway = redundancy_takeaway(summary, frames.get("lazy"))
    return Result(
        frames=frames,
        figures=figures,
        tables=[("Mean over layers, one column per loop", summary)],
        summary=summary,
        values={
            "converged": res.converged,
            "reason": res.reason,
            "model": how,
            "takeaway": takeaway,
        },  # fmt: skip
        notes=[f"model: {how}", *res.notes],
    )


def _at(summary: pd.DataFrame, observation: str, tensor: str, metric: str, param=None) -> float:
    """The value at the last loop with one, of one row of the summary table (nan if absent)."""
    rows = summary[(summary["observation"] == observation) & (summary["tensor"] == tensor)
                   & (summary["metric"] == metric)]  # fmt: skip
    if param is not None:
        rows = rows[pd.to_numeric(rows["param"], errors="coerce") == param]
    loops = [c for c in summary.columns if c not in ("observation", "tensor", "metric", "param")]
    vals = rows[loops].apply(pd.to_numeric, errors="coerce").to_numpy().ravel() if len(rows) else []
    vals = [float(v) for v in vals if math.isfinite(v)]
    return vals[-1] if vals else math.nan


def redundancy_takeaway(summary: pd.DataFrame, lazy: pd.DataFrame | None = None) -> str:
    """One sentence a reader can act on, from the last loop's readings: whether the state
    change concentrates on few tokens (top 10 % carry >= 20 % of it), how alike consecutive
    loops are, whether KV residuals quantize better than K/V, and the lazy update's trade."""
    parts = []
    top = _at(summary, "concentration", "output", "share", 0.1)
    if math.isfinite(top):
        where = "concentrates on few tokens" if top >= 0.2 else "is spread over the tokens"
        parts.append(f"at the last loop the state change {where} (the top 10 % carry "
                     f"{top:.0%}; uniform: 10 %)")  # fmt: skip
    cos = _at(summary, "similarity", "output", "cos_mean")
    if math.isfinite(cos):
        parts.append(f"consecutive loops' outputs have mean cosine {cos:.2f}")
    bits = pd.to_numeric(summary.loc[summary["metric"] == "ratio", "param"], errors="coerce")
    if len(bits.dropna()):
        b = bits.max()
        ratios = [_at(summary, "quantization", t, "ratio", b) for t in ("K", "V")]
        ratios = [r for r in ratios if math.isfinite(r)]
        if ratios:
            better = "quantize better than" if max(ratios) < 1 else "do not beat"
            parts.append(f"KV residuals {better} K/V at {b:g} bits (error ratio "
                         f"{' / '.join(f'{r:.2f}' for r in ratios)})")  # fmt: skip
    if lazy is not None and len(lazy):
        best = lazy.sort_values("saved").iloc[-1]
        parts.append(f"a lazy update saves {best['saved']:.0%} of per-token work at KL "
                     f"{best['kl']:.2g} (f = {best['f']:g})")  # fmt: skip
    if not parts:
        return "no reading to summarize (see the table)"
    text = "; ".join(parts)
    return text[0].upper() + text[1:] + "."
