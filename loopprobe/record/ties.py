"""Partly tied modules: same-class modules that share some parameters but not all.

That is how silently broken weight tying looks (``b.mlp = a.mlp`` without ``b.attn``), and
how an intended shared block with per-layer parts looks (Zamba). :class:`Probe` warns once
per discovery and notes on each sublayer that is only the shared part of such modules, so
its kappa is read as the shared part's (the visit table's ``note`` column).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace

from torch import nn

from loopprobe.record import discover
from loopprobe.record.session import Group


@dataclass(frozen=True)
class TieNote:
    """Same-class modules whose parameters are partly tied (see :func:`partial_ties`)."""

    modules: tuple[str, ...]
    cls: str
    shared: list[str]  # relative names, summarised (``mlp.*``)
    untied: list[str]
    shared_ids: frozenset

    def sentence(self) -> str:
        return (
            f"{', '.join(self.modules)} ({self.cls}) are partly tied: they share "
            f"{self.shared} but not {self.untied}"
        )


def partial_tie_notes(model: nn.Module) -> list[TieNote]:
    """The partial ties of ``model``, pairs of one class and one split merged."""
    merged: dict[tuple, tuple[list[str], frozenset]] = {}
    for a, b, shared, rest in partial_ties(model):
        ma = model.get_submodule(a)
        among = [n for n, _ in ma.named_parameters(remove_duplicate=False)]
        key = (
            type(ma).__name__,
            tuple(summarize(shared, among)),
            tuple(summarize(rest, among + rest)),
        )
        names, ids = merged.get(key, ([], frozenset()))
        ids |= {id(p) for n, p in ma.named_parameters(remove_duplicate=False) if n in shared}
        merged[key] = (names + [n for n in (a, b) if n not in names], ids)
    return [
        TieNote(tuple(names), cls, list(sh), list(un), ids)
        for (cls, sh, un), (names, ids) in merged.items()
    ]


def warn_partial_ties(ties: list[TieNote], call: str) -> None:
    if ties:
        t = ties[0]
        a, b = t.modules[:2]
        more = f" (and {len(ties) - 1} more partial ties)" if len(ties) > 1 else ""
        fix = t.untied[0].removesuffix(".*")
        warnings.warn(
            f"{call}: {a!r} and {b!r} ({t.cls}) are partly tied: they share {t.shared} but "
            f"not {t.untied}{more}; modules involved: {list(t.modules)}. That is how silently "
            f"broken weight tying looks; tie all of a module's parameters (e.g. {b}.{fix} = "
            f"{a}.{fix}) or none. Each parameter set is its own sublayer here: a kappa over "
            "the shared part is not the whole module's (see the visit table's note column). "
            "Where the split is intended (a shared block with per-layer parts, as in Zamba), "
            "the numbers stand for the shared part",
            stacklevel=4,
        )


def with_tie_note(g: Group, ties: list[TieNote]) -> Group:
    """``g`` with a ``note`` naming the partly tied modules it is only the shared part of."""
    ids = {id(p) for p in g.params}

    def inside(a: str) -> bool:  # the tie is within the sublayer: its kappa covers both sides
        return any(a == m or a.startswith(m + ".") for m in g.sublayer.modules)

    notes = [
        f"{t.sentence()}: this sublayer is only their shared part, so its kappa is over "
        f"{g.sublayer.numel} parameters, not over the whole {t.cls}"
        for t in ties
        if ids & t.shared_ids and not any(inside(a) for a in t.modules)
    ]
    if not notes:
        return g
    return replace(g, sublayer=replace(g.sublayer, note="; ".join(notes)))


def partial_ties(model: nn.Module) -> list[tuple[str, str, list[str], list[str]]]:
    """Pairs of same-class modules whose parameters (all of them, recursively) are partly
    the same objects: ``q.weight`` tied and ``q.bias`` not, or blocks that share their
    ``mlp`` but not their ``attn``. A parameter shared under different names in the two
    (an embedding's weight used as the output layer's, both wrapped in ``nn.Sequential``)
    is a tie across roles, not a partly tied copy, and is not reported.

    Returns ``(module a, module b, shared names, names not shared)`` per pair, names
    relative to the modules, innermost pairs first (where the tie breaks).
    """
    owners = []
    for name, m in model.named_modules():
        params = {pn: id(p) for pn, p in m.named_parameters(remove_duplicate=False)}
        if params:
            owners.append((name, type(m), params, set(params.values())))
    holders: dict[int, list[int]] = {}  # parameter id -> the owners holding it
    for x, (_, _, _, ids) in enumerate(owners):
        for i in ids:
            holders.setdefault(i, []).append(x)
    pairs = {(x, y) for xs in holders.values() for k, x in enumerate(xs) for y in xs[k + 1 :]}
    out = []
    for x, y in sorted(pairs):  # only owners that share a parameter can be partly tied
        (na, ca, pa, ia), (nb, cb, pb, ib) = owners[x], owners[y]
        if ca is not cb or ia == ib or nb.startswith(na + "."):
            continue
        shared = [pn for pn, i in pb.items() if i in ia]
        if not any(pa.get(pn) == pb[pn] for pn in shared):
            continue  # shared across roles (an embedding's weight as the output layer's)
        rest = [pn for pn, i in pa.items() if i not in ib]
        rest += [pn for pn, i in pb.items() if i not in ia and pn not in rest]
        if not _only_norms(model.get_submodule(na), model.get_submodule(nb), rest):
            out.append((na, nb, shared, rest))
    out.sort(key=lambda t: -t[0].count("."))  # stable: call order within a depth
    return out


def _only_norms(a: nn.Module, b: nn.Module, names: Sequence[str]) -> bool:
    """Every name is a parameter of a normalisation submodule (per-layer norms around a
    shared mixer are a design, ALBERT-style; a norm partly tied itself is not)."""

    def owner(n: str) -> nn.Module | None:
        for m in (a, b):
            try:
                return m.get_submodule(n.rpartition(".")[0]) if "." in n else m
            except AttributeError:
                continue
        return None

    owners = [owner(n) for n in names]
    return all(
        o is not None and o is not a and o is not b and discover.is_norm(type(o)) for o in owners
    )


def summarize(names: Sequence[str], among: Sequence[str]) -> list[str]:
    """``names`` (dotted parameter names) shortened to submodule globs: ``mlp.*`` when
    every name of ``among`` under ``mlp`` is in ``names``."""
    keep = set(names)
    out: list[str] = []
    for n in names:
        parts = n.split(".")
        short = n
        for k in range(1, len(parts)):
            pre = ".".join(parts[:k]) + "."
            if all(a in keep for a in among if a.startswith(pre)):
                short = pre + "*"
                break
        if short not in out:
            out.append(short)
    return out
