"""``python -m proofs_check --model pkg.mod:factory`` runs the statements about a model on a
user's family and reports pass/fail per statement in the usual JSON."""

from __future__ import annotations

import json

from proofs_check.__main__ import main

ARGS = ["--model", "_testing_family:deeploop", "--inputs", "_testing_family:inputs", "--json"]


def test_a_deeploop_family_passes_every_statement_including_its_flat_slope(capsys):
    rc = main([*ARGS, "--R", "2,4", "--max-slope", "0.15", "--C-max", "1e-3"])
    rows = json.loads(capsys.readouterr().out)
    assert rc == 0 and len(rows) == 6
    assert all(r["status"] == "pass" and r["ok"] and r["module"] == "user_model" for r in rows)
    slope = next(r for r in rows if r["method"] == "rate")
    assert slope["figure"].startswith("slope -0.") and "in [-inf, 0.15]" in slope["figure"]


def test_a_wrong_residual_scale_fails_the_slope_row_with_the_explanation(capsys):
    args = [
        *ARGS[:1],
        "_testing_family:wrong_scale",
        *ARGS[2:],
        "--R",
        "2,4",
        "--max-slope",
        "0.15",
    ]
    rc = main(args)
    rows = {r["method"]: r for r in json.loads(capsys.readouterr().out)}
    assert rc == 1
    assert rows["rate"]["status"] == "fail" and rows["rate"]["expected"] == "pass"
    assert "slope of dF/F in R is 0.8" in rows["rate"]["figure"]  # 0.872 at R = 2, 4
    assert "alpha computed from the blocks instead of visits" in rows["rate"]["note"]
    assert rows["exact"]["status"] == "pass"  # the other statements still hold
