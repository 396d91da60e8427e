"""Where a newcomer starts: the docs' sidebar puts the health check right after getting started."""

from __future__ import annotations

import pathlib

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _pages(nav: list) -> list[str]:
    """The nav's pages in sidebar order (sections flattened)."""
    out = []
    for item in nav:
        for value in item.values() if isinstance(item, dict) else [item]:
            out += _pages(value) if isinstance(value, list) else [value]
    return out


def test_the_health_check_guide_comes_right_after_getting_started():
    text = (ROOT / "mkdocs.yml").read_text()
    nav = yaml.safe_load(text[text.index("\nnav:") :])["nav"]
    pages = _pages(nav)
    assert pages.index("guides/health.md") == pages.index("getting-started.md") + 1
    assert pages.count("guides/health.md") == 1
