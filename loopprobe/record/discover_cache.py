"""Discovery once per model and batch: what :func:`~loopprobe.record.discover.find_sublayers`
found, kept for the next probe attached to the same model, and never handed out stale.

Every :func:`loopprobe.attach` starts a fresh :class:`~loopprobe.record.probe.Probe`, and
each one used to run its own discovery forward (a report on ``--model`` attaches once per
section; a monitor once per logging step). The cache is keyed on everything the discovery
reads:

- the model's structure: every module's name, identity, class and train/eval flag, and
  which parameter and buffer objects it holds (so a replaced submodule, a re-tied or untied
  parameter, ``load_state_dict(..., assign=True)`` or ``model.eval()`` all miss), its plain
  attributes, and the class-level attributes of every module class (a forward that branches
  on ``type(self).SHARED`` takes another path when it changes);
- the inputs: each tensor's shape, dtype, device, ``requires_grad``, its identity (held by
  a weak reference, so a freed batch whose address is reused cannot hit) and its in-place
  version counter; other leaves by value (int, float, bool, str, None; anything else is not
  cached);
- the ``forward`` callable (by a weak reference) and the ``seed`` (``None``, the caller's
  RNG, is not cached: a forward that draws could take another path).

What it leaves out, on purpose: parameter and buffer *values* (training changes them every
step; which modules reuse which parameters does not). A forward whose control flow reads
them would have to be re-attached with ``sublayers=``. Results found with data-flow
tracking off (the forward failed under it, with a warning) are not cached, so the warning
is never swallowed. Entries hang off a weak reference to the model: the cache never keeps a
model alive.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from loopprobe.record.discover import Found

_SCALARS = (int, float, bool, str, type(None))
_CACHE: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, tuple, list[Found]]] = (
    weakref.WeakKeyDictionary()
)


def structure(model: nn.Module) -> tuple:
    """Per module: name, identity, class, mode, held parameter/buffer objects, its forward
    and hooks, and its plain attributes (``self.R = 4`` steers a loop as much as a module);
    per class, its class-level attributes (``Model.SHARED = False`` steers it too)."""
    hooks = nn.modules.module
    classes: dict[type, tuple] = {}
    for m in model.modules():
        if type(m) not in classes:
            classes[type(m)] = _class_state(type(m))
    return (
        tuple(hooks._global_forward_pre_hooks),
        tuple(hooks._global_forward_hooks),
        tuple(classes.items()),
        *(
            (
                name,
                id(m),
                type(m),
                id(type(m).forward),
                m.training,
                tuple((k, id(p)) for k, p in m._parameters.items() if p is not None),
                tuple((k, id(b)) for k, b in m._buffers.items() if b is not None),
                tuple(m._forward_pre_hooks),
                tuple(m._forward_hooks),
                tuple((k, _attr(v)) for k, v in vars(m).items() if k not in _MODULE_STATE),
            )
            for name, m in model.named_modules(remove_duplicate=False)
        ),
    )


_MODULE_STATE = {"_parameters", "_buffers", "_modules", "training"} | {
    k for k in vars(nn.Module()) if k.endswith("hooks") or k.startswith("_")
}


def _class_state(cls: type) -> tuple:
    """The attributes a class and its bases below ``nn.Module`` define, as :func:`_attr` sees
    them (methods by identity: a patched method is another forward)."""
    return tuple(
        (k, _attr(v))
        for c in cls.__mro__
        if c not in _TORCH_CLASSES
        for k, v in vars(c).items()
        if not (k.startswith("__") and k.endswith("__"))
    )


_TORCH_CLASSES = frozenset(nn.Module.__mro__)


def _attr(v: Any) -> Any:
    """A plain attribute as it can steer the forward: scalars (and tuples/lists of them) by
    value, a config object by its scalar fields and identity, anything else by identity."""
    if isinstance(v, _SCALARS):
        return (type(v), v)
    if isinstance(v, (tuple, list)) and all(isinstance(x, _SCALARS) for x in v):
        return (type(v), tuple(v))
    fields = getattr(v, "__dict__", None)
    if isinstance(fields, dict) and not isinstance(v, (nn.Module, torch.Tensor)):
        return (id(v), tuple((k, x) for k, x in fields.items() if isinstance(x, _SCALARS)))
    return id(v)


def _inputs(inputs: Any) -> tuple[tuple, list] | None:
    """(signature, objects to hold weakly) of the inputs, or None when not cacheable."""
    sig, objs = [], []
    leaves, spec = pytree.tree_flatten(inputs)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            sig.append((tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad))
            sig.append(leaf._version)
            objs.append(leaf)
        elif isinstance(leaf, _SCALARS):
            sig.append((type(leaf), leaf))
        else:
            return None
    return (str(spec), *sig), objs


def key(model: nn.Module, inputs: Any, forward: Callable | None, seed: int | None):
    """The cache key of one discovery and the objects it is tied to, or None (not cached)."""
    if seed is None:
        return None
    got = _inputs(inputs)
    if got is None:
        return None
    sig, objs = got
    if forward is not None:
        objs.append(forward)
    try:
        refs = tuple(weakref.ref(o) for o in objs)
    except TypeError:  # an object without weak references (a builtin): not cached
        return None
    return (structure(model), sig, forward is None, seed), refs


def lookup(model: nn.Module, k: tuple | None) -> list[Found] | None:
    """The cached sublayers of ``model`` for key ``k`` (from :func:`key`), or None."""
    entry = _CACHE.get(model) if k is not None else None
    if entry is None:
        return None
    stored_key, stored_refs, found = entry
    sig, refs = k
    if stored_key != sig or len(stored_refs) != len(refs):
        return None
    if any(a() is None or a() is not b() for a, b in zip(stored_refs, refs, strict=True)):
        return None
    return list(found)


def store(model: nn.Module, k: tuple | None, found: list[Found]) -> None:
    """Keep ``found`` for ``model`` under key ``k`` (replacing the previous entry)."""
    if k is not None:
        _CACHE[model] = (k[0], k[1], list(found))


def clear() -> None:
    """Forget every cached discovery (tests; a model whose forward code was patched)."""
    _CACHE.clear()
