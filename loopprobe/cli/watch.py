"""``loopprobe watch``: train the reference model per scheme with the monitor on.

Example::

    loopprobe watch                                   # DeepNorm, DeepLoop, pre 1/sqrt(N), pre 1/N
    loopprobe watch --schemes deepnorm,deeploop --steps 600 --out watch

Writes ``OUT/watch.csv`` (the monitor's long frame with a ``scheme`` column) and
``OUT/watch.png`` (kappa_R / R, loss, mean per-visit ||G_r||, rho against step), caches
each scheme's run in ``OUT/cache``, and prints one row per scheme with the answers.
Reference: seed 002 (kappa_R, the tied bound); docs/definitions.md.
"""

from __future__ import annotations

import argparse
import pathlib

from loopprobe.cli._common import add_json_arg, emit, text_table

#: loopprobe.experiments.watch.SCHEMES (a test checks they agree; listed here so that --help
#: does not import torch)
SCHEMES = ("deepnorm", "deeploop", "pre:1/sqrt(N)", "pre:1/N")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "watch",
        help="train LoopedGPT per scheme with the monitor on: kappa_R, ||G_r||, rho, loss",
        description=(
            "Train the reference LoopedGPT (K blocks x R rounds) on byte-level standard-library "
            "text once per scheme (AdamW, fixed lr, clipping 1.0) with lp.Monitor on a held-out "
            "probe batch: per-visit ||G_r|| every --every steps, kappa_R (with per-visit ||U_r||) "
            "and rho of one round every --kappa-every steps. Does alignment persist after "
            "initialization? Does DeepNorm's larger tied bound show as larger updates? Does the "
            "loss differ?"
        ),
    )
    parser.add_argument(
        "--schemes", default=",".join(SCHEMES), help=f"comma-separated, from {','.join(SCHEMES)}"
    )
    parser.add_argument("--K", type=int, default=2, help="physical blocks (default 2)")
    parser.add_argument("--R", type=int, default=8, help="rounds (default 8)")
    parser.add_argument("--d-model", type=int, default=32, help="width (32)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (4)")
    parser.add_argument("--seq", type=int, default=32, help="sequence length (32)")
    parser.add_argument("--batch", type=int, default=16, help="batch size (16)")
    parser.add_argument("--steps", type=int, default=300, help="AdamW steps per scheme (300)")
    parser.add_argument("--lr", type=float, default=3e-3, help="learning rate (3e-3)")
    parser.add_argument("--every", type=int, default=25, help="monitor every N steps")
    parser.add_argument("--kappa-every", type=int, default=150, help="kappa_R and rho every N")
    parser.add_argument("--seed", type=int, default=0, help="init, data and probe seed (0)")
    parser.add_argument("--out", default="loopprobe-watch", help="directory for CSV, PNG, cache")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_json_arg(parser)
    parser.set_defaults(func=run, cache_of=lambda args: f"{args.out}/cache")


def build_report(args: argparse.Namespace) -> dict:
    from loopprobe.cli._common import apply_threads, reference_work
    from loopprobe.experiments.watch import watch_training

    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    bad = [s for s in schemes if s not in SCHEMES]
    if bad or not schemes:
        raise ValueError(f"--schemes: unknown {bad}; choose from {','.join(SCHEMES)}")
    apply_threads(args, reference_work(args.d_model, args.seq, args.batch, args.K))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    frame = watch_training(
        schemes, K=args.K, R=args.R, d_model=args.d_model, n_heads=args.heads,
        seq_len=args.seq, batch=args.batch, steps=args.steps, lr=args.lr, every=args.every,
        kappa_every=args.kappa_every, seed=args.seed, cache_dir=str(out / "cache"),
        progress=not args.no_progress,
    )  # fmt: skip
    frame.to_csv(out / "watch.csv", index=False)
    from loopprobe.plots import training_watch

    training_watch(frame, R=args.R).savefig(out / "watch.png", dpi=110)
    return {
        "model": f"LoopedGPT K={args.K} R={args.R} d_model {args.d_model}, seq {args.seq}, "
        f"batch {args.batch}, {args.steps} AdamW steps at lr {args.lr:g}, seed {args.seed}",
        "out": str(out),
        "schemes": [_summary(frame[frame.scheme == s], args.R) for s in schemes],
    }


def _summary(df, R: int) -> dict:
    """kappa_R / R at the first, middle and last measurement; loss; G growth; rho."""

    def series(q: str):
        return df[df.quantity == q].groupby("step")["value"].mean()

    kappa, rho, g, loss = series("kappa_R"), series("rho"), series("G_norm"), series("loss")
    conv = df[df.quantity == "kappa_R"]["converged"]
    val = df[df.quantity == "val_loss"]["value"]
    return {
        "scheme": str(df.scheme.iloc[0]),
        "kappa_R/R": [float(v) / R for v in kappa.values],
        "kappa_steps": [int(s) for s in kappa.index],
        "kappa_converged": bool(conv.astype(bool).all()) if len(conv) else False,
        "mean ||G_r|| first/last": [float(g.iloc[0]), float(g.iloc[-1])] if len(g) else [],
        "rho": [float(v) for v in rho.values],
        "train loss last": float(loss.iloc[-1]) if len(loss) else float("nan"),
        "val loss": float(val.iloc[0]) if len(val) else float("nan"),
    }


def format_report(report: dict) -> str:
    lines = [f"loopprobe watch: {report['model']}"]
    head = ["scheme", "kappa_R/R (steps)", "converged", "mean ||G_r|| first->last", "rho",
            "train loss", "val loss"]  # fmt: skip
    rows = []
    for s in report["schemes"]:
        steps = ",".join(map(str, s["kappa_steps"]))
        g = s["mean ||G_r|| first/last"]
        rows.append(
            [
                s["scheme"],
                " ".join(f"{v:.2f}" for v in s["kappa_R/R"]) + f" ({steps})",
                "yes" if s["kappa_converged"] else "NO",
                f"{g[0]:.3g} -> {g[1]:.3g}" if g else "-",
                " ".join(f"{v:.2f}" for v in s["rho"]),
                f"{s['train loss last']:.3f}",
                f"{s['val loss']:.3f}",
            ]
        )
    lines += text_table(head, rows)
    lines.append(f"wrote {report['out']}/watch.csv and watch.png")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    return emit(build_report(args), args.json, format_report)
