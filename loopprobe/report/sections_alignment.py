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
    slopes = theory.predicted_slopes(norms)
    summary = pd.DataFrame(
        [
            {
                "scheme": n,
                "p": theory.scales(1, n).p,
                "slope in R (aligned)": slopes.get(n, math.nan),
                "slope in R (decorrelated)": theory.predicted_slopes([n], 0.0).get(n, math.nan),
            }
            for n in norms
        ]
    )
    res = Result(
        frames={"bounds": df},
        tables=[("Closed forms (DeepLoop, Eqs. 5-16)", df)],
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
                    "title": "Predicted bound vs R (DeepLoop, Eq. 14)",
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
            probe, idx, _lm_loss(targets), lr=c["lr"], max_iter=c["power_iters"],
            tol=report_tol(model), narrow=c["d_model"] >= NARROW_FROM_D,
        )  # fmt: skip
    rep = chk.report
    bound = {k: v for k, v in chk.to_dict().items()}
    bound["U_converged"] = float(rep.visits["converged"].astype(float).mean())
    rows = [{"table": "bound", **bound}]
    rows += [{"table": "visit", **r} for r in rep.visits.to_dict("records")]
    rows += [{"table": "cosine", **r} for r in cosine_rows(rep.cos_G)]
    bad = [k for k in ("kappa", "dF_true", "dF_first") if not math.isfinite(bound[k])]
    for row in rows:
        row["diverged"] = bool(bad)
        row["error"] = f"non-finite {', '.join(bad)}" if bad else None
    return rows


_alignment_cell.version = f"{loopprobe.__version__}-4"  # kappa at report_tol, narrow by size

#: Width from which the cells run κ's operators in groups by visit (``narrow``, the
#: default); below it all in one batch, each product over every visit (``narrow=False``:
#: the same certified bound, more arithmetic in fewer calls). Measured, one thread, the
#: report's cells (seq 16, batch 4; benchmarks/bench_report_kappa.py): at d 32 the eight
#: cells took 8.2 CPU-s in one batch against 13.0 grouped and 9.8 grouped with warm visits;
#: at d 64 (R 4, 8) 15.4 in one batch against 12.4 for the default there (grouped, warm).
NARROW_FROM_D = 64


def report_tol(model: torch.nn.Module) -> float | None:
    """kappa's error bound in the report: 1e-4 for a float64 model (its default 1e-6 costs
    more than a report needs), else the dtype's default (1e-3 in float32: a 1e-4 bound is
    below float32 roundoff from R 2 on: the reference cells ended at bounds of 1.1e-4 to
    4e-4 and were marked not converged)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return 1e-4 if dtypes == {torch.float64} else None


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
    predicted = theory.predicted_slopes(list(cfg.norms))
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
                "predicted slope (DeepLoop, Eq. 14, aligned).",
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


def cosine_rows(cos_G: dict[str, torch.Tensor]) -> list[dict]:
    """The visit-cosine matrices of an alignment report as long rows (sublayer, r, s)."""
    rows = []
    for name, cos in cos_G.items():
        m = cos.detach().cpu().numpy()
        rows += [
            {"sublayer": name, "r": r, "s": s, "cosine": float(m[r, s])}
            for r in range(m.shape[0])
            for s in range(m.shape[1])
        ]
    return rows


def run_alignment(
    model: torch.nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    forward: Callable | None = None,
    output: Callable | None = None,
    sublayers: list[str] | None = None,
    exclude: list[str] | None = None,
    update: str = "sgd",
    max_iter: int = 100,
    tol: float | None = None,
    seed: int = 0,
    bound: dict[str, Any] | None = None,
) -> tuple[Any, Any]:
    """κ_R of a model, as ``loopprobe kappa`` and the report's alignment section run it.

    ``lp.visit_alignment`` on ``lp.attach(model, sublayers, exclude=exclude)``; with
    ``bound`` (``bound_check``'s keywords, e.g. ``alpha``, ``beta``) also ``lp.bound_check``
    on the same probe and report. Returns ``(report, check)``; ``check`` is ``None``
    without ``bound`` and the :class:`Skip` saying why when loopprobe refuses the check.
    """
    from loopprobe.estimate.alignment import visit_alignment
    from loopprobe.estimate.bound import bound_check

    how = dict(forward=forward, output=output)
    with loopprobe.attach(model, sublayers, exclude=exclude) as probe:
        rep = visit_alignment(
            probe, inputs, loss_fn, **how, update=update, max_iter=max_iter, tol=tol,
            generator=torch.Generator().manual_seed(seed), seed=seed,
        )  # fmt: skip
        if bound is None:
            return rep, None
        try:
            with refusal_is_skip():
                return rep, bound_check(probe, inputs, loss_fn, **how, **bound, report=rep)
        except Skip as why:
            return rep, why


def _alignment_user(ctx: Context) -> Result:
    u = ctx.user
    with refusal_is_skip():
        rep, chk = run_alignment(
            u.model, u.inputs, u.loss_fn, forward=u.forward, output=u.output,
            sublayers=u.sublayers, exclude=u.exclude, max_iter=ctx.cfg.power_iters,
            tol=report_tol(u.model),
            seed=ctx.cfg.seed, bound=dict(alpha=u.alpha, beta=u.beta),
        )  # fmt: skip
    values: dict[str, Any] = {"kappa": rep.kappa, "M": rep.M, "M_g": rep.M_g}
    notes = [f"loss: {getattr(u.loss_fn, 'used', None) or u.loss_name}"]  # the rule's pick
    kappas = rep.sublayers.dropna(subset=["kappa"])
    if len(kappas):  # κ_R is the largest κ_j: say whose
        top = str(kappas.loc[kappas.kappa.idxmax(), "sublayer"])
        values["kappa_sublayer"] = top
        notes.append(f"κ_R = {rep.kappa:.4g}: the largest κ_j over sublayers, of {top}")
    if isinstance(chk, Skip):
        notes.append(f"bound check skipped: {chk} (loopprobe report: --alpha and --beta)")
    else:
        values.update(chk.to_dict())
    cos = pd.DataFrame(cosine_rows(rep.cos_G))
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
