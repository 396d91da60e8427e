"""pytest entry point: every statement must pass and every wrong variant must fail.

Runs the same checks as ``python -m proofs_check`` (profile from HYPOTHESIS_PROFILE:
``thorough`` selects the thorough profile, anything else the CI one).
"""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest

import proofs_check as pc
from proofs_check.__main__ import main

PROFILE = "thorough" if os.environ.get("HYPOTHESIS_PROFILE") == "thorough" else "ci"


def _id(check: pc.Check) -> str:
    return f"{check.module}: {check.name}"


@pytest.mark.parametrize("check", pc.checks("statement"), ids=_id)
def test_statement_of_the_theory_holds(check):
    result = check.run(PROFILE)
    assert result.status == "pass", f"{result.figure}\n{result.note}"


@pytest.mark.parametrize("check", pc.checks("wrong variant"), ids=_id)
def test_wrong_variant_of_a_statement_is_rejected(check):
    result = check.run(PROFILE)
    assert result.status == "fail", (
        f"wrong variant not rejected ({result.status}): {result.figure}\n{result.note}"
    )


def test_every_statement_module_has_a_docstring_and_registers_a_statement():
    import importlib

    for name in pc.MODULES:
        mod = importlib.import_module(f"proofs_check.{name}")
        assert mod.__doc__ and "cannot establish" in mod.__doc__, name
        assert any(c.module == name and c.kind == "statement" for c in pc.REGISTRY), name


def test_json_output_lists_statement_reference_method_status_and_figure():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["--json", "--only", "deepnorm_constants"])
    rows = json.loads(out.getvalue())
    assert code == 0 and len(rows) == 2
    for row in rows:
        assert {"statement", "reference", "method", "status", "figure"} <= set(row)
        assert row["method"] in ("symbolic", "property", "rate", "exact", "count")
    assert [r["status"] for r in rows] == ["pass", "fail"]


def test_a_crashing_check_is_reported_as_error_and_is_not_ok():
    def boom(profile):
        raise RuntimeError("broken oracle")

    check = pc.Check("boom", "nowhere", "exact", "wrong variant", boom, "test")
    result = check.run("ci")
    assert result.status == "error" and not result.ok and "broken oracle" in result.figure
