"""The paper's grid of runs (seed 001, App. E-F), and runs drawn from a planted law.

:func:`paper_grid` rebuilds the architectures and budgets of arXiv 2604.21106's iso-depth
study; :func:`synthetic_runs` draws losses from a known law on it, so the fit in
:mod:`loopprobe.estimate.scaling` can be checked against planted parameters.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from loopprobe.estimate.scaling_law import predict

# ------------------------------------------------------------------------- the paper's grid

BUDGETS = (4.64e17, 1e18, 2.15e18, 4.64e18, 1e19, 2.15e19)
# Table 6 (App. E): training tokens (B) of the r = 1 run per (width s, budget)
TABLE6_TOKENS = {
    6: {4.64e17: 0.98, 1e18: 2.10},
    8: {4.64e17: 0.64, 1e18: 1.36, 2.15e18: 2.95},
    10: {4.64e17: 0.45, 1e18: 0.97, 2.15e18: 2.08, 4.64e18: 4.49},
    12: {4.64e17: 0.34, 1e18: 0.72, 2.15e18: 1.55, 4.64e18: 3.34, 1e19: 7.13},
    14: {1e18: 0.56, 2.15e18: 1.20, 4.64e18: 2.59},
    16: {2.15e18: 0.96, 4.64e18: 2.07, 1e19: 4.43},
    18: {4.64e18: 1.70, 1e19: 3.62, 2.15e19: 7.78},
    20: {4.64e18: 1.42, 1e19: 3.05},
    24: {1e19: 2.20, 2.15e19: 4.71},
    28: {2.15e19: 3.58},
    34: {2.15e19: 2.52},
}
# Planted law: the paper's alpha, beta, E, phi (Table 2); A, B solved so the law passes
# through the injection ablation's linear run (Table 5: s=10, r=4, 955M tokens, 2.793)
# and the extrapolation's r = 1 run (Table 10: s=34, 47B tokens, 2.047).
PAPER = {"alpha": 0.199, "beta": 0.369, "E": 1.57, "phi": 0.459}
ANCHORS = ((4, 10, 0.955e9, 2.793), (1, 34, 47e9, 2.047))


def split_counts(r: int, d: int, prelude: int = 2, coda: int = 2, depth: int = 20):
    """Paper Sec. 3.2: (N_once, N_rec) with n_b = 12 d^2, injection n_i = 2 d^2 in N_rec."""
    nb = 12 * d * d
    if r == 1:
        return depth * nb, 0
    return (prelude + coda) * nb, (depth - prelude - coda) // r * nb + 2 * d * d


def paper_grid(rs: tuple = (1, 2, 4, 8)) -> pd.DataFrame:
    """The paper's 116-run iso-depth grid (without losses): r, s, d, n_once, n_rec, tokens, budget.

    Tokens: Table 6 gives the r = 1 run; a looped run spends 6 * 2 r d^2 more FLOPs per
    token on the injection, D_r = C / (C / D_1 + 12 r d^2) (reproduces Table 5's 955M).
    """
    rows = []
    for r in rs:
        for s, per in TABLE6_TOKENS.items():
            d = 64 * s
            n_once, n_rec = split_counts(r, d)
            for c, tok in per.items():
                d1 = tok * 1e9
                D = d1 if r == 1 else c / (c / d1 + 12 * r * d * d)
                rows.append((r, s, d, n_once, n_rec, D, c))
    return pd.DataFrame(rows, columns=["r", "s", "d", "n_once", "n_rec", "tokens", "budget"])


def planted_params() -> dict:
    """The paper's alpha, beta, E, phi with A, B through the two ANCHORS (see above)."""
    p = PAPER
    M, y = [], []
    for r, s, D, L in ANCHORS:
        n_once, n_rec = split_counts(r, 64 * s)
        M.append([(n_once + r ** p["phi"] * n_rec) ** -p["alpha"], D ** -p["beta"]])
        y.append(L - p["E"])
    A, B = np.linalg.solve(np.array(M), np.array(y))
    return {"A": float(A), "alpha": p["alpha"], "B": float(B), "beta": p["beta"], "E": p["E"],
            "phi": p["phi"]}  # fmt: skip


def synthetic_runs(
    params: dict | None = None,
    grid: pd.DataFrame | None = None,
    *,
    noise: float = 0.010,
    cell_noise: float = 0.0,
    seed: int = 0,
) -> pd.DataFrame:
    """Losses from a planted law on a grid, plus Gaussian noise (nats) per run and per cell."""
    params = planted_params() if params is None else params
    grid = paper_grid() if grid is None else grid
    out = grid.copy()
    rng = np.random.default_rng(seed)
    loss = predict(params, out) + noise * rng.standard_normal(len(out))
    if cell_noise:
        cells = out.groupby(["budget", "r"]).ngroup().to_numpy()
        loss = loss + cell_noise * rng.standard_normal(cells.max() + 1)[cells]
    out["loss"] = loss
    return out


# ------------------------------------------------------------------------- CI coverage


def coverage(
    datasets: int = 20,
    *,
    noise: float = 0.010,
    cell_noise: float = 0.010,
    bootstrap: int = 200,
    boot_restarts: int = 2,
    method: str = "cells",
    informed: int = 0,
    level: float = 0.95,
    params: dict | None = None,
    grid: pd.DataFrame | None = None,
    seed: int = 0,
    restarts: int = 8,
) -> pd.DataFrame:
    """Coverage of the bootstrap CI of phi on runs drawn from a planted law.

    ``datasets`` draws of :func:`synthetic_runs` (the
    paper's 116-run grid and planted law by default; per-run ``noise`` and per-(budget, r)
    ``cell_noise`` in nats; seeds ``seed .. seed + datasets - 1``); each is fitted and its
    ``level`` interval checked against the planted phi. One row per dataset: seed, phi_hat,
    lo, hi, covered, width, seconds. ``out.covered.mean()`` is the coverage.
    """
    import time

    from loopprobe.estimate.scaling import block_bootstrap, fit_law
    from loopprobe.estimate.scaling_law import check_runs

    params = planted_params() if params is None else params
    rows = []
    for s in range(seed, seed + datasets):
        t0 = time.perf_counter()
        df = check_runs(synthetic_runs(params, grid, noise=noise, cell_noise=cell_noise,
                                          seed=s))  # fmt: skip
        fit = fit_law(df, restarts=restarts, seed=s, call="coverage")
        _, ci = block_bootstrap(df, fit, bootstrap, boot_restarts=boot_restarts, seed=s,
                                level=level, method=method, informed=informed)  # fmt: skip
        lo, hi = ci["phi"]
        rows.append({"seed": s, "phi_hat": fit.params["phi"], "lo": lo, "hi": hi,
                     "covered": bool(lo <= params["phi"] <= hi), "width": hi - lo,
                     "seconds": time.perf_counter() - t0})  # fmt: skip
    return pd.DataFrame(rows)
