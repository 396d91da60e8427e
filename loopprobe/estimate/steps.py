"""One real optimizer step, taken on copies: the user's model and optimizer never change.

:func:`optimizer_step` returns the step ``Delta theta`` a ``torch.optim.Optimizer`` would
take from its current state (Adam's moments after k steps, weight decay, momentum,
any optimizer class) for given gradients: the optimizer is deep-copied together with its
parameters, the copy gets the gradients and steps, and the difference is read off. A name
(``"sgd"``, ``"adam"``, ``"adamw"``) builds a fresh optimizer of that kind instead.
:func:`optimizer_family` says which prediction of the tied-depth bound applies to a step
(docs/definitions.md, "The tied-depth bound under Adam").
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

#: fresh optimizers by name
OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}

OptimizerArg = str | torch.optim.Optimizer


def check_optimizer(optimizer: object, lr: float | None, call: str) -> None:
    """A name from :data:`OPTIMIZERS` or a ``torch.optim.Optimizer``; ``lr`` only with a name."""
    if isinstance(optimizer, str):
        if optimizer.lower() not in OPTIMIZERS:
            raise ValueError(
                f"{call}: optimizer={optimizer!r}; choose one of {list(OPTIMIZERS)} or pass "
                "the torch.optim.Optimizer you train with"
            )
        if lr is not None and not lr > 0:
            raise ValueError(f"{call}: lr must be > 0, got {lr!r}")
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"{call}: optimizer={type(optimizer).__name__} is not a torch.optim.Optimizer; pass "
            f"one (its state is read on a copy, never written) or a name in {list(OPTIMIZERS)}"
        )
    if lr is not None:
        raise ValueError(
            f"{call}: lr={lr!r} given with an optimizer instance; its own param_groups' lr "
            "is used: drop lr= (or pass a name such as 'adamw' to take a fresh optimizer's step)"
        )


def optimizer_name(optimizer: OptimizerArg) -> str:
    """``"adamw"`` for a name, ``"AdamW (step 7)"`` for an instance (its state's step count)."""
    if isinstance(optimizer, str):
        return optimizer.lower()
    steps = [
        int(s["step"]) for s in optimizer.state.values() if isinstance(s, dict) and "step" in s
    ]
    return f"{type(optimizer).__name__} (step {max(steps, default=0)})"


def optimizer_family(optimizer: OptimizerArg) -> str:
    """``"sgd"`` (the step is a multiple of the gradient: seed 002's form), ``"adam"``
    (a per-coordinate normalised step: this project's Adam form) or ``"other"`` (no prediction).

    SGD with momentum counts as ``"sgd"`` only on its first step (no momentum buffer yet):
    afterwards the step carries past gradients and neither form is derived for it.
    """
    if isinstance(optimizer, str):
        return "sgd" if optimizer.lower() == "sgd" else "adam"
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return "adam"
    if isinstance(optimizer, torch.optim.SGD):
        buffers = [s.get("momentum_buffer") for s in optimizer.state.values()]
        return "sgd" if all(b is None for b in buffers) else "other"
    return "other"


def optimizer_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    optimizer: OptimizerArg,
    lr: float | None = None,
    call: str = "optimizer_step",
) -> tuple[list[torch.Tensor], list[str]]:
    """``Delta theta`` for ``params`` (one tensor each) and notes on parameters it leaves.

    ``grads[k]`` is the gradient of ``params[k]`` (``None``: not stepped, as the optimizer
    skips a parameter without ``.grad``). With an instance, every parameter it holds that is
    not in ``params`` gets no gradient (so no weight decay either), and a parameter of
    ``params`` the optimizer does not hold is not stepped (named in the notes). With a name,
    a fresh optimizer (``lr``, default 1e-3; torch's defaults otherwise) steps clones.
    """
    check_optimizer(optimizer, lr, call)
    if isinstance(optimizer, str):
        new = [p.detach().clone() for p in params]
        for q, g in zip(new, grads, strict=True):
            q.grad = torch.zeros_like(q) if g is None else g.detach().clone()
        OPTIMIZERS[optimizer.lower()](new, lr=1e-3 if lr is None else lr).step()
        return [q.detach() - p.detach() for q, p in zip(new, params, strict=True)], []
    held = [p for group in optimizer.param_groups for p in group["params"]]
    try:
        twin = copy.deepcopy(optimizer)
    except (RuntimeError, TypeError) as e:  # a state holding something that cannot be copied
        raise TypeError(
            f"{call}: could not copy {type(optimizer).__name__} to step it without touching "
            f"yours ({e}); pass its name ('sgd', 'adam', 'adamw') to take a fresh step instead"
        ) from e
    copies = [q for group in twin.param_groups for q in group["params"]]
    where = {id(p): k for k, p in enumerate(held)}
    grad_of = {id(p): g for p, g in zip(params, grads, strict=True)}
    with torch.no_grad():
        for p, q in zip(held, copies, strict=True):
            g = grad_of.get(id(p))
            q.grad = None if g is None else g.detach().clone().to(q.dtype)
        twin.step()
    deltas, notes = [], []
    for p in params:
        k = where.get(id(p))
        if k is None:
            deltas.append(torch.zeros_like(p.detach()))
            continue
        deltas.append(copies[k].detach().to(p.dtype) - p.detach())
    missing = sum(id(p) not in where for p in params)
    if missing:
        notes.append(
            f"{missing} stepped parameter tensor(s) are not held by the optimizer "
            f"{type(optimizer).__name__} and stay fixed (their Delta theta is 0)"
        )
    return deltas, notes
