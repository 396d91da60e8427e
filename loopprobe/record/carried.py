"""The stream a loop carries: how one visit's read holds an earlier visit's output.

Used by :class:`loopprobe.record.increments.Collector` when ``increment="auto"`` looks
for the carried stream of a loop that feeds its input back through a layer
(``h <- block(inject(cat[h, e]))``). A :class:`_Link` says how a read holds the carried
output: as an input, as a slice of a concatenation, or as an input minus a fixed tensor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, eq=False)
class _Link:
    """How a read holds the carried output: float input ``i`` is it, holds it at
    ``[off, off + n)`` along ``dim`` (a concatenation), or is it plus ``c`` (an injection)."""

    i: int
    shape: tuple
    dim: int | None = None
    off: int = 0
    n: int = 0
    c: torch.Tensor | None = None

    def carried(self, reads: list[torch.Tensor]) -> torch.Tensor:
        a = reads[self.i]
        if self.dim is not None:
            return a.narrow(self.dim, self.off, self.n)
        return a if self.c is None else a - self.c

    def holds(self, y: torch.Tensor, reads: list[torch.Tensor]) -> bool:
        ok = self.i < len(reads) and tuple(reads[self.i].shape) == self.shape
        return ok and _close(self.carried(reads), y)

    def rest(self, reads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Everything else the read holds: the other inputs and the rest of a concatenation."""
        out = [t for j, t in enumerate(reads) if j != self.i]
        if self.dim is not None and self.i < len(reads):
            a, end = reads[self.i], self.off + self.n
            out += [
                a.narrow(self.dim, 0, self.off),
                a.narrow(self.dim, end, a.shape[self.dim] - end),
            ]
        return out

    def how(self) -> str:
        if self.dim is not None:
            return (
                f"as [{self.off}:{self.off + self.n}] along dim {self.dim} of its float input "
                f"#{self.i} (a concatenation)"
            )
        if self.c is None:
            return f"as its float input #{self.i}"
        return f"as its float input #{self.i} minus the same tensor every round (an injection)"


def _links(y: torch.Tensor, reads: list[torch.Tensor]) -> list[_Link]:
    """Every way one read can hold ``y``: an input, a slice of one, an input minus a ``c``."""
    out = []
    for i, a in enumerate(reads):
        if a.dtype != y.dtype or a.ndim != y.ndim:
            continue
        if a.shape == y.shape:
            out.append(_Link(i, tuple(a.shape), c=None if _close(a, y) else a - y))
            continue
        dims = [d for d in range(a.ndim) if a.shape[d] != y.shape[d]]
        if len(dims) == 1 and a.shape[dims[0]] > y.shape[dims[0]]:
            d, n = dims[0], y.shape[dims[0]]
            for off in range(a.shape[d] - n + 1):
                if _close(a.narrow(d, off, n), y):
                    out.append(_Link(i, tuple(a.shape), d, off, n))
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and (_close(x, y) if y.numel() else True)
        for x, y in zip(a, b, strict=False)
    )


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    tol = math.sqrt(torch.finfo(b.dtype).eps) if b.is_floating_point() else 0.0
    if not a.is_floating_point() or a.dtype != b.dtype:
        return False
    return float(torch.linalg.vector_norm(a - b)) <= tol * float(torch.linalg.vector_norm(b))


def find_carried(
    names: list[str], read: list[Any], outputs: Mapping[int, Any]
) -> tuple[int, int, _Link] | str:
    """``(p, P, link)``: the visits (``names`` in call order; what each ``read`` and, by
    visit index, the ``outputs`` it returned) repeat in rounds of ``P``, and visit ``p`` of
    each round outputs what the next round's first visit reads by ``link``, with everything
    else it reads the same every round; else why not (a sentence)."""
    n = len(names)
    P = next((q for q in range(1, n // 2 + 1) if names == names[:q] * (n // q)), 0)
    if not P:
        return f"the visits ({', '.join(names[:6])}, ...) do not repeat in rounds"
    R, first = n // P, names[0]
    reads = [read[r * P] for r in range(R)]  # what each round's first visit reads
    found, moving = [], []
    for p in range(P):
        ys = [outputs[r * P + p] for r in range(R)]
        for link in _links(ys[0], reads[1]):
            if (link.c is not None and R < 3) or not all(
                link.holds(ys[r], reads[r + 1]) for r in range(1, R - 1)
            ):
                continue  # one pair cannot tell a fixed injection from a transform
            same = all(_same(link.rest(reads[r]), link.rest(reads[0])) for r in range(1, R))
            (found if same else moving).append((p, link))
    outs = sorted({names[p] for p, _ in found + moving})
    if len(found) == 1:
        return found[0][0], P, found[0][1]
    if found:
        return f"the next round's first visit ({first!r}) reads several outputs ({outs})"
    if moving:
        return (
            f"the next round's first visit ({first!r}) reads the output of {outs} but also "
            "inputs that change between rounds (the loop carries more than one stream)"
        )
    return (
        f"no visit's output is what the next round's first visit ({first!r}) reads (as an "
        "input, a slice of one, or one plus a fixed tensor); if a layer outside the probe "
        "feeds it back (an injection Linear(2d, d)), probing it too lets increment='auto' "
        "find the carried stream"
    )
