"""What a reader sees: an HTML page rendered by headless Chromium, measured in the page.

A copy of the page gets a script that, once the page has loaded, measures the layout (page
width against the window, each figure drawn or not, where chosen elements sit) and writes the
numbers into the DOM; ``chromium --headless --dump-dom`` prints that DOM and the numbers are read
back. No driver library: the Debian package ``chromium`` is all it needs (scripts/setup.sh
installs it where it can).
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import tempfile

from _liveness import run_alive

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)

MEASURE = """
<script>
window.addEventListener("load", () => {
  const doc = document.documentElement;
  const scrolls = (el) => {
    for (let e = el.parentElement; e; e = e.parentElement) {
      const ox = getComputedStyle(e).overflowX;
      if ((ox === "auto" || ox === "scroll") && e !== doc && e !== document.body) return true;
    }
    return false;
  };
  const wide = [];
  const kinds = "table, pre, img, svg, code, p, li, h1, h2, h3";
  for (const el of document.body.querySelectorAll(kinds)) {
    const r = el.getBoundingClientRect();
    if (r.width > 0 && r.right > window.innerWidth + 1 && !scrolls(el))
      wide.push(el.tagName.toLowerCase() + ": "
                + (el.textContent || el.getAttribute("src") || "").slice(0, 60));
  }
  const tops = {};
  for (const sel of (window.__MEASURE_SELECTORS__ || [])) {
    const el = document.querySelector(sel);
    tops[sel] = el ? el.getBoundingClientRect().top + window.scrollY : null;
  }
  const out = {
    window: [window.innerWidth, window.innerHeight],
    page_width: doc.scrollWidth,
    overflowing: wide,
    images: [...document.images].map(
      (i) => ({src: i.getAttribute("src"), drawn: i.complete && i.naturalWidth > 0})),
    tops: tops,
    text: document.body.innerText,
    prose: (() => {  // the text outside code: what should read as words and rendered math
      const copy = document.body.cloneNode(true);
      copy.querySelectorAll("code, pre, script, style").forEach((e) => e.remove());
      return copy.textContent;
    })(),
  };
  const pre = document.createElement("pre");
  pre.id = "__measured__";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>
"""


def measure(page: pathlib.Path, *, width: int = 1400, height: int = 900,
            selectors: tuple[str, ...] = ()) -> dict:
    """Render ``page`` (its folder's files reachable) at ``width`` x ``height`` CSS pixels.

    Returns ``window``, ``page_width`` (the document's scroll width: wider than the window
    means the page scrolls sideways), ``overflowing`` (elements whose right edge leaves the
    window outside any scrolling box), ``images`` (``drawn``: loaded with a size), ``tops``
    (each selector's distance from the page top, None if absent), the page's ``text`` and its
    ``prose`` (the text outside code elements).
    """
    if CHROMIUM is None:
        raise RuntimeError("chromium is not installed: bash scripts/setup.sh installs it "
                           "(apt-get install chromium)")
    html = page.read_text()
    inject = f"<script>window.__MEASURE_SELECTORS__ = {json.dumps(list(selectors))};</script>"
    body_end = html.lower().rfind("</body>")
    html = (html[:body_end] + inject + MEASURE + html[body_end:]) if body_end >= 0 else (
        html + inject + MEASURE)
    copy = page.with_name(f".measured-{page.name}")
    copy.write_text(html)
    try:
        with tempfile.TemporaryDirectory() as profile:
            run = run_alive([
                CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                f"--user-data-dir={profile}", f"--window-size={width},{height}",
                "--allow-file-access-from-files", "--virtual-time-budget=10000",
                "--dump-dom", copy.resolve().as_uri(),
            ])
    finally:
        copy.unlink()
    found = re.search(r'<pre id="__measured__">(.*?)</pre>', run.stdout, re.S)
    if found is None:
        raise RuntimeError(f"chromium printed no measurement: {run.stderr[-2000:]}")
    text = found[1].replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", '"')
    return json.loads(text.replace("&amp;", "&"))
