"""Section ``health``: the health check's verdicts on a user's model (:func:`lp.health`)."""

from __future__ import annotations

import pandas as pd

from loopprobe.estimate.health import health
from loopprobe.report.common import refusal_is_skip
from loopprobe.report.config import Context, Fig, Result, Skip
from loopprobe.report.sections_alignment import cosine_rows
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
            optimizer=ctx.cfg.optimizer,
            **u.probe_kwargs(),  # forward, output, sublayers, exclude: one Target for all
            max_iter=max(ctx.cfg.power_iters, 50),
            progress=ctx.progress,
        )
    verdicts = [verdict(r) for r in h.frame.to_dict("records")]
    summary = h.frame[["check", "reading", "verdict", "kind", "measured"]]
    notes = [
        f"loss: {h.values['loss']}",  # the loss the checks used, as the rule picked it
        f"optimizer: {h.values['optimizer']} (the bound and scaling lines judge its step; "
        "set it with --optimizer)",
        "reading: fine / risk (what to change) / cannot tell (what would tell); the theory's "
        "claim or premise (aligned, correlated, ...) is context beside it",
        "kind = inference: an extrapolation in R from this one R",
    ]
    if not h.converged:
        notes.append(f"not converged: {h.reason}")
    frames = {"checks": h.frame}
    figures = []
    if h.visits is not None and len(h.visits):  # the per-visit readings behind the lines
        frames.update(visits=h.visits, cosines=pd.DataFrame(cosine_rows(h.cos_G)))
        figures.append(
            Fig(
                "health_visit_norms",
                "Your model, per visit: ‖U_r,j‖ and ‖G_r,j‖ "
                "(the explosion line reads ‖G_r‖/‖G_last‖).",
                "visits",
                "visit_norms",
            )
        )
        if len(frames["cosines"]):
            figures.append(Fig("health_cosines", "Your model: cosines of the visits' G_·,j "
                               "(the oscillation line averages the first off-diagonal).",
                               "cosines", "visit_cosines"))  # fmt: skip
    return Result(
        frames=frames,
        figures=figures,
        tables=[
            ("Health check: one row per check (reading, what to do, measured, theory)", h.frame)
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
    """A row of ``Health.frame`` as a report :class:`Verdict`: its reading (fine / risk /
    cannot tell) decides; the threshold and the theory's verdict are the context, the advice
    (what to change, or what would tell) the why."""
    expected = f"{row['threshold']}; theory: {row['claim']}: {row['verdict']}"
    claim = f"{row['check']}: {row['claim']}"
    return Verdict(
        "health", claim, row["reading"], row["measured"], expected, row["advice"], row["kind"]
    )


def _plain(v: object) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))
