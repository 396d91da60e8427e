"""How much is one recurrence worth: the iso-depth joint scaling law and its exponent phi.

Joint law (seed 001, arXiv 2604.21106, Eq. 3)::

    L(N_once, N_rec, D, r) = E + A (N_once + r^phi N_rec)^(-alpha) + B D^(-beta)

``N_once``: parameters visited once per forward (prelude, coda); ``N_rec``: parameters
visited on every recurrence (the looped blocks and the input-injection layer); ``r``: the
recurrence count; ``D``: training tokens. phi = 1: r loops are worth r unique blocks;
phi = 0: no capacity gain. The paper measures phi = 0.459 [0.41, 0.53] on 116 runs.

Fit (Eq. 4, the Chinchilla form): minimise
sum_i Huber_delta(LSE(a - alpha log N_eff_i, b - beta log D_i, e) - log L_i), delta = 1e-3,
a = log A, b = log B, e = log E, with L-BFGS-B and an analytic gradient, best of several
random starts drawn uniformly in the paper's box. Near the optimum that sum is ~1e-4, and
scipy's default stopping rule (relative decrease below 2.2e-9 of max(|f|, 1)) stops far
from it; so the objective is divided by delta^2 and the tolerances are tight. Tight
tolerances alone do not make a few uniform starts repeatable (on the paper's grid about 1
in 5 lands in the global basin), so every fit also starts from the best points of a small
(alpha, beta, phi) grid with (E, A, B) by non-negative least squares; with those the
result does not depend on the restart seed (tested). CI: block bootstrap over
(budget, architecture) cells (App. F.2). Its coverage
(:func:`loopprobe.experiments.scaling_grid.coverage`, benchmarks/phi_coverage.py) on the
paper's grid with 0.010 nats per run and 0.010 per cell: the planted phi in 85 of 90 95 %
intervals (94 %, Wilson [88 %, 98 %]); random restarts in the refits move the interval
ends by < 2e-8. A fit says when the runs do not identify phi (``fit.identified``,
:func:`identification`); ``fit.per_arch`` holds the per-architecture standard fits
(Table 1).

Example::

    fit = lp.scaling.fit_recurrence_law(df, bootstrap=200)   # columns: COLUMNS
    print(fit.params["phi"], fit.ci["phi"], fit.r2, fit.converged)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from loopprobe._threads import blas_threads
from loopprobe.estimate.param_split import UNEMBEDDING, ParamSplit, param_split  # noqa: F401 - lp.scaling's names
from loopprobe.estimate.scaling_law import (
    BOX,
    DELTA,
    NAMES,
    TIGHT,
    _check_budgets,
    _design,
    _terms,
    _theta_of,
    check_runs,
    objective,
)

# ------------------------------------------------------------------------- fitting


@dataclass
class LawFit:
    """A fitted law.

    ``params``: A, alpha, B, beta, E, phi (phi absent for the standard law); ``fixed``:
    the parameters held fixed; ``huber``: the objective (unscaled, as in the paper's
    tables); ``r2`` on the loss; ``residuals``: per run (actual - predicted, nats);
    ``cells``: per (budget, arch) cell n, mean, max |resid|, RMSE; ``ci``: 95% block-
    bootstrap intervals (empty without bootstrap); ``converged``/``reason``: the best
    restart stopped on the tolerance, at least two restarts reached the same optimum, and
    no parameter sits at the paper's box bound (else ``reason`` says which failed);
    ``edge``: the parameters on their box bound.

    ``identified``/``identification`` (set by :func:`fit_recurrence_law`): False with the
    reason when the runs cannot pin phi down (fewer than 3 budgets or 3 values of r, a
    parameter on its box bound, or a phi CI wider than ``max_ci_width``); then phi is a
    number the data do not determine and should not be reported. ``per_arch``: one
    standard-law fit (Eq. 2, N = n_once + n_rec) per architecture, as in the paper's Table 1.
    """

    form: str
    params: dict
    fixed: dict
    huber: float
    r2: float
    rmse: float
    residuals: pd.DataFrame
    cells: pd.DataFrame
    converged: bool
    reason: str
    restarts: int
    hits: int
    n: int
    ci: dict = field(default_factory=dict)
    bootstrap: np.ndarray | None = None
    restricted: dict = field(default_factory=dict)
    edge: list = field(default_factory=list)
    identified: bool = True
    identification: str = ""
    per_arch: dict = field(default_factory=dict)

    def plot(self):
        """Loss vs N_eff per architecture (markers: runs; lines: the fitted law per budget)."""
        from loopprobe.plots._base import new_figure, palette

        fig, axes = new_figure()
        ax = axes[0][0]
        df = self.residuals
        phi = self.params.get("phi", 1.0)
        neff = df.n_once + df.r**phi * df.n_rec
        archs = sorted(df.arch.unique())
        colors = dict(zip(archs, palette(len(archs)), strict=True))
        for arch in archs:
            m = df.arch == arch
            ax.scatter(neff[m], df.loss[m], s=16, color=colors[arch], label=arch, zorder=3)
        for budget, sub in df.assign(neff=neff).groupby("budget"):
            sub = sub.sort_values("neff")
            ax.plot(sub.neff, sub.predicted, color="0.4", lw=0.8, zorder=2)
            ax.annotate(f"C={budget:.2g}", (sub.neff.iloc[0], sub.predicted.iloc[0]), fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel(f"N_eff = N_once + r^phi N_rec  (phi = {phi:.3f})")
        ax.set_ylabel("loss (nats)")
        ax.set_title(f"{self.form} law, R^2 = {self.r2:.4f}")
        ax.legend(fontsize=8)
        return fig

    def summary(self) -> dict:
        """Plain-float summary (JSON-ready)."""
        out = {
            "form": self.form,
            "n": self.n,
            **{k: float(v) for k, v in self.params.items()},
            "huber": self.huber,
            "r2": self.r2,
            "rmse": self.rmse,
            "converged": self.converged,
            "reason": self.reason,
            "restarts": self.restarts,
            "hits": self.hits,
            "identified": self.identified,
            "identification": self.identification,
        }
        if self.ci:
            out["ci"] = {k: [float(lo), float(hi)] for k, (lo, hi) in self.ci.items()}
        if self.restricted:
            out["restricted"] = {k: v.summary() for k, v in self.restricted.items()}
        if self.per_arch:
            out["per_arch_fits"] = {k: v.summary() for k, v in self.per_arch.items()}
        return out


def _minimize(theta0, X, free, fixed_theta, target, options, scale):
    def fun(z):
        th = fixed_theta.copy()
        th[free] = z
        f, g = objective(th, X, target)
        return f * scale, g[free] * scale

    bounds = [BOX[NAMES[i]] for i in free]
    z0 = np.clip(theta0[free], [b[0] for b in bounds], [b[1] for b in bounds])
    from scipy.optimize import minimize  # on call: keeps scipy out of the import

    res = minimize(fun, z0, jac=True, method="L-BFGS-B", bounds=bounds, options=options)
    th = fixed_theta.copy()
    th[free] = res.x
    return th, res.fun / scale, res


GRID = {"alpha": (0.1, 0.25, 0.5), "beta": (0.1, 0.25, 0.5), "phi": (0.0, 0.5, 1.0)}


def linear_starts(X: dict, fixed_theta: np.ndarray, free: np.ndarray, k: int) -> list:
    """``k`` data-informed starting points: on a grid of (alpha, beta, phi) the law is linear
    in (E, A, B), solved by non-negative least squares on the loss; the best ``k`` by SSE."""
    from scipy.optimize import nnls  # on call: keeps scipy out of the import

    fixed = {NAMES[i] for i in range(6) if i not in free}
    axes = {n: ((fixed_theta[NAMES.index(n)],) if n in fixed else v) for n, v in GRID.items()}
    cands = []
    for al in axes["alpha"]:
        for be in axes["beta"]:
            for phi in axes["phi"]:
                neff = X["n_once"] + X["r"] ** phi * X["n_rec"]
                M = np.stack([np.ones_like(neff), neff**-al, np.exp(-be * X["logd"])], 1)
                coef, rnorm = nnls(M, X["y"])
                e, A, B = np.maximum(coef, 1e-12)
                cands.append((rnorm, [math.log(A), al, math.log(B), be, math.log(e), phi]))
    cands.sort(key=lambda c: c[0])
    return [np.array(c[1]) for c in cands[:k]]


def _best(X, free, fixed_theta, starts, restarts, seed, target, options, rescale, call,
          informed=0):  # fmt: skip
    """Best of the given starts, ``informed`` linear starts and ``restarts`` uniform draws."""
    opts = TIGHT if options is None else options
    scale = 1.0 / DELTA**2 if rescale else 1.0
    rng = np.random.default_rng(seed)
    lo = np.array([BOX[k][0] for k in NAMES])
    hi = np.array([BOX[k][1] for k in NAMES])
    points = [np.asarray(s, float) for s in (starts or [])]
    if informed:
        points += linear_starts(X, fixed_theta, free, informed)
    points += [rng.uniform(lo, hi) for _ in range(restarts)]
    found = []
    with blas_threads(1):
        for p0 in points:
            th, f, res = _minimize(p0, X, free, fixed_theta, target, opts, scale)
            if np.all(np.isfinite(th)) and np.isfinite(f):
                found.append((f, th, res))
    if not found:
        raise RuntimeError(f"{call}: every restart failed (non-finite objective)")
    found.sort(key=lambda t: t[0])
    fbest, best, res = found[0]
    hits = sum(f <= fbest + 1e-9 * max(fbest, DELTA**2) for f, _, _ in found)
    return found, fbest, best, res, hits


def fit_law(
    df: pd.DataFrame,
    *,
    form: str = "joint",
    fixed: dict | None = None,
    restarts: int = 8,
    seed: int = 0,
    starts: list | None = None,
    informed: int = 4,
    target: str = "log",
    options: dict | None = None,
    rescale: bool = True,
    call: str = "fit_law",
) -> LawFit:
    """One fit: L-BFGS-B from ``informed`` data-informed starts (:func:`linear_starts`),
    ``restarts`` uniform draws in the paper's box (seeded by ``seed``) and any ``starts``;
    the best objective wins. ``informed=0`` is the paper's protocol (random starts only).

    ``form``: ``joint`` (phi free unless fixed) or ``standard`` (N = n_once + n_rec, the
    per-architecture Chinchilla law, Eq. 2). ``fixed``: e.g. ``{"phi": 0.0}``.
    ``options``/``rescale``: the solver's stopping rule (default tight, objective / delta^2);
    ``options={}, rescale=False`` is scipy's default (shown to fail on the paper's grid).
    """
    if form not in ("joint", "standard"):
        raise ValueError(f"{call}: form={form!r}; use 'joint' or 'standard'")
    if target not in ("log", "raw"):
        raise ValueError(f"{call}: target={target!r}; use 'log' (the paper's) or 'raw'")
    if not isinstance(restarts, int) or restarts < 0 or (restarts + informed == 0 and not starts):
        raise ValueError(f"{call}: restarts={restarts!r}; give an integer >= 1")
    fixed = dict(fixed or {})
    if form == "standard":
        fixed["phi"] = 1.0  # N = n_once + r n_rec ... replaced below by unique N
    bad = [k for k in fixed if k not in NAMES]
    if bad:
        raise ValueError(f"{call}: fixed={fixed}: unknown {bad}; use names from {NAMES}")
    X = _design(df)
    if form == "standard":  # unique parameters N = n_once + n_rec: r = 1 in the formula
        X = dict(X, r=np.ones_like(X["r"]), logr=np.zeros_like(X["r"]))
    fixed_theta = np.zeros(6)
    for k, v in fixed.items():
        fixed_theta[NAMES.index(k)] = v
    free = np.array([i for i, k in enumerate(NAMES) if k not in fixed])
    found, fbest, best, res, hits = _best(
        X, free, fixed_theta, starts, restarts, seed, target, options, rescale, call, informed
    )
    msg = res.message if isinstance(res.message, str) else res.message.decode()
    # ABNORMAL: the line search found no decrease at machine precision; at an optimum that
    # other restarts reach too, this is the tight tolerance's normal stop.
    stopped = bool(res.success) or msg.startswith("ABNORMAL")
    converged = stopped and hits >= 2
    reason = f"{msg.strip() or 'stopped'}; best objective reached by {hits}/{len(found)} restarts"
    if not stopped:
        reason = "best restart did not converge: " + reason
    elif hits < 2:
        reason = "only one restart reached the best objective (add restarts): " + reason
    edge = [NAMES[i] for i in free if min(abs(best[i] - b) for b in BOX[NAMES[i]]) < 1e-6]
    if edge:  # a bound is active: that parameter is not identified inside the box
        reason += f"; at the box bound (not identified inside the box): {', '.join(edge)}"
        converged = False
    if converged:
        reason = ""
    a, al, b, be, e, phi = best
    params = {"A": math.exp(a), "alpha": al, "B": math.exp(b), "beta": be, "E": math.exp(e)}
    if form == "joint":
        params["phi"] = phi
    pred = np.exp(_terms(best, X)[0])
    resid = X["y"] - pred
    r2 = 1.0 - float((resid**2).sum() / ((X["y"] - X["y"].mean()) ** 2).sum())
    rtab = df[["budget", "arch", "r", "n_once", "n_rec", "tokens", "loss"]].copy()
    rtab["predicted"], rtab["residual"] = pred, resid
    cells = (
        rtab.groupby(["budget", "arch"])["residual"]
        .agg(
            n="size",
            mean="mean",
            max_abs=lambda v: float(np.abs(v).max()),
            rmse=lambda v: float(np.sqrt((v**2).mean())),
        )
        .reset_index()
    )
    return LawFit(
        form=form,
        params={k: float(v) for k, v in params.items()},
        fixed={k: float(v) for k, v in fixed.items() if form == "joint" or k != "phi"},
        huber=float(fbest),
        r2=r2,
        rmse=float(np.sqrt((resid**2).mean())),
        residuals=rtab,
        cells=cells,
        converged=converged,
        reason=reason,
        restarts=len(found),
        hits=int(hits),
        n=len(df),
        edge=[
            {"a": "A", "b": "B", "e": "E"}.get(NAMES[i], NAMES[i]) for i in free if NAMES[i] in edge
        ],  # fmt: skip
    )


def fit_recurrence_law(
    df: pd.DataFrame,
    *,
    bootstrap: int = 200,
    restarts: int = 8,
    boot_restarts: int = 2,
    seed: int = 0,
    restricted: bool = True,
    level: float = 0.95,
    max_ci_width: float = 1.0,
    per_arch: bool = True,
    method: str = "cells",
) -> LawFit:
    """Fit the joint law (phi free) to runs; block-bootstrap CI; restricted phi = 0 / 1 fits.

    ``df``: one row per run with columns ``COLUMNS`` (+ optional ``arch``, ``seed``);
    ``loss`` in nats, ``tokens`` the training tokens D, ``budget`` the compute budget
    (it defines the cells with ``arch``, default ``r``). ``bootstrap``: resamples of the
    (budget, arch) cells (0: none); each refit starts from the full-data optimum plus
    ``boot_restarts`` random points (``method``: see :func:`block_bootstrap`).
    ``fit.restricted``: ``{"phi=0": ..., "phi=1": ...}``; ``fit.per_arch``: the standard
    law fitted to each architecture's runs alone (``per_arch=False``: skip).

    ``fit.identified`` is False, with ``fit.identification`` giving the reason, when the
    runs span fewer than 3 budgets or 3 values of r, a parameter of the joint fit sits on
    its box bound, or the phi CI is wider than ``max_ci_width`` (default 1: wider than the
    whole range from no gain to full equivalence); report "not identified", not phi.
    """
    call = "fit_recurrence_law"
    df = check_runs(df, call)
    _check_budgets(df, call)
    if not isinstance(bootstrap, int) or bootstrap < 0:
        raise ValueError(f"{call}: bootstrap={bootstrap!r}; give an integer >= 0 (e.g. 200)")
    if not 0 < level < 1:
        raise ValueError(f"{call}: level={level!r} must lie in (0, 1)")
    fit = fit_law(df, restarts=restarts, seed=seed, call=call)
    if restricted:
        fit.restricted = {
            f"phi={v:g}": fit_law(df, fixed={"phi": v}, restarts=restarts, seed=seed, call=call)
            for v in (0.0, 1.0)
        }
    if per_arch:
        fit.per_arch = {
            arch: fit_law(
                sub.reset_index(drop=True), form="standard", restarts=restarts, seed=seed, call=call
            )  # fmt: skip
            for arch, sub in df.groupby("arch", sort=True)
        }
    if bootstrap:
        fit.bootstrap, fit.ci = block_bootstrap(
            df, fit, bootstrap, boot_restarts=boot_restarts, seed=seed, level=level,
            method=method,
        )  # fmt: skip
    why = identification(df, fit, max_ci_width)
    fit.identified, fit.identification = not why, "; ".join(why)
    return fit


def identification(df: pd.DataFrame, fit: LawFit, max_ci_width: float = 1.0) -> list[str]:
    """Why the runs do not identify phi (empty list: identified). See :func:`fit_recurrence_law`."""
    why = []
    nb, nr = df["budget"].nunique(), df["r"].nunique()
    if nb < 3:
        why.append(f"{nb} budget(s); the law needs at least 3 to separate N_eff from D")
    if nr < 3:
        why.append(f"{nr} value(s) of r; phi needs at least 3")
    if fit.edge:
        why.append(f"{', '.join(fit.edge)} on the box bound of the fit")
    if fit.ci and "phi" in fit.ci:
        lo, hi = fit.ci["phi"]
        if not hi - lo <= max_ci_width:
            why.append(f"phi CI [{lo:.2f}, {hi:.2f}] wider than {max_ci_width:g}")
    return why


def block_bootstrap(
    df: pd.DataFrame,
    fit: LawFit,
    n: int,
    *,
    boot_restarts: int = 2,
    seed: int = 0,
    level: float = 0.95,
    method: str = "cells",
    informed: int = 0,
) -> tuple[np.ndarray, dict]:
    """Bootstrap refits and percentile intervals at ``level``.

    ``method="cells"`` (the paper's, App. F.2): resample the (budget, arch) cells with
    replacement and refit. ``method="wild"``: keep the design, add to the fitted log loss the
    fit's log residuals, each cell's residuals multiplied by one Rademacher sign per cell
    (a wild cluster bootstrap; noise shared within a cell stays shared) and refit. Each refit
    starts from the full-data optimum, ``boot_restarts`` uniform draws and ``informed``
    data-informed starts of the resample (:func:`linear_starts`).
    """
    if method not in ("cells", "wild"):
        raise ValueError(f"block_bootstrap: method={method!r}; use 'cells' or 'wild'")
    rng = np.random.default_rng(seed + 1)
    cell_of = df.groupby(["budget", "arch"]).ngroup().to_numpy()
    groups = [np.flatnonzero(cell_of == c) for c in range(cell_of.max() + 1)]
    X = _design(df)
    free = np.arange(6)
    start = _theta_of(fit.params)
    logfit = _terms(start, X)[0]
    logres = X["logy"] - logfit
    draws = []
    for k in range(n):
        if method == "cells":
            pick = rng.integers(len(groups), size=len(groups))
            rows = np.concatenate([groups[i] for i in pick])
            sub = {key: v[rows] for key, v in X.items()}
        else:
            sign = rng.choice([-1.0, 1.0], size=len(groups))[cell_of]
            logy = logfit + sign * logres
            sub = dict(X, logy=logy, y=np.exp(logy))
        best = _best(sub, free, np.zeros(6), [start], boot_restarts, seed + 7919 * (k + 1),
                     "log", None, True, "block_bootstrap", informed)[2]  # fmt: skip
        a, al, b, be, e, phi = best
        draws.append([math.exp(a), al, math.exp(b), be, math.exp(e), phi])
    draws = np.array(draws)
    q = 100 * (1 - level) / 2
    ci = {
        p: tuple(np.percentile(draws[:, i], [q, 100 - q]))
        for i, p in enumerate(("A", "alpha", "B", "beta", "E", "phi"))
    }
    return draws, ci
