"""mkdocs hook: the CLI reference page is generated from ``loopprobe.cli.build_parser()``.

``docs/reference/cli.md`` holds the marker ``<!-- loopprobe-cli -->``; at build time it is
replaced by one section per subcommand holding exactly what ``loopprobe <cmd> --help``
prints (at a fixed width of 100 columns), so the page cannot drift from the parser.
"""

from __future__ import annotations

import argparse
import contextlib
import os

MARKER = "<!-- loopprobe-cli -->"
WIDTH = "100"


@contextlib.contextmanager
def _columns(width: str):
    """argparse wraps help at $COLUMNS; fix it so the page does not depend on the terminal."""
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = width
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """``{name: parser}`` of every subcommand, in the order ``loopprobe --help`` lists them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def help_texts() -> dict[str, str]:
    """``{"": loopprobe --help, name: loopprobe name --help}`` from the one parser."""
    from loopprobe.cli import build_parser

    with _columns(WIDTH):
        parser = build_parser()
        out = {"": parser.format_help()}
        out.update({name: sub.format_help() for name, sub in subcommands(parser).items()})
    return out


def render() -> str:
    """The markdown that replaces the marker: the top-level help, then one section each."""
    texts = help_texts()
    parts = ["## `loopprobe`", "", "```text", texts.pop("").rstrip(), "```", ""]
    for name, text in texts.items():
        parts += [f"## `loopprobe {name}`", "", "```text", text.rstrip(), "```", ""]
    return "\n".join(parts)


def on_page_markdown(markdown, page, config, files, **kwargs):
    if page.file.src_uri == "reference/cli.md":
        if MARKER not in markdown:
            raise ValueError(f"docs/reference/cli.md lost its marker {MARKER}")
        return markdown.replace(MARKER, render())
    return markdown
