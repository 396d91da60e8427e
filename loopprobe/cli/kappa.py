"""``loopprobe kappa``: the visit-alignment coefficient kappa_R measured on a looped model.

Example::

    loopprobe kappa --K 2 --R 4 --norm deeploop            # reference LoopedGPT, table
    loopprobe kappa --K 2 --R 4 --norm deeploop --json     # one JSON object
    loopprobe kappa --model mypkg.models:make --inputs mypkg.models:batch --R 8

Without ``--model`` the target is the reference :class:`~loopprobe.models.LoopedGPT`
(d_model 32, 4 heads, sequence 16, batch 4, float64 by default) on random tokens
(:func:`loopprobe.tasks.random_tokens`) with the cross-entropy loss. ``--model
package.module:factory`` probes the user's own ``nn.Module``: ``factory()`` (or
``factory(R)`` when ``--R`` is given) builds it; ``--inputs package.module:fn`` returns
what the model is called with (``fn(model)``, or ``fn()`` if it takes no argument);
``--forward package.module:fn`` calls the model as ``fn(model, inputs)`` (a model that
takes a dict itself: ``return model(inputs)``; a mapping is passed as ``model(**inputs)``
without it); ``--output package.module:fn`` picks the
tensor F from the output (default: the output itself, or its ``.logits`` for Hugging
Face ``ModelOutput`` and similar; the report says which); ``--loss package.module:fn`` is
``loss_fn(output, inputs)`` (default: the model's own scalar ``.loss`` when it returns
one, else cross-entropy on random targets for models with ``cfg.vocab_size``, else
``0.5 * mean(F^2)``).

Exit code 0 also when an estimate did not converge: the text ends ``converged: NO:
<reason>`` (``(raise --max-iter)`` added when an iteration limit was hit), the JSON has
``"converged": false`` and the ``reason``; kappa_R is then not a measurement. Every
sublayer record carries its ``role`` (``body``, ``head``, ``norm``, ``embedding``,
``other``; kappa_R is over ``body``).

The helpers here (target construction, shared arguments) also serve ``loopprobe bound``.
Reference: seed 002, Eq. 12 (kappa_j), Eq. 17-18 (M, M_g).
"""

from __future__ import annotations

import argparse
from typing import Any

from loopprobe.cli._common import emit, text_table

NORMS = ("pre", "post", "deepnorm", "deeploop")
DTYPES = ("float32", "float64")
SUBLAYER_KEYS = (
    "sublayer",
    "role",
    "j",
    "R",
    "R_g",
    "kappa",
    "U_tied",
    "G_tied",
    "U_max",
    "G_max",
    "U_sum",
    "G_sum",
    "converged",
    "cos_G_adjacent",
)
VISIT_KEYS = (
    "sublayer",
    "j",
    "r",
    "i",
    "grad_visible",
    "U_norm",
    "G_norm",
    "converged",
    "iterations",
)


# --------------------------------------------------------------------------- arguments


def add_target_args(parser: argparse.ArgumentParser, *, default_norm: str) -> None:
    """Arguments shared by ``kappa`` and ``bound`` (``--R`` is added by each command)."""
    ref = parser.add_argument_group("reference model (ignored with --model)")
    ref.add_argument("--K", type=int, default=2, help="physical blocks (default 2)")
    ref.add_argument(
        "--norm",
        choices=NORMS,
        default=default_norm,
        help=f"residual scheme (default {default_norm})",
    )
    ref.add_argument("--d-model", dest="d_model", type=int, default=32, help="width (32)")
    ref.add_argument("--heads", type=int, default=4, help="attention heads (4)")
    ref.add_argument("--seq", type=int, default=16, help="sequence length (16)")
    ref.add_argument("--batch", type=int, default=4, help="batch size (4)")
    ref.add_argument("--vocab", type=int, default=64, help="vocabulary size (64)")
    user = parser.add_argument_group("your own model")
    user.add_argument(
        "--model", default=None, metavar="PKG.MOD:FACTORY", help="factory returning an nn.Module"
    )
    user.add_argument(
        "--inputs",
        default=None,
        metavar="PKG.MOD:FN",
        help="fn(model) or fn() returning what the model is called with",
    )
    user.add_argument(
        "--loss",
        default=None,
        metavar="PKG.MOD:FN",
        help="loss_fn(output, inputs) -> scalar (default: the model's own .loss if it returns "
        "one, else cross-entropy on random tokens with cfg.vocab_size, else 0.5 mean(F^2))",
    )
    user.add_argument(
        "--forward",
        default=None,
        metavar="PKG.MOD:FN",
        help="fn(model, inputs) -> output, for models called in another way (e.g. a model that "
        "takes a dict itself: return model(inputs)); default model(*inputs) for a tuple, "
        "model(**inputs) for a mapping, else model(inputs)",
    )
    user.add_argument(
        "--output",
        default=None,
        metavar="PKG.MOD:FN",
        help="fn(output) -> the tensor F (default: the output itself, or its .logits when it "
        "is not a tensor, e.g. a Hugging Face ModelOutput)",
    )
    user.add_argument("--alpha", type=float, default=None, help="residual scale (default cfg)")
    user.add_argument("--beta", type=float, default=None, help="init gain (default cfg)")
    est = parser.add_argument_group("estimation")
    est.add_argument("--seed", type=int, default=0, help="init, tokens, probes and dropout (0)")
    est.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="cast the model (default: float64 for the reference model, unchanged for --model)",
    )
    est.add_argument(
        "--max-iter",
        dest="max_iter",
        type=int,
        default=100,
        help="iterations per operator norm (100; Lanczos or power iteration, see --tol)",
    )
    est.add_argument(
        "--tol",
        type=float,
        default=None,
        help="stopping tolerance: Lanczos's relative residual (default 1e-6 in float64) or "
        "power iteration's relative change (1e-10); 1e-5 in float32",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def check_positive(args: argparse.Namespace, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(args, name)
        if value < 1:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} must be an integer >= 1, got {value}")


# --------------------------------------------------------------------------- kappa


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "kappa",
        help="measure kappa_R, M and M_g on the reference LoopedGPT or your own model",
        description=(
            "Per-visit updates G (one backward) and sensitivities U (Lanczos or power iteration on "
            "JVP/VJP, batched over visits) give kappa_j = ||sum U|| ||sum G|| / "
            "(R_j max||U|| max||G||) for every physical sublayer and kappa_R = max_j "
            "(seed 002, Eq. 12); 0 <= kappa_j <= R_j. Default target: LoopedGPT with random "
            "tokens and cross-entropy."
        ),
    )
    parser.add_argument(
        "--R", type=int, default=None, help="rounds (default 4; with --model, passed as factory(R))"
    )
    add_target_args(parser, default_norm="deeploop")
    parser.add_argument(
        "--update",
        choices=("sgd", "adam", "adamw"),
        default="sgd",
        help="effective update G: gradient or a fresh optimizer's first step",
    )
    parser.set_defaults(func=run)


def build_report(args: argparse.Namespace, target: Any = None) -> dict:
    """The kappa report; ``target`` (default: built from ``args``) lets ``ddp-kappa`` pass
    its DDP-wrapped model and this rank's shard of the inputs."""
    check_positive(args, ("K", "d_model", "heads", "seq", "batch", "vocab", "max_iter"))
    if args.R is not None:
        check_positive(args, ("R",))
    import torch

    from loopprobe._threads import work
    from loopprobe.cli._common import apply_threads
    from loopprobe.cli._target import build_target, call_hint, describe
    from loopprobe.estimate.alignment import visit_alignment
    from loopprobe.record.probe import attach

    target = target or build_target(args, args.R)
    apply_threads(args, work(target.model, target.inputs))
    with attach(target.model) as probe, call_hint(target):
        rep = visit_alignment(
            probe,
            target.inputs,
            target.loss_fn,
            forward=target.forward,
            output=target.output,
            update=args.update,
            max_iter=args.max_iter,
            tol=args.tol,
            generator=torch.Generator().manual_seed(args.seed),
            seed=args.seed,
        )
    ratio = None
    if target.alpha is not None and target.beta is not None:
        ratio = target.beta / target.alpha
    subs = rep.sublayers
    report = {
        "model": describe(args, args.R if args.model else (args.R or 4)),
        "K": args.K if args.model is None else None,
        "R": (args.R or 4) if args.model is None else args.R,
        "norm": args.norm if args.model is None else None,
        "kappa": rep.kappa,
        "M": rep.M,
        "M_g": rep.M_g,
        "alpha": target.alpha,
        "beta": target.beta,
        "ratio": ratio,
        "bound": None if ratio is None else rep.M_g * rep.kappa * ratio**2,
        "update": rep.update,
        "loss_fn": target.describe_loss(),
        "F": target.describe_output(),
        "threads": args.threads_used,
        "loss": rep.loss,
        "F_norm": rep.F_norm,
        "converged": rep.converged,
        "reason": rep.reason,
        "kappa_note": rep.kappa_note,
        "sublayers": _records(subs, SUBLAYER_KEYS),
        "visits": _records(rep.visits, VISIT_KEYS),
    }
    return report


def _records(frame: Any, keys: tuple[str, ...]) -> list[dict]:
    cols = [k for k in keys if k in frame.columns]
    rows = frame[cols].to_dict(orient="records")
    return [{k: _plain(v) for k, v in row.items()} for row in rows]


def _plain(v: Any) -> Any:
    if hasattr(v, "item") and callable(v.item):
        return v.item()
    return v


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        return "nan" if x != x else f"{x:.4g}"
    return str(x)


def format_report(report: dict) -> str:
    lines = [f"loopprobe kappa: {report['model']}"]
    lines.append(
        f"M={report['M']} forward visits, M_g={report['M_g']} gradient-visible; "
        f"alpha={_fmt(report['alpha'])} beta={_fmt(report['beta'])} "
        f"beta/alpha={_fmt(report['ratio'])}"
    )
    lines.append(f"G: {report['update']}; loss: {report['loss_fn']} = {_fmt(report['loss'])}")
    if report.get("F"):
        lines.append(f"F: {report['F']}")
    head = [
        "sublayer",
        "R_g",
        "kappa_j",
        "||sum U||",
        "max||U||",
        "||sum G||",
        "max||G||",
        "cos(G_r,G_r+1)",
        "converged",
    ]
    keys = [
        "sublayer",
        "R_g",
        "kappa",
        "U_tied",
        "U_max",
        "G_tied",
        "G_max",
        "cos_G_adjacent",
        "converged",
    ]
    rows = [[_fmt(s.get(k)) for k in keys] for s in report["sublayers"]]
    lines += text_table(head, rows)
    lines.append(
        f"kappa_R = {_fmt(report['kappa'])} (max over body sublayers; 0 <= kappa_j <= R_j: "
        "R_j when visits align, O(1) when they decorrelate)"
    )
    if report["kappa_note"]:
        lines.append(report["kappa_note"])
    if report["bound"] is not None:
        lines.append(f"M_g kappa_R (beta/alpha)^2 = {_fmt(report['bound'])} (seed 002, Eq. 14)")
    if report["converged"]:
        lines.append("converged: yes (every norm estimate converged; every kappa_j in [0, R_j])")
    else:
        hint = " (raise --max-iter)" if "not converged" in report["reason"] else ""
        lines.append(f"converged: NO: {report['reason']}{hint}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    return emit(build_report(args), args.json, format_report)
