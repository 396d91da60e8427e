"""The list of sections, in page order. Adding a section is one function and one entry here."""

from __future__ import annotations

from loopprobe.report.config import Section
from loopprobe.report.sections_alignment import alignment_section, theory_section, visits_section
from loopprobe.report.sections_fixedpoint import fixedpoint_section
from loopprobe.report.sections_growth import coordcheck_section, increments_section
from loopprobe.report.sections_health import health_section
from loopprobe.report.sections_redundancy import redundancy_section
from loopprobe.report.sections_repro import reproductions_section

SECTIONS: list[Section] = [
    Section(
        "health",
        "Health check of your model",
        "Is the residual scaling / normalization right for this loop count, and where will "
        "training break (alignment, bound, increments, fixed point, gradients)?",
        health_section,
    ),
    Section(
        "theory",
        "Theory: scales and predicted bounds",
        "What does DeepLoop (Li et al.) predict for DeepNorm vs DeepLoop as the loop count R "
        "grows?",
        theory_section,
    ),
    Section(
        "visits",
        "Visits: physical sublayers and their calls",
        "Which modules are reused, how often, and how many visits carry gradient?",
        visits_section,
    ),
    Section(
        "alignment",
        "Visit alignment κ_R and the tied-depth bound",
        "Are the visits of a shared sublayer aligned (κ_R ≈ R), and does ‖ΔF‖ follow "
        "M κ_R (β/α)² as R grows?",
        alignment_section,
    ),
    Section(
        "increments",
        "Forward increments and growth regimes",
        "Do shared-weight increments add up coherently, and which residual rule keeps "
        "‖h_N − h_0‖ flat in N?",
        increments_section,
    ),
    Section(
        "coordcheck",
        "Coordinate check across loop count N",
        "After a few Adam steps, do activation updates stay the same size as N grows "
        "(the looped analogue of mup's coord check)?",
        coordcheck_section,
    ),
    Section(
        "fixedpoint",
        "Fixed points of one round",
        "Does iterating one round reach a fixed point, how fast (ρ), and does it depend "
        "on the input?",
        fixedpoint_section,
    ),
    Section(
        "redundancy",
        "Where looping is redundant (FlashLoop's observations)",
        "Do state changes concentrate on few tokens, is the cross-loop attention difference "
        "sparse, do KV residuals quantize better than K/V, and what would a lazy update cost?",
        redundancy_section,
    ),
    Section(
        "reproductions",
        "Reproductions of the papers' training claims (pre-registered studies)",
        "Which of the papers' training claims (learning-rate transfer across loop counts, "
        "reachable fixed points, DeepLoop, the edge learning rate, finite steps, the Fully "
        "Looped Transformer) hold at CPU scale, by the criteria stated before each study ran?",
        reproductions_section,
    ),
]
"""The report's sections, in page order. Append a :class:`Section` to extend the report."""
