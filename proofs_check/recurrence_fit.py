"""Seed 001 (arXiv 2604.21106): the paper's phi is recoverable, with its CI, on its own grid.

Statement (seed 001 Eq. 3-4, Table 2, App. E-F; PAPERS.md 5). On the paper's exact
116-run iso-depth grid (r = 1, 2, 4, 8; six budgets; widths and r = 1 tokens of Table 6,
looped tokens reduced by the injection FLOPs), losses planted from the joint law with the
paper's alpha = 0.199, beta = 0.369, E = 1.57, phi = 0.459 (A, B solved so the law passes
through Table 5's s=10, r=4 run, 2.793 nats at 955M tokens, and Table 10's s=34, r=1 run,
2.047 nats at 47B tokens: A = 20.7, B = 1304) are fitted back with loopprobe.estimate.scaling
(Huber delta = 1e-3 on log loss, LSE form, L-BFGS-B with analytic gradient, restarts):
(1) without noise every parameter is recovered (|phi - 0.459| < 1e-6, R^2 = 1);
(2) the fit does not depend on the restart seed (phi equal to 1e-6 for two seeds);
(3) with 0.010-nat noise per run and a 0.003-nat offset per (budget, r) cell, the 95%
block-bootstrap CI over the 24 cells covers the planted phi: over n = 12 independent noise
draws (ci; 40 in thorough) with 40 cell resamples each (200 in thorough), the 95 % Wilson
interval [lo, hi] of the coverage k/n must have lo >= 0.6 (coverage at least 60 % with 95 %
confidence) and hi >= 0.95 (not significantly below nominal); at n = 12 that is k >= 11
(12/12: [0.76, 1.00], 11/12: [0.65, 0.99], 10/12: [0.55, 0.95]); and fixing phi = 0 or
phi = 1 loses R^2 (paper: 0.9972 vs 0.9858 / 0.9552). Power: a CI with true coverage 0.95
passes with probability 0.88, one covering 0.80 with 0.27, 0.68 with 0.07; the row cannot
tell a 90 % CI from a 95 % one (benchmarks/phi_coverage.py measures that: 85 / 90 draws).

Wrong variants (each must fail the same check): the interval phi_hat +- one bootstrap
standard error read as the 95 % CI (what a table's "+-" means; nominally 68 %, 10 of the
12 here), on the same draws; counting the injection (2 d^2) in N_once instead of N_rec
(phi comes out biased by ~0.02 on exact data); scipy's default L-BFGS-B
tolerances on the unscaled objective with 5 restarts (stops far from the optimum; phi
depends on the restart seed).

Not a wrong variant, measured: fitting raw loss instead of log loss with the same Huber
scale gives phi within ~0.006 of the log-loss fit on this grid (both residual scales are
mostly in Huber's linear region, and L varies only 2.3-3.0 nats), so it cannot be shown to
fail here; it is reported, not registered.

Bootstrap refits start from the full-data optimum only (no extra random starts) and the
coverage draws' own fits use two restarts, to keep the row at ~12 s of one CPU.

What a check cannot establish: that the paper's real losses follow the law (its residuals
are not published per run), or the published CI [0.41, 0.53] itself; only that the
protocol recovers a planted phi with honest coverage at the paper's noise scale.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from loopprobe.estimate import scaling as sc
from loopprobe.estimate import scaling_law as sl
from loopprobe.experiments import scaling_grid as sg
from proofs_check._registry import Outcome, Profile, statement, wrong_variant

REF = "seed 001, arXiv 2604.21106 Eq. 3-4, Table 2, App. E-F"
NOISE, CELL = 0.010, 0.003
DEFAULT_SOLVER = {"options": {}, "rescale": False, "informed": 0}


def _runs(noise: float, seed: int, move_injection: bool = False):
    df = sl.check_runs(sg.synthetic_runs(noise=noise, cell_noise=CELL if noise else 0.0, seed=seed))
    if move_injection:  # the wrong accounting: injection 2 d^2 counted once, not per loop
        inj = np.where(df.r > 1, 2.0 * df.d**2, 0.0)
        df["n_once"], df["n_rec"] = df.n_once + inj, df.n_rec - inj
    return df


def _check(
    profile: Profile,
    restarts: int = 4,
    move_injection: bool = False,
    solver=None,
    interval: str = "percentile",
):
    """Stages in order; the first that fails ends the check (wrong variants stay cheap)."""
    solver = solver or {}
    phi0 = sg.planted_params()["phi"]
    exact = sc.fit_law(_runs(0.0, 0, move_injection), restarts=restarts, **solver)
    d_phi = abs(exact.params["phi"] - phi0)
    figure = f"exact data: |phi - 0.459| = {d_phi:.1e}, R^2 = {exact.r2:.6f}"
    if not (d_phi < 1e-6 and exact.r2 > 1 - 1e-12):
        return Outcome(False, figure + " (not recovered; later stages skipped)")
    noisy = _runs(NOISE, 100, move_injection)
    s0, s1 = (sc.fit_law(noisy, restarts=restarts, seed=s, **solver) for s in (0, 1))
    spread = abs(s0.params["phi"] - s1.params["phi"])
    figure += f"; restart seeds 0/1: |d phi| = {spread:.1e}"
    if not spread < 1e-6:
        return Outcome(False, figure + " (seed-dependent; later stages skipped)")
    draws = _coverage_draws(profile.wide)
    covered = sum(lo <= phi0 <= hi for lo, hi in _intervals(draws, interval))
    n = len(draws)
    wlo, whi = wilson(covered, n)
    r2 = {v: sc.fit_law(noisy, fixed={"phi": v}, restarts=restarts, **solver).r2 for v in (0, 1)}
    what = "percentile 95% CI" if interval == "percentile" else "phi_hat +- 1 bootstrap SE"
    figure += (
        f"; {what} covered phi in {covered}/{n} draws ({draws[0]['n_boot']} cell resamples "
        f"each), Wilson 95% [{wlo:.2f}, {whi:.2f}] (want lo >= 0.6, hi >= 0.95); "
        f"R^2 free/phi=0/phi=1 = {s0.r2:.4f}/{r2[0]:.4f}/{r2[1]:.4f}"
    )
    return Outcome(wlo >= 0.6 and whi >= 0.95 and s0.r2 > max(r2.values()), figure)


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval (95 % by default) of a binomial proportion k / n."""
    centre = (k + z * z / 2) / (n + z * z)
    half = z / (n + z * z) * math.sqrt(k * (n - k) / n + z * z / 4)
    return max(0.0, centre - half), min(1.0, centre + half)


@functools.lru_cache(maxsize=2)  # the statement and its SE variant share the draws
def _coverage_draws(wide: bool) -> tuple[dict, ...]:
    """Independent noisy datasets (seeds 200..), each fitted and cell-bootstrapped."""
    n, n_boot = (40, 200) if wide else (12, 40)
    out = []
    for k in range(n):
        df = _runs(NOISE, 200 + k)
        fit = sc.fit_law(df, restarts=2, seed=k)
        boot, ci = sc.block_bootstrap(df, fit, n_boot, boot_restarts=0, seed=k)
        out.append(
            {"phi": fit.params["phi"], "ci": ci["phi"], "boot": boot[:, 5], "n_boot": n_boot}
        )
    return tuple(out)


def _intervals(draws, interval: str) -> list[tuple[float, float]]:
    if interval == "percentile":
        return [d["ci"] for d in draws]
    return [(d["phi"] - d["boot"].std(ddof=1), d["phi"] + d["boot"].std(ddof=1)) for d in draws]


@statement("Joint law: planted phi = 0.459 recovered with its CI on the 116-run grid", REF, "rate")
def recovery(profile: Profile) -> Outcome:
    return _check(profile)


@wrong_variant("phi_hat +- one bootstrap SE as the 95% CI (nominal 68%)", REF, "rate")
def se_interval(profile: Profile) -> Outcome:
    return _check(profile, interval="se")


@wrong_variant("Injection counted in N_once instead of N_rec", REF, "rate")
def injection_once(profile: Profile) -> Outcome:
    return _check(profile, move_injection=True)


@wrong_variant("scipy's default L-BFGS-B tolerances, unscaled objective, 5 restarts", REF, "rate")
def default_solver(profile: Profile) -> Outcome:
    return _check(profile, restarts=5, solver=DEFAULT_SOLVER)
