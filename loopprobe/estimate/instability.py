"""Instability diagnostics: gradient oscillation, residual explosion, branch gain after a norm.

The Fully Looped Transformer abstract traces looped-training collapse to two sources:

- **gradient oscillation**: per-visit gradients ``G_{r,j}`` (from
  :func:`loopprobe.estimate.updates.per_visit_updates`, one backward) that point in opposite
  directions on consecutive visits, ``cos(G_{r,j}, G_{r+1,j}) < 0``. Flagged per pair
  when the cosine is below ``oscillation_threshold`` (default 0), and per sublayer when
  the mean consecutive cosine is;
- **residual explosion**: the residual stream growing round after round. The stream RMS
  ``d^-1/2 ||h||`` after every visit comes from :func:`loopprobe.estimate.increments`; a round is
  flagged when the RMS after it exceeds ``explosion_threshold`` (default 10; seed 004
  reports about 1 under ``1/N``, 8 under ``1/sqrt(N)`` and 60 unscaled at N = 64).

:class:`InstabilityRecorder` runs both every k steps of a training loop and keeps the
rows in one DataFrame (``record_training`` is the loop itself for quick studies).

:func:`branch_gain` measures, for post-norm blocks ``x <- Norm(alpha x + z)``, how much
of the branch output z reaches the normalized state: ``||R(alpha x + z) - R(alpha x)||
/ ||z||`` with ``R`` the (weightless) RMS normalization, next to ``1/alpha`` and to the
first-order value of seed 002 Lemma A.1, ``R(alpha x + z) = x + (z - <x,z>_d x)/alpha +
O(RMS(z)^2/alpha^2)`` for ``RMS(x) = 1``.
Reference: Fully Looped Transformer abstract (seed 001); docs/definitions.md §2-3;
seed 002 Lemma A.1.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from loopprobe._html import HTMLView
from loopprobe.estimate.increments import increments as measure_increments
from loopprobe.estimate.updates import per_visit_updates
from loopprobe.record.probe import Probe
from loopprobe.record.types import Forward
from loopprobe.tasks import lm_loss

__all__ = [
    "Instability",
    "InstabilityRecorder",
    "branch_gain",
    "instability",
    "record_training",
]

# --------------------------------------------------------------------------- one check


@dataclass
class Instability(HTMLView):
    """Per-visit gradient norms and consecutive cosines, per-round stream RMS, with flags.

    ``visits``: one row per visit (``sublayer``, ``r``, ``G_norm``, ``cos_prev`` = cosine
    with the previous visit of the same sublayer, ``oscillation`` flag, ``stream_rms``
    after the visit). ``rounds``: one row per round (``round``, ``stream_rms`` after its
    last visit, ``growth`` = ratio to the previous round, ``explosion`` flag).
    ``sublayers``: mean consecutive cosine and the sublayer's ``oscillating`` flag.
    """

    _html_keys = ("oscillating", "exploding", "loss")

    visits: pd.DataFrame
    rounds: pd.DataFrame
    sublayers: pd.DataFrame
    oscillation_threshold: float
    explosion_threshold: float
    loss: float
    method: str

    @property
    def oscillating(self) -> bool:
        return bool(self.sublayers["oscillating"].any())

    @property
    def exploding(self) -> bool:
        return bool(self.rounds["explosion"].any())

    def to_frame(self) -> pd.DataFrame:
        df = self.visits.copy()
        df.attrs.update(self.summary())
        return df

    def summary(self) -> dict:
        return {
            "loss": self.loss,
            "oscillating": self.oscillating,
            "exploding": self.exploding,
            "min_cos_prev": float(self.visits["cos_prev"].min()),
            "final_stream_rms": float(self.rounds["stream_rms"].iloc[-1]),
            "oscillation_threshold": self.oscillation_threshold,
            "explosion_threshold": self.explosion_threshold,
            "method": self.method,
        }


def instability(
    model: nn.Module | Probe,
    inputs: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    forward: Forward | None = None,
    sublayers: Sequence[str] | None = None,
    oscillation_threshold: float = 0.0,
    explosion_threshold: float = 10.0,
    increment: Any = "output",
) -> Instability:
    """Gradient oscillation and residual explosion of one batch, with flags.

    ``loss_fn(output, inputs)`` is the scalar loss (``output`` = ``forward(model,
    inputs)`` or ``model(inputs)``), as in :func:`loopprobe.estimate.updates.per_visit_updates`;
    the per-visit gradients are the raw ``d loss / d delta_{r,j}`` (update ``sgd``). The
    stream RMS uses :func:`loopprobe.estimate.increments` (``model.hidden`` when present, else
    ``forward``; ``increment=`` as there). Probing leaves the model, its ``.grad`` and its
    mode unchanged. Reference: Fully Looped Transformer abstract; docs/definitions.md §2.
    """
    call = "instability"
    for name, v in (("oscillation_threshold", oscillation_threshold),
                    ("explosion_threshold", explosion_threshold)):  # fmt: skip
        if not isinstance(v, (int, float)) or math.isnan(v):
            raise ValueError(f"{call}: {name}={v!r} must be a number")
    probe = model if isinstance(model, Probe) else Probe(_module(model, call), sublayers)
    ups = per_visit_updates(probe, inputs, loss_fn, forward=forward, update="sgd", memory="full")
    # h_N from model.hidden when the model has one; else from ``forward`` (or additive)
    inc_forward = None if callable(getattr(probe.model, "hidden", None)) else forward
    inc = measure_increments(probe, inputs, forward=inc_forward, increment=increment, copy=False)
    inc_df = inc.to_frame()
    rows, subs = [], []
    for j, name in enumerate(ups.sublayers):
        norms = ups.norms(j).double().cpu().numpy()
        cos = ups.cosine(j, visible_only=False).double().cpu().numpy()
        adjacent = np.array([cos[r, r - 1] for r in range(1, len(norms))])
        for r in range(len(norms)):
            c = float(cos[r, r - 1]) if r > 0 else math.nan
            rows.append(
                {
                    "sublayer": name,
                    "j": j,
                    "r": r,
                    "G_norm": float(norms[r]),
                    "cos_prev": c,
                    "oscillation": bool(c < oscillation_threshold) if r > 0 else False,
                }
            )
        mean_adj = float(np.nanmean(adjacent)) if np.isfinite(adjacent).any() else math.nan
        subs.append(
            {
                "sublayer": name,
                "visits": len(norms),
                "mean_cos_prev": mean_adj,
                "min_cos_prev": float(np.nanmin(adjacent)) if len(adjacent) else math.nan,
                "oscillating": bool(mean_adj < oscillation_threshold),
                "G_norm_first": float(norms[0]),
                "G_norm_last": float(norms[-1]),
            }
        )
    visits = pd.DataFrame(rows).merge(
        inc_df[["sublayer", "r", "i", "k", "stream_rms"]], on=["sublayer", "r"], how="left"
    )
    visits = visits.sort_values("i").reset_index(drop=True)
    rounds = _rounds(inc_df, explosion_threshold)
    return Instability(
        visits,
        rounds,
        pd.DataFrame(subs),
        float(oscillation_threshold),
        float(explosion_threshold),
        ups.loss,
        ups.method,
    )


def _rounds(inc_df: pd.DataFrame, threshold: float) -> pd.DataFrame:
    """Stream RMS after the last visit of each round (``k``: the visit's place in its group)."""
    last = inc_df.sort_values("i").groupby("k", sort=True).tail(1).sort_values("k")
    rms = last["stream_rms"].to_numpy()
    growth = np.concatenate([[math.nan], rms[1:] / rms[:-1]]) if len(rms) else rms
    return pd.DataFrame(
        {
            "round": last["k"].to_numpy(),
            "stream_rms": rms,
            "growth": growth,
            "explosion": rms > threshold,
        }
    )


def _module(model: Any, call: str) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{call}: expected an nn.Module or an lp.Probe, got {type(model).__name__}")
    return model


# --------------------------------------------------------------------------- training loop


@dataclass
class InstabilityRecorder:
    """Run :func:`instability` every ``every`` steps of a training loop; keep the rows.

    Call it once per step, before or after the optimizer step::

        rec = lp.experiments.InstabilityRecorder(model, every=10, probe_batch=(idx, targets))
        for step in range(steps):
            ...; opt.step()
            rec(step)                       # or rec(step, (inputs, targets))
        rec.to_frame()                      # one row per (step, sublayer, visit)

    ``loss_fn(output, targets)`` (default next-token cross entropy). With no batch given
    the fixed ``probe_batch`` is used, so rows of different steps are comparable.
    """

    model: nn.Module
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] = lm_loss
    every: int = 10
    probe_batch: tuple[Any, torch.Tensor] | None = None
    forward: Forward | None = None
    sublayers: Sequence[str] | None = None
    oscillation_threshold: float = 0.0
    explosion_threshold: float = 10.0
    _visits: list[pd.DataFrame] = field(default_factory=list, repr=False)
    _rounds: list[pd.DataFrame] = field(default_factory=list, repr=False)
    _summaries: list[dict] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"InstabilityRecorder: every={self.every!r} must be an integer >= 1")
        self._probe = Probe(_module(self.model, "InstabilityRecorder"), self.sublayers)

    def __call__(self, step: int, batch: tuple[Any, torch.Tensor] | None = None):
        """Record at ``step`` if ``step % every == 0``; returns the Instability or None."""
        if step % self.every:
            return None
        batch = batch if batch is not None else self.probe_batch
        if batch is None:
            raise ValueError(
                "InstabilityRecorder: no batch; pass rec(step, (inputs, targets)) or "
                "probe_batch=(inputs, targets) when creating it"
            )
        inputs, targets = batch
        inst = instability(
            self._probe,
            inputs,
            lambda out, _inp: self.loss_fn(out, targets),
            forward=self.forward,
            oscillation_threshold=self.oscillation_threshold,
            explosion_threshold=self.explosion_threshold,
        )
        self._visits.append(inst.visits.assign(step=step))
        self._rounds.append(inst.rounds.assign(step=step))
        self._summaries.append({"step": step, **inst.summary()})
        return inst

    def to_frame(self) -> pd.DataFrame:
        """One row per (step, sublayer, visit): G_norm, cos_prev, oscillation, stream_rms."""
        return _concat(self._visits, first="step")

    def rounds_frame(self) -> pd.DataFrame:
        """One row per (step, round): stream_rms, growth, explosion."""
        return _concat(self._rounds, first="step")

    def summary_frame(self) -> pd.DataFrame:
        """One row per recorded step: loss, oscillating, exploding, final stream RMS."""
        return pd.DataFrame(self._summaries)


def _concat(frames: list[pd.DataFrame], first: str) -> pd.DataFrame:
    if not frames:
        return pd.DataFrame(columns=[first])
    df = pd.concat(frames, ignore_index=True)
    return df[[first] + [c for c in df.columns if c != first]]


def record_training(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch_fn: Callable[[int, torch.Generator], tuple[Any, torch.Tensor]],
    steps: int,
    *,
    generator: torch.Generator,
    every: int = 10,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] = lm_loss,
    probe_batch: tuple[Any, torch.Tensor] | None = None,
    oscillation_threshold: float = 0.0,
    explosion_threshold: float = 10.0,
) -> InstabilityRecorder:
    """Train ``model`` for ``steps`` steps, recording :func:`instability` every ``every``.

    The diagnostics run before the step they are labelled with (step 0 = at init) on
    ``probe_batch`` (default: the first training batch). A non-finite loss stops the
    loop; the recorder's summary then ends with that step. Returns the recorder.
    """
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"record_training: steps={steps!r} must be an integer >= 1")
    first = batch_fn(0, generator)
    rec = InstabilityRecorder(
        model,
        loss_fn,
        every,
        probe_batch if probe_batch is not None else first,
        oscillation_threshold=oscillation_threshold,
        explosion_threshold=explosion_threshold,
    )
    batch = first
    for step in range(steps):
        if step > 0:
            batch = batch_fn(step, generator)
        rec(step)
        inputs, targets = batch
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        if not torch.isfinite(loss):
            rec._summaries.append({"step": step, "loss": float(loss.detach()), "diverged": True})
            break
        loss.backward()
        optimizer.step()
    return rec


# --------------------------------------------------------------------------- branch gain


def branch_gain(
    model: nn.Module | Probe,
    inputs: Any,
    *,
    alpha: float | None = None,
    forward: Forward | None = None,
    sublayers: Sequence[str] | None = None,
) -> pd.DataFrame:
    """Effective gain of each post-norm branch through ``Norm(alpha x + z)``, per visit.

    For every visit, ``x`` is the stream the branch reads and ``z`` its output. Columns:
    ``gain = ||R(alpha x + z) - R(alpha x)|| / ||z||`` (R: RMS normalization per token,
    no weight), ``gain_first_order = ||J_R(alpha x) z|| / ||z||`` with
    ``J_R(alpha x) z = (z - <x_hat, z>_d x_hat) / (alpha RMS(x))`` (Lemma A.1's linear
    term; ``x_hat = x / RMS(x)``), ``inv_alpha = 1/alpha``, ``gain_alpha = gain * alpha``
    (1 when the branch enters at 1/alpha), and ``c = RMS(z) / (alpha RMS(x))``, the
    Lemma's small parameter. ``alpha`` defaults to ``model.cfg.alpha`` (the reference
    models). Reference: seed 002, Lemma A.1.
    """
    call = "branch_gain"
    probe = model if isinstance(model, Probe) else Probe(_module(model, call), sublayers)
    if alpha is None:
        alpha = getattr(getattr(probe.model, "cfg", None), "alpha", None)
        if alpha is None:
            raise ValueError(
                f"{call}: the model has no cfg.alpha; pass alpha= (its residual scale)"
            )
    if not (isinstance(alpha, (int, float)) and alpha > 0):
        raise ValueError(f"{call}: alpha={alpha!r} must be a positive number")
    with torch.no_grad():
        rec = probe.record(inputs, forward=forward, copy=False)
    rows = []
    for v in rec.visits:
        x, z = v.args[0] if v.args else None, v.output
        if not (isinstance(x, torch.Tensor) and isinstance(z, torch.Tensor) and x.shape == z.shape):
            raise ValueError(
                f"{call}: sublayer {v.sublayer!r} (module {v.module!r}) does not map the "
                "stream to a same-shaped branch output; point the probe at the residual "
                "branches, e.g. lp.attach(model, sublayers=['blocks.*.attn', 'blocks.*.mlp'])"
            )
        x, z = x.double(), z.double()
        a = float(alpha)
        exact = _rmsnorm(a * x + z) - _rmsnorm(a * x)
        rms_x = x.pow(2).mean(-1, keepdim=True).sqrt()
        xh = x / rms_x
        lin = (z - (xh * z).mean(-1, keepdim=True) * xh) / (a * rms_x)
        zn = float(z.norm())
        rows.append(
            {
                "sublayer": v.sublayer,
                "j": v.j,
                "r": v.r,
                "i": v.i,
                "alpha": a,
                "inv_alpha": 1.0 / a,
                "gain": float(exact.norm()) / zn if zn > 0 else math.nan,
                "gain_first_order": float(lin.norm()) / zn if zn > 0 else math.nan,
                "gain_alpha": a * float(exact.norm()) / zn if zn > 0 else math.nan,
                "c": float(z.pow(2).mean().sqrt() / (a * x.pow(2).mean().sqrt())),
                "rms_x": float(x.pow(2).mean().sqrt()),
            }
        )
    return pd.DataFrame(rows)


def _rmsnorm(v: torch.Tensor) -> torch.Tensor:
    return v / v.pow(2).mean(-1, keepdim=True).sqrt()
