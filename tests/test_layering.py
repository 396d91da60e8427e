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


def imported_by_name(node: ast.AST) -> str | None:
    """The module a call ``importlib.import_module("loopprobe.x")`` / ``import_module(...)`` /
    ``__import__(...)`` names by a literal string: an import all the same, for a reader too."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
        return None
    f = node.func
    called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
    arg = node.args[0].value
    if called in ("import_module", "__import__") and isinstance(arg, str):
        return arg
    return None


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
        elif dynamic := imported_by_name(node):  # importlib.import_module("loopprobe.x")
            targets = [dynamic]
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
    # lazy, inside replay_round
    assert "loopprobe.record.probe" in graph["loopprobe.differentiate.roundmap"]
    assert "loopprobe.models.gpt" in graph["loopprobe.models"]  # from the package's __init__
    assert "loopprobe.plots" in graph["loopprobe.estimate.increments"]  # lazy, inside .plot()
    hidden = ast.parse('import importlib\nm = importlib.import_module("loopprobe.tasks")')
    assert [imported_by_name(n) for n in ast.walk(hidden) if imported_by_name(n)] == [
        "loopprobe.tasks"
    ]
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


# The four layers, in order; a module may import its own layer and the ones before it.
# Modules outside them (autodiff, linalg, sweeps, theory, tasks, models, _checks, ...) are
# the ground every layer stands on and import no layer.
LAYERS = [
    "record",
    "differentiate",
    "estimate",
    "monitor",
    "experiments",
    "plots",
    "report",
    "testing",
    "integrations",
    "cli",
]


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def module_level_imports(path: pathlib.Path, known: set[str]) -> set[str]:
    """Package modules imported by statements run at import time (not inside functions)."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module:
            named = [f"{node.module}.{a.name}" for a in node.names]
            out.update(t if t in known else node.module for t in named)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {t for t in out if t in known}


def layer_violations(graph: dict[str, set[str]], mods: dict[str, pathlib.Path]) -> list:
    """Edges from a module to a later layer (a lazy import of the plots is allowed: a
    result's ``.plot()``), and from the ground to any layer."""
    bad = []
    for name, targets in graph.items():
        if name in ("loopprobe", "loopprobe.results"):
            continue  # the public surface (and its namespace of result types) names everything
        mine = layer_of(name)
        eager = module_level_imports(mods[name], set(mods))
        for t in targets:
            theirs = layer_of(t)
            if theirs is None:
                continue
            lazy_plot = LAYERS[theirs] == "plots" and t not in eager
            if (mine is None or theirs > mine) and not lazy_plot:
                bad.append((name, t))
    return sorted(bad)


def test_each_layer_imports_only_itself_and_the_layers_before_it():
    assert layer_violations(import_graph(), modules()) == []


def test_the_layer_check_catches_an_estimator_importing_an_experiment():
    assert layer_of("loopprobe.estimate.increments") < layer_of("loopprobe.experiments.growth")
    assert layer_of("loopprobe.autodiff") is None and layer_of("loopprobe.record.types") == 0


def test_import_loopprobe_loads_no_torch_until_a_name_is_used():
    assert "torch" not in loaded_after("import loopprobe")
    assert "torch" in loaded_after("import loopprobe as lp\nlp.attach")


def test_the_cli_help_lists_agree_with_the_modules_they_describe():
    import loopprobe.cli.phi_fit
    import loopprobe.cli.report
    from loopprobe import report
    from loopprobe.estimate import scaling_law

    assert loopprobe.cli.report.SECTION_KEYS == tuple(s.key for s in report.SECTIONS)
    assert loopprobe.cli.phi_fit.COLUMNS == scaling_law.COLUMNS
    import loopprobe.cli.watch
    from loopprobe.experiments import watch

    assert loopprobe.cli.watch.SCHEMES == tuple(watch.SCHEMES)


def test_building_the_cli_parser_loads_no_torch():
    assert "torch" not in loaded_after("from loopprobe.cli import build_parser\nbuild_parser()")
