"""DeepLoop redesign (issue 39.1): each arm at its own learning rate, and the p-sweep across R.

The cells come from ``studies/deeploop/redesign.py``; the criteria are pre-registered in
docs/studies/deeploop.md ("Redesign"), committed before any of these cells ran.
"""

from __future__ import annotations

import pandas as pd

from studies._common import here
from studies.deeploop.analysis import final_losses

PILOT_CSV = here(__file__, "deeploop_lr_pilot.csv")
OLD_PILOT_CSV = here(__file__, "deeploop_pilot.csv")  # lr 3e-3, seeds 0-2 (the same trainings)


def pilot_cells() -> pd.DataFrame:
    """The lr pilot's cells: the original pilot's (lr 3e-3) and the lr-grid pilot's."""
    import os

    frames = [pd.read_csv(OLD_PILOT_CSV)]
    if os.path.exists(PILOT_CSV):
        frames.append(pd.read_csv(PILOT_CSV))
    df = pd.concat(frames, ignore_index=True)
    return df[df["R"].isin((1, 3))].reset_index(drop=True)


def per_lr(cells: pd.DataFrame, floor: float | None = None) -> pd.DataFrame:
    """Mean final held-out loss per arm, R and lr over the seeds that ran it."""
    f = final_losses(cells, floor=floor)
    f["lr"] = cells.loc[cells["final"].astype(bool), "lr"].to_numpy()
    return (
        f.groupby(["arm", "R", "lr"])
        .agg(seeds=("loss", "size"), loss=("loss", "mean"), escaped=("escaped", "sum"))
        .reset_index()
    )


def best_lr(cells: pd.DataFrame, floor: float | None = None) -> dict:
    """(arm, R) -> the grid lr with the lowest mean final loss."""
    t = per_lr(cells, floor)
    return {k: float(g.loc[g["loss"].idxmin(), "lr"]) for k, g in t.groupby(["arm", "R"])}
