"""The report as a reader meets it: the answer first, then the evidence.

Two small reports are rendered: the reference model with the cheapest sections that still
draw figures and write tables (tiny sizes), and a Huginn-style model written the way user code
is (tests/huginn_model.py) with the health check. Chromium renders each page at 1400 px and the
tests read what is on screen: no sideways overflow, the summary above the fold, every figure
drawn. The summary's text, the terminal's last lines and the redundancy takeaway are checked
on their own, on inputs where the answer is known.
"""

from __future__ import annotations

import json
import math
import re

import pandas as pd
import pytest
from _browser import CHROMIUM, measure

from loopprobe import report
from loopprobe.cli import main
from loopprobe.report.sections_redundancy import redundancy_takeaway
from loopprobe.report.summary import headline, reader_text
from loopprobe.report.verdicts import FAILS

TINY = dict(seq_len=4, d_model=8, n_heads=2, batch=1, Rs=(1, 2), power_iters=3)
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """theory, alignment, redundancy (figures, a long table), the studies' verdicts (the
    longest text cells) and health (skipped here) on a tiny reference model: a few CPU-s."""
    out = tmp_path_factory.mktemp("ref")
    lines = []
    cfg = report.ReportConfig(**TINY, studies="studies")
    keys = ["health", "theory", "alignment", "redundancy", "reproductions"]
    report.run_report(out, cfg, sections=keys, progress=False, echo=lines.append,
                      command=f"loopprobe report --out {out}")
    return out, "\n".join(lines)


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """`loopprobe report --model` on the Huginn-style model, health and visits only."""
    out = tmp_path_factory.mktemp("user")
    code = main(["report", "--model", "huginn_model:huginn", "--inputs", "huginn_model:batch",
                 "--sections", "health,visits", "--out", str(out), "--no-progress"])
    return code, out


def _results(out):
    return json.loads((out / "results.json").read_text())


@needs_chromium
@pytest.mark.parametrize("which", ["reference", "user"])
def test_the_page_fits_1400px_leads_with_its_summary_and_draws_every_figure(which, request):
    out = request.getfixturevalue("reference")[0] if which == "reference" else (
        request.getfixturevalue("user")[1])
    seen = measure(out / "index.html", width=1400, height=900,
                   selectors=("#summary", "#verdicts", "#references"))
    assert seen["page_width"] <= seen["window"][0], seen["page_width"]
    assert seen["overflowing"] == []
    top = seen["tops"]["#summary"]
    assert top is not None and top < seen["window"][1] / 3  # the first thing read
    assert seen["tops"]["#verdicts"] is None or seen["tops"]["#verdicts"] > top
    assert seen["tops"]["#references"] is not None
    assert len(seen["images"]) >= (3 if which == "reference" else 2)
    assert [i["src"] for i in seen["images"] if not i["drawn"]] == []


@needs_chromium
def test_the_user_s_risks_are_named_on_the_first_screen_with_what_to_do(user):
    code, out = user
    assert code == 0
    health = [v for v in _results(out)["verdicts"] if v["section"] == "health"]
    flagged = [v for v in health if v["verdict"] != "fine"]
    assert flagged  # the textbook init has lines that cannot tell (no step=, ...)
    seen = measure(out / "index.html", width=1400, height=900, selectors=("#summary", "nav"))
    first_screen = seen["text"].split("\nhealth\n")[0]  # the text before the section links
    counts = {k: sum(v["verdict"] == k for v in health) for k in ("fine", "risk", "cannot tell")}
    for k, n in counts.items():
        assert f"{n} {k}" in first_screen
    for v in flagged:
        assert v["claim"].split(":")[0] in first_screen
    assert seen["tops"]["nav"] < seen["window"][1] * 3  # the summary is about a screen
    # its own per-visit figures are in the summary, before the sections
    summary_imgs = re.findall(r"<p class='thumbs'>(.*?)</p>", (out / "index.html").read_text())
    assert summary_imgs and "health_visit_norms.png" in summary_imgs[0]


def test_the_verdict_wall_is_folded_and_each_line_opens_for_its_details(reference):
    html = (reference[0] / "index.html").read_text()
    wall = html[html.index("<h2 id='verdicts'>"):]
    assert wall.split("\n")[1].startswith("<details><summary>All ")
    n = len(_results(reference[0])["verdicts"])
    assert wall.count("<li><details><summary>") == n
    assert html.index("<section id='summary'>") < html.index("<h2 id='verdicts'>")


def test_no_issue_numbers_seed_numbers_or_absolute_paths_outside_commands(reference, user):
    for out in (reference[0], user[1]):
        html = (out / "index.html").read_text()
        prose = re.sub(r"<(code|pre)>.*?</\1>", "", html, flags=re.S)
        assert not re.search(r"\bissues? \d", html), re.search(r".{60}\bissues? \d.{20}", html)
        assert not re.search(r"\bseeds? 00\d", prose)
        assert str(out) not in prose and "/home/" not in prose and "/work/" not in prose
    html = (reference[0] / "index.html").read_text()
    assert "arxiv.org/abs/2607.13491" in html and "DeepLoop: Depth Scaling" in html


def test_the_redundancy_section_leads_with_a_takeaway_and_folds_its_long_table(reference):
    out, text = reference
    entry = _results(out)["sections"]["redundancy"]
    takeaway = entry["values"]["takeaway"]
    assert "state change" in takeaway and "KV residuals" in takeaway
    html = (out / "index.html").read_text()
    assert f"<p class='takeaway'>{takeaway}</p>".replace("'", "&#39;") in html.replace(
        "'", "&#39;")
    table = pd.read_csv(out / entry["tables"][0]["csv"])
    assert len(table) > 20 and re.search(r"<details><summary><b>Mean over layers", html)
    assert f"takeaway: {takeaway}" in text and "redundancy_*.csv" in text


def test_the_terminal_output_ends_on_the_summary_not_on_skipped(reference, user, capsys):
    text = reference[1]
    tail = text[text.rindex("summary:"):].splitlines()
    assert not text.rstrip().splitlines()[-1].startswith(("SKIPPED", "FAILED"))
    assert tail[0] == "summary:" and any(ln.startswith("  alignment: ") for ln in tail)


def _v(section, claim, verdict, why=""):
    return {"section": section, "claim": claim, "verdict": verdict, "measured": "m",
            "expected": "e", "why": why, "kind": ""}


def test_the_summary_names_risks_first_and_counts_every_reading():
    sections = {
        "health": {"title": "Health", "status": "ok", "figures": [{"png": "a.png"}]},
        "alignment": {"title": "Alignment", "status": "ok"},
        "fixedpoint": {"title": "Fixed points", "status": "skipped", "reason": "needs step"},
    }
    verdicts = [_v("health", "oscillation: x", "cannot tell", "repeat over seeds"),
                _v("health", "bound: y", "fine"), _v("health", "explosion: z", "risk", "lower lr"),
                _v("alignment", "a holds", "holds"), _v("alignment", "b [tested: d 8]", FAILS)]
    head = headline({"model": "m:f", "user_model": True, "sections": sections,
                     "verdicts": verdicts})
    u = head["user"]
    assert u["counts"] == [("fine", 1), ("risk", 1), ("cannot tell", 1)]
    assert [v["check"] for v in u["named"]] == ["explosion", "oscillation"]  # risk first
    assert u["figures"] == [{"png": "a.png"}]
    assert head["reference"][0]["fails"] == ["b"]  # the scope is left to the list below
    assert head["not_run"] == [{"key": "fixedpoint", "status": "skipped", "reason": "needs step"}]
    lines = head["lines"]
    assert lines[1] == "  your model (m:f), health check: 1 fine, 1 risk, 1 cannot tell"
    assert lines[2] == "    risk: explosion (m): lower lr"
    ref = headline({"model": "ref", "user_model": False, "sections": sections,
                    "verdicts": verdicts})
    assert ref["user"] is None and ref["lines"][1] == "  alignment: 1 holds, 1 does not hold"


@pytest.mark.parametrize("text, expected", [
    ("above 0 (stated after the data, issue 27)", "above 0 (stated after the data)"),
    ("rule, stated after the data (issue 39); at 0.5", "rule, stated after the data; at 0.5"),
    ("What does seed 002 predict", "What does DeepLoop (Li et al.) predict"),
    ("1/N and a/b/c stay", "1/N and a/b/c stay"),
])  # fmt: skip
def test_reader_text_names_papers_and_drops_tracker_references(text, expected):
    assert reader_text(text) == expected
    assert reader_text({"command": "x issue 3"}) == {"command": "x issue 3"}  # commands as typed


def _summary(share_top10, cos, ratio_k, ratio_v):
    rows = [("concentration", "output", "share", 0.1, share_top10),
            ("similarity", "output", "cos_mean", math.nan, cos),
            ("quantization", "K", "ratio", 4, ratio_k), ("quantization", "V", "ratio", 4, ratio_v),
            ("quantization", "K", "ratio", 2, 9.0)]  # the larger bit width is read
    return pd.DataFrame([(o, t, m, p, math.nan, v) for o, t, m, p, v in rows],
                        columns=["observation", "tensor", "metric", "param", 1, 2])


def test_the_redundancy_takeaway_reads_concentration_similarity_and_quantization():
    spread = redundancy_takeaway(_summary(0.12, 0.97, 0.4, 0.3))
    assert spread.startswith("At the last loop the state change is spread over the tokens "
                             "(the top 10 % carry 12%")
    assert "mean cosine 0.97" in spread
    assert "KV residuals quantize better than K/V at 4 bits " in spread
    assert "(error ratio 0.40 / 0.30)" in spread
    peaked = redundancy_takeaway(_summary(0.45, 0.5, 1.3, 0.3))
    assert "concentrates on few tokens" in peaked and "KV residuals do not beat K/V" in peaked
    lazy = pd.DataFrame({"f": [0.1, 0.5], "kl": [1e-3, 2e-4], "saved": [0.44, 0.2]})
    assert "a lazy update saves 44% of per-token work at KL 0.001 (f = 0.1)" in (
        redundancy_takeaway(_summary(0.12, 0.97, 0.4, 0.3), lazy))


def test_a_reference_run_does_not_open_on_a_skipped_health_section(reference):
    out = reference[0]
    assert _results(out)["sections"]["health"]["status"] == "skipped"  # kept in the data
    html = (out / "index.html").read_text()
    assert "id='health'" not in html and "href='#health'" not in html
    assert "do not apply" not in html  # the only skipped section was health
    assert "for the health check of a model of yours, run <code>loopprobe report --model" in html
