"""Property tests of the theory's statements on your own looped model family.

``import loopprobe.testing as lpt``: the checks (``lpt.check_*``) need neither pytest nor
hypothesis; ``lpt.configs``/``lpt.settings`` need hypothesis (``pip install
loopprobe[testing]``). Every name is imported on first use, so that the pytest plugin
(``loopprobe.testing.plugin``, registered as an entry point and loaded by every pytest run
where loopprobe is installed) imports no torch until a test uses it. The plugin gives
fixtures and applies the ``--loopprobe-profile`` settings to property tests that use this
module.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_CHECKS = (
    "check_updates_sum_to_tied_gradient",
    "check_kappa_in_range",
    "check_probe_leaves_model_unchanged",
    "check_first_order_change",
    "check_bound",
    "check_bound_slope",
    "check_increment_growth",
    "check_fixed_point_contracts",
    "check_updates_match_untied_copy",
    "check_sensitivity_matches_dense_jacobian",
    "check_spectral_radius_matches_dense",
)
#: the module of each check (split by job); the rest live in loopprobe.testing.checks
_HOME = {
    "check_probe_leaves_model_unchanged": "loopprobe.testing.unchanged",
    "check_updates_match_untied_copy": "loopprobe.testing.twins",
    "check_sensitivity_matches_dense_jacobian": "loopprobe.testing.twins",
    "check_spectral_radius_matches_dense": "loopprobe.testing.twins",
}
_LAZY = ("configs", "settings", "Config", "mean_square_loss", "reference_batch", "PROFILES")


def __getattr__(name: str) -> Any:
    """Import a name's module on first use (PEP 562) and keep the name here."""
    if name in _CHECKS:
        home = _HOME.get(name, "loopprobe.testing.checks")
        value = getattr(importlib.import_module(home), name)
    elif name == "CHECKS":
        value = tuple(__getattr__(c) for c in _CHECKS)
    elif name in _LAZY:
        try:
            strategies = importlib.import_module("loopprobe.testing.strategies")
        except ImportError as exc:  # pragma: no cover - exercised without hypothesis
            raise ImportError(
                f"loopprobe.testing.{name} needs hypothesis: pip install 'loopprobe[testing]'"
            ) from exc
        value = getattr(strategies, name)
    else:
        raise AttributeError(f"module 'loopprobe.testing' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [*_CHECKS, *_LAZY, "CHECKS"]

if TYPE_CHECKING:  # for type checkers and IDEs; at run time names load on first use
    from loopprobe.testing.checks import (  # noqa: F401 - the names __getattr__ loads
        check_bound,
        check_bound_slope,
        check_first_order_change,
        check_fixed_point_contracts,
        check_increment_growth,
        check_kappa_in_range,
        check_updates_sum_to_tied_gradient,
    )
    from loopprobe.testing.strategies import (  # noqa: F401
        PROFILES,
        Config,
        configs,
        mean_square_loss,
        reference_batch,
        settings,
    )
    from loopprobe.testing.twins import (  # noqa: F401
        check_sensitivity_matches_dense_jacobian,
        check_spectral_radius_matches_dense,
        check_updates_match_untied_copy,
    )
    from loopprobe.testing.unchanged import (  # noqa: F401
        check_probe_leaves_model_unchanged,
    )

    CHECKS: tuple = ()
