"""What a call may change on a module tree, saved so that it can be put back.

Probing never changes the user's model. A replayed call of a module (``replay_round``) may
rebind attributes (``self.cache = ...``), grow lists, bump counters or write buffers in
place; :class:`ModuleState` saves what such a call can change and :meth:`ModuleState.restore`
puts it back and says what changed (:class:`Change`), so a caller can refuse a call that is
not a pure function of its arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_TORCH_ATTRS = frozenset(vars(torch.nn.Module()))
_MISSING = object()
IN_PLACE = "written in place"


@dataclass(frozen=True)
class Change:
    """One attribute a call changed: its name, how, and whether it was put back."""

    name: str
    how: str
    restored: bool

    def __str__(self) -> str:
        return f"{self.name} {self.how}" + ("" if self.restored else " (not restored)")


class ModuleState:
    """What a call may change on a module tree, saved so that it can be put back.

    For every submodule: its plain attributes (``self.cache``, ``self.t``), buffers,
    parameters and children by identity, the contents of list/dict/set attributes, and each
    tensor's version counter (in-place writes). :meth:`restore` puts back rebound, added or
    removed attributes and container contents, and returns the :class:`Change` list; tensors
    written in place are put back from a copy only with ``clone=True`` (buffers and plain
    tensor attributes, never parameters). ``only`` (the changes an earlier call made) limits
    it to those attributes: a few dict look-ups per call instead of the whole tree.
    """

    def __init__(
        self,
        root: torch.nn.Module,
        prefix: str,
        clone: bool = False,
        only: list[Change] | None = None,
    ):
        self.stores: list[tuple[str, dict, dict, frozenset]] = []
        self.contents: dict[tuple[int, object], object] = {}
        self.versions: dict[tuple[int, object], tuple[int | None, torch.Tensor | None]] = {}
        self.watch = watch = None if only is None else _by_store(only)
        if watch == {}:
            return
        for path, m in root.named_modules(prefix=prefix):
            kinds = {"": m.__dict__, "buffer ": m._buffers, "parameter ": m._parameters}
            for kind, store in (kinds | {"submodule ": m._modules}).items():
                name = f"{kind}{path}."
                if watch is not None and name not in watch:
                    continue
                keys = watch[name] if watch is not None else None
                skip = _TORCH_ATTRS if kind == "" else frozenset()
                saved = {k: v for k, v in store.items() if k not in skip}
                if keys is not None:
                    saved = {k: v for k, v in saved.items() if k in keys}
                self.stores.append((name, store, saved, skip))
                for key, value in saved.items():
                    self._save(id(store), key, value, clone and kind != "parameter ")

    def _save(self, sid: int, key: object, value: object, clone: bool) -> None:
        if isinstance(value, torch.Tensor):
            copy = value.detach().clone() if clone else None
            self.versions[sid, key] = (_version(value), copy)
        elif isinstance(value, list | dict | set):
            self.contents[sid, key] = value.copy()

    def restore(self) -> list[Change]:
        changes = []
        for name, store, saved, skip in self.stores:
            watched = store if self.watch is None else self.watch[name]
            for key in [k for k in watched if k in store and k not in saved and k not in skip]:
                changes.append(Change(f"{name}{key}", "added", True))
                del store[key]
            for key, value in saved.items():
                now = store.get(key, _MISSING)
                if now is not value:
                    how = "removed" if now is _MISSING else f"rebound to {_brief(now)}"
                    changes.append(Change(f"{name}{key}", how, True))
                    store[key] = value
                change = self._restore_value(id(store), key, value)
                if change is not None:
                    changes.append(Change(f"{name}{key}", *change))
        return changes

    def _restore_value(self, sid: int, key: object, value: object) -> tuple[str, bool] | None:
        old = self.contents.get((sid, key), _MISSING)
        if old is not _MISSING:
            if _same_contents(old, value):
                return None
            how = f"changed in place ({_brief(old)} -> {_brief(value)})"
            if isinstance(value, list):
                value[:] = old
            else:
                value.clear()
                value.update(old)
            return how, True
        version, copy = self.versions.get((sid, key), (None, None))
        if version is None or _version(value) == version:
            return None
        if copy is None:
            return IN_PLACE, False
        with torch.no_grad():
            value.copy_(copy)
        return IN_PLACE, True


def _by_store(changes: list[Change]) -> dict[str, set[str]]:
    watch: dict[str, set[str]] = {}
    for c in changes:
        store, key = c.name.rsplit(".", 1)
        watch.setdefault(store + ".", set()).add(key)
    return watch


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except (RuntimeError, AttributeError):  # inference tensors and some wrappers have none
        return None


def _same_contents(old: object, now: object) -> bool:
    if len(old) != len(now):
        return False
    if isinstance(old, list):
        return all(a is b for a, b in zip(old, now, strict=True))
    if isinstance(old, dict):
        return all(now.get(k, _MISSING) is v for k, v in old.items())
    return old == now


def _brief(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {tuple(value.shape)}"
    if isinstance(value, list | dict | set | tuple):
        return f"{type(value).__name__} of {len(value)}"
    text = repr(value)
    return text if len(text) <= 20 else f"{type(value).__name__}"
