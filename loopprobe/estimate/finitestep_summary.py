"""Per-transition failure summary: finite-step failures, the quarter step and the oracles.

For each transition ``H -> H+ = F(H)`` (one per example) and the gain
``phi(alpha) = U(H + alpha D) - U(H)``, following arXiv 2609.16665 exactly:

- harmful: ``phi(1) < 0``; finite-step failure: harmful with ``A > 0`` (Def. 3.2);
  ``share`` = finite-step failures / harmful (Table 1);
- recovery by a fixed scale ``alpha_c`` (0.25): a finite-step failure is recovered when
  ``phi(alpha_c) > 0`` (Sec. 3.4); the recovery fraction is over finite-step failures, the
  mean gain averages ``phi(alpha_c)`` over the same subset; likewise by ``alpha_hat``;
- the oracles (Eq. 14): ``U_halt = max{U(H), U(H+)}``, ``U_step = max_{alpha in B}
  U(H + alpha D)`` over a finite scale set ``B`` containing 0 and 1, so
  ``U_step - U_halt >= 0``;
- endpoint prediction (Table 1): sign accuracy of ``A`` and of ``A + Q`` for ``Delta U``,
  Spearman(``A + Q``, ``Delta U``); and generic change diagnostics (update norm ``|D|``,
  relative change ``|D| / |H|``, cosine change ``1 - cos(H, H+)``, output KL, entropy
  change), whose |Spearman| with ``Delta U`` the paper finds <= 0.285 (Sec. 4.2).

Differences from docs/definitions.md (the paper wins): ``alpha_hat`` for ``Q >= 0`` is 1 if
``A + Q > 0`` and 0 otherwise (Eq. 8-9, App. A.4), not always 1; a neutral transition
(``phi(1) = 0``) is neither progressing nor harmful.

Reference: Guo et al., arXiv 2609.16665, Def. 3.2, Eq. 8-9, 14, Sec. 3.4, Table 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from loopprobe.estimate.finitestep import (
    FINITE_STEP,
    Map,
    Utility,
    finite_step,
    reference_logprob,
)

SCALES = (0.0, 0.25, 0.5, 0.75, 1.0)  # the paper's five-scale oracle set B
GENERIC = ("update_norm", "rel_change", "cos_change", "kl", "entropy_change")


@dataclass(frozen=True)
class FailureSummary:
    """Result of :func:`failure_summary`: ``frame`` (one row per transition) and the
    population statistics of :func:`summarize` as fields."""

    frame: pd.DataFrame
    n: int
    n_harmful: int
    n_finite_step: int
    share: float
    recovery_quarter: float
    recovery_hat: float
    mean_gain_quarter: float
    sign_acc_A: float
    sign_acc_AQ: float
    spearman_AQ: float
    spearman_generic_max: float
    step_minus_halt: float
    alpha_c: float

    def to_frame(self) -> pd.DataFrame:
        """One row per transition (the tidy per-transition table)."""
        return self.frame


def failure_summary(
    F: Map,
    H: torch.Tensor,
    readout: Map,
    targets: torch.Tensor,
    *,
    utility: Utility | None = None,
    ignore_index: int = -100,
    scales: tuple[float, ...] = SCALES,
    alpha_c: float = 0.25,
) -> FailureSummary:
    """The failure summary of the transitions ``H -> F(H)`` (one per example).

    ``scales`` is the oracle set B (must contain 0 and 1); ``alpha_c`` the fixed
    contraction. ``U`` is :func:`reference_logprob` unless ``utility`` is given.

    Example::

        s = failure_summary(lambda h: model.step(h, x), h, model.head, targets)
        s.recovery_quarter, s.to_frame().query("finite_step")
    """
    call = "failure_summary"
    B = sorted(float(a) for a in scales)
    if 0.0 not in B or 1.0 not in B or not all(0.0 <= a <= 1.0 for a in B):
        raise ValueError(f"{call}: scales={scales!r} must lie in [0, 1] and contain 0 and 1")
    if not 0.0 < alpha_c < 1.0:
        raise ValueError(f"{call}: alpha_c={alpha_c!r} must lie strictly between 0 and 1")
    fs = finite_step(F, H, readout, targets, utility=utility, ignore_index=ignore_index)
    U = reference_logprob(readout, targets, ignore_index) if utility is None else utility
    H = H.detach()
    mask = targets != ignore_index
    with torch.no_grad():
        FH = F(H).detach()
        D = FH - H
        U_at = {a: U(H + a * D).cpu().numpy() for a in sorted({*B, alpha_c})}
        flat = (H.flatten(1), FH.flatten(1), D.flatten(1))
        cos = torch.nn.functional.cosine_similarity(flat[0], flat[1], dim=1)
        ent = [_entropy(readout(X), mask) for X in (H, FH)]
        frame = pd.DataFrame(
            {
                "example": np.arange(len(fs.A)),
                "A": fs.A,
                "Q": fs.Q,
                "predicted": fs.predicted,
                "gain": fs.gain,
                "label": fs.label,
                "alpha_hat": fs.alpha_hat,
                "gain_at_alpha_hat": fs.gain_at_alpha_hat,
                "gain_quarter": U_at[alpha_c] - U_at[0.0],
                "U_H": U_at[0.0],
                "U_next": U_at[1.0],
                "U_halt": np.maximum(U_at[0.0], U_at[1.0]),
                "U_step": np.max(np.stack([U_at[a] for a in B]), axis=0),
                "update_norm": flat[2].norm(dim=1).cpu().numpy(),
                "rel_change": (flat[2].norm(dim=1) / flat[0].norm(dim=1)).cpu().numpy(),
                "cos_change": (1 - cos).cpu().numpy(),
                "kl": fs.kl,
                "entropy_change": (ent[1] - ent[0]).cpu().numpy(),
            }
        )
    frame["harmful"] = frame.gain < 0
    frame["finite_step"] = frame.label == FINITE_STEP
    frame["recovered_quarter"] = frame.finite_step & (frame.gain_quarter > 0)
    frame["recovered_hat"] = frame.finite_step & (frame.gain_at_alpha_hat > 0)
    return FailureSummary(frame=frame, **summarize(frame), alpha_c=alpha_c)


def summarize(frame: pd.DataFrame) -> dict:
    """The population statistics of a per-transition frame (also used on resamples).

    Fractions over an empty subset are NaN; a Spearman correlation of a constant is NaN.
    """
    fsf = frame[frame.finite_step]
    gain = frame.gain.to_numpy()
    return {
        "n": len(frame),
        "n_harmful": int(frame.harmful.sum()),
        "n_finite_step": len(fsf),
        "share": _frac(len(fsf), int(frame.harmful.sum())),
        "recovery_quarter": _frac(int((fsf.gain_quarter > 0).sum()), len(fsf)),
        "recovery_hat": _frac(int((fsf.gain_at_alpha_hat > 0).sum()), len(fsf)),
        "mean_gain_quarter": float(fsf.gain_quarter.mean()) if len(fsf) else np.nan,
        "sign_acc_A": float(np.mean(np.sign(frame.A) == np.sign(gain))),
        "sign_acc_AQ": float(np.mean(np.sign(frame.predicted) == np.sign(gain))),
        "spearman_AQ": _spearman(frame.predicted, gain),
        "spearman_generic_max": max(abs(_spearman(frame[c], gain)) for c in GENERIC),
        "step_minus_halt": float((frame.U_step - frame.U_halt).mean()),
    }


def paired_bootstrap(frame: pd.DataFrame, n: int = 2000, seed: int = 20260904) -> pd.DataFrame:
    """``n`` resamples of the transitions (inputs) with replacement; one row per resample
    with every statistic of :func:`summarize` computed on the same resample (paired).
    The paper: 2000 paired question-bootstrap resamples, seed 20260904."""
    rng = np.random.default_rng(seed)
    m = len(frame)
    rows = [summarize(frame.iloc[rng.integers(0, m, m)]) for _ in range(n)]
    return pd.DataFrame(rows)


def _frac(k: int, n: int) -> float:
    return k / n if n else float("nan")


def _spearman(x, y) -> float:
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return float("nan")
    from scipy.stats import spearmanr  # on call: scipy.stats costs ~1 s to import

    return float(spearmanr(x, y).statistic)


def _entropy(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per example, the mean over reference positions of the readout's entropy."""
    logp = torch.log_softmax(logits, -1)
    h = -(logp.exp() * logp).sum(-1) * mask
    return h.flatten(1).sum(1) / mask.flatten(1).sum(1)


def verdict(boot: pd.Series, threshold: float, direction: str, level: float = 0.95) -> dict:
    """A pre-registered criterion on a bootstrap distribution: holds / fails / undecided.

    ``direction=">="`` (the claim is stat >= threshold): holds when the lower end of the
    two-sided percentile interval is >= threshold, fails when its upper end is below,
    else undecided; ``"<="`` mirrors it. NaN resamples (an empty subset) are dropped.
    """
    if direction not in (">=", "<="):
        raise ValueError(f"verdict: direction={direction!r}; use '>=' or '<='")
    v = np.asarray(boot, float)
    v = v[np.isfinite(v)]
    if len(v) == 0:
        return {"lo": np.nan, "hi": np.nan, "verdict": "undecided"}
    q = 100 * (1 - level) / 2
    lo, hi = np.percentile(v, [q, 100 - q])
    if direction == ">=":
        out = "holds" if lo >= threshold else "fails" if hi < threshold else "undecided"
    else:
        out = "holds" if hi <= threshold else "fails" if lo > threshold else "undecided"
    return {"lo": float(lo), "hi": float(hi), "verdict": out}
