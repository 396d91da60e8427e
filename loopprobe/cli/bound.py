"""``loopprobe bound``: the tied-depth bound checked across a sweep of R.

Example::

    loopprobe bound --K 2 --R 1,2,4,8,16 --norm deepnorm           # table
    loopprobe bound --K 2 --R 1,2,4,8,16 --norm deeploop --json    # rows, slope, C per R
    loopprobe bound --model mypkg.models:make --R 2,4,8 --alpha 1 --beta 1

For every R: one real optimizer step (SGD by default, on the looped sublayers only) on a
copy of the parameters of a fresh model at initialization, the measured relative output
change ``||Delta F|| / ||F||`` (first-order JVP and true finite change), kappa_R, the
prediction for that optimizer and the implied constant ``C``; then the fitted log-log
slopes in R. SGD: ``M_g kappa_R (beta/alpha)^2``, growing like ``R^(1 + gamma - 4p)`` when
``kappa_R ~ R^gamma`` (seed 002, Eq. 14-16): DeepNorm (p=1/4) slope 1 when aligned,
DeepLoop (p=1/2) slope 0. Adam/AdamW (``--optimizer adamw``): ``J_g kappa_U (beta/alpha)``,
growing like ``R^(gamma - 2p)`` (this project's extension, docs/definitions.md): DeepNorm
slope 1/2 when aligned, DeepLoop 0. ``--model package.module:factory`` is called as ``factory(R)``
for every R; the other model arguments are those of ``loopprobe kappa``.
"""

from __future__ import annotations

import argparse

from loopprobe import theory
from loopprobe.cli._common import (
    UPDATES,
    add_target_args,
    apply_threads,
    check_positive,
    emit,
    text_table,
)
from loopprobe.cli.kappa import _fmt

ROW_KEYS = (
    "R",
    "M",
    "M_g",
    "kappa",
    "alpha",
    "beta",
    "F_norm",
    "dF_first",
    "dF_true",
    "prediction",
    "C",
    "C_first",
    "prediction_M",
    "family",
    "kappa_U",
    "J_g",
    "prediction_sgd",
    "prediction_adam",
    "dF_roundoff",
    "converged",
    "reason",
)


#: the prediction each optimizer family is judged with
FORMS = {
    "sgd": "M_g kappa_R (beta/alpha)^2",
    "adam": "J_g kappa_U (beta/alpha)",
    "other": "no derived form",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bound",
        help="measured ||dF|| after one step vs its optimizer's bound across R, with slopes",
        description=(
            "Sweep R at fixed K: one real optimizer step per R, the measured relative output "
            "change (first-order and true), kappa_R, the prediction for the optimizer (SGD: "
            "M_g kappa_R (beta/alpha)^2, seed 002, Eq. 13-16; Adam/AdamW: J_g kappa_U "
            "(beta/alpha), this project's extension), the constant C = ||dF|| / prediction, "
            "and the fitted log-log slope of ||dF|| in R."
        ),
    )
    add_target_args(parser, default_norm="deepnorm", R="list")
    parser.add_argument("--lr", type=float, default=1e-3, help="step size (1e-3)")
    parser.add_argument(
        "--optimizer",
        choices=UPDATES,
        default="sgd",
        help="a fresh optimizer's first step (sgd); adam/adamw are judged with the Adam form",
    )
    parser.add_argument(
        "--scope",
        choices=("looped", "all"),
        default="looped",
        help="step the looped sublayers only (the bound's subject) or all",
    )
    parser.set_defaults(func=run)


def build_report(args: argparse.Namespace) -> dict:
    from loopprobe._threads import work
    from loopprobe.cli._target import build_target, call_hint

    check_positive(args, ("K", "d_model", "heads", "seq", "batch", "vocab", "max_iter"))
    Rs = list(args.R)
    bad = [R for R in Rs if R < 1]
    if bad:
        raise ValueError(f"--R values must be integers >= 1, got {bad[0]} in {Rs}")
    if len(set(Rs)) < 2:
        raise ValueError(f"--R needs at least two distinct values to fit a slope, got {Rs}")
    if not args.lr > 0:
        raise ValueError(f"--lr must be > 0, got {args.lr}")
    targets = {R: build_target(args, R) for R in Rs}
    for R, t in targets.items():
        if t.alpha is None or t.beta is None:
            raise ValueError(
                f"--model {args.model}: the model built for R={R} has no cfg.alpha/cfg.beta; "
                "pass --alpha and --beta (1 and 1 for a plain pre-norm model)"
            )
    first = targets[Rs[0]]
    apply_threads(args, max(work(t.model, t.inputs) for t in targets.values()))
    with call_hint(first):
        sweep = _sweep(args, Rs, targets)
    return _report(args, Rs, first, sweep)


def _sweep(args: argparse.Namespace, Rs: list[int], targets: dict) -> object:
    import torch

    from loopprobe.estimate.bound import bound_sweep

    first = targets[Rs[0]]
    return bound_sweep(
        lambda R: targets[R].model,
        Rs,
        lambda model: next(t.inputs for t in targets.values() if t.model is model),
        _per_model_loss(targets),
        sublayers=first.sublayers,
        exclude=first.exclude,
        lr=args.lr,
        optimizer=args.optimizer,
        scope=args.scope,
        alpha=None if args.alpha is None else args.alpha,
        beta=None if args.beta is None else args.beta,
        forward=first.forward,
        output=first.output,
        seed=args.seed,
        max_iter=args.max_iter,
        tol=args.tol,
        generator=torch.Generator().manual_seed(args.seed),
    )


def _report(args: argparse.Namespace, Rs: list[int], first: object, sweep: object) -> dict:
    from loopprobe.cli._target import describe

    frame = sweep.to_frame()
    rows = frame[[k for k in ROW_KEYS if k in frame.columns]].to_dict(orient="records")
    rows = [{k: (v.item() if hasattr(v, "item") else v) for k, v in r.items()} for r in rows]
    for r in rows:
        r["ratio"] = r["beta"] / r["alpha"]
    report = {
        "model": describe(args, ",".join(map(str, Rs))),
        "K": args.K if args.model is None else None,
        "norm": args.norm if args.model is None else None,
        "R": Rs,
        "lr": args.lr,
        "optimizer": args.optimizer,
        "family": rows[0]["family"],
        "prediction_form": FORMS[rows[0]["family"]],
        "scope": args.scope,
        "loss_fn": first.describe_loss(),
        "F": first.describe_output(),
        "threads": args.threads_used,
        "slope": sweep.slope,
        "slope_first": sweep.slope_first,
        "slope_prediction": sweep.slope_prediction,
        "C_ratio": sweep.C_ratio,
        "C": [r["C"] for r in rows],
        "converged": sweep.converged,
        "reason": sweep.reason,
        "theory": _theory_slopes(args),
        "rows": rows,
    }
    report["verdicts"] = _verdicts(report)
    return report


def _verdicts(report: dict) -> list[dict]:
    """The slope of ||dF|| in R against the bound's (kappa measured), and C against a band."""
    from loopprobe.report.verdicts import C_BAND, band_verdict, slope_verdict

    opt, form = report["optimizer"], report["prediction_form"]
    claim = f"||dF|| after one {opt} step grows in R as {form} predicts"
    return [
        slope_verdict(
            "bound",
            claim,
            report["slope"],
            report["slope_prediction"],
            points=len(report["rows"]),
            converged=report["converged"],
            reason="not every kappa_R converged",
        ).to_dict(),
        band_verdict("bound", "C is a constant in R", report["C"], C_BAND).to_dict(),
    ]


def _per_model_loss(targets: dict) -> object:
    """bound_sweep passes one loss for every R; each target closes over its own targets."""
    import torch

    by_inputs = {id(t.inputs): t.loss_fn for t in targets.values()}

    def loss_fn(out: object, inputs: object) -> torch.Tensor:
        return by_inputs[id(inputs)](out, inputs)

    return loss_fn


def _theory_slopes(args: argparse.Namespace) -> dict | None:
    """Predicted slopes of the bound in R at fixed K (``1 + gamma - 4p``)."""
    if args.model is not None or args.norm not in ("deepnorm", "deeploop"):
        return None
    p = theory.scales(args.K, args.norm).p
    exponent = theory.bound_exponent if args.optimizer == "sgd" else theory.adam_bound_exponent
    return {"p": p, "aligned": exponent(p, 1.0), "decorrelated": exponent(p, 0.0)}


def format_report(report: dict) -> str:
    lines = [
        f"loopprobe bound: {report['model']}",
        f"one {report['optimizer']} step, lr={_fmt(report['lr'])}, on "
        + ("the looped sublayers" if report["scope"] == "looped" else "every parameter")
        + f"; loss: {report['loss_fn']}",
        f"prediction for {report['optimizer']}: {report['prediction_form']}"
        + ("" if report["family"] == "sgd" else " (this project's Adam form; SGD's in --json)"),
    ]
    if report.get("F"):
        lines.append(f"F: {report['F']}")
    adam = report["family"] == "adam"
    head = ["R", "M_g", "kappa_U" if adam else "kappa_R", "beta/alpha", "dF/F (JVP)"]
    head += ["dF/F (true)", "J_g kU (b/a)" if adam else "M_g k (b/a)^2", "C"]
    rows = [
        [
            str(r["R"]),
            str(r["M_g"]),
            _fmt(r["kappa_U"] if adam else r["kappa"]),
            _fmt(r["ratio"]),
            _fmt(r["dF_first"]),
            _fmt(r["dF_true"]),
            _fmt(r["prediction"]),
            _fmt(r["C"]),
        ]
        for r in report["rows"]
    ]
    lines += text_table(head, rows)
    tail = (
        f"log-log slope in R: ||dF|| {_fmt(report['slope'])} (first-order "
        f"{_fmt(report['slope_first'])}), prediction {_fmt(report['slope_prediction'])}"
    )
    th = report["theory"]
    if th is not None:
        tail += (
            f"; theory (p={_fmt(th['p'])}): {_fmt(th['aligned'])} aligned, "
            f"{_fmt(th['decorrelated'])} decorrelated"
        )
    lines.append(tail)
    lines.append(f"C max/min across R = {_fmt(report['C_ratio'])}")
    if report["converged"]:
        lines.append("converged: yes (every kappa_R certified; every true change above roundoff)")
    else:
        lines.append(f"converged: NO: {report['reason']}")
    from loopprobe.report.verdicts import summary_lines

    lines += ["verdicts:"] + ["  " + ln for ln in summary_lines(report["verdicts"])]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    return emit(build_report(args), args.json, format_report)
