"""The package as an index lists it: classifiers (Framework :: Pytest, Typing :: Typed, the
Python version the suite runs on), authors and keywords in the built metadata; a long
description with no relative link (README.md's break on an index page); and what that
description points at (the docs site, the changelog, py.typed) inside the source archive."""

from __future__ import annotations

import email
import os
import re
import shutil
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["pyproject.toml", "MANIFEST.in", "README.pypi.md", "README.md", "LICENSE",
           "CHANGELOG.md", "mkdocs.yml", "loopprobe", "docs"]  # fmt: skip


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> tuple[email.message.Message, set[str]]:
    """The source archive built by setuptools from a copy of the tracked sources: its
    PKG-INFO (the metadata an index shows) and its file names."""
    from setuptools import build_meta

    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("dist")
    cwd = Path.cwd()
    try:
        os.chdir(src)
        name = build_meta.build_sdist(str(out))
    finally:
        os.chdir(cwd)
    with tarfile.open(out / name) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        info = tar.extractfile(f"{name[: -len('.tar.gz')]}/PKG-INFO").read().decode()
    return email.message_from_string(info), names


def test_the_metadata_has_classifiers_authors_and_keywords(sdist):
    meta, _ = sdist
    classifiers = meta.get_all("Classifier")
    for want in ("Framework :: Pytest", "Typing :: Typed", "Programming Language :: Python :: 3"):
        assert want in classifiers
    ours = f"Programming Language :: Python :: {sys.version_info.major}.{sys.version_info.minor}"
    assert ours in classifiers  # the version this suite runs on is listed
    assert meta["Author"] == "The loopprobe authors"
    assert "looped transformer" in meta["Keywords"].split(",")
    assert meta["Description-Content-Type"] == "text/markdown"


def test_the_long_description_has_no_relative_link_and_what_it_names_ships(sdist):
    meta, names = sdist
    text = meta.get_payload()
    assert "visit-alignment coefficient" in text  # the description is the short page
    links = re.findall(r"\]\(([^)]+)\)", text) + re.findall(r"<(\w+:[^>]+)>", text)
    assert all(re.match(r"https?://", u) for u in links), links  # an index resolves only these
    assert {"docs/index.md", "docs/definitions.md", "CHANGELOG.md", "loopprobe/py.typed"} <= names
    assert not [n for n in names if "__pycache__" in n]


def test_the_readme_for_the_repository_keeps_its_relative_links_and_is_not_the_description(sdist):
    meta, _ = sdist
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"\]\(docs/", readme)  # fine on the repository, broken on an index
    assert "](docs/" not in meta.get_payload()


def test_the_declared_floors_are_the_ones_the_floor_script_tests(sdist):
    meta, _ = sdist
    floors = dict(
        re.match(r"([A-Za-z]+)>=([\d.]+)$", d).groups()
        for d in meta.get_all("Requires-Dist")
        if re.match(r"(torch|numpy|scipy|pandas)>=", d)
    )
    script = (ROOT / "scripts" / "test_floors.sh").read_text()
    for name in ("numpy", "scipy", "pandas"):
        pinned = re.search(rf'"{name}==([\d.]+)"', script).group(1)
        assert pinned.startswith(floors[name]), (name, pinned, floors[name])
    import torch

    assert torch.__version__.startswith(floors["torch"])  # the torch the suite runs on
