"""Property tests of the theory's statements on your own looped model family.

``import loopprobe.testing as lpt``: the checks (``lpt.check_*``) need neither pytest nor
hypothesis; ``lpt.configs``/``lpt.settings`` need hypothesis (``pip install
loopprobe[testing]``) and are imported on first use. The pytest plugin
(``loopprobe.testing.plugin``, registered as an entry point) gives fixtures and applies the
``--loopprobe-profile`` settings to property tests that use this module.
"""

from __future__ import annotations

from typing import Any

from loopprobe.testing.checks import (
    check_bound,
    check_bound_slope,
    check_first_order_change,
    check_fixed_point_contracts,
    check_increment_growth,
    check_kappa_in_range,
    check_probe_leaves_model_unchanged,
    check_updates_sum_to_tied_gradient,
)

CHECKS = (
    check_updates_sum_to_tied_gradient,
    check_kappa_in_range,
    check_probe_leaves_model_unchanged,
    check_first_order_change,
    check_bound,
    check_bound_slope,
    check_increment_growth,
    check_fixed_point_contracts,
)

_LAZY = ("configs", "settings", "Config", "mean_square_loss", "reference_batch", "PROFILES")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        try:
            from loopprobe.testing import strategies
        except ImportError as exc:  # pragma: no cover - exercised without hypothesis
            raise ImportError(
                f"loopprobe.testing.{name} needs hypothesis: pip install 'loopprobe[testing]'"
            ) from exc
        return getattr(strategies, name)
    raise AttributeError(f"module 'loopprobe.testing' has no attribute {name!r}")


__all__ = [*(c.__name__ for c in CHECKS), *_LAZY, "CHECKS"]
