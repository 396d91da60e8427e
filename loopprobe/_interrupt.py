"""A Ctrl-C that Python could not raise where it landed, kept for the command to honour.

A SIGINT whose handler runs inside a finaliser (a weakref callback, a ``__del__``: torch and
Python run many) raises its KeyboardInterrupt there, where Python cannot propagate it: it is
printed as "Exception ignored in ..." and lost, and the command ran on to the end. While
:func:`kept` is active (the CLI, which owns its process), such an interrupt is recorded instead
of printed, and :func:`check`, called between units of work, raises it. Without ``kept``
(the library in a user's process) nothing is recorded and ``check`` does nothing.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

_pending: list[bool] = []


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """Record KeyboardInterrupts raised in finalisers until :func:`check` raises them."""
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            _pending.append(True)
        else:
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous
        _pending.clear()


def check() -> None:
    """Raise the KeyboardInterrupt a finaliser swallowed, if one did."""
    if _pending:
        _pending.clear()
        raise KeyboardInterrupt
