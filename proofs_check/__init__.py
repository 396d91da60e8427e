"""Every lemma and proposition of the seeds as an executable check that can fail.

``python -m proofs_check`` prints one row per check (statement, reference, method, status,
figure) and exits non-zero when a statement fails or a wrong variant passes;
``--json`` prints the rows as JSON; ``--thorough`` runs more examples and wider sweeps.
pytest collects ``proofs_check/test_statements.py``.

Each module holds one statement of the theory (its docstring says what, under which
assumptions, from which seed and equation, and what a numerical check cannot establish)
and, where one exists, a natural wrong variant that the same check must reject.
"""

from __future__ import annotations

import importlib

from proofs_check._registry import PROFILES, REGISTRY, Check, Outcome, Profile, Result

MODULES = (
    "deepnorm_constants",
    "deeploop_constants",
    "comparison_table",
    "rmsnorm_expansion",
    "visit_norms",
    "untied_bound",
    "tied_double_sum",
    "visit_alignment",
    "tied_bound",
    "adam_bound",
    "exponent_threshold",
    "hierarchical_counts",
    "residual_scaling",
    "lr_bound",
    "pathwise_decomposition",
    "endpoint_identity",
    "positive_gain",
    "scale_error",
    "endpoint_error",
    "root_prediction",
    "recurrence_worth",
    "recurrence_fit",
    "countable_fixed_points",
)

for _m in MODULES:
    importlib.import_module(f"proofs_check.{_m}")
REGISTRY.sort(key=lambda c: MODULES.index(c.module))  # table order = MODULES order


def checks(kind: str | None = None) -> list[Check]:
    """The registered checks (``kind``: ``"statement"``, ``"wrong variant"`` or all)."""
    return [c for c in REGISTRY if kind is None or c.kind == kind]


def run_all(profile: str = "ci", only: str | None = None) -> list[Result]:
    """Run every check (or those whose name, module or reference contains ``only``)."""
    return [
        c.run(PROFILES[profile])
        for c in REGISTRY
        if only is None or any(only in f for f in (c.name, c.module, c.reference))
    ]


__all__ = [
    "MODULES",
    "PROFILES",
    "REGISTRY",
    "Check",
    "Outcome",
    "Profile",
    "Result",
    "checks",
    "run_all",
]
