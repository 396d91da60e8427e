"""Section ``fixedpoint``: reachability, ρ(∂T/∂h) and ‖dh*/dx‖ of one round per recall variant."""

from __future__ import annotations

import copy
import math

import pandas as pd
import torch
from torch import nn
from tqdm import tqdm

from loopprobe.differentiate.roundmap import round_map
from loopprobe.estimate.fixedpoint import (
    fixed_point,
    jacobian_norm,
    round_residuals,
    spectral_radius,
)
from loopprobe.estimate.implicit import input_dependence
from loopprobe.experiments import recall as study
from loopprobe.report.config import Context, Fig, ReportConfig, Result, Skip
from loopprobe.report.verdicts import fixedpoint_verdicts


def _fixedpoint_models(cfg: ReportConfig) -> tuple[list[tuple[str, nn.Module]], torch.Tensor, str]:
    """The recall variants, trained briefly on ``cfg.fp_task``."""
    size = dict(seq_len=cfg.fp_seq_len, d_model=cfg.fp_d_model, n_heads=4, R=cfg.fp_R)
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
        row, trace, ev = _probe_round(name, model.double(), idx, cfg)
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
        values={
            "variants": table.to_dict("records"),
            "models": how,
            "verdicts": [v.to_dict() for v in fixedpoint_verdicts(table)],
        },
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


def _probe_round(name: str, model: nn.Module, idx: torch.Tensor, cfg: ReportConfig):
    """One variant: Picard and Anderson traces, spectrum, norm, input-dependence, R rounds."""
    rm = round_map(model, idx)
    gen = torch.Generator().manual_seed(cfg.seed)
    runs = {
        meth: fixed_point(rm.T, rm.h0, tol=1e-6, max_iter=cfg.fp_max_iter, method=meth)
        for meth in ("picard", "anderson")
    }
    fp = runs["picard"] if runs["picard"].converged else runs["anderson"]
    trace = pd.concat(
        [run.to_frame().assign(variant=f"{name} ({meth})") for meth, run in runs.items()],
        ignore_index=True,
    )
    sr = spectral_radius(rm.T, fp.h, k=6, generator=gen)
    jn = jacobian_norm(rm.T, fp.h, generator=gen, max_iter=50, tol=1e-6)
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
        dep = input_dependence(
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
        rr = round_residuals(rm.T, rm.h0, rm.rounds, h_star=fp.h if fp.converged else None)
        row.update({"residual after R rounds": rr.residual, "distance to h*": rr.distance})
    row["reason"] = fp.reason
    return row, trace, sr.to_frame().assign(variant=name)
