"""Section ``redundancy``: FlashLoop's observations per loop and the lazy-update cost."""

from __future__ import annotations

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
    return Result(
        frames=frames,
        figures=figures,
        tables=[("Mean over layers, one column per loop", summary)],
        summary=summary,
        values={"converged": res.converged, "reason": res.reason, "model": how},
        notes=[f"model: {how}", *res.notes],
    )
