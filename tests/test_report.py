"""Tests for `loopprobe report`: files written, images that open, user models, bad input."""

from __future__ import annotations

import json
import re
import textwrap

import matplotlib.image
import pytest

from loopprobe import report
from loopprobe.cli import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    """One `loopprobe report --quick` run shared by the tests that read its output."""
    out = tmp_path_factory.mktemp("report")
    code = main(["report", "--quick", "--out", str(out), "--no-progress"])
    return code, out


def test_quick_report_writes_index_results_and_at_least_four_figures(quick_report):
    code, out = quick_report
    assert code == 0
    assert (out / "index.html").stat().st_size > 0
    results = json.loads((out / "results.json").read_text())
    expected = {s.key: "ok" for s in report.SECTIONS}
    expected["health"] = "skipped"  # a user model's check; the reference's verdicts are below
    assert {k: v["status"] for k, v in results["sections"].items()} == expected
    verdicts = results["verdicts"]  # every prediction judged, gathered at the top
    assert {v["section"] for v in verdicts} == {
        "alignment",
        "increments",
        "coordcheck",
        "fixedpoint",
        "reproductions",
    }
    assert {v["verdict"] for v in verdicts} <= {"holds", "does not hold", "cannot tell"}
    assert all(v["expected"] for v in verdicts)
    assert "<h2 id='verdicts'>Verdicts</h2>" in (out / "index.html").read_text()
    assert len(list(out.glob("*.png"))) >= 4
    assert len(list(out.glob("*.csv"))) >= 5


def test_every_img_in_index_html_exists_and_opens_as_a_png(quick_report):
    _, out = quick_report
    srcs = re.findall(r"<img src='([^']+)'", (out / "index.html").read_text())
    assert len(srcs) >= 4
    for src in srcs:
        data = (out / src).read_bytes()
        assert data[:8] == PNG_SIGNATURE and len(data) > 1000
        img = matplotlib.image.imread(out / src)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


def test_the_alignment_section_reports_kappa_per_R_and_fitted_next_to_predicted_slopes(
    quick_report,
):
    _, out = quick_report
    sec = json.loads((out / "results.json").read_text())["sections"]["alignment"]
    rows = sec["values"]["rows"]
    cfg = report.ReportConfig.quick()
    assert sorted({(r["norm"], r["R"]) for r in rows}) == sorted(
        (n, R) for n in cfg.norms for R in cfg.Rs
    )
    slopes = {s["scheme"]: s for s in sec["values"]["slopes"]}
    assert slopes["deepnorm"]["predicted slope"] == 1.0
    assert slopes["deeploop"]["predicted slope"] == 0.0
    assert abs(slopes["deepnorm"]["fitted slope of ‖ΔF‖"] - 1.0) < 0.25
    assert abs(slopes["deeploop"]["fitted slope of ‖ΔF‖"]) < 0.25


def test_each_figure_comes_with_a_replot_command_that_reads_its_csv(quick_report):
    _, out = quick_report
    sections = json.loads((out / "results.json").read_text())["sections"]
    figs = [f for s in sections.values() for f in s.get("figures", [])]
    assert figs and all(f["png"] and (out / f["csv"]).exists() for f in figs)
    assert all(
        f["replot"].startswith('python -c "import pandas as pd, loopprobe as lp;') for f in figs
    )
    # the command as the report was called (main(argv), not this process's sys.argv)
    typed = f"loopprobe report --quick --out {out} --no-progress"
    assert all(
        f["recompute"] == f"{typed} --sections {key}"
        for key, s in sections.items()
        for f in s.get("figures", [])
    )


def test_the_terminal_summary_has_a_table_per_section(quick_report, capsys):
    # the fixture's output went to an earlier capture; rerun one cached section cheaply
    _, out = quick_report
    assert (
        main(
            [
                "report",
                "--quick",
                "--out",
                str(out),
                "--no-progress",
                "--sections",
                "theory,increments",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "[theory]" in text and "deepnorm" in text and "slope in R (aligned)" in text
    assert "[increments]" in text and "regime" in text and "[alignment]" not in text
    # the page keeps the sections that were not rerun
    sections = json.loads((out / "results.json").read_text())["sections"]
    assert list(sections) == [s.key for s in report.SECTIONS]
    html = (out / "index.html").read_text()  # the reference's skipped health check is left out
    assert all(f"<h2 id='{s.key}'>" in html for s in report.SECTIONS if s.key != "health")


def test_a_rerun_reads_the_sweep_cache_instead_of_recomputing(tmp_path, monkeypatch):
    calls = []
    original = report._alignment_cell

    def counting(cfg):
        calls.append(cfg)
        return original(cfg)

    counting.version = original.version
    monkeypatch.setattr(report.sections_alignment, "_alignment_cell", counting)
    tiny = report.ReportConfig(seq_len=4, d_model=8, n_heads=2, batch=1, Rs=(1, 2), power_iters=3)
    report.run_report(tmp_path, tiny, sections=["alignment"], progress=False, echo=lambda s: None)
    assert len(calls) == 4
    report.run_report(tmp_path, tiny, sections=["alignment"], progress=False, echo=lambda s: None)
    assert len(calls) == 4
    assert (tmp_path / "alignment_kappa.png").exists()


USER_MODEL = '''
import torch
from torch import nn

CALLS = []

class Loop(nn.Module):
    """A user's looped model: one block applied R times, no loopprobe conventions."""

    def __init__(self, d=6, R=3):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.block = nn.Linear(d, d)
        self.out = nn.Linear(d, 2)
        self.R = R

    def forward(self, x):
        h = self.inp(x)
        for _ in range(self.R):
            h = h + torch.tanh(self.block(h))
        return self.out(h)


def make():
    CALLS.append(1)
    torch.manual_seed(0)
    return Loop()


def batch():
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(0))


def not_a_module():
    return 42


def broken():
    raise RuntimeError("no weights here")


class BadForward(Loop):
    def forward(self, x):
        raise ValueError("user forward: shapes (4, 6) and (5, 6) do not match")


def make_bad_forward():
    return BadForward()


def make_unlooped():
    return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))


NOT_CALLABLE = 3
'''


@pytest.fixture
def user_pkg(tmp_path, monkeypatch):
    (tmp_path / "usermodels_lp.py").write_text(textwrap.dedent(USER_MODEL))
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib
    import sys

    sys.modules.pop("usermodels_lp", None)
    return importlib.import_module("usermodels_lp")


def test_a_user_model_runs_what_applies_and_says_why_the_rest_was_skipped(
    user_pkg, tmp_path, capsys
):
    out = tmp_path / "r"
    code = main(
        [
            "report",
            "--model",
            "usermodels_lp:make",
            "--inputs",
            "usermodels_lp:batch",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0
    sections = json.loads((out / "results.json").read_text())["sections"]
    status = {k: v["status"] for k, v in sections.items()}
    assert status["visits"] == "ok" and status["alignment"] == "ok"
    assert status["theory"] == "skipped" and "model.cfg" in sections["theory"]["reason"]
    assert status["fixedpoint"] == "skipped" and "step(h, x)" in sections["fixedpoint"]["reason"]
    assert (
        status["coordcheck"] == "skipped"
        and "make_model(N, seed)" in sections["coordcheck"]["reason"]
    )
    assert sections["visits"]["values"]["M"] == 3
    assert 0.0 <= sections["alignment"]["values"]["kappa"] <= 3.0 + 1e-6
    assert any("bound check skipped" in n for n in sections["alignment"]["notes"])
    text = capsys.readouterr().out
    assert "[theory] Theory: scales and predicted bounds (0.0 s): SKIPPED: needs model.cfg" in text
    html = (out / "index.html").read_text()
    assert "skipped</b>: needs the round map" in html


def run_user_report(out, factory, sections="visits,alignment,increments") -> dict:
    argv = ["report", "--model", f"usermodels_lp:{factory}", "--inputs", "usermodels_lp:batch"]
    main([*argv, "--out", str(out), "--no-progress", "--sections", sections])
    return json.loads((out / "results.json").read_text())


def test_an_error_inside_a_section_is_failed_with_its_reason_not_skipped(user_pkg, tmp_path):
    results = run_user_report(tmp_path / "r", "make_bad_forward")
    sections = results["sections"]
    for key in ("visits", "alignment", "increments"):
        assert sections[key]["status"] == "failed"
        assert sections[key]["reason"] == (
            "ValueError: user forward: shapes (4, 6) and (5, 6) do not match"
        )
    assert results["failed"] == ["visits", "alignment", "increments"]
    assert results["skipped"] == []
    html = (tmp_path / "r" / "index.html").read_text()
    assert "<b>3 section(s) raised an error</b>" in html
    assert "failed</b>: ValueError: user forward: shapes" in html
    assert "skipped</b>" not in html


def test_a_model_the_measurement_does_not_apply_to_is_skipped_with_the_reason(user_pkg, tmp_path):
    results = run_user_report(tmp_path / "r", "make_unlooped", sections="visits,alignment")
    for key in ("visits", "alignment"):
        assert results["sections"][key]["status"] == "skipped"
        assert "nothing is looped" in results["sections"][key]["reason"]
    assert results["failed"] == [] and results["skipped"] == ["visits", "alignment"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module_lp:make", "cannot import 'no_such_module_lp'"),
        ("usermodels_lp:missing", "has no attribute 'missing'"),
        ("usermodels_lp:NOT_CALLABLE", "'NOT_CALLABLE' is not callable"),
        ("usermodels_lp:not_a_module", "returned a int, not a torch.nn.Module"),
        ("usermodels_lp:broken", "broken() raised RuntimeError: no weights here"),
        ("usermodels_lp", "must look like package.module:factory"),
    ],
)
def test_a_bad_model_spec_is_a_one_line_error_with_exit_code_2(
    user_pkg, tmp_path, capsys, spec, message
):
    code = main(
        [
            "report",
            "--model",
            spec,
            "--inputs",
            "usermodels_lp:batch",
            "--out",
            str(tmp_path / "r"),
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("loopprobe report: error: ") and message in err
    assert err.count("\n") == 1
    assert not (tmp_path / "r" / "index.html").exists()


def test_an_unwritable_out_is_an_error_before_any_computation(user_pkg, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    code = main(
        [
            "report",
            "--model",
            "usermodels_lp:make",
            "--inputs",
            "usermodels_lp:batch",
            "--out",
            str(blocker / "sub"),
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "is not a writable directory" in err and err.count("\n") == 1
    assert user_pkg.CALLS == []  # the factory was never called


def test_unknown_sections_and_inputs_without_model_are_rejected(tmp_path, capsys):
    assert main(["report", "--sections", "theory,nope", "--out", str(tmp_path)]) == 2
    assert "--sections: unknown ['nope']" in capsys.readouterr().err
    assert main(["report", "--inputs", "x:y", "--out", str(tmp_path)]) == 2
    assert "--inputs needs --model" in capsys.readouterr().err


def test_the_report_asks_kappa_for_a_bound_its_precision_can_reach():
    # a 1e-4 bound on kappa is below float32 roundoff from R 2 on (the reference cells ended
    # at 1.1e-4 to 4e-4, marked not converged); float32 takes its own default (1e-3)
    import torch

    from loopprobe.report.sections_alignment import report_tol

    model = torch.nn.Linear(3, 3)
    assert report_tol(model) is None
    assert report_tol(model.double()) == 1e-4
