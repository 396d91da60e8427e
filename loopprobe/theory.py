"""The looped-Transformer theory's closed forms, as plain functions of the counts.

Notation (seed 002): ``K`` physical blocks applied for ``R`` rounds, unrolled depth
``N = K R``, ``J = 2K`` physical residual sublayers, ``M = J R = 2N`` unrolled visits.
Post-norm residual ``x <- Norm(alpha x + f(x))`` with per-matrix init gain ``beta``;
the quantity the perturbation bounds are written in is the ratio ``beta / alpha``.

Every function here is exact arithmetic on its arguments: no tensors, no models. The
measured counterparts (kappa, Delta F, counted visits) live in the estimator modules and
are compared with these numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Real

from loopprobe._checks import count as _count

RESIDUALS = ("none", "1/sqrt(N)", "1/N", "loop-mup")  # branch multiplier rules over N loops
TYINGS = ("tied", "untied")  # one block looped N times, or N distinct blocks
#: norm[:residual] schemes of the reference model that the coordinate check compares
SCHEMES = ("pre:none", "pre:1/sqrt(N)", "pre:1/N", "pre:loop-mup", "post", "deepnorm", "deeploop")
#: what the coordinate check measures per N (loopprobe.experiments.coordcheck)
COORD_QUANTITIES = ("increment", "increment_change", "state", "state_change")

__all__ = [
    "ALLOWED_NORMS",
    "ALLOWED_RESIDUALS",
    "Scales",
    "adam_bound",
    "adam_bound_exponent",
    "adam_exponent_threshold",
    "aligned_tied_bound",
    "bound",
    "bound_exponent",
    "exponent_threshold",
    "hierarchical_counts",
    "kappa_bar_g",
    "residual_multiplier",
    "scales",
    "unrolled_depth",
    "untied_bound",
    "visit_count",
]

ALLOWED_NORMS: tuple[str, ...] = ("deepnorm", "deeploop", "postp", "pre", "post", "none")
"""Residual/normalisation schemes ``scales`` knows (the models validate configs with it)."""

ALLOWED_RESIDUALS: tuple[str, ...] = ("none", "1/sqrt(N)", "1/N", "loop-mup")
"""Pre-norm residual-branch multiplier rules ``residual_multiplier`` knows."""

# Fixed exponents of the named post-norm schemes (seed 002, Eq. 3 and the DeepLoop choice).
_FIXED_P = {"deepnorm": 0.25, "deeploop": 0.5}
_UNSCALED = ("pre", "post", "none")


# --------------------------------------------------------------------------- validation


def _real(call: str, name: str, value: object, *, low: float, strict: bool = False) -> float:
    """A finite real number ``> low`` (strict) or ``>= low``, or a ValueError/TypeError."""
    relation = ">" if strict else ">="
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{call}: {name} must be a real number {relation} {low}, got {value!r}")
    x = float(value)
    if not math.isfinite(x) or x < low or (strict and x == low):
        raise ValueError(f"{call}: {name} must be a finite number {relation} {low}, got {value!r}")
    return x


# ------------------------------------------------------------------------------ scales


@dataclass(frozen=True)
class Scales:
    """Residual scale ``alpha``, init gain ``beta`` and the family exponent ``p``.

    ``alpha = (cN)^p`` multiplies the skip path before the norm; ``beta = (dN)^(-p)`` is
    a per-matrix initialisation gain on the residual-branch matrices (not a runtime
    multiplier). Reference: seed 002, Eqs. 2-4 and 15.
    """

    alpha: float
    beta: float
    p: float

    @property
    def ratio(self) -> float:
        """The update-to-residual ratio ``beta / alpha``. Reference: seed 002, Eq. 5, 8, 15."""
        return self.beta / self.alpha


def scales(
    N: float,
    norm: str = "deepnorm",
    p: float | None = None,
    c: float = 2.0,
    d: float = 8.0,
) -> Scales:
    """``alpha = (cN)^p`` and ``beta = (dN)^(-p)`` for unrolled depth ``N``.

    ``norm`` picks the exponent: ``"deepnorm"`` p = 1/4 (Eq. 3), ``"deeploop"`` p = 1/2,
    ``"postp"`` the general family with the given ``p > 0`` (Eq. 15); ``"pre"``,
    ``"post"`` and ``"none"`` use no scaling (alpha = beta = 1, p = 0). With the default
    constants (c, d) = (2, 8) the ratio is ``beta/alpha = 16^(-p) N^(-2p)``: ``1/(2 sqrt N)``
    for DeepNorm (Eq. 5) and ``1/(4N)`` for DeepLoop (Eq. 8).

    ``p`` is required for ``"postp"``; for the other schemes it may be omitted or must
    equal their fixed exponent. ``N`` may be fractional (e.g. a gradient-visible
    ``N_g = M_g / 2``) but must be ``>= 1``.

    Reference: seed 002, Eqs. 3, 5, 7, 8 and 15.

    Example: ``scales(8, "deeploop")`` -> ``Scales(alpha=4.0, beta=0.125, p=0.5)``.
    """
    call = "scales"
    if not isinstance(norm, str) or norm not in ALLOWED_NORMS:
        raise ValueError(f"{call}: norm={norm!r} is not one of {ALLOWED_NORMS}")
    N = _real(call, "N", N, low=1.0)
    c = _real(call, "c", c, low=0.0, strict=True)
    d = _real(call, "d", d, low=0.0, strict=True)
    if norm == "postp":
        if p is None:
            raise ValueError(f"{call}: norm='postp' needs an exponent p > 0, got p=None")
        p = _real(call, "p", p, low=0.0, strict=True)
    else:
        fixed = _FIXED_P.get(norm, 0.0)
        if p is not None and _real(call, "p", p, low=0.0) != fixed:
            raise ValueError(
                f"{call}: norm={norm!r} has fixed exponent p={fixed}, got p={p!r}; "
                "omit p, or use norm='postp' for a general exponent"
            )
        p = fixed
    if norm in _UNSCALED:
        return Scales(alpha=1.0, beta=1.0, p=0.0)
    return Scales(alpha=(c * N) ** p, beta=(d * N) ** (-p), p=p)


# ------------------------------------------------------------------------------ counts


def unrolled_depth(K: int, R: int) -> int:
    """Unrolled depth ``N = K R`` of K physical blocks looped for R rounds.

    Reference: seed 002, Eq. 1.
    """
    return _count("unrolled_depth", "K", K) * _count("unrolled_depth", "R", R)


def visit_count(K: int, R: int) -> int:
    """Unrolled residual-sublayer visits ``M = J R = 2 K R = 2N`` (attention + MLP per block).

    Reference: seed 002, text before Eq. 7 (and Eq. 17 with C = 1, C_L = 0).
    """
    return 2 * _count("visit_count", "K", K) * _count("visit_count", "R", R)


# ------------------------------------------------------------------------------ bounds


def bound(M: float, kappa: float, ratio: float) -> float:
    """The looped first-order perturbation bound ``M kappa_R (beta/alpha)^2`` (up to C'').

    ``kappa = 1`` gives the untied DeepNet bound (Eq. 9/10); ``kappa = R`` the aligned
    worst case (Eq. 16). Also serves the hierarchical form with ``M = M_g`` and
    ``kappa = kappa_bar_g`` (Eq. 21). Reference: seed 002, Eqs. 13 and 14.
    """
    call = "bound"
    M = _real(call, "M", M, low=0.0)
    kappa = _real(call, "kappa", kappa, low=0.0)
    ratio = _real(call, "ratio", ratio, low=0.0)
    return M * kappa * ratio**2


def untied_bound(N: int, sc: Scales) -> float:
    """Depth-untied bound ``M (beta/alpha)^2`` with ``M = 2N``; DeepNorm gives exactly 1/2.

    Reference: seed 002, Eqs. 6, 9 and 10.
    """
    M = 2 * _count("untied_bound", "N", N)
    return bound(M, 1.0, sc.ratio)


def aligned_tied_bound(K: int, R: int, sc: Scales) -> float:
    """Aligned tied-loop bound ``M R (beta/alpha)^2`` (kappa_R = R), ``M = 2KR``.

    ``sc`` should be the scales at ``N = K R``. DeepNorm gives R/2 (grows with R),
    DeepLoop gives 1/(8K) (flat in R). Reference: seed 002, Eqs. 14 and 16.
    """
    R = _count("aligned_tied_bound", "R", R)
    M = 2 * _count("aligned_tied_bound", "K", K) * R
    return bound(M, float(R), sc.ratio)


def exponent_threshold(gamma: float) -> float:
    """Smallest family exponent ``p`` keeping the bound bounded: ``(1 + gamma) / 4``.

    ``gamma`` is the alignment growth ``kappa_R = Theta(R^gamma)``, in ``[0, 1]`` because
    ``0 <= kappa_R <= R``: gamma = 0 (decorrelated) recovers DeepNorm's 1/4, gamma = 1
    (aligned) gives DeepLoop's 1/2. Derived from Eqs. 14-15 at fixed K (R = N/K), since the
    appendix statement of Prop. 3.1 is not in the seed. Reference: seed 002, Prop. 3.1.
    """
    gamma = _real("exponent_threshold", "gamma", gamma, low=0.0)
    if gamma > 1.0:
        raise ValueError(f"exponent_threshold: gamma must lie in [0, 1], got {gamma!r}")
    return (1.0 + gamma) / 4.0


def bound_exponent(p: float, gamma: float) -> float:
    """Exponent ``e`` with ``M kappa_R (beta/alpha)^2 = Theta(N^e)``: ``e = 1 + gamma - 4p``.

    From ``M = 2N``, ``kappa_R = Theta(N^gamma)`` at fixed K and ``(beta/alpha)^2 ~ N^(-4p)``;
    the bound stays O(1) iff ``e <= 0`` iff ``p >= exponent_threshold(gamma)``.
    Reference: seed 002, Eqs. 14-16 and Prop. 3.1.
    """
    p = _real("bound_exponent", "p", p, low=0.0)
    gamma = _real("bound_exponent", "gamma", gamma, low=0.0)
    if gamma > 1.0:
        raise ValueError(f"bound_exponent: gamma must lie in [0, 1], got {gamma!r}")
    return 1.0 + gamma - 4.0 * p


def adam_bound(J: float, kappa_U: float, ratio: float) -> float:
    """The one-step output change under Adam/AdamW, ``J kappa^U_R (beta/alpha)`` (up to C_A).

    This project's extension of seed 002 (docs/definitions.md, "The tied-depth bound under
    Adam"): Adam's step has per-coordinate size about ``lr`` whatever R and ``beta/alpha``,
    so of the SGD form's two factors ``R (beta/alpha)`` (the summed visit gradients) only
    the sensitivity's ``kappa^U_R (beta/alpha)`` remains; ``J`` counts the physical
    sublayers, ``kappa^U_R = max_j ||sum_r U_{r,j}|| / max_r ||U_{r,j}||`` lies in ``[0, R]``.
    """
    call = "adam_bound"
    J = _real(call, "J", J, low=0.0)
    kappa_U = _real(call, "kappa_U", kappa_U, low=0.0)
    ratio = _real(call, "ratio", ratio, low=0.0)
    return J * kappa_U * ratio


def adam_bound_exponent(p: float, gamma: float) -> float:
    """Exponent ``e`` with ``J kappa^U_R (beta/alpha) = Theta(R^e)`` at fixed K: ``gamma - 2p``.

    From ``kappa^U_R = Theta(R^gamma)`` and ``beta/alpha ~ N^(-2p)``: DeepNorm aligned
    ``1/2`` (where SGD's :func:`bound_exponent` gives 1), DeepLoop aligned ``0``. The change
    stays O(1) iff ``p >= adam_exponent_threshold(gamma) = gamma / 2``: under alignment the
    same threshold 1/2 as SGD's, but a deficit below it that grows like ``R^(1 - 2p)``, not
    ``R^(2 - 4p)``. This project's extension of seed 002 (Eqs. 14-16).
    """
    p = _real("adam_bound_exponent", "p", p, low=0.0)
    gamma = _real("adam_bound_exponent", "gamma", gamma, low=0.0)
    if gamma > 1.0:
        raise ValueError(f"adam_bound_exponent: gamma must lie in [0, 1], got {gamma!r}")
    return gamma - 2.0 * p


def adam_exponent_threshold(gamma: float) -> float:
    """Smallest ``p`` keeping the Adam form bounded in R: ``gamma / 2`` (1/2 when aligned).

    See :func:`adam_bound_exponent`; SGD's threshold is :func:`exponent_threshold`.
    """
    gamma = _real("adam_exponent_threshold", "gamma", gamma, low=0.0)
    if gamma > 1.0:
        raise ValueError(f"adam_exponent_threshold: gamma must lie in [0, 1], got {gamma!r}")
    return gamma / 2.0


# ------------------------------------------------------------------------ hierarchical


def kappa_bar_g(J_H: int, J_L: int, C_L: int, kappa_L: float, M_g: float) -> float:
    """Gradient-visible aggregate ``kappa_bar_g = (J_H + J_L C_L kappa_L) / M_g``.

    ``kappa_L`` is the L-module alignment on the gradient-visible cycle, in ``[0, C_L]``
    (triangle inequality); the H-module term uses kappa_H <= 1. ``M_g`` is passed in so
    that a *measured* gradient-visible count can be used. Reference: seed 002, Eq. 21.
    """
    call = "kappa_bar_g"
    J_H = _count(call, "J_H", J_H, minimum=0)
    J_L = _count(call, "J_L", J_L, minimum=0)
    C_L = _count(call, "C_L", C_L)
    kappa_L = _real(call, "kappa_L", kappa_L, low=0.0)
    M_g = _real(call, "M_g", M_g, low=0.0, strict=True)
    if kappa_L > C_L * (1.0 + 1e-9):
        raise ValueError(f"{call}: kappa_L must lie in [0, C_L={C_L}], got {kappa_L!r}")
    return (J_H + J_L * C_L * kappa_L) / M_g


def hierarchical_counts(C: int, K_H: int, C_L: int, K_L: int) -> dict:
    """Visit counts of an HRM-style reasoner trained with a one-step gradient.

    ``C`` outer cycles; per cycle the L module (``K_L`` blocks) iterates ``C_L`` times,
    then the H module (``K_H`` blocks) once. Returns a dict with

    - ``M = 2C(K_H + C_L K_L)`` forward visits (Eq. 17),
    - ``M_g = 2(K_H + C_L K_L)`` gradient-visible visits (Eq. 18), ``N_g = M_g / 2``,
    - ``J_H = 2K_H``, ``J_L = 2K_L``, ``J = J_H + J_L``,
    - ``R_g_H = 1``, ``R_g_L = C_L`` (Eq. 19),
    - ``kappa_bar_range = (J_H / M_g, 1 + J_L C_L (C_L - 1) / M_g)`` (Eq. 21).

    Consistency of the Eq. 21 range (checked here and in the tests): with
    ``kappa_bar = (J_H + J_L C_L kappa_L) / M_g`` and ``kappa_L in [0, C_L]`` the ends are
    ``J_H / M_g`` (kappa_L = 0) and ``(J_H + J_L C_L^2) / M_g``; since
    ``M_g = J_H + J_L C_L`` the upper end equals ``1 + J_L C_L (C_L - 1) / M_g``, so the
    seed's range agrees with its definition. Reference: seed 002, Eqs. 17-21.
    """
    call = "hierarchical_counts"
    C = _count(call, "C", C)
    K_H = _count(call, "K_H", K_H)
    C_L = _count(call, "C_L", C_L)
    K_L = _count(call, "K_L", K_L)
    J_H, J_L = 2 * K_H, 2 * K_L
    M_g = 2 * (K_H + C_L * K_L)
    lo = kappa_bar_g(J_H, J_L, C_L, 0.0, M_g)
    hi = kappa_bar_g(J_H, J_L, C_L, float(C_L), M_g)
    return {
        "C": C,
        "K_H": K_H,
        "C_L": C_L,
        "K_L": K_L,
        "M": C * M_g,
        "M_g": M_g,
        "N_g": M_g // 2,
        "J_H": J_H,
        "J_L": J_L,
        "J": J_H + J_L,
        "R_g_H": 1,
        "R_g_L": C_L,
        "kappa_bar_range": (lo, hi),
    }


# --------------------------------------------------------------------- residual rules


def residual_multiplier(rule: str, N: float, L: int = 1, lam: float = 1.0) -> float:
    """Pre-norm residual-branch multiplier ``eps`` in ``h <- h + eps f(h)``.

    Here ``N`` is the number of loops (applications of the shared block) and ``L`` the
    number of unique layers in the looped stack, as in seeds 003/004 (this ``N`` is not
    seed 002's unrolled depth K R). Rules:

    - ``"none"``: 1;
    - ``"1/sqrt(N)"``: depth-muP, ``N^(-1/2)`` (enough for untied depth only);
    - ``"1/N"``: the loop-aware rule for correlated shared-weight increments;
    - ``"loop-mup"``: ``lam / (N sqrt(L))`` (the factored Loop-muP rule).

    ``L`` and ``lam`` are used by ``"loop-mup"`` only. Reference: seed 003 (Right
    Direction, Wrong Step abstract) and seed 004 (Loop-muP abstract).
    """
    call = "residual_multiplier"
    if not isinstance(rule, str) or rule not in ALLOWED_RESIDUALS:
        raise ValueError(f"{call}: rule={rule!r} is not one of {ALLOWED_RESIDUALS}")
    N = _real(call, "N", N, low=1.0)
    L = _count(call, "L", L)
    lam = _real(call, "lam", lam, low=0.0, strict=True)
    if rule == "none":
        return 1.0
    if rule == "1/sqrt(N)":
        return 1.0 / math.sqrt(N)
    if rule == "1/N":
        return 1.0 / N
    return lam / (N * math.sqrt(L))


def predicted_slopes(schemes: Sequence[str], gamma: float = 1.0) -> dict[str, float]:
    """Predicted log-log slope of ``M κ_R (β/α)²`` in R (fixed K) per named scheme.

    ``1 + gamma - 4p`` (seed 002, Eqs. 14-16): aligned visits (gamma = 1) give 1 for
    DeepNorm (p = 1/4) and 0 for DeepLoop (p = 1/2). Names :func:`scales` does not know,
    and ``"postp"`` (whose p is not in its name), are left out.
    """
    out = {}
    for s in schemes:
        if isinstance(s, str) and s in ALLOWED_NORMS and s != "postp":
            out[s] = bound_exponent(scales(1, s).p, gamma)
    return out
