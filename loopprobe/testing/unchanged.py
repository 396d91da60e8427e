"""The check that probing leaves the user's model exactly as it was (every entry point,
one after another, each compared with a snapshot taken before the first)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn

import loopprobe as lp
from loopprobe.testing._common import _blame_model, _fail, _own_forward_changes
from loopprobe.testing._snapshot import _differences, _snapshot

# A state of every global RNG that no seeding inside a probe reproduces (seed 0 would be:
# a probe that calls torch.manual_seed(0) and forgets to restore would go unseen).
_ODD_SEED = 20261201


def _entry_points(
    model: nn.Module,
    batch: Any,
    loss: Callable,
    kw: dict,
    round_module: str | None,
    max_iter: int,
    alpha: float | None,
    beta: float | None,
    increment: Any,
) -> dict[str, Callable[[], Any]]:
    """Every public way of probing the model, each on a fresh probe."""
    out = {"output": kw.pop("output")}
    calls = {
        "visit_table": lambda: lp.attach(model).visit_table(batch, **kw, **out),
        "per_visit_updates": lambda: lp.per_visit_updates(lp.attach(model), batch, loss, **kw),
        "sensitivity_norms": lambda: lp.sensitivity_norms(
            lp.attach(model), batch, max_iter=max_iter, **kw, **out
        ),
        "visit_alignment": lambda: lp.visit_alignment(
            lp.attach(model), batch, loss, max_iter=max_iter, **kw, **out
        ),
        "bound_check": lambda: lp.bound_check(
            lp.attach(model), batch, loss, alpha=alpha, beta=beta, **kw, **out
        ),
        "increments": lambda: lp.increments(model, batch, increment=increment, **kw),
    }
    if round_module is not None:

        def radius() -> Any:
            rm = lp.replay_round(model, batch, round_module, **kw)
            return lp.spectral_radius(rm.step, rm.h0, x=rm.x, max_iter=max_iter)

        calls["replay_round + spectral_radius"] = radius
    return calls


@contextmanager
def _odd_state(model: nn.Module) -> Iterator[None]:
    """The global RNGs at an odd state and every ``.grad`` set to a distinct value during
    the check (a probe that zeroes, accumulates into or drops a gradient is then seen);
    the caller's RNG states and ``.grad`` tensors are put back afterwards."""
    py, npy = random.getstate(), np.random.get_state()
    grads = [(p, p.grad) for p in model.parameters()]
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_ODD_SEED)
            torch.rand(7)
            random.seed(_ODD_SEED)
            np.random.seed(_ODD_SEED % 2**32)
            with torch.no_grad():
                for i, (p, _) in enumerate(grads):
                    p.grad = torch.full_like(p, float(i + 1))
            yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        for p, g in grads:
            p.grad = g


def check_probe_leaves_model_unchanged(
    model: nn.Module,
    batch: Any,
    loss: Callable,
    *,
    forward: Callable | None = None,
    output: Callable | None = None,
    alpha: float | None = None,
    beta: float | None = None,
    increment: Any = "auto",
    round_module: str | None = None,
    max_iter: int = 5,
) -> list[str]:
    """Probing leaves the model exactly as it was. Every entry point runs once, on a fresh
    probe: ``visit_table``, ``per_visit_updates``, ``sensitivity_norms``,
    ``visit_alignment``, ``bound_check``, ``increments`` and, with ``round_module=``,
    ``replay_round`` + ``spectral_radius`` (estimates capped at ``max_iter`` iterations:
    what is checked is what they touch, not their values). After each, the model is
    compared with a snapshot taken before the first: parameter and buffer values bitwise
    (NaN payloads and the sign of zero included; buffers hold parametrization state such as
    ``spectral_norm``'s ``u``/``v``) with their dtype, shape, device and identity, ``.grad``,
    ``requires_grad``, train/eval modes, module, tensor and torch-global hooks, the RNGs
    (torch's CPU and CUDA, Python's, numpy's) and every ``torch.Generator`` a module holds.

    During the check the global RNGs are set to an odd state and every ``.grad`` to a
    distinct value (a probe that reseeds, or zeroes a gradient, is then seen); your RNG
    states and ``.grad`` tensors are put back afterwards. An entry point that raises must
    leave the model unchanged too; its error is then raised as it came. Returns the names
    of the entry points run.

    When something changed, a plain forward of a copy of the model is run too, to say
    whether the model's own forward writes its state (a block re-initialised at every
    visit, a counter buffer) rather than the probe."""
    __tracebackhide__ = True  # a failure points at the user\'s test line
    call = "check_probe_leaves_model_unchanged"
    kw = {"forward": forward, "output": output}
    calls = _entry_points(model, batch, loss, kw, round_module, max_iter, alpha, beta, increment)
    with _odd_state(model):
        before = _snapshot(model)
        for name, run in calls.items():
            try:
                with _blame_model(call, model, batch, forward):
                    run()
            except Exception:
                _fail_if_changed(call, name, before, model, batch, forward, " (and raised)")
                raise
            _fail_if_changed(call, name, before, model, batch, forward)
    return list(calls)


def _fail_if_changed(
    call: str,
    name: str,
    before: dict,
    model: nn.Module,
    batch: Any,
    forward: Callable | None,
    raised: str = "",
) -> None:
    __tracebackhide__ = True
    diffs = _differences(before, model)
    if not diffs:
        return
    own = _own_forward_changes(model, batch, forward)
    if own:
        _fail(
            call,
            "the model's own forward changes its state, so no derivative of it is meaningful"
            f" (a block re-initialised at every visit?); seen after {name}{raised}",
            "a plain forward of a copy changed: " + "; ".join(own[:3]),
            f"probing changed {len(diffs)} things: " + "; ".join(diffs[:3]) + "; fix the model",
        )
    _fail(
        call,
        f"{len(diffs)} things changed across probing, seen after {name}{raised}",
        "; ".join(diffs[:6]),
        "a plain forward leaves the model as it was, so the probe changed it: "
        "a loopprobe bug, please report it",
    )
