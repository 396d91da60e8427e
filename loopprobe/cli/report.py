"""``loopprobe report``: every diagnostic on one model, as a browsable report.

Example::

    loopprobe report                                  # embedded default, ./loopprobe-report
    loopprobe report --quick --out /tmp/r             # smaller sizes (tests, a first look)
    loopprobe report --sections alignment             # recompute one section
    loopprobe report --model mypkg.models:make --inputs mypkg.data:batch
    loopprobe report --model mymodel:make --inputs mymodel:batch --forward mymodel:call \
        --alpha 1 --beta 1                        # kwargs/dict inputs; bound check scales

Writes ``index.html`` (tables, PNG figures, the command behind each figure),
``results.json`` and tidy CSVs, and prints a summary table. Exit status: 0, 1 if a
section failed, 2 on bad input (nothing is computed then) or when a section named in
``--sections`` cannot run on the model (the report says why), 130 on Ctrl-C (a folder the
report created is removed while it holds no file).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import pathlib
import sys
from typing import Any

from loopprobe.cli._common import add_user_model_args, apply_threads, increment_spec, reference_work

#: the report's sections, in page order (tests check it against loopprobe.report.SECTIONS;
#: listed here so that --help does not import the report and torch)
SECTION_KEYS = (
    "health",
    "theory",
    "visits",
    "alignment",
    "increments",
    "coordcheck",
    "fixedpoint",
    "redundancy",
    "reproductions",
)


def register(subparsers: argparse._SubParsersAction) -> None:

    parser = subparsers.add_parser(
        "report",
        help="run every diagnostic and write index.html, results.json, figures and CSVs",
        description=(
            "Without --model: the reference LoopedGPT at a size for 2 CPU cores; DeepNorm vs "
            "DeepLoop over R (kappa_R, bound check and slopes), pre-norm 1/sqrt(N) vs 1/N over "
            "an N ladder (increment growth, coordinate check), fixed-point diagnostics on "
            "briefly trained recall variants. With "
            "--model: every diagnostic that applies to that model, and why the others were "
            "skipped."
        ),
    )
    parser.add_argument("--out", default="loopprobe-report", help="output directory")
    add_user_model_args(
        parser,
        helps={
            "alpha": "residual scale of --model for the bound check (default model.cfg.alpha; "
            "without either the check is skipped)",
            "beta": "init gain of --model for the bound check (default model.cfg.beta)",
        },
    )
    parser.add_argument(
        "--optimizer",
        choices=("sgd", "adam", "adamw"),
        default="sgd",
        help="what you train --model with: the health section's bound and scaling lines judge "
        "that optimizer's step (adam/adamw: the Adam form of the bound); the report states it",
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes (about 30 s)")
    parser.add_argument(
        "--sections",
        default=None,
        help=f"comma-separated subset of {','.join(SECTION_KEYS)}",
    )
    parser.add_argument(
        "--studies",
        default=None,
        metavar="DIR",
        help="the studies tree whose verdicts.csv the reproductions section shows (default "
        "./studies when it exists; `python -m studies` writes it in a clone of the repository)",
    )
    parser.add_argument("--no-cache", action="store_true", help="recompute every sweep cell")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(func=run, cache_of=_cache_of)


def _cache_of(args: argparse.Namespace) -> str | None:
    """Where the report caches its sweep cells: OUT/cache (reference runs, unless --no-cache)."""
    return None if args.model is not None or args.no_cache else f"{args.out}/cache"


def run(args: argparse.Namespace) -> int:
    from loopprobe import report
    from loopprobe.cli._target import NEEDS_MODEL

    if args.model is None:
        for flag in (*NEEDS_MODEL, "alpha", "beta"):
            if getattr(args, flag) is not None:
                raise ValueError(f"--{flag} needs --model (the reference model brings its own)")
        if args.optimizer != "sgd":
            raise ValueError("--optimizer needs --model (it sets the health section's bound)")
    for flag in ("alpha", "beta"):
        value = getattr(args, flag)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"--{flag} must be a positive number, got {value}")
    sections = [s.strip() for s in args.sections.split(",")] if args.sections else None
    keys = [s.key for s in report.SECTIONS]
    if sections and any(s not in keys for s in sections):
        bad = [s for s in sections if s not in keys]
        raise ValueError(f"--sections: unknown {bad}; choose from {','.join(keys)}")
    if args.studies is not None:  # before any computation or output
        from loopprobe.report.sections_repro import verdict_table

        verdict_table(args.studies)
    made = _missing_folders(args.out)
    try:  # a Ctrl-C even between the folder's creation and the work leaves no folder
        report.check_out_dir(args.out)  # before any computation
        return _run(args, report, sections)
    except KeyboardInterrupt:  # Ctrl-C: leave no empty folder behind (main prints the line)
        _remove_if_empty(made)
        raise


def _missing_folders(path: str) -> list[str]:
    """``path`` and its ancestors that do not exist yet (deepest first)."""
    missing, p = [], os.path.abspath(path)
    while not os.path.exists(p):
        missing.append(p)
        p = os.path.dirname(p)
    return missing


def _remove_if_empty(made: list[str]) -> None:
    """Remove the folders the report created, deepest first, while no file is in them (the
    write test's probe file, if a Ctrl-C caught it, is not a result)."""
    from loopprobe.report.pipeline import WRITE_TEST

    if made:
        pathlib.Path(made[0], WRITE_TEST).unlink(missing_ok=True)
    for folder in made:
        if any(files for _, _, files in os.walk(folder)):
            return
        for root, _, _ in sorted(os.walk(folder), key=lambda w: -len(w[0])):
            os.rmdir(root)


def _run(args: argparse.Namespace, report: Any, sections: list[str] | None) -> int:
    """The report once the arguments are checked: exit 1 when a section failed, 2 when a
    section named in ``--sections`` could not run (skipped: the model is not one it
    applies to), else 0."""
    from loopprobe._threads import work

    cfg = report.ReportConfig.quick() if args.quick else report.ReportConfig()
    if args.studies is not None:
        cfg = dataclasses.replace(cfg, studies=args.studies)
    if args.optimizer != "sgd":
        cfg = dataclasses.replace(cfg, optimizer=args.optimizer)
    user = None
    if args.model is not None:
        user = report.load_user_model(
            args.model, args.inputs, args.loss, seed=cfg.seed, output_spec=args.output,
            forward_spec=args.forward, step_spec=args.step,
            increment=increment_spec(args.increment), sublayers=args.sublayers,
            exclude=args.exclude, alpha=args.alpha, beta=args.beta,
        )  # fmt: skip
        apply_threads(args, work(user.model, user.inputs))
    else:  # the largest reference model the report builds: the untied growth sweep
        apply_threads(args, reference_work(cfg.d_model, cfg.seq_len, cfg.batch, max(cfg.Ns)))
    results = report.run_report(
        args.out,
        cfg,
        user=user,
        sections=sections,
        cache=not args.no_cache,
        progress=not args.no_progress,
        command=report.main_command(getattr(args, "argv", None)),
    )
    failed = [k for k, s in results["sections"].items() if s["status"] == "failed"]
    if failed:
        return 1
    skipped = [k for k in sections or [] if results["sections"][k]["status"] == "skipped"]
    if skipped:
        why = "; ".join(f"{k}: {results['sections'][k]['reason']}" for k in skipped)
        print(f"loopprobe report: error: --sections {','.join(skipped)} could not run ("
              + " ".join(why.split()) + ")", file=sys.stderr)  # fmt: skip
        return 2
    return 0
