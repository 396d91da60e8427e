"""Run the sections, then write CSVs, PNGs, ``results.json`` and ``index.html``."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import shlex
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

import loopprobe
from loopprobe._interrupt import check
from loopprobe._io import to_jsonable
from loopprobe.report.config import Context, Fig, ReportConfig, Result, Section, Skip, UserModel
from loopprobe.report.render import format_summary, render_html
from loopprobe.report.sections import SECTIONS

if TYPE_CHECKING:  # plotting is imported when a figure is drawn
    from matplotlib.figure import Figure


WRITE_TEST = ".loopprobe-write-test"  # written and removed to prove --out writable


def check_out_dir(out: str | os.PathLike) -> pathlib.Path:
    """Create ``out`` and prove it writable, or raise ValueError naming it (before any work)."""
    path = pathlib.Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / WRITE_TEST
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise ValueError(
            f"--out {str(out)!r} is not a writable directory ({err.strerror or err}); "
            "pass --out with a directory you can write"
        ) from err
    return path


def run_report(
    out: str | os.PathLike,
    cfg: ReportConfig | None = None,
    *,
    user: UserModel | None = None,
    sections: Sequence[str] | None = None,
    cache: bool = True,
    progress: bool = True,
    command: str | None = None,
    echo: Callable[[str], None] = print,
) -> dict:
    """Run the sections, write ``out/index.html``, ``results.json``, PNGs and CSVs.

    Returns the ``results.json`` object. ``sections`` picks keys of :data:`SECTIONS`
    (default all); ``cache`` keeps finished sweep cells in ``out/cache`` (reference runs
    only) so a rerun re-plots without recomputing; ``echo`` prints the terminal summary.
    """
    cfg = cfg or ReportConfig()
    keys = [s.key for s in SECTIONS]
    chosen = list(sections) if sections else keys
    unknown = [k for k in chosen if k not in keys]
    if unknown:
        raise ValueError(f"report: unknown section(s) {unknown}; choose from {keys}")
    outdir = check_out_dir(out)
    command = command or "loopprobe report"
    cache_dir = outdir / "cache" if cache and user is None else None
    ctx = Context(cfg, user, cache_dir, progress, rerun=_strip_sections(command))
    started = time.perf_counter()
    done: list[tuple[Section, str, Result | str, float]] = []
    todo = [s for s in SECTIONS if s.key in chosen]
    bar = tqdm(todo, desc="report", unit="section", disable=not progress)
    for section in bar:
        check()  # a Ctrl-C a finaliser swallowed in the last section (the CLI keeps it)
        bar.set_postfix_str(section.key)
        t0 = time.perf_counter()
        try:
            res: Result | str = section.run(ctx)
            status = "ok"
        except Skip as why:  # the section does not apply to this model: not an error
            res, status = str(why), "skipped"
        except Exception as err:  # noqa: BLE001 - one failing section must not lose the rest
            res, status = f"{type(err).__name__}: {err}", "failed"
        done.append((section, status, res, time.perf_counter() - t0))
    bar.close()
    check()
    results = _write(outdir, ctx, done, command, time.perf_counter() - started)
    echo(format_summary(done, results))
    return results


def _strip_sections(command: str) -> str:
    words = shlex.split(command)
    out, skip = [], False
    for w in words:
        if skip:
            skip = False
            continue
        if w == "--sections":
            skip = True
            continue
        if w.startswith("--sections="):
            continue
        out.append(w)
    return shlex.join(out)


def _write(outdir: pathlib.Path, ctx: Context, done: list, command: str, runtime: float) -> dict:
    """CSVs and PNGs per section, then results.json and index.html (rendered from those).

    A run of some sections (``--sections``) into a directory holding a report of the same
    model and config keeps the other sections' entries, so the page stays whole.
    """
    model = ctx.user.spec if ctx.user else "reference LoopedGPT (embedded default)"
    config = (
        dataclasses.asdict(ctx.cfg)
        if ctx.user is None
        else {"model": ctx.user.spec, "inputs": ctx.user.inputs_spec, "loss": _loss_used(ctx)}
    )
    config = to_jsonable(config)
    sections = {}
    if len(done) < len(SECTIONS):
        sections = _previous_sections(outdir, model, config)
    for section, status, res, secs in done:
        sections[section.key] = _write_section(outdir, ctx, section, status, res, secs)
    results = {
        "loopprobe_version": loopprobe.__version__,
        "command": ctx.rerun,
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "runtime_s": round(runtime, 2),
        "model": model,
        "user_model": ctx.user is not None,
        "out": str(outdir),
        "config": config,
        "sections": {s.key: sections[s.key] for s in SECTIONS if s.key in sections},
    }
    values = [entry.get("values", {}) for entry in results["sections"].values()]
    results["verdicts"] = [v for vals in values for v in vals.get("verdicts", [])]
    for status in ("failed", "skipped"):
        results[status] = [k for k, v in results["sections"].items() if v["status"] == status]
    figures = [f for s in results["sections"].values() for f in s.get("figures", [])]
    not_drawn = [f["not_drawn"] for f in figures if f.get("not_drawn")]
    if not_drawn:  # one note for the page, the terminal and results.json
        results["figures_note"] = (
            f"{len(not_drawn)} figure(s) not drawn ({not_drawn[0]}); each one's data is in its "
            "CSV, and results.json gives the command that redraws it"
        )
    (outdir / "results.json").write_text(json.dumps(to_jsonable(results), indent=2))
    (outdir / "index.html").write_text(render_html(results, outdir))
    return results


def _previous_sections(outdir: pathlib.Path, model: str, config: Any) -> dict:
    """Entries of an earlier results.json in ``outdir`` for the same model and config."""
    try:
        old = json.loads((outdir / "results.json").read_text())
    except (OSError, ValueError):
        return {}
    if old.get("model") != model or old.get("config") != config:
        return {}
    return dict(old.get("sections", {}))


def _loss_used(ctx: Context) -> str:
    """The loss the sections used: the default rule's pick once it ran, else the given name."""
    return getattr(ctx.user.loss_fn, "used", None) or ctx.user.loss_name


def _write_section(
    outdir: pathlib.Path,
    ctx: Context,
    section: Section,
    status: str,
    res: Result | str,
    secs: float,
) -> dict:
    """One section's files and its results.json entry."""
    entry: dict[str, Any] = {
        "title": section.title,
        "question": section.question,
        "status": status,
        "runtime_s": round(secs, 2),
    }
    if status != "ok":
        entry["reason"] = res
        return entry
    entry["csv"], entry["tables"] = {}, []
    for name, frame in res.frames.items():
        entry["csv"][name] = f"{section.key}_{name}.csv"
        frame.to_csv(outdir / entry["csv"][name], index=False)
    for i, (caption, table) in enumerate(res.tables):
        name = next((n for n, f in res.frames.items() if f is table), None)
        fname = entry["csv"][name] if name else f"{section.key}_table{i}.csv"
        if name is None:
            table.to_csv(outdir / fname, index=False)
        entry["tables"].append({"caption": caption, "csv": fname})
    entry["figures"] = [_draw(outdir, section, res, fig, entry, ctx) for fig in res.figures]
    entry["values"] = res.values
    entry["notes"] = res.notes
    return entry


def _draw(
    outdir: pathlib.Path, section: Section, res: Result, fig: Fig, entry: dict, ctx: Context
) -> dict:
    """Draw one Fig from its frame, save the PNG, and return its record with the commands."""
    frame = res.frames[fig.frame]
    df = frame.query(fig.query) if fig.query else frame
    png = f"{fig.name}.png"
    record = {"png": png, "caption": fig.caption, "csv": entry["csv"][fig.frame]}
    load = f"pd.read_csv({record['csv']!r})" + (f".query({fig.query!r})" if fig.query else "")
    args = "".join(f", {k}={v!r}" for k, v in fig.kwargs.items())
    record["replot"] = (
        f'python -c "import pandas as pd, loopprobe as lp; '
        f'lp.plots.{fig.plot}({load}{args}).savefig({png!r})"'
    )
    record["recompute"] = f"{ctx.rerun} --sections {section.key}"
    try:
        from loopprobe import plots
    except ImportError as err:  # the core install: the data is in the CSV, the page says so
        record.update(png=None, not_drawn=str(err))
        return record
    try:
        figure: Figure = getattr(plots, fig.plot)(df, **fig.kwargs)
        figure = figure if hasattr(figure, "savefig") else figure.figure  # an Axes
        figure.savefig(outdir / png, dpi=110)
    except Exception as err:  # noqa: BLE001 - a bad figure is noted, the report goes on
        record.update(png=None, error=f"{type(err).__name__}: {err}")
    return record
