"""The report's first screen: what a reader should act on, before the sections.

:func:`headline` condenses ``results.json`` into the summary that opens ``index.html`` and
closes the terminal output: the user's model first (its health lines that are a risk or
cannot tell, by name, with their advice, and its per-visit figures), then the reference's
results (per section the counts of holds / does not hold / cannot tell, the ones that do
not hold named), then the sections that failed or did not apply. :func:`reader_text` puts
the papers' names where the project's internal shorthand stood ("seed 002") and drops
internal tracker references, so the page reads without the repository at hand.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from loopprobe.report.verdicts import FAILS, HOLDS, UNKNOWN

#: the papers the report's figures test: (short name used in the text, full reference, arXiv)
PAPERS: list[tuple[str, str, str]] = [
    ("DeepLoop (Li et al.)", "Li, Zhang, Guo, Gu, Wang. DeepLoop: Depth Scaling for Looped "
     "Transformers.", "2607.13491"),
    ("Residual Scaling (Wang et al.)", "Wang, Li, Zhang, Huang, Yan, Li. On the Residual "
     "Scaling of Looped Transformers: Stability and Transferability (incl. the Loop-μP recipe).",
     "2606.18524"),
    ("Stability and Generalization (Labovich)", "Labovich. Stability and Generalization in "
     "Looped Transformers.", "2604.15259"),
    ("Right Direction, Wrong Step (Guo et al.)", "Guo, Wu, Du, Huo, Shao. Right Direction, "
     "Wrong Step: Geometric Analysis of Finite-Step Failure in Looped Transformers.",
     "2609.16665"),
    ("One Recurrence (Schwethelm et al.)", "Schwethelm, Rückert, Kaissis. How Much Is One "
     "Recurrence Worth? Iso-Depth Scaling Laws for Looped Language Models.", "2604.21106"),
    ("Fully Looped Transformer (Fu et al.)", "Fu, Yang, Zhang, Ma, Chen, Li, Chang. Simply "
     "Stabilizing the Loop via Fully Looped Transformer.", "2605.18797"),
    ("FlashLoop (Yang, Liu)", "Yang, Liu. FlashLoop: Fast and Memory-Efficient Looped "
     "Transformers via Lazy Updates.", "2609.29812"),
]  # fmt: skip

#: the project's internal names of source texts, as the reader's paper names
_SEEDS = {"seed 002": PAPERS[0][0], "seed 004": PAPERS[1][0]}
_SEED = re.compile(r"seeds? 00\d(?:, 00\d)*")
_ISSUE = [
    (re.compile(r"\s*\(issues? \d+(?:\.\d+)?\)"), ""),
    (re.compile(r"[,;]\s*issues? \d+(?:\.\d+)?"), ""),
    (re.compile(r"\bissues? \d+(?:\.\d+)?[,;]?\s*"), ""),
]
_COMMANDS = ("command", "recompute", "replot")
SHORT = 110  # characters of a claim shown before "…" in the summary


def _paper(m: re.Match) -> str:
    return _SEEDS.get(m.group(0), "the source papers")


def reader_text(obj: Any, key: str = "") -> Any:
    """``obj`` with "seed 002"-style names replaced by the paper's name and "(issue N)"-style
    tracker references removed from every string except command lines."""
    if isinstance(obj, dict):
        return {k: reader_text(v, k) for k, v in obj.items()}
    if isinstance(obj, list):
        return [reader_text(v, key) for v in obj]
    if not isinstance(obj, str) or key in _COMMANDS:
        return obj
    text = _SEED.sub(_paper, obj)
    for pattern, by in _ISSUE:
        text = pattern.sub(by, text)
    return text


def short(text: str, n: int = SHORT) -> str:
    """``text`` cut at a word boundary to at most ``n`` characters, "…" marking a cut."""
    if len(text) <= n:
        return text
    return text[: text.rfind(" ", 0, n - 1) if " " in text[: n - 1] else n - 1] + " …"


def _claim(claim: str) -> str:
    """A claim without its bracketed scope ("[tested: ...]"): the summary names, the list
    below gives the scope."""
    return re.sub(r"\s*\[tested:.*?(\]|$)", "", claim).strip()


def headline(results: dict) -> dict:
    """The summary of ``results``: ``user`` (None on a reference run), ``reference`` (one row
    per section with verdicts), ``not_run`` (failed / skipped sections) and ``lines`` (the
    same as plain text, for the terminal)."""
    sections = results["sections"]
    verdicts = results.get("verdicts", [])
    user = _user_part(results, sections, verdicts) if results.get("user_model") else None
    reference = []
    for key, entry in sections.items():
        vs = [v for v in verdicts if v["section"] == key and key != "health"]
        if not vs:
            continue
        count = Counter(v["verdict"] for v in vs)
        reference.append({
            "key": key, "title": entry["title"],
            "counts": [(k, count.get(k, 0)) for k in (HOLDS, FAILS, UNKNOWN)],
            "fails": [short(_claim(v["claim"])) for v in vs if v["verdict"] == FAILS],
        })  # fmt: skip
    not_run = [
        {"key": k, "status": e["status"], "reason": short(str(e.get("reason", "")), 160)}
        for k, e in sections.items()
        if e["status"] != "ok" and not (k == "health" and user is None)
    ]
    return {"user": user, "reference": reference, "not_run": not_run,
            "lines": _lines(user, reference, not_run)}  # fmt: skip


def _user_part(results: dict, sections: dict, verdicts: list) -> dict:
    entry = sections.get("health", {})
    lines = [v for v in verdicts if v["section"] == "health"]
    count = Counter(v["verdict"] for v in lines)
    return {
        "model": results["model"],
        "status": entry.get("status", "not run"),
        "reason": short(str(entry.get("reason", "")), 200),
        "counts": [(k, count.get(k, 0)) for k in ("fine", "risk", UNKNOWN)],
        "named": [
            {
                "verdict": v["verdict"],
                "check": v["claim"].split(":")[0],
                "measured": short(v["measured"], 80),
                "advice": short(v["why"], 200),
            }
            for v in sorted(lines, key=lambda v: v["verdict"] != "risk")
            if v["verdict"] != "fine"
        ],  # fmt: skip
        "figures": [f for f in entry.get("figures", []) if f.get("png")],
    }


def _lines(user: dict | None, reference: list, not_run: list) -> list[str]:
    out = ["summary:"]
    if user is not None:
        if user["status"] != "ok":
            out.append(f"  your model ({user['model']}): health check {user['status']}: "
                       f"{user['reason']}")  # fmt: skip
        else:
            counts = ", ".join(f"{n} {k}" for k, n in user["counts"])
            out.append(f"  your model ({user['model']}), health check: {counts}")
            out += [f"    {v['verdict']}: {v['check']} ({v['measured']}): {v['advice']}"
                    for v in user["named"]]  # fmt: skip
    for row in reference:
        counts = ", ".join(f"{n} {k}" for k, n in row["counts"] if n)
        out.append(f"  {row['key']}: {counts}")
        out += [f"    does not hold: {c}" for c in row["fails"]]
    for row in not_run:
        out.append(f"  {row['key']}: {row['status']} ({row['reason']})")
    return out
