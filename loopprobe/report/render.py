"""Rendering: the terminal summary and ``index.html``, from results.json and the CSVs."""

from __future__ import annotations

import html
import math
import pathlib
import shlex
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from loopprobe.report.verdicts import FAILS, HOLDS, UNKNOWN, summary_lines


def _fmt(v: Any) -> str:
    if isinstance(v, (float, np.floating)):
        return "—" if not math.isfinite(v) else f"{v:.4g}"
    return str(v)


def _text_table(df: pd.DataFrame) -> str:
    return df.to_string(index=False, formatters={c: _fmt for c in df.columns})


def format_summary(done: list, results: dict) -> str:
    """The terminal summary: one small table per section, then skipped/failed reasons."""
    lines = [f"loopprobe report — {results['model']}", ""]
    for section, status, res, secs in done:
        head = f"[{section.key}] {section.title} ({secs:.1f} s)"
        if status != "ok":
            lines += [f"{head}: {status.upper()}: {res}", ""]
            continue
        lines.append(head)
        if res.summary is not None and len(res.summary):
            lines += ["  " + ln for ln in _text_table(res.summary).splitlines()]
        if section.key == "alignment" and "slopes" in res.frames:
            lines += ["  " + ln for ln in _text_table(res.frames["slopes"]).splitlines()]
        lines += [f"  note: {n}" for n in res.notes]
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
    lines += [_status_line(results, status) for status in ("failed", "skipped")]
    return "\n".join(ln for ln in lines if ln is not None)


def _status_line(results: dict, status: str) -> str | None:
    """``FAILED: a (reason); b (reason)``: a failure is an error to look at, a skip is not."""
    keys = results.get(status, [])
    if not keys:
        return None
    why = "; ".join(f"{k} ({results['sections'][k]['reason']})" for k in keys)
    return f"{status.upper()} ({'an error' if status == 'failed' else 'does not apply'}): {why}"


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;max-width:1100px;margin:2em auto;
padding:0 1em;color:#222;line-height:1.45}
h1{margin-bottom:.2em} h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:2em}
.meta,.question{color:#555} .question{font-style:italic}
table.tbl{border-collapse:collapse;font-size:.85em;margin:.6em 0 1.2em}
table.tbl th,table.tbl td{border:1px solid #ddd;padding:.25em .6em;text-align:right}
table.tbl th{background:#f4f4f4} figure{margin:1em 0 2em} figure img{max-width:100%;
border:1px solid #eee} figcaption{font-size:.9em;color:#444}
code,pre{background:#f6f8fa;font-size:.8em} pre{padding:.5em;overflow-x:auto;white-space:pre-wrap}
.skipped{color:#8a6d3b} .failed{color:#a94442} .ok{color:#2b6e2b} nav a{margin-right:1em}
.scroll{overflow-x:auto}
"""


def _html_table(df: pd.DataFrame) -> str:
    return df.to_html(
        index=False,
        classes="tbl",
        border=0,
        na_rep="—",
        formatters={c: _fmt for c in df.columns},
        escape=True,
    )


_VERDICT_CLASS = {HOLDS: "ok", FAILS: "failed", UNKNOWN: "skipped"}


def render_html(results: dict, outdir: pathlib.Path) -> str:
    """index.html from results.json and the CSVs: tables, linked PNGs, the commands."""
    e = html.escape
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>loopprobe report</title><style>{_CSS}</style></head><body>",
        "<h1>loopprobe report</h1>",
        f"<p class='meta'>{e(results['model'])} · loopprobe {e(results['loopprobe_version'])}"
        f" · {e(results['created'])}<br>reproduce everything: "
        f"<code>{e(results['command'])}</code> · data: <a href='results.json'>results.json</a>"
        "</p><nav>",
    ]
    for key, entry in results["sections"].items():
        st = entry["status"]
        mark = "" if st == "ok" else f" <span class='{st}'>({st})</span>"
        parts.append(f"<a href='#{key}'>{e(key)}</a>{mark}")
    parts.append("</nav>")
    if results.get("verdicts"):
        items = "".join(
            f"<li class='{_VERDICT_CLASS[v['verdict']]}'>"
            f"<b>{e(v['verdict'])}</b> — {e(v['claim'])}: {e(v['measured'])} "
            f"(expected {e(v['expected'])}{'; ' + e(v['why']) if v['why'] else ''})</li>"
            for v in results["verdicts"]
        )
        parts.append(f"<h2 id='verdicts'>Verdicts</h2><ul class='verdicts'>{items}</ul>")
    for status, meaning in (("failed", "raised an error"), ("skipped", "do not apply")):
        keys = [k for k, v in results["sections"].items() if v["status"] == status]
        if keys:
            head = f"{len(keys)} section(s) {meaning}"
            parts.append(f"<p class='{status}'><b>{head}</b>: {e(', '.join(keys))}</p>")
    for key, entry in results["sections"].items():
        parts += [
            f"<h2 id='{key}'>{e(entry['title'])}</h2>",
            f"<p class='question'>{e(entry.get('question', ''))}</p>",
        ]
        if entry["status"] != "ok":
            status = entry["status"]
            parts.append(f"<p class='{status}'><b>{status}</b>: {e(str(entry['reason']))}</p>")
            continue
        for table in entry["tables"]:
            parts += [
                f"<p><b>{e(table['caption'])}</b></p>",
                "<div class='scroll'>" + _html_table(pd.read_csv(outdir / table["csv"])) + "</div>",
            ]
        parts += [f"<p class='meta'>note: {e(note)}</p>" for note in entry["notes"]]
        for fig in entry["figures"]:
            parts.append(_html_figure(fig))
        csvs = " ".join(f"<a href='{e(f)}'>{e(f)}</a>" for f in entry["csv"].values())
        parts.append(f"<p class='meta'>tidy data: {csvs} · {entry['runtime_s']:.0f} s</p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _html_figure(fig: dict) -> str:
    e = html.escape
    if fig.get("png") is None:
        return f"<p class='failed'>figure failed: {e(fig['error'])}</p>"
    return (
        f"<figure><img src='{e(fig['png'])}' alt='{e(fig['caption'])}'>"
        f"<figcaption>{e(fig['caption'])}<pre>"
        f"# recompute the data:\n{e(fig['recompute'])}\n"
        f"# redraw from the saved CSV, no recompute:\n{e(fig['replot'])}</pre>"
        "</figcaption></figure>"
    )


def main_command(argv: Sequence[str] | None = None) -> str:
    """The command line as typed (for 'reproduce' lines)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return shlex.join(["loopprobe", *args])
