"""Section ``reproductions``: issue 17's training studies, judged from their cached CSVs.

The studies train hundreds of models (hours; ``scripts/lr_transfer_study.py``,
``scripts/reachability_study.py``); the report only reads their committed cells and applies
the pre-stated criteria (:mod:`loopprobe.experiments.reproductions`), so it stays fast.
"""

from __future__ import annotations

import math
import pathlib

import pandas as pd

from loopprobe.experiments.reproductions import (
    LR_RUNS,
    MARGIN,
    PREDICTED_DRIFT,
    lr_claim,
    lr_contrast,
    lr_drift,
    reach_claims,
    reach_summary,
)
from loopprobe.report.config import Context, Result, Skip
from loopprobe.report.verdicts import FAILS, HOLDS, UNKNOWN, Verdict

#: Where the cached cells live: the repository's docs/data (next to the package).
DATA = pathlib.Path(__file__).resolve().parents[2] / "docs" / "data"


def _data_dir(ctx: Context) -> pathlib.Path:
    return pathlib.Path(ctx.cfg.repro_data) if ctx.cfg.repro_data else DATA


def reproductions_section(ctx: Context) -> Result:
    """LR transfer across loop counts (per residual rule: the optimum's drift N = 1 -> 8 with
    its bootstrap interval) and fixed-point reachability (per recall variant and outer norm),
    with the verdicts stated before the runs."""
    if ctx.user is not None:
        raise Skip("the reproductions are the seeds' training studies, not a --model diagnostic")
    data = _data_dir(ctx)
    found = [r for r, spec in LR_RUNS.items() if (data / spec["cells"]).exists()]
    reach_path = data / "reachability_study.csv"
    if not found and not reach_path.exists():
        raise Skip(
            f"no cached study cells under {data} (run scripts/lr_transfer_study.py and "
            "scripts/reachability_study.py from a clone of the repository)"
        )
    frames: dict[str, pd.DataFrame] = {}
    tables: list[tuple[str, pd.DataFrame]] = []
    verdicts: list[Verdict] = []
    notes = [f"cached cells: {data}"]
    for run in found:
        spec = LR_RUNS[run]
        cells = pd.read_csv(data / spec["cells"])
        table = lr_drift(cells, half_width=spec["half_width"])
        contrast = lr_contrast(cells, half_width=spec["half_width"])
        frames[f"lr_drift_run{run}"] = table
        tables.append((f"LR transfer, run {run}: optimum drift N = 1 → 8 (octaves)", table))
        claim = lr_claim(table)
        notes.append(
            f"LR transfer run {run}: claim {claim}; contrast drift(1/√N) − drift(1/N) "
            f"{contrast['contrast']:+.2f} [{contrast['ci_low']:+.2f}, {contrast['ci_high']:+.2f}]"
            f" ({'pre-stated' if spec['contrast_prestated'] else 'post hoc'}: "
            f"{contrast['verdict']})"
        )
        verdicts += _lr_verdicts(run, table, contrast, spec["contrast_prestated"])
    if reach_path.exists():
        runs = pd.read_csv(reach_path)
        summary = reach_summary(runs)
        claims = reach_claims(runs)
        frames["reachability"] = summary
        tables.append(("Fixed-point reachability per task, recall and outer norm", summary))
        tables.append(("Reachability claims", claims))
        mapping = {"holds": HOLDS, "fails": FAILS, "undecided": UNKNOWN}
        verdicts += [
            Verdict(
                "reproductions",
                r["claim"],
                mapping.get(r["verdict"], UNKNOWN),
                r["measured"] if r["verdict"] in mapping else f"{r['measured']}; {r['verdict']}",
                r["expected"],
            )  # fmt: skip
            for r in claims.to_dict("records")
        ]
    return Result(
        frames=frames,
        tables=tables,
        summary=frames.get(f"lr_drift_run{max(found)}") if found else frames.get("reachability"),
        values={"converged": True, "reason": "", "verdicts": [v.to_dict() for v in verdicts]},
        notes=notes,
    )


def _lr_verdicts(run: int, table: pd.DataFrame, contrast: dict, prestated: bool) -> list:
    out = []
    for r in table.to_dict("records"):
        arm, predicted = r["arm"], PREDICTED_DRIFT.get(r["arm"], math.nan)
        expect = "drifts" if predicted != 0 else "stays"
        measured = f"drift {r['drift']:+.2f} [{r['ci_low']:+.2f}, {r['ci_high']:+.2f}] oct"
        verdict = UNKNOWN if r["verdict"] not in ("stays", "drifts") else (
            HOLDS if r["verdict"] == expect else FAILS)  # fmt: skip
        why = "" if verdict != UNKNOWN else (
            "optimum off the grid in > 10 % of resamples" if "grid" in r["verdict"] else
            f"the interval straddles the margin ({MARGIN:g} oct)")  # fmt: skip
        out.append(Verdict("reproductions", f"run {run}, {arm}: the optimal lr {expect} from "
                           "N = 1 to 8", verdict, measured, f"{predicted:+.1f} oct "
                           f"(margin {MARGIN:g})", why))  # fmt: skip
    if prestated:
        v = contrast["verdict"]
        verdict = {"differ as predicted": HOLDS, "do not differ as predicted": FAILS}.get(
            v, UNKNOWN
        )
        out.append(Verdict(
            "reproductions", f"run {run}: 1/√N moves the optimum more than 1/N does",
            verdict, f"drift(1/√N) − drift(1/N) = {contrast['contrast']:+.2f} "
            f"[{contrast['ci_low']:+.2f}, {contrast['ci_high']:+.2f}] oct",
            f"{contrast['predicted']:+.1f} (beyond {contrast['predicted'] / 2:+.2f})"))  # fmt: skip
    return out
