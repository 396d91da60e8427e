"""Argument checks shared by the public functions (one wording, one exception type each)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from numbers import Integral


def count(call: str, name: str, value: object, minimum: int = 1) -> int:
    """An integer ``>= minimum``: TypeError for a non-integer (bools too), ValueError below it."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{call}: {name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{call}: {name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


class Trust(ABC):
    """``converged`` and ``reason`` of a result from one list of what cannot be trusted.

    A result class defines ``_not_converged() -> list[str]`` (empty when every estimate
    behind it converged and every number it shows is valid).
    """

    @abstractmethod
    def _not_converged(self) -> list[str]:
        """What cannot be trusted, one phrase each (each result class says what it checks)."""

    @property
    def converged(self) -> bool:
        return not self._not_converged()

    @property
    def reason(self) -> str:
        return "; ".join(self._not_converged())
