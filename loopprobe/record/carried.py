"""The stream a loop carries: how one visit's read holds an earlier visit's output.

Used by :class:`loopprobe.record.increments.Collector` when ``increment="auto"`` looks
for the carried stream of a loop that feeds its input back through a layer
(``h <- block(inject(cat[h, e]))``). A :class:`_Link` says how a read holds the carried
output: as an input, as a slice of a concatenation, or as an input minus a fixed tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
