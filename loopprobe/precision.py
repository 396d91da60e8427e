"""Which floating dtypes a computation actually rounds in (:func:`dtypes_on_path`).

Tolerances and roundoff allowances follow the coarsest dtype in which arithmetic touches the
values on the path, not the parameters' dtype and not the mere presence of a tensor: a
float32 zero pad concatenated into a float64 model rounds nothing, while a float32 softmax of
float64 logits does (arithmetic, and the cast down before it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["dtypes_on_path", "is_half", "lowest_precision"]


#: Ops that move or select values without arithmetic: they round only when they cast to a
#: coarser dtype than their inputs (``x.float()`` of a float64 ``x``).
_MOVES = frozenset(
    "cat stack clone copy copy_ _to_copy constant_pad_nd expand index index_select gather "
    "select slice where masked_fill fill_ zero_ zeros_like ones_like full_like empty_like "
    "repeat flip roll embedding detach alias lift_fresh lift_fresh_copy".split()
)


def _bits(t: Any) -> int:
    return torch.finfo(t.dtype).bits


class _Dtypes(TorchDispatchMode):
    """Collects the floating dtypes that an op *rounds* in: the dtypes of what arithmetic on
    floating inputs returns, and of a move that casts to a coarser dtype. A tensor created
    without floating inputs (``torch.zeros`` of the default dtype used as a pad), a view, or
    a copy into a wider dtype rounds nothing, so a float32 zero pad concatenated into a
    float64 model leaves it a float64 computation."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        ins = [t for t in tree_leaves((args, kwargs)) if _floating(t)]
        if not ins or func.is_view:
            return out
        widest = max(_bits(t) for t in ins)
        moves = func.overloadpacket.__name__ in _MOVES
        for t in tree_leaves(out):
            if _floating(t) and (not moves or _bits(t) < widest):
                self.seen.add(t.dtype)
        return out


def _floating(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def dtypes_on_path(fn: Callable[[], Any], *, grad: bool = False) -> set[torch.dtype]:
    """The floating dtypes rounded in while ``fn()`` runs (:class:`_Dtypes`; one call;
    ``grad=True`` with grad enabled, for a forward that needs it: a tensor hook,
    autograd.grad inside)."""
    mode = _Dtypes()
    with torch.set_grad_enabled(grad), mode:
        fn()
    return mode.seen


def lowest_precision(dtypes: set[torch.dtype] | list[torch.dtype]) -> torch.dtype:
    """The dtype with the largest machine epsilon (float64 when ``dtypes`` is empty)."""
    return max(dtypes, key=lambda d: torch.finfo(d).eps, default=torch.float64)


def is_half(dtype: torch.dtype) -> bool:
    """bfloat16 and float16: too coarse to certify an estimate to a useful tolerance."""
    return torch.finfo(dtype).eps > 1e-4
