"""Coordinate check across loop count N (the looped analogue of mup's coord check).

mup's coord check sweeps *width* and pools the repeated calls of a module; here the
sweep is over the loop count N and every visit keeps its own row. For each N in a
ladder and each seed, a fresh model takes a few optimizer steps on a task; before the
first step and after each one, a fixed probe batch is run through the visit recording
(:meth:`loopprobe.Probe.record`) and every visit's increment (its output) and the final
state ``h_N`` are compared with step 0. Rows, one per (N, seed, step, sublayer, visit,
quantity):

- ``increment``: RMS of the visit's output (the residual increment; column ``value``,
  and its mean absolute entry in ``l1``, as mup records);
- ``increment_change``: RMS of (output at this step - output at step 0);
- ``state`` / ``state_change``: the same for the final state ``h_N`` (sublayer ``h_N``).

Flat curves in N (at every step) mean the parameterization is stable in the loop count;
a slope in log-log says how it is not. With Adam-like updates seed 004 (Theorem 2)
bounds ``||Delta h_N|| <~ eta eps N``: flat under ``1/N``, ``sqrt(N)`` under ``1/sqrt(N)``.
Reference: docs/definitions.md §5; seed 004 (Loop-muP abstract); microsoft/mup coord check.

Example::

    cc = lp.experiments.reference_coord_check(["pre:1/sqrt(N)", "pre:1/N"], Ns=[1, 2, 4, 8])
    cc.flatness()                                     # log-log slope over N per group
    cc.plot("pre:1/N", "state_change").savefig("cc.png")
    mup.coord_check.plot_coord_data(cc.to_mup("pre:1/N"), x="width")  # mup's own figure
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from loopprobe._stats import loglog_slope
from loopprobe.record.probe import Probe
from loopprobe.record.types import Forward
from loopprobe.sweeps import grid, sweep
from loopprobe.tasks import lm_loss
from loopprobe.theory import COORD_QUANTITIES

if TYPE_CHECKING:  # plotting is imported on call (.plot): import stays light
    from matplotlib.figure import Figure

__all__ = ["CoordCheck", "coord_check", "make_optimizer"]

QUANTITIES = COORD_QUANTITIES
BatchFn = Callable[[int, torch.Generator], tuple[Any, torch.Tensor]]
LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


def make_optimizer(model: nn.Module, name: str, lr: float) -> torch.optim.Optimizer:
    """``adam`` / ``adamw`` (betas 0.9, 0.95, no weight decay) or plain ``sgd``."""
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, betas=(0.9, 0.95))
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    raise ValueError(f"optimizer={name!r}; choose 'adam', 'adamw' or 'sgd'")


# --------------------------------------------------------------------------- result


@dataclass
class CoordCheck:
    """Long-format coordinate-check rows (see the module docstring for the columns)."""

    rows: pd.DataFrame
    config: dict = field(default_factory=dict)

    def to_frame(self) -> pd.DataFrame:
        return self.rows

    def plot_frame(self, quantity: str = "state_change", scheme: str | None = None) -> pd.DataFrame:
        """Rows of one quantity with a ``group`` per line: ``<role> first``/``last``, ``h_N``.

        A one-visit sublayer (N = 1) is both its first and its last visit. Steps whose
        ``*_change`` is 0 by definition (step 0) are dropped.
        """
        df = self.rows
        if quantity not in QUANTITIES:
            raise ValueError(f"CoordCheck: quantity={quantity!r}; choose one of {QUANTITIES}")
        wanted = quantity
        if scheme is not None:
            if "scheme" not in df or scheme not in set(df["scheme"]):
                have = sorted(set(df["scheme"])) if "scheme" in df else []
                raise ValueError(f"CoordCheck: scheme={scheme!r} not in the rows; have {have}")
            df = df[df["scheme"] == scheme]
        df = df[df["quantity"] == wanted]
        if wanted.endswith("_change"):
            df = df[df["step"] > 0]
        only = df[df["position"] == "only"]
        parts = [
            df[df["position"].isin(["first", "last", "final"])],
            only.assign(position="first"),
            only.assign(position="last"),
        ]
        out = pd.concat(parts, ignore_index=True)
        out["group"] = np.where(
            out["position"] == "final", out["role"], out["role"] + " " + out["position"]
        )
        return out

    def plot(self, scheme: str | None = None, quantity: str = "state_change", **kw: Any) -> Figure:
        """mup-style figure: one panel per step, N on a log2 x axis, a line per group."""
        from loopprobe import plots

        df = self.plot_frame(quantity, scheme)
        title = f"Coordinate check across N: {quantity}" + (f" ({scheme})" if scheme else "")
        return plots.coord_check(df, y="value", col="step", hue="group", title=title, **kw)

    def to_mup(self, scheme: str | None = None, *, change: bool = False) -> pd.DataFrame:
        """The rows in the format of mup's ``get_coord_data``, for
        ``mup.coord_check.plot_coord_data(df)``: columns ``width`` (here N, the swept size;
        mup allows any notion of width), ``module`` (a group of :meth:`plot_frame`:
        ``<role> first``/``last``, the same visit at every N, and ``h_N``), ``t`` (from 1:
        ``t = step + 1``, the forward after ``t - 1`` updates, when mup's hooks record),
        ``l1`` (mean ``|x|``), ``l2`` (RMS), ``optimizer`` and ``lr``, one row per seed as in
        mup, plus ``N``, ``seed``, ``sublayer``, ``r``.

        ``change=False``: the activations (visit outputs and ``h_N``), as mup records;
        ``change=True``: their change since step 0 (``t = step``, from the first update).
        ``scheme``: which scheme's rows, needed when there are several. Diverged rows are
        left out (they stay in :meth:`to_frame`).
        """
        call = "CoordCheck.to_mup"
        if "l1" not in self.rows:
            raise ValueError(
                f"{call}: the rows have no 'l1' column (recorded by an older loopprobe, e.g. "
                "read from a cache); run the coord check again with a fresh cache_dir"
            )
        schemes = sorted(set(self.rows["scheme"])) if "scheme" in self.rows else []
        if scheme is None and len(schemes) > 1:
            raise ValueError(
                f"{call}: the rows hold {len(schemes)} schemes {schemes}; pick one with "
                "scheme=..., mup's plot draws one parameterization at a time"
            )
        parts = []
        for name in ("increment", "state"):
            df = self.plot_frame(f"{name}_change" if change else name, scheme)
            parts.append(df[~df["diverged"]])
        df = pd.concat(parts, ignore_index=True)
        t = df["step"] if change else df["step"] + 1
        return pd.DataFrame(
            {
                "width": df["N"], "module": df["group"], "t": t.astype(int), "l1": df["l1"],
                "l2": df["value"], "optimizer": self.config.get("optimizer"),
                "lr": self.config.get("lr"), "N": df["N"], "seed": df["seed"],
                "sublayer": df["sublayer"], "r": df["r"],
            }
        ).sort_values(["width", "seed", "t", "module"], ignore_index=True)  # fmt: skip

    def flatness(self, quantity: str = "state_change", step: int | None = None) -> pd.DataFrame:
        """Log-log slope of the seed-mean value over N per (scheme, group) at one step.

        ``step=None``: the last step. Slope 0 is a flat (N-stable) coordinate.
        """
        df = self.plot_frame(quantity)
        df = df[~df["diverged"]]
        if df.empty:
            return pd.DataFrame(columns=["scheme", "group", "step", "slope"])
        step = int(df["step"].max()) if step is None else step
        df = df[df["step"] == step]
        keys = ["scheme", "group"] if "scheme" in df else ["group"]
        rows = []
        for key, sub in df.groupby(keys, sort=False):
            means = sub.groupby("N")["value"].mean()
            key = key if isinstance(key, tuple) else (key,)
            rows.append(
                {
                    **dict(zip(keys, key, strict=True)),
                    "step": step,
                    "slope": loglog_slope(means.index, means.values),
                    "value_at_min_N": float(means.iloc[0]),
                    "value_at_max_N": float(means.iloc[-1]),
                }
            )
        return pd.DataFrame(rows)


# --------------------------------------------------------------------------- one run


def _run_one(
    model: nn.Module,
    N: int,
    seed: int,
    *,
    steps: int,
    lr: float,
    optimizer: str,
    batch_fn: BatchFn,
    probe_inputs: Any,
    loss_fn: LossFn,
    forward: Forward | None,
    sublayers: Sequence[str] | None,
    train_forward: Forward | None = None,
) -> list[dict]:
    """Train ``model`` for ``steps`` steps, recording the probe batch before and after each."""
    call_train = train_forward or (lambda m, x: m(x))
    opt = make_optimizer(model, optimizer, lr)
    probe = Probe(model, sublayers)
    gen = torch.Generator().manual_seed(1_000 + seed)
    rows: list[dict] = []
    ref: dict[str, Any] = {}
    loss_val = math.nan
    for step in range(steps + 1):
        if step > 0:
            inputs, targets = batch_fn(step - 1, gen)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(call_train(model, inputs), targets)
            loss_val = float(loss.detach())
            if math.isfinite(loss_val):
                loss.backward()
                opt.step()
        with torch.no_grad():
            rec = probe.record(probe_inputs, forward=forward, copy=False)
        diverged = not math.isfinite(loss_val) and step > 0
        base = {"N": N, "seed": seed, "step": step, "loss": loss_val}
        places = _places([v.sublayer for v in rec.visits])
        for v, (label, pos) in zip(rec.visits, places, strict=True):
            z = v.output
            if not isinstance(z, torch.Tensor):
                raise ValueError(
                    f"coord_check: sublayer {v.sublayer!r} returned a {type(z).__name__}; "
                    "name tensor-valued branch modules with sublayers=[...]"
                )
            key = f"{v.sublayer}#{v.r}"
            ref.setdefault(key, z.detach().clone())
            who = {"sublayer": v.sublayer, "role": label, "r": v.r, "position": pos}
            rows += _pair(base, who, "increment", z, ref[key], diverged)
        out = rec.output
        if isinstance(out, torch.Tensor):
            ref.setdefault("h_N", out.detach().clone())
            who = {"sublayer": "h_N", "role": "h_N", "r": -1, "position": "final"}
            rows += _pair(base, who, "state", out, ref["h_N"], diverged)
        if diverged:
            break
    return rows


def _pair(base: dict, who: dict, name: str, now: torch.Tensor, ref: torch.Tensor, div: bool):
    size, change = _rms(now), _rms(now - ref)
    bad = div or not (math.isfinite(size) and math.isfinite(change))
    return [
        {**base, **who, "quantity": name, "value": size, "l1": _l1(now), "diverged": bad},
        {
            **base, **who, "quantity": f"{name}_change", "value": change,
            "l1": _l1(now - ref), "diverged": bad,
        },
    ]  # fmt: skip


def _places(names: list[str]) -> list[tuple[str, str]]:
    """(label, position) per visit: position first / mid / last / only within its group.

    A sublayer visited more than once is its own group (label: its last non-integer
    name segment, e.g. ``attn``, or the full name when several sublayers share that
    segment). Sublayers visited once (an untied stack) are grouped by that segment, in
    execution order, so ``first``/``last`` are the first and last layer of that role.
    """
    counts = {n: names.count(n) for n in dict.fromkeys(names)}
    short = {n: _role(n) for n in counts}
    looped = [n for n in counts if counts[n] > 1]
    clash = {s for s in short.values() if sum(short[n] == s for n in looped) > 1}
    key = [n if counts[n] > 1 else short[n] for n in names]
    label = {n: n if short[n] in clash else short[n] for n in counts}
    size = {k: key.count(k) for k in set(key)}
    seen: dict[str, int] = {}
    out = []
    for n, k in zip(names, key, strict=True):
        i = seen.get(k, 0)
        seen[k] = i + 1
        last = size[k] - 1
        pos = "only" if size[k] == 1 else "first" if i == 0 else "last" if i == last else "mid"
        out.append((label[n], pos))
    return out


def _role(name: str) -> str:
    parts = [p for p in name.split(".") if not re.fullmatch(r"\d+", p)]
    return parts[-1] if parts else name


def _rms(t: torch.Tensor) -> float:
    return float(t.detach().double().pow(2).mean().sqrt())


def _l1(t: torch.Tensor) -> float:
    return float(t.detach().double().abs().mean())


# --------------------------------------------------------------------------- sweeps


def coord_check(
    make_model: Callable[[int, int], nn.Module],
    batch_fn: BatchFn,
    probe_inputs: Any,
    Ns: Sequence[int] = (1, 2, 4, 8, 16),
    seeds: Sequence[int] = (0, 1),
    *,
    steps: int = 4,
    lr: float = 1e-2,
    optimizer: str = "adam",
    loss_fn: LossFn = lm_loss,
    forward: Forward | None = None,
    train_forward: Forward | None = None,
    sublayers: Sequence[str] | None = None,
    cache_dir: str | None = None,
    name: str | None = None,
    progress: bool = False,
) -> CoordCheck:
    """Coordinate check of any looped model across N.

    ``make_model(N, seed)`` builds a fresh model; ``batch_fn(step, generator)`` returns a
    training ``(inputs, targets)``; ``probe_inputs`` is the fixed batch that is recorded;
    ``loss_fn(train_forward(model, inputs), targets)`` the training loss (default
    ``model(inputs)``). ``forward`` (default
    ``model.hidden`` when the model has one) gives the final state ``h_N``. A run whose
    loss turns NaN/inf stops there and its rows carry ``diverged=True``; a run that raises
    becomes one ``diverged`` row (through :func:`loopprobe.sweep`).
    Reference: docs/definitions.md §5.
    """
    call = "coord_check"
    _check(call, Ns, seeds, steps, lr)
    if cache_dir is not None and name is None:
        raise ValueError(f"{call}: caching needs name='...' identifying make_model/batch_fn")

    def cell(cfg: dict) -> list[dict]:
        model = make_model(cfg["N"], cfg["seed"])
        fwd = forward if forward is not None else _default_forward(model)
        return _run_one(
            model,
            cfg["N"],
            cfg["seed"],
            steps=steps,
            lr=lr,
            optimizer=optimizer,
            batch_fn=batch_fn,
            probe_inputs=probe_inputs,
            loss_fn=loss_fn,
            forward=fwd,
            sublayers=sublayers,
            train_forward=train_forward,
        )

    df = sweep(grid(N=list(Ns), seed=list(seeds)), cell, cache_dir, progress, name=name or call)
    return CoordCheck(df, {"steps": steps, "lr": lr, "optimizer": optimizer})


def _default_forward(model: nn.Module) -> Forward | None:
    if callable(getattr(model, "hidden", None)):
        return lambda m, x: m.hidden(x)
    return None


def _check(call: str, Ns: Sequence[int], seeds: Sequence[int], steps: int, lr: float) -> None:
    if not list(Ns) or any(not isinstance(n, int) or n < 1 for n in Ns):
        raise ValueError(f"{call}: Ns={Ns!r} must be a non-empty list of integers >= 1")
    if not list(seeds) or any(not isinstance(s, int) for s in seeds):
        raise ValueError(f"{call}: seeds={seeds!r} must be a non-empty list of integers")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"{call}: steps={steps!r} must be an integer >= 1")
    if not (isinstance(lr, (int, float)) and lr > 0):
        raise ValueError(f"{call}: lr={lr!r} must be a positive number")
