"""Helpers shared by the subcommands: list parsing, tables, JSON output, thread choice,
and telling an error raised inside the user's model from one raised by loopprobe."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any, TextIO

from loopprobe._io import to_jsonable

if TYPE_CHECKING:
    import torch


# --------------------------------------------------------------------------- option groups
#
# Every option that more than one command takes is declared once here, with its help text;
# a command picks the ones that apply to it (``add_user_model_args(parser, "model", ...)``).

INCREMENT_MODES = ("auto", "output", "delta")

#: the user-model group: flag -> argparse keywords (``help`` always set)
USER_MODEL_OPTIONS: dict[str, dict[str, Any]] = {
    "model": dict(
        metavar="PKG.MOD:FACTORY",
        help="factory returning your nn.Module (package.module:fn or path/to/file.py:fn, "
        "looked up from the current directory)",
    ),
    "inputs": dict(
        metavar="PKG.MOD:FN",
        help="fn(model) or fn() returning what the model is called with (a tensor, a tuple "
        "of positional arguments or a mapping of keyword arguments); default: random "
        "tokens from cfg.vocab_size and cfg.seq_len",
    ),
    "loss": dict(metavar="PKG.MOD:FN", help=None),  # filled from LOSS_RULE below
    "forward": dict(
        metavar="PKG.MOD:FN",
        help="fn(model, inputs) -> output, for models called in another way (e.g. a model "
        "that takes a dict itself: return model(inputs)); default model(*inputs) for a "
        "tuple, model(**inputs) for a mapping, else model(inputs)",
    ),
    "output": dict(
        metavar="PKG.MOD:FN",
        help="fn(output) -> the tensor F (default: the output itself, or its .logits when it "
        "is not a tensor, e.g. a Hugging Face ModelOutput)",
    ),
    "sublayers": dict(
        nargs="+",
        metavar="NAME",
        help="modules to probe (names or globs such as 'blocks.*.attn'; * is one path "
        "segment, ** several); default: model.loopprobe_sublayers, else found from one forward",
    ),
    "exclude": dict(
        nargs="+",
        metavar="PATTERN",
        help="module names or globs removed from the probed sublayers",
    ),
    "increment": dict(
        metavar="MODE|PKG.MOD:FN",
        help="what a visit adds to the residual stream: auto (decided from the forward pass), "
        "output (the module returns the increment), delta (it returns the updated stream: "
        "output - input), or fn(record) -> Tensor (default auto)",
    ),
    "step": dict(
        metavar="PKG.MOD:FN",
        help="the round map, fn(model, inputs) -> lp.RoundMap, called like lp.round_map (e.g. "
        "return lp.replay_round(model, inputs, 'block')); default: model.step(h, x) and "
        "model.embed(inputs), the reference-model interface",
    ),
    "alpha": dict(type=float, metavar="A", help="residual scale alpha (default model.cfg.alpha)"),
    "beta": dict(type=float, metavar="B", help="init gain beta (default model.cfg.beta)"),
}


def add_user_model_args(
    parser: argparse.ArgumentParser,
    *flags: str,
    title: str = "your own model",
    helps: dict[str, str] | None = None,
) -> None:
    """Add the options ``flags`` of :data:`USER_MODEL_OPTIONS` (all when none given) as one
    argument group; ``helps`` overrides a help text where a command means more by it."""
    from loopprobe._io import LOSS_RULE

    group = parser.add_argument_group(title)
    for flag in flags or USER_MODEL_OPTIONS:
        spec = dict(USER_MODEL_OPTIONS[flag])
        spec["help"] = (helps or {}).get(flag) or spec["help"] or LOSS_RULE
        group.add_argument(f"--{flag}", default=None, **spec)


def add_json_arg(parser: argparse.ArgumentParser, what: str = "one JSON object") -> None:
    parser.add_argument("--json", action="store_true", help=f"print {what} instead of text")


def choice_list(allowed: tuple[str, ...], flag: str) -> Callable[[str], list[str]]:
    """argparse ``type=``: comma-separated values, each one of ``allowed``."""

    def parse(text: str) -> list[str]:
        values = [t.strip() for t in text.split(",") if t.strip()]
        if not values or any(v not in allowed for v in values):
            raise argparse.ArgumentTypeError(
                f"{flag} {text!r}: each value must be one of {', '.join(allowed)}"
            )
        return values

    return parse


def increment_spec(text: str | None) -> Any:
    """``--increment``: a mode of :data:`INCREMENT_MODES` or an imported ``fn(record)``."""
    if text is None or text in INCREMENT_MODES:
        return text
    if ":" not in text:
        raise ValueError(
            f"--increment {text!r}: use one of {', '.join(INCREMENT_MODES)} or "
            "package.module:fn returning the increment of a visit record"
        )
    from loopprobe._io import load_object

    return load_object(text, "--increment")


NORMS = ("pre", "post", "deepnorm", "deeploop")
UPDATES = ("sgd", "adam", "adamw")


def add_target_args(
    parser: argparse.ArgumentParser, *, default_norm: str, R: str, exclude: bool = True
) -> None:
    """What ``kappa``, ``ddp-kappa`` and ``bound`` probe: the reference model's size or
    your own model (the user-model group), the estimation settings and ``--json``.

    ``R="one"``: ``--R N`` and ``--update`` (one probe); ``R="list"``: ``--R 1,2,4``
    (``bound``'s sweep, which adds its own step options).
    """
    if R == "one":
        parser.add_argument(
            "--R", type=int, default=None, help="rounds (default 4; with --model, factory(R))"
        )
        parser.add_argument(
            "--update",
            choices=UPDATES,
            default="sgd",
            help="effective update G: the gradient (sgd) or a fresh optimizer's first step",
        )
    else:
        parser.add_argument(
            "--R",
            type=_r_list,
            required=True,
            help="comma-separated rounds, e.g. 1,2,4,8,16 (at least two); with --model, "
            "factory(R) for each",
        )
    ref = parser.add_argument_group("reference model (ignored with --model)")
    ref.add_argument("--K", type=int, default=2, help="physical blocks (default 2)")
    ref.add_argument("--norm", choices=NORMS, default=default_norm,
                     help=f"residual scheme (default {default_norm})")  # fmt: skip
    ref.add_argument("--d-model", dest="d_model", type=int, default=32, help="width (32)")
    ref.add_argument("--heads", type=int, default=4, help="attention heads (4)")
    ref.add_argument("--seq", type=int, default=16, help="sequence length (16)")
    ref.add_argument("--batch", type=int, default=4, help="batch size (4)")
    ref.add_argument("--vocab", type=int, default=64, help="vocabulary size (64)")
    user = ["model", "inputs", "loss", "forward", "output", "sublayers", "exclude", "alpha"]
    add_user_model_args(parser, *[f for f in user if exclude or f != "exclude"], "beta")
    est = parser.add_argument_group("estimation")
    est.add_argument("--seed", type=int, default=0, help="init, tokens, probes and dropout (0)")
    est.add_argument("--dtype", choices=("float32", "float64"), default=None,
                     help="cast the model (default: float64 for the reference model, "
                     "unchanged for --model)")  # fmt: skip
    est.add_argument("--max-iter", dest="max_iter", type=int, default=100,
                     help="iterations per operator norm (100; Lanczos or power "
                     "iteration)")  # fmt: skip
    est.add_argument(
        "--tol",
        type=float,
        default=None,
        help="bound on kappa's error (absolute): every operator norm runs until kappa's "
        "certified interval is this narrow (default 1e-6 where the model computes in "
        "float64, 1e-3 in float32)",
    )
    add_json_arg(parser)


def _r_list(text: str) -> list[int]:
    try:
        return int_list(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def check_positive(args: Any, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(args, name)
        if value < 1:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} must be an integer >= 1, got {value}")


def add_sweep_args(
    parser: argparse.ArgumentParser,
    *,
    N: list[int],
    seeds: int,
    d_model: int,
    seq_len: int,
    batch: int,
    heads: bool,
) -> None:
    """The options of the sweep commands over the reference model: ``--N``, ``--seeds``,
    the model size (:func:`add_size_args`), ``--cache`` and ``--json``;
    :func:`setup_sweep` reads them back."""
    parser.add_argument("--N", type=int_list, default=N,
                        help=f"loop counts, comma-separated ({','.join(map(str, N))})")  # fmt: skip
    parser.add_argument("--seeds", type=int, default=seeds, help=f"seeds 0..S-1 (default {seeds})")
    add_size_args(parser, d_model=d_model, seq_len=seq_len, batch=batch, heads=heads)
    parser.add_argument("--cache", default=None,
                        help="cache directory of the sweep cells (resumes a run)")  # fmt: skip
    add_json_arg(parser)
    parser.set_defaults(cache_of=lambda args: args.cache)


def add_size_args(
    parser: argparse.ArgumentParser, *, d_model: int, seq_len: int, batch: int, heads: bool
) -> None:
    """The reference model's size in the sweep commands: ``--d-model``, ``--n-heads``
    (when ``heads``), ``--seq-len``, ``--batch``; :func:`size_of` reads them back."""
    group = parser.add_argument_group("reference model size")
    group.add_argument("--d-model", dest="d_model", type=int, default=d_model,
                       help=f"width ({d_model})")  # fmt: skip
    if heads:
        group.add_argument("--n-heads", dest="n_heads", type=int, default=4,
                           help="attention heads (4)")  # fmt: skip
    group.add_argument("--seq-len", dest="seq_len", type=int, default=seq_len,
                       help=f"sequence length ({seq_len})")  # fmt: skip
    group.add_argument("--batch", type=int, default=batch, help=f"batch size ({batch})")


def size_of(args: Any) -> dict[str, int]:
    """The keywords of :func:`add_size_args` as the reference drivers take them."""
    names = ("d_model", "n_heads", "seq_len", "batch")
    return {n: getattr(args, n) for n in names if hasattr(args, n)}


def check_writable(path: str, flag: str) -> None:
    """A ValueError naming ``flag`` unless a file can be written at ``path`` (checked before
    any work, so a long computation is not lost at the end)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path}: the directory {folder} does not exist; create it first")
    if (
        os.path.isdir(path)
        or not os.access(folder, os.W_OK)
        or (os.path.exists(path) and not os.access(path, os.W_OK))
    ):
        raise ValueError(f"{flag} {path}: cannot write a file there; give a writable path")


def int_list(text: str) -> list[int]:
    """Parse ``"1,2,4"`` into ``[1, 2, 4]`` (for argparse ``type=``)."""
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError as err:
        raise ValueError(f"expected comma-separated integers like 1,2,4, got {text!r}") from err
    if not values:
        raise ValueError(f"expected comma-separated integers like 1,2,4, got {text!r}")
    return values


class DefaultOutput:
    """Picks F when no ``--output`` is given: the output itself if it is a tensor, else
    its ``.logits`` (Hugging Face ``ModelOutput`` and similar objects) or ``["logits"]``.

    ``picked`` records what was used, so the command can say so.
    """

    def __init__(self) -> None:
        self.picked: str | None = None

    def __call__(self, out: Any) -> torch.Tensor:
        import torch

        if isinstance(out, torch.Tensor):
            self.picked = self.picked or "the model output"
            return out
        logits = getattr(out, "logits", None)
        if isinstance(logits, torch.Tensor):
            self.picked = self.picked or f".logits of the model's {type(out).__name__}"
            return logits
        if isinstance(out, dict) and isinstance(out.get("logits"), torch.Tensor):
            self.picked = self.picked or "the model output's ['logits']"
            return out["logits"]
        keys = list(out.keys()) if isinstance(out, dict) else None
        raise TypeError(
            f"the model returned a {type(out).__name__}"
            + (f" with keys {keys}" if keys is not None else "")
            + ", not a tensor and without a .logits tensor; pass --output package.module:fn "
            "returning the tensor F"
        )


def apply_threads(args: Any, work: float | None) -> int:
    """Set torch's intra-op threads for a command: ``--threads`` or the size rule.

    ``work`` is the model's parameter-tokens (:func:`loopprobe._threads.work`); ``None``
    for commands that do no torch computation. The count is stored in ``args.threads_used``.
    """
    import torch

    from loopprobe._threads import auto_threads

    if args.threads is not None:
        n = args.threads
    elif work is None:
        n = 1
    else:
        n = auto_threads(work, default=args.torch_default_threads)
    torch.set_num_threads(n)
    args.threads_used = n
    return n


#: where :func:`print_json` writes while :func:`json_only_on_stdout` holds stdout for it
_RESULT_STREAMS: list[TextIO] = []


@contextlib.contextmanager
def json_only_on_stdout(enabled: bool = True) -> Iterator[None]:
    """For ``--json``: while the command runs, everything printed to ``sys.stdout`` (the
    user's factory or forward, a library's progress line) goes to stderr, and only
    :func:`print_json` writes to the real stdout, so stdout is exactly one JSON object.

    Python-level: output that C code writes to file descriptor 1 itself is not moved.
    """
    if not enabled:
        yield
        return
    _RESULT_STREAMS.append(sys.stdout)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        _RESULT_STREAMS.pop()


def print_json(obj: Any) -> None:
    """``obj`` as strict JSON (NaN and inf as strings, see :func:`to_jsonable`) on stdout."""
    out = _RESULT_STREAMS[-1] if _RESULT_STREAMS else sys.stdout
    print(json.dumps(to_jsonable(obj), indent=2, allow_nan=False), file=out, flush=True)


def emit(report: dict, as_json: bool, format_text: Callable[[dict], str]) -> int:
    """Print a command's report as one JSON object or as text; exit code 0."""
    if as_json:
        print_json(report)
    else:
        print(format_text(report))
    return 0


def text_table(head: list[str], rows: list[list[str]]) -> list[str]:
    """Aligned plain-text rows: first column (names) left-aligned, the rest right-aligned."""
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    return [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in [head, *rows]
    ]


def setup_sweep(args: Any, blocks: int) -> dict[str, Any]:
    """Shared start of the sweep commands (:func:`add_sweep_args`): check ``--seeds``, choose
    the threads for a reference model of ``blocks`` physical blocks, and return the
    drivers' keywords ``seeds``, ``cache_dir`` and the model size."""
    if args.seeds < 1:
        raise ValueError(f"--seeds {args.seeds}: give at least 1")
    apply_threads(args, reference_work(args.d_model, args.seq_len, args.batch, blocks))
    return {"seeds": list(range(args.seeds)), "cache_dir": args.cache, **size_of(args)}


def reference_work(d_model: int, seq_len: int, batch: int, blocks: int, vocab: int = 256) -> float:
    """Parameter-tokens of a reference LoopedGPT with ``blocks`` physical blocks (12 d^2
    each: attention 4 d^2, MLP 8 d^2) plus embedding and head."""
    return float((12 * d_model**2 * blocks + 2 * vocab * d_model) * seq_len * batch)


# --------------------------------------------------------------------------- whose error


def model_frame(err: BaseException) -> tuple[FrameType, int] | None:
    """The frame and line in the model's own code where ``err`` was raised, or ``None`` when
    it was not raised inside the model.

    Inside the model: below loopprobe's last frame on the traceback (a hook loopprobe put
    on the model raising is loopprobe's error) there is a method of an ``nn.Module``: its
    ``forward``, or any method defined outside torch (``embed``, ``step``). The reported
    frame is the deepest of those outside torch (the user's line), else the deepest. A
    call that fails while binding its arguments (``model(dict)`` for a keyword-only
    forward) never enters the model: that is bad input, not the model's error.
    """
    nn = sys.modules.get("torch.nn")
    if nn is None:  # torch never loaded: no model ran
        return None
    import loopprobe

    root = os.path.dirname(os.path.abspath(loopprobe.__file__)) + os.sep
    torch_root = os.path.dirname(os.path.abspath(sys.modules["torch"].__file__)) + os.sep
    found: list[tuple[FrameType, int, bool]] = []
    tb = err.__traceback__
    while tb is not None:
        frame, file = tb.tb_frame, os.path.abspath(tb.tb_frame.f_code.co_filename)
        ours = file.startswith(root) and not file.startswith(root + "models" + os.sep)
        if ours:
            found = []  # whatever ran the model before loopprobe's last frame is not the raiser
        elif isinstance(frame.f_locals.get("self"), nn.Module):
            in_torch = file.startswith(torch_root)
            if frame.f_code.co_name == "forward" or not in_torch:
                found.append((frame, tb.tb_lineno, in_torch))
        tb = tb.tb_next
    user = [f for f in found if not f[2]] or found
    return (user[-1][0], user[-1][1]) if user else None


def where(frame: FrameType, line: int) -> str:
    """``file.py:17, Model.forward``: a frame as a user finds it in their code."""
    owner = type(frame.f_locals.get("self")).__name__
    return f"{os.path.basename(frame.f_code.co_filename)}:{line}, {owner}.{frame.f_code.co_name}"
