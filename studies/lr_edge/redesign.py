"""The LR-edge redesign (pre-registered in docs/studies/lr_edge.md, "Redesign — pre-registration").

The edge defined by instability during training. Same model as the first design (pre-norm
``LoopedGPT``, K = 1 block looped N times, eps = N^-alpha, d 32, 4 heads, seq 32, batch 16,
byte-level text), N in {1, 2, 4, 8, 16}, both scalings (N = 1 once, as ``both``), 200 steps
of AdamW (betas 0.9/0.95, warmup 10 steps, linear decay) with **no gradient clipping**,
half-octave lr grid 2^-7 .. 2^1 (17 rates), seeds 100-105. Each primary cell records whether
its training loss was ever non-finite and the largest rise of the 10-step moving mean of its
training loss above its running minimum after warmup (``studies.deeploop.redesign.loss_rise``).

Secondary (Theorem 2 measured directly): ``step_cell`` takes one AdamW step at each lr on a
fixed batch from the seed's fresh model and records d^-1/2 ||Delta h_N|| (per-token RMS of the
change of the final hidden state on that batch, averaged over tokens; ``dh_loop`` the same for
h_N - h_0, the loop's own part without the embedding's change; ``h_rms`` the scale of h_N).

Resumable and seed-major: every finished cell is appended at once to ``redesign_step.csv`` /
``redesign.csv`` (committed with the repository) and a rerun skips the cells already there.
The secondary (cheap) runs first for every seed, then the primary, seed by seed.

    nice -n 19 python -m studies lr_edge --design redesign                 # run / resume
    nice -n 19 python -m studies lr_edge --design redesign --stop-at 21:00 # stop by UTC time
    python -m studies lr_edge --design redesign --plan    # the cells still to run
    python -m studies lr_edge --design redesign --small-steps  # exploratory one-step cells
    python -m studies lr_edge --design redesign --analyze # the summary from the committed cells
"""

from __future__ import annotations

import datetime as dt
import math
import os
import sys
import time

import numpy as np
import pandas as pd
import torch

from loopprobe import tasks
from loopprobe.experiments.coordcheck import make_optimizer
from loopprobe.models import GPTConfig, LoopedGPT
from studies import _common
from studies.deeploop.redesign import loss_rise

CSV = _common.here(__file__, "redesign.csv")
STEP_CSV = _common.here(__file__, "redesign_step.csv")
SMALL_CSV = _common.here(__file__, "redesign_step_small.csv")  # exploratory, after the data
SMALL_GRID = tuple(range(-16, -7))  # log2 lr: octaves 2^-16 .. 2^-8, below the registered grid
SEEDS = (100, 101, 102, 103, 104, 105)
NS = (1, 2, 4, 8, 16)
SCALINGS = ("1/sqrt(N)", "1/N")
GRID = tuple(x / 2 for x in range(-14, 3))  # log2 lr: -7, -6.5, ..., 1 (17 rates)
BASE = {"d": 32, "heads": 4, "seq": 32, "batch": 16, "eval_batches": 8, "steps": 200}
WARMUP = 10  # steps of linear warmup (5 % of 200, as train_short)
WINDOW = 10  # steps in the moving mean of the instability rule
KEY = ["scaling", "N", "lr", "seed"]
COLUMNS = KEY + ["steps", "loss", "train_loss", "nonfinite", "nonfinite_step", "rise",
                 "steps_done", "cpu_s"]  # fmt: skip
STEP_COLUMNS = KEY + ["eps", "dh", "dh_loop", "h_rms", "cpu_s"]


def lr_of(x: float) -> float:
    return float(f"{2.0**x:.6g}")


def arms() -> list[tuple[str, int]]:
    return [("both", 1)] + [(s, N) for N in NS[1:] for s in SCALINGS]


def model_of(scaling: str, N: int, seed: int) -> LoopedGPT:
    residual = "1/N" if scaling == "both" else scaling  # N = 1: eps = 1 under both
    cfg = GPTConfig(vocab_size=256, seq_len=BASE["seq"], d_model=BASE["d"],
                    n_heads=BASE["heads"], K=1, R=N, norm="pre", residual=residual)  # fmt: skip
    return LoopedGPT(cfg, generator=torch.Generator().manual_seed(seed))


def train_cell(cfg: dict) -> dict:
    """Train one (scaling, N, lr, seed) without clipping; the instability outcome, held-out
    loss and CPU time. A non-finite training loss stops the run."""
    cpu0 = time.process_time()
    model = model_of(cfg["scaling"], cfg["N"], cfg["seed"])
    steps, B, T = cfg["steps"], BASE["batch"], BASE["seq"]
    opt = make_optimizer(model, "adamw", cfg["lr"])

    def factor(t: int) -> float:
        return min((t + 1) / WARMUP, max(0.0, (steps - t) / max(1, steps - WARMUP)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    gen = torch.Generator().manual_seed(7_000 + cfg["seed"])
    losses: list[float] = []
    bad = None
    for t in range(steps):
        x, y = tasks.stdlib_text(B, T, gen)
        loss = tasks.lm_loss(model(x), y)
        if not torch.isfinite(loss):
            bad = t
            break
        losses.append(float(loss.detach()))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    val = math.nan
    if bad is None:
        val = _common.evaluate(model, _common.val_batches(BASE))
    rise = loss_rise(losses, start=WARMUP, window=WINDOW)
    return {"loss": val, "train_loss": float(np.mean(losses[-20:])) if losses else math.nan,
            "nonfinite": bad is not None or not math.isfinite(val), "nonfinite_step": bad,
            "rise": rise, "steps_done": len(losses),
            "cpu_s": round(time.process_time() - cpu0, 2)}  # fmt: skip


def step_cell(cfg: dict) -> dict:
    """One AdamW step at ``lr`` on the seed's first training batch from the fresh model;
    d^-1/2 ||Delta h_N|| (per-token RMS change of the final hidden state, mean over tokens)."""
    cpu0 = time.process_time()
    model = model_of(cfg["scaling"], cfg["N"], cfg["seed"])
    x, y = tasks.stdlib_text(BASE["batch"], BASE["seq"],
                             torch.Generator().manual_seed(7_000 + cfg["seed"]))  # fmt: skip
    with torch.no_grad():
        e0, h0 = model.embed(x), model.hidden(x)
    opt = make_optimizer(model, "adamw", cfg["lr"])
    tasks.lm_loss(model(x), y).backward()
    opt.step()
    with torch.no_grad():
        e1, h1 = model.embed(x), model.hidden(x)

    def rms(t: torch.Tensor) -> float:
        return float(t.pow(2).mean(-1).sqrt().mean())

    return {
        "eps": float(model.cfg.eps),
        "dh": rms(h1 - h0),
        "dh_loop": rms(h1 - e1 - h0 + e0),
        "h_rms": rms(h0),
        "cpu_s": round(time.process_time() - cpu0, 3),
    }


def cells_of(seed: int) -> list[dict]:
    return [{"scaling": s, "N": N, "lr": lr_of(x), "seed": seed} for s, N in arms() for x in GRID]


def load(path: str) -> pd.DataFrame:
    return pd.read_csv(path) if os.path.exists(path) else pd.DataFrame(columns=KEY)


def todo(done: pd.DataFrame, seeds=None) -> list[dict]:
    """Every cell of ``seeds`` (default ``SEEDS``) not in ``done``, seed-major."""
    seeds = SEEDS if seeds is None else seeds
    have = {(r.scaling, int(r.N), float(r.lr), int(r.seed)) for r in done.itertuples()}
    return [c for s in seeds for c in cells_of(s)
            if (c["scaling"], c["N"], c["lr"], c["seed"]) not in have]  # fmt: skip


def append(row: dict, path: str, columns: list[str]) -> None:
    df = pd.DataFrame([{k: row.get(k) for k in columns}])
    df.to_csv(path, mode="a", header=not os.path.exists(path), index=False, float_format="%.6g")


def run(stop_at: str | None = None, plan: bool = False, out: str = CSV,
        step_out: str = STEP_CSV) -> None:  # fmt: skip
    """The secondary for every seed, then the primary seed by seed; resumable."""
    torch.set_num_threads(1)
    stop = None
    if stop_at:
        h, m = map(int, stop_at.split(":"))
        stop = dt.datetime.now(dt.UTC).replace(hour=h, minute=m, second=0, microsecond=0)
    jobs = ((step_out, STEP_COLUMNS, step_cell), (out, COLUMNS, train_cell))
    for path, columns, fn in jobs:
        cells = todo(load(path))
        print(f"{os.path.basename(path)}: {len(load(path))} cells done, {len(cells)} to run",
              flush=True)  # fmt: skip
        if plan:
            continue
        for c in cells:
            if stop is not None and dt.datetime.now(dt.UTC) >= stop:
                print("stop time reached", file=sys.stderr)
                return
            c = {**c, "steps": BASE["steps"]}
            res = fn(c)
            append({**c, **res}, path, columns)
            if fn is train_cell:
                print(f"{c['scaling']} N{c['N']} lr {c['lr']:.4g} seed {c['seed']}: rise "
                      f"{res['rise']:.3f} nonfinite {res['nonfinite']} cpu {res['cpu_s']} s",
                      flush=True)  # fmt: skip


def run_small(path: str = SMALL_CSV) -> pd.DataFrame:
    """Exploratory (stated after the registered one-step cells): the one-step cells on octaves
    2^-16 .. 2^-8, where the step is small against h_N; every seed and arm, seconds."""
    torch.set_num_threads(1)
    rows = [{**c, **step_cell(c)} for seed in SEEDS for s, N in arms() for x in SMALL_GRID
            for c in [{"scaling": s, "N": N, "lr": lr_of(x), "seed": seed}]]  # fmt: skip
    df = pd.DataFrame(rows)[STEP_COLUMNS]
    df.to_csv(path, index=False, float_format="%.6g")
    return df
