"""The notebook view of a result: one status line, the key numbers, the frame as a table.

Every type in :mod:`loopprobe.results` derives from :class:`HTMLView`; Jupyter calls
``_repr_html_`` when a result is the last expression of a cell. A class names its key numbers
in ``_html_keys`` (attribute or property names; a scalar is shown, anything else is skipped);
the table is ``to_frame()`` (or the ``frame`` a result holds, as ``Health`` does) cut to
:data:`MAX_ROWS` rows, with a note saying how many are left out (the frame has them all).
"""

from __future__ import annotations

import html
import math
import numbers
from typing import Any, ClassVar

MAX_ROWS = 20


class HTMLView:
    """``_repr_html_`` from ``converged``/``reason``, ``_html_keys`` and ``to_frame()``."""

    _html_keys: ClassVar[tuple[str, ...]] = ()

    def _repr_html_(self) -> str:
        return result_html(self)


def result_html(result: Any, max_rows: int = MAX_ROWS) -> str:
    """The HTML view of ``result`` (see the module docstring); never raises on a bad frame."""
    name = html.escape(type(result).__name__)
    parts = [f"<div class='loopprobe-result'><b>{name}</b>: {_status(result)}"]
    keys = _key_numbers(result)
    if keys:
        parts.append("<br>" + ", ".join(f"{html.escape(k)} = {v}" for k, v in keys))
    parts.append(_table(result, max_rows))
    parts.append("</div>")
    return "".join(parts)


def _status(result: Any) -> str:
    converged = getattr(result, "converged", None)
    if converged is None:
        return "<i>no convergence flag (a record or a measurement, not an estimate)</i>"
    if converged:
        return "<span style='color:green'>converged</span>"
    reason = html.escape(str(getattr(result, "reason", "") or "no reason given"))
    return f"<span style='color:#b00'>not converged</span>: {reason}"


def _key_numbers(result: Any) -> list[tuple[str, str]]:
    out = []
    for key in type(result)._html_keys:
        try:
            value = getattr(result, key)
        except Exception:  # noqa: BLE001 - a property that cannot be computed is not shown
            continue
        if isinstance(value, bool):
            out.append((key, str(value)))
        elif isinstance(value, numbers.Integral):
            out.append((key, str(int(value))))
        elif isinstance(value, numbers.Real):
            v = float(value)
            out.append((key, "nan" if math.isnan(v) else f"{v:.4g}"))
        elif isinstance(value, str) and value:
            out.append((key, html.escape(value)))
    return out


def _table(result: Any, max_rows: int) -> str:
    to_frame = getattr(result, "to_frame", None)
    if to_frame is None:  # a result that holds its table (Health.frame)
        frame = getattr(result, "frame", None)
        to_frame = None if frame is None else (lambda: frame)
    if to_frame is None:
        return ""
    try:
        frame = to_frame()
    except Exception as err:  # noqa: BLE001 - the view says why instead of failing the cell
        return f"<br><i>to_frame() failed: {html.escape(f'{type(err).__name__}: {err}')}</i>"
    n = len(frame)
    shown = frame.head(max_rows).to_html(index=False, float_format=lambda v: f"{v:.4g}")
    if n <= max_rows:
        return shown
    whole = ".to_frame()" if hasattr(result, "to_frame") else ".frame"
    note = f"{max_rows} of {n} rows shown; {whole} has them all"
    return f"{shown}<i>{note}</i>"
