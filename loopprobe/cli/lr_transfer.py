"""``loopprobe lr-transfer``: loss vs learning rate per loop count N, and the argmin's drift.

Example::

    loopprobe lr-transfer --residual 1/sqrt(N),1/N --N 1,2,4,8 \\
        --lr 1e-3,2e-3,4e-3,8e-3,1.6e-2,3.2e-2 --steps 150 --out lr/ --cache .lp-cache

Trains the pre-norm reference LoopedGPT (one block looped N times) on byte-level stdlib
text for ``--steps`` AdamW steps per (rule, N, lr, seed), evaluates the held-out loss,
and prints the best lr per N and its drift across N in grid steps (positive = moves
right). Writes ``lr_transfer.csv`` and ``lr_transfer.png`` with ``--out``. Cells are
cached with ``--cache`` (an interrupted run resumes). Reference: seed 004.
"""

from __future__ import annotations

import argparse
import pathlib

from loopprobe.cli._common import add_sweep_args, choice_list, print_json, setup_sweep
from loopprobe.theory import RESIDUALS


def _floats(text: str) -> list[float]:
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected numbers like 1e-3,2e-3, got {text!r}") from err
    if not values:
        raise argparse.ArgumentTypeError(f"expected numbers like 1e-3,2e-3, got {text!r}")
    return values


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "lr-transfer",
        help="loss vs learning rate per loop count N; best lr per N and its drift",
        description=(
            "Short training runs of the pre-norm reference model over an lr x N grid per "
            "residual rule; reports the argmin lr per N and its drift in grid steps."
        ),
    )
    parser.add_argument("--residual", type=choice_list(RESIDUALS, "--residual"),
                        default=["1/sqrt(N)", "1/N"],
                        help="residual rules: " + ", ".join(RESIDUALS))  # fmt: skip
    parser.add_argument("--lr", type=_floats, default=[1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2],
                        help="learning-rate grid, comma-separated (1e-3 .. 3.2e-2)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=150, help="AdamW steps per run (150)")
    add_sweep_args(parser, N=[1, 2, 4, 8], seeds=1, d_model=64, seq_len=64, batch=16, heads=True)
    parser.add_argument("--eval-batches", dest="eval_batches", type=int, default=8,
                        help="held-out batches of the evaluated loss (8)")  # fmt: skip
    parser.add_argument("--out", default=None, help="directory for lr_transfer.csv and .png")
    parser.add_argument("--progress", action="store_true", help="show a progress bar")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    sweep = setup_sweep(args, 1)
    from loopprobe.experiments.lrtransfer import reference_lr_transfer

    lt = reference_lr_transfer(
        args.residual,
        args.N,
        args.lr,
        steps=args.steps,
        eval_batches=args.eval_batches,
        progress=args.progress,
        **sweep,
    )
    best, drift, df = lt.best(), lt.drift(), lt.to_frame()
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        df.to_csv(out / "lr_transfer.csv", index=False)
        lt.plot().savefig(out / "lr_transfer.png", dpi=110)
    if args.json:
        print_json(
            {
                **lt.config,
                "lrs": lt.lrs,
                "best": best.to_dict("records"),
                "drift": drift.to_dict("records"),
                "rows": df[["residual", "N", "lr", "seed", "loss", "diverged"]].to_dict("records"),
            }
        )
        return 0
    print(
        f"lr transfer: pre-norm LoopedGPT K=1, d_model={args.d_model}, seq_len={args.seq_len}, "
        f"batch={args.batch}, {args.steps} AdamW steps, {args.seeds} seed(s); held-out loss"
    )
    table = df[~df["diverged"]].pivot_table(index=["residual", "N"], columns="lr", values="loss")
    print(table.to_string(float_format=lambda v: f"{v:.3f}"))
    n_div = int(df["diverged"].sum())
    if n_div:
        print(f"diverged cells: {n_div}")
    for row in drift.to_dict("records"):
        lrs = ", ".join(f"{x:g}" for x in row["best_lr"])
        d = row["drift"]
        d = f"{d:+d}" if isinstance(d, int) else str(d)
        print(
            f"{row['residual']}: best lr per N {row['N']} = [{lrs}]; drift {d} "
            f"grid steps, spread {row['spread']}" + (" (at the grid edge)" if row["edge"] else "")
        )
        fit = ", ".join(f"{x:.2f}" for x in row["fit_log2_lr"])
        print(f"  parabola-fitted optimum log2(lr) per N = [{fit}]; drift "
              f"{row['fit_drift_log2']:+.2f} octaves")  # fmt: skip
    return 0
