"""Section ``fixedpoint``: reachability, ρ(∂T/∂h) and ‖dh*/dx‖ of one round per recall variant."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pandas as pd
import torch
from torch import nn
from tqdm import tqdm

from loopprobe._io import call_user
from loopprobe.differentiate.roundmap import RoundMap, round_map
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
    step = None
    if ctx.user is not None:
        m, step = ctx.user.model, ctx.user.step
        if step is None and not (
            callable(getattr(m, "step", None)) and callable(getattr(m, "embed", None))
        ):
            raise Skip(
                f"needs the round map: {type(m).__name__} has no step(h, x) and "
                "embed(inputs) methods (see docs/models-api.md); pass --step pkg.mod:fn "
                "returning lp.replay_round(model, inputs, 'block')"
            )
        idx = ctx.user.inputs
        if step is None and isinstance(idx, tuple):
            idx = idx[0]  # model.embed takes the token ids
        # a float64 copy: probing never changes the user's model
        models, how = [("your model", copy.deepcopy(m))], "your model as given, float64 copy"
        if step is not None:
            how += f", round map from --step {getattr(step, '__name__', step)}"
    else:
        models, idx, how = _fixedpoint_models(cfg)
    traces, eig, rows = [], [], []
    for name, model in tqdm(models, desc="fixed points", disable=not ctx.progress, leave=False):
        row, trace, ev = _probe_round(name, model.double(), _double(idx), cfg, step)
        rows.append(row)
        traces.append(trace)
        eig.append(ev)
    table = pd.DataFrame(rows)
    notes = [f"models: {how}", RHO_NOTE]
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


RHO_NOTE = (
    "ρ(∂T/∂h) is measured at the state named in 'ρ at': the fixed point when one was reached, "
    "else the last iterate of the method that got furthest (Anderson or Picard), on a float64 "
    "copy. The health section's ρ is at its own Picard state in the model's dtype; where no "
    "fixed point exists the two are taken at different states and may differ"
)


def _double(x: Any) -> Any:
    """Floating tensors in ``x`` as float64 (the probe runs on a float64 copy)."""
    if isinstance(x, torch.Tensor):
        return x.double() if x.is_floating_point() else x
    if isinstance(x, (tuple, list)):
        return type(x)(_double(v) for v in x)
    if isinstance(x, dict):
        return {k: _double(v) for k, v in x.items()}
    return x


def round_map_of(model: nn.Module, inputs: Any, step: Callable | None = None) -> RoundMap:
    """The round map of ``model`` at ``inputs``: ``step(model, inputs)`` (the user's
    ``--step``, called like :func:`loopprobe.round_map`) or ``lp.round_map(model, inputs)``."""
    if step is None:
        return round_map(model, inputs)
    name = getattr(step, "__name__", "step")
    rm = call_user(step, "--step", f"--step:{name}", model, inputs)
    if not isinstance(rm, RoundMap):
        raise TypeError(
            f"--step: {getattr(step, '__name__', 'the function')}(model, inputs) returned a "
            f"{type(rm).__name__}, not an lp.RoundMap; return lp.replay_round(model, inputs, "
            "'block') or lp.RoundMap(step=lambda h, x: ..., x=x, h0=h0, rounds=R)"
        )
    return rm


def probe_round(
    rm: RoundMap,
    *,
    methods: tuple[str, ...] = ("picard",),
    tol: float = 1e-6,
    max_iter: int = 200,
    k: int = 6,
    seed: int = 0,
    norm: dict | None = None,
    dependence: dict | None = None,
) -> dict[str, Any]:
    """Every fixed-point diagnostic of one round map, as ``loopprobe fixed-point`` and this
    section run them: ``fixed_point`` per method (the first that converges is ``fp``), then
    at its state ``spectral_radius``, ``jacobian_norm`` (``norm``: its keywords),
    ``input_dependence`` where the fixed point was reached (``dependence``: its keywords;
    else ``None``) and ``round_residuals`` after the model's R rounds (``None`` without R).
    """
    gen = torch.Generator().manual_seed(seed)
    runs = {m: fixed_point(rm.T, rm.h0, tol=tol, max_iter=max_iter, method=m) for m in methods}
    fp = next((r for r in runs.values() if r.converged), runs[methods[-1]])
    out: dict[str, Any] = {"runs": runs, "fp": fp, "dep": None, "rr": None}
    out["sr"] = spectral_radius(rm.T, fp.h, k=k, generator=gen)
    out["jn"] = jacobian_norm(rm.T, fp.h, generator=gen, **(norm or {}))
    if fp.converged:
        dep = dependence or {}
        out["dep"] = input_dependence(rm.step, fp.h, rm.x, rounds=rm.rounds, generator=gen, **dep)
    if rm.rounds is not None:
        h_star = fp.h if fp.converged else None
        out["rr"] = round_residuals(rm.T, rm.h0, rm.rounds, h_star=h_star)
    return out


def _probe_round(name: str, model: nn.Module, idx: Any, cfg: ReportConfig, step=None):
    """One variant: Picard and Anderson traces, spectrum, norm, input-dependence, R rounds."""
    p = probe_round(
        round_map_of(model, idx, step), methods=("picard", "anderson"), max_iter=cfg.fp_max_iter,
        seed=cfg.seed, norm=dict(max_iter=50, tol=1e-6),
        dependence=dict(max_iter=30, norm_tol=1e-4, tol=1e-8),
    )  # fmt: skip
    fp, sr, jn, dep, rr = p["fp"], p["sr"], p["jn"], p["dep"], p["rr"]
    trace = pd.concat(
        [run.to_frame().assign(variant=f"{name} ({meth})") for meth, run in p["runs"].items()],
        ignore_index=True,
    )
    row = {
        "variant": name,
        "converged": fp.converged,
        "method": fp.method,
        "iterations": fp.iterations,
        "rate": fp.rate,
        "ρ(∂T/∂h)": sr.value,
        "ρ converged": sr.converged,
        "ρ at": "the fixed point" if fp.converged else f"the last {fp.method} iterate",
        "‖∂T/∂h‖": jn.value,
    }
    if dep is not None:
        row.update(
            {
                "‖dh*/dx‖ implicit": dep.value,
                "‖dh_R/dx‖ unrolled": dep.unrolled.value if dep.unrolled else math.nan,
                "dh/dx converged": dep.converged,
            }
        )
    if rr is not None:
        row.update({"residual after R rounds": rr.residual, "distance to h*": rr.distance})
    row["reason"] = fp.reason
    return row, trace, sr.to_frame().assign(variant=name)
