"""The report: diagnostics -> tidy frames -> figures -> ``index.html``, ``results.json``, CSVs.

A report is a list of :class:`Section` objects. Each section is one function
``run(ctx) -> Result``: it measures (through the library's estimators and
:func:`loopprobe.sweep`), returns tidy frames, the figures drawn from them by
:mod:`loopprobe.plots`, a short summary table for the terminal and the numbers for
``results.json``. A section that does not apply to the model raises :class:`Skip` with
the reason; one that fails is reported as failed and the others still run. Adding a
section is adding one function and one entry in :data:`SECTIONS`.

Without a user model every section runs on the reference
:class:`~loopprobe.models.LoopedGPT` (:class:`ReportConfig`, sized for 2 CPU cores):

- ``theory``: α, β, β/α and the predicted bound for DeepNorm vs DeepLoop (Li et al.);
- ``visits``: physical sublayers and visits found on the model, M and M_g vs 2KR;
- ``alignment``: κ_R and the bound check over R per scheme, fitted vs predicted slopes;
- ``increments``: growth of ‖h_N − h_0‖/‖h_0‖ over N per residual rule and tying;
- ``coordcheck``: mup-style coordinate check across N after a few Adam steps;
- ``fixedpoint``: reachability, ρ(∂T/∂h) and ‖dh*/dx‖ for recall variants trained briefly.

Example::

    from loopprobe.report import ReportConfig, run_report
    summary = run_report("loopprobe-report", ReportConfig.quick())

The package reads in page order: :mod:`.config` (sizes and records), :mod:`.common`
(reference and user models), the sections (:mod:`.sections_alignment`,
:mod:`.sections_growth`, :mod:`.sections_fixedpoint`, listed in :mod:`.sections`),
:mod:`.pipeline` (run and write) and :mod:`.render` (terminal summary and HTML).
"""

from __future__ import annotations

from loopprobe.report.common import first_tensor, load_user_model  # noqa: F401 - re-exported
from loopprobe.report.config import Context, Fig, ReportConfig, Result, Section, Skip, UserModel
from loopprobe.report.pipeline import check_out_dir, run_report
from loopprobe.report.render import format_summary, main_command, render_html  # noqa: F401
from loopprobe.report.sections import SECTIONS
from loopprobe.report.sections_alignment import (  # noqa: F401 - re-exported
    _alignment_cell,
    alignment_section,
    theory_section,
    visits_section,
)
from loopprobe.report.sections_fixedpoint import fixedpoint_section  # noqa: F401
from loopprobe.report.sections_growth import coordcheck_section, increments_section  # noqa: F401

__all__ = [
    "Context",
    "Fig",
    "ReportConfig",
    "Result",
    "SECTIONS",
    "Section",
    "Skip",
    "UserModel",
    "check_out_dir",
    "load_user_model",
    "run_report",
]
