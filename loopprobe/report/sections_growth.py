"""Sections ``increments`` and ``coordcheck``: how the forward pass and its updates grow in N."""

from __future__ import annotations

import math

import pandas as pd

from loopprobe.estimate.increments import increments
from loopprobe.experiments.coordcheck_reference import reference_coord_check
from loopprobe.experiments.growth import reference_growth, start_at_rms
from loopprobe.record.probe import Probe
from loopprobe.report.common import _batch, _gpt, refusal_is_skip
from loopprobe.report.config import Context, Fig, Result, Skip
from loopprobe.report.verdicts import coordcheck_verdicts, growth_verdicts

_GROWTH_PREDICTION = {
    ("tied", "1/sqrt(N)"): 0.5,
    ("tied", "1/N"): 0.0,
    ("untied", "1/sqrt(N)"): 0.0,
    ("untied", "1/N"): -0.5,
}


def increments_section(ctx: Context) -> Result:
    """Growth of ‖h_N − h_0‖/‖h_0‖ over N per residual rule and tying; increment cosines."""
    if ctx.user is not None:
        return _increments_user(ctx)
    cfg = ctx.cfg
    frames, rows = [], []
    size = dict(
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        seq_len=cfg.seq_len,
        batch=cfg.batch,
        vocab_size=cfg.vocab_size,
    )
    for tying in cfg.tyings:
        for rule in cfg.rules:
            g = reference_growth(
                tying,
                rule,
                Ns=list(cfg.Ns),
                seeds=list(cfg.seeds),
                cache_dir=ctx.cache_dir,
                progress=ctx.progress,
                **size,
            )
            frames.append(g.rows)
            rows.append(
                {
                    "tying": tying,
                    "residual": rule,
                    "growth slope": g.slope,
                    "predicted": _GROWTH_PREDICTION.get((tying, rule), math.nan),
                    "mean off-diag cos": g.mean_offdiag_cos,
                    "regime": g.regime,
                }
            )
    growth = pd.concat(frames, ignore_index=True)
    summary = pd.DataFrame(rows)
    Nshow = min(8, max(cfg.Ns))
    model = _gpt(cfg, K=1, R=Nshow, norm="pre", residual=cfg.rules[0])
    one = increments(model, _batch(cfg)[0], forward=start_at_rms(1.0))
    cos = one.cosine_frame()
    keep = [
        "tying",
        "residual",
        "N",
        "seed",
        "growth",
        "mean_offdiag_cos",
        "mean_ratio",
        "hN_rms",
        "regime",
        "diverged",
        "error",
    ]
    growth = growth[[c for c in keep if c in growth.columns]]
    return Result(
        frames={"growth": growth, "cosines": cos, "regimes": summary},
        tables=[("Growth exponent of ‖h_N − h_0‖/‖h_0‖ in N, pre-norm, at init", summary)],
        summary=summary,
        values={
            "regimes": summary.to_dict("records"),
            "verdicts": [v.to_dict() for v in growth_verdicts(summary, len(cfg.Ns))],
        },
        figures=[
            Fig(
                "increments_growth",
                "‖h_N − h_0‖/‖h_0‖ vs N per residual rule (colour) and "
                "tying (line style); dashed: slopes ½ and 0.",
                "growth",
                "increment_growth",
            ),
            Fig(
                "increments_cosines",
                f"Increment cosines across the N = {Nshow} visits of the "
                f"shared block under {cfg.rules[0]}.",
                "cosines",
                "visit_cosines",
                {"title": "Increment cosines cos(inc_r, inc_s)"},
            ),
        ],
    )


def _increments_user(ctx: Context) -> Result:
    u = ctx.user
    # --increment / --sublayers / --exclude; a refusal is the Skip reason, and its message
    # names the choices that fit this model (its own sublayer names)
    increment = "auto" if u.increment is None else u.increment
    with refusal_is_skip():
        probe = Probe(u.model, u.sublayers, u.exclude)
        one = increments(probe, u.inputs, forward=u.forward, increment=increment)
    groups = one.group_frame()
    notes = [f"{s}: increment measured as {m} ({one.evidence[s]})" for s, m in one.measured.items()]
    notes += [f"{s}: {e}" for s, e in one.evidence.items() if s not in one.measured]
    return Result(
        frames={"groups": groups, "cosines": one.cosine_frame(), "visits": one.to_frame()},
        tables=[("Increment correlation per group of visits", groups)],
        summary=pd.DataFrame(
            [{k: v for k, v in one.summary().items() if isinstance(v, (int, float, str))}]
        ),
        values=one.summary(),
        notes=notes,
        figures=[
            Fig(
                "increments_cosines",
                "Increment cosines across visits.",
                "cosines",
                "visit_cosines",
                {"title": "Increment cosines cos(inc_r, inc_s)"},
            )
        ],
    )


def coordcheck_section(ctx: Context) -> Result:
    """mup-style coordinate check across N: ‖Δh_N‖ since step 0 per residual rule."""
    if ctx.user is not None:
        raise Skip(
            "needs a family of models over N (make_model(N, seed)); call "
            "lp.experiments.coord_check(make_model, batch_fn, probe_inputs) from Python"
        )
    cfg = ctx.cfg
    cc = reference_coord_check(
        list(cfg.cc_schemes),
        Ns=list(cfg.cc_Ns),
        seeds=list(cfg.seeds[:2]),
        steps=cfg.cc_steps,
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        seq_len=cfg.seq_len,
        batch=cfg.batch,
        cache_dir=ctx.cache_dir,
        progress=ctx.progress,
    )
    state = cc.plot_frame("state_change")
    incs = cc.plot_frame("increment_change", cfg.cc_schemes[-1])
    flat = cc.flatness("state_change")
    keep = ["scheme", "N", "seed", "step", "group", "value", "diverged"]
    return Result(
        frames={"state": state[keep], "increments": incs[keep], "flatness": flat},
        tables=[
            (
                f"Log-log slope in N of ‖Δh_N‖ (RMS change since step 0) after "
                f"{cfg.cc_steps} Adam steps; 0 = stable in N",
                flat,
            )
        ],
        summary=flat,
        values={
            "flatness": flat.to_dict("records"),
            "config": cc.config,
            "verdicts": [v.to_dict() for v in coordcheck_verdicts(flat, len(cfg.cc_Ns))],
        },
        figures=[
            Fig(
                "coordcheck_state",
                "RMS change of the final state h_N since step 0 vs N, "
                "per residual rule, one panel per Adam step: flat means N-stable.",
                "state",
                "coord_check",
                {
                    "hue": "scheme",
                    "ylabel": "RMS(h_N(t) − h_N(0))",
                    "title": "Coordinate check across N: final state",
                },
            ),
            Fig(
                "coordcheck_increments",
                "RMS change of the first and last visit's increment "
                f"since step 0 vs N under {cfg.cc_schemes[-1]}.",
                "increments",
                "coord_check",
                {
                    "ylabel": "RMS(inc(t) − inc(0))",
                    "title": f"Coordinate check: increments ({cfg.cc_schemes[-1]})",
                },
            ),
        ],
    )
