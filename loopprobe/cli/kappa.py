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
``--forward package.module:fn`` calls the model as ``fn(model, inputs)`` (keyword
arguments, dicts: ``return model(**inputs)``); ``--output package.module:fn`` picks the
tensor F from the output (default: the output itself, or its ``.logits`` for Hugging
Face ``ModelOutput`` and similar; the report says which); ``--loss package.module:fn`` is
``loss_fn(output, inputs)`` (default: the model's own scalar ``.loss`` when it returns
one, else cross-entropy on random targets for models with ``cfg.vocab_size``, else
``0.5 * mean(F^2)``).

The helpers here (target construction, shared arguments) also serve ``loopprobe bound``.
Reference: seed 002, Eq. 12 (kappa_j), Eq. 17-18 (M, M_g).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loopprobe import tasks
from loopprobe.cli._common import (
    DefaultOutput,
    apply_threads,
    call_user,
    emit,
    load_object,
    model_loss,
    text_table,
)
from loopprobe.models import GPTConfig, LoopedGPT
from loopprobe.probe import attach
from loopprobe.threads import work

NORMS = ("pre", "post", "deepnorm", "deeploop")
DTYPES = {"float32": torch.float32, "float64": torch.float64}
SUBLAYER_KEYS = (
    "sublayer",
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


@dataclass
class Target:
    """What one probe needs: the model, its inputs, the loss, F, and the scales."""

    model: nn.Module
    inputs: Any
    loss_fn: Callable[[Any, Any], torch.Tensor]
    output: Callable[[Any], torch.Tensor] | None
    loss_name: str
    alpha: float | None
    beta: float | None
    forward: Callable[[nn.Module, Any], Any] | None = None

    def describe_output(self) -> str | None:
        """What F was (known after a probe when the default picker chose it)."""
        if isinstance(self.output, DefaultOutput):
            if self.output.picked is None:
                return None
            return f"{self.output.picked} (default; pass --output to pick another tensor)"
        return None

    def describe_loss(self) -> str:
        return getattr(self.loss_fn, "used", None) or self.loss_name


class DefaultLoss:
    """The loss when no ``--loss`` is given: the model's own scalar ``.loss`` if its output
    carries one (Hugging Face style), else ``fallback``. ``used`` names what was used."""

    def __init__(self, fallback: Callable[[Any, Any], torch.Tensor], name: str) -> None:
        self.fallback, self.name, self.used = fallback, name, None

    def __call__(self, out: Any, inputs: Any) -> torch.Tensor:
        loss = model_loss(out)
        if loss is not None:
            self.used = self.used or "the model's own .loss"
            return loss
        self.used = self.used or self.name
        return self.fallback(out, inputs)


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
        help="fn(model, inputs) -> output, for models called with keyword arguments or dicts "
        "(e.g. return model(**inputs)); default model(*inputs) for a tuple, else model(inputs)",
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
        help="power iterations per operator norm (100)",
    )
    est.add_argument(
        "--tol",
        type=float,
        default=None,
        help="relative-change tolerance (default: 1e-10 in float64, 1e-5 otherwise)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def check_positive(args: argparse.Namespace, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(args, name)
        if value < 1:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} must be an integer >= 1, got {value}")


# --------------------------------------------------------------------------- targets


def reference_model(args: argparse.Namespace, R: int) -> nn.Module:
    cfg = GPTConfig(
        vocab_size=args.vocab,
        seq_len=args.seq,
        d_model=args.d_model,
        n_heads=args.heads,
        K=args.K,
        R=R,
        norm=args.norm,
    )
    model = LoopedGPT(cfg, generator=torch.Generator().manual_seed(args.seed))
    return model.to(DTYPES[args.dtype or "float64"])


def user_model(args: argparse.Namespace, R: int | None) -> nn.Module:
    factory = load_object(args.model, "--model")
    call = f"{args.model.partition(':')[2]}({'' if R is None else R})"
    try:
        model = factory() if R is None else factory(R)
    except Exception as err:  # noqa: BLE001 - the user's code: report it in one line
        raise ValueError(
            f"--model {args.model}: {call} raised {type(err).__name__}: {err}"
        ) from err
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"--model {args.model}: {call} returned a {type(model).__name__}, not an nn.Module"
        )
    if args.dtype is not None:
        model = model.to(DTYPES[args.dtype])
    return model


def build_target(args: argparse.Namespace, R: int | None) -> Target:
    """The model (reference or ``--model``), its inputs, loss, F picker and scales."""
    if args.model is None:
        for flag in ("inputs", "loss", "output", "forward"):
            if getattr(args, flag) is not None:
                raise ValueError(f"--{flag} only applies together with --model")
        model = reference_model(args, 4 if R is None else R)
        output = None
    else:
        model = user_model(args, R)
        output = load_object(args.output, "--output") if args.output else DefaultOutput()
    forward = load_object(args.forward, "--forward") if args.forward else None
    cfg = getattr(model, "cfg", None)
    inputs, loss_fn, loss_name = _inputs_and_loss(args, model, cfg, output)
    alpha = args.alpha if args.alpha is not None else getattr(cfg, "alpha", None)
    beta = args.beta if args.beta is not None else getattr(cfg, "beta", None)
    return Target(model, inputs, loss_fn, output, loss_name, alpha, beta, forward)


def _inputs_and_loss(args: argparse.Namespace, model: nn.Module, cfg: Any, output: Any) -> tuple:
    """Inputs from ``--inputs`` or random tokens; loss from ``--loss`` or a default."""
    pick = output if output is not None else (lambda out: out)
    targets = None
    if args.inputs is not None:
        fn = load_object(args.inputs, "--inputs")
        inputs = call_user(fn, "--inputs", args.inputs, *([model] if _takes_argument(fn) else []))
        if isinstance(inputs, list):
            inputs = tuple(inputs)
    elif hasattr(cfg, "vocab_size") and hasattr(cfg, "seq_len"):
        seq = args.seq if args.model is None else cfg.seq_len
        g = torch.Generator().manual_seed(args.seed)
        inputs, targets = tasks.random_tokens(args.batch, seq, cfg.vocab_size, g)
        inputs, targets = inputs.to(_device(model)), targets.to(_device(model))
    else:
        raise ValueError(
            f"--model {args.model}: {type(model).__name__} has no cfg.vocab_size/cfg.seq_len to "
            "draw random tokens from; pass --inputs package.module:fn returning its inputs"
        )
    if args.loss is not None:
        return inputs, load_object(args.loss, "--loss"), args.loss
    fallback, name = _fallback_loss(pick, targets)
    if args.model is None:
        return inputs, fallback, name
    return inputs, DefaultLoss(fallback, name), name


def _fallback_loss(pick: Callable[[Any], torch.Tensor], targets: Any) -> tuple:
    if targets is not None:

        def cross_entropy(out: Any, _inputs: Any) -> torch.Tensor:
            logits = pick(out)
            return nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
            )

        return cross_entropy, "cross-entropy on random tokens"

    def half_mean_square(out: Any, _inputs: Any) -> torch.Tensor:
        return 0.5 * pick(out).pow(2).mean()

    return half_mean_square, "0.5 * mean(F^2) (pass --loss to use yours)"


@contextlib.contextmanager
def call_hint(target: Target) -> Iterator[None]:
    """A model fed a dict without ``--forward`` that fails: say how to call it instead."""
    try:
        yield
    except Exception as err:
        if target.forward is None and isinstance(target.inputs, dict):
            raise ValueError(
                f"calling the model with the dict from --inputs as model(inputs) raised "
                f"{type(err).__name__}: {err}; pass --forward package.module:fn with "
                "def fn(model, inputs): return model(**inputs)"
            ) from err
        raise


def _takes_argument(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return any(p.kind in kinds or p.kind == inspect.Parameter.VAR_POSITIONAL for p in params)


def _device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def describe(args: argparse.Namespace, R: Any) -> str:
    if args.model is not None:
        return f"{args.model}" + ("" if R is None else f" (R={R})")
    return (
        f"LoopedGPT K={args.K} R={R} norm={args.norm} (d_model {args.d_model}, {args.heads} "
        f"heads, seq {args.seq}, batch {args.batch}, {args.dtype or 'float64'}, seed {args.seed})"
    )


# --------------------------------------------------------------------------- kappa


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "kappa",
        help="measure kappa_R, M and M_g on the reference LoopedGPT or your own model",
        description=(
            "Per-visit updates G (one backward) and sensitivities U (power iteration on "
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


def build_report(args: argparse.Namespace) -> dict:
    check_positive(args, ("K", "d_model", "heads", "seq", "batch", "vocab", "max_iter"))
    if args.R is not None:
        check_positive(args, ("R",))
    target = build_target(args, args.R)
    apply_threads(args, work(target.model, target.inputs))
    with attach(target.model) as probe, call_hint(target):
        rep = probe.alignment(
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
        lines.append(f"converged: NO: {report['reason']} (raise --max-iter)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    return emit(build_report(args), args.json, format_report)
