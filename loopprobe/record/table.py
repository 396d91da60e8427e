"""The visit table: one row per physical sublayer with its role, nesting, size and visits.

:meth:`loopprobe.record.probe.Probe.visit_table` records the visits; this builds the frame.
Reference: seed 002, Eq. 17-18 (M and M_g).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd
from torch import nn

from loopprobe.record import discover
from loopprobe.record.types import Sublayer, Visit


def visit_frame(
    visits: Sequence[Visit],
    subs: Sequence[Sublayer],
    outside: Sequence[tuple[int, Any]],
    ties: Sequence[Any],
    model: nn.Module,
) -> pd.DataFrame:
    """The frame of :meth:`~loopprobe.record.probe.Probe.visit_table` from the visits, the
    sublayers, the calls of sublayer modules outside the loop (``(j, ...)`` pairs) and the
    partial ties (:mod:`loopprobe.record.ties`)."""
    body = [s.index for s in subs if s.role == "body"]
    nested = discover.nesting([v.j for v in visits], body)
    rows = []
    for s in subs:
        mine = [v for v in visits if v.j == s.index]
        loop, steps = nested.get(s.index, ([], float("nan")))
        rows.append(
            {
                "sublayer": s.name,
                "j": s.index,
                "role": s.role,
                "nested_in": ",".join(subs[b].name for b in loop),
                "steps_per_outer": steps,
                "modules": ",".join(s.modules),
                "parameters": s.numel,
                "tensors": len(s.param_names),
                "visits": len(mine),
                "grad_visible": sum(bool(v.grad_visible) for v in mine),
                "no_grad_visits": sum(not v.grad_enabled for v in mine),
                "outside_calls": sum(j == s.index for j, _ in outside),
                "note": s.note,
            }
        )
    df = pd.DataFrame(rows)
    df.attrs["M"] = len(visits)
    df.attrs["partial_ties"] = [t.sentence() for t in ties]
    df.attrs["M_g"] = sum(bool(v.grad_visible) for v in visits)
    cfg = getattr(model, "cfg", None)  # the formula, when the model states one
    for key in ("M", "M_g"):
        if isinstance(getattr(cfg, key, None), int):
            df.attrs[f"{key}_formula"] = getattr(cfg, key)
    return df
