"""Sublayer names: dotted globs over module names (``blocks.*.attn``, ``**.mlp``) and the
user's ``sublayers=`` grouped by the parameters each module owns (:func:`groups_from_names`)."""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Sequence

from torch import nn

__all__ = ["groups_from_names", "is_glob", "match", "matches"]


def match(pattern: str, name: str) -> bool:
    """Dotted glob: ``*`` is one path segment, ``**`` any number of segments."""
    pat, parts = pattern.split("."), name.split(".")

    def rec(a: int, b: int) -> bool:
        if a == len(pat):
            return b == len(parts)
        if pat[a] == "**":
            return any(rec(a + 1, c) for c in range(b, len(parts) + 1))
        return b < len(parts) and fnmatch.fnmatchcase(parts[b], pat[a]) and rec(a + 1, b + 1)

    return rec(0, 0)


@functools.lru_cache(maxsize=256)
def matches(pattern: str, names: tuple[str, ...]) -> tuple[str, ...]:
    """The ``names`` that :func:`match` ``pattern``, in order (cached: a pure function of
    strings; a report attaches to a hundred models with the same module names)."""
    return tuple(n for n in names if match(pattern, n))


def is_glob(pattern: str) -> bool:
    return bool(re.search(r"[*?\[]", pattern))


def groups_from_names(model: nn.Module, names: Sequence[str], call: str) -> list[list[str]]:
    """Module names matched by ``names`` (names or dotted globs), grouped by parameter set."""
    all_modules = dict(model.named_modules())
    module_names = tuple(all_modules)
    picked: list[str] = []
    for pat in names:
        hits = list(matches(pat, module_names))
        if not is_glob(pat) and pat not in all_modules:
            raise ValueError(
                f"{call}: sublayer {pat!r} is not a module of {type(model).__name__}; "
                f"module names look like {list(all_modules)[1:6]}"
            )
        hits = [n for n in hits if any(True for _ in all_modules[n].parameters())]
        if not hits and not is_glob(pat):
            raise ValueError(
                f"{call}: sublayer {pat!r} owns no parameters; name modules that own the "
                "reused parameters"
            )
        if not hits:
            raise ValueError(f"{call}: pattern {pat!r} matches no module with parameters")
        picked += [n for n in hits if n not in picked]
    by_params: dict[frozenset, list[str]] = {}
    for n in picked:
        key = frozenset(id(p) for p in all_modules[n].parameters())
        by_params.setdefault(key, []).append(n)
    keys = list(by_params)
    for a in range(len(keys)):
        for b in range(a + 1, len(keys)):
            if keys[a] & keys[b]:
                raise ValueError(
                    f"{call}: sublayers {by_params[keys[a]][0]!r} and "
                    f"{by_params[keys[b]][0]!r} share some but not all parameters; name "
                    "disjoint modules (e.g. blocks.0.attn and blocks.0.mlp, not blocks.0 too)"
                )
    return [by_params[k] for k in keys]
