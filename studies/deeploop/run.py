"""DeepLoop against its baselines across R, and the p-sweep at R = 3 (issue 30.1).

The design, estimator and criteria are pre-registered in docs/studies/deeploop.md (committed
before any study cell ran). Post-norm LoopedGPT (K = 2, d_model 32, 4 heads, seq 32, batch 16)
on byte-level lp.tasks.stdlib_text; arms ``post`` (alpha = beta = 1, the seed's baseline),
``deepnorm`` (p = 1/4), ``deeploop`` (p = 1/2) at R in {1, 3, 7}, and ``postp`` at R = 3 for
the p-sweep (p = 0, 1/4, 1/2 are the post, deepnorm, deeploop cells, shared). Every cell trains
a fresh model (AdamW betas 0.9/0.95, linear warmup 5 %, linear decay to 0, clip 1, one fixed
lr) and evaluates the held-out loss on fixed val batches at checkpoints. A seed fixes the
init draws and the data order, so the arms of a seed are paired. Cells are cached one by one
with lp.sweep in --cache (resumable, seed-major: an interrupted run leaves whole seeds), and
the long CSV (one row per cell and checkpoint) is rewritten after every seed.

    nice -n 19 python -m studies deeploop --cache /work/cache/deeploop   # the study
    python -m studies deeploop --analyze       # tables + figure from the CSV, seconds
    python -m studies deeploop --pilot --cache /work/cache/deeploop_pilot   # pilot
    python -m studies deeploop --quick --cache /tmp/dlq --out /tmp/dlq.csv  # smoke

One torch thread; CPU seconds per cell are in the ``cpu_s`` column.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import pandas as pd
import torch

from loopprobe import tasks
from loopprobe.experiments.coordcheck import make_optimizer
from loopprobe.models import GPTConfig, LoopedGPT
from studies import _common
from studies._common import evaluate, val_batches
from studies.deeploop import analysis as study

BASE = {"K": 2, "d": 32, "heads": 4, "seq": 32, "batch": 16, "eval_batches": 16,
        "checkpoints": 8}  # fmt: skip
STUDY = {"seed0": 100, "seeds": 12, "p_seeds": 5, "steps": 1000, "lr": 3e-3,
         "out": _common.here(__file__, "deeploop_study.csv")}  # fmt: skip
PILOT = {"seed0": 0, "seeds": 3, "p_seeds": 0, "steps": 1000, "lr": 3e-3,
         "out": _common.here(__file__, "deeploop_pilot.csv")}  # fmt: skip


def train_steps(cfg: dict, norm: str, p: float | None, clip: float | None):
    """Build one cell's model and train it (AdamW, linear warmup over 5 % then linear decay,
    ``clip``: the gradient-norm clip or None). Returns the rows (held-out loss at each
    checkpoint, plus a NaN row at the last step if training failed), every step's training
    loss, and the error (None, or why the run failed). ``cfg["position"]`` and
    ``cfg["embed_norm"]`` pick the backbone (default: learned positions, no embedding norm)."""
    gcfg = GPTConfig(vocab_size=256, seq_len=cfg["seq"], d_model=cfg["d"], n_heads=cfg["heads"],
                     K=cfg["K"], R=cfg["R"], norm=norm, p=p,
                     position=cfg.get("position", "learned"),
                     embed_norm=bool(cfg.get("embed_norm", False)))  # fmt: skip
    model = LoopedGPT(gcfg, generator=torch.Generator().manual_seed(cfg["seed"]))
    data = torch.Generator().manual_seed(7_000 + cfg["seed"])
    evals = val_batches(cfg)
    steps, n_warm = cfg["steps"], max(1, int(0.05 * cfg["steps"]))
    opt = make_optimizer(model, "adamw", cfg["lr"])

    def factor(t: int) -> float:
        return min((t + 1) / n_warm, max(0.0, (steps - t) / max(1, steps - n_warm)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    marks = {round(steps * (i + 1) / cfg["checkpoints"]) for i in range(cfg["checkpoints"])}
    rows, losses, error = [], [], None
    model.train()
    for t in range(steps):
        x, y = tasks.stdlib_text(cfg["batch"], cfg["seq"], data)
        loss = tasks.lm_loss(model(x), y)
        if not torch.isfinite(loss):
            error = f"non-finite training loss at step {t}"
            break
        losses.append(float(loss.detach()))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        if t + 1 in marks:
            rows.append({"step": t + 1, "val_loss": evaluate(model, evals)})
    final = rows[-1]["val_loss"] if rows and rows[-1]["step"] == steps else math.nan
    if error is None and not math.isfinite(final):
        error = "non-finite held-out loss"
    if error is not None:
        rows.append({"step": steps, "val_loss": math.nan})
    return rows, losses, error


def train_cell(cfg: dict) -> list[dict]:
    """Train one (norm, p, R, seed); one row per checkpoint (held-out loss at that step)."""
    cpu0 = time.process_time()
    rows, losses, error = train_steps(cfg, cfg["norm"], cfg["p"], clip=1.0)
    steps = cfg["steps"]
    tail = losses[steps - max(1, steps // 10) :]  # the last tenth's steps that ran
    train_loss = sum(tail) / len(tail) if tail else math.nan
    cpu = time.process_time() - cpu0
    for row in rows:
        row.update(final=row["step"] == steps, train_loss=train_loss, cpu_s=round(cpu, 2),
                   diverged=error is not None, error=error)  # fmt: skip
    return rows


train_cell.version = 1


def cells_for_seed(seed: int, a: argparse.Namespace, with_p: bool) -> list[dict]:
    """The study's cells of one seed: the three arms at every R, then the p-sweep at R = 3."""
    base = {**BASE, "steps": a.steps, "lr": a.lr, "seed": seed}
    out = [{"arm": arm, "norm": arm, "p": None, "R": R, **base}
           for R in a.Rs for arm in study.ARMS]  # fmt: skip
    if with_p:
        out += [{"arm": "postp", "norm": "postp", "p": p, "R": study.P_SWEEP_R, **base}
                for p in study.P_GRID if p not in study.SHARED_P]  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> None:
    ap = _common.parser(__doc__, cache="/work/cache/deeploop",
                        figure=_common.figure("deeploop_study.png"),
                        quick="1 seed, 6 steps: a smoke test")  # fmt: skip
    ap.add_argument("--p-seeds", type=int, dest="p_seeds", help="seeds that also run the p-sweep")
    ap.add_argument("--lr", type=float)
    ap.add_argument("--Rs", default=",".join(map(str, study.RS)))
    a = _common.apply_design(ap.parse_args(argv), STUDY, PILOT)
    if a.analyze:
        report(pd.read_csv(a.out), a.figure)
        return
    a.Rs = [int(r) for r in a.Rs.split(",")]
    if a.quick:
        a.seeds, a.p_seeds, a.steps = 1, 1, 6
    seeds = range(a.seed0, a.seed0 + a.seeds)
    df = _common.run_seeds(seeds, lambda seed: cells_for_seed(seed, a, seed - a.seed0 < a.p_seeds),
                           train_cell, a.cache, a.out, "deeploop_study")  # fmt: skip
    print(f"{len(df[df['final']])} cells in {a.out}", file=sys.stderr)


def report(df: pd.DataFrame, figure: str | None) -> None:
    """Print the pre-registered tables and verdicts; draw the figure."""
    print(study.summary_markdown(df))
    if figure:
        study.figure(df, figure)
        print(f"figure: {figure}")


if __name__ == "__main__":
    main()
