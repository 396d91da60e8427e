"""Argument checks shared by the public functions (one wording, one exception type each)."""

from __future__ import annotations

from numbers import Integral


def count(call: str, name: str, value: object, minimum: int = 1) -> int:
    """An integer ``>= minimum``: TypeError for a non-integer (bools too), ValueError below it."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{call}: {name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{call}: {name} must be an integer >= {minimum}, got {value!r}")
    return int(value)
