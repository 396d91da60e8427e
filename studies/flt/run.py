"""LT vs FLT at 12 loops with lp.instability recorded during training (issue 30.5).

The design, estimator and criteria are pre-registered in docs/studies/flt.md (committed
before any study cell ran). Pre-LN ``lp.models.LoopedGPT`` (the plain LT) and
``lp.models.FullyLoopedGPT`` (FLT), K = 2 physical blocks, R = 12 loops, d_model 32,
4 heads, seq 32, on byte-level lp.tasks.stdlib_text. Every cell trains a fresh model
(AdamW betas 0.9/0.95, linear warmup, then a constant lr, no clipping: instability is what
is measured) and, every ``every`` steps *before* that step's update, records the held-out
loss on fixed val batches, the global gradient norm, the per-round final-state RMS
(chained ``model.step``), and ``lp.instability`` on a fixed probe batch (per-sublayer mean
consecutive cosine, oscillating sublayers, per-round stream RMS). A seed fixes the init
(LT and FLT of one seed start from identical weights) and the data order. Cells are cached
one by one with lp.sweep in --cache (resumable, seed-major); the long CSV (one row per
cell and record step) is rewritten after every seed.

    nice -n 19 python -m studies flt --cache /work/cache/flt     # the study
    python -m studies flt --analyze          # tables + figure from the CSV, seconds
    python -m studies flt --pilot --cache /work/cache/flt_pilot  # the pilot
    python -m studies flt --quick --cache /tmp/fltq --out /tmp/fltq.csv   # smoke
    nice -n 19 python -m studies flt --design redesign-pilot   # issue 39.6 (redesign.py)

One torch thread; CPU seconds per cell are in the ``cpu_s`` column.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import pandas as pd
import torch

import loopprobe as lp
from loopprobe import tasks
from loopprobe.experiments.coordcheck import make_optimizer
from loopprobe.models import FullyLoopedGPT, GPTConfig, LoopedGPT
from studies import _common
from studies._common import evaluate, val_batches
from studies.flt import analysis as study

BASE = {"K": 2, "d": 32, "heads": 4, "seq": 32, "batch": 8, "eval_batches": 4, "every": 10,
        "warmup": 20}  # fmt: skip
STUDY = {"seed0": 100, "seeds": 5, "steps": 300, "lrs": "3e-3,1e-2,3e-2", "arms": "lt,flt",
         "Rs": "12", "out": _common.here(__file__, "flt_study.csv")}  # fmt: skip
PILOT = {"seed0": 0, "seeds": 1, "steps": 300, "lrs": "3e-2,1e-2,3e-3", "arms": "lt,flt",
         "Rs": "12", "out": _common.here(__file__, "flt_pilot.csv")}  # fmt: skip
MODELS = {"lt": LoopedGPT, "flt": FullyLoopedGPT}


@torch.no_grad()
def round_rms(model: LoopedGPT, idx: torch.Tensor) -> list[float]:
    """RMS of each loop's final state h^(r) (before the next loop or the head)."""
    x = model.embed(idx)
    h, out = x, []
    for r in range(model.cfg.R):
        h = model.step(h, x, r)
        out.append(float(h.pow(2).mean().sqrt()))
    return out


def probe_row(model, probe, batch, evals) -> dict:
    """Every diagnostic of one record step (the model is unchanged by all of them)."""
    x, y = batch
    inst = lp.instability(probe, x, lambda out, _i: tasks.lm_loss(out, y))
    subs = inst.sublayers
    rms = round_rms(model, x)
    row = {"val_loss": evaluate(model, evals), "probe_loss": inst.loss,
           "n_oscillating": int(subs["oscillating"].sum()),
           "min_mean_cos": float(subs["mean_cos_prev"].min()),
           "mean_cos": float(subs["mean_cos_prev"].mean()),
           "exploding": inst.exploding,
           "stream_rms_last": float(inst.rounds["stream_rms"].iloc[-1]),
           "stream_rms_max": float(inst.rounds["stream_rms"].max()),
           "round_rms_last": rms[-1], "round_rms_max": max(rms)}  # fmt: skip
    for j, c in enumerate(subs["mean_cos_prev"]):
        row[f"cos_{j}"] = float(c)
    return row


def layer_grad_norm(block: torch.nn.Module) -> float:
    """Norm of one physical layer's gradient (all its parameters; summed over its visits)."""
    sq = sum(float(p.grad.pow(2).sum()) for p in block.parameters() if p.grad is not None)
    return math.sqrt(sq)


def _norm_columns(gnorms: list[list[float]]) -> dict:
    """``gnorm_<k>``: layer k's gradient norm at every training step since the previous
    record row (space-separated, oldest first; emptied here), so that the CSV holds each
    layer's whole per-step series for the per-layer oscillation diagnostic."""
    out = {f"gnorm_{k}": " ".join(f"{v:.6g}" for v in g) for k, g in enumerate(gnorms)}
    for g in gnorms:
        g.clear()
    return out


def train_cell(cfg: dict) -> list[dict]:
    """Train one (arm, R, lr, seed); one row per record step (diagnostics before the step)."""
    cpu0 = time.process_time()
    gcfg = GPTConfig(vocab_size=256, seq_len=cfg["seq"], d_model=cfg["d"], n_heads=cfg["heads"],
                     K=cfg["K"], R=cfg["R"])  # fmt: skip
    model = MODELS[cfg["arm"]](gcfg, generator=torch.Generator().manual_seed(cfg["seed"]))
    data = torch.Generator().manual_seed(7_000 + cfg["seed"])
    evals = val_batches(cfg)
    probe_batch = tasks.stdlib_text(cfg["batch"], cfg["seq"], torch.Generator().manual_seed(99))
    probe = lp.attach(model)
    opt = make_optimizer(model, "adamw", cfg["lr"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / cfg["warmup"]))
    rows, window, gnorms, error = [], [], [[] for _ in model.blocks], None
    model.train()
    for t in range(cfg["steps"] + 1):
        record = t % cfg["every"] == 0
        if record:
            diag = (probe_row(model, probe, probe_batch, evals) if cfg.get("probe", True)
                    else {"val_loss": evaluate(model, evals)})  # fmt: skip
            row = {"step": t, **diag}
        if t == cfg["steps"]:
            rows.append({**row, **_norm_columns(gnorms), "train_loss": math.nan,
                         "grad_norm": math.nan})  # fmt: skip
            break
        x, y = tasks.stdlib_text(cfg["batch"], cfg["seq"], data)
        loss = tasks.lm_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        if torch.isfinite(loss):
            loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf))
        for k, blk in enumerate(model.blocks):
            gnorms[k].append(layer_grad_norm(blk))
        window.append(float(loss.detach()))
        if record:
            rows.append({**row, **_norm_columns(gnorms), "train_loss": sum(window) / len(window),
                         "grad_norm": gnorm})  # fmt: skip
            window = []
        if not (torch.isfinite(loss) and math.isfinite(gnorm)):
            error = f"non-finite training loss or gradient at step {t}"
            rows.append({"step": t, "val_loss": math.nan, "train_loss": math.nan})
            break
        opt.step()
        sched.step()
    probe.detach()
    cpu = time.process_time() - cpu0
    for row in rows:
        row.update(cpu_s=round(cpu, 2), diverged=error is not None, error=error)
    return rows


train_cell.version = 2  # 2: per-layer gradient norms (gnorm_<k>) per step


def cells_for_seed(seed: int, a: argparse.Namespace) -> list[dict]:
    base = {**BASE, "steps": a.steps, "seed": seed}
    return [{"arm": arm, "R": R, "lr": lr, **base} for R in a.Rs for lr in a.lrs for arm in a.arms]


def main(argv: list[str] | None = None) -> None:
    ap = _common.parser(__doc__, cache="/work/cache/flt", figure=_common.figure("flt_study.png"),
                        quick="1 seed, 20 steps: a smoke test")  # fmt: skip
    ap.add_argument("--lrs")
    ap.add_argument("--arms")
    ap.add_argument("--Rs")
    ap.add_argument("--design", choices=("redesign-pilot", "redesign"),
                    help="the redesign (issue 39.6): its pilot, or its study at the pilot's "
                         "control (cells appended to their CSV; a rerun skips them)")  # fmt: skip
    a = _common.apply_design(ap.parse_args(argv), STUDY, PILOT)
    if a.design is not None:
        return _redesign(a)
    if a.analyze:
        df = pd.read_csv(a.out)
        print(study.summary_markdown(df))
        if a.figure:
            study.figure(df, a.figure)
            print(f"figure: {a.figure}")
        return
    a.lrs = [float(v) for v in a.lrs.split(",")]
    a.Rs = [int(v) for v in a.Rs.split(",")]
    a.arms = a.arms.split(",")
    if a.quick:
        a.seeds, a.steps = 1, 20
    df = _common.run_seeds(range(a.seed0, a.seed0 + a.seeds), lambda seed: cells_for_seed(seed, a),
                           train_cell, a.cache, a.out, "flt_study")  # fmt: skip
    print(f"{df.groupby(['arm', 'R', 'lr', 'seed']).ngroups} cells in {a.out}", file=sys.stderr)


def _redesign(a) -> None:
    from studies.flt import redesign

    pilot = pd.read_csv(redesign.PILOT_CELLS) if os.path.exists(redesign.PILOT_CELLS) else None
    if a.analyze:
        if pilot is None:
            raise SystemExit(f"no pilot cells at {redesign.PILOT_CELLS}: run --design "
                             "redesign-pilot first")  # fmt: skip
        cells = pd.read_csv(redesign.CELLS) if os.path.exists(redesign.CELLS) else None
        print(redesign.summary_markdown(cells, pilot))
    elif a.design == "redesign-pilot":
        print(f"positive control (R, lr): {redesign.run_pilot()}", file=sys.stderr)
    else:
        print(f"{redesign.run_study()} cells ran", file=sys.stderr)


if __name__ == "__main__":
    main()
