"""``python -m proofs_check --model pkg.mod:factory``: the statements that are about a model
(the numeric and property ones) checked on the user's own family, one row each, in the
same table and JSON as the reference checks.

``factory(R)`` builds the model at R; ``--inputs pkg.mod:fn`` gives ``fn(model)`` (or
``fn()``) its inputs (default: random tokens for a model with ``cfg.vocab_size`` and
``cfg.seq_len``); ``--loss pkg.mod:fn`` is ``loss(output, inputs)`` (default ``0.5 mean
F^2``). Each statement runs one check of :mod:`loopprobe.testing`; the symbolic statements
are about the theory, not a model, and wrong variants are about the theory's wording, so
neither is run here. The slope and the stated-constant rows run only when their bound
(``--max-slope``, ``--C-max``) is given: what a family should do in R is the user's claim.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

import loopprobe.testing as lpt
from loopprobe._io import call_user, load_model, load_object
from proofs_check._registry import PROFILES, Check, Outcome, Result

REF = "seed 002"


def _inputs(spec: str | None, model: torch.nn.Module) -> Any:
    if spec is not None:
        fn = load_object(spec, "--inputs")
        try:
            return call_user(fn, "--inputs", spec, model)
        except ValueError as err:
            if not isinstance(err.__cause__, TypeError):
                raise
            return call_user(fn, "--inputs", spec)
    return lpt.reference_batch(model, torch.Generator().manual_seed(0))


def _outcome(run: Callable[[], str]) -> Outcome:
    try:
        return Outcome(True, run())
    except AssertionError as err:
        lines = str(err).splitlines()
        first, prefix = lines[0], ""
        if first.startswith("R="):  # "R=4: check_bound: what" -> "R=4: what"
            prefix, _, first = first.partition(": ")
            prefix += ": "
        return Outcome(False, (prefix + first.partition(": ")[2])[:160], "\n".join(lines))


def user_checks(
    model_spec: str,
    *,
    inputs: str | None = None,
    loss: str | None = None,
    Rs: Sequence[int] = (2, 4, 8),
    max_slope: float | None = None,
    min_slope: float | None = None,
    C_max: float | None = None,
) -> list[Check]:
    """The checks for the family ``model_spec`` (``package.module:factory``)."""
    load_object(model_spec, "--model")  # a bad spec fails here, before any check runs
    loss_fn = load_object(loss, "--loss") if loss else lpt.mean_square_loss
    R_mid = sorted(Rs)[len(Rs) // 2]

    def build(R: int) -> tuple[torch.nn.Module, Any]:
        model = load_model(model_spec, R)
        return model, _inputs(inputs, model)

    def at_each_R(check: Callable, fig: Callable[[Any], str], **kw: Any) -> Callable:
        def run() -> str:
            figs = []
            for R in Rs:
                m, x = build(R)
                try:
                    figs.append(f"R={R}: {fig(check(m, x, loss_fn, **kw))}")
                except AssertionError as err:
                    raise AssertionError(f"R={R}: {err}") from err
            return "; ".join(figs)

        return lambda profile: _outcome(run)

    def at_mid(check: Callable, fig: Callable[[Any], str], **kw: Any) -> Callable:
        def run() -> str:
            m, x = build(R_mid)
            return f"R={R_mid}: {fig(check(m, x, loss_fn, **kw))}"

        return lambda profile: _outcome(run)

    rows = [
        (
            "Eq 11 on your model: per-visit updates sum to the tied gradient",
            "exact",
            at_each_R(
                lpt.check_updates_sum_to_tied_gradient,
                lambda e: f"max rel err {max(e.values()):.1e}",
            ),
        ),
        (
            "Eq 12 on your model: 0 <= kappa_j <= R_j, converged",
            "property",
            at_each_R(lpt.check_kappa_in_range, lambda rep: f"kappa_R {rep.kappa:.3g}"),
        ),
        (
            "Eq 11 on your model: small-step change = tied first-order (JVP) change",
            "exact",
            at_mid(
                lpt.check_first_order_change,
                lambda c: f"dF true/first-order = {c.dF_true / c.dF_first:.6f}",
            ),
        ),
        (
            "probing leaves your model unchanged (params, .grad, buffers, modes, hooks, RNG)",
            "exact",
            at_mid(lpt.check_probe_leaves_model_unchanged, lambda _: "unchanged"),
        ),
    ]
    if C_max is not None:
        rows.append(
            (
                f"Eq 14 on your model: dF/F <= {C_max:g} M_g kappa_R (beta/alpha)^2",
                "property",
                at_each_R(lpt.check_bound, lambda c: f"C {c.C:.3g}", C_max=C_max),
            )
        )
    if max_slope is not None or min_slope is not None:
        lo = -float("inf") if min_slope is None else min_slope
        hi = float("inf") if max_slope is None else max_slope

        def slope() -> str:
            sw = lpt.check_bound_slope(
                lambda R: build(R)[0], lambda m: _inputs(inputs, m), loss_fn,
                max_slope=hi, min_slope=lo, Rs=Rs,
            )  # fmt: skip
            return f"slope {sw.slope:.3g} in [{lo:g}, {hi:g}], C max/min {sw.C_ratio:.3g}"

        rows.append(
            (
                f"Eq 13-16 on your model: slope of dF/F in R within [{lo:g}, {hi:g}]",
                "rate",
                lambda profile: _outcome(slope),
            )
        )
    return [
        Check(name, REF, method, "statement", func, "user_model") for name, method, func in rows
    ]


def run_user_model(model_spec: str, profile: str = "ci", **kwargs: Any) -> list[Result]:
    """Run :func:`user_checks`; a statement that crashes is an ``error`` row, as elsewhere."""
    return [c.run(PROFILES[profile]) for c in user_checks(model_spec, **kwargs)]
