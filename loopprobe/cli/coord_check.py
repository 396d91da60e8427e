"""``loopprobe coord-check``: the coordinate check across loop count N (mup-style figures).

Example::

    loopprobe coord-check --out cc/                       # pre-norm rules, N = 1..16
    loopprobe coord-check --schemes deepnorm,deeploop --lr 1e-3 --out cc/ --json

For each scheme, N in the ladder and seed, a fresh reference LoopedGPT (tied, K blocks)
takes ``--steps`` Adam steps on byte-level stdlib text; a fixed probe batch is recorded
before and after each step. Writes ``coord_check.csv`` (one row per N, seed, step,
sublayer, visit, quantity) and, per scheme, ``<scheme>_<quantity>.png`` (one panel per
step, N on a log2 axis, one line per visit group); prints the log-log slope over N of
each group at the last step (0 = flat = stable in N). Reference: docs/definitions.md §5.
"""

from __future__ import annotations

import argparse
import pathlib
import re

from loopprobe.cli._common import add_sweep_args, choice_list, print_json, setup_sweep
from loopprobe.theory import COORD_QUANTITIES, SCHEMES


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "coord-check",
        help="coordinate check across loop count N (activation and update sizes per step)",
        description=(
            "Train fresh reference models for a few steps at every N of a ladder and record, "
            "per visit, the size of each residual increment and of the final state and their "
            "change since step 0; one figure per scheme and quantity, one panel per step."
        ),
    )
    parser.add_argument("--schemes", type=choice_list(SCHEMES, "--schemes"), default=list(SCHEMES),
                        help="comma-separated: " + ", ".join(SCHEMES))  # fmt: skip
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run (4)")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate (1e-3)")
    parser.add_argument("--optimizer", choices=["adam", "adamw", "sgd"], default="adam",
                        help="optimizer of the training steps (adam)")  # fmt: skip
    parser.add_argument("--K", type=int, default=1, help="physical blocks (R = N/K rounds)")
    add_sweep_args(parser, N=[1, 2, 4, 8, 16], seeds=2, d_model=64, seq_len=32, batch=8,
                   heads=False)  # fmt: skip
    parser.add_argument("--h0-rms", dest="h0_rms", default="1",
                        help="RMS of the loop input h_0 at init via a fixed embedding "
                        "multiplier (default 1); 'model' trains the model as built")  # fmt: skip
    parser.add_argument("--quantities", default="state_change,increment_change",
                        help="figures to draw: " + ", ".join(COORD_QUANTITIES))  # fmt: skip
    parser.add_argument("--out", required=True, help="output directory (CSV and figures)")
    parser.set_defaults(func=run)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")


def run(args: argparse.Namespace) -> int:
    sweep = setup_sweep(args, args.K)
    quantities = [q.strip() for q in args.quantities.split(",") if q.strip()]
    bad = [q for q in quantities if q not in COORD_QUANTITIES]
    if bad:
        raise ValueError(f"--quantities: {bad} not in {list(COORD_QUANTITIES)}")
    from loopprobe.experiments.coordcheck_reference import reference_coord_check

    cc = reference_coord_check(
        args.schemes,
        args.N,
        K=args.K,
        steps=args.steps,
        lr=args.lr,
        optimizer=args.optimizer,
        h0_rms=None if args.h0_rms == "model" else float(args.h0_rms),
        **sweep,
    )
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cc.to_frame().to_csv(out / "coord_check.csv", index=False)
    files = [str(out / "coord_check.csv")]
    for scheme in args.schemes:
        for q in quantities:
            path = out / f"{_slug(scheme)}_{q}.png"
            cc.plot(scheme, q).savefig(path, dpi=110)
            files.append(str(path))
    flat = {q: cc.flatness(q) for q in quantities}
    diverged = int(cc.to_frame()["diverged"].sum())
    if args.json:
        print_json(
            {
                **cc.config,
                "schemes": args.schemes,
                "N": args.N,
                "seeds": args.seeds,
                "flatness": {q: f.to_dict("records") for q, f in flat.items()},
                "diverged_rows": diverged,
                "files": files,
            }
        )
        return 0
    print(
        f"coordinate check: {args.optimizer} lr={args.lr:g}, {args.steps} steps, "
        f"N={args.N}, {args.seeds} seed(s), d_model={args.d_model}, h_0 RMS {args.h0_rms}"
    )
    for q, f in flat.items():
        print(f"\nlog-log slope over N of {q} at step {args.steps} (0 = flat in N)")
        print(f"{'scheme':<15} {'group':<12} {'slope':>7} {'at min N':>10} {'at max N':>10}")
        for row in f.to_dict("records"):
            print(
                f"{row['scheme']:<15} {row['group']:<12} {row['slope']:>7.2f} "
                f"{row['value_at_min_N']:>10.3g} {row['value_at_max_N']:>10.3g}"
            )
    if diverged:
        print(f"\ndiverged rows: {diverged}")
    print(f"\nwrote {len(files)} files to {out}")
    return 0
