"""Notices go to the ``loopprobe`` logger, warnings about your results stay ``warnings.warn``.

The library adds no handler but a ``NullHandler`` (the convention for libraries): notices
show once the application configures logging, and ``logging.getLogger("loopprobe").setLevel(
logging.ERROR)`` silences them as ``transformers.logging`` users silence transformers.
"""

from __future__ import annotations

import ast
import logging
import pathlib
import subprocess
import sys

import loopprobe

PACKAGE = pathlib.Path(loopprobe.__file__).parent

#: every ``warnings.warn`` of the package, by module, and why it is a warning, not a notice:
#: each concerns the numbers a user gets (or an API they call), so it must stay visible
#: (and an error under ``-W error``). A new call site needs a decision recorded here.
DECIDED_WARNINGS = {
    "loopprobe": 1,  # lp.<ResultType> moved to lp.results: DeprecationWarning, Python's way
    "loopprobe.integrations": 1,  # the trainer's optimizer has no per-visit rule: G is raw
    "loopprobe.distributed": 1,  # a torch.compile'd model: its eager module is what is measured
    "loopprobe.monitor.monitor": 2,  # a sink's / a diagnostic's failure: rows missing from the run
    "loopprobe.record.discover": 1,  # discovery fell back untracked: roles unknown (all 'body')
    "loopprobe.record.ties": 1,  # partly tied modules: a number covers only the shared part
}

#: where ``print`` is the output the user asked for (a command's tables), not a notice
PRINTING = ("loopprobe.cli",)

NOTICE = (  # the heat-map notice of a monitor sink without matplotlib, in a fresh process
    "import sys, logging; sys.modules['matplotlib'] = sys.modules['seaborn'] = None\n"
    "{setup}\n"
    "from loopprobe.monitor.sinks import heatmap_function\n"
    "class Sink:\n"
    "    heatmaps = ('G_norm',)\n"
    "sink = Sink()\n"
    "assert heatmap_function(sink) is None and sink.heatmaps == ()\n"
)


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def calls() -> list[tuple[str, str, ast.Call]]:
    """``(module, callee, node)`` for every call ``print(...)``, ``warnings.warn(...)`` and
    ``logging.getLogger(...)`` in the package's source."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if isinstance(f, ast.Name) and f.id == "print":
                out.append((module_name(path), "print", node))
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                callee = f"{f.value.id}.{f.attr}"
                if callee in ("warnings.warn", "logging.getLogger"):
                    out.append((module_name(path), callee, node))
    return out


def run(setup: str) -> subprocess.CompletedProcess:
    code = NOTICE.format(setup=setup)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_every_warning_of_the_package_is_one_decided_about_the_users_results():
    found: dict[str, int] = {}
    for module, callee, _ in calls():
        if callee == "warnings.warn":
            found[module] = found.get(module, 0) + 1
    assert found == DECIDED_WARNINGS


def test_nothing_outside_the_cli_prints_and_every_logger_is_under_loopprobe():
    printing = sorted({m for m, c, _ in calls() if c == "print" and not m.startswith(PRINTING)})
    assert printing == []
    names = [n.args[0] for _, c, n in calls() if c == "logging.getLogger"]
    assert names and all(isinstance(a, ast.Constant) for a in names)
    assert all(a.value == "loopprobe" or a.value.startswith("loopprobe.") for a in names)


def test_the_package_logger_has_only_a_null_handler_and_its_children_none():
    import loopprobe.monitor.sinks  # noqa: F401 - a module with a child logger

    handlers = logging.getLogger("loopprobe").handlers
    assert [type(h) for h in handlers] == [logging.NullHandler]
    children = [n for n in logging.root.manager.loggerDict if n.startswith("loopprobe.")]
    assert "loopprobe.monitor" in children
    assert all(not logging.getLogger(n).handlers for n in children)


def test_a_notice_shows_once_logging_is_configured_and_set_level_silences_it():
    shown = run("logging.basicConfig(level=logging.INFO)")
    assert shown.returncode == 0, shown.stderr
    assert "loopprobe.monitor" in shown.stderr and "heat maps skipped" in shown.stderr
    quiet = run(
        "logging.basicConfig(level=logging.INFO); "
        "logging.getLogger('loopprobe').setLevel(logging.ERROR)"
    )
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    unconfigured = run("")  # the NullHandler keeps Python's last-resort handler out
    assert unconfigured.returncode == 0 and unconfigured.stderr == "", unconfigured.stderr


def test_the_monitors_first_budget_skip_is_one_notice_that_set_level_silences(monkeypatch, caplog):
    from thirdparty_models import ForLoopModel, make, randn

    import loopprobe.monitor.monitor as monitor_module

    def watch() -> list[int]:
        now = [0.0]
        monkeypatch.setattr(monitor_module, "_clock", lambda: now[0])

        def costly(_metrics):  # a sink that takes 5 s of the monitor's time
            now[0] += 5.0

        model, x = make(ForLoopModel, K=1, R=2), randn(2, 5)
        loss = lambda out, _i: out.square().mean()  # noqa: E731
        mon = loopprobe.Monitor(
            model, x, loss, diagnostics=["updates"], every=1, budget=0.5, sinks=[costly]
        )
        for step in range(6):
            now[0] += 1.0  # a training step takes 1 s
            mon.step(step)
        return mon.skipped

    with caplog.at_level(logging.INFO, logger="loopprobe"):
        skipped = watch()
    notices = [r for r in caplog.records if "skipped to keep within budget" in r.getMessage()]
    assert skipped and len(notices) == 1 and notices[0].name == "loopprobe.monitor"
    assert f"step {skipped[0]} skipped" in notices[0].getMessage()
    caplog.clear()
    monkeypatch.setattr(logging.getLogger("loopprobe"), "level", logging.ERROR)  # a user's line
    with caplog.at_level(logging.DEBUG):  # the root handler would show any record
        assert watch() == skipped
    assert not [r for r in caplog.records if r.name.startswith("loopprobe")]
