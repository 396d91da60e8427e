"""Hide installed packages from imports inside one test, as on an install without them.

``hide(monkeypatch, "matplotlib", "seaborn")`` drops those packages (and every module that
imported them lazily: ``loopprobe.plots``) from ``sys.modules`` and puts a finder first on
``sys.meta_path`` that answers their import with ``ModuleNotFoundError``, exactly what
Python raises when a package is not installed; ``monkeypatch`` restores both afterwards.
"""

from __future__ import annotations

import importlib.abc
import sys


class _Hidden(importlib.abc.MetaPathFinder):
    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


def hide(monkeypatch, *names: str, dependents: tuple[str, ...] = ("loopprobe.plots",)) -> None:
    """Make ``import <name>`` fail for each of ``names`` until the test ends."""
    for mod in list(sys.modules):
        top = mod.partition(".")[0]
        if top in names or any(mod == d or mod.startswith(d + ".") for d in dependents):
            monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setattr(sys, "meta_path", [_Hidden(names), *sys.meta_path])
