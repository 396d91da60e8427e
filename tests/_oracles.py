"""Brute-force oracles shared by the tests on third-party models (tests only).

None of these use loopprobe: an explicitly untied twin (one deep copy of a reused module
per call), dense Jacobians from ``torch.func.jacrev``, a forward hook that counts calls,
and a snapshot of everything probing must leave alone.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, jacrev


class PerCall(nn.Module):
    """One private deep copy of ``module`` per call: call k computes with ``copies[k]``.

    Attributes the caller reads off the module (``config``, flags) come from copy 0.
    """

    def __init__(self, module: nn.Module, calls: int) -> None:
        super().__init__()
        self.copies = nn.ModuleList(copy.deepcopy(module) for _ in range(calls))
        self.k = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.k += 1
        return self.copies[self.k - 1](*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["copies"][0], name)


def untied_twin(model: nn.Module, untie: dict[str, int]) -> nn.Module:
    """A deep copy of ``model`` whose module ``name`` is ``PerCall(module, calls)``."""
    twin = copy.deepcopy(model)
    for name, calls in untie.items():
        parent, _, leaf = name.rpartition(".")
        owner = twin.get_submodule(parent) if parent else twin
        setattr(owner, leaf, PerCall(owner.get_submodule(leaf), calls))
    return twin


def restart(twin: nn.Module) -> nn.Module:
    """Reset every ``PerCall`` counter before a forward of the twin."""
    for m in twin.modules():
        if isinstance(m, PerCall):
            m.k = 0
    return twin


def flat_grads(module: nn.Module) -> torch.Tensor:
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
            for p in module.parameters()
        ]
    )


def renamed(param_names: tuple[str, ...], prefix: str, new_prefix: str) -> list[str]:
    """The twin's names of a sublayer's parameters (``prefix`` is the model's module name)."""
    out = []
    for n in param_names:
        if not n.startswith(prefix + "."):
            raise AssertionError(f"{n!r} is not under {prefix!r}")
        out.append(new_prefix + n[len(prefix) :])
    return out


def dense_jacobian(F: Callable, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """``dF/dtheta`` as one (m, n) matrix (tests only: the library never builds one)."""
    names = list(params)

    def f(*ps: torch.Tensor) -> torch.Tensor:
        return F(dict(zip(names, ps, strict=True)))

    jac = jacrev(f, tuple(range(len(names))))(*params.values())
    return torch.cat([j.reshape(j.shape[0], -1) for j in jac], 1)


def dense_norm_of_visit(
    twin: nn.Module, call: Callable[[nn.Module], torch.Tensor], names: list[str]
) -> float:
    """``||dF/dtheta||_2`` over the twin parameters ``names`` (one visit's private copy)."""
    full = dict(twin.named_parameters())
    ps = {n: full[n].detach() for n in names}

    def F(sub: dict) -> torch.Tensor:
        restart(twin)
        return call_params(twin, {**full, **sub}, call).reshape(-1)

    return float(torch.linalg.matrix_norm(dense_jacobian(F, ps), 2))


def call_params(model: nn.Module, params: dict, call: Callable[[nn.Module], Any]) -> Any:
    """``call(model)`` with ``params`` swapped in by ``torch.func.functional_call``."""

    class _Call(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self) -> Any:
            return call(self.m)

    return functional_call(_Call(), {f"m.{k}": v for k, v in params.items()}, ())


@contextmanager
def counting_calls(module: nn.Module):
    """Independent oracle: a plain forward hook noting, per call, whether grad is on."""
    calls: list[bool] = []
    h = module.register_forward_pre_hook(lambda m, a: calls.append(torch.is_grad_enabled()))
    try:
        yield calls
    finally:
        h.remove()


def snapshot(model: nn.Module) -> dict:
    """Everything probing must leave as it was: values, .grad, modes, hooks, RNG."""
    return {
        "state": {
            k: v.detach().clone() for k, v in [*model.named_parameters(), *model.named_buffers()]
        },
        "grads": {
            n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()
        },
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "modes": [m.training for m in model.modules()],
        "hooks": sum(
            len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._backward_hooks)
            for m in model.modules()
        ),
        "rng": torch.get_rng_state(),
    }


def assert_unchanged(before: dict, model: nn.Module) -> None:
    after = snapshot(model)
    assert before["state"].keys() == after["state"].keys()
    for k, v in before["state"].items():
        assert torch.equal(v, after["state"][k]), f"{k} changed"
    for n, g in before["grads"].items():
        h = after["grads"][n]
        assert (g is None and h is None) or (g is not None and h is not None and torch.equal(g, h))
    assert before["requires_grad"] == after["requires_grad"]
    assert before["modes"] == after["modes"]
    assert before["hooks"] == after["hooks"]
    assert torch.equal(before["rng"], after["rng"]), "torch's global RNG advanced"
