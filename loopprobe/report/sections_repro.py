"""Section ``reproductions``: the pre-registered training studies' verdicts, read from one table.

The studies (``studies/`` in a clone of the repository: each study's driver, analysis and
committed cells) are not part of the installed package. ``python -m studies`` judges the
committed cells by the criteria stated before each run and writes one table,
``studies/verdicts.csv`` (columns ``study, claim, verdict, measured, expected, why``); this
section only reads it, so it needs no study code and stays fast. Where it looks: the
``--studies DIR`` option of ``loopprobe report`` (:attr:`ReportConfig.studies`), else
``./studies`` when it holds the table (``./run.sh`` runs the report from the repository root).
"""

from __future__ import annotations

import pathlib

import pandas as pd

from loopprobe.report.config import Context, Result, Skip
from loopprobe.report.verdicts import FAILS, HOLDS, UNKNOWN, Verdict

TABLE = "verdicts.csv"
COLUMNS = ("study", "claim", "verdict", "measured", "expected", "why")
DEFAULT_DIR = "studies"  # relative to the working directory
HOW = (
    "run `loopprobe report` from the repository root (it reads ./studies/verdicts.csv) or pass "
    "--studies DIR; `python -m studies` rewrites the table from the committed cells"
)


def verdict_table(studies: str | pathlib.Path | None) -> pathlib.Path | None:
    """The verdict table under ``studies`` (a given directory must hold it), or under
    ``./studies`` when ``studies`` is None and it exists there, else None."""
    if studies is not None:
        path = pathlib.Path(studies) / TABLE
        if not path.is_file():
            raise ValueError(f"--studies {studies}: no {TABLE} there; {HOW}")
        return path
    path = pathlib.Path(DEFAULT_DIR) / TABLE
    return path if path.is_file() else None


def read_verdicts(path: pathlib.Path) -> pd.DataFrame:
    """The table, checked: every column of :data:`COLUMNS`, verdicts the report's three."""
    table = pd.read_csv(path, keep_default_na=False, dtype=str)
    missing = [c for c in COLUMNS if c not in table]
    if missing:
        raise ValueError(f"{path}: lacks columns {missing}; {HOW}")
    bad = sorted(set(table["verdict"]) - {HOLDS, FAILS, UNKNOWN})
    if bad:
        raise ValueError(f"{path}: verdicts {bad} are not {HOLDS!r}, {FAILS!r} or {UNKNOWN!r}")
    return table[list(COLUMNS)]


def reproductions_section(ctx: Context) -> Result:
    """Every pre-registered study's claims with what was measured, judged before the runs."""
    if ctx.user is not None:
        raise Skip("the reproductions are the seeds' training studies, not a --model diagnostic")
    path = verdict_table(ctx.cfg.studies)
    if path is None:
        raise Skip(f"no study verdicts ({DEFAULT_DIR}/{TABLE} not found): {HOW}")
    table = read_verdicts(path)
    verdicts = [
        Verdict("reproductions", r["claim"], r["verdict"], r["measured"], r["expected"], r["why"])
        for r in table.to_dict("records")
    ]
    counts = pd.crosstab(table["study"], table["verdict"]).reset_index()
    counts.columns.name = None
    return Result(
        frames={"study_verdicts": table},
        tables=[("Study verdicts per claim", table), ("Verdicts per study", counts)],
        summary=counts,
        values={"converged": True, "reason": "", "verdicts": [v.to_dict() for v in verdicts]},
        notes=[
            f"verdict table: {path} (written by `python -m studies` from the committed "
            "cells; each study's design, criteria and tables: docs/studies/)"
        ],  # fmt: skip
    )
