"""The FLT redesign (issue 39.6): a pilot for a positive control, then LT vs FLT there.

Pre-registered in docs/studies/flt.md ("Redesign — pre-registration", committed before any
cell). Cells are trained by :func:`studies.flt.run.train_cell` (the first design's cell:
same model sizes, optimizer, warmup, no clipping, records every 10 steps) and appended to a
committed CSV as each finishes (one row per record step); a rerun skips the cells already
there, so a run on a fresh machine resumes from the repository.

- **Pilot** (exploratory, seeds 0-2): the LT only, R in {12, 24}, lr in {3e-2, 6e-2, 1e-1},
  300 steps. The positive control is the cheapest (R, lr) at which the LT collapsed in all
  3 seeds (:func:`choose_control`): the smallest R (a cell's cost grows with R), and at
  that R the smallest such lr (the mildest setting that still collapses; rule fixed before
  the pilot ran). The R = 24 cells are trained only when no lr qualifies at R = 12 (they
  cannot be cheaper). Pilot cells skip ``lp.instability`` (only the collapse matters).
- **Study** at the control: LT and FLT, seeds 100-109. (A) as in the first design
  (:func:`studies.flt.analysis.avoids`). Signals (primary): ``growth`` (the last loop's
  stream RMS at 10x its step-0 value or more) and ``grad_oscillation``, the paper's
  per-layer diagnostic (:func:`grad_oscillation`); the across-visit cosine (``oscillation``)
  is a secondary. Each is judged by :func:`studies.flt.analysis.warns`.

    nice -n 19 python -m studies flt --design redesign-pilot   # appends flt_redesign_pilot.csv
    nice -n 19 python -m studies flt --design redesign         # appends flt_redesign.csv
    python -m studies flt --design redesign --analyze          # tables and verdicts
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import pandas as pd
import torch

from studies import _common
from studies.flt import analysis as study

PILOT_CELLS = _common.here(__file__, "flt_redesign_pilot.csv")
CELLS = _common.here(__file__, "flt_redesign.csv")
PILOT_RS = (12, 24)
PILOT_LRS = (3e-2, 6e-2, 1e-1)
PILOT_SEEDS = (0, 1, 2)
SEEDS = tuple(range(100, 110))
STEPS = 300
#: the paper's oscillation diagnostic: a window of WINDOW step-to-step differences of a
#: layer's gradient norm; it fires when more than half of the WINDOW - 1 consecutive pairs
#: of differences change sign
WINDOW = 10
#: redesign signals -> CSV column (``grad_osc`` and ``growth`` are derived from the cells)
SIGNALS = {"grad_oscillation": "grad_osc", "growth": "growth", "oscillation": "n_oscillating"}
PRIMARY = ("grad_oscillation", "growth")
KEY = ["arm", "R", "lr", "seed"]


# ------------------------------------------------------------------------------ driver


def _key(c) -> tuple:
    return (str(c["arm"]), int(c["R"]), round(float(c["lr"]), 12), int(c["seed"]))


def done_keys(path: str) -> set:
    """The cells already in ``path`` (none when it does not exist)."""
    if not os.path.exists(path):
        return set()
    df = pd.read_csv(path, usecols=KEY)
    return {_key(r) for r in df.drop_duplicates().to_dict("records")}


def run_cells(cells: list[dict], path: str) -> int:
    """Train every cell not yet in ``path`` and append its rows there; how many ran."""
    from studies.flt.run import train_cell

    torch.set_num_threads(1)
    have = done_keys(path)
    todo = [c for c in cells if _key(c) not in have]
    print(f"flt redesign: {len(cells) - len(todo)} of {len(cells)} cells in {path}; "
          f"{len(todo)} to run", file=sys.stderr, flush=True)  # fmt: skip
    for i, cfg in enumerate(todo):
        t0 = time.process_time()
        rows = pd.DataFrame(train_cell(cfg))
        for k, v in reversed(cfg.items()):
            rows.insert(0, k, v)
        _append(rows, path)
        loss = rows["val_loss"].iloc[-1]
        print(f"[{i + 1}/{len(todo)}] {_key(cfg)} final val {loss:.3f} "
              f"{time.process_time() - t0:.1f} CPU-s", file=sys.stderr, flush=True)  # fmt: skip
    return len(todo)


def _append(rows: pd.DataFrame, path: str) -> None:
    """Append ``rows`` to the CSV at ``path`` in its column order; a column the file lacks
    rewrites it with that column added (empty for the earlier cells)."""
    if not os.path.exists(path):
        rows.to_csv(path, index=False, float_format="%.6g")
        return
    have = list(pd.read_csv(path, nrows=0).columns)
    if set(rows.columns) <= set(have):
        rows.reindex(columns=have).to_csv(path, mode="a", header=False, index=False,
                                          float_format="%.6g")  # fmt: skip
        return
    old = pd.read_csv(path, keep_default_na=False, na_values=[""], dtype=str)
    rows = rows.astype(object).where(rows.notna(), "")
    pd.concat([old, rows.astype(str)], ignore_index=True).reindex(
        columns=have + [c for c in rows.columns if c not in have]
    ).to_csv(path, index=False)


def cell(arm: str, R: int, lr: float, seed: int, probe: bool = True) -> dict:
    from studies.flt.run import BASE

    return {"arm": arm, "R": R, "lr": lr, **BASE, "steps": STEPS, "seed": seed, "probe": probe}


def run_pilot(path: str = PILOT_CELLS) -> tuple[int, float] | None:
    """The pilot, R by R, stopping at the first R with a control; returns the control."""
    for R in PILOT_RS:
        run_cells([cell("lt", R, lr, s, probe=False) for lr in PILOT_LRS for s in PILOT_SEEDS],
                  path)  # fmt: skip
        control = choose_control(pd.read_csv(path))
        if control is not None:
            return control
    return None


def run_study(pilot_path: str = PILOT_CELLS, path: str = CELLS) -> int:
    control = choose_control(pd.read_csv(pilot_path))
    if control is None:
        print("no positive control within budget: the study is not run", file=sys.stderr)
        return 0
    R, lr = control
    return run_cells([cell(arm, R, lr, s) for s in SEEDS for arm in ("lt", "flt")], path)


# ------------------------------------------------------------------------------ analysis


def choose_control(pilot: pd.DataFrame, floor: float | None = None) -> tuple[int, float] | None:
    """The cheapest (R, lr) where the LT collapsed in every one of >= 3 pilot seeds: the
    smallest R, then the smallest lr; None when no (R, lr) qualifies."""
    table = pilot_table(pilot, floor)
    ok = table[(table["seeds"] >= 3) & (table["collapsed"] == table["seeds"])]
    if ok.empty:
        return None
    best = ok.sort_values(["R", "lr"]).iloc[0]
    return int(best["R"]), float(best["lr"])


def pilot_table(pilot: pd.DataFrame, floor: float | None = None) -> pd.DataFrame:
    """Per (R, lr) of the LT: seeds, how many collapsed, the median final held-out loss."""
    ev = study.events(pilot, floor, signals={})
    ev = ev[ev["arm"] == study.LT]
    g = ev.groupby(["R", "lr"])
    return pd.DataFrame({"seeds": g.size(), "collapsed": g["collapsed"].sum().astype(int),
                         "final_loss_median": g["final_loss"].median(),
                         "cpu_s_mean": g["cpu_s"].mean()}).reset_index()  # fmt: skip


def pilot_signals(pilot: pd.DataFrame, floor: float | None = None) -> pd.DataFrame:
    """Exploratory, decides nothing: per pilot cell, whether it collapsed, the first record
    step where the per-layer oscillation diagnostic fired, and the share of record steps
    (from step 10) where it was on."""
    cells = grad_oscillation(pilot)
    ev = study.events(cells, floor, signals={"grad_oscillation": "grad_osc"})
    on = cells[cells["step"] >= WINDOW].groupby(KEY)["grad_osc"].apply(lambda v: (v > 0).mean())
    ev = ev.merge(on.rename("share_on").reset_index(), on=KEY)
    return ev[KEY + ["collapsed", "collapse_step", "final_loss", "fire_grad_oscillation",
                     "share_on"]]  # fmt: skip


def sign_flips(norms: np.ndarray) -> int:
    """How many consecutive pairs of step-to-step differences of ``norms`` change sign."""
    d = np.sign(np.diff(np.asarray(norms, dtype=float)))
    return int(np.sum(d[1:] * d[:-1] < 0))


def grad_oscillation(cells: pd.DataFrame) -> pd.DataFrame:
    """``cells`` with ``grad_osc``: per record row, how many layers oscillate there. A layer
    oscillates at a row when, over the last WINDOW differences of its per-step gradient
    norm (``gnorm_<k>``, the WINDOW + 1 steps up to the row's last training step), more
    than half of the WINDOW - 1 consecutive pairs change sign; rows with fewer steps
    behind them never fire."""
    cols = sorted(c for c in cells.columns if c.startswith("gnorm_"))
    if not cols:
        raise ValueError("flt.redesign.grad_oscillation: cells lack gnorm_<k> columns; train "
                         "them with studies/flt/run.py's train_cell version >= 2")  # fmt: skip
    out = []
    for _, g in cells.groupby(KEY, sort=False):
        g = g.sort_values("step").copy()
        count = np.zeros(len(g), dtype=int)
        for col in cols:
            parts = [[] if not isinstance(v, str) else [float(x) for x in v.split()]
                     for v in g[col]]  # fmt: skip
            series = np.array([x for p in parts for x in p])
            ends = np.cumsum([len(p) for p in parts]) - 1
            for i, e in enumerate(ends):
                if e >= WINDOW:
                    count[i] += sign_flips(series[e - WINDOW : e + 1]) > (WINDOW - 1) / 2
        g["grad_osc"] = count
        out.append(g)
    return pd.concat(out, ignore_index=True)


def judge(cells: pd.DataFrame, floor: float | None = None) -> dict:
    """(A) at the study's one (R, lr), and every redesign signal, as pre-registered."""
    cells = grad_oscillation(cells)
    pairs = cells[["R", "lr"]].drop_duplicates()
    if len(pairs) != 1:
        raise ValueError(f"flt.redesign.judge: cells hold {len(pairs)} (R, lr) pairs; "
                         "the redesign's study has one")  # fmt: skip
    lr = float(pairs["lr"].iloc[0])
    warns = {s: study.warns(cells, s, floor, signals=SIGNALS) for s in SIGNALS}
    return {"R": int(pairs["R"].iloc[0]), "lr": lr, "warns": warns,
            "avoids": study.avoids(cells, lr, floor, signals=SIGNALS)}  # fmt: skip


def summary_markdown(cells: pd.DataFrame | None, pilot: pd.DataFrame,
                     floor: float | None = None) -> str:  # fmt: skip
    """The pilot's collapse table, the control, and (with study cells) every verdict."""
    floor = study.unigram_floor() if floor is None else floor
    out = ["### Pilot (LT only)", "", _common.md(pilot_table(pilot, floor)), ""]
    sig = pilot_signals(pilot, floor)
    out += ["Per-layer oscillation diagnostic in the pilot cells (exploratory):", "",
            _common.md(sig), ""]  # fmt: skip
    control = choose_control(pilot, floor)
    if control is None:
        return "\n".join(out + ["no positive control within budget"])
    out.append(f"positive control: R {control[0]}, lr {control[1]:g}")
    if cells is None or cells.empty:
        return "\n".join(out)
    j = judge(cells, floor)
    ev = study.events(grad_oscillation(cells), floor, signals=SIGNALS)
    show = ev[["arm", "seed", "collapsed", "collapse_step", "final_loss"]
              + [f"fire_{s}" for s in SIGNALS] + ["cpu_s"]]  # fmt: skip
    a = j["avoids"]
    out += ["", "### Study cells", "", _common.md(show), "",
            f"- **FLT avoids the LT's collapse (R {j['R']}, lr {j['lr']:g}): {a['verdict']}** "
            f"({a['reason']})"]  # fmt: skip
    for s, w in j["warns"].items():
        tag = "" if s in PRIMARY else " (secondary)"
        out.append(f"- **{s}{tag} fires before collapse: {w['verdict']}** ({w['reason']}; "
                   f"median lead {w['median_lead']:g} steps)")  # fmt: skip
    cpu = ev["cpu_s"].sum() + study.events(pilot, floor, signals={})["cpu_s"].sum()
    out += ["", f"CPU time (pilot + study cells): {cpu / 60:.1f} CPU-minutes"]
    return "\n".join(out)
