"""Partly tied modules: same-class modules that share some parameters but not all.

That is how silently broken weight tying looks (``b.mlp = a.mlp`` without ``b.attn``), and
how an intended shared block with per-layer parts looks (Zamba). :class:`Probe` warns once
per discovery and notes on each sublayer that is only the shared part of such modules, so
its kappa is read as the shared part's (the visit table's ``note`` column).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

from torch import nn

from loopprobe.record import discover
from loopprobe.record.session import Group


@dataclass(frozen=True)
class TieNote:
    """Same-class modules whose parameters are partly tied (see discover.partial_ties)."""

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
    for a, b, shared, rest in discover.partial_ties(model):
        ma = model.get_submodule(a)
        among = [n for n, _ in ma.named_parameters(remove_duplicate=False)]
        key = (
            type(ma).__name__,
            tuple(discover.summarize(shared, among)),
            tuple(discover.summarize(rest, among + rest)),
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
