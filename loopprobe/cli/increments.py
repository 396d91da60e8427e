"""``loopprobe increments``: growth of the residual stream with loop count N, at init.

Example::

    loopprobe increments --tying tied --residual 1/sqrt(N) --N 1,2,4,8,16,32
    loopprobe increments --tying tied,untied --residual 1/sqrt(N),1/N --json
    loopprobe increments --tying tied --residual 1/N --out figs/   # CSV + growth plot

On the pre-norm reference model (tied: one block for N rounds; untied: N blocks once),
per N: ``||h_N - h_0|| / ||h_0||``, the mean off-diagonal cosine of the increments across
visits and ``R = ||sum inc||^2 / sum ||inc||^2``; then the fitted log-log growth exponent
and the regime it names. Reference: docs/definitions.md §3; seed 004.
"""

from __future__ import annotations

import argparse
import math
import pathlib

from loopprobe.cli._common import (
    add_sweep_args,
    add_user_model_args,
    choice_list,
    increment_spec,
    print_json,
    setup_sweep,
)
from loopprobe.theory import RESIDUALS, TYINGS


def register(subparsers: argparse._SubParsersAction) -> None:

    parser = subparsers.add_parser(
        "increments",
        help="growth exponent of ||h_N - h_0||/||h_0|| over N and increment correlation, at init",
        description=(
            "Sweep the loop count N on the pre-norm reference LoopedGPT at init, record every "
            "visit's residual increment, fit the log-log growth exponent of "
            "||h_N - h_0||/||h_0|| and name the regime (docs/definitions.md section 3). Tied: one "
            "physical block applied N times; untied: N distinct blocks applied once."
        ),
    )
    parser.add_argument("--tying", type=choice_list(TYINGS, "--tying"), default=["tied"],
                        help="tied, untied or both (comma-separated)")  # fmt: skip
    parser.add_argument("--residual", type=choice_list(RESIDUALS, "--residual"), default=["1/N"],
                        help="none, 1/sqrt(N), 1/N, loop-mup (comma-separated)")  # fmt: skip
    add_sweep_args(parser, N=[1, 2, 4, 8, 16, 32], seeds=3, d_model=64, seq_len=32, batch=8,
                   heads=True)  # fmt: skip
    parser.add_argument(
        "--h0-rms",
        dest="h0_rms",
        default="1",
        help="RMS of the loop's starting state h_0 (default 1, seed 004's Theta(1) "
        "assumption); 'model' keeps the model's own embedding (std 0.02)",
    )
    parser.add_argument("--out", default=None, help="directory for increments.csv and growth.png")
    add_user_model_args(
        parser, "model", "inputs", "forward", "sublayers", "exclude", "increment",
        title="your own model (one forward pass instead of the reference sweep)",
    )  # fmt: skip
    parser.set_defaults(func=run)


def _h0(text: str) -> float | None:
    if text == "model":
        return None
    try:
        value = float(text)
    except ValueError as err:
        raise ValueError(f"--h0-rms {text!r}: give a positive number or 'model'") from err
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"--h0-rms {text!r}: give a positive number or 'model'")
    return value


def run(args: argparse.Namespace) -> int:
    if args.model is not None:
        return _run_user(args)
    for flag in ("inputs", "forward", "sublayers", "exclude", "increment"):
        if getattr(args, flag) is not None:
            raise ValueError(f"--{flag} only applies together with --model")
    from loopprobe.experiments.growth import reference_growth

    # untied: N blocks of one model, the largest the sweep builds
    blocks = max(args.N) if "untied" in args.tying else 1
    sweep = setup_sweep(args, blocks)
    h0 = _h0(args.h0_rms)
    results = []
    for tying in args.tying:
        for residual in args.residual:
            results.append(
                reference_growth(
                    tying,
                    residual,
                    args.N,
                    h0_rms=h0,
                    **sweep,
                )
            )
    if args.out:
        _save(results, pathlib.Path(args.out))
    reports = [_report(g) for g in results]
    if args.json:
        print_json(reports[0] if len(reports) == 1 else {"results": reports})
    else:
        print("\n\n".join(_table(r) for r in reports))
    return 0


def _report(g) -> dict:
    return {
        **g.summary(),
        "per_N": g.per_N().to_dict("records"),
        "rows": g.to_frame()[
            ["N", "seed", "growth", "mean_offdiag_cos", "mean_ratio", "hN_rms", "diverged"]
        ].to_dict("records"),
    }


def _table(r: dict) -> str:
    h0 = "model embedding" if r["h0_rms"] is None else f"{r['h0_rms']:g}"
    lines = [
        f"{r['tying']} pre-norm, residual {r['residual']}, d_model={r['d_model']}, "
        f"seq_len={r['seq_len']}, batch={r['batch']}, h_0 RMS {h0}",
        f"{'N':>4} {'||h_N-h_0||/||h_0||':>20} {'sd':>8} {'mean cos':>9} {'R ratio':>8} "
        f"{'RMS(h_N)':>9}",
    ]
    for row in r["per_N"]:
        sd = row["growth_std"]
        lines.append(
            f"{row['N']:>4} {row['growth']:>20.4g} {sd if sd == sd else 0:>8.2g} "
            f"{row['mean_offdiag_cos']:>9.3f} {row['mean_ratio']:>8.2f} {row['hN_rms']:>9.3g}"
        )
    seeds = ", ".join(f"{v:.3f}" for v in r["growth_slope_per_seed"].values())
    lines.append(f"growth slope {r['growth_slope']:.3f} (per seed: {seeds})")
    lines.append(f"mean off-diagonal cosine at largest N: {r['mean_offdiag_cos']:.3f}")
    lines.append(f"regime: {r['regime']}")
    if r["diverged_rows"]:
        lines.append(f"diverged cells: {r['diverged_rows']}")
    lines.append("converged: yes" if r["converged"] else f"converged: NO ({r['reason']})")
    return "\n".join(lines)


def _save(results: list, out: pathlib.Path) -> None:
    import pandas as pd

    out.mkdir(parents=True, exist_ok=True)
    df = pd.concat([g.to_frame() for g in results], ignore_index=True)
    df.to_csv(out / "increments.csv", index=False)
    from loopprobe import plots

    fig = plots.increment_growth(df, hue="residual", style="tying")
    fig.savefig(out / "growth.png", dpi=120)


def _run_user(args: argparse.Namespace) -> int:
    """``lp.increments`` on the user's model: one forward pass, increments per visit."""
    from loopprobe import attach
    from loopprobe._io import load_model, load_object, user_inputs
    from loopprobe.estimate.increments import increments

    model = load_model(args.model)
    if args.inputs is None:
        raise ValueError("--model needs --inputs package.module:fn returning the model's inputs")
    inputs = user_inputs(args.inputs, model)
    forward = load_object(args.forward, "--forward") if args.forward else None
    how = dict(forward=forward, increment=increment_spec(args.increment) or "auto")
    with attach(model, args.sublayers, exclude=args.exclude) as probe:
        inc = increments(probe, inputs, **how)
    summary = {k: v for k, v in inc.summary().items() if isinstance(v, (int, float, str, bool))}
    report = {
        "model": args.model,
        **summary,
        "measured": dict(inc.measured),
        "evidence": dict(inc.evidence),
        "groups": inc.group_frame().to_dict("records"),
    }
    if args.json:
        print_json(report)
        return 0
    print(f"loopprobe increments: {args.model}, one forward pass")
    for key, value in summary.items():
        print(f"{key:>24}  {value:.4g}" if isinstance(value, float) else f"{key:>24}  {value}")
    for name, mode in inc.measured.items():
        print(f"{name}: increment measured as {mode} ({inc.evidence[name]})")
    return 0
