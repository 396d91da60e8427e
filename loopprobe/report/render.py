"""Rendering: the terminal summary and ``index.html`` (a Jinja2 template, ``templates/``)."""

from __future__ import annotations

import functools
import math
import os
import pathlib
import re
import shlex
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from loopprobe.report.summary import PAPERS, headline, reader_text
from loopprobe.report.verdicts import FAILS, HOLDS, UNKNOWN, summary_lines

if TYPE_CHECKING:
    import jinja2


def _fmt(v: Any) -> str:
    if isinstance(v, (float, np.floating)):
        return "—" if not math.isfinite(v) else f"{v:.4g}"
    return str(v)


def _text_table(df: pd.DataFrame) -> str:
    return df.to_string(index=False, formatters={c: _fmt for c in df.columns})


#: claims that do not hold named per section in the summary (the rest are counted)
MAX_NAMED = 6
#: a table longer than this is folded on the page and left to its CSV in the terminal
LONG_TABLE = 20


def format_summary(done: list, results: dict) -> str:
    """The terminal output: one small table per section, the verdicts, the files written,
    the skipped/failed reasons, and last the summary (what to act on) of :func:`headline`."""
    results = reader_text(results)
    lines = [f"loopprobe report — {results['model']}", ""]
    for section, status, res, secs in done:
        head = f"[{section.key}] {section.title} ({secs:.1f} s)"
        if status != "ok":
            lines += [f"{head}: {status.upper()}: {res}", ""]
            continue
        lines.append(head)
        takeaway = res.values.get("takeaway") if isinstance(res.values, dict) else None
        if takeaway:
            lines.append(f"  takeaway: {reader_text(takeaway)}")
        if res.summary is not None and len(res.summary) > LONG_TABLE:
            lines.append(f"  ({len(res.summary)}-row table: {section.key}_*.csv and the page)")
        elif res.summary is not None and len(res.summary):
            lines += ["  " + ln for ln in _text_table(res.summary).splitlines()]
        if section.key == "alignment" and "slopes" in res.frames:
            lines += ["  " + ln for ln in _text_table(res.frames["slopes"]).splitlines()]
        lines += [f"  note: {reader_text(n)}" for n in res.notes]
        lines.append("")
    if results.get("verdicts"):
        lines += ["verdicts:"] + ["  " + ln for ln in summary_lines(results["verdicts"])] + [""]
    n_png = sum(
        1 for s in results["sections"].values() for f in s.get("figures", []) if f.get("png")
    )
    lines.append(
        f"wrote {results['out']}/index.html, results.json, {n_png} figures and CSVs "
        f"in {results['runtime_s']:.0f} s"
    )
    lines.append(f"note: {results['figures_note']}" if results.get("figures_note") else None)
    lines += [_status_line(results, status) for status in ("failed", "skipped")]
    lines += ["", *headline(results)["lines"]]
    return "\n".join(ln for ln in lines if ln is not None)


def _status_line(results: dict, status: str) -> str | None:
    """``FAILED: a (reason); b (reason)``: a failure is an error to look at, a skip is not."""
    keys = results.get(status, [])
    if not keys:
        return None
    why = "; ".join(f"{k} ({results['sections'][k]['reason']})" for k in keys)
    return f"{status.upper()} ({'an error' if status == 'failed' else 'does not apply'}): {why}"


def _html_table(df: pd.DataFrame) -> str:
    return df.to_html(
        index=False,
        classes="tbl",
        border=0,
        na_rep="—",
        formatters={c: _fmt for c in df.columns},
        escape=True,
    )


_VERDICT_CLASS = {HOLDS: "ok", FAILS: "failed", UNKNOWN: "skipped", "fine": "ok", "risk": "failed"}


@functools.cache
def _template() -> jinja2.Template:
    """``templates/index.html``, autoescaped; an undefined name raises instead of printing ''."""
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.PackageLoader("loopprobe.report", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    return env.get_template("index.html")


def render_html(results: dict, outdir: pathlib.Path) -> str:
    """index.html from results.json and the CSVs: tables, linked PNGs, the commands.

    A Jinja2 template with autoescaping (``templates/index.html``): every string from
    ``results`` is escaped there; the tables are pandas HTML with their cells escaped.
    """
    from markupsafe import Markup

    if (
        not results.get("user_model")
        and results["sections"].get("health", {}).get("status") == "skipped"
    ):  # a reference run: the summary says how to check a model of yours
        results = {**results, "sections": {
            k: v for k, v in results["sections"].items() if k != "health"}}  # fmt: skip
    sections = results["sections"]
    by_status = {
        s: [k for k, v in sections.items() if v["status"] == s] for s in ("failed", "skipped")
    }
    frames = {
        t["csv"]: pd.read_csv(outdir / t["csv"])
        for entry in sections.values()
        if entry["status"] == "ok"
        for t in entry["tables"]
    }
    frames = {name: df.map(reader_text) for name, df in frames.items()}  # cells read as prose
    tables = {name: Markup(_html_table(df)) for name, df in frames.items()}
    rows = {name: len(df) for name, df in frames.items()}
    shown = reader_text(relative_paths(results, outdir))
    return _template().render(
        r=shown,
        by_status=by_status,
        tables=tables,
        rows=rows,
        long_table=LONG_TABLE,
        max_named=MAX_NAMED,
        head=headline(shown),
        papers=PAPERS,
        verdict_class=_VERDICT_CLASS,
    )


#: an absolute path in a message (not preceded by a word character, so ``1/N`` is no path)
_ABSOLUTE = re.compile(r"(?<![\w.:/])/[\w.\-]+(?:/[\w.\-]+)*")


def relative_paths(obj: Any, outdir: pathlib.Path, key: str = "") -> Any:
    """``obj`` with every absolute path of an existing file or directory in its strings
    (notes, reasons, captions) rewritten relative to the report directory ``outdir``, so
    the page shows no local path and its links work wherever it is moved with its data.
    Command lines (``command``, ``recompute``, ``replot``) are kept as typed."""
    if isinstance(obj, dict):
        return {k: relative_paths(v, outdir, k) for k, v in obj.items()}
    if isinstance(obj, list):
        return [relative_paths(v, outdir) for v in obj]
    if not isinstance(obj, str) or key in ("command", "recompute", "replot"):
        return obj
    base = outdir.resolve()

    def rel(m: re.Match) -> str:
        path = m.group(0)
        return os.path.relpath(path, base) if os.path.exists(path) else path

    return _ABSOLUTE.sub(rel, obj)


def main_command(argv: Sequence[str] | None = None) -> str:
    """The command line as typed (for 'reproduce' lines)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return shlex.join(["loopprobe", *args])
