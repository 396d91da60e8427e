"""The committed verdict table (``studies/verdicts.csv``) against the studies' own analysis, and
the report's one path to it (``--studies DIR``, default ``./studies``)."""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess
import sys

import pandas as pd
import pytest

from loopprobe import report
from loopprobe.cli import main
from loopprobe.report.config import Context
from loopprobe.report.sections_repro import COLUMNS, reproductions_section
from studies import verdicts as study_verdicts

ROOT = pathlib.Path(__file__).resolve().parents[1]
STUDIES = ROOT / "studies"


def test_the_committed_verdict_table_is_what_the_analysis_gives_from_the_committed_cells():
    committed = pd.read_csv(study_verdicts.VERDICTS, keep_default_na=False, dtype=str)
    recomputed = study_verdicts.frame(study_verdicts.collect(STUDIES)[1])
    assert list(committed.columns) == list(COLUMNS) == study_verdicts.COLUMNS
    pd.testing.assert_frame_equal(committed, recomputed.astype(str), check_dtype=False)
    assert set(committed["study"]) == {"lr_transfer", "reachability", "deeploop", "lr_edge",
                                       "lr_l", "finite_step", "flt"}  # fmt: skip


def test_the_report_shows_every_row_of_the_table_and_nothing_else(tmp_path):
    table = pd.DataFrame(
        [["s1", "a claim", "holds", "x 1.0 [0.9, 1.1]", "> 0.5", ""],
         ["s2", "another", "cannot tell", "y", "z", "the interval contains 0"]],
        columns=COLUMNS,
    )  # fmt: skip
    table.to_csv(tmp_path / "verdicts.csv", index=False)
    cfg = dataclasses.replace(report.ReportConfig.quick(), studies=str(tmp_path))
    res = reproductions_section(Context(cfg=cfg))
    got = [(v["claim"], v["verdict"], v["measured"], v["why"]) for v in res.values["verdicts"]]
    assert got == [("a claim", "holds", "x 1.0 [0.9, 1.1]", ""),
                   ("another", "cannot tell", "y", "the interval contains 0")]  # fmt: skip
    assert res.summary.set_index("study").loc["s2", "cannot tell"] == 1


def test_a_malformed_table_is_refused_with_what_to_run(tmp_path):
    cfg = dataclasses.replace(report.ReportConfig.quick(), studies=str(tmp_path))
    pd.DataFrame({"study": ["s"], "claim": ["c"]}).to_csv(tmp_path / "verdicts.csv", index=False)
    with pytest.raises(ValueError, match="lacks columns .*python -m studies"):
        reproductions_section(Context(cfg=cfg))
    row = dict.fromkeys(COLUMNS, "x")
    pd.DataFrame([{**row, "verdict": "maybe"}]).to_csv(tmp_path / "verdicts.csv", index=False)
    with pytest.raises(ValueError, match="verdicts \\['maybe'\\] are not"):
        reproductions_section(Context(cfg=cfg))


def test_the_report_reads_dot_studies_by_default_and_a_bad_studies_dir_stops_before_work(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(ROOT)  # as ./run.sh does
    res = reproductions_section(Context(cfg=report.ReportConfig.quick()))
    assert len(res.values["verdicts"]) == len(pd.read_csv(study_verdicts.VERDICTS))
    out = tmp_path / "r"
    code = main(["report", "--sections", "reproductions", "--out", str(out), "--no-progress",
                 "--studies", str(tmp_path / "nowhere")])  # fmt: skip
    assert code == 2 and not out.exists()
    assert "no verdicts.csv there" in capsys.readouterr().err


def test_the_library_never_imports_the_studies():
    code = ("import sys, loopprobe, loopprobe.report, loopprobe.experiments, loopprobe.cli; "
            "from loopprobe.report.sections import SECTIONS; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'studies'))")  # fmt: skip
    got = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "tests", capture_output=True,
                         text=True, check=True)  # fmt: skip
    assert got.stdout.strip() == "[]"
    texts = {p: p.read_text() for p in (ROOT / "loopprobe").rglob("*.py")}
    offenders = [str(p) for p, t in texts.items() if "import studies" in t or "from studies" in t]
    assert offenders == []


def test_every_study_folder_is_run_by_python_m_studies_and_judged_into_the_table(capsys):
    import importlib

    from studies import judges
    from studies.__main__ import STUDIES as RUN
    from studies.__main__ import main as studies_main

    folders = sorted(p.parent.name for p in STUDIES.glob("*/run.py"))
    assert sorted(RUN) == folders
    assert all(callable(importlib.import_module(f"studies.{n}.run").main) for n in RUN)
    assert set(judges.STUDIES) | {"lr_transfer", "reachability"} == set(RUN)
    assert studies_main(["nosuch"]) == 2
    assert "choose from lr_transfer, reachability" in capsys.readouterr().err
