"""Finite step over >= 10 trained models (issue 39.5): the driver and the per-model cells.

Design and criteria: docs/studies/finite_step.md ("Redesign", committed before these cells
ran). The recipe of ``studies/finite_step/run.py`` (K = 1, R = 4, d 32 LoopedGPT with add
recall, prefix sums, AdamW lr 3e-3, 600 steps) on training seeds 100-109; each model's
primary transition 4 -> 5 (512 held-out inputs, float64) is written to its own committed
file ``studies/finite_step/models/seed_<s>.csv.gz`` as soon as it finishes, so a fresh
checkout resumes from the repository (a seed whose file exists is skipped).

    nice -n 19 .venv/bin/python -m studies.finite_step.models        # ~20 CPU-s a model
    .venv/bin/python -m studies.finite_step.models --analyze          # per model + over models
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import pandas as pd
import torch

from studies.finite_step import per_model as pm
from studies.finite_step.run import run

SEEDS = tuple(range(100, 110))
DIR = pathlib.Path(__file__).resolve().parent / "models"
DESIGN = {"steps": 600, "inputs": 512, "seq_len": 16}


def path_of(seed: int, where: pathlib.Path = DIR) -> pathlib.Path:
    return pathlib.Path(where) / f"seed_{seed}.csv.gz"


def cells(seeds=SEEDS, where: pathlib.Path = DIR) -> pd.DataFrame:
    """Every finished model's 4 -> 5 rows under ``where`` (empty frame if none)."""
    paths = [(s, path_of(s, where)) for s in seeds]
    frames = [pd.read_csv(p).assign(seed=s) for s, p in paths if p.exists()]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def train_missing(seeds=SEEDS) -> int:
    torch.set_num_threads(1)
    DIR.mkdir(exist_ok=True)
    ran = 0
    for s in seeds:
        if path_of(s).exists():
            continue
        out = run({"seed": s, **DESIGN})
        out = out[out["transition"] == pm.PRIMARY].assign(seed=s)
        tmp = path_of(s).with_suffix(".tmp")
        out.to_csv(tmp, index=False, float_format="%.6g", compression="gzip")
        tmp.rename(path_of(s))  # whole files only: an interrupted model leaves none
        ran += 1
        print(f"seed {s}: cpu {out['cpu_s'].iloc[0]:.1f}s", file=sys.stderr, flush=True)
    return ran


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--analyze", action="store_true")
    a = ap.parse_args(argv)
    if not a.analyze:
        train_missing()
    c = cells()
    if c.empty:
        print("no finished models yet")
        return
    models = pm.per_model(c)
    print(models.to_string(index=False))
    print(pm.over_models(models).to_string(index=False))
    print(f"{c['seed'].nunique()} of {len(SEEDS)} models; CPU "
          f"{c.groupby('seed')['cpu_s'].first().sum() / 60:.1f} min")  # fmt: skip


if __name__ == "__main__":
    main()
