"""The notebooks: stored without outputs, in sync with notebooks/build.py, and they run.

Each notebook is executed end to end with nbclient on the venv's ``python3`` kernel, from
the repository root, at the reduced size ``LOOPPROBE_NOTEBOOK_SMALL=1``.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def test_there_are_six_numbered_notebooks():
    assert [p.name[:3] for p in NOTEBOOKS] == ["01_", "02_", "03_", "04_", "05_", "06_"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_with_outputs_stripped(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_opens_with_its_question_and_seed_and_imports_only_loopprobe(path):
    nb = nbformat.read(path, as_version=4)
    first = nb.cells[0]
    assert first.cell_type == "markdown" and first.source.startswith(f"# {path.name[:2]} ·")
    assert "**Question.**" in first.source and "**Seed.**" in first.source
    imports = [
        line.split()[1].split(".")[0]
        for c in nb.cells
        if c.cell_type == "code"
        for line in c.source.splitlines()
        if line.startswith(("import ", "from "))
    ]
    assert set(imports) <= {"loopprobe", "torch", "os", "pandas"}, imports


def test_stored_notebooks_match_the_build_script():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "notebooks" / "build.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_end_to_end_at_reduced_size(path, monkeypatch):
    monkeypatch.setenv("LOOPPROBE_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    )
    client.execute()
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert errors == []
    pngs = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(pngs) >= 1  # lp.plots figures render inline without pyplot
