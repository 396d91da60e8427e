"""Finite-step geometry of one loop transition: right direction, wrong step?

For a transition ``H -> F(H)`` with update ``D = F(H) - H`` and a readout utility ``U``,
the gain along the straight path is ``phi(alpha) = U(H + alpha D) - U(H)``, alpha in
[0, 1]. Its Taylor terms at 0 are the initial slope ``A = phi'(0) = <grad U(H), D>`` and
the curvature term ``Q = phi''(0) / 2 = <D, hess U(H)[D]> / 2``; ``A + Q`` predicts the
full-step gain ``phi(1)`` and ``alpha_hat`` the best step scale of the quadratic model
``q(alpha) = A alpha + Q alpha^2`` on [0, 1] (its smallest maximiser, Eq. 8-9):
``clip(-A / (2Q), 0, 1)`` when Q < 0, else 1 if A + Q > 0 and 0 otherwise. A harmful
transition (``phi(1) < 0``) is a *directional failure* when
``A <= 0`` and a *finite-step failure* when ``A > 0``: the direction was right, the step
too long.

Reference: Guo et al., "Right Direction, Wrong Step", arXiv 2609.16665 (../shared/PAPERS.md
§2a): Definition 3.2, the quadratic model, Proposition 3.4 (``phi(1) = A - KL`` for readouts
affine in alpha).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from loopprobe._html import HTMLView

Map = Callable[[torch.Tensor], torch.Tensor]
Utility = Callable[[torch.Tensor], torch.Tensor]

HELPFUL, DIRECTIONAL, FINITE_STEP = "helpful", "directional failure", "finite-step failure"


def reference_logprob(readout: Map, targets: torch.Tensor, ignore_index: int = -100) -> Utility:
    """The default utility: per example, the mean log-probability of its reference tokens.

    ``U_b(H) = mean_{t : targets[b, t] != ignore_index} log softmax(readout(H))[b, t,
    targets[b, t]]`` (teacher forcing). ``readout`` maps the state to logits ``(B, ..., V)``
    and ``targets`` has the logits' shape without ``V``.
    """
    mask = targets != ignore_index
    safe = targets.masked_fill(~mask, 0)
    counts = mask.flatten(1).sum(dim=1)

    def U(H: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(readout(H), dim=-1)
        picked = logp.gather(-1, safe.unsqueeze(-1)).squeeze(-1) * mask
        return picked.flatten(1).sum(dim=1) / counts

    return U


@dataclass(frozen=True)
class FiniteStep(HTMLView):
    """Result of :func:`finite_step`: one entry per example (the state's first dimension).

    ``A``, ``Q``: Taylor terms of ``phi`` at 0; ``gain = phi(1)``; ``kl``: mean over
    reference positions of ``KL(p(H) || p(F(H)))`` of the readout distributions;
    ``alpha_hat``: the quadratic model's best scale; ``gain_at_alpha_hat = phi(alpha_hat)``;
    ``label``: helpful / directional failure / finite-step failure.
    """

    A: np.ndarray
    Q: np.ndarray
    gain: np.ndarray
    kl: np.ndarray
    alpha_hat: np.ndarray
    gain_at_alpha_hat: np.ndarray
    label: list[str]

    @property
    def predicted(self) -> np.ndarray:
        """The quadratic model's full-step gain ``A + Q``."""
        return self.A + self.Q

    def to_frame(self) -> pd.DataFrame:
        """One row per example."""
        return pd.DataFrame(
            {
                "example": np.arange(len(self.A)),
                "A": self.A,
                "Q": self.Q,
                "predicted": self.predicted,
                "gain": self.gain,
                "kl": self.kl,
                "alpha_hat": self.alpha_hat,
                "gain_at_alpha_hat": self.gain_at_alpha_hat,
                "label": self.label,
            }
        )


def finite_step(
    F: Map,
    H: torch.Tensor,
    readout: Map,
    targets: torch.Tensor,
    *,
    utility: Utility | None = None,
    ignore_index: int = -100,
) -> FiniteStep:
    """Slope, curvature, predicted and true gain of the transition ``H -> F(H)``.

    ``A`` and ``Q`` are exact derivatives of ``alpha -> U(H + alpha D)`` by forward-mode
    AD (a JVP, and a JVP of that JVP: the Hessian-vector product along D), not finite
    differences. ``utility`` (``H -> (B,)``) replaces the default
    :func:`reference_logprob`; ``kl`` always uses ``readout`` and ``targets``.
    Reference: arXiv 2609.16665, Sec. 3 (Def. 3.2, Prop. 3.3-3.4, quadratic model).

    Example::

        fs = finite_step(lambda h: model.step(h, x), h, model.head, targets)
        fs.to_frame().label.value_counts()
    """
    call = "finite_step"
    H, FH = _check_transition(call, F, H)
    logits0 = _check_readout(call, readout, H, targets, ignore_index)
    U = reference_logprob(readout, targets, ignore_index) if utility is None else utility
    D = FH - H

    def g(a: torch.Tensor) -> torch.Tensor:
        return U(H + a * D)

    def dg(a: torch.Tensor) -> torch.Tensor:
        return torch.func.jvp(g, (a,), (torch.ones_like(a),))[1]

    zero = torch.zeros((), dtype=H.dtype, device=H.device)
    with torch.no_grad(), warnings.catch_warnings():
        # forward-mode AD loads its decompositions with torch.jit.script on first use
        warnings.filterwarnings("ignore", message=".*torch.jit.script. is deprecated")
        A, d2 = torch.func.jvp(dg, (zero,), (torch.ones_like(zero),))
        U0 = U(H)
        if U0.dim() != 1 or U0.shape[0] != H.shape[0]:
            raise ValueError(
                f"{call}: the utility must return one value per example, shape "
                f"({H.shape[0]},), got {tuple(U0.shape)}"
            )
        gain = U(FH) - U0
        Q = d2 / 2
        ratio = torch.where(Q < 0, -A / (2 * Q).clamp(max=-torch.finfo(H.dtype).tiny), 1.0)
        # Q >= 0: q is convex, its smallest maximiser on [0, 1] is 1 if q(1) = A + Q > 0, else 0
        endpoint = ((A + Q) > 0).to(A.dtype)
        alpha_hat = torch.where(Q < 0, ratio.clamp(0.0, 1.0), endpoint)
        scale = alpha_hat.view(-1, *[1] * (H.dim() - 1))
        gain_hat = U(H + scale * D) - U0
        kl = _mean_kl(logits0, readout(FH), targets != ignore_index)
    return FiniteStep(
        *(t.detach().cpu().numpy() for t in (A, Q, gain, kl, alpha_hat, gain_hat)),
        label=[_label(float(a), float(p)) for a, p in zip(A, gain, strict=True)],
    )


def path_gains(
    F: Map,
    H: torch.Tensor,
    readout: Map,
    targets: torch.Tensor,
    alphas: torch.Tensor | None = None,
    *,
    utility: Utility | None = None,
    ignore_index: int = -100,
) -> pd.DataFrame:
    """``phi(alpha) = U(H + alpha D) - U(H)`` on a grid (default 21 points 0, 0.05, .., 1).

    Tidy: one row per (example, alpha). The paper's step-contraction oracle is the
    maximum over alpha per example. Reference: arXiv 2609.16665, Sec. 4 (the 21-point grid).
    """
    call = "path_gains"
    H, FH = _check_transition(call, F, H)
    _check_readout(call, readout, H, targets, ignore_index)
    U = reference_logprob(readout, targets, ignore_index) if utility is None else utility
    grid = torch.linspace(0, 1, 21, dtype=torch.float64) if alphas is None else alphas
    rows = []
    with torch.no_grad():
        U0 = U(H)
        for a in grid.tolist():
            phi = (U(H + a * (FH - H)) - U0).cpu().numpy()
            rows += [{"example": b, "alpha": a, "gain": float(v)} for b, v in enumerate(phi)]
    return pd.DataFrame(rows)


def _label(A: float, gain: float) -> str:
    if gain >= 0:
        return HELPFUL
    return FINITE_STEP if A > 0 else DIRECTIONAL


def _mean_kl(logits0: torch.Tensor, logits1: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per example, the mean over reference positions of ``KL(softmax(l0) || softmax(l1))``."""
    logp0, logp1 = torch.log_softmax(logits0, -1), torch.log_softmax(logits1, -1)
    kl = (logp0.exp() * (logp0 - logp1)).sum(-1) * mask
    return kl.flatten(1).sum(dim=1) / mask.flatten(1).sum(dim=1)


def _check_transition(call: str, F: Map, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(H, torch.Tensor) or not H.is_floating_point() or H.dim() < 1:
        raise TypeError(
            f"{call}: H must be a floating-point tensor with a leading example dimension, "
            f"got {H!r:.60}"
        )
    H = H.detach()
    with torch.no_grad():
        FH = F(H)
    if not isinstance(FH, torch.Tensor) or FH.shape != H.shape or FH.dtype != H.dtype:
        got = tuple(FH.shape) if isinstance(FH, torch.Tensor) else type(FH).__name__
        raise ValueError(
            f"{call}: F changed the state from {tuple(H.shape)} to {got}; the transition "
            "must map the state to a state of the same shape and dtype"
        )
    if not bool(torch.isfinite(FH).all()):
        raise ValueError(f"{call}: F(H) contains NaN/inf; the transition is not usable here")
    return H, FH.detach()


def _check_readout(call, readout, H, targets, ignore_index) -> torch.Tensor:
    if not isinstance(targets, torch.Tensor) or targets.dtype != torch.long:
        raise TypeError(f"{call}: targets must be a LongTensor of token ids, got {targets!r:.60}")
    with torch.no_grad():
        logits = readout(H)
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"{call}: readout(H) has shape {tuple(logits.shape)} but targets have "
            f"{tuple(targets.shape)}; targets must match the logits without the vocabulary axis"
        )
    counts = (targets != ignore_index).flatten(1).sum(dim=1)
    if bool((counts == 0).any()):
        bad = int((counts == 0).nonzero()[0])
        raise ValueError(
            f"{call}: example {bad} has no reference token (all targets == {ignore_index}); "
            "give every example at least one target"
        )
    return logits
