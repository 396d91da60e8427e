"""The README's trainer and reuse recipes run as a user copies them and print what it shows."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def recipes() -> dict[str, tuple[str, str]]:
    """``{name: (code, printed)}``: each python block that uses a trainer's MonitorCallback,
    with the text block right after it."""
    text = README.read_text()
    block = r"((?:(?!```).)*)"  # a fenced block's body: no fence inside
    pairs = re.findall(rf"```python\n{block}```\n\n```text\n{block}```", text, flags=re.S)
    out = {}
    for code, printed in pairs:
        m = re.search(r"loopprobe\.integrations\.(\w+) import MonitorCallback", code)
        if m:
            out[m.group(1)] = (code, printed)
        for name in ("transform_safe", "sensitivity_operators"):
            if f"lp.{name}(" in code:
                out[name] = (code, printed)
    return out


def test_the_readme_has_both_trainer_recipes():
    assert sorted(recipes()) == [
        "huggingface", "lightning", "sensitivity_operators", "transform_safe"
    ]  # fmt: skip


@pytest.mark.parametrize(
    "name", ["huggingface", "lightning", "transform_safe", "sensitivity_operators"]
)
def test_a_trainer_recipe_prints_what_the_readme_shows(name, tmp_path):
    code, printed = recipes()[name]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env,
        timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    want = printed.rstrip("\n").splitlines()
    assert run.stdout.rstrip("\n").splitlines()[-len(want) :] == want
