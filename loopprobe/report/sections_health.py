"""Section ``health``: the health check's verdicts on a user's model (:func:`lp.health`)."""

from __future__ import annotations

from loopprobe.estimate.health import health
from loopprobe.report.common import refusal_is_skip
from loopprobe.report.config import Context, Result, Skip
from loopprobe.report.verdicts import Verdict


def health_section(ctx: Context) -> Result:
    """One verdict per check of :func:`lp.health` on ``--model``; Skip on the reference run."""
    if ctx.user is None:
        raise Skip(
            "runs on a model of yours (--model); the reference model's verdicts come from the "
            "alignment, increments, coordcheck and fixedpoint sections, which sweep R and N"
        )
    u = ctx.user
    with refusal_is_skip():
        h = health(
            u.model,
            u.inputs,
            loss_fn=u.loss_fn,
            alpha=u.alpha,
            beta=u.beta,
            step=u.step,
            increment=u.increment,
            sublayers=u.sublayers,
            exclude=u.exclude,
            forward=u.forward,
            output=u.output,
            max_iter=max(ctx.cfg.power_iters, 50),
            progress=ctx.progress,
        )
    verdicts = [verdict(r) for r in h.frame.to_dict("records")]
    summary = h.frame[["check", "verdict", "kind", "measured"]]
    notes = [f"loss: {u.loss_name}", "kind = inference: an extrapolation in R from this one R"]
    if not h.converged:
        notes.append(f"not converged: {h.reason}")
    return Result(
        frames={"checks": h.frame},
        tables=[
            ("Health check: one row per check (measured, theory, threshold, verdict)", h.frame)
        ],
        summary=summary,
        values={
            "verdicts": [v.to_dict() for v in verdicts],
            "converged": h.converged,
            "reason": h.reason,
            **{k: v for k, v in h.values.items() if _plain(v)},
        },
        notes=notes,
    )


def verdict(row: dict) -> Verdict:
    """A row of ``Health.frame`` as a report :class:`Verdict` (theory and threshold: expected)."""
    expected = f"{row['threshold']}; theory: {row['predicted']}"
    claim = f"{row['check']}: {row['claim']}"
    return Verdict(
        "health", claim, row["verdict"], row["measured"], expected, row["why"], row["kind"]
    )


def _plain(v: object) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))
