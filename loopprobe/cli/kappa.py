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

``M``, ``M_g`` and the bound count the visits of the loop body only (the sublayers kappa_R
is over), as ``bound_check`` and ``lp.health`` do: a read-out applied after every round is
not a visit of the recurrence. The JSON carries ``kappa_err`` (the certified bound on
kappa_R's error), ``[kappa_lo, kappa_hi]`` (the interval holding the exact kappa_R) and
``tol`` (the bound asked for; ``--tol``, default from the precision the model computes in).

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

from loopprobe.cli._common import add_target_args, check_positive, emit, text_table

SUBLAYER_KEYS = (
    "sublayer",
    "role",
    "j",
    "R",
    "R_g",
    "kappa",
    "kappa_err",
    "kappa_lo",
    "kappa_hi",
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
    "U_lo",
    "U_hi",
    "U_err",
    "G_norm",
    "converged",
    "iterations",
)


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
            "tokens and cross-entropy. Before a run at --R > 2 the memory it needs is estimated "
            "from one forward at R = 1 and 2; an --R that cannot fit in the free memory is "
            "refused with the estimate (exit 2)."
        ),
    )
    add_target_args(parser, default_norm="deeploop", R="one")
    parser.set_defaults(func=run)


def build_report(args: argparse.Namespace, target: Any = None) -> dict:
    """The kappa report; ``target`` (default: built from ``args``) lets ``ddp-kappa`` pass
    its DDP-wrapped model and this rank's shard of the inputs."""
    check_positive(args, ("K", "d_model", "heads", "seq", "batch", "vocab", "max_iter"))
    if args.R is not None:
        check_positive(args, ("R",))
    from loopprobe._threads import work
    from loopprobe.cli._common import apply_threads
    from loopprobe.cli._target import build_target, call_hint, describe
    from loopprobe.report.sections_alignment import run_alignment

    if target is None and args.R is not None and args.R > 2:
        _guard(args)
    target = target or build_target(args, args.R)
    apply_threads(args, work(target.model, target.inputs))
    with call_hint(target):
        rep, _ = run_alignment(
            target.model, target.inputs, target.loss_fn, forward=target.forward,
            output=target.output, sublayers=target.sublayers, exclude=target.exclude,
            update=args.update, max_iter=args.max_iter, tol=args.tol, seed=args.seed,
        )  # fmt: skip
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
        "kappa_err": rep.kappa_err,
        "kappa_lo": rep.kappa_lo,
        "kappa_hi": rep.kappa_hi,
        "tol": rep.tol,
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


def _guard(args: argparse.Namespace) -> None:
    """Before a κ run at ``--R``: its memory from one forward at R = 1 and 2 (linear in R,
    times the measured peak of a κ run per saved byte); refuse what cannot fit, and say the
    size of a large run on stderr (the Krylov solves grow about like R², with no progress
    line of their own)."""
    import sys

    from loopprobe._memory import (
        KAPPA_PEAK_PER_SAVED,
        available_bytes,
        check_fits,
        rounds_bytes,
        saved_bytes,
    )
    from loopprobe.cli._target import build_target
    from loopprobe.record.types import call_model

    saved = []
    try:
        for r in (1, 2):
            t = build_target(args, r)
            params = [*t.model.parameters(), *t.model.buffers()]
            saved.append(saved_bytes(lambda t=t: call_model(t.model, t.inputs, t.forward),
                                     exclude=params))  # fmt: skip
    except Exception:  # noqa: BLE001 - no estimate (a factory made for larger R): the run says
        return
    device = next(t.model.parameters(), None)
    need = KAPPA_PEAK_PER_SAVED * rounds_bytes(saved[0], saved[1], args.R)
    free = available_bytes(device.device if device is not None else "cpu")
    check_fits(f"kappa --R {args.R}", need, free,
               "lower --R (or --batch, --seq), or run where more memory is free")  # fmt: skip
    if need > 2**30 or args.R >= 64:
        print(f"loopprobe kappa: --R {args.R} needs about {need / 2**30:.2g} GiB (an estimate); "
              "its time grows about like R²", file=sys.stderr)  # fmt: skip


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
    lines.append(
        f"kappa_R error bound {_fmt(report['kappa_err'])} (tol {_fmt(report['tol'])}): the "
        f"exact kappa_R lies in [{_fmt(report['kappa_lo'])}, {_fmt(report['kappa_hi'])}]"
    )
    if report["kappa_note"]:
        lines.append(report["kappa_note"])
    if report["bound"] is not None:
        lines.append(f"M_g kappa_R (beta/alpha)^2 = {_fmt(report['bound'])} (seed 002, Eq. 14)")
    if report["converged"]:
        lines.append("converged: yes (kappa_R's error bound within tol; every kappa_j in [0, R_j])")
    else:
        hint = " (raise --max-iter)" if "not converged" in report["reason"] else ""
        lines.append(f"converged: NO: {report['reason']}{hint}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    return emit(build_report(args), args.json, format_report)
