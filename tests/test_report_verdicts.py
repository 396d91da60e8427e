"""Verdicts: each prediction judged holds / does not hold / cannot tell, with its tolerance."""

from __future__ import annotations

import math

import pandas as pd

from loopprobe.report.verdicts import (
    FAILS,
    HOLDS,
    UNKNOWN,
    alignment_verdicts,
    band_verdict,
    coordcheck_verdicts,
    fixedpoint_verdicts,
    slope_verdict,
)


def test_a_slope_within_the_tolerance_holds_and_one_outside_does_not():
    assert slope_verdict("s", "c", 0.90, 1.0, points=4).verdict == HOLDS
    assert slope_verdict("s", "c", 0.84, 1.0, points=4).verdict == FAILS
    assert slope_verdict("s", "c", 1.16, 1.0, points=4).verdict == FAILS


def test_too_few_points_unconverged_or_nan_slopes_cannot_tell():
    assert slope_verdict("s", "c", 1.0, 1.0, points=2).verdict == UNKNOWN
    v = slope_verdict("s", "c", 1.0, 1.0, points=5, converged=False, reason="κ not converged")
    assert v.verdict == UNKNOWN and v.why == "κ not converged"
    assert slope_verdict("s", "c", math.nan, 1.0, points=5).verdict == UNKNOWN


def test_the_C_band_is_max_over_min():
    assert band_verdict("s", "c", [1.0, 1.9], 2.0).verdict == HOLDS
    assert band_verdict("s", "c", [1.0, 2.1], 2.0).verdict == FAILS
    assert band_verdict("s", "c", [1.0], 2.0).verdict == UNKNOWN


def bound_frame(kappa_last: float, converged: bool = True) -> tuple[pd.DataFrame, pd.DataFrame]:
    bound = pd.DataFrame(
        {
            "norm": ["deepnorm"] * 3,
            "R": [1, 2, 4],
            "kappa": [1.0, 1.9, kappa_last],
            "C": [1.0, 1.1, 1.2],
            "converged": [True, True, converged],
        }
    )
    slopes = pd.DataFrame(
        [{"scheme": "deepnorm", "fitted slope of ‖ΔF‖": 0.97, "predicted slope": 1.0}]
    )
    return bound, slopes


def test_alignment_verdicts_judge_slope_C_and_alignment_at_the_largest_R():
    slope, band, aligned = alignment_verdicts(*bound_frame(3.6))
    assert (slope.verdict, band.verdict, aligned.verdict) == (HOLDS, HOLDS, HOLDS)
    assert alignment_verdicts(*bound_frame(2.0))[2].verdict == FAILS  # κ_R/R = 0.5
    slope, _, aligned = alignment_verdicts(*bound_frame(3.6, converged=False))
    assert slope.verdict == UNKNOWN and aligned.verdict == UNKNOWN


def test_coordcheck_verdicts_only_judge_the_rules_that_predict_flatness():
    flat = pd.DataFrame(
        [
            {"scheme": "pre:1/N", "group": "h_N", "slope": 0.05},
            {"scheme": "pre:1/sqrt(N)", "group": "h_N", "slope": 0.4},
        ]
    )
    (v,) = coordcheck_verdicts(flat, points=4)
    assert v.verdict == HOLDS and "pre:1/N" in v.claim


def test_fixedpoint_verdicts_expect_input_dependence_only_with_recall():
    table = pd.DataFrame(
        [
            {"variant": "recall=add, outer norm", "converged": True, "ρ(∂T/∂h)": 0.7,
             "‖dh*/dx‖ implicit": 3.0, "dh/dx converged": True},
            {"variant": "recall=none, outer norm", "converged": True, "ρ(∂T/∂h)": 0.4,
             "‖dh*/dx‖ implicit": 0.5, "dh/dx converged": True},
            {"variant": "recall=none", "converged": False, "ρ(∂T/∂h)": 1.2,
             "‖dh*/dx‖ implicit": math.nan, "dh/dx converged": False},
        ]
    )  # fmt: skip
    got = [(v.claim.split(":")[0], v.verdict) for v in fixedpoint_verdicts(table)]
    assert got == [
        ("recall=add, outer norm", HOLDS),
        ("recall=add, outer norm", HOLDS),
        ("recall=none, outer norm", HOLDS),
        ("recall=none, outer norm", FAILS),  # reached, but depends on x
        ("recall=none", FAILS),  # not reached
        ("recall=none", UNKNOWN),
    ]
