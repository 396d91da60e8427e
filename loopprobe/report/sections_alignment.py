"""Sections ``theory``, ``visits`` and ``alignment``: closed forms, visits, κ_R and the bound."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import pandas as pd
import torch

import loopprobe
from loopprobe import theory
from loopprobe._stats import loglog_slope
from loopprobe.report.common import (
    _batch,
    _cfg_attr,
    _gpt,
    _lm_loss,
    first_tensor,
    refusal_is_skip,
)
from loopprobe.report.config import Context, Fig, ReportConfig, Result, Skip
from loopprobe.report.verdicts import alignment_verdicts
from loopprobe.sweeps import grid, sweep


def theory_section(ctx: Context) -> Result:
    """α, β, β/α, M and the untied/aligned bounds over R per scheme (closed forms)."""
    cfg = ctx.cfg
    if ctx.user is not None:
        c = _cfg_attr(ctx.user.model, "K", "R", "norm")
        if c is None or c["norm"] not in theory.ALLOWED_NORMS or c["norm"] == "postp":
            raise Skip(
                "needs model.cfg with K, R and a named norm (a reference LoopedGPT "
                f"config); {type(ctx.user.model).__name__} has none"
            )
        K, Rs, norms = c["K"], [c["R"]], [c["norm"]]
    else:
        K, Rs, norms = cfg.K, list(cfg.Rs), list(cfg.norms)
    rows = []
    for norm in norms:
        for R in Rs:
            N = theory.unrolled_depth(K, R)
            sc = theory.scales(N, norm)
            rows.append(
                {
                    "norm": norm,
                    "K": K,
                    "R": R,
                    "N": N,
                    "M": theory.visit_count(K, R),
                    "p": sc.p,
                    "alpha": sc.alpha,
                    "beta": sc.beta,
                    "beta/alpha": sc.ratio,
                    "untied_bound": theory.untied_bound(N, sc),
                    "aligned_tied_bound": theory.aligned_tied_bound(K, R, sc),
                }
            )
    df = pd.DataFrame(rows)
    from loopprobe import plots  # on call: `loopprobe --help` stays light

    slopes = plots.predicted_slopes(norms)
    summary = pd.DataFrame(
        [
            {
                "scheme": n,
                "p": theory.scales(1, n).p,
                "slope in R (aligned)": slopes.get(n, math.nan),
                "slope in R (decorrelated)": plots.predicted_slopes([n], 0.0).get(n, math.nan),
            }
            for n in norms
        ]
    )
    res = Result(
        frames={"bounds": df},
        tables=[("Closed forms (seed 002, Eqs. 5-16)", df)],
        summary=summary,
        values={"rows": df.to_dict("records"), "slopes": slopes},
    )
    if len(Rs) > 1:
        res.figures.append(
            Fig(
                "theory_bound",
                "Predicted bound M κ_R (β/α)² with aligned "
                "visits (κ_R = R): DeepNorm grows like R, DeepLoop stays flat.",
                "bounds",
                "delta_f_vs_R",
                {
                    "y": "aligned_tied_bound",
                    "ylabel": "M κ_R (β/α)²  (κ_R = R)",
                    "title": "Predicted bound vs R (seed 002, Eq. 14)",
                },
            )
        )
    return res


def visits_section(ctx: Context) -> Result:
    """Physical sublayers and visits, measured from one forward pass, next to 2KR."""
    output: Callable[[Any], torch.Tensor] = first_tensor
    if ctx.user is not None:
        model, inputs, output = ctx.user.model, ctx.user.inputs, ctx.user.output
    else:
        model, (inputs, _) = _gpt(ctx.cfg, K=ctx.cfg.K, R=4, norm="deeploop"), _batch(ctx.cfg)
    forward = ctx.user.forward if ctx.user is not None else None
    with refusal_is_skip(), loopprobe.attach(model) as probe:
        table = probe.visit_table(inputs, forward=forward, output=output)
    M, M_g = table.attrs["M"], table.attrs["M_g"]
    values = {"J": len(table), "M": M, "M_g": M_g, "sublayers": table.to_dict("records")}
    row = {"J (sublayers)": len(table), "M (visits)": M, "M_g (grad-visible)": M_g}
    c = _cfg_attr(model, "K", "R")
    if c is not None and getattr(model.cfg, "tied", True):
        values["M_theory"] = row["2KR"] = theory.visit_count(c["K"], c["R"])
    title = "Physical sublayers j, visits R_j and gradient-visible visits"
    return Result(
        frames={"visits": table},
        tables=[(title, table)],
        summary=pd.DataFrame([row]),
        values=values,
    )


def _alignment_cell(c: dict) -> list[dict]:
    """One (norm, R) cell: bound check + per-visit norms + visit cosines, as tagged rows.

    Rows of the three kinds share one cell (one cache file); ``table`` says which. The
    cell diverged when the bound check's numbers are not finite (a NaN U norm of one
    visit alone is data, not divergence).
    """
    from loopprobe.estimate.bound import bound_check

    cfg = ReportConfig(**{k: v for k, v in c.items() if k in _CFG_FIELDS})
    model = _gpt(cfg, K=c["K"], R=c["R"], norm=c["norm"])
    idx, targets = _batch(cfg)
    with loopprobe.attach(model) as probe:
        chk = bound_check(
            probe, idx, _lm_loss(targets), lr=c["lr"], max_iter=c["power_iters"], tol=1e-4
        )
    rep = chk.report
    bound = {k: v for k, v in chk.to_dict().items()}
    bound["U_converged"] = float(rep.visits["converged"].astype(float).mean())
    rows = [{"table": "bound", **bound}]
    rows += [{"table": "visit", **r} for r in rep.visits.to_dict("records")]
    for name, cos in rep.cos_G.items():
        m = cos.detach().cpu().numpy()
        rows += [
            {"table": "cosine", "sublayer": name, "r": r, "s": s, "cosine": float(m[r, s])}
            for r in range(m.shape[0])
            for s in range(m.shape[1])
        ]
    bad = [k for k in ("kappa", "dF_true", "dF_first") if not math.isfinite(bound[k])]
    for row in rows:
        row["diverged"] = bool(bad)
        row["error"] = f"non-finite {', '.join(bad)}" if bad else None
    return rows


_alignment_cell.version = f"{loopprobe.__version__}-2"  # bound rows carry converged/reason
_CFG_FIELDS = {f.name for f in dataclasses.fields(ReportConfig)}


def _split(df: pd.DataFrame, table: str) -> pd.DataFrame:
    part = df[df["table"] == table].drop(columns="table")
    return part.dropna(axis=1, how="all").reset_index(drop=True)


def alignment_section(ctx: Context) -> Result:
    """κ_R and the bound check over R per scheme (default) or κ_j on the user's model."""
    if ctx.user is not None:
        return _alignment_user(ctx)
    cfg = ctx.cfg
    cells = grid(norm=list(cfg.norms), R=list(cfg.Rs))
    names = "vocab_size seq_len d_model n_heads batch K lr power_iters seed".split()
    extra = {k: getattr(cfg, k) for k in names}
    df = sweep(
        [{**c, **extra} for c in cells],
        _alignment_cell,
        ctx.cache_dir,
        ctx.progress,
        name="report.alignment",
    )
    failed = df[df["diverged"]]
    df = df[~df["diverged"]]
    if df.empty:
        raise RuntimeError(f"every alignment cell failed: {failed['error'].iloc[0]}")
    keys = ["norm", "R"]
    cols = "kappa M M_g alpha beta dF_first dF_true prediction C U_converged converged".split()
    bound = _split(df, "bound")
    bound = bound[keys + cols + (["reason"] if "reason" in bound else [])]
    bound["converged"] = bound["converged"].astype(bool)  # object dtype in the shared cell frame
    visits, cos = _split(df, "visit"), _split(df, "cosine")
    Rmax, show = max(cfg.Rs), cfg.norms[0]
    from loopprobe import plots

    predicted = plots.predicted_slopes(list(cfg.norms))
    slopes = []
    for norm, sub in bound.groupby("norm", sort=False):
        C = sub["C"]
        slopes.append(
            {
                "scheme": norm,
                "fitted slope of ‖ΔF‖": loglog_slope(sub.R, sub.dF_true),
                "predicted slope": predicted.get(norm, math.nan),
                "κ_R slope": loglog_slope(sub.R, sub.kappa),
                "C max/min": float(C.max() / C.min()),
            }
        )
    slopes = pd.DataFrame(slopes)
    label = {"kappa": "κ_R", "dF_true": "‖ΔF‖/‖F‖", "C": "C"}
    wide = bound.pivot(index="R", columns="norm", values=list(label))
    wide = wide[[(a, n) for a in label for n in cfg.norms if (a, n) in wide.columns]]
    wide.columns = [f"{label[a]} {n}" for a, n in wide.columns]
    wide = wide.reset_index()
    q = f"norm == '{show}' and R == {Rmax}"
    res = Result(
        frames={"bound": bound, "visits": visits, "cosines": cos, "slopes": slopes},
        tables=[
            (
                "Bound check per (scheme, R): one SGD step on the looped sublayers "
                f"(lr {cfg.lr:g}), K = {cfg.K}",
                bound,
            ),
            ("Fitted log-log slopes in R vs the prediction (aligned visits)", slopes),
        ],
        summary=wide,
        values={
            "rows": bound.to_dict("records"),
            "slopes": slopes.to_dict("records"),
            "failed_cells": failed[["norm", "R", "error"]].to_dict("records"),
            "verdicts": [v.to_dict() for v in alignment_verdicts(bound, slopes)],
            "converged": bool(bound.converged.all()),
            "reason": "; ".join(
                f"{r.norm} R={r.R}: {r.reason}" for r in bound[~bound.converged].itertuples()
            ),
        },
        figures=[
            Fig(
                "alignment_kappa",
                "Measured κ_R vs R per scheme, between κ_R = 1 "
                "(decorrelated visits) and κ_R = R (aligned).",
                "bound",
                "kappa_vs_R",
            ),
            Fig(
                "alignment_delta_f",
                "Measured ‖ΔF‖/‖F‖ after one SGD step vs R; dashed: the "
                "predicted slope (seed 002, Eq. 14, aligned).",
                "bound",
                "delta_f_vs_R",
                {"y": "dF_true"},
            ),
            Fig(
                "alignment_visit_norms",
                f"Per-visit ‖U_r,j‖ and ‖G_r,j‖, {show}, R = {Rmax}.",
                "visits",
                "visit_norms",
                {},
                q,
            ),
            Fig(
                "alignment_cosines",
                f"Visit cosines of G_·,j, {show}, R = {Rmax}: near 1 off "
                "the diagonal means aligned visits.",
                "cosines",
                "visit_cosines",
                {},
                q,
            ),
        ],
    )
    res.tables.insert(0, ("κ_R, ‖ΔF‖/‖F‖ and C per R", wide))
    if len(failed):
        res.notes.append(
            f"{len(failed)} cell(s) failed: "
            + "; ".join(f"{r.norm} R={r.R}: {r.error}" for r in failed.itertuples())
        )
    return res


def _alignment_user(ctx: Context) -> Result:
    from loopprobe.estimate.alignment import visit_alignment
    from loopprobe.estimate.bound import bound_check

    u = ctx.user
    notes = [f"loss: {u.loss_name}"]
    with loopprobe.attach(u.model) as probe:
        with refusal_is_skip():
            rep = visit_alignment(
                probe,
                u.inputs,
                u.loss_fn,
                forward=u.forward,
                output=u.output,
                max_iter=ctx.cfg.power_iters,
                tol=1e-4,
            )
        values: dict[str, Any] = {"kappa": rep.kappa, "M": rep.M, "M_g": rep.M_g}
        try:
            with refusal_is_skip():
                chk = bound_check(
                    probe,
                    u.inputs,
                    u.loss_fn,
                    forward=u.forward,
                    output=u.output,
                    alpha=u.alpha,
                    beta=u.beta,
                    report=rep,
                )
            values.update(chk.to_dict())
        except Skip as why:
            notes.append(f"bound check skipped: {why} (loopprobe report: --alpha and --beta)")
    cos = pd.DataFrame(
        [
            {"sublayer": name, "r": r, "s": s, "cosine": float(m[r, s])}
            for name, c in rep.cos_G.items()
            for m in [c.detach().cpu().numpy()]
            for r in range(m.shape[0])
            for s in range(m.shape[1])
        ]
    )
    figs = [Fig("alignment_visit_norms", "Per-visit ‖U_r,j‖ and ‖G_r,j‖.", "visits", "visit_norms")]
    if len(cos):
        figs.append(Fig("alignment_cosines", "Visit cosines of G_·,j.", "cosines", "visit_cosines"))
    summary = pd.DataFrame(
        [{k: values[k] for k in ("kappa", "M", "M_g", "dF_true", "prediction", "C") if k in values}]
    )
    return Result(
        frames={"sublayers": rep.sublayers, "visits": rep.visits, "cosines": cos},
        tables=[("κ_j per physical sublayer", rep.sublayers)],
        figures=figs,
        summary=summary,
        values=values,
        notes=notes,
    )
