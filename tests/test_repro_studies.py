"""Issue 30's studies' verdicts: each study's own verdicts from its committed cells (and from
planted cells, to see a verdict flip), through the verdict table into the report's
``reproductions`` section."""

from __future__ import annotations

import pathlib
from dataclasses import replace

import pandas as pd
import test_deeploop_study as planted

from loopprobe import report
from loopprobe.report.config import Context
from loopprobe.report.sections_repro import reproductions_section
from loopprobe.report.verdicts import FAILS, HOLDS, UNKNOWN
from studies import verdicts as study_verdicts
from studies.deeploop import analysis as dl
from studies.judges import issue30_studies

STUDIES = pathlib.Path(__file__).resolve().parents[1] / "studies"


def _by_claim(pairs) -> dict:
    return {v.claim: v for _, v in pairs}


def test_the_committed_deeploop_and_finite_step_cells_give_the_pages_verdicts():
    _, verdicts, notes = issue30_studies(STUDIES)
    v = _by_claim(verdicts)
    post = v["DeepLoop: vs post: neutral at R = 1, better at R > 1"]
    assert post.verdict == FAILS and "R=1 neutral fails" in post.measured  # docs/studies page
    assert "R=3 improves holds" in post.measured and "R=7 improves holds" in post.measured
    sweep = v["DeepLoop: p-sweep: stability boundary near p = 1/2"]  # one R: undecided (39)
    assert sweep.verdict == UNKNOWN and "pre-registered criterion gave 'fails'" in sweep.why
    assert v["finite step: H3 Spearman(A+Q, dU) >= 0.99"].verdict == FAILS
    h1 = v["finite step: H1 quarter step recovers >= 72%"]
    assert h1.verdict == UNKNOWN and h1.why == "undecided" and "0.778" in h1.measured
    assert any(n.startswith("DeepLoop study: 12 seeds") for n in notes)
    flt = [c for c in v if c.startswith("FLT: ")]
    assert "FLT: avoids the looped transformer's collapse" in flt and len(flt) == 3
    lr_l = v["LR vs L (redesign, no gate): the optimum depends on L, not N, under 1/(N√L)"]
    assert lr_l.verdict == UNKNOWN and "seeds [100, 101, 102, 103]" in lr_l.measured  # 4 of 4
    assert "an interval overlaps its prediction's boundary" in lr_l.measured  # too wide
    assert any(n.startswith("LR-vs-L task search: 12.0 CPU-min") for n in notes)
    assert any(n.startswith("LR-vs-L redesign: 416 cells") for n in notes)


def test_planted_deeploop_gains_flip_the_report_verdict_to_holds(tmp_path):
    (tmp_path / "deeploop").mkdir()
    cells = planted.improving(gain=0.05)
    cells.to_csv(tmp_path / "deeploop" / "deeploop_study.csv", index=False)
    _, verdicts, notes = issue30_studies(tmp_path)
    v = _by_claim(verdicts)
    assert v["DeepLoop: vs post: neutral at R = 1, better at R > 1"].verdict == HOLDS
    assert v["DeepLoop: vs deepnorm: neutral at R = 1, better at R > 1"].verdict == HOLDS
    boundary = v["DeepLoop: p-sweep: stability boundary near p = 1/2"]
    assert boundary.verdict == UNKNOWN and boundary.why.startswith("undecided")  # no sweep cells
    assert sum("not judged" in n for n in notes) == 4  # the other studies have no CSV here
    harm = planted.cells({("post", 3): -0.05, ("post", 7): -0.05})  # deeploop worse at R > 1
    harm.to_csv(tmp_path / "deeploop" / "deeploop_study.csv", index=False)
    claim = _by_claim(issue30_studies(tmp_path)[1])
    assert claim["DeepLoop: vs post: neutral at R = 1, better at R > 1"].verdict == FAILS
    assert dl.claim(dl.comparisons(harm), "post")[0] == "fails"


def test_planted_study_cells_reach_the_report_through_the_verdict_table(tmp_path):
    for study in ("deeploop", "finite_step"):
        (tmp_path / study).mkdir()
    planted.improving().to_csv(tmp_path / "deeploop" / "deeploop_study.csv", index=False)
    pd.DataFrame(
        [{"criterion": "H2 sign(A+Q) accuracy >= 97%", "estimate": 0.99, "lo": 0.98, "hi": 1.0,
          "verdict": "holds"}]
    ).to_csv(tmp_path / "finite_step" / "finite_step_verdicts.csv", index=False)  # fmt: skip
    table = study_verdicts.write(tmp_path / "verdicts.csv", root=tmp_path)
    assert set(table["study"]) == {"deeploop", "finite_step"}
    cfg = replace(report.ReportConfig.quick(), studies=str(tmp_path))
    res = reproductions_section(Context(cfg=cfg))
    seen = {v["claim"].split(" [tested: ")[0]: v["verdict"] for v in res.values["verdicts"]}
    assert all("[tested: " in v["claim"] for v in res.values["verdicts"])  # issue 39.7
    assert seen["finite step: H2 sign(A+Q) accuracy >= 97%"] == HOLDS
    assert seen["DeepLoop: vs post: neutral at R = 1, better at R > 1"] == HOLDS
