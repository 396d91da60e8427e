"""Ctrl-C during `loopprobe report`: one line, exit 130, and no empty folder left behind."""

from __future__ import annotations

import dataclasses

import pytest

from loopprobe import report
from loopprobe.cli import main


def _interrupt_after(write: str | None):
    def run_report(out, *_a, **_k):
        if write:
            (report.check_out_dir(out) / write).write_text("partial")
        raise KeyboardInterrupt

    return run_report


@pytest.mark.parametrize("write", [None, "theory_bounds.csv"])
def test_ctrl_c_removes_the_folders_it_created_only_while_they_hold_no_file(
    write, monkeypatch, tmp_path, capsys
):
    monkeypatch.setattr(report, "run_report", _interrupt_after(write))
    out = tmp_path / "new" / "deep"
    assert main(["report", "--sections", "theory", "--out", str(out), "--no-progress"]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    if write is None:
        assert not (tmp_path / "new").exists()  # nothing written: nothing left
    else:
        assert (out / write).read_text() == "partial"  # a file written is kept with its folder


def test_ctrl_c_keeps_a_folder_that_existed_before(monkeypatch, tmp_path):
    monkeypatch.setattr(report, "run_report", _interrupt_after(None))
    out = tmp_path / "mine"
    out.mkdir()
    assert main(["report", "--sections", "theory", "--out", str(out), "--no-progress"]) == 130
    assert out.is_dir()


class _CtrlCInFinaliser:
    """Where a SIGINT's handler can run: inside a finaliser, where Python cannot raise."""

    def __del__(self):
        raise KeyboardInterrupt


def test_a_ctrl_c_a_finaliser_swallowed_still_stops_the_report(monkeypatch, tmp_path, capsys):
    # Seen under load with a real SIGINT: "Exception ignored in: <weakref callback>" and the
    # report ran on to the end (exit 0, folder written). Now the next section boundary raises.
    from loopprobe.report import pipeline, sections

    ran = []
    i = next(i for i, s in enumerate(sections.SECTIONS) if s.key == "theory")
    original = sections.SECTIONS[i].run

    def run_then_ctrl_c(ctx):
        res = original(ctx)
        _CtrlCInFinaliser()  # collected at once: its KeyboardInterrupt is unraisable
        ran.append(ctx)
        return res

    planted = dataclasses.replace(sections.SECTIONS[i], run=run_then_ctrl_c)
    replaced = [*sections.SECTIONS[:i], planted, *sections.SECTIONS[i + 1 :]]
    monkeypatch.setattr(sections, "SECTIONS", replaced)
    monkeypatch.setattr(pipeline, "SECTIONS", replaced)
    out = tmp_path / "r"
    argv = ["report", "--sections", "theory,visits", "--out", str(out), "--no-progress"]
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert ran and err.count("\n") == 1 and "interrupted" in err and "ignored" not in err
    assert not out.exists()


def test_outside_the_cli_a_finalisers_ctrl_c_is_left_to_python(monkeypatch):
    import sys

    from loopprobe._interrupt import check

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(type(u.exc_value)))
    _CtrlCInFinaliser()
    check()  # the library in a user's process records nothing: no late KeyboardInterrupt
    assert seen == [KeyboardInterrupt]  # Python's own hook had it, as without loopprobe
