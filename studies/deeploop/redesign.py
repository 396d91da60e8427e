"""DeepLoop redesign (issue 39.1): a learning-rate grid per arm and R, and the p-sweep across R.

The designs and criteria are pre-registered in docs/studies/deeploop.md ("Redesign"),
committed before any of these cells ran. Every cell is appended to its committed CSV as soon
as it finishes (one row per checkpoint), so an interrupted run resumes from the repository:

    nice -n 19 .venv/bin/python -m studies.deeploop.redesign pilot    # lr pilot, R = 1 and 3
    nice -n 19 .venv/bin/python -m studies.deeploop.redesign study    # 3 rates per arm and R
    nice -n 19 .venv/bin/python -m studies.deeploop.redesign psweep   # p across R = 2..16
    nice -n 19 .venv/bin/python -m studies.deeploop.redesign trend    # R = 1, 4k and 8k steps
    nice -n 19 .venv/bin/python -m studies.deeploop.redesign backbone # RoPE + embedding norm
    nice -n 19 .venv/bin/python -m studies.deeploop.redesign pilot7   # lr pilot at R = 7
    nice -n 19 .venv/bin/python -m studies.deeploop.redesign study7   # lr study at R = 7
    nice -n 19 .venv/bin/python -m studies.deeploop.redesign extend7  # its addendum rates
    .venv/bin/python -m studies.deeploop.redesign pilot --dry         # list what is left

The lr-grid cells train with ``studies.deeploop.run.train_cell`` (the original design: clip
1.0, warmup 5 %, linear decay), so the original pilot's lr 3e-3 cells (seeds 0-2,
``deeploop_pilot.csv``) are the same trainings and join the pilot grid. The p-sweep cells
train with :func:`train_unclipped`: no gradient clipping, and the training loss of every step
kept as its instability outcome (divergence, or a rise of the smoothed training loss above
its running minimum).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import pandas as pd
import torch

from studies._common import here
from studies.deeploop.run import BASE, train_cell, train_steps

ARMS = ("post", "deepnorm", "deeploop")
#: lr pilot: the original lr 3e-3 plus these, half a decade apart, seeds 0-1 (3e-3: seeds 0-2)
PILOT = {"Rs": (1, 3), "lrs": (1e-3, 1e-2, 3e-2), "seeds": (0, 1), "steps": 1000,
         "out": here(__file__, "deeploop_lr_pilot.csv")}  # fmt: skip
LR_LADDER = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)  # half-decade steps; pilot optimum +- 1
STUDY = {"Rs": (1, 3), "seeds": tuple(range(100, 106)), "steps": 1000,
         "out": here(__file__, "deeploop_lr_study.csv")}  # fmt: skip
TREND = {"arms": ("post", "deeploop"), "budgets": (4000, 8000), "seeds": (100, 101, 102),
         "out": here(__file__, "deeploop_trend.csv")}  # fmt: skip
PSWEEP = {"Rs": (2, 4, 8, 16), "ps": (0.0, 0.25, 0.35, 0.45, 0.55), "seeds": (200, 201, 202),
          "lr": 1e-2, "steps": 1000, "out": here(__file__, "deeploop_psweep.csv")}  # fmt: skip
# Second redesign (docs/studies/deeploop.md, "Second redesign"): the seed's backbone at the
# lr-study's tuned rates, and the lr pilot and study at R = 7 (same CSVs as at R = 1 and 3).
BACKBONE = {"Rs": (1, 3), "seeds": tuple(range(100, 106)), "steps": 1000, "position": "rope",
            "embed_norm": True, "out": here(__file__, "deeploop_backbone.csv")}  # fmt: skip
PILOT7 = {**PILOT, "Rs": (7,), "lrs": (3e-4, 1e-3, 1e-2)}  # + the original pilot's 3e-3
STUDY7 = {**STUDY, "Rs": (7,)}
SMOOTH = 20  # steps in the moving mean of the training loss the instability outcome reads
KEYS = ["arm", "p", "R", "lr", "seed"]


def train_unclipped(cfg: dict) -> list[dict]:
    """One p-sweep cell: ``norm="postp"`` at exponent p (``"post"``, alpha = beta = 1, at
    p = 0), no gradient clipping. Rows per checkpoint as :func:`studies.deeploop.run.
    train_cell`, plus ``rise``: the largest excess of the SMOOTH-step mean training loss over
    its running minimum after warmup (nats; a loss spike), and ``diverged`` when a training
    loss was not finite."""
    cpu0 = time.process_time()
    norm, p = ("postp" if cfg["p"] else "post"), (cfg["p"] or None)
    rows, losses, error = train_steps(cfg, norm, p, clip=None)
    steps, n_warm = cfg["steps"], max(1, int(0.05 * cfg["steps"]))
    rise = loss_rise(losses, start=n_warm)
    tail = losses[-max(1, steps // 10) :]
    cpu = time.process_time() - cpu0
    for row in rows:
        row.update(final=row["step"] == steps, train_loss=sum(tail) / max(1, len(tail)),
                   rise=rise, cpu_s=round(cpu, 2), diverged=error is not None,
                   error=error)  # fmt: skip
    return rows


def loss_rise(losses: list[float], start: int = 0, window: int = SMOOTH) -> float:
    """Largest excess (nats) of the ``window``-step moving mean of ``losses`` over its running
    minimum, counting from step ``start`` (0.0 for a loss that never rises; NaN if too short)."""
    s = pd.Series(losses, dtype=float).rolling(window).mean().iloc[max(start, window - 1) :]
    if s.empty:
        return math.nan
    return float((s - s.cummin()).max())


def lr_cells(design: dict, lrs_of) -> list[dict]:
    """R-major (cheap R first), then seed, arm, lr: ``lrs_of(arm, R)`` gives the rates."""
    base = {**BASE, "steps": design["steps"],
            **{k: design[k] for k in ("position", "embed_norm") if k in design}}  # fmt: skip
    return [{"arm": arm, "norm": arm, "p": None, "R": R, "lr": lr, "seed": s, **base}
            for R in design["Rs"] for s in design["seeds"] for arm in ARMS
            for lr in lrs_of(arm, R)]  # fmt: skip


def psweep_cells(design: dict = PSWEEP) -> list[dict]:
    base = {**BASE, "steps": design["steps"], "lr": design["lr"]}
    return [{"arm": "postp", "norm": "postp", "p": p, "R": R, "seed": s, **base}
            for R in design["Rs"] for s in design["seeds"] for p in design["ps"]]  # fmt: skip


def trend_cells(design: dict = TREND) -> list[dict]:
    """The budget trend at R = 1: post and deeploop at their tuned study lr, shortest first."""
    from studies.deeploop.redesign_analysis import tuned

    t = tuned(pd.read_csv(STUDY["out"])).set_index(["arm", "R"])["lr"]
    return [{"arm": a, "norm": a, "p": None, "R": 1, "lr": float(t[(a, 1)]), "seed": s,
             **BASE, "steps": n}
            for n in design["budgets"] for s in design["seeds"]
            for a in design["arms"]]  # fmt: skip


def backbone_cells(design: dict = BACKBONE) -> list[dict]:
    """The backbone check: every arm at R = 1 and 3 at its tuned lr of the lr study (tuned on
    learned positions; not re-tuned), with RoPE and the input-embedding RMSNorm."""
    from studies.deeploop.redesign_analysis import tuned

    t = tuned(pd.read_csv(STUDY["out"])).set_index(["arm", "R"])["lr"]
    return lr_cells(design, lambda arm, R: (float(t[(arm, R)]),))


def extend7_cells(design: dict = STUDY7) -> list[dict]:
    """Addendum to the R = 7 study: the next ladder rate beyond each arm's end optimum."""
    from studies.deeploop.redesign_analysis import extension_rates, pilot_cells

    rates = extension_rates(pd.read_csv(STUDY["out"]), pilot_cells())
    return lr_cells(design, lambda arm, R: rates.get((arm, R), ()))


def done_keys(path: str) -> set[tuple]:
    """The (arm, p, R, lr, seed, steps) of every finished cell in ``path`` (its final row)."""
    if not os.path.exists(path):
        return set()
    df = pd.read_csv(path)
    df = df[df["final"].astype(bool)]
    return {_key(r) for r in df.to_dict("records")}


def _key(cell: dict) -> tuple:
    p = cell.get("p")
    p = None if p is None or (isinstance(p, float) and math.isnan(p)) else round(float(p), 4)
    return (cell["arm"], p, int(cell["R"]), round(float(cell["lr"]), 8), int(cell["seed"]),
            int(cell["steps"]))  # fmt: skip


def run_cells(cells: list[dict], fn, out: str, stop_at: float | None = None) -> int:
    """Train every cell not yet in ``out`` and append its rows there at once; returns how
    many ran. ``stop_at``: a time.time() after which no new cell starts."""
    torch.set_num_threads(1)
    done, ran = done_keys(out), 0
    todo = [c for c in cells if _key(c) not in done]
    print(f"{len(todo)} of {len(cells)} cells left -> {out}", file=sys.stderr, flush=True)
    for i, cell in enumerate(todo):
        if stop_at is not None and time.time() > stop_at:
            print("stop time reached; no new cell started", file=sys.stderr)
            break
        rows = fn(cell)
        frame = pd.DataFrame([{**cell, **r} for r in rows])
        frame.to_csv(out, mode="a", header=not os.path.exists(out), index=False,
                     float_format="%.6g")  # fmt: skip
        ran += 1
        print(f"[{i + 1}/{len(todo)}] {_key(cell)} loss {rows[-1]['val_loss']:.4f} "
              f"cpu {rows[-1]['cpu_s']:.1f}s", file=sys.stderr, flush=True)  # fmt: skip
    return ran


def study_rates(pilot: pd.DataFrame) -> dict:
    """Each (arm, R)'s three study rates: the pilot's best grid lr (lowest mean final loss
    over the pilot seeds) and its neighbours on :data:`LR_LADDER`."""
    from studies.deeploop.redesign_analysis import best_lr

    out = {}
    for (arm, R), lr in best_lr(pilot).items():
        i = min(range(len(LR_LADDER)), key=lambda j: abs(math.log(LR_LADDER[j] / lr)))
        out[(arm, R)] = LR_LADDER[max(0, i - 1) : i + 2]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("design", choices=("pilot", "study", "psweep", "trend", "backbone",
                                       "pilot7", "study7", "extend7"))  # fmt: skip
    ap.add_argument("--dry", action="store_true", help="only say how many cells are left")
    ap.add_argument("--stop-at", dest="stop_at", help="HH:MM UTC after which no cell starts")
    a = ap.parse_args(argv)
    stop = None
    if a.stop_at:
        h, m = map(int, a.stop_at.split(":"))
        now = time.gmtime()
        left = ((h - now.tm_hour) * 60 + m - now.tm_min) * 60 - now.tm_sec
        stop = time.time() + left % 86400  # a stop time past midnight UTC is tomorrow's
    if a.design == "pilot":
        cells, out, fn = lr_cells(PILOT, lambda arm, R: PILOT["lrs"]), PILOT["out"], train_cell
    elif a.design == "pilot7":
        cells, out, fn = lr_cells(PILOT7, lambda arm, R: PILOT7["lrs"]), PILOT7["out"], train_cell
    elif a.design in ("study", "study7"):
        from studies.deeploop.redesign_analysis import pilot_cells

        rates, d = study_rates(pilot_cells()), (STUDY if a.design == "study" else STUDY7)
        cells, out, fn = lr_cells(d, lambda arm, R: rates[(arm, R)]), d["out"], train_cell
    elif a.design == "extend7":
        cells, out, fn = extend7_cells(), STUDY7["out"], train_cell
    elif a.design == "backbone":
        cells, out, fn = backbone_cells(), BACKBONE["out"], train_cell
    elif a.design == "trend":
        cells, out, fn = trend_cells(), TREND["out"], train_cell
    else:
        cells, out, fn = psweep_cells(), PSWEEP["out"], train_unclipped
    if a.dry:
        left = [c for c in cells if _key(c) not in done_keys(out)]
        print(f"{len(left)} of {len(cells)} cells left in {out}")
        return
    run_cells(cells, fn, out, stop)


if __name__ == "__main__":
    main()
