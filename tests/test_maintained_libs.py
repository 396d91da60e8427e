"""Issue 26.9: where a maintained library replaced hand-written code (threadpoolctl for the BLAS
threads, Jinja2 for index.html), a test of the bug the library avoids; where the hand
version stays (the seed bootstrap, the free memory, the ``pkg.mod:fn`` loader), a test of
the reason it stays."""

from __future__ import annotations

import fnmatch
import html
import math
import pathlib
import sys
import textwrap

import numpy as np
import pandas as pd
import pytest
import scipy.linalg  # noqa: F401 - loads scipy's BLAS, so there is one to limit
import torch

from loopprobe import _memory
from loopprobe._io import load_object
from loopprobe._threads import blas_threads
from loopprobe.report.render import render_html
from studies.optimum import drift_interval, seed_matrix, vertex

threadpoolctl = pytest.importorskip("threadpoolctl")
ROOT = pathlib.Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------- BLAS threads


def blas_counts() -> list[int]:
    return [i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]


@pytest.fixture
def two_blas_threads():
    """The caller's own setting: every BLAS at 2 threads (restored after the test)."""
    if not blas_counts():
        pytest.skip("no BLAS library that threadpoolctl can control is loaded")
    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
        assert set(blas_counts()) == {2}
        yield


def test_blas_threads_sets_every_loaded_blas_and_puts_the_callers_count_back(two_blas_threads):
    with blas_threads(1) as n:
        assert n == 1 and set(blas_counts()) == {1}
    assert set(blas_counts()) == {2}
    with pytest.raises(KeyError), blas_threads(1):
        assert set(blas_counts()) == {1}
        raise KeyError("inside")
    assert set(blas_counts()) == {2}


def test_blas_threads_leaves_torchs_intra_op_threads_alone(two_blas_threads):
    before = torch.get_num_threads()
    with blas_threads(1):
        assert torch.get_num_threads() == before


def test_blas_threads_limits_the_blas_where_proc_self_maps_cannot_be_read(
    two_blas_threads, monkeypatch
):
    # the hand version found OpenBLAS through /proc/self/maps only (Linux with procfs): on
    # macOS, Windows or a sandbox without /proc it did nothing and L-BFGS-B ran ~25x slower
    if sys.platform != "linux":
        pytest.skip("simulates a platform without procfs on Linux")
    real_open = open

    def no_procfs(path, *args, **kwargs):
        if str(path).startswith("/proc/self/maps"):
            raise PermissionError(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", no_procfs)
    monkeypatch.setattr(threadpoolctl, "_HAS_PROCFS", False)  # as on a system without /proc
    with blas_threads(1):
        assert set(blas_counts()) == {1}


@pytest.mark.parametrize("bad", [0, -2, 1.0, True, "1"])
def test_blas_threads_rejects_a_count_that_is_not_a_positive_integer(bad):
    with pytest.raises(ValueError, match=r"blas_threads: n=.*integer >= 1"), blas_threads(bad):
        pass


# --------------------------------------------------------------------------- index.html

EVIL = "blocks.0.<script>alert('x')</script>"


def report_results(out: pathlib.Path, name: str) -> dict:
    """A results.json with ``name`` in every place a sublayer or user string can appear."""
    frame = pd.DataFrame({"sublayer": [name, "mlp"], "kappa": [1.5, math.nan]})
    frame.to_csv(out / "alignment_kappa.csv", index=False)
    ok = {
        "title": "Alignment", "question": "Do the visits align?", "status": "ok",
        "runtime_s": 2.4, "csv": {"kappa": "alignment_kappa.csv"},
        "tables": [{"caption": f"kappa of {name}", "csv": "alignment_kappa.csv"}],
        "figures": [
            {"png": "a.png", "caption": f"kappa of {name}", "csv": "alignment_kappa.csv",
             "recompute": f"loopprobe kappa --sublayer '{name}'", "replot": "lp.plots.kappa(df)"},
            {"png": None, "caption": "c", "error": f"ValueError: no sublayer {name}"},
        ],
        "values": {}, "notes": [f"{name} is visited 4 times"],
    }  # fmt: skip
    failed = {"title": "Growth", "question": "q", "status": "failed", "runtime_s": 0.1,
              "reason": f"ValueError: {name}: shapes"}  # fmt: skip
    verdict = {"verdict": "holds", "claim": f"kappa of {name}", "measured": "1.5",
               "expected": "<= R", "why": f"from {name}", "section": "alignment"}  # fmt: skip
    return {
        "loopprobe_version": "0", "command": f"loopprobe report --model '{name}'",
        "created": "2025-01-01T00:00:00", "runtime_s": 3.0, "model": f"m:make {name}",
        "out": str(out), "config": {}, "sections": {"alignment": ok, "growth": failed},
        "verdicts": [verdict], "failed": ["growth"], "skipped": [],
    }  # fmt: skip


def test_a_sublayer_name_with_a_script_tag_is_escaped_everywhere_in_index_html(tmp_path):
    page = render_html(report_results(tmp_path, EVIL), tmp_path)
    assert "<script>" not in page
    # model, command, table cell, caption x3, recompute, figure error, note, reason, verdict x3
    # (the folded verdict line: its summary, the claim again in its details, and its why)
    assert page.count("&lt;script&gt;") == 13
    assert "alt='kappa of blocks.0.&lt;script&gt;alert(&#39;x&#39;)" in page  # quotes too


def test_index_html_shows_every_string_of_results_json_once_unescaped(tmp_path):
    results = report_results(tmp_path, "blocks.0.attn")
    text = html.unescape(render_html(results, tmp_path))
    for s in ("m:make blocks.0.attn", "blocks.0.attn is visited 4 times", "kappa of blocks.0.attn",
              "ValueError: blocks.0.attn: shapes", "1 section(s) raised an error</b>: growth",
              "from blocks.0.attn", "loopprobe kappa --sublayer 'blocks.0.attn'",
              "figure failed: ValueError: no sublayer blocks.0.attn", "· 2 s</p>"):  # fmt: skip
        assert s in text
    assert "<h2 id='alignment'>Alignment</h2>" in text and "<img src='a.png'" in text


def test_a_results_entry_missing_a_key_raises_instead_of_rendering_an_empty_string(tmp_path):
    results = report_results(tmp_path, "attn")
    del results["sections"]["growth"]["reason"]
    with pytest.raises(Exception, match="reason"):
        render_html(results, tmp_path)


def test_the_wheel_ships_the_html_template():
    tomllib = pytest.importorskip("tomllib")
    template = ROOT / "loopprobe" / "report" / "templates" / "index.html"
    assert template.is_file()
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    globs = data.get("package-data", {}).get("loopprobe", [])
    rel = template.relative_to(ROOT / "loopprobe").as_posix()
    assert any(fnmatch.fnmatch(rel, g) for g in globs), f"package-data {globs} misses {rel}"


# --------------------------------------------------------------------------- seed bootstrap

GRID = [1e-3 * 2**k for k in range(7)]


def planted(opt: dict, seeds, noise: float, far_seeds=()) -> pd.DataFrame:
    """arm, N, lr, seed, loss: a parabola in log2 lr per seed; ``far_seeds`` at N = 8 have a
    flat one with its optimum far left of the grid (a resample heavy in them has no vertex)."""
    rng = np.random.default_rng(0)
    rows = []
    for (arm, N), o in opt.items():
        for s in seeds:
            a, o_s = (0.005, -30.0) if (N == 8 and s in far_seeds) else (0.05, o)
            for lr in GRID:
                loss = a * (math.log2(lr) - o_s) ** 2 + 0.5 * s + noise * rng.normal()
                rows.append({"arm": arm, "N": N, "lr": lr, "seed": s, "loss": loss})
    return pd.DataFrame(rows)


def scipy_drift_interval(df: pd.DataFrame, n_boot: int, seed: int):
    """The same paired percentile bootstrap through ``scipy.stats.bootstrap``."""
    from scipy import stats

    seeds = sorted(df["seed"].unique())
    curves = {N: seed_matrix(df[df["N"] == N], seeds) for N in (1, 8)}

    def drift(i, axis=-1):
        v = {}
        for N, (x, m) in curves.items():
            v[N] = np.array([vertex(x, row) for row in np.nanmean(m[np.atleast_2d(i)], axis=1)])
        return v[8] - v[1]

    return stats.bootstrap((np.arange(len(seeds)),), drift, paired=True, vectorized=True,
                           n_resamples=n_boot, method="percentile",
                           rng=np.random.default_rng(seed))  # fmt: skip


def test_the_seed_bootstrap_draws_scipys_resamples_and_gives_its_percentile_interval():
    df = planted({("a", 1): -6.0, ("a", 8): -7.0}, seeds=range(6), noise=0.02)
    t = drift_interval(df, "arm", n_boot=300, seed=3).iloc[0]
    assert t["boot_valid"] == 1.0  # every resample has a vertex: the case scipy can do
    ci = scipy_drift_interval(df, 300, seed=3).confidence_interval
    assert t["ci_low"] == pytest.approx(ci.low, abs=1e-12)
    assert t["ci_high"] == pytest.approx(ci.high, abs=1e-12)


def test_a_resample_without_a_vertex_is_left_out_and_counted_where_scipy_gives_nan():
    df = planted({("a", 1): -6.0, ("a", 8): -7.0}, seeds=range(5), noise=0.0, far_seeds=(0,))
    t = drift_interval(df, "arm", n_boot=400).iloc[0]
    assert 0.9 < t["boot_valid"] < 1.0  # 5 % of the resamples have no vertex
    assert np.isfinite(t["ci_low"]) and np.isfinite(t["ci_high"])
    with pytest.warns(Warning):  # scipy's DegenerateDataWarning
        ci = scipy_drift_interval(df, 400, seed=0).confidence_interval
    assert math.isnan(ci.low) and math.isnan(ci.high)


# --------------------------------------------------------------------------- free memory


def test_free_cpu_memory_is_psutils_where_no_cgroup_limit_applies():
    psutil = pytest.importorskip("psutil")
    if not sys.platform.startswith("linux") or _memory._cgroup_room() is not None:
        pytest.skip("Linux without a cgroup memory limit: MemAvailable on both sides")
    ours, theirs = _memory.available_bytes("cpu"), psutil.virtual_memory().available
    assert ours == pytest.approx(theirs, rel=0.05)  # two reads of a moving number


def test_a_cgroup_limit_lowers_the_free_memory_below_what_psutil_reports(monkeypatch):
    psutil = pytest.importorskip("psutil")
    if not sys.platform.startswith("linux"):
        pytest.skip("cgroups are Linux")
    room = 64 * 2**20
    monkeypatch.setattr(_memory, "_cgroup_room", lambda *a: room)  # a container with 64 MiB left
    assert _memory.available_bytes("cpu") == room < psutil.virtual_memory().available


# --------------------------------------------------------------------------- pkg.mod:fn


def test_a_user_module_raising_attribute_error_on_import_is_an_import_failure(
    tmp_path, monkeypatch
):
    # pkgutil.resolve_name imports and looks up in one call: the AttributeError of a broken
    # import reads like the attribute missing; load_object keeps the two steps apart
    (tmp_path / "lp_broken_import.py").write_text(
        textwrap.dedent("""
        import os
        x = os.no_such_name

        def make():
            return None
    """)
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "lp_broken_import", raising=False)
    with pytest.raises(ValueError) as err:
        load_object("lp_broken_import:make")
    assert "importing 'lp_broken_import' raised AttributeError" in str(err.value)
    assert "has no attribute 'make'" not in str(err.value)


def test_a_spec_without_a_colon_is_refused_where_pkgutil_would_resolve_a_module():
    import pkgutil

    assert pkgutil.resolve_name("os.path") is sys.modules["os.path"]
    with pytest.raises(ValueError, match=r"--model 'os.path' must look like package.module:"):
        load_object("os.path")
