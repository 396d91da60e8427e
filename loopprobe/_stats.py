"""The small statistics every diagnostic shares: cosines from a Gram matrix, log-log slopes.

One implementation each, so every result handles the degenerate cases (a zero vector, a
non-positive or non-finite point) the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch


def cosine_matrix(gram: torch.Tensor) -> torch.Tensor:
    """Cosines ``gram[r, s] / sqrt(gram[r, r] gram[s, s])`` of the vectors behind a Gram matrix.

    A zero (or non-finite) vector has no direction: its row and column are NaN, diagonal
    included. Roundoff is kept inside ``[-1, 1]`` (a negative diagonal from roundoff
    counts as zero).
    """
    d = gram.diagonal().clamp_min(0).sqrt()
    outer = d[:, None] * d[None, :]
    c = (gram / outer).clamp(-1.0, 1.0)
    return c.masked_fill((outer == 0) | ~torch.isfinite(outer), math.nan)


def loglog_slope(x: Sequence[float], y: Sequence[float]) -> float:
    """Least-squares slope of log y on log x over the points with x, y > 0 and finite.

    NaN when fewer than two distinct x remain (the slope is then undefined).
    """
    x, y = np.asarray(x, float), np.asarray(y, float)
    ok = (x > 0) & (y > 0) & np.isfinite(x) & np.isfinite(y)
    if len(np.unique(x[ok])) < 2:
        return math.nan
    return float(np.polyfit(np.log(x[ok]), np.log(y[ok]), 1)[0])
