"""pytest plugin (entry point ``loopprobe`` in ``pytest11``): fixtures and settings for
property tests of a looped model family.

- ``--loopprobe-profile=ci|thorough`` (default ``ci``; or env ``LOOPPROBE_PROFILE``): the
  hypothesis settings given to every ``@given`` test in a module that imports
  ``loopprobe.testing`` and sets no ``@settings`` of its own (deadline off, shrinking on;
  ``ci`` derandomised with 8 examples, ``thorough`` 100 random ones). Other hypothesis
  tests in the suite are left alone.
- fixture ``lp_unchanged``: ``with lp_unchanged(model): ...`` fails the test, naming what,
  if the block changed the model's parameters, ``.grad``, buffers, modes, hooks or RNG.
- fixture ``lp_one_thread``: torch runs on one thread during the test (restored after);
  tiny models are several times faster so.

pytest loads this module in every run where loopprobe is installed, so it costs nothing
until a test uses it: it imports neither torch, pandas nor hypothesis itself. The profile
is applied only when the collected modules had imported hypothesis and loopprobe.testing,
with hypothesis's public ``settings(...)`` decorator (which refuses a test that has its
own). Loads without hypothesis installed (then only the fixtures are offered).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("loopprobe")
    group.addoption(
        "--loopprobe-profile",
        default=os.environ.get("LOOPPROBE_PROFILE", "ci"),
        choices=("ci", "thorough"),
        help="hypothesis settings for property tests that use loopprobe.testing",
    )


def _uses_lpt(module: object) -> bool:
    """Whether a test module names loopprobe.testing or something defined in it."""
    lpt = sys.modules.get("loopprobe.testing")
    if lpt is None or module is None:
        return False
    for value in vars(module).values():
        if value is lpt or str(getattr(value, "__module__", "")).startswith("loopprobe.testing"):
            return True
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    if "hypothesis" not in sys.modules:  # no collected module uses hypothesis: nothing to set
        return
    tests = []
    for item in items:
        fn = getattr(item, "obj", None)
        if getattr(fn, "is_hypothesis_test", False) and _uses_lpt(getattr(item, "module", None)):
            tests.append(getattr(fn, "__func__", fn))  # a method's function carries settings
    if not tests:
        return
    from hypothesis.errors import InvalidArgument

    from loopprobe.testing.strategies import settings

    chosen = settings(config.getoption("--loopprobe-profile"))
    for fn in tests:
        with contextlib.suppress(InvalidArgument):  # the test states its own settings
            chosen(fn)


@pytest.fixture
def lp_unchanged():
    """``with lp_unchanged(model): ...``: assert the block left the model as it was."""
    from loopprobe.testing._snapshot import _differences, _snapshot

    @contextlib.contextmanager
    def guard(model: torch.nn.Module) -> Iterator[None]:
        before = _snapshot(model)
        yield
        diffs = _differences(before, model)
        if diffs:
            raise AssertionError("lp_unchanged: the model changed: " + "; ".join(diffs[:6]))

    return guard


@pytest.fixture
def lp_one_thread() -> Iterator[None]:
    """torch on one thread during the test (the caller's thread count restored after)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
