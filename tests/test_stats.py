"""The shared small statistics and argument checks: one implementation each, used everywhere."""

from __future__ import annotations

import math
import pathlib
import re

import numpy as np
import pytest
import torch

import loopprobe as lp
from loopprobe import tasks, theory
from loopprobe._stats import cosine_matrix, loglog_slope

SRC = pathlib.Path(lp.__file__).parent


def test_cosine_matrix_matches_normalised_dot_products():
    Z = torch.randn(4, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    U = Z / Z.norm(dim=1, keepdim=True)
    torch.testing.assert_close(cosine_matrix(Z @ Z.T), U @ U.T, rtol=0, atol=1e-15)


def test_a_zero_vector_has_nan_cosines_in_its_row_and_column_only():
    Z = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    c = cosine_matrix(Z @ Z.T)
    assert torch.isnan(c[1]).all() and torch.isnan(c[:, 1]).all()
    assert c[0, 0] == 1.0 and c[0, 2] == pytest.approx(1 / math.sqrt(2), rel=1e-15)


def test_cosines_of_parallel_vectors_stay_inside_minus_one_one_under_roundoff():
    v = torch.tensor([0.1, 0.7, 0.3], dtype=torch.float32)
    Z = torch.stack([v, 3.0000001 * v, -v / 7])
    gram = Z @ Z.T
    gram[0, 1] = gram[1, 0] = gram[0, 1] * (1 + 1e-6)  # a dot product rounded up past |a||b|
    c = cosine_matrix(gram)
    assert float(c.max()) == 1.0 and float(c.min()) == pytest.approx(-1.0, abs=1e-6)
    assert float(c.min()) >= -1.0


def test_loglog_slope_recovers_a_power_and_skips_invalid_points():
    x = np.array([1.0, 2.0, 4.0, 8.0, 16.0])
    assert loglog_slope(x, 3 * x**-0.5) == pytest.approx(-0.5, abs=1e-12)
    y = 3 * x**0.5
    y[2], y[3] = math.nan, 0.0  # NaN and non-positive points are left out, not fitted
    assert loglog_slope(x, y) == pytest.approx(0.5, abs=1e-12)
    assert math.isnan(loglog_slope([2.0, 2.0], [1.0, 3.0]))


def _definitions(pattern: str) -> list[str]:
    hits = []
    for path in sorted(SRC.rglob("*.py")):
        for line in path.read_text().splitlines():
            if re.search(pattern, line):
                hits.append(f"{path.relative_to(SRC)}: {line.strip()}")
    return hits


@pytest.mark.parametrize(
    "pattern",
    [
        r"^def _?cos(ine)?(_matrix)?\(",  # a module-level cosine-from-Gram helper
        r"polyfit\(\s*(np\.)?log",  # a log-log least-squares slope
        r"^def (_count|count|_check_int)\(",  # an integer-argument validator
    ],
)
def test_each_shared_helper_is_defined_once_in_the_package(pattern):
    assert len(_definitions(pattern)) == 1, _definitions(pattern)


@pytest.mark.parametrize(
    "call",
    [
        lambda v: theory.visit_count(v, 2),
        lambda v: lp.fixed_point(lambda h: h / 2, torch.ones(3), max_iter=v),
        lambda v: tasks.random_tokens(v, 4, 5, torch.Generator()),
    ],
)
def test_integer_arguments_raise_type_error_for_non_integers_and_value_error_below_range(call):
    with pytest.raises(TypeError, match="must be an integer >= .* got 2.5"):
        call(2.5)
    with pytest.raises(ValueError, match="must be an integer >= .* got -1"):
        call(-1)
