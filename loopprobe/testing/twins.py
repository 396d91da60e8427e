"""Checks of loopprobe's measurements on your model against brute-force twins: an explicitly
untied copy (one deep copy of a reused module per call) and dense ``torch.func`` Jacobians.

They are for tiny members of a family (d of a few dozen, float64): the dense Jacobian of
F over one visit's parameters is built in full. The twin is built from the visits the probe
finds, then checked by counting: each copied module must be called exactly as often as the
probe saw it visited, or the check fails.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, jacrev

import loopprobe as lp
from loopprobe.record.types import Sublayer, Visit, call_model, pick_output, seeded
from loopprobe.testing._common import _blame_model, _fail


class _PerCall(nn.Module):
    """One private deep copy of ``module`` per call: call k computes with ``copies[k]``;
    attributes the caller reads off the module (``config``, flags) come from copy 0."""

    def __init__(self, module: nn.Module, calls: int, name: str) -> None:
        super().__init__()
        self.copies = nn.ModuleList(copy.deepcopy(module) for _ in range(calls))
        self.k, self.name = 0, name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.k >= len(self.copies):
            raise AssertionError(
                f"the untied copy calls {self.name!r} more than the {len(self.copies)} times "
                "the probe saw it visited"
            )
        self.k += 1
        return self.copies[self.k - 1](*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["copies"][0], name)


def _untied(model: nn.Module, visits: list[Visit], call: str) -> tuple[nn.Module, dict]:
    """A deep copy of ``model`` with every visited module replaced by a :class:`_PerCall`,
    and ``(j, r) -> prefix`` of the copy that computes visit r of sublayer j."""
    calls: dict[str, int] = {}
    prefix = {}
    for v in visits:
        prefix[(v.j, v.r)] = f"{v.module}.copies.{calls.get(v.module, 0)}"
        calls[v.module] = calls.get(v.module, 0) + 1
    for a in calls:
        inner = [b for b in calls if b.startswith(a + ".")]
        if inner:
            raise ValueError(
                f"{call}: the untied copy needs sublayers that do not nest, and {inner[0]!r} "
                f"runs inside {a!r}; pass sublayers= naming one level"
            )
    twin = copy.deepcopy(model)
    for name, n in calls.items():
        parent, _, leaf = name.rpartition(".")
        owner = twin.get_submodule(parent) if parent else twin
        setattr(owner, leaf, _PerCall(owner.get_submodule(leaf), n, name))
    return twin, prefix


def _restart(twin: nn.Module) -> nn.Module:
    for m in twin.modules():
        if isinstance(m, _PerCall):
            m.k = 0
    return twin


def _counted(twin: nn.Module, call: str) -> None:
    """Every copied module was called as often as the probe saw it visited."""
    for m in twin.modules():
        if isinstance(m, _PerCall) and m.k != len(m.copies):
            _fail(
                call,
                f"the probe saw {len(m.copies)} visits of {m.name!r}, a plain forward of the "
                f"untied copy called it {m.k} times",
                "the visits loopprobe found are not the module's calls",
            )


def _twin_names(s: Sublayer, prefix: str, call: str) -> list[str]:
    """The names, in the untied copy, of sublayer ``s``'s parameters for one visit."""
    out = []
    for n in s.param_names:
        home = next((m for m in s.modules if n.startswith(m + ".")), None)
        if home is None:
            raise ValueError(
                f"{call}: parameter {n!r} of sublayer {s.name!r} lies outside its modules "
                f"{list(s.modules)}; the untied copy cannot give it one copy per visit"
            )
        out.append(prefix + n[len(home) :])
    return out


def _flat(tensors: Sequence[torch.Tensor | None], like: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat(
        [
            (torch.zeros_like(q) if t is None else t).reshape(-1)
            for t, q in zip(tensors, like, strict=True)
        ]
    )


def check_updates_match_untied_copy(
    model: nn.Module,
    batch: Any,
    loss: Callable,
    *,
    forward: Callable | None = None,
    sublayers: Sequence[str] | None = None,
    rtol: float = 1e-10,
    seed: int | None = 0,
) -> dict[tuple[str, int], float]:
    """Each per-visit update ``G_{r,j}`` (SGD: the gradient of the loss with respect to
    visit r's offset) equals the plain-autograd gradient of visit r's private parameters in
    an explicitly untied copy of the model (seed 002, Eq. 11); a visit whose copy gets no
    gradient (run under ``no_grad``, or not reaching the loss) must have ``G_{r,j} = 0`` and
    not be marked gradient-visible. Returns the relative error per compared visit, keyed
    ``(sublayer, r)``."""
    __tracebackhide__ = True  # a failure points at the user\'s test line
    call = "check_updates_match_untied_copy"
    with _blame_model(call, model, batch, forward), lp.attach(model, sublayers) as probe:
        ups = lp.per_visit_updates(probe, batch, loss, forward=forward, seed=seed)
        subs = [g.sublayer for g in probe.groups(batch, forward, seed=seed)]
    twin, prefix = _untied(model, ups.visits, call)
    with torch.enable_grad(), seeded(seed):
        value = loss(call_model(_restart(twin), batch, forward), batch)
        _counted(twin, call)
        params = dict(twin.named_parameters())
        names = [n for v in ups.visits for n in _twin_names(subs[v.j], prefix[(v.j, v.r)], call)]
        grads = torch.autograd.grad(value, [params[n] for n in names], allow_unused=True)
        grads = dict(zip(names, grads, strict=True))
    errors = {}
    for v in ups.visits:
        s, G = subs[v.j], ups.G[v.j][v.r]
        mine = _twin_names(s, prefix[(v.j, v.r)], call)
        brute = _flat([grads[n] for n in mine], [params[n] for n in mine])
        if float(brute.norm()) == 0.0:
            if float(G.abs().max()) != 0.0 or bool(ups.visible[v.j][v.r]):
                _fail(
                    call,
                    f"sublayer {s.name!r} visit {v.r}: its untied copy gets no gradient, but "
                    "G is not zero (or the visit is marked gradient-visible)",
                    f"||G_r|| = {float(G.norm()):.4g}, visible = {bool(ups.visible[v.j][v.r])}",
                )
            continue
        err = float((G - brute).norm() / brute.norm())
        errors[(s.name, v.r)] = err
        if not err <= rtol:
            _fail(
                call,
                f"sublayer {s.name!r} visit {v.r} (module {v.module!r}): G_r is not the "
                "gradient of that visit's untied copy",
                f"||G_r - grad|| / ||grad|| = {err:.3g} > rtol={rtol:g}; ||grad|| = "
                f"{float(brute.norm()):.4g}, ||G_r|| = {float(G.norm()):.4g}",
            )
    return errors


def _dense_norm(
    twin: nn.Module, names: list[str], F: Callable[[nn.Module], torch.Tensor], seed: int | None
) -> float:
    """``||dF/dtheta||_2`` over the untied copy's parameters ``names``, by a dense
    ``jacrev`` Jacobian and its top singular value."""
    full = {k: v.detach() for k, v in twin.named_parameters()}

    def f(*ps: torch.Tensor) -> torch.Tensor:
        with seeded(seed):
            out = functional_call(_restart(twin), {**full, **dict(zip(names, ps, strict=True))}, ())
        return F(out).reshape(-1)

    jac = jacrev(f, tuple(range(len(names))))(*(full[n] for n in names))
    J = torch.cat([j.reshape(j.shape[0], -1) for j in jac], 1)
    return float(torch.linalg.matrix_norm(J, 2))


class _Call(nn.Module):
    """``forward()`` runs the model on fixed inputs (so functional_call can swap its
    parameters under the names ``m.<name>``)."""

    def __init__(self, model: nn.Module, batch: Any, forward: Callable | None) -> None:
        super().__init__()
        self.m, self.batch, self.fwd = model, batch, forward

    def forward(self) -> Any:
        return call_model(self.m, self.batch, self.fwd)


def check_sensitivity_matches_dense_jacobian(
    model: nn.Module,
    batch: Any,
    *,
    forward: Callable | None = None,
    output: Callable | None = None,
    sublayers: Sequence[str] | None = None,
    visits: Sequence[tuple[int, int]] | None = None,
    rtol: float = 1e-8,
    seed: int | None = 0,
    **sensitivity_kwargs: Any,
) -> dict[tuple[str, int], float]:
    """``||U_{r,j}||`` (loopprobe's Krylov estimate of the operator norm of dF/d delta_{r,j})
    equals the top singular value of the dense ``jacrev`` Jacobian of F over visit r's
    private parameters in an explicitly untied copy, to ``rtol`` relative. ``visits``:
    ``(j, r)`` pairs; default the last gradient-visible visit of every sublayer. Every
    estimate must have converged (``sensitivity_kwargs`` go to
    :func:`loopprobe.sensitivity_norms`, default ``method="lanczos"``). Returns the
    relative error per checked visit, keyed ``(sublayer, r)``."""
    __tracebackhide__ = True  # a failure points at the user\'s test line
    call = "check_sensitivity_matches_dense_jacobian"
    sensitivity_kwargs.setdefault("method", "lanczos")
    with _blame_model(call, model, batch, forward), lp.attach(model, sublayers) as probe:
        sens = lp.sensitivity_norms(
            probe, batch, forward=forward, output=output, seed=seed, **sensitivity_kwargs
        )
        subs = [g.sublayer for g in probe.groups(batch, forward, seed=seed)]
        seen = probe.visits(batch, forward=forward, output=output, seed=seed)
    late = [e for e in sens.visit_norms if not e.converged]
    if late:
        _fail(call, "an operator-norm estimate did not converge", str(late[0]),
              "raise max_iter= or use method='lanczos'")  # fmt: skip
    if visits is None:
        last = {v.j: v.r for v in seen if v.grad_visible}
        visits = sorted(last.items())
    twin, prefix = _untied(model, seen, call)
    errors = {}
    for j, r in visits:
        k = next((i for i, v in enumerate(sens.visits) if (v.j, v.r) == (j, r)), None)
        if k is None:
            raise ValueError(f"{call}: no visit (j={j}, r={r}) among the probe's visits")
        names = [f"m.{n}" for n in _twin_names(subs[j], prefix[(j, r)], call)]
        wrapped = _Call(twin, batch, forward)
        dense = _dense_norm(wrapped, names, lambda out: pick_output(out, output, call=call), seed)
        est = sens.visit_norms[k].value
        err = abs(est - dense) / dense
        errors[(subs[j].name, r)] = err
        if not err <= rtol:
            _fail(
                call,
                f"sublayer {subs[j].name!r} visit {r}: ||U_r|| is not the top singular value "
                "of the dense Jacobian of its untied copy",
                f"||U_r|| = {est:.12g}, dense = {dense:.12g}, relative {err:.3g} > rtol={rtol:g}",
            )
    return errors


def check_spectral_radius_matches_dense(
    model: nn.Module,
    batch: Any,
    module: str,
    *,
    rtol: float = 1e-6,
    **replay_kwargs: Any,
) -> float:
    """The spectral radius of one replayed round ``T`` at its start ``h0``
    (:func:`loopprobe.replay_round`, :func:`loopprobe.spectral_radius`) equals the largest
    eigenvalue modulus of the dense ``jacrev(T)(h0)``, converged. Returns the dense one."""
    __tracebackhide__ = True  # a failure points at the user\'s test line
    call = "check_spectral_radius_matches_dense"
    rm = lp.replay_round(model, batch, module, **replay_kwargs)
    sr = lp.spectral_radius(rm.step, rm.h0, x=rm.x)
    if not sr.converged:
        _fail(call, "the spectral radius did not converge", sr.reason)
    n = rm.h0.numel()
    J = jacrev(rm.T)(rm.h0.detach()).reshape(n, n)
    rho = float(torch.linalg.eigvals(J.detach()).abs().max())
    if not abs(sr.value - rho) <= rtol * rho:
        _fail(
            call,
            f"the spectral radius of the round of {module!r} is not the dense one",
            f"spectral_radius = {sr.value:.10g}, dense eigvals = {rho:.10g}, rtol={rtol:g}",
        )
    return rho
