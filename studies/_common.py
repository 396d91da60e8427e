"""What every study's driver shares: paths, the command line, held-out batches, the seed loop.

A driver (``studies/<name>/run.py``) states its designs as dicts (``STUDY``, ``PILOT``: seeds,
steps, where its cells go), builds its parser with :func:`parser`, fills unset options from
the chosen design with :func:`apply_design`, and trains seed-major with :func:`run_seeds`
(each cell cached by :func:`loopprobe.sweep`, so an interrupted run resumes; the long CSV is
rewritten after every seed, so it holds whole seeds only).
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import sys
from collections.abc import Callable, Iterable

import numpy as np
import pandas as pd
import torch

from loopprobe import tasks
from loopprobe.sweeps import sweep

#: The repository root (``studies/`` sits in it) and where the docs pages find the figures.
ROOT = pathlib.Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "figures"


def here(module_file: str, name: str) -> str:
    """``name`` beside the study's module (its committed cells), as a string for argparse."""
    return str(pathlib.Path(module_file).resolve().parent / name)


def figure(name: str) -> str:
    """The path of a figure the docs pages show (``docs/figures/<name>``)."""
    return str(FIGURES / name)


def parser(doc: str, *, cache: str, figure: str | None, quick: str) -> argparse.ArgumentParser:
    """The options every driver has: ``--cache``, ``--pilot``, ``--quick``, ``--analyze``,
    ``--seed0``, ``--seeds``, ``--steps``, ``--out`` and (when it draws one) ``--figure``."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--cache", default=cache, help="where each trained cell is cached")
    ap.add_argument("--pilot", action="store_true", help="the pilot design")
    ap.add_argument("--quick", action="store_true", help=quick)
    ap.add_argument("--analyze", action="store_true", help="no training: tables and figure")
    ap.add_argument("--seed0", type=int)
    ap.add_argument("--seeds", type=int)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--out")
    if figure is not None:
        ap.add_argument("--figure", default=figure)
    return ap


def apply_design(a: argparse.Namespace, study: dict, pilot: dict) -> argparse.Namespace:
    """Fill every option left unset from the pilot design (``--pilot``) or the study's."""
    for key, value in (pilot if a.pilot else study).items():
        if getattr(a, key, None) is None:
            setattr(a, key, value)
    return a


def run_seeds(
    seeds: Iterable[int],
    cells_of: Callable[[int], list[dict]],
    fn: Callable,
    cache: str,
    out: str,
    name: str,
    *,
    more: Callable[[pd.DataFrame, list[dict]], list[dict]] | None = None,
    float_format: str = "%.6g",
) -> pd.DataFrame:
    """Train every seed's cells (``cells_of(seed)``) through :func:`loopprobe.sweep`, seed by
    seed, and rewrite ``out`` after each. ``more(frame, cells)``: follow-up cells of the same
    seed chosen from its results (e.g. a refinement), run with the same ``fn``."""
    torch.set_num_threads(1)
    frames: list[pd.DataFrame] = []
    df = pd.DataFrame()
    for seed in tqdm_seeds(list(seeds)):
        cells = cells_of(seed)
        frame = sweep(cells, fn, cache, progress=True, name=name)
        frames.append(frame)
        if more is not None:
            frames.append(sweep(more(frame, cells), fn, cache, progress=True, name=name))
        df = pd.concat(frames, ignore_index=True)
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        df.to_csv(out, index=False, float_format=float_format)
    return df


def tqdm_seeds(seeds: list[int]):
    from tqdm import tqdm

    return tqdm(seeds, desc="seed", file=sys.stderr)


def val_batches(cfg: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed held-out text batches (``cfg``: ``batch``, ``seq``, ``eval_batches``): the
    same for every cell and seed, so held-out losses are paired."""
    gen = torch.Generator().manual_seed(123)
    return [tasks.stdlib_text(cfg["batch"], cfg["seq"], gen, split="val")
            for _ in range(cfg["eval_batches"])]  # fmt: skip


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list) -> float:
    """Mean LM loss over ``batches`` in eval mode (the model is put back in train mode)."""
    model.eval()
    out = sum(float(tasks.lm_loss(model(x), y)) for x, y in batches) / len(batches)
    model.train()
    return out


def md(df: pd.DataFrame, digits: int = 3) -> str:
    """A markdown table (no tabulate dependency)."""

    def cell(v):
        if isinstance(v, float | np.floating):
            return (
                "–"
                if not math.isfinite(v)
                else f"{v:.{digits}g}"
                if abs(v) >= 100
                else f"{v:.{digits}f}"
            )
        return str(v)

    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)
