"""``lp.health``'s bound and scaling lines under the optimizer the model trains with.

The SGD lines (:func:`loopprobe.estimate.health_checks.alignment_rows`) judge seed 002's
``M_g kappa_R (beta/alpha)^2``. For an Adam/AdamW step the one-step change follows this
project's Adam form ``J_g kappa^U_R (beta/alpha)`` instead (docs/definitions.md §8), whose
growth in R is ``R^(gamma_U - 2p)`` and whose flat exponent is ``p >= gamma_U / 2``;
:func:`optimizer_rows` rewrites the two lines for it and says which optimizer they assume.
An optimizer with no derived form (SGD with momentum history, others) gets the SGD lines
with a note that they assume SGD.
"""

from __future__ import annotations

import math

from loopprobe import theory
from loopprobe.estimate.alignment import AlignmentReport
from loopprobe.estimate.health_checks import (
    FINE,
    INFERENCE,
    MEASUREMENT,
    RISK,
    SCALING_TOL,
    UNKNOWN,
    _body,
    _row,
    _verdict,
)
from loopprobe.estimate.steps import OptimizerArg, optimizer_family, optimizer_name

#: the Adam form's per-sublayer size kappa^U_R (beta/alpha) at most (one unscaled visit's)
ADAM_MAX = 1.0


def optimizer_rows(
    rows: list[dict], rep: AlignmentReport, scales: tuple, optimizer: OptimizerArg
) -> tuple[list[dict], dict]:
    """``rows`` with the bound and scaling lines for ``optimizer``; values to add."""
    name, family = optimizer_name(optimizer), optimizer_family(optimizer)
    values: dict = {"optimizer": name, "bound_form": "M_g κ_R (β/α)²"}
    alpha, beta, _ = scales
    if family == "sgd" or alpha is None or beta is None:
        return rows, values
    if family == "other":
        for r in rows:
            if r["check"] in ("bound", "scaling"):
                r["why"] = (r["why"] + "; " if r["why"] else "") + (
                    f"assumes SGD steps; no form is derived for {name} (docs/definitions.md §8)"
                )
        return rows, values
    body = _body(rep)
    seen = body[body.R_g > 0]
    kU = seen.U_tied / seen.U_max
    kappa_U, J_g, R = float(kU.max()), len(seen), int(seen.R_g.max())
    ratio = beta / alpha
    size = kappa_U * ratio
    values.update(bound_form="J_g κ^U_R (β/α)", kappa_U=kappa_U, bound=J_g * size)
    unsure = "" if rep.converged else f"κ^U_R from unconverged norms: {rep.reason}"
    side = None if unsure or not math.isfinite(size) else size <= ADAM_MAX
    meas = (f"{J_g * size:.3g} = J_g κ^U_R (β/α) under {name} (J_g = {J_g}, κ^U_R = "
            f"{kappa_U:.3g}, β/α = {ratio:.4g}; SGD's M_g κ_R (β/α)² would be "
            f"{rows_value(rows, 'bound'):.3g})")  # fmt: skip
    advice = {True: f"one {name} step moves F by O(lr) per sublayer whatever R is",
              False: f"one {name} step moves F about {size:.3g}× more per sublayer than one "
                     "unscaled visit: lower the learning rate by that factor, or use the "
                     "scaling line's α, β",
              None: unsure or "κ^U_R is not a number"}[side]  # fmt: skip
    caveat = ("the Adam form is checked at a fresh optimizer's step; along training its slope "
              "in R drifts (docs/results/tied-bound.md)")  # fmt: skip
    bound = _row("bound", MEASUREMENT, _verdict(side), J_g * size, meas, unsure or caveat,
                 {True: FINE, False: RISK, None: UNKNOWN}[side], advice)  # fmt: skip
    bound.update(claim=f"the tied bound under {name}, J_g κ^U_R (β/α), is O(1)",
                 threshold=f"κ^U_R (β/α) ≤ {ADAM_MAX:g}",
                 predicted="Adam form (definitions §8): grows like R^(γ_U − 2p)")  # fmt: skip
    out = [bound if r["check"] == "bound" else r for r in rows]
    values["N"] = max(float(body.R_g.sum()) / 2, 1.0)  # as the SGD lines: N = M_g / 2
    out = [_scaling(r, kappa_U, R, alpha / beta, unsure, name, values)
           if r["check"] == "scaling" else r for r in out]  # fmt: skip
    return out, values


def rows_value(rows: list[dict], check: str) -> float:
    return next((float(r["value"]) for r in rows if r["check"] == check), float("nan"))


def _scaling(row: dict, kappa_U: float, R: int, a_over_b: float, unsure, name, values) -> dict:
    """The exponent p of α, β against ``gamma_U / 2`` (the Adam form flat in R)."""
    N = values["N"]
    p = row["value"]
    if R < 2 or not kappa_U > 0 or not math.isfinite(p):
        return row | {"why": "one visit per sublayer or κ^U_R = 0: no growth in R to read"}
    gamma = min(max(math.log(kappa_U) / math.log(R), 0.0), 1.0)
    need = theory.adam_exponent_threshold(gamma)
    values.update(gamma_U=gamma, p_needed=need)
    side = p >= need - SCALING_TOL
    sc = theory.scales(N, "postp", p=need) if need > 0 else None
    use = f"α = {sc.alpha:.4g}, β = {sc.beta:.4g}" if sc else "any α, β"
    new = _row("scaling", INFERENCE, _verdict(side), p, row["measured"],
               unsure or f"assumes κ^U_R = Θ(R^γ_U) with γ_U read at this one R ({name})",
               FINE if side else RISK,
               f"α, β already keep the {name} change flat in R" if side
               else f"use {use} (p = {need:.3g}) at N = {N:g}")  # fmt: skip
    return new | {"claim": f"α, β keep the {name} bound flat in R",
                  "predicted": f"p ≥ γ_U/2 = {need:.3g} (γ_U = ln κ^U_R / ln R = {gamma:.3g})",
                  "threshold": f"p ≥ γ_U/2 − {SCALING_TOL:g}"}  # fmt: skip
