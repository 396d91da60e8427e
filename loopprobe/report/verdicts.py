"""Verdicts: each prediction a section compares against, judged with the tolerance used.

A :class:`Verdict` is one claim of a seed, what was measured, what was expected and with
which tolerance, and one of three answers: ``holds``, ``does not hold`` or ``cannot
tell`` (an estimate did not converge, or there are too few points to fit). Sections put
their verdicts in ``Result.values["verdicts"]``; the pipeline gathers them at the top of
``results.json`` and of ``index.html`` and under the terminal summary.

The tolerances are the acceptance bands the README and the tests state: a log-log slope
within 0.15 of its prediction, C within a factor 2 across R, ``kappa_R / R >= 0.8`` for
"aligned at initialization", and ``||dh*/dx|| <= 1e-8`` (float64) for "no input
dependence". Definitions: docs/definitions.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import pandas as pd

HOLDS, FAILS, UNKNOWN = "holds", "does not hold", "cannot tell"
SLOPE_TOL = 0.15  # a fitted log-log slope against its predicted value
C_BAND = 2.0  # max C / min C across R
ALIGNED = 0.8  # kappa_R / R at the largest R, "visits aligned"
NO_DEPENDENCE = 1e-8  # ||dh*/dx|| in float64, "no input dependence"
MIN_POINTS = 3  # values of R or N needed for a slope


@dataclass(frozen=True)
class Verdict:
    """One claim, judged: ``verdict`` is ``holds``, ``does not hold`` or ``cannot tell``."""

    section: str
    claim: str
    verdict: str
    measured: str
    expected: str
    why: str = ""
    kind: str = ""  # "measurement" or "inference" where a section says (the health check)

    def line(self) -> str:
        why = f"; {self.why}" if self.why else ""
        kind = f" ({self.kind})" if self.kind else ""
        claim = f"{self.claim}{kind}"
        return f"[{self.verdict}] {claim}: {self.measured} (expected {self.expected}{why})"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def slope_verdict(
    section: str,
    claim: str,
    slope: float,
    predicted: float,
    *,
    points: int,
    converged: bool = True,
    reason: str = "",
    tol: float = SLOPE_TOL,
) -> Verdict:
    """A fitted slope against its prediction, within ``tol``."""
    measured, expected = f"slope {slope:+.3f}", f"{predicted:+.2f} ± {tol:g}"
    if points < MIN_POINTS or not math.isfinite(slope) or not math.isfinite(predicted):
        why = f"{points} points (need {MIN_POINTS})" if points < MIN_POINTS else "no finite slope"
        return Verdict(section, claim, UNKNOWN, measured, expected, why)
    if not converged:
        return Verdict(section, claim, UNKNOWN, measured, expected, reason or "not converged")
    ok = abs(slope - predicted) <= tol
    return Verdict(section, claim, HOLDS if ok else FAILS, measured, expected)


def band_verdict(section: str, claim: str, values: Sequence[float], band: float) -> Verdict:
    """``max / min`` of positive values within ``band``."""
    vals = [v for v in values if math.isfinite(v) and v > 0]
    expected = f"max/min <= {band:g}"
    if len(vals) < 2:
        return Verdict(section, claim, UNKNOWN, f"{len(vals)} values", expected, "too few values")
    ratio = max(vals) / min(vals)
    return Verdict(
        section, claim, HOLDS if ratio <= band else FAILS, f"max/min {ratio:.3f}", expected
    )


def alignment_verdicts(bound: pd.DataFrame, slopes: pd.DataFrame) -> list[Verdict]:
    """Per scheme: the bound's slope in R, C within a band, and alignment at init."""
    out = []
    for row in slopes.to_dict("records"):
        scheme = row["scheme"]
        sub = bound[bound["norm"] == scheme]
        converged = bool(sub["converged"].all())
        bad = int((~sub["converged"].astype(bool)).sum())
        reason = f"κ_R not converged at {bad} of {len(sub)} R values (the section's reason column)"
        out.append(
            slope_verdict(
                "alignment",
                f"{scheme}: ‖ΔF‖ after one step grows in R as M_g κ_R (β/α)² predicts",
                row["fitted slope of ‖ΔF‖"],
                row["predicted slope"],
                points=len(sub),
                converged=converged,
                reason=reason,
            )
        )
        claim_c = f"{scheme}: C is a constant in R"
        out.append(band_verdict("alignment", claim_c, sub["C"], C_BAND))
        last = sub.loc[sub["R"].idxmax()]
        ratio = float(last["kappa"]) / float(last["R"])
        expected = f"κ_R/R >= {ALIGNED:g} at R = {int(last['R'])}"
        claim, measured = f"{scheme}: visits are aligned at initialization", f"κ_R/R = {ratio:.2f}"
        if not bool(last["converged"]):
            verdict, why = UNKNOWN, "κ_R not converged"
        else:
            verdict, why = (HOLDS if ratio >= ALIGNED else FAILS), ""
        out.append(Verdict("alignment", claim, verdict, measured, expected, why))
    return out


def growth_verdicts(summary: pd.DataFrame, points: int) -> list[Verdict]:
    """Per (tying, residual rule): the growth exponent against its regime's prediction."""
    return [
        slope_verdict(
            "increments",
            f"{r['tying']}, residual {r['residual']}: ‖h_N − h_0‖/‖h_0‖ grows like N^p "
            f"(regime seen: {r['regime']})",
            float(r["growth slope"]),
            float(r["predicted"]),
            points=points,
        )
        for r in summary.to_dict("records")
    ]


def coordcheck_verdicts(flat: pd.DataFrame, points: int) -> list[Verdict]:
    """Loop-μP's prediction: under 1/N (or loop-mup) the state change is flat in N."""
    out = []
    for r in flat.to_dict("records"):
        scheme = str(r.get("scheme", ""))
        if not scheme.endswith(("1/N", "loop-mup")):
            continue
        out.append(
            slope_verdict(
                "coordcheck",
                f"{scheme} ({r.get('group', '')}): the change of h_N since step 0 is flat in N",
                float(r["slope"]),
                0.0,
                points=points,
            )
        )
    return out


def fixedpoint_verdicts(table: pd.DataFrame) -> list[Verdict]:
    """Per variant: a reachable fixed point (with recall: input-dependent; without: not)."""
    out = []
    for r in table.to_dict("records"):
        name = r["variant"]
        reached = bool(r["converged"])
        rho = r.get("ρ(∂T/∂h)", math.nan)
        out.append(
            Verdict(
                "fixedpoint",
                f"{name}: iterating the round reaches a fixed point",
                HOLDS if reached else FAILS,
                f"{'reached' if reached else 'not reached'}, ρ = {rho:.3f} at "
                f"{r.get('ρ at', 'the reached state')}",
                "residual ≤ 1e-6",
            )
        )
        dep = r.get("‖dh*/dx‖ implicit", math.nan)
        no_recall = name.startswith("recall=none")
        claim = f"{name}: the fixed point {'does not depend' if no_recall else 'depends'} on x"
        expected = f"‖dh*/dx‖ {'≤' if no_recall else '>'} {NO_DEPENDENCE:g}"
        if not reached or not math.isfinite(dep) or not r.get("dh/dx converged", False):
            out.append(Verdict("fixedpoint", claim, UNKNOWN, f"‖dh*/dx‖ = {dep:.3g}", expected,
                               "no converged fixed point or derivative"))  # fmt: skip
            continue
        ok = dep <= NO_DEPENDENCE if no_recall else dep > NO_DEPENDENCE
        out.append(Verdict("fixedpoint", claim, HOLDS if ok else FAILS, f"‖dh*/dx‖ = {dep:.3g}",
                           expected))  # fmt: skip
    return out


def summary_lines(verdicts: Sequence[dict]) -> list[str]:
    """One line per verdict, for the terminal and the HTML summary."""
    return [Verdict(**v).line() for v in verdicts]
