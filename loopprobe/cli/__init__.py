"""The ``loopprobe`` command line.

Each subcommand lives in its own module in this package and exposes
``register(subparsers)``, which adds its parser and sets ``func=run`` where
``run(args) -> int``. Modules are discovered, so adding a command touches one file.
Every command also gets ``--threads`` and ``--debug`` (added here) and runs with the
current directory on ``sys.path`` (as ``python -m`` does), so ``--model mymodel:make``
finds ``./mymodel.py``.

Output: with ``--json`` stdout is exactly one JSON object (strict JSON: NaN and inf are
the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``); whatever else is printed while the
command runs (the user's factory or forward) goes to stderr.

Ctrl-C stops any command with one line on stderr saying what is on disk (e.g. the sweep
cells cached so far, which a rerun resumes from) and exit code 130.

Exit codes: 0 when the command produced its result, also a result whose estimates did not
converge (it says ``converged: NO: <reason>``; JSON ``"converged": false`` and ``reason``).
Bad arguments and errors a user can fix (``ValueError``/``TypeError``, also those raised by
the user's factory, inputs or loss functions) are one line on stderr and exit code 2. An
exception raised inside the model's own code while it runs (its ``forward``, or a method
such as ``embed``) is one line naming it as the model's, with file and line, and exit code
1; so is any other failure. ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import signal
import sys
from typing import Any, NoReturn

import loopprobe
from loopprobe._interrupt import kept
from loopprobe._io import cwd_on_path
from loopprobe.cli._common import json_only_on_stdout, model_frame, where

THREADS_HELP = (
    "torch intra-op threads. Default: 1 for models below {threshold:.0e} parameter-tokens "
    "(parameters x token positions; the reference models of every command are far below); "
    "above, torch's default (one per core) capped at the cores the load average leaves idle. "
    "Several threads on small kernels wait on each other and run many times slower than "
    "one when another process keeps a core busy (benchmarks/bench_threads.py)."
)


class Parser(argparse.ArgumentParser):
    """Argument errors as one line on stderr (no usage block), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """``--threads`` and ``--debug``, on every command."""
    from loopprobe._threads import THRESHOLD

    group = parser.add_argument_group("common options")
    group.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        metavar="N",
        help=THREADS_HELP.format(threshold=THRESHOLD),
    )
    group.add_argument("--debug", action="store_true", help="show the full traceback of an error")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="loopprobe",
        description="Visit-resolved diagnostics for looped (weight-tied) Transformers.",
    )
    parser.add_argument("--version", action="version", version=f"loopprobe {loopprobe.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        module.register(sub)
    for command in sub.choices.values():
        add_common_args(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``loopprobe`` command; Ctrl-C at any point (start-up included) is one line and 130."""
    try:
        return _main(argv)
    except KeyboardInterrupt:  # during start-up; a command's own run is caught in _main
        print("loopprobe: interrupted", file=sys.stderr)
        return 130


def _import_torch() -> Any:
    """``import torch`` with Ctrl-C held until it is done: a KeyboardInterrupt inside numpy's
    C-extension import (which torch's import runs) is swallowed there and leaves numpy half
    loaded, so the run went on to fail later with a RecursionError. The held Ctrl-C is raised
    once the import is complete."""
    held: list[int] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    except ValueError:  # not the main thread: signals cannot be handled here
        import torch

        return torch
    try:
        import torch
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        raise KeyboardInterrupt
    return torch


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # reported by the command's parser, so the hint names its --help
        commands = parser._subparsers._group_actions[0].choices if parser._subparsers else {}
        (commands.get(args.command) or parser).error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    args.threads_used = args.threads or 1
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as typed, for 'recompute' lines
    previous = None
    if getattr(args, "uses_torch", True):  # `theory` is arithmetic: no torch to load
        torch = _import_torch()

        previous = args.torch_default_threads = torch.get_num_threads()
        torch.set_num_threads(args.threads_used)  # commands raise it for large models
    try:
        with cwd_on_path(), json_only_on_stdout(bool(getattr(args, "json", False))), kept():
            return int(args.func(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C: one line, never a traceback (also with --debug)
        print(f"loopprobe {args.command}: {_interrupted(args)}", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `loopprobe theory ... | head`: stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except Exception as err:  # noqa: BLE001 - one line; the traceback with --debug
        if args.debug:
            raise
        return _report_error(args.command, err)
    finally:
        if previous is not None:
            import torch

            torch.set_num_threads(previous)


def _interrupted(args: argparse.Namespace) -> str:
    """What is on disk after Ctrl-C: sweep cells are cached whole (each one written when it
    finishes) or not at all, so a rerun resumes; nothing else is written before the end."""
    cache_of = getattr(args, "cache_of", None)
    cache = cache_of(args) if cache_of is not None else None
    if cache:
        return f"interrupted; finished cells are cached in {cache}; rerun the command to resume"
    if hasattr(args, "cache"):
        return "interrupted; nothing was cached (pass --cache DIR to resume an interrupted sweep)"
    return "interrupted; no result was written"


def _report_error(command: str, err: Exception) -> int:
    """One line on stderr; the exit code: 1 for the model's own error, 2 for bad input."""
    site = model_frame(err)
    if site is not None:
        message = (
            f"the model raised {type(err).__name__} in its own code ({where(*site)}): "
            f"{_one_line(err)} (run again with --debug for the traceback)"
        )
        code = 1
    elif isinstance(err, (ValueError, TypeError)):
        message, code = _one_line(err), 2
    else:
        message = (
            f"{type(err).__name__}: {_one_line(err)} (run again with --debug for the traceback)"
        )
        code = 1
    print(f"loopprobe {command}: error: {message}", file=sys.stderr)
    return code


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


if __name__ == "__main__":
    raise SystemExit(main())
