"""Ctrl-C during `loopprobe report`: one line, exit 130, and no empty folder left behind."""

from __future__ import annotations

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
