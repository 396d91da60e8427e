"""The report: diagnostics -> tidy frames -> figures -> ``index.html``, ``results.json``, CSVs.

A report is a list of :class:`Section` objects. Each section is one function
``run(ctx) -> Result``: it measures (through the library's estimators and
:func:`loopprobe.sweep`), returns tidy frames, the figures drawn from them by
:mod:`loopprobe.plots`, a short summary table for the terminal and the numbers for
``results.json``. A section that does not apply to the model raises :class:`Skip` with
the reason; one that fails is reported as failed and the others still run. Adding a
section is adding one function and one entry in :data:`SECTIONS`.

Without a user model every section runs on the reference
:class:`~loopprobe.models.LoopedGPT` (:class:`ReportConfig`, sized for 2 CPU cores):

- ``theory``: α, β, β/α and the predicted bound for DeepNorm vs DeepLoop (seed 002);
- ``visits``: physical sublayers and visits found on the model, M and M_g vs 2KR;
- ``alignment``: κ_R and the bound check over R per scheme, fitted vs predicted slopes;
- ``increments``: growth of ‖h_N − h_0‖/‖h_0‖ over N per residual rule and tying;
- ``coordcheck``: mup-style coordinate check across N after a few Adam steps;
- ``fixedpoint``: reachability, ρ(∂T/∂h) and ‖dh*/dx‖ for recall variants trained briefly.

Example::

    from loopprobe.report import ReportConfig, run_report
    summary = run_report("loopprobe-report", ReportConfig.quick())
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import html
import inspect
import json
import math
import os
import pathlib
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from torch import nn
from tqdm import tqdm

import loopprobe
from loopprobe import plots, tasks, theory
from loopprobe.cli._common import load_object, to_jsonable
from loopprobe.sweeps import grid, sweep

__all__ = [
    "Context",
    "Fig",
    "ReportConfig",
    "Result",
    "SECTIONS",
    "Section",
    "Skip",
    "UserModel",
    "check_out_dir",
    "load_user_model",
    "run_report",
]


# ---------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class ReportConfig:
    """Sizes of the embedded default run (reference LoopedGPT, random-token LM batch)."""

    vocab_size: int = 64
    seq_len: int = 16
    d_model: int = 32
    n_heads: int = 4
    batch: int = 4
    K: int = 2  # physical blocks in the alignment sweep
    Rs: tuple[int, ...] = (1, 2, 4, 8)  # rounds in the alignment sweep
    norms: tuple[str, ...] = ("deepnorm", "deeploop")
    lr: float = 1e-3  # SGD step of the bound check
    power_iters: int = 30  # power iterations per ||U|| estimate
    Ns: tuple[int, ...] = (1, 2, 4, 8, 16, 32)  # loop counts of the growth sweep
    rules: tuple[str, ...] = ("1/sqrt(N)", "1/N")
    tyings: tuple[str, ...] = ("tied", "untied")
    seeds: tuple[int, ...] = (0, 1, 2)
    cc_schemes: tuple[str, ...] = ("pre:1/sqrt(N)", "pre:1/N")  # coordinate check
    cc_Ns: tuple[int, ...] = (1, 2, 4, 8, 16)
    cc_steps: int = 3
    fp_R: int = 4  # rounds of the fixed-point model (one block, its own size)
    fp_d_model: int = 32
    fp_seq_len: int = 16
    fp_variants: tuple[tuple[str, bool], ...] = (("add", True), ("none", True))
    fp_task: str = "prefix_sums"  # trained on briefly before the fixed-point probe
    fp_train_steps: int = 40
    fp_max_iter: int = 200
    seed: int = 0

    @classmethod
    def quick(cls) -> ReportConfig:
        """A smaller run for tests and a first look (about half a minute on 2 cores)."""
        return cls(
            seq_len=8,
            d_model=16,
            n_heads=2,
            batch=2,
            Rs=(1, 2, 4),
            power_iters=10,
            Ns=(1, 2, 4, 8),
            seeds=(0,),
            cc_Ns=(1, 2, 4, 8),
            cc_steps=2,
            fp_max_iter=100,
        )


@dataclass
class UserModel:
    """A user's model from ``--model pkg.mod:factory`` (and optionally inputs and loss)."""

    spec: str
    model: nn.Module
    inputs: Any
    loss_fn: Callable[[Any, Any], torch.Tensor]
    loss_name: str
    inputs_spec: str | None = None
    loss_spec: str | None = None
    output: Callable[[Any], torch.Tensor] | None = None  # picks F; default first_tensor


@dataclass
class Context:
    """What every section gets: the config or the user's model, where to cache, progress."""

    cfg: ReportConfig
    user: UserModel | None = None
    cache_dir: pathlib.Path | None = None
    progress: bool = True
    rerun: str = "loopprobe report"  # the command that recomputes a section (+ --sections)


@dataclass
class Fig:
    """A figure, the frame it is drawn from and the one-line call that redraws it.

    The figure is built from ``frame`` (a key of ``Result.frames``, saved as CSV), filtered
    by the pandas ``query`` if given, with ``plots.<plot>(df, **kwargs)``; the HTML shows
    exactly that call, so re-plotting never recomputes.
    """

    name: str
    caption: str
    frame: str
    plot: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    query: str | None = None


@dataclass
class Result:
    """What a section returns (see the module docstring)."""

    frames: dict[str, pd.DataFrame] = field(default_factory=dict)
    figures: list[Fig] = field(default_factory=list)
    tables: list[tuple[str, pd.DataFrame]] = field(default_factory=list)
    summary: pd.DataFrame | None = None
    values: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


class Skip(Exception):  # noqa: N818 - a signal, not an error
    """Raised by a section that does not apply; the message says why."""


@dataclass(frozen=True)
class Section:
    key: str
    title: str
    question: str
    run: Callable[[Context], Result]


# ------------------------------------------------------------------------------- helpers


def _gpt(cfg: ReportConfig, **over: Any) -> nn.Module:
    from loopprobe.models import GPTConfig, LoopedGPT

    base = dict(
        vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, d_model=cfg.d_model, n_heads=cfg.n_heads
    )
    seed = over.pop("seed", cfg.seed)
    return LoopedGPT(GPTConfig(**{**base, **over}), generator=torch.Generator().manual_seed(seed))


def _batch(cfg: ReportConfig, seed: int = 10_000) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return tasks.random_tokens(cfg.batch, cfg.seq_len, cfg.vocab_size, gen)


def _lm_loss(targets: torch.Tensor) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    def loss(logits: torch.Tensor, _inputs: Any) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return loss


def first_tensor(out: Any) -> torch.Tensor:
    """The output F of a model: the tensor itself, ``.logits``, ``["logits"]`` or the first."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(getattr(out, "logits", None), torch.Tensor):
        return out.logits
    if isinstance(out, dict):
        if isinstance(out.get("logits"), torch.Tensor):
            return out["logits"]
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        for v in out:
            if isinstance(v, torch.Tensor):
                return v
    raise TypeError(f"report: the model returned {type(out).__name__} with no tensor in it")


def _mean_square(output: Callable[[Any], torch.Tensor]) -> Callable[[Any, Any], torch.Tensor]:
    """The default loss for a user's model: ``0.5 * mean(F^2)``, F picked by ``output``."""

    def loss(out: Any, _inputs: Any) -> torch.Tensor:
        return 0.5 * output(out).pow(2).mean()

    return loss


def _fmt(v: Any) -> str:
    if isinstance(v, (float, np.floating)):
        return "—" if not math.isfinite(v) else f"{v:.4g}"
    return str(v)


def _cfg_attr(model: nn.Module, *names: str) -> dict[str, Any] | None:
    cfg = getattr(model, "cfg", None)
    if cfg is None or not all(hasattr(cfg, n) for n in names):
        return None
    return {n: getattr(cfg, n) for n in names}


def _need(module: str, issue: int) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise Skip(f"{module} is not available in this install ({err}; issue {issue})") from err


# ---------------------------------------------------------------------------- sections


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
    try:
        with loopprobe.attach(model) as probe:
            table = probe.visit_table(inputs, output=output)
    except ValueError as err:
        raise Skip(str(err)) from err
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
    from loopprobe.alignment import bound_check

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


_alignment_cell.version = f"{loopprobe.__version__}-1"
_CFG_FIELDS = {f.name for f in dataclasses.fields(ReportConfig)}


def _split(df: pd.DataFrame, table: str) -> pd.DataFrame:
    part = df[df["table"] == table].drop(columns="table")
    return part.dropna(axis=1, how="all").reset_index(drop=True)


def alignment_section(ctx: Context) -> Result:
    """κ_R and the bound check over R per scheme (default) or κ_j on the user's model."""
    _need("loopprobe.alignment", 3)
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
    cols = "kappa M M_g alpha beta dF_first dF_true prediction C U_converged".split()
    bound = _split(df, "bound")[keys + cols]
    visits, cos = _split(df, "visit"), _split(df, "cosine")
    Rmax, show = max(cfg.Rs), cfg.norms[0]
    predicted = plots.predicted_slopes(list(cfg.norms))
    slopes = []
    for norm, sub in bound.groupby("norm", sort=False):
        C = sub["C"]
        slopes.append(
            {
                "scheme": norm,
                "fitted slope of ‖ΔF‖": plots.loglog_slope(sub.R, sub.dF_true),
                "predicted slope": predicted.get(norm, math.nan),
                "κ_R slope": plots.loglog_slope(sub.R, sub.kappa),
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
    from loopprobe.alignment import bound_check, visit_alignment

    u = ctx.user
    notes = [f"loss: {u.loss_name}"]
    with loopprobe.attach(u.model) as probe:
        try:
            rep = visit_alignment(
                probe,
                u.inputs,
                u.loss_fn,
                output=u.output,
                max_iter=ctx.cfg.power_iters,
                tol=1e-4,
            )
        except ValueError as err:
            raise Skip(str(err)) from err
        values: dict[str, Any] = {"kappa": rep.kappa, "M": rep.M, "M_g": rep.M_g}
        try:
            chk = bound_check(probe, u.inputs, u.loss_fn, output=u.output, report=rep)
            values.update(chk.to_dict())
        except ValueError as err:
            notes.append(f"bound check skipped: {err}")
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


_GROWTH_PREDICTION = {
    ("tied", "1/sqrt(N)"): 0.5,
    ("tied", "1/N"): 0.0,
    ("untied", "1/sqrt(N)"): 0.0,
    ("untied", "1/N"): -0.5,
}


def increments_section(ctx: Context) -> Result:
    """Growth of ‖h_N − h_0‖/‖h_0‖ over N per residual rule and tying; increment cosines."""
    inc = _need("loopprobe.increments", 4)
    if ctx.user is not None:
        return _increments_user(ctx, inc)
    cfg = ctx.cfg
    frames, rows = [], []
    size = dict(
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        seq_len=cfg.seq_len,
        batch=cfg.batch,
        vocab_size=cfg.vocab_size,
    )
    for tying in cfg.tyings:
        for rule in cfg.rules:
            g = inc.reference_growth(
                tying,
                rule,
                Ns=list(cfg.Ns),
                seeds=list(cfg.seeds),
                cache_dir=ctx.cache_dir,
                progress=ctx.progress,
                **size,
            )
            frames.append(g.rows)
            rows.append(
                {
                    "tying": tying,
                    "residual": rule,
                    "growth slope": g.slope,
                    "predicted": _GROWTH_PREDICTION.get((tying, rule), math.nan),
                    "mean off-diag cos": g.mean_offdiag_cos,
                    "regime": g.regime,
                }
            )
    growth = pd.concat(frames, ignore_index=True)
    summary = pd.DataFrame(rows)
    Nshow = min(8, max(cfg.Ns))
    model = _gpt(cfg, K=1, R=Nshow, norm="pre", residual=cfg.rules[0])
    one = inc.increments(model, _batch(cfg)[0], forward=inc.start_at_rms(1.0))
    cos = one.cosine_frame()
    keep = [
        "tying",
        "residual",
        "N",
        "seed",
        "growth",
        "mean_offdiag_cos",
        "mean_ratio",
        "hN_rms",
        "regime",
        "diverged",
        "error",
    ]
    growth = growth[[c for c in keep if c in growth.columns]]
    return Result(
        frames={"growth": growth, "cosines": cos, "regimes": summary},
        tables=[("Growth exponent of ‖h_N − h_0‖/‖h_0‖ in N, pre-norm, at init", summary)],
        summary=summary,
        values={"regimes": summary.to_dict("records")},
        figures=[
            Fig(
                "increments_growth",
                "‖h_N − h_0‖/‖h_0‖ vs N per residual rule (colour) and "
                "tying (line style); dashed: slopes ½ and 0.",
                "growth",
                "increment_growth",
            ),
            Fig(
                "increments_cosines",
                f"Increment cosines across the N = {Nshow} visits of the "
                f"shared block under {cfg.rules[0]}.",
                "cosines",
                "visit_cosines",
                {"title": "Increment cosines cos(inc_r, inc_s)"},
            ),
        ],
    )


def _increments_user(ctx: Context, inc: Any) -> Result:
    u = ctx.user
    try:
        one = inc.increments(u.model, u.inputs)
    except (ValueError, TypeError) as err:
        raise Skip(str(err)) from err
    groups = one.group_frame()
    return Result(
        frames={"groups": groups, "cosines": one.cosine_frame(), "visits": one.to_frame()},
        tables=[("Increment correlation per group of visits", groups)],
        summary=pd.DataFrame(
            [{k: v for k, v in one.summary().items() if isinstance(v, (int, float, str))}]
        ),
        values=one.summary(),
        notes=[
            "each looped sublayer's output is taken as its residual increment; if your "
            "sublayers return the updated stream, call lp.increments(model, inputs, "
            "increment='delta') from Python"
        ],
        figures=[
            Fig(
                "increments_cosines",
                "Increment cosines across visits.",
                "cosines",
                "visit_cosines",
                {"title": "Increment cosines cos(inc_r, inc_s)"},
            )
        ],
    )


def coordcheck_section(ctx: Context) -> Result:
    """mup-style coordinate check across N: ‖Δh_N‖ since step 0 per residual rule."""
    ccm = _need("loopprobe.coordcheck", 4)
    if ctx.user is not None:
        raise Skip(
            "needs a family of models over N (make_model(N, seed)); call "
            "lp.coord_check(make_model, batch_fn, probe_inputs) from Python"
        )
    cfg = ctx.cfg
    cc = ccm.reference_coord_check(
        list(cfg.cc_schemes),
        Ns=list(cfg.cc_Ns),
        seeds=list(cfg.seeds[:2]),
        steps=cfg.cc_steps,
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        seq_len=cfg.seq_len,
        batch=cfg.batch,
        cache_dir=ctx.cache_dir,
        progress=ctx.progress,
    )
    state = cc.plot_frame("state_change")
    incs = cc.plot_frame("increment_change", cfg.cc_schemes[-1])
    flat = cc.flatness("state_change")
    keep = ["scheme", "N", "seed", "step", "group", "value", "diverged"]
    return Result(
        frames={"state": state[keep], "increments": incs[keep], "flatness": flat},
        tables=[
            (
                f"Log-log slope in N of ‖Δh_N‖ (RMS change since step 0) after "
                f"{cfg.cc_steps} Adam steps; 0 = stable in N",
                flat,
            )
        ],
        summary=flat,
        values={"flatness": flat.to_dict("records"), "config": cc.config},
        figures=[
            Fig(
                "coordcheck_state",
                "RMS change of the final state h_N since step 0 vs N, "
                "per residual rule, one panel per Adam step: flat means N-stable.",
                "state",
                "coord_check",
                {
                    "hue": "scheme",
                    "ylabel": "RMS(h_N(t) − h_N(0))",
                    "title": "Coordinate check across N: final state",
                },
            ),
            Fig(
                "coordcheck_increments",
                "RMS change of the first and last visit's increment "
                f"since step 0 vs N under {cfg.cc_schemes[-1]}.",
                "increments",
                "coord_check",
                {
                    "ylabel": "RMS(inc(t) − inc(0))",
                    "title": f"Coordinate check: increments ({cfg.cc_schemes[-1]})",
                },
            ),
        ],
    )


def _fixedpoint_models(cfg: ReportConfig) -> tuple[list[tuple[str, nn.Module]], torch.Tensor, str]:
    """The recall variants, trained briefly on ``cfg.fp_task`` when the study module exists."""
    size = dict(seq_len=cfg.fp_seq_len, d_model=cfg.fp_d_model, n_heads=4, R=cfg.fp_R)
    try:
        from loopprobe import fixedpoint_study as study
    except ImportError:
        gen = torch.Generator().manual_seed(10_000)
        idx = tasks.random_tokens(1, cfg.fp_seq_len, cfg.vocab_size, gen)[0]
        fp_cfg = dataclasses.replace(cfg, seq_len=cfg.fp_seq_len, d_model=cfg.fp_d_model)
        models = [
            (
                _variant(r, on),
                _gpt(fp_cfg, K=1, R=cfg.fp_R, n_heads=4, norm="pre", recall=r, outer_norm=on),
            )
            for r, on in cfg.fp_variants
        ]
        return models, idx, "untrained (loopprobe.fixedpoint_study is not available)"
    models = []
    for r, on in cfg.fp_variants:
        model, _ = study.train(cfg.fp_task, r, on, seed=cfg.seed, steps=cfg.fp_train_steps, **size)
        models.append((_variant(r, on), model))
    gen = torch.Generator().manual_seed(10_000)
    idx = study.task_batch(cfg.fp_task, 1, cfg.fp_seq_len, gen)[0]
    return models, idx, f"trained {cfg.fp_train_steps} AdamW steps on {cfg.fp_task}"


def _variant(recall: str, outer_norm: bool) -> str:
    return f"recall={recall}" + (", outer norm" if outer_norm else "")


def fixedpoint_section(ctx: Context) -> Result:
    """Reachability, ρ(∂T/∂h), ‖∂T/∂h‖ and ‖dh*/dx‖ of one round, per recall variant."""
    fpm = _need("loopprobe.fixedpoint", 5)
    cfg = ctx.cfg
    if ctx.user is not None:
        m = ctx.user.model
        if not (callable(getattr(m, "step", None)) and callable(getattr(m, "embed", None))):
            raise Skip(
                f"needs the round map: {type(m).__name__} has no step(h, x) and "
                "embed(inputs) methods (see docs/models-api.md)"
            )
        idx = ctx.user.inputs[0] if isinstance(ctx.user.inputs, tuple) else ctx.user.inputs
        # a float64 copy: probing never changes the user's model
        models, how = [("your model", copy.deepcopy(m))], "your model as given, float64 copy"
    else:
        models, idx, how = _fixedpoint_models(cfg)
    traces, eig, rows = [], [], []
    for name, model in tqdm(models, desc="fixed points", disable=not ctx.progress, leave=False):
        row, trace, ev = _probe_round(fpm, name, model.double(), idx, cfg)
        rows.append(row)
        traces.append(trace)
        eig.append(ev)
    table = pd.DataFrame(rows)
    notes = [f"models: {how}"]
    if not table["converged"].all():
        notes.append("input-dependence is measured only where the fixed point was reached")
    R = getattr(getattr(models[0][1], "cfg", None), "R", "?")
    return Result(
        frames={
            "residuals": pd.concat(traces, ignore_index=True),
            "eigenvalues": pd.concat(eig, ignore_index=True),
            "summary": table,
        },
        tables=[(f"Fixed point of one round (R = {R}, float64)", table)],
        summary=table.drop(columns=["reason"]),
        values={"variants": table.to_dict("records"), "models": how},
        notes=notes,
        figures=[
            Fig(
                "fixedpoint_residuals",
                "Residual ‖T(h_k) − h_k‖/‖h_k‖ of plain (Picard) and "
                "Anderson iteration of one round; a straight line is linear convergence at "
                "rate ρ.",
                "residuals",
                "fixed_point_residuals",
                {"tol": 1e-6},
            ),
            Fig(
                "fixedpoint_eigenvalues",
                "Top eigenvalues of ∂T/∂h at the reached state "
                "(Arnoldi on JVPs) against the unit circle.",
                "eigenvalues",
                "eigenvalues",
            ),
        ],
    )


def _probe_round(fpm: Any, name: str, model: nn.Module, idx: torch.Tensor, cfg: ReportConfig):
    """One variant: Picard and Anderson traces, spectrum, norm, input-dependence, R rounds."""
    rm = fpm.round_map(model, idx)
    gen = torch.Generator().manual_seed(cfg.seed)
    runs = {
        meth: fpm.fixed_point(rm.T, rm.h0, tol=1e-6, max_iter=cfg.fp_max_iter, method=meth)
        for meth in ("picard", "anderson")
    }
    fp = runs["picard"] if runs["picard"].converged else runs["anderson"]
    trace = pd.concat(
        [run.to_frame().assign(variant=f"{name} ({meth})") for meth, run in runs.items()],
        ignore_index=True,
    )
    sr = fpm.spectral_radius(rm.T, fp.h, k=6, generator=gen)
    jn = fpm.jacobian_norm(rm.T, fp.h, generator=gen, max_iter=50, tol=1e-6)
    row = {
        "variant": name,
        "converged": fp.converged,
        "method": fp.method,
        "iterations": fp.iterations,
        "rate": fp.rate,
        "ρ(∂T/∂h)": sr.value,
        "ρ converged": sr.converged,
        "‖∂T/∂h‖": jn.value,
    }
    if fp.converged:
        dep = fpm.input_dependence(
            rm.step,
            fp.h,
            rm.x,
            rounds=rm.rounds,
            generator=gen,
            max_iter=30,
            norm_tol=1e-4,
            tol=1e-8,
        )
        row.update(
            {
                "‖dh*/dx‖ implicit": dep.value,
                "‖dh_R/dx‖ unrolled": dep.unrolled.value if dep.unrolled else math.nan,
                "dh/dx converged": dep.converged,
            }
        )
    if rm.rounds is not None:
        rr = fpm.round_residuals(rm.T, rm.h0, rm.rounds, h_star=fp.h if fp.converged else None)
        row.update({"residual after R rounds": rr.residual, "distance to h*": rr.distance})
    row["reason"] = fp.reason
    return row, trace, sr.to_frame().assign(variant=name)


SECTIONS: list[Section] = [
    Section(
        "theory",
        "Theory: scales and predicted bounds",
        "What does seed 002 predict for DeepNorm vs DeepLoop as the loop count R grows?",
        theory_section,
    ),
    Section(
        "visits",
        "Visits: physical sublayers and their calls",
        "Which modules are reused, how often, and how many visits carry gradient?",
        visits_section,
    ),
    Section(
        "alignment",
        "Visit alignment κ_R and the tied-depth bound",
        "Are the visits of a shared sublayer aligned (κ_R ≈ R), and does ‖ΔF‖ follow "
        "M κ_R (β/α)² as R grows?",
        alignment_section,
    ),
    Section(
        "increments",
        "Forward increments and growth regimes",
        "Do shared-weight increments add up coherently, and which residual rule keeps "
        "‖h_N − h_0‖ flat in N?",
        increments_section,
    ),
    Section(
        "coordcheck",
        "Coordinate check across loop count N",
        "After a few Adam steps, do activation updates stay the same size as N grows "
        "(the looped analogue of mup's coord check)?",
        coordcheck_section,
    ),
    Section(
        "fixedpoint",
        "Fixed points of one round",
        "Does iterating one round reach a fixed point, how fast (ρ), and does it depend "
        "on the input?",
        fixedpoint_section,
    ),
]
"""The report's sections, in page order. Append a :class:`Section` to extend the report."""


# --------------------------------------------------------------------------- user's model


def _call_with_model(fn: Callable, model: nn.Module) -> Any:
    """``fn(model)`` when fn takes a required positional argument, else ``fn()``."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return fn(model)
    required = [
        p
        for p in params
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return fn(model) if required else fn()


def load_user_model(
    model_spec: str,
    inputs_spec: str | None = None,
    loss_spec: str | None = None,
    seed: int = 0,
    output_spec: str | None = None,
) -> UserModel:
    """Import and build a user's model, inputs and loss; one-line errors for bad specs.

    ``model_spec`` names a factory ``pkg.mod:fn`` returning an ``nn.Module``;
    ``inputs_spec`` a function ``fn(model)`` or ``fn()`` returning what the model is called
    with (a tensor or a tuple of positional arguments; default: random token ids when the
    model has ``cfg.vocab_size`` and ``cfg.seq_len``); ``loss_spec`` a function
    ``loss(output, inputs) -> scalar`` (default: half the mean square of the output F);
    ``output_spec`` a function ``output(out) -> Tensor`` picking F from what the model
    returns (default: the tensor, ``.logits``, ``["logits"]`` or the first tensor).
    """
    factory = load_object(model_spec, "--model")
    try:
        model = factory()
    except Exception as err:  # noqa: BLE001 - the user's code: report it in one line
        raise ValueError(
            f"--model {model_spec!r}: calling it raised {type(err).__name__}: {err}"
        ) from err
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"--model {model_spec!r} returned {type(model).__name__}, not a "
            "torch.nn.Module; the factory must build and return the model"
        )
    if inputs_spec is not None:
        fn = load_object(inputs_spec, "--inputs")
        try:
            inputs = _call_with_model(fn, model)
        except Exception as err:  # noqa: BLE001
            raise ValueError(
                f"--inputs {inputs_spec!r}: calling it raised {type(err).__name__}: {err}"
            ) from err
    else:
        c = _cfg_attr(model, "vocab_size", "seq_len")
        if c is None:
            raise ValueError(
                f"--model {model_spec!r}: the model has no cfg.vocab_size/seq_len, "
                "so its inputs cannot be guessed; pass --inputs package.module:fn"
            )
        gen = torch.Generator().manual_seed(10_000 + seed)
        inputs = tasks.random_tokens(2, c["seq_len"], c["vocab_size"], gen)[0]
    if isinstance(inputs, list):
        inputs = tuple(inputs)
    output = load_object(output_spec, "--output") if output_spec is not None else first_tensor
    if loss_spec is not None:
        loss_fn, loss_name = load_object(loss_spec, "--loss"), f"--loss {loss_spec}"
    else:
        loss_fn, loss_name = _mean_square(output), "½·mean(F²) of the output (pass --loss)"
    return UserModel(model_spec, model, inputs, loss_fn, loss_name, inputs_spec, loss_spec, output)


def check_out_dir(out: str | os.PathLike) -> pathlib.Path:
    """Create ``out`` and prove it writable, or raise ValueError naming it (before any work)."""
    path = pathlib.Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".loopprobe-write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise ValueError(
            f"--out {str(out)!r} is not a writable directory ({err.strerror or err}); "
            "pass --out with a directory you can write"
        ) from err
    return path


# ------------------------------------------------------------------------------- pipeline


def run_report(
    out: str | os.PathLike,
    cfg: ReportConfig | None = None,
    *,
    user: UserModel | None = None,
    sections: Sequence[str] | None = None,
    cache: bool = True,
    progress: bool = True,
    command: str | None = None,
    echo: Callable[[str], None] = print,
) -> dict:
    """Run the sections, write ``out/index.html``, ``results.json``, PNGs and CSVs.

    Returns the ``results.json`` object. ``sections`` picks keys of :data:`SECTIONS`
    (default all); ``cache`` keeps finished sweep cells in ``out/cache`` (reference runs
    only) so a rerun re-plots without recomputing; ``echo`` prints the terminal summary.
    """
    cfg = cfg or ReportConfig()
    keys = [s.key for s in SECTIONS]
    chosen = list(sections) if sections else keys
    unknown = [k for k in chosen if k not in keys]
    if unknown:
        raise ValueError(f"report: unknown section(s) {unknown}; choose from {keys}")
    outdir = check_out_dir(out)
    command = command or "loopprobe report"
    cache_dir = outdir / "cache" if cache and user is None else None
    ctx = Context(cfg, user, cache_dir, progress, rerun=_strip_sections(command))
    started = time.perf_counter()
    done: list[tuple[Section, str, Result | str, float]] = []
    todo = [s for s in SECTIONS if s.key in chosen]
    bar = tqdm(todo, desc="report", unit="section", disable=not progress)
    for section in bar:
        bar.set_postfix_str(section.key)
        t0 = time.perf_counter()
        try:
            res: Result | str = section.run(ctx)
            status = "ok"
        except Skip as why:
            res, status = str(why), "skipped"
        except Exception as err:  # noqa: BLE001 - one failing section must not lose the rest
            res, status = f"{type(err).__name__}: {err}", "failed"
        done.append((section, status, res, time.perf_counter() - t0))
    bar.close()
    results = _write(outdir, ctx, done, command, time.perf_counter() - started)
    echo(format_summary(done, results))
    return results


def _strip_sections(command: str) -> str:
    words = shlex.split(command)
    out, skip = [], False
    for w in words:
        if skip:
            skip = False
            continue
        if w == "--sections":
            skip = True
            continue
        if w.startswith("--sections="):
            continue
        out.append(w)
    return shlex.join(out)


def _write(outdir: pathlib.Path, ctx: Context, done: list, command: str, runtime: float) -> dict:
    """CSVs and PNGs per section, then results.json and index.html (rendered from those).

    A run of some sections (``--sections``) into a directory holding a report of the same
    model and config keeps the other sections' entries, so the page stays whole.
    """
    model = ctx.user.spec if ctx.user else "reference LoopedGPT (embedded default)"
    config = (
        dataclasses.asdict(ctx.cfg)
        if ctx.user is None
        else {"model": ctx.user.spec, "inputs": ctx.user.inputs_spec, "loss": ctx.user.loss_name}
    )
    config = to_jsonable(config)
    sections = {}
    if len(done) < len(SECTIONS):
        sections = _previous_sections(outdir, model, config)
    for section, status, res, secs in done:
        sections[section.key] = _write_section(outdir, ctx, section, status, res, secs)
    results = {
        "loopprobe_version": loopprobe.__version__,
        "command": ctx.rerun,
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "runtime_s": round(runtime, 2),
        "model": model,
        "out": str(outdir),
        "config": config,
        "sections": {s.key: sections[s.key] for s in SECTIONS if s.key in sections},
    }
    (outdir / "results.json").write_text(json.dumps(to_jsonable(results), indent=2))
    (outdir / "index.html").write_text(render_html(results, outdir))
    return results


def _previous_sections(outdir: pathlib.Path, model: str, config: Any) -> dict:
    """Entries of an earlier results.json in ``outdir`` for the same model and config."""
    try:
        old = json.loads((outdir / "results.json").read_text())
    except (OSError, ValueError):
        return {}
    if old.get("model") != model or old.get("config") != config:
        return {}
    return dict(old.get("sections", {}))


def _write_section(
    outdir: pathlib.Path,
    ctx: Context,
    section: Section,
    status: str,
    res: Result | str,
    secs: float,
) -> dict:
    """One section's files and its results.json entry."""
    entry: dict[str, Any] = {
        "title": section.title,
        "question": section.question,
        "status": status,
        "runtime_s": round(secs, 2),
    }
    if status != "ok":
        entry["reason"] = res
        return entry
    entry["csv"], entry["tables"] = {}, []
    for name, frame in res.frames.items():
        entry["csv"][name] = f"{section.key}_{name}.csv"
        frame.to_csv(outdir / entry["csv"][name], index=False)
    for i, (caption, table) in enumerate(res.tables):
        name = next((n for n, f in res.frames.items() if f is table), None)
        fname = entry["csv"][name] if name else f"{section.key}_table{i}.csv"
        if name is None:
            table.to_csv(outdir / fname, index=False)
        entry["tables"].append({"caption": caption, "csv": fname})
    entry["figures"] = [_draw(outdir, section, res, fig, entry, ctx) for fig in res.figures]
    entry["values"] = res.values
    entry["notes"] = res.notes
    return entry


def _draw(
    outdir: pathlib.Path, section: Section, res: Result, fig: Fig, entry: dict, ctx: Context
) -> dict:
    """Draw one Fig from its frame, save the PNG, and return its record with the commands."""
    frame = res.frames[fig.frame]
    df = frame.query(fig.query) if fig.query else frame
    png = f"{fig.name}.png"
    record = {"png": png, "caption": fig.caption, "csv": entry["csv"][fig.frame]}
    try:
        figure: Figure = getattr(plots, fig.plot)(df, **fig.kwargs)
        figure.savefig(outdir / png, dpi=110)
    except Exception as err:  # noqa: BLE001 - a bad figure is noted, the report goes on
        record.update(png=None, error=f"{type(err).__name__}: {err}")
        return record
    load = f"pd.read_csv({record['csv']!r})" + (f".query({fig.query!r})" if fig.query else "")
    args = "".join(f", {k}={v!r}" for k, v in fig.kwargs.items())
    record["replot"] = (
        f'python -c "import pandas as pd, loopprobe as lp; '
        f'lp.plots.{fig.plot}({load}{args}).savefig({png!r})"'
    )
    record["recompute"] = f"{ctx.rerun} --sections {section.key}"
    return record


# ------------------------------------------------------------------------------ rendering


def _text_table(df: pd.DataFrame) -> str:
    return df.to_string(index=False, formatters={c: _fmt for c in df.columns})


def format_summary(done: list, results: dict) -> str:
    """The terminal summary: one small table per section, then skipped/failed reasons."""
    lines = [f"loopprobe report — {results['model']}", ""]
    for section, status, res, secs in done:
        head = f"[{section.key}] {section.title} ({secs:.1f} s)"
        if status != "ok":
            lines += [f"{head}: {status.upper()}: {res}", ""]
            continue
        lines.append(head)
        if res.summary is not None and len(res.summary):
            lines += ["  " + ln for ln in _text_table(res.summary).splitlines()]
        if section.key == "alignment" and "slopes" in res.frames:
            lines += ["  " + ln for ln in _text_table(res.frames["slopes"]).splitlines()]
        lines += [f"  note: {n}" for n in res.notes]
        lines.append("")
    n_png = sum(
        1 for s in results["sections"].values() for f in s.get("figures", []) if f.get("png")
    )
    lines.append(
        f"wrote {results['out']}/index.html, results.json, {n_png} figures and CSVs "
        f"in {results['runtime_s']:.0f} s"
    )
    return "\n".join(lines)


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;max-width:1100px;margin:2em auto;
padding:0 1em;color:#222;line-height:1.45}
h1{margin-bottom:.2em} h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:2em}
.meta,.question{color:#555} .question{font-style:italic}
table.tbl{border-collapse:collapse;font-size:.85em;margin:.6em 0 1.2em}
table.tbl th,table.tbl td{border:1px solid #ddd;padding:.25em .6em;text-align:right}
table.tbl th{background:#f4f4f4} figure{margin:1em 0 2em} figure img{max-width:100%;
border:1px solid #eee} figcaption{font-size:.9em;color:#444}
code,pre{background:#f6f8fa;font-size:.8em} pre{padding:.5em;overflow-x:auto;white-space:pre-wrap}
.skipped{color:#8a6d3b} .failed{color:#a94442} nav a{margin-right:1em}
.scroll{overflow-x:auto}
"""


def _html_table(df: pd.DataFrame) -> str:
    return df.to_html(
        index=False,
        classes="tbl",
        border=0,
        na_rep="—",
        formatters={c: _fmt for c in df.columns},
        escape=True,
    )


def render_html(results: dict, outdir: pathlib.Path) -> str:
    """index.html from results.json and the CSVs: tables, linked PNGs, the commands."""
    e = html.escape
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>loopprobe report</title><style>{_CSS}</style></head><body>",
        "<h1>loopprobe report</h1>",
        f"<p class='meta'>{e(results['model'])} · loopprobe {e(results['loopprobe_version'])}"
        f" · {e(results['created'])}<br>reproduce everything: "
        f"<code>{e(results['command'])}</code> · data: <a href='results.json'>results.json</a>"
        "</p><nav>",
    ]
    parts += [f"<a href='#{key}'>{e(key)}</a>" for key in results["sections"]]
    parts.append("</nav>")
    for key, entry in results["sections"].items():
        parts += [
            f"<h2 id='{key}'>{e(entry['title'])}</h2>",
            f"<p class='question'>{e(entry.get('question', ''))}</p>",
        ]
        if entry["status"] != "ok":
            status = entry["status"]
            parts.append(f"<p class='{status}'><b>{status}</b>: {e(str(entry['reason']))}</p>")
            continue
        for table in entry["tables"]:
            parts += [
                f"<p><b>{e(table['caption'])}</b></p>",
                "<div class='scroll'>" + _html_table(pd.read_csv(outdir / table["csv"])) + "</div>",
            ]
        parts += [f"<p class='meta'>note: {e(note)}</p>" for note in entry["notes"]]
        for fig in entry["figures"]:
            parts.append(_html_figure(fig))
        csvs = " ".join(f"<a href='{e(f)}'>{e(f)}</a>" for f in entry["csv"].values())
        parts.append(f"<p class='meta'>tidy data: {csvs} · {entry['runtime_s']:.0f} s</p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _html_figure(fig: dict) -> str:
    e = html.escape
    if fig.get("png") is None:
        return f"<p class='failed'>figure failed: {e(fig['error'])}</p>"
    return (
        f"<figure><img src='{e(fig['png'])}' alt='{e(fig['caption'])}'>"
        f"<figcaption>{e(fig['caption'])}<pre>"
        f"# recompute the data:\n{e(fig['recompute'])}\n"
        f"# redraw from the saved CSV, no recompute:\n{e(fig['replot'])}</pre>"
        "</figcaption></figure>"
    )


def main_command(argv: Sequence[str] | None = None) -> str:
    """The command line as typed (for 'reproduce' lines)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return shlex.join(["loopprobe", *args])
