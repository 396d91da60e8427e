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

Loads without hypothesis installed (then only the fixtures are offered).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import pytest
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
    lpt = sys.modules.get("loopprobe.testing")
    if lpt is None or module is None:
        return False
    for value in vars(module).values():
        if value is lpt or getattr(value, "__module__", "").startswith("loopprobe.testing"):
            return True
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    try:
        from loopprobe.testing.strategies import settings
    except ImportError:  # no hypothesis: nothing to set
        return
    chosen = settings(config.getoption("--loopprobe-profile"))
    for item in items:
        fn = getattr(item, "obj", None)
        if not getattr(fn, "is_hypothesis_test", False):
            continue
        if getattr(fn, "_hypothesis_internal_settings_applied", False):
            continue  # the test states its own settings
        if _uses_lpt(getattr(item, "module", None)):
            fn._hypothesis_internal_use_settings = chosen


@pytest.fixture
def lp_unchanged():
    """``with lp_unchanged(model): ...``: assert the block left the model as it was."""
    from loopprobe.testing.checks import _differences, _snapshot

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
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
