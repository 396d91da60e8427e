"""Watch the reference model train: DeepNorm vs DeepLoop (and pre-norm 1/sqrt(N) vs 1/N).

:func:`watch_training` trains :class:`~loopprobe.models.LoopedGPT` on byte-level standard
library text (``lp.tasks.stdlib_text``) once per scheme, with a :class:`loopprobe.Monitor`
on a held-out probe batch: per-visit gradients ``||G_r||`` (raw, ``update="sgd"``: the
theory's G; Adam's effective per-visit step from a fresh state divides each visit's
gradient by the tied one elementwise and blows up where visits cancel) and consecutive-visit
cosines often,
kappa_R (with per-visit ``||U_r||``) and rho of one round at a few steps. It answers: does
the visits' alignment persist after initialization, does DeepNorm's larger tied bound
show as larger updates or instability, does the loss differ? ``loopprobe watch`` runs it
and draws the figures; the rows are cached per scheme by :func:`loopprobe.sweep`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pandas as pd
import torch

from loopprobe.experiments._reference import reference_gpt
from loopprobe.experiments.coordcheck import make_optimizer
from loopprobe.monitor.monitor import Monitor
from loopprobe.sweeps import grid, sweep
from loopprobe.tasks import lm_loss, stdlib_text

#: scheme name -> GPTConfig fields (norm and residual rule)
SCHEMES = {
    "deepnorm": {"norm": "deepnorm"},
    "deeploop": {"norm": "deeploop"},
    "pre:1/sqrt(N)": {"norm": "pre", "residual": "1/sqrt(N)"},
    "pre:1/N": {"norm": "pre", "residual": "1/N"},
}


def watch_training(
    schemes: Sequence[str] = tuple(SCHEMES),
    *,
    K: int = 2,
    R: int = 8,
    d_model: int = 32,
    n_heads: int = 4,
    seq_len: int = 32,
    batch: int = 16,
    steps: int = 300,
    lr: float = 3e-3,
    every: int = 25,
    kappa_every: int = 150,
    seed: int = 0,
    cache_dir: str | None = None,
    progress: bool = False,
) -> pd.DataFrame:
    """The monitor's long frame for every scheme, plus the training loss every ``every`` steps.

    Columns: ``scheme, step, sublayer, visit, quantity, value, converged`` (the monitor's;
    ``quantity`` includes ``loss`` (training) and ``val_loss`` (held-out, at the end)).
    The monitor runs every ``every`` steps (step 0: before training); kappa_R and rho
    every ``kappa_every`` steps (a multiple of ``every``). AdamW (betas 0.9, 0.95),
    gradient clipping 1.0, fixed lr.
    """
    call = "watch_training"
    bad = [s for s in schemes if s not in SCHEMES]
    if bad or not schemes:
        raise ValueError(f"{call}: schemes {bad or schemes}; choose from {list(SCHEMES)}")
    if steps < 1 or every < 1 or kappa_every < every or kappa_every % every:
        raise ValueError(
            f"{call}: steps={steps}, every={every}, kappa_every={kappa_every}: need steps >= 1, "
            "every >= 1 and kappa_every a multiple of every"
        )
    base = dict(
        K=K, R=R, d_model=d_model, n_heads=n_heads, seq_len=seq_len, batch=batch, steps=steps,
        lr=lr, every=every, kappa_every=kappa_every, seed=seed,
    )  # fmt: skip
    cells = grid(scheme=list(schemes))
    frame = sweep([{**c, **base} for c in cells], _cell, cache_dir, progress, name=call)
    return frame


def _cell(cfg: dict) -> list[dict]:
    """Train one scheme with the monitor on; the monitor's rows (JSON-able for the cache)."""
    model = reference_gpt(cfg, K=cfg["K"], R=cfg["R"], **SCHEMES[cfg["scheme"]])
    opt = make_optimizer(model, "adamw", cfg["lr"])
    data = torch.Generator().manual_seed(10_000 + cfg["seed"])
    probe_x, probe_y = stdlib_text(8, cfg["seq_len"], torch.Generator().manual_seed(1), "val")
    heavy = cfg["kappa_every"] // cfg["every"]
    mon = Monitor(
        model,
        probe_x,
        lambda out, _inputs: lm_loss(out, probe_y),
        every=cfg["every"],
        diagnostics={"updates": 1, "kappa": heavy, "rho": heavy},
        update="sgd",  # raw per-visit gradients: kappa as the theory defines it (Eq. 12)
        seed=cfg["seed"],
    )
    mon.step(0)  # at initialization, before any update
    model.train()
    for t in range(1, cfg["steps"] + 1):
        x, y = stdlib_text(cfg["batch"], cfg["seq_len"], data)
        loss = lm_loss(model(x), y)
        if not torch.isfinite(loss):
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        mon.step(t, loss=float(loss.detach()))
    model.eval()
    with torch.no_grad():
        val = [lm_loss(model(x), y) for x, y in _val_batches(cfg["seq_len"])]
    rows = mon.frame.assign(scheme=cfg["scheme"]).to_dict("records")
    rows.append(
        {"scheme": cfg["scheme"], "step": t, "quantity": "val_loss",
         "value": float(torch.stack(val).mean()), "converged": None}
    )  # fmt: skip
    for r in rows:
        for k, v in list(r.items()):
            if isinstance(v, float) and math.isnan(v) and k != "value":
                r[k] = None
    return rows


def _val_batches(seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(2)
    return [stdlib_text(16, seq_len, gen, "val") for _ in range(4)]


_cell.version = 2  # G is the raw gradient (SGD), not Adam's step
