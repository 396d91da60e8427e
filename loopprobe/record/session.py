"""The one place where parameters are swapped: hooks on every sublayer, for one call.

:func:`session` installs a forward pre-hook and post-hook on each module of each
sublayer. At a visit, ``enter`` may hand back one tensor per parameter of the sublayer;
the module then computes with those tensors (per-visit offsets, fresh leaves, float64
copies) for that call only, as ``torch.func.functional_call`` does, and gets its own
parameters back when the call returns or raises. Every estimator that needs a per-visit
parameter goes through here; nothing else in the package writes ``_parameters``.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from loopprobe.autodiff import in_backward, inline_checkpoint, transform_safe
from loopprobe.record.types import Sublayer, Trace, Visit


@dataclass
class Group:
    """A sublayer with its live parameters, the modules that use them, and where each
    module holds each parameter (``places[slot]``: (owner module, name, parameter index))."""

    sublayer: Sublayer
    params: list[torch.Tensor]
    modules: list[nn.Module]
    places: list[list[tuple[nn.Module, str, int]]]
    paths: tuple[tuple[str, nn.Module], ...] = ()  # (name in the model, module): see current

    def current(self, model: nn.Module) -> bool:
        """Still how ``model`` computes: each module and parameter owner at its name, each
        owner holding these parameter objects (False after ``load_state_dict(...,
        assign=True)`` or a replaced submodule). A few attribute lookups, no forward."""
        for path, m in self.paths:
            cur: nn.Module | None = model
            for part in path.split(".") if path else ():
                cur = cur._modules.get(part) if cur is not None else None
            if cur is not m:
                return False
        return all(
            owner._parameters.get(pname) is self.params[k]
            for locs in self.places
            for owner, pname, k in locs
        )

    def renumbered(self, j: int) -> Group:
        return replace(self, sublayer=replace(self.sublayer, index=j))


def real_parameters(call: str, groups: Sequence[Group]) -> None:
    """Refuse, naming it, the first complex parameter of a probed sublayer: G's Gram matrix,
    ``||U||`` and kappa are defined for real parameters (a complex one needs conjugate
    transposes throughout, which the estimators do not take)."""
    for g in groups:
        for name, p in zip(g.sublayer.param_names, g.params, strict=True):
            if p.is_complex():
                raise TypeError(
                    f"{call}: parameter {name!r} of sublayer {g.sublayer.name!r} is complex "
                    f"({p.dtype}); per-visit updates, sensitivities and kappa are defined for "
                    "real parameters only. Hold it as two real parameters and build "
                    "torch.complex(re, im) in the forward, or leave the sublayer out "
                    f"(lp.attach(model, exclude=[{g.sublayer.name!r}]))"
                )


def owners_of(model: nn.Module, groups: Sequence[Group]) -> list[list[tuple[nn.Module, str]]]:
    """Per group, every module of ``model`` (with its name) that directly holds one of the
    group's parameters, in module order: one pass over the modules for all groups."""
    where: dict[int, list[int]] = {}
    for j, g in enumerate(groups):
        for p in g.params:
            js = where.setdefault(id(p), [])
            if j not in js:
                js.append(j)
    out: list[list[tuple[nn.Module, str]]] = [[] for _ in groups]
    for name, m in model.named_modules():
        hit = {j for p in m._parameters.values() if p is not None for j in where.get(id(p), ())}
        for j in sorted(hit):
            out[j].append((m, name))
    return out


@contextmanager
def session(
    model: nn.Module,
    groups: Sequence[Group],
    owners: Sequence[Sequence[tuple[nn.Module, str]]],
    enter: Callable[[Visit, nn.Module, tuple, dict], Sequence[torch.Tensor] | None] | None = None,
    leave: Callable[[Visit, tuple, dict, Any], None] | None = None,
    *,
    call: str = "probe",
    transforms: bool = True,
) -> Iterator[Trace]:
    """Hooks on every sublayer module for the duration of the ``with`` block.

    At each visit ``enter(visit, module, args, kwargs)`` may return one tensor per
    sublayer parameter; the module then computes with those tensors in place of its
    parameters for this call only (as ``torch.func.functional_call`` does) and gets its
    own parameters back when the call returns or raises. ``leave(visit, args, kwargs,
    output)`` sees the output. Yields a :class:`Trace` filled in as the forward runs.
    Model state (parameters, buffers, train/eval mode) is restored on exit. Inside the
    block, fused attention and activation checkpointing are made transform-safe
    (:func:`loopprobe.autodiff.transform_safe`): same values, every visit counted once.
    ``transforms=False`` is for a block that only runs plain autograd (no ``torch.func``
    transform): attention keeps the user's kernel (fused kernels have backward rules) and
    no mode intercepts each torch call (80-215 us per visit in three runs on LoopedGPT
    d_model 32, ``benchmarks/bench_visits.py`` section 5); checkpointed segments still run
    inline.
    """
    trace = Trace([], [])
    counts = [0] * len(groups)
    inside = [0] * len(groups)
    active: dict[int, list[tuple[Visit, list]]] = {}
    handles = []

    def pre_hook(j: int, g: Group, slot: int) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if in_backward():
                raise RuntimeError(_called_in_backward(call, g.sublayer.modules[slot]))
            v = Visit(
                i=len(trace.visits),
                j=j,
                r=counts[j],
                sublayer=g.sublayer.name,
                module=g.sublayer.modules[slot],
                grad_enabled=torch.is_grad_enabled(),
            )
            counts[j] += 1
            inside[j] += 1
            trace.visits.append(v)
            saved: list = []
            new = enter(v, module, args, kwargs) if enter is not None else None
            if new is not None:
                for owner, pname, k in g.places[slot]:
                    saved.append((owner, pname, owner._parameters[pname]))
                    owner._parameters[pname] = new[k]
            active.setdefault(id(module), []).append((v, saved))

        return hook

    def post_hook(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        stack = active.get(id(module))
        if not stack:
            return
        v, saved = stack.pop()
        inside[v.j] -= 1
        for owner, pname, p in reversed(saved):
            owner._parameters[pname] = p
        if leave is not None:
            leave(v, args, kwargs, out)

    def owner_hook(j: int, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            if inside[j] == 0:
                trace.outside.append((j, name))

        return hook

    with restored(model), transform_safe() if transforms else inline_checkpoint():
        try:
            for j, g in enumerate(groups):
                for slot, m in enumerate(g.modules):
                    handles.append(
                        m.register_forward_pre_hook(pre_hook(j, g, slot), with_kwargs=True)
                    )
                    handles.append(
                        m.register_forward_hook(post_hook, with_kwargs=True, always_call=True)
                    )
                for owner, oname in owners[j]:
                    handles.append(owner.register_forward_pre_hook(owner_hook(j, oname)))
            yield trace
        finally:
            for h in handles:
                h.remove()
            for stack in active.values():
                for _, saved in reversed(stack):
                    for owner, pname, p in reversed(saved):
                        owner._parameters[pname] = p


#: why a backward raised RecursionError (torch reports it as a SystemError from run_backward)
ENDLESS_BACKWARD = (
    "the backward recursed without end: a tensor hook registered in the forward "
    "(Tensor.register_hook) runs torch.autograd.grad through its own tensor, as the implicit "
    "gradient of DEQ code does, and removes itself only through an attribute the next forward "
    "overwrites; probing runs the forward more than once before a backward, so an earlier "
    "hook stays attached. Probe with that hook off (the model in eval mode, or its plain "
    "unrolled gradient)"
)


#: more nested torch.autograd.grad calls than this inside one product: an endless recursion
MAX_NESTED_GRAD = 16
_nested = [0]


def bounded_backward(fn: Callable) -> Callable:
    """``fn`` with ``torch.autograd.grad`` counting how deep its calls nest (a hook that calls
    it inside a backward nests one level): past :data:`MAX_NESTED_GRAD` levels a
    ``RuntimeError`` (:data:`ENDLESS_BACKWARD`) stops it at once. Without the guard such a
    recursion runs to Python's limit, torch loses the ``RecursionError`` and the hook's own
    loop goes on, so time and memory grow exponentially (gigabytes on a tiny DEQ)."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        grad = torch.autograd.grad

        def guarded(*a: Any, **k: Any) -> Any:
            if _nested[0] >= MAX_NESTED_GRAD:
                raise RuntimeError(ENDLESS_BACKWARD)
            _nested[0] += 1
            try:
                return grad(*a, **k)
            finally:
                _nested[0] -= 1

        torch.autograd.grad = guarded
        try:
            return fn(*args, **kwargs)
        finally:
            torch.autograd.grad = grad

    return wrapped


def _called_in_backward(call: str, module: str) -> str:
    """Why ``module`` runs inside a backward pass, as far as the Python stack tells."""
    fn = _backward_function()
    if fn is not None:
        return (
            f"{call}: module {module!r} was called during a backward pass by the backward of "
            f"{fn} (a custom torch.autograd.Function that calls the module in its backward: "
            "the implicit gradient of DEQ code, a hand-written recompute); a call in backward "
            "cannot be told "
            "from a new visit, and G, U and kappa are defined for the gradient of the "
            "forward's own visits. Probe with that gradient off (the model in eval mode, "
            "or the solver's unrolled / plain-autograd gradient)"
        )
    return (
        f"{call}: module {module!r} was called during a backward pass: activation "
        "checkpointing other than torch.utils.checkpoint recomputes it, or a tensor hook "
        "calls it, and such a call cannot be told from a new visit. Turn that off while "
        "probing (e.g. model.gradient_checkpointing_disable())"
    )


def _backward_function() -> str | None:
    """The custom ``torch.autograd.Function`` whose ``backward`` is on the stack, if any."""
    frame = sys._getframe(2)
    while frame is not None:
        ctx = frame.f_locals.get("ctx") if frame.f_code.co_name == "backward" else None
        cls = getattr(ctx, "_forward_cls", None)
        if isinstance(cls, type) and issubclass(cls, torch.autograd.Function):
            return f"{cls.__module__}.{cls.__qualname__}"
        frame = frame.f_back
    return None


def device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


# BatchNorm running statistics set aside by `restored`, per module (see running_stats)
_SET_ASIDE: weakref.WeakKeyDictionary[nn.Module, dict[str, torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)


@contextmanager
def restored(model: nn.Module) -> Iterator[None]:
    """Put back train/eval flags, buffer values (e.g. BatchNorm running stats) and the state
    of every ``torch.Generator`` a module holds (``self.gen`` of a dropout-like module).

    Inside the block, train-mode BatchNorm layers run without running statistics: the
    output is the same (train mode normalises with batch statistics), nothing is
    updated, and torch.func transforms do not trip over in-place buffer updates. A round
    map run in eval mode inside the block gets them back for its call (:func:`running_stats`).
    """
    modes = [(m, m.training) for m in model.modules()]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    gens = [(g, g.get_state()) for g in generators(model)]
    stats = []
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training:
            for key in ("running_mean", "running_var", "num_batches_tracked"):
                if m._buffers.get(key) is not None:
                    stats.append((m, key, m._buffers[key]))
                    _SET_ASIDE.setdefault(m, {})[key] = m._buffers[key]
                    m._buffers[key] = None
    try:
        yield
    finally:
        for m, key, b in stats:
            m._buffers[key] = b
            _SET_ASIDE.get(m, {}).pop(key, None)
        for m, mode in modes:
            m.training = mode
        for g, state in gens:
            g.set_state(state)
        with torch.no_grad():
            for b, saved in buffers:
                if not _same(b, saved):
                    b.copy_(saved)


@contextmanager
def running_stats(model: nn.Module) -> Iterator[None]:
    """Give the BatchNorm layers of ``model`` back the running statistics that an enclosing
    :func:`restored` set aside, for the block: an eval-mode call then normalises with them,
    as it does outside probing (eval mode with no running statistics would use the batch's)."""
    put = []
    for m in model.modules():
        for key, b in _SET_ASIDE.get(m, {}).items():
            if key in m._buffers and m._buffers[key] is None:
                m._buffers[key] = b
                put.append((m, key))
    try:
        yield
    finally:
        for m, key in put:
            m._buffers[key] = None


def generators(model: nn.Module) -> list[torch.Generator]:
    """Every ``torch.Generator`` a module of ``model`` holds as an attribute (directly or in a
    list, tuple or dict attribute), each once."""
    found: dict[int, torch.Generator] = {}
    for m in model.modules():
        for value in vars(m).values():
            inner = value.values() if isinstance(value, dict) else value
            for v in inner if isinstance(value, list | tuple | dict) else (value,):
                if isinstance(v, torch.Generator):
                    found.setdefault(id(v), v)
    return list(found.values())


def buffer_values(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each buffer of ``model`` with a copy of its values, for :func:`put_back`."""
    return [(b, b.detach().clone()) for b in model.buffers()]


def put_back(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy the values :func:`buffer_values` saved back into the buffers that differ.

    For the moment after a ``torch.func`` attempt failed: a forward under a transform may
    write a buffer in place (``spectral_norm``'s power iteration writes ``u``/``v``) and
    then fail, and :func:`restored` cannot copy inside the transform. Before any fallback
    runs, the model must be back where the first forward found it, or the fallback
    measures at other weights than the forward it is compared with.
    """
    with torch.no_grad():
        for b, values in saved:
            if not _same(b, values):
                b.copy_(values)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN equal to NaN (a NaN buffer left alone is unchanged: copying it
    back would write a captured tensor inside a torch.func transform)."""
    if torch.equal(a, b):
        return True
    if not (a.is_floating_point() or a.is_complex()) or a.shape != b.shape:
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


@contextmanager
def grads_kept(model: nn.Module):  # noqa: ANN202
    """Put back every parameter's ``.grad`` (a forward that runs a backward of its own)."""
    saved = [(p, p.grad, None if p.grad is None else p.grad.clone()) for p in model.parameters()]
    try:
        yield
    finally:
        for p, g, values in saved:
            if p.grad is not g:
                p.grad = g
            if g is not None and not torch.equal(g, values):  # accumulated in place
                with torch.no_grad():
                    g.copy_(values)
