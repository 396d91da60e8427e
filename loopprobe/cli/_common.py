"""Helpers shared by the subcommands: list parsing, JSON output, loading a user's model."""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Callable
from typing import Any

import torch


def int_list(text: str) -> list[int]:
    """Parse ``"1,2,4"`` into ``[1, 2, 4]`` (for argparse ``type=``)."""
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError as err:
        raise ValueError(f"expected comma-separated integers like 1,2,4, got {text!r}") from err
    if not values:
        raise ValueError(f"expected comma-separated integers like 1,2,4, got {text!r}")
    return values


def load_object(spec: str, what: str = "--model") -> Callable[..., Any]:
    """Import ``package.module:attr`` and return the attribute, with one-line errors."""
    if ":" not in spec:
        raise ValueError(f"{what} {spec!r} must look like package.module:factory")
    mod_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as err:
        raise ValueError(f"{what} {spec!r}: cannot import {mod_name!r} ({err})") from err
    try:
        obj = getattr(module, attr)
    except AttributeError as err:
        raise ValueError(f"{what} {spec!r}: module {mod_name!r} has no attribute {attr!r}") from err
    if not callable(obj):
        raise TypeError(f"{what} {spec!r}: {attr!r} is not callable")
    return obj


def to_jsonable(obj: Any) -> Any:
    """Convert numpy/torch scalars, NaN and nested containers to plain JSON values."""
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "ndim", 0) == 0:
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def print_json(obj: Any) -> None:
    print(json.dumps(to_jsonable(obj), indent=2))


def emit(report: dict, as_json: bool, format_text: Callable[[dict], str]) -> int:
    """Print a command's report as one JSON object or as text; exit code 0."""
    if as_json:
        print_json(report)
    else:
        print(format_text(report))
    return 0


def text_table(head: list[str], rows: list[list[str]]) -> list[str]:
    """Aligned plain-text rows: first column (names) left-aligned, the rest right-aligned."""
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    return [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in [head, *rows]
    ]


def setup_sweep(args: Any) -> None:
    """Shared start of the sweep commands: check ``--seeds``, then apply ``--threads``."""
    if args.seeds < 1:
        raise ValueError(f"--seeds {args.seeds}: give at least 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
