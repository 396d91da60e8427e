"""loopprobe.testing's hypothesis strategies shrink a planted failure to its smallest
configuration; the pytest plugin runs the issue's example; the package imports without
pytest or hypothesis; pyproject registers the plugin and the `testing` extra."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tomllib
import torch
from _testing_family import batch, loop, loss
from hypothesis import given

import loopprobe.testing as lpt

ROOT = Path(__file__).resolve().parents[1]


def bypass_from_R5_K2(R: int, K: int, d: int):
    """A planted bug that appears only from R = 5 with K >= 2: the smallest failing
    configuration is R=5, K=2, d=4 (d and the batch do not matter)."""
    return loop(R=R, K=K, d=d, bug="bypass" if R >= 5 and K >= 2 else "")


def test_a_planted_failure_is_shrunk_to_its_smallest_configuration():
    seen = []

    @lpt.settings("ci", max_examples=30)
    @given(
        cfg=lpt.configs(bypass_from_R5_K2, batch=batch, loss=loss, R=(2, 8), K=(1, 3), d=(4, 12))
    )
    def prop(cfg):
        seen.append(cfg)
        lpt.check_updates_sum_to_tied_gradient(cfg.model, cfg.batch, cfg.loss)

    with pytest.raises(AssertionError, match="do not sum to its tied gradient"):
        prop()
    assert repr(seen[-1]) == "Config(K=2, R=5, d=4, batch_seed=0)"  # the replayed minimum
    assert any(c.params["R"] > 5 or c.params["d"] > 4 for c in seen)  # it started larger


def test_a_drawn_model_is_rebuilt_at_other_R_with_its_other_settings_and_batch():
    cfg = lpt.configs(loop, batch=batch, loss=loss, R=(3, 3), K=(2, 2), d=[8]).example()
    m, x = cfg.rebuild(5)
    assert m.cfg.R == 5 and m.cfg.K == 2 and x.shape == cfg.batch.shape
    assert (cfg.rebuild(3)[1] == cfg.batch).all()
    sweep = lpt.check_bound_slope(cfg.model, cfg.batch, cfg.loss, max_slope=0.15, Rs=(2, 4))
    assert list(sweep.frame.R) == [2, 4]


def test_bad_ranges_and_a_factory_that_returns_no_module_are_clear_errors():
    with pytest.raises(ValueError, match=r"configs: R=\(1, 'a'\); a range is \(low, high\)"):
        lpt.configs(loop, R=(1, "a"))
    with pytest.raises(TypeError, match="configs: the factory returned a int"):
        lpt.configs(lambda R: R, batch=batch, R=(2, 3)).example()
    with pytest.raises(ValueError, match="settings: profile='fast'"):
        lpt.settings("fast")


def _plugin() -> list[str]:
    """``-p loopprobe.testing.plugin`` unless the installed entry point already loads it
    (naming it twice would register it twice)."""
    eps = importlib.metadata.entry_points(group="pytest11")
    installed = any(ep.value == "loopprobe.testing.plugin" for ep in eps)
    return [] if installed else ["-p", "loopprobe.testing.plugin"]


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")  # as tests/conftest.py
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_the_plugin_runs_a_users_property_tests_and_reports_a_shrunk_explained_failure(tmp_path):
    (tmp_path / "test_user.py").write_text(
        textwrap.dedent(
            """
            from hypothesis import given
            import loopprobe.testing as lpt
            from _testing_family import batch, loop, loss

            from test_testing_strategies import bypass_from_R5_K2

            @given(cfg=lpt.configs(loop, batch=batch, loss=loss, R=(2, 4), K=(1, 2)))
            def test_a_small_step_moves_my_loop_to_first_order(cfg, lp_unchanged, lp_one_thread):
                with lp_unchanged(cfg.model):
                    lpt.check_first_order_change(cfg.model, cfg.batch, cfg.loss)

            @given(cfg=lpt.configs(bypass_from_R5_K2, batch=batch, R=(2, 8), K=(1, 3), d=(4, 9)))
            def test_my_broken_loop(cfg):
                lpt.check_updates_sum_to_tied_gradient(cfg.model, cfg.batch, cfg.loss)
            """
        )
    )
    args = ["-m", "pytest", *_plugin(), "-q", "-p", "no:cacheprovider"]
    out = _run([*args, "--loopprobe-profile=ci", "test_user.py"], tmp_path)
    text = out.stdout + out.stderr
    assert "1 failed, 1 passed" in text, text[-3000:]
    assert "Failing test case" in text and "Config(K=2, R=5, d=4, batch_seed=0)" in text
    assert "check_updates_sum_to_tied_gradient: sublayer 'blocks.0'" in text
    assert "DeadlineExceeded" not in text  # the plugin's profile turned the deadline off


def test_the_checks_import_and_run_without_pytest_or_hypothesis(tmp_path):
    code = textwrap.dedent(
        """
        import sys
        sys.modules["pytest"] = sys.modules["hypothesis"] = None  # as if not installed
        import torch
        import loopprobe.testing as lpt
        from _testing_family import batch, loop, loss
        m = loop(R=3)
        lpt.check_updates_sum_to_tied_gradient(m, batch(m, torch.Generator()), loss)
        try:
            lpt.configs
        except ImportError as e:
            print("ImportError:", e)
        """
    )
    out = _run(["-c", code], tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "configs needs hypothesis: pip install 'loopprobe[testing]'" in out.stdout


def test_pyproject_registers_the_plugin_and_the_testing_extra():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["entry-points"]["pytest11"] == {"loopprobe": "loopprobe.testing.plugin"}
    extra = meta["optional-dependencies"]["testing"]
    assert {e.split(">")[0] for e in extra} == {"pytest", "hypothesis"}


def test_float_ranges_are_log_uniform_within_bounds_and_lists_offer_their_choices():
    from hypothesis import find

    seen = []

    def factory(init_scale, dtype):
        seen.append((init_scale, dtype))
        return loop(R=2, d=4).to(dtype)

    strategy = lpt.configs(
        factory, batch=batch, init_scale=(0.5, 2.0), dtype=[torch.float64, torch.float32]
    )
    big = find(strategy, lambda c: c.params["init_scale"] > 1.5)  # shrinks toward the low end
    assert 1.5 < big.params["init_scale"] <= 2.0 and big.params["dtype"] == torch.float64
    assert all(0.5 <= s <= 2.0 for s, _ in seen) and {d for _, d in seen} == {
        torch.float64,
        torch.float32,
    }
