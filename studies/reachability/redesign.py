"""The reachability redesign (issue 39.4): an arm without the outer norm that *can* stop.

Pre-registered in docs/studies/reachability.md ("Redesign — pre-registration") before any
cell: recall {none, add, internal} x {pre-norm + outer norm, post-norm without outer norm
(``norm="post"``: each sublayer ends in an RMSNorm, so the stream is bounded and a fixed
point can exist)}, prefix sums and the 4 x 4 Latin square, seeds 200-204 (10 runs per arm).
Training, curriculum and probe are the 64-input study's as it ran (:func:`run.run`: 600-step
cap, 64 held-out inputs, tolerance 1e-7, the rate-based cap up to 4000 iterations).

Each finished cell is appended to ``reach_redesign.csv`` (committed as the run goes), and a
rerun skips the cells already there, so a fresh checkout resumes from the repository::

    nice -n 19 python -m studies reachability --design redesign   # ~25 CPU-minutes
    python -m studies reachability --design redesign --quick --out /tmp/rr.csv

One torch thread, one cell at a time, seed-major (a partial file holds balanced seeds).
"""

from __future__ import annotations

import os
import sys
import time

import pandas as pd
import torch

from loopprobe.experiments.recall import TASKS
from studies.reachability import run as study

SEEDS = tuple(range(200, 205))
#: The two architectures compared: (norm, outer_norm).
ARMS = (("pre", True), ("post", False))
KEY = ("task", "recall", "norm", "outer_norm", "seed")
CELLS = "reach_redesign.csv"


def cells(base: dict, seeds=SEEDS, tasks=TASKS) -> list[dict]:
    """Every cell of the design, seed-major: seed x task x recall x arm."""
    return [
        {"task": t, "recall": r, "norm": n, "outer_norm": o, "seed": s, **base}
        for s in seeds
        for t in tasks
        for r in study.STUDY_RECALLS
        for n, o in ARMS
    ]


def _key(row) -> tuple:
    return (row["task"], row["recall"], row["norm"], bool(row["outer_norm"]), int(row["seed"]))


def done_keys(out: str) -> set:
    """The cells already in ``out`` (none if it does not exist yet)."""
    if not os.path.exists(out):
        return set()
    return {_key(r) for r in pd.read_csv(out).to_dict("records")}


def append_row(out: str, row: dict) -> None:
    """Append one finished cell to ``out`` in the file's own column order."""
    frame = pd.DataFrame([row])
    if os.path.exists(out):
        frame = frame.reindex(columns=pd.read_csv(out, nrows=0).columns)
    frame.to_csv(out, mode="a", header=not os.path.exists(out), index=False,
                 float_format="%.6g")  # fmt: skip


def run_cells(items: list[dict], out: str) -> int:
    """Train and probe every cell of ``items`` not yet in ``out``; return how many ran."""
    torch.set_num_threads(1)
    have, ran = done_keys(out), 0
    todo = [c for c in items if _key(c) not in have]
    print(f"reach redesign: {len(items) - len(todo)} of {len(items)} cells in {out}; "
          f"{len(todo)} to run", file=sys.stderr, flush=True)  # fmt: skip
    for i, cfg in enumerate(todo):
        t0 = time.process_time()
        try:
            row, error = study.run(cfg), ""
        except Exception as exc:  # a failed cell is a result, recorded with its reason
            row, error = {}, f"{type(exc).__name__}: {exc}"
        append_row(out, {**cfg, **row, "error": error})
        ran += 1
        print(f"[{i + 1}/{len(todo)}] {_key(cfg)} reach {row.get('reach_frac', float('nan')):.3g}"
              f" {time.process_time() - t0:.1f} CPU-s {error}", file=sys.stderr,
              flush=True)  # fmt: skip
    return ran
