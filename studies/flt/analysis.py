"""LT vs FLT at 12 loops (issue 30.5): collapse, instability signals and their lead time.

The training runs live in ``studies/flt/run.py`` (CPU-minutes, outside CI); its long CSV (one
row per cell and record step) is committed as ``studies/flt/flt_study.csv``. This module holds
only the analysis and the criteria pre-registered in ``docs/studies/flt.md`` (committed before
the study ran).

Per cell (one arm, lr, R and seed; record steps every 10 training steps, diagnostics taken
before that step's update):

- *collapsed*: the mean held-out loss of the last ``END_WINDOW`` record steps lies above
  ``floor - COLLAPSE_MARGIN`` (the run ends on the byte-unigram plateau), or a held-out
  loss was not finite, or the run stopped on a non-finite loss or gradient. Its *collapse
  step* is the first non-finite record step (the last row of a stopped run), else the
  first record step from which every later loss lies above ``floor - COLLAPSE_MARGIN``,
  but not before ``COLLAPSE_FROM`` (until then healthy runs sit on the plateau too);
- a *signal fires* at the first record step where its ``lp.instability`` flag is on:
  ``oscillation`` = some sublayer's mean consecutive-visit gradient cosine is below 0
  (``n_oscillating >= 1``), ``explosion`` = some round's stream RMS exceeds 10
  (``exploding``); secondary, ``growth`` = the last round's stream RMS (from the same
  call) has grown to ``GROWTH`` times its step-0 value; a signal fires *before* collapse
  when ``collapse - fire >= LEAD``.

Claims, with Wilson 95 % intervals over cells (Newcombe's for a difference):

- *FLT avoids collapse* (LT vs FLT at one lr): holds when the interval of
  ``rate(LT) - rate(FLT)`` lies above 0; fails when LT collapsed in at least half its
  seeds and FLT at least as often; else undecided; fewer than ``MIN_SEEDS`` seeds per arm
  is undecided. The claim is judged at each lr of ``COLLAPSE_LRS`` (an intersection-union
  test: holds when it holds at each, fails when it fails at one).
- *a signal warns* (per signal): among collapsed cells the share where it fired before
  collapse, among cells that did not collapse the share where it fired at all (a false
  alarm). Holds when the first share's interval lies above 1/2 and the second's below 1/2;
  fails when the first lies below 1/2 (it does not fire before collapse) or the second
  above 1/2 (it fires regardless); else undecided; fewer than ``MIN_SEEDS`` collapsed
  cells (or non-collapsed ones) is undecided.

Example::

    cells = pd.read_csv("studies/flt/flt_study.csv")
    events(cells)                 # one row per cell: collapse step, fire steps, leads
    avoids_claim(cells), warns(cells, "oscillation")
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from scipy import stats

from studies.deeploop.analysis import _md, unigram_floor

__all__ = [
    "KEY", "SIGNALS", "avoids", "avoids_claim", "events", "figure", "power_avoids", "power_warns",
    "summary_markdown", "warns", "wilson",
]  # fmt: skip

KEY = ["arm", "lr", "R", "seed"]
#: signal name -> the CSV column whose truth is the flag (lp.instability's); ``growth`` is
#: derived: the last round's stream RMS at GROWTH times its value at step 0 or more
SIGNALS = {"oscillation": "n_oscillating", "explosion": "exploding", "growth": "growth"}
PRIMARY = ("oscillation", "explosion")
GROWTH = 10.0
COLLAPSE_FROM = 100  # pilot: every run is on the plateau until ~90, healthy ones leave by 120
COLLAPSE_MARGIN = 0.1  # nats below the unigram floor of the val split
END_WINDOW = 5  # record steps at the end of a run whose mean decides "collapsed"
LEAD = 20  # steps: a signal fires "before" collapse when it leads it by >= two record steps
MIN_SEEDS = 3
LEVEL = 0.95
LT, FLT = "lt", "flt"
COLLAPSE_LRS = (1e-2, 3e-2)  # pre-registered: the lrs at which the pilot's LT collapsed


def wilson(k: int, n: int, level: float = LEVEL) -> tuple[float, float]:
    """Wilson score interval of a proportion k / n (NaN for n = 0)."""
    if n == 0:
        return math.nan, math.nan
    z = stats.norm.ppf(0.5 + level / 2)
    p = k / n
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, mid - half), min(1.0, mid + half)


def newcombe(k1: int, n1: int, k2: int, n2: int, level: float = LEVEL) -> tuple[float, float]:
    """Newcombe's hybrid score interval of p1 - p2 (his method 10)."""
    l1, u1 = wilson(k1, n1, level)
    l2, u2 = wilson(k2, n2, level)
    p1, p2 = k1 / n1, k2 / n2
    d = p1 - p2
    return (d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2),
            d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2))  # fmt: skip


# ------------------------------------------------------------------------------ cells


def events(cells: pd.DataFrame, floor: float | None = None,
           signals: dict | None = None) -> pd.DataFrame:  # fmt: skip
    """One row per cell: ``collapsed``, ``collapse_step``, per signal ``fire_<s>`` (first
    record step with the flag on, NaN if never), ``lead_<s>`` and ``before_<s>``;
    ``final_loss``, ``last_step``, ``cpu_s``. ``signals``: name -> column (default
    ``SIGNALS``; ``growth`` is derived from ``stream_rms_last``)."""
    signals = SIGNALS if signals is None else signals
    need = set(KEY) | {"step", "val_loss", "diverged"}
    need |= {c for c in signals.values() if c != "growth"}
    need |= {"stream_rms_last"} if "growth" in signals.values() else set()
    if missing := need - set(cells.columns):
        raise ValueError(f"flt.events: cells lack columns {sorted(missing)}")
    floor = unigram_floor() if floor is None else floor
    rows = []
    for key, g in cells.groupby(KEY, sort=True):
        g = g.sort_values("step").copy()
        if "growth" in signals.values():
            rms = g["stream_rms_last"].astype(float).to_numpy()
            g["growth"] = np.nan_to_num(rms / rms[0], nan=np.inf) >= GROWTH
        steps, loss = g["step"].to_numpy(), g["val_loss"].astype(float).to_numpy()
        finite = loss[np.isfinite(loss)]
        c = _collapse_step(steps, loss, bool(g["diverged"].astype(bool).any()), floor)
        row = dict(zip(KEY, key, strict=True))
        row.update(collapsed=not math.isnan(c), collapse_step=c, last_step=float(steps[-1]),
                   final_loss=float(finite[-1]) if len(finite) else math.nan,
                   cpu_s=float(g["cpu_s"].iloc[0]) if "cpu_s" in g else math.nan)  # fmt: skip
        for name, col in signals.items():
            on = np.flatnonzero(g[col].fillna(0).astype(float).to_numpy() > 0)
            f = float(steps[on[0]]) if len(on) else math.nan
            row[f"fire_{name}"] = f
            row[f"lead_{name}"] = c - f
            row[f"before_{name}"] = bool(c - f >= LEAD)  # False when either is NaN
        rows.append(row)
    return pd.DataFrame(rows)


def _collapse_step(steps: np.ndarray, loss: np.ndarray, diverged: bool, floor: float) -> float:
    """The collapse step of one cell (see the module doc), NaN when it did not collapse."""
    nonfinite = np.flatnonzero(~np.isfinite(loss))
    if len(nonfinite):
        return float(steps[nonfinite[0]])
    if diverged:
        return float(steps[-1])
    high = loss > floor - COLLAPSE_MARGIN
    if not loss[-END_WINDOW:].mean() > floor - COLLAPSE_MARGIN:
        return math.nan
    low = np.flatnonzero(~high)
    first = int(low[-1]) + 1 if len(low) else 0  # from here on every loss is high
    return float(max(steps[min(first, len(steps) - 1)], COLLAPSE_FROM))


# ------------------------------------------------------------------------------ verdicts


def _study_lr(ev: pd.DataFrame, lr: float | None) -> float:
    if lr is not None:
        return lr
    both = set(ev.loc[ev["arm"] == LT, "lr"]) & set(ev.loc[ev["arm"] == FLT, "lr"])
    if not both:
        raise ValueError("flt: no lr at which both arms ran; pass lr=")
    return max(both)


def avoids(cells: pd.DataFrame, lr: float | None = None, floor: float | None = None,
           signals: dict | None = None) -> dict:  # fmt: skip
    """FLT avoids the LT's collapse at the study lr (default: the largest lr both ran)."""
    ev = events(cells, floor, signals)
    lr = _study_lr(ev, lr)
    ev = ev[np.isclose(ev["lr"], lr)]
    lt, flt = ev[ev["arm"] == LT], ev[ev["arm"] == FLT]
    k1, n1, k2, n2 = int(lt["collapsed"].sum()), len(lt), int(flt["collapsed"].sum()), len(flt)
    out = {"lr": lr, "lt_collapsed": k1, "lt_n": n1, "flt_collapsed": k2, "flt_n": n2}
    if min(n1, n2) < MIN_SEEDS:
        return {**out, "diff": math.nan, "ci_low": math.nan, "ci_high": math.nan,
                "verdict": "undecided",
                "reason": f"{min(n1, n2)} seeds < the pre-stated minimum {MIN_SEEDS}"}  # fmt: skip
    lo, hi = newcombe(k1, n1, k2, n2)
    desc = f"LT {k1}/{n1} collapsed, FLT {k2}/{n2}; difference 95 % [{lo:.2f}, {hi:.2f}]"
    if lo > 0:
        verdict = "holds"
    elif k1 / n1 >= 0.5 and k2 / n2 >= k1 / n1:
        verdict = "fails"
    else:
        verdict = "undecided"
        desc += f"; power at rates 1 vs 0 with these seeds: {power_avoids(n1, n2):.2f}"
    return {**out, "diff": k1 / n1 - k2 / n2, "ci_low": lo, "ci_high": hi,
            "verdict": verdict, "reason": desc}  # fmt: skip


def avoids_claim(cells: pd.DataFrame, lrs=COLLAPSE_LRS, floor: float | None = None) -> dict:
    """The claim at every lr of ``lrs`` (where the pilot's LT collapsed): holds when it holds
    at each, fails when it fails at one, else undecided; with the per-lr results."""
    per = [avoids(cells, lr, floor) for lr in lrs]
    v = {p["verdict"] for p in per}
    verdict = "fails" if "fails" in v else "holds" if v == {"holds"} else "undecided"
    return {"verdict": verdict, "per_lr": per,
            "reason": "; ".join(f"lr {p['lr']:g} {p['verdict']}" for p in per)}  # fmt: skip


def warns(cells: pd.DataFrame, signal: str, floor: float | None = None,
          signals: dict | None = None) -> dict:  # fmt: skip
    """Does ``signal`` fire before collapse (in collapsed cells) and not in healthy ones?"""
    signals = SIGNALS if signals is None else signals
    if signal not in signals:
        raise ValueError(f"flt.warns: signal={signal!r}; choose one of {list(signals)}")
    ev = events(cells, floor, signals)
    col, healthy = ev[ev["collapsed"]], ev[~ev["collapsed"]]
    kb, nc = int(col[f"before_{signal}"].sum()), len(col)
    kf, nh = int(healthy[f"fire_{signal}"].notna().sum()), len(healthy)
    lead = col[f"lead_{signal}"].dropna()
    out = {"signal": signal, "collapsed": nc, "before": kb, "healthy": nh, "false_alarms": kf,
           "median_lead": float(lead.median()) if len(lead) else math.nan}  # fmt: skip
    if min(nc, nh) < MIN_SEEDS:
        return {**out, "before_ci": (math.nan, math.nan), "false_ci": (math.nan, math.nan),
                "verdict": "undecided",
                "reason": f"{nc} collapsed / {nh} healthy cells; the pre-stated minimum is "
                          f"{MIN_SEEDS} of each"}  # fmt: skip
    b, f = wilson(kb, nc), wilson(kf, nh)
    desc = (f"fired >= {LEAD} steps before collapse in {kb}/{nc} [{b[0]:.2f}, {b[1]:.2f}], "
            f"false alarms {kf}/{nh} [{f[0]:.2f}, {f[1]:.2f}]")  # fmt: skip
    if b[0] > 0.5 and f[1] < 0.5:
        verdict = "holds"
    elif b[1] < 0.5:
        verdict, desc = "fails", desc + " (does not fire before collapse)"
    elif f[0] > 0.5:
        verdict, desc = "fails", desc + " (fires in healthy runs too: not specific)"
    else:
        verdict = "undecided"
        desc += f"; power at 0.9 / 0.1 with these cells: {power_warns(nc, nh):.2f}"
    return {**out, "before_ci": b, "false_ci": f, "verdict": verdict, "reason": desc}


# ------------------------------------------------------------------------------ power


def power_avoids(n1: int, n2: int, p1: float = 1.0, p2: float = 0.0) -> float:
    """P(holds) when the true collapse rates are p1 (LT) and p2 (FLT), exact over binomials."""
    tot = 0.0
    for k1 in range(n1 + 1):
        for k2 in range(n2 + 1):
            if newcombe(k1, n1, k2, n2)[0] > 0:
                tot += stats.binom.pmf(k1, n1, p1) * stats.binom.pmf(k2, n2, p2)
    return float(tot)


def power_warns(nc: int, nh: int, p_before: float = 0.9, p_false: float = 0.1) -> float:
    """P(holds) when a signal truly fires before collapse with p_before and falsely with
    p_false, with nc collapsed and nh healthy cells (exact over binomials)."""
    a = sum(stats.binom.pmf(k, nc, p_before) for k in range(nc + 1) if wilson(k, nc)[0] > 0.5)
    b = sum(stats.binom.pmf(k, nh, p_false) for k in range(nh + 1) if wilson(k, nh)[1] < 0.5)
    return float(a * b)


# ------------------------------------------------------------------------------ present


def summary_markdown(cells: pd.DataFrame, floor: float | None = None) -> str:
    """Every pre-registered table and verdict as markdown (what the study script prints)."""
    floor = unigram_floor() if floor is None else floor
    ev = events(cells, floor)
    show = ev[KEY + ["collapsed", "collapse_step", "final_loss"]
              + [f"fire_{s}" for s in SIGNALS] + ["cpu_s"]]  # fmt: skip
    claim = avoids_claim(cells, floor=floor)
    out = [f"unigram floor (val split): {floor:.4f} nats; collapsed = mean held-out loss of "
           f"the last {END_WINDOW} record steps above floor - {COLLAPSE_MARGIN}, or non-finite;"
           f" collapse step >= {COLLAPSE_FROM}",
           "", "### Cells", "", _md(show), "",
           ]  # fmt: skip
    lrs = sorted(set(ev["lr"]) | set(COLLAPSE_LRS))
    for lr in lrs:
        a = avoids(cells, lr, floor)
        tag = "" if any(np.isclose(lr, COLLAPSE_LRS)) else " (control, decides nothing)"
        out.append(f"- FLT avoids collapse at lr {lr:g}{tag}: {a['verdict']} ({a['reason']})")
    out.append(f"- **claim: FLT avoids the LT's collapse: {claim['verdict']}** ({claim['reason']})")
    for s in SIGNALS:
        w = warns(cells, s, floor)
        tag = "" if s in PRIMARY else " (secondary)"
        out.append(f"- **{s}{tag} fires before collapse: {w['verdict']}** ({w['reason']}; median "
                   f"lead {w['median_lead']:g} steps)")  # fmt: skip
    cpu = ev["cpu_s"].sum()
    out += ["", f"CPU time of these cells: {cpu / 60:.1f} CPU-minutes"]
    return "\n".join(out)


def figure(cells: pd.DataFrame, path: str, floor: float | None = None) -> None:
    """Three panels against training step, one line per cell: held-out loss (with the
    collapse step marked), the last round's stream RMS, and the smallest per-sublayer
    mean consecutive-visit gradient cosine (written to ``path``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    floor = unigram_floor() if floor is None else floor
    ev = events(cells, floor).set_index(KEY)
    fig, ax = plt.subplots(1, 3, figsize=(15, 3.8))
    colors = {}
    for key, g in cells.groupby(KEY, sort=True):
        g = g.sort_values("step")
        label = f"{key[0].upper()} lr={key[1]:g}"
        c = colors.setdefault(label, f"C{len(colors)}")
        kw = {"color": c, "lw": 1, "alpha": 0.8, "label": label if label not in
              {ln.get_label() for ln in ax[0].lines} else None}  # fmt: skip
        ax[0].plot(g["step"], g["val_loss"], **kw)
        cs = ev.loc[key, "collapse_step"]
        if math.isfinite(cs):
            ax[0].plot([cs], [floor], "x", color=c, ms=8)
        ax[1].plot(g["step"], g["stream_rms_last"], **{**kw, "label": None})
        ax[2].plot(g["step"], g["min_mean_cos"], **{**kw, "label": None})
    ax[0].axhline(floor, color="k", ls=":", lw=1, label="unigram floor")
    ax[0].set(xlabel="step", ylabel="held-out loss (nats); x = collapse step",
              ylim=(floor - 0.6, floor + 0.6))  # fmt: skip
    ax[0].legend(fontsize=7)
    ax[1].axhline(10, color="k", ls=":", lw=1)
    ax[1].set(xlabel="step", ylabel="stream RMS after the last round", yscale="log")
    ax[2].axhline(0, color="k", ls=":", lw=1)
    ax[2].set(xlabel="step", ylabel="min over sublayers of mean cos(G_r, G_r+1)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
