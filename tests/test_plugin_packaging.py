"""Issue 26, items 1 and 6: the pytest plugin costs an unrelated project nothing (it loads
no torch, pandas, numpy or hypothesis) and still gives its profile and fixtures to the tests
that use loopprobe.testing; the core runs without matplotlib and seaborn (the ``plots``
extra), lp.plots says how to get them; the wheel ships the MIT license."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import tomllib

import loopprobe

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(loopprobe.__file__).parent
HEAVY = ("torch", "pandas", "numpy", "hypothesis")


def _pytest(project: Path, *args: str) -> subprocess.CompletedProcess:
    """pytest in ``project`` as a user runs it: the plugin loaded by its entry point (named
    with ``-p`` only while the entry point is not installed), nothing of this repo's tests."""
    eps = importlib.metadata.entry_points(group="pytest11")
    installed = any(ep.value == "loopprobe.testing.plugin" for ep in eps)
    plugin = [] if installed else ["-p", "loopprobe.testing.plugin"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HYPOTHESIS"))}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "pytest", *plugin, "-p", "no:cacheprovider", "-q", "-s", *args]
    return subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=300)


def test_pytest_in_an_unrelated_project_loads_no_torch_pandas_numpy_or_hypothesis(tmp_path):
    (tmp_path / "test_unrelated.py").write_text(
        textwrap.dedent(
            f"""
            import sys

            def test_nothing_heavy_was_imported():
                print("HEAVY", [m for m in {HEAVY!r} if m in sys.modules])
            """
        )
    )
    out = _pytest(tmp_path, "--loopprobe-profile=ci", "test_unrelated.py")  # the plugin's option
    assert "1 passed" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    assert "HEAVY []" in out.stdout


USER_TESTS = {
    "test_lp_props.py": """
        import torch
        from hypothesis import given, settings, strategies as st
        import loopprobe.testing as lpt

        torch.set_num_threads(2)  # the caller's count, which lp_one_thread must put back

        @given(st.integers())
        def test_profile(n):
            print("CALL profile")

        @settings(max_examples=3)
        @given(st.integers())
        def test_own_settings(n):
            print("CALL own")

        class TestInAClass:
            @given(st.integers())
            def test_method(self, n):
                print("CALL method")

        def test_one_thread_inside(lp_one_thread):
            assert torch.get_num_threads() == 1

        def test_threads_put_back_after():
            assert torch.get_num_threads() == 2

        def test_unchanged_block_passes(lp_unchanged):
            m = torch.nn.Linear(2, 2)
            with lp_unchanged(m):
                m(torch.ones(1, 2)).sum()

        def test_changed_block_fails(lp_unchanged):
            m = torch.nn.Linear(2, 2)
            with lp_unchanged(m):
                m.weight.data.add_(1.0)
        """,
    "test_other_props.py": """
        from hypothesis import given, strategies as st

        @given(st.integers())
        def test_other(n):
            print("CALL other")
        """,
}


def _calls(project: Path, profile: str) -> tuple[dict[str, int], str]:
    out = _pytest(project, f"--loopprobe-profile={profile}", *USER_TESTS)
    text = out.stdout + out.stderr
    return {k: text.count(f"CALL {k}\n") for k in ("profile", "own", "method", "other")}, text


def test_the_profile_reaches_only_loopprobe_property_tests_without_own_settings(tmp_path):
    for name, code in USER_TESTS.items():
        (tmp_path / name).write_text(textwrap.dedent(code))
    calls, text = _calls(tmp_path, "ci")
    assert "1 failed, 7 passed" in text, text[-3000:]
    assert "lp_unchanged: the model changed" in text and "test_changed_block_fails" in text
    # ci: 8 examples for the module that uses loopprobe.testing (a method too); the test
    # with its own settings and the other module keep theirs (hypothesis's default is 100)
    assert calls == {"profile": 8, "own": 3, "method": 8, "other": 100}, text[-3000:]
    calls, text = _calls(tmp_path, "thorough")
    assert calls == {"profile": 100, "own": 3, "method": 100, "other": 100}, text[-3000:]


NO_PLOTS = """
import sys
sys.modules["matplotlib"] = sys.modules["seaborn"] = None  # as if not installed
import torch
import loopprobe as lp

class Loop(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = torch.nn.Linear(4, 4)

    def forward(self, x):
        for _ in range(3):
            x = x + torch.tanh(self.block(x))
        return x

x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
rep = lp.visit_alignment(lp.attach(Loop()), x, lambda out, x: out.pow(2).mean())
print("KAPPA", rep.kappa, rep.converged, len(rep.to_frame()))
for stmt in ("lp.plots", "import loopprobe.plots.monitor"):
    try:
        exec(stmt)
    except ImportError as e:
        print("IMPORTERROR", e)
"""


def test_the_core_estimates_without_matplotlib_and_seaborn_and_lp_plots_names_the_extra():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", NO_PLOTS], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    kappa = re.search(r"KAPPA (\S+) True 3", out.stdout)
    assert kappa and 1.0 <= float(kappa.group(1)) <= 3.0, out.stdout  # 0 <= kappa_R <= R = 3
    errors = re.findall(r"IMPORTERROR (.*)", out.stdout)
    assert len(errors) == 2 and all("pip install 'loopprobe[plots]'" in e for e in errors), errors


def _eager_imports(tree: ast.Module) -> set[str]:
    """Modules (and ``from``-imported names) imported when a module is imported: its top
    level, ``if``/``try`` bodies included, functions and ``if TYPE_CHECKING:`` blocks not."""
    found, todo = set(), list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody
            todo += [s for h in node.handlers for s in h.body]
    return found


def test_the_import_reader_sees_eager_imports_and_skips_lazy_ones():
    code = "import a.b\nif x:\n    from c import d\nif TYPE_CHECKING:\n    import e\n"
    code += "try:\n    import f\nexcept ImportError:\n    import g\ndef h():\n    import i\n"
    assert _eager_imports(ast.parse(code)) == {"a.b", "c", "c.d", "f", "g"}


def _plotting(name: str) -> bool:
    return name.split(".")[0] in ("matplotlib", "seaborn") or name.startswith("loopprobe.plots")


def test_no_module_outside_lp_plots_imports_plotting_when_imported():
    eager = {
        str(p.relative_to(PACKAGE)): sorted(
            filter(_plotting, _eager_imports(ast.parse(p.read_text())))
        )
        for p in PACKAGE.rglob("*.py")
        if "plots" not in p.relative_to(PACKAGE).parts
    }
    assert {k: v for k, v in eager.items() if v} == {}


def test_matplotlib_and_seaborn_are_the_plots_extra_and_dev_and_notebooks_include_it():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=\[ ]", d)[0] for d in meta["dependencies"]}
    assert not {"matplotlib", "seaborn"} & names
    extras = meta["optional-dependencies"]
    assert {re.split(r"[<>= ]", d)[0] for d in extras["plots"]} == {"matplotlib", "seaborn"}
    assert "loopprobe[plots]" in extras["dev"] and "loopprobe[plots]" in extras["notebooks"]


def test_the_wheel_ships_the_mit_license_and_names_the_plots_extra(tmp_path):
    src = tmp_path / "src"  # a copy: the build writes build/ and *.egg-info next to the code
    src.mkdir()
    for name in ("pyproject.toml", "README.pypi.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(PACKAGE, src / "loopprobe", ignore=shutil.ignore_patterns("__pycache__"))
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    out = subprocess.run(
        [*cmd, "-w", str(tmp_path / "whl"), str(src)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp_path / "whl").glob("loopprobe-*.whl")
    with zipfile.ZipFile(wheel) as z:
        licenses = [n for n in z.namelist() if re.search(r"\.dist-info/licenses/LICENSE$", n)]
        assert len(licenses) == 1, z.namelist()
        assert z.read(licenses[0]).decode().startswith("MIT License")
        metadata = z.read(next(n for n in z.namelist() if n.endswith("METADATA"))).decode()
    assert "License-Expression: MIT" in metadata
    assert 'Requires-Dist: seaborn>=0.13; extra == "plots"' in metadata


def test_loopprobe_report_without_the_plots_extra_writes_the_page_data_and_one_note(tmp_path):
    out_dir = tmp_path / "r"
    code = (
        'import sys\nsys.modules["matplotlib"] = sys.modules["seaborn"] = None\n'
        "from loopprobe.cli import main\n"
        "sys.exit(main(['report', '--quick', '--no-progress', '--sections', 'theory,visits', "
        f"'--out', {str(out_dir)!r}]))\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    notes = [ln for ln in out.stdout.splitlines() if ln.startswith("note:")]
    assert len(notes) == 1 and "pip install 'loopprobe[plots]'" in notes[0]
    assert sorted(p.name for p in out_dir.iterdir()) == [
        "index.html", "results.json", "theory_bounds.csv", "visits_visits.csv",
    ]  # fmt: skip
    results = json.loads((out_dir / "results.json").read_text())
    assert results["failed"] == [] and "1 figure(s) not drawn" in results["figures_note"]
    (fig,) = results["sections"]["theory"]["figures"]
    assert fig["png"] is None and "lp.plots." in fig["replot"]
    page = (out_dir / "index.html").read_text()
    assert page.count("not drawn") == 1 and "<img" not in page and "figure failed" not in page
