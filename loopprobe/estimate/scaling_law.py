"""The iso-depth joint scaling law: its columns, its value, and the fitting objective.

``L(N_once, N_rec, D, r) = E + A (N_once + r^phi N_rec)^(-alpha) + B D^(-beta)`` (seed
001, arXiv 2604.21106, Eq. 3), in the log-sum-exp form the fit minimises (Eq. 4, Huber
on log loss). :mod:`loopprobe.estimate.scaling` fits it. Definitions: docs/definitions.md §5.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

COLUMNS = ("loss", "r", "n_once", "n_rec", "tokens", "budget")
NAMES = ("a", "alpha", "b", "beta", "e", "phi")
BOX = {
    "a": (-5.0, 35.0),
    "alpha": (0.0, 2.5),
    "b": (-5.0, 35.0),
    "beta": (0.0, 2.5),
    "e": (-3.0, 2.0),
    "phi": (-3.0, 3.0),
}
DELTA = 1e-3
TIGHT = {"ftol": 1e-15, "gtol": 1e-10, "maxiter": 10_000, "maxfun": 20_000}

# ------------------------------------------------------------------------- the runs


def check_runs(df: Any, call: str = "fit_recurrence_law") -> pd.DataFrame:
    """Validate a tidy frame of runs; returns a copy with ``arch`` (default: ``r``) added."""
    if not isinstance(df, pd.DataFrame):
        raise TypeError(f"{call}: expected a pandas DataFrame of runs, got {type(df).__name__}")
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(
            f"{call}: missing column(s) {missing}; the runs need columns {list(COLUMNS)} "
            "(+ optional arch, seed)"
        )
    out = df.copy()
    for c in COLUMNS:
        v = pd.to_numeric(out[c], errors="coerce")
        if v.isna().any():
            raise ValueError(f"{call}: column {c!r} has non-numeric or empty values")
        out[c] = v.astype(float)
    for c in ("loss", "r", "tokens", "budget"):
        bad = out.index[out[c] <= 0]
        if len(bad):
            raise ValueError(
                f"{call}: column {c!r} must be > 0, got {out.loc[bad[0], c]!r} (row {bad[0]})"
            )
    for c in ("n_once", "n_rec"):
        if (out[c] < 0).any():
            raise ValueError(f"{call}: column {c!r} must be >= 0")
    if ((out.n_once + out.n_rec) <= 0).any():
        raise ValueError(f"{call}: n_once + n_rec must be > 0 on every run")
    looped = out.r > 1
    if (looped & (out.n_rec <= 0)).any():
        raise ValueError(f"{call}: runs with r > 1 need n_rec > 0 (the looped parameters)")
    if "arch" not in out.columns:
        out["arch"] = out["r"].map(lambda v: f"r={v:g}")
    out["arch"] = out["arch"].astype(str)
    return out.reset_index(drop=True)


def _check_budgets(df: pd.DataFrame, call: str) -> None:
    if df["r"].nunique() < 2:
        raise ValueError(f"{call}: all runs have the same r; phi needs at least two values of r")
    per = df.groupby("budget")["arch"].nunique()
    lone = per[per < 2]
    if len(lone):
        raise ValueError(
            f"{call}: budget {lone.index[0]:g} has runs of one architecture only; the joint "
            "law compares architectures at the same budget (add runs or drop that budget)"
        )


# ------------------------------------------------------------------------- the law


def _log_neff(theta: np.ndarray, X: dict) -> tuple[np.ndarray, np.ndarray]:
    """log N_eff and d log N_eff / d phi."""
    rp = X["r"] ** theta[5]
    neff = X["n_once"] + rp * X["n_rec"]
    return np.log(neff), rp * X["logr"] * X["n_rec"] / neff


def _terms(theta: np.ndarray, X: dict):
    a, al, b, be, e, _ = theta
    logn, dphi = _log_neff(theta, X)
    t = np.stack([a - al * logn, b - be * X["logd"], np.full_like(logn, e)])
    m = t.max(0)
    w = np.exp(t - m)
    s = w.sum(0)
    return m + np.log(s), w / s, logn, dphi


def predict(params: dict, df: pd.DataFrame) -> np.ndarray:
    """Predicted loss of the law with ``params`` (A, alpha, B, beta, E, phi) on ``df``'s runs."""
    theta = _theta_of(params)
    return np.exp(_terms(theta, _design(df))[0])


def _design(df: pd.DataFrame) -> dict:
    return {
        "r": df["r"].to_numpy(float),
        "logr": np.log(df["r"].to_numpy(float)),
        "n_once": df["n_once"].to_numpy(float),
        "n_rec": df["n_rec"].to_numpy(float),
        "logd": np.log(df["tokens"].to_numpy(float)),
    } | (
        {"y": df["loss"].to_numpy(float), "logy": np.log(df["loss"].to_numpy(float))}
        if "loss" in df.columns
        else {}
    )


def objective(theta: np.ndarray, X: dict, target: str = "log", delta: float = DELTA):
    """Huber sum and its gradient in (a, alpha, b, beta, e, phi).

    ``target="log"``: residual LSE - log L (the paper's Eq. 4); ``"raw"``: exp(LSE) - L
    (a wrong variant kept to show that it fails).
    """
    lse, w, logn, dphi = _terms(theta, X)
    if target == "log":
        res, dres = lse - X["logy"], np.ones_like(lse)
    else:
        pred = np.exp(lse)
        res, dres = pred - X["y"], pred
    small = np.abs(res) <= delta
    f = np.where(small, 0.5 * res**2, delta * (np.abs(res) - 0.5 * delta)).sum()
    h = np.where(small, res, delta * np.sign(res)) * dres
    g = np.array(
        [
            (h * w[0]).sum(),
            -(h * w[0] * logn).sum(),
            (h * w[1]).sum(),
            -(h * w[1] * X["logd"]).sum(),
            (h * w[2]).sum(),
            -(h * w[0] * theta[1] * dphi).sum(),
        ]
    )
    return f, g


def _theta_of(p: dict) -> np.ndarray:
    """The optimiser's vector (log A, alpha, log B, beta, log E, phi) from named parameters."""
    return np.array(
        [math.log(p["A"]), p["alpha"], math.log(p["B"]), p["beta"], math.log(p["E"])]
        + [p.get("phi", 0.0)]
    )
