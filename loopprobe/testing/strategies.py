"""Hypothesis strategies that draw configurations of a user's model family, and settings.

Needs hypothesis (``pip install loopprobe[testing]``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hypothesis import HealthCheck, Phase
from hypothesis import settings as Settings
from hypothesis import strategies as st
from torch import nn

from loopprobe.record.types import pick_output
from loopprobe.testing._family import remember

PROFILES = {
    # derandomised, few examples, shrinking on: the same counterexample on every CI run
    "ci": dict(max_examples=8, derandomize=True, database=None),
    # random, many examples, the example database on: for a local search
    "thorough": dict(max_examples=100, derandomize=False),
}
_COMMON = dict(
    deadline=None,
    phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink),
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,  # the plugin's fixtures hold no per-example state
    ],
    print_blob=False,
)
for _name, _kw in PROFILES.items():
    Settings.register_profile(f"loopprobe-{_name}", **_COMMON, **_kw)


def settings(profile: str = "ci", **overrides: Any) -> Settings:
    """Hypothesis settings for property tests of a model family: ``"ci"`` (derandomised, 8
    examples) or ``"thorough"`` (100 random examples); deadline off, shrinking on."""
    if profile not in PROFILES:
        raise ValueError(f"loopprobe.testing.settings: profile={profile!r}; use {list(PROFILES)}")
    return Settings(Settings.get_profile(f"loopprobe-{profile}"), **overrides)


def mean_square_loss(out: Any, inputs: Any) -> torch.Tensor:
    """The default loss: half the mean square of the output F (any scalar loss will do for
    the statements checked here, which are about one step of it)."""
    return 0.5 * pick_output(out, call="mean_square_loss").pow(2).mean()


class Config:
    """One drawn member of the family: ``params`` passed to the factory, the model, a batch
    for it (from ``batch_seed``), the loss, and ``rebuild(R)`` for statements across R.
    Printed (also in a hypothesis failure) as its settings only."""

    def __init__(self, params, batch_seed, model, batch, loss, factory, make_batch) -> None:
        self.params: dict[str, Any] = params
        self.batch_seed: int = batch_seed
        self.model: nn.Module = model
        self.batch: Any = batch
        self.loss: Callable = loss
        self.factory, self.make_batch = factory, make_batch

    def rebuild(self, R: int) -> tuple[nn.Module, Any]:
        """The same member at another R (same other settings and batch seed)."""
        return _build(self.factory, {**self.params, "R": R}, self.make_batch, self.batch_seed)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"Config({args}, batch_seed={self.batch_seed})"


def _build(factory: Callable, params: dict, make_batch: Callable, batch_seed: int) -> tuple:
    model = factory(**params)
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"loopprobe.testing.configs: the factory returned a {type(model).__name__}, not an "
            "nn.Module; the factory takes the drawn settings as keywords and returns the model"
        )
    return model, make_batch(model, torch.Generator().manual_seed(batch_seed))


def _strategy(name: str, spec: Any) -> st.SearchStrategy:
    if isinstance(spec, st.SearchStrategy):
        return spec
    if isinstance(spec, tuple) and len(spec) == 2:
        lo, hi = spec
        if all(isinstance(v, int) and not isinstance(v, bool) for v in spec):
            return st.integers(lo, hi)
        if all(isinstance(v, (int, float)) for v in spec) and lo > 0 and spec[0] <= spec[1]:
            # log-uniform scales, shrinking toward the lower end
            return st.floats(math.log(lo), math.log(hi)).map(math.exp)
        raise ValueError(
            f"loopprobe.testing.configs: {name}={spec!r}; a range is (low, high) of ints, or of "
            "positive floats"
        )
    if isinstance(spec, Sequence) and not isinstance(spec, str):
        if not spec:
            raise ValueError(f"loopprobe.testing.configs: {name}=[] offers no value")
        return st.sampled_from(list(spec))  # shrinks toward the first
    return st.just(spec)


def reference_batch(model: nn.Module, generator: torch.Generator) -> torch.Tensor:
    """Token ids for a model with ``cfg.vocab_size`` and ``cfg.seq_len`` (the reference
    models): 4 sequences."""
    cfg = getattr(model, "cfg", None)
    vocab, seq = getattr(cfg, "vocab_size", None), getattr(cfg, "seq_len", None)
    if vocab is None or seq is None:
        raise TypeError(
            f"loopprobe.testing.configs: no batch= given and {type(model).__name__} has no "
            "cfg.vocab_size/cfg.seq_len; pass batch=lambda model, generator: <inputs>"
        )
    return torch.randint(0, vocab, (4, seq), generator=generator)


def configs(
    factory: Callable[..., nn.Module],
    *,
    batch: Callable[[nn.Module, torch.Generator], Any] | None = None,
    loss: Callable | None = None,
    batch_seed: Any = (0, 255),
    **ranges: Any,
) -> st.SearchStrategy[Config]:
    """Configurations of the family ``factory(**drawn)``: each keyword is a range
    ``(low, high)`` (ints: integers; positive floats: log-uniform), a list of choices, a
    fixed value or a hypothesis strategy, e.g. ``configs(make, R=(1, 16), K=(1, 3), d=[8,
    16], dtype=[torch.float64], init_scale=(0.5, 2.0), seed=(0, 9))``. Every value shrinks
    toward the low end / first choice, so a failure is reported at the smallest failing
    configuration. ``batch(model, generator)`` makes the inputs (default: token ids for a
    reference model), seeded by the drawn ``batch_seed``; ``loss(output, inputs)`` defaults
    to :func:`mean_square_loss`."""
    make_batch = batch or reference_batch
    loss_fn = loss or mean_square_loss
    names = sorted(ranges)
    drawn = {k: _strategy(k, ranges[k]) for k in names}
    seeds = _strategy("batch_seed", batch_seed)

    @st.composite
    def draw(data: st.DrawFn) -> Config:
        params = {k: data(drawn[k]) for k in names}
        bseed = data(seeds)
        model, x = _build(factory, params, make_batch, bseed)
        cfg = Config(params, bseed, model, x, loss_fn, factory, make_batch)
        remember(model, cfg.rebuild)
        return cfg

    return draw()
