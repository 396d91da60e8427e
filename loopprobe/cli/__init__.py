"""The ``loopprobe`` command line.

Each subcommand lives in its own module in this package and exposes
``register(subparsers)``, which adds its parser and sets ``func=run`` where
``run(args) -> int``. Modules are discovered, so adding a command touches one file.
Errors a user can fix (``ValueError``/``TypeError``) become one line on stderr and
exit code 2, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import loopprobe


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loopprobe",
        description="Visit-resolved diagnostics for looped (weight-tied) Transformers.",
    )
    parser.add_argument("--version", action="version", version=f"loopprobe {loopprobe.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError) as err:
        print(f"loopprobe {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
