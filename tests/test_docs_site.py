"""The documentation site builds strictly, its guides' code prints what the pages show, the
CLI reference is the parser's own ``--help``, and the README's links resolve.

Conventions (docs/CONTRIBUTING.md, "Documentation"): every ```python block of the README,
docs/getting-started.md and docs/guides/*.md runs, the blocks of one page in order in one
namespace, in a temporary directory, on one thread; a ```text block right after a python
block (blank lines between are allowed) is what that block prints. Words, integers and the
line structure are compared exactly; a decimal number (``3.455``, ``2e-10``) agrees when it is
within one unit of the last digit the page shows, so a page prints only the digits the
computation guarantees and the last digit may move with the machine's summation order (the
tolerance is stated in docs/CONTRIBUTING.md). A block that must not run is
```python title="not run" (or ```bash / ```console).
"""

from __future__ import annotations

import html
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
from _browser import measure
from _liveness import run_alive

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
NOT_RUN = 'title="not run"'
FENCE = re.compile(r"^```(?P<lang>[\w-]*)(?P<attrs>[^\n]*)\n(?P<body>.*?)^```[ \t]*$", re.S | re.M)


def blocks(text: str) -> list[tuple[str, str | None]]:
    """``[(code, printed or None)]`` for every ```python block that runs, in page order."""
    fences = list(FENCE.finditer(text))
    out = []
    for i, m in enumerate(fences):
        if m["lang"] != "python" or NOT_RUN in m["attrs"]:
            continue
        printed = None
        if i + 1 < len(fences):
            nxt = fences[i + 1]
            between = text[m.end() : nxt.start()]
            if nxt["lang"] == "text" and not between.strip():
                printed = nxt["body"]
        out.append((m["body"], printed))
    return out


#: a number standing alone: not part of a name (``blocks.0.attn``) or a longer token
NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.\d+|\d+)(?:[eE][-+]?\d+)?(?![\w])(?!\.\d)")


def _unit(shown: str) -> float:
    """One unit of the last digit ``shown`` prints (``3.455`` -> 1e-3, ``2e-10`` -> 1e-10)."""
    mant, _, exp = shown.lower().partition("e")
    decimals = len(mant.partition(".")[2])
    return 10.0 ** (int(exp or 0) - decimals)


def same_output(got: str, shown: str) -> bool:
    """``got`` prints what the page ``shows``: the same lines and words (white space inside a line
    folded, as table columns widen with a digit), integers equal, decimals within one unit of the
    page's last digit."""
    got_lines, shown_lines = got.rstrip("\n").split("\n"), shown.rstrip("\n").split("\n")
    if len(got_lines) != len(shown_lines):
        return False
    for g, s in zip(got_lines, shown_lines, strict=True):
        words = [[" ".join(t.split()) for t in NUMBER.split(line)] for line in (g, s)]
        g_num, s_num = NUMBER.findall(g), NUMBER.findall(s)
        if words[0] != words[1] or len(g_num) != len(s_num):
            return False
        for a, b in zip(g_num, s_num, strict=True):
            exact = not any(c in b.lower() for c in ".e")
            if (a != b) if exact else abs(float(a) - float(b)) > _unit(b) * (1 + 1e-9):
                return False
    return True


def pages() -> list[pathlib.Path]:
    """The pages whose code runs: the README, getting-started and every guide."""
    return [ROOT / "README.md", DOCS / "getting-started.md", *sorted(DOCS.glob("guides/*.md"))]


RUNNER = r"""
import contextlib, io, json, sys, traceback
import torch
torch.set_num_threads(1)
codes = json.load(sys.stdin)
ns = {"__name__": "__main__"}
results = []
for i, code in enumerate(codes):
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            exec(compile(code, f"<block {i + 1}>", "exec"), ns)
    except BaseException:
        results.append({"stdout": buf.getvalue(), "error": traceback.format_exc()})
        break
    results.append({"stdout": buf.getvalue(), "error": None})
with open("__results__.json", "w") as f:
    json.dump(results, f)
"""


def run_page(path: pathlib.Path, cwd: pathlib.Path) -> list[dict]:
    codes = [code for code, _ in blocks(path.read_text())]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("COLUMNS", None)
    run = run_alive([sys.executable, "-c", RUNNER], input=json.dumps(codes), cwd=cwd, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((cwd / "__results__.json").read_text())


def test_blocks_are_found_with_their_printed_text_and_not_run_blocks_are_skipped():
    page = (
        "```python\nprint(1)\n```\n\n```text\n1\n```\n"
        '```python title="not run"\nboom()\n```\n'
        "```bash\nls\n```\n```python\nx = 2\n```\nprose\n```text\nnot its output\n```\n"
    )
    assert blocks(page) == [("print(1)\n", "1\n"), ("x = 2\n", None)]


@pytest.mark.parametrize(
    ("got", "shown", "same"),
    [
        ("[(2, 3.4549)]\n", "[(2, 3.455)]\n", True),  # within one unit of the page's last digit
        ("[(2, 3.4535)]\n", "[(2, 3.455)]\n", False),  # 1.5 units off
        ("[(3, 3.455)]\n", "[(2, 3.455)]\n", False),  # integers exactly
        ("err = 3e-10\n", "err = 2e-10\n", True),
        ("err = 4e-10\n", "err = 2e-10\n", False),
        ("blocks.1.attn  0.5\n", "blocks.0.attn  0.5\n", False),  # a digit inside a name
        ("kappa  3.99\n", "kappa 3.99\n", True),  # a column one character wider
        ("converged: False\n", "converged: True\n", False),
        ("1.0\n2.0\n", "1.0\n", False),
    ],
)
def test_printed_numbers_agree_to_the_last_digit_the_page_shows_and_words_exactly(got, shown, same):
    assert same_output(got, shown) is same


def test_every_page_with_code_has_a_block_that_prints_what_it_shows():
    counted = {p.name: sum(out is not None for _, out in blocks(p.read_text())) for p in pages()}
    for name in ("README.md", "getting-started.md", "your-model.md", "monitor.md"):
        assert counted[name] >= 1, counted


#: every page runs its code in a fresh interpreter (10-90 CPU-s each): run by ./test.sh and CI,
#: left out of the quick loop (-m "not slow")


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(p, marks=pytest.mark.slow)
        for p in pages()
        if blocks(p.read_text())  # pages without python blocks run nothing
    ],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_a_page_s_code_runs_and_prints_what_the_page_shows(path, tmp_path):
    found = blocks(path.read_text())
    results = run_page(path, tmp_path)
    for i, ((code, printed), res) in enumerate(zip(found, results, strict=False), start=1):
        assert res["error"] is None, f"{path.name} block {i} raised:\n{res['error']}\n{code}"
        if printed is not None:
            assert same_output(res["stdout"], printed), (
                f"{path.name} block {i} printed:\n{res['stdout']}\nthe page shows:\n{printed}"
            )
    assert len(results) == len(found)


def test_the_readme_s_relative_links_resolve():
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r'src="([^"]+)"', text)
    relative = [t for t in targets if not re.match(r"[a-z]+:|#", t)]
    assert relative, "the README links to the docs"
    missing = [t for t in relative if not (ROOT / t.split("#")[0]).exists()]
    assert not missing, missing


def test_the_readme_is_a_landing_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 260


HAS_MKDOCS = all(importlib.util.find_spec(m) for m in ("mkdocs", "material", "mkdocstrings"))


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    # not a skip: the dev extra (what ./test.sh installs) holds them, so a missing one is a
    # broken setup that must show
    assert HAS_MKDOCS, "mkdocs, mkdocs-material or mkdocstrings missing: pip install -e .[docs]"
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, OMP_NUM_THREADS="1", NO_MKDOCS_2_WARNING="1")
    run = run_alive(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, env=env,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return out


def test_the_site_builds_strictly_with_every_page_of_the_nav(site):
    for page in ("index.html", "getting-started/index.html", "reference/api/index.html"):
        assert (site / page).exists(), page
    assert not (site / "hooks").exists()  # the build hook is not published


def test_the_api_reference_renders_every_public_name(site):
    import loopprobe

    page = (site / "reference/api/index.html").read_text()
    ids = set(re.findall(r'id="([\w.]+)"', page))
    from loopprobe import results

    public = {**loopprobe._NAMES, **results._NAMES}
    missing = [f"{mod}.{name}" for name, mod in public.items() if f"{mod}.{name}" not in ids]
    assert not missing, missing


def test_the_cli_reference_is_each_command_s_own_help(site):
    page = (site / "reference/cli/index.html").read_text()
    shown = [
        html.unescape(re.sub(r"<[^>]+>", "", b))
        for b in re.findall(r"<code>(.*?)</code>", page, re.S)
    ]
    env = dict(os.environ, COLUMNS="100")
    sys.path.insert(0, str(DOCS / "hooks"))
    try:
        from cli_reference import help_texts
    finally:
        sys.path.pop(0)
    names = [n for n in help_texts() if n]
    assert len(names) >= 10, names
    for name in ["", *names]:
        argv = [sys.executable, "-m", "loopprobe.cli", *([name] if name else []), "--help"]
        want = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT).stdout
        assert any(s.strip() == want.strip() for s in shown), f"loopprobe {name} --help differs"


#: the pages a newcomer reads first and the widest ones (tables, code)
READ_PAGES = ["index.html", "getting-started/index.html", "guides/health/index.html",
              "definitions/index.html", "results/performance/index.html",
              "reference/cli/index.html", "studies/deeploop/index.html"]


@pytest.mark.parametrize("page", READ_PAGES)
def test_a_key_page_fits_a_1400px_window_with_every_figure_drawn_and_no_raw_tex(site, page):
    seen = measure(site / page, width=1400, height=900)
    assert seen["page_width"] <= 1400 and not seen["overflowing"], seen["overflowing"]
    assert all(img["drawn"] for img in seen["images"]), seen["images"]
    tex = re.findall(r".{0,20}[_^]\{.{0,10}", seen["prose"])
    assert not tex, f"raw TeX (x^{{..}} / x_{{..}}) in the prose: {tex[:3]}"

