"""Layering: no import circle inside the package; plotting stays out of ``import loopprobe``.

Imports are read with ``ast`` from every module of the package, those inside functions
(lazy imports) and under ``if TYPE_CHECKING:`` included: a lazy import still ties the two
modules together, in both directions, for a reader. An edge goes to the module named
(``from loopprobe import plots`` -> ``loopprobe.plots``; ``from loopprobe.x import f`` ->
``loopprobe.x``); the implicit import of parent packages is not an edge.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import loopprobe

PACKAGE = pathlib.Path(loopprobe.__file__).parent

# Circles that exist and are scheduled to go (one edge each); none since Probe's estimator
# methods moved to loopprobe/probe.py. The test fails when a listed edge no longer exists, so
# the list can only shrink with the code and cannot hide a new circle.
KNOWN_CIRCLE_EDGES: set[tuple[str, str]] = set()


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """Package modules that the module ``name`` imports anywhere in its source."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = name.split(".")
                anchor = anchor if is_pkg else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            named = [f"{base}.{a.name}" for a in node.names]
            targets = [t if t in known else base for t in named]
        else:
            continue
        out.update(t for t in targets if t in known and t != name)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_reader_sees_lazy_relative_and_type_checking_imports():
    graph = import_graph()
    assert "loopprobe.visits" in graph["loopprobe.roundmap"]  # lazy, inside replay_round
    assert "loopprobe.models.gpt" in graph["loopprobe.models"]  # from the package's __init__
    assert "loopprobe.plots" in graph["loopprobe.increments"]  # lazy, inside .plot()
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_package_has_no_import_circle_besides_the_listed_edges_scheduled_to_go():
    graph = import_graph()
    stale = sorted(e for e in KNOWN_CIRCLE_EDGES if e[1] not in graph[e[0]])
    assert not stale, f"edges gone from the code: remove them from KNOWN_CIRCLE_EDGES: {stale}"
    for a, b in KNOWN_CIRCLE_EDGES:
        graph[a].discard(b)
    assert circles(graph) == [], "import circle(s) inside loopprobe (lazy imports count)"


def loaded_after(code: str) -> set[str]:
    probe = f"import sys\n{code}\nprint(' '.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    return {m.split(".")[0] for m in out.split()}


def test_import_loopprobe_loads_neither_seaborn_nor_matplotlib():
    assert not {"seaborn", "matplotlib"} & loaded_after("import loopprobe")


def test_building_the_cli_parser_for_help_loads_neither_seaborn_nor_matplotlib():
    code = "from loopprobe.cli import build_parser\nbuild_parser()"
    assert not {"seaborn", "matplotlib"} & loaded_after(code)


def test_lp_plots_is_imported_on_first_use_and_then_is_the_plots_module():
    loaded = loaded_after("import loopprobe as lp\nassert lp.plots.kappa_vs_R")
    assert {"seaborn", "matplotlib", "loopprobe"} <= loaded
