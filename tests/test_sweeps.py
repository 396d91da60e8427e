"""Tests for loopprobe.sweeps: tidy frames, on-disk cache, resume, divergence as data."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import sys

import pandas as pd
import pytest
from thirdparty_models import TruncatedModel, make, randn

import loopprobe as lp
from loopprobe.sweeps import cell_key


def stored_cells(cache_dir) -> list:
    """The cell results joblib.Memory wrote under ``cache_dir``."""
    return sorted(cache_dir.rglob("output.pkl"))


class Counter:
    """A diagnostic that counts its calls: y = a * R, optionally failing on one config."""

    version = 1
    diverge_on = ("y",)

    def __init__(self, fail_on=None, nan_on=None, interrupt_after=None):
        self.calls = 0
        self.fail_on, self.nan_on, self.interrupt_after = fail_on, nan_on, interrupt_after

    def __call__(self, cfg):
        if self.interrupt_after is not None and self.calls >= self.interrupt_after:
            raise KeyboardInterrupt
        self.calls += 1
        if cfg.get("R") == self.fail_on:
            raise RuntimeError("loss exploded")
        y = math.nan if cfg.get("R") == self.nan_on else cfg["a"] * cfg["R"]
        return {"y": y}


def test_grid_is_the_cartesian_product_with_the_last_axis_fastest():
    g = lp.grid(a=[1, 2], R=[1, 2, 4])
    assert len(g) == 6
    assert g[0] == {"a": 1, "R": 1} and g[1] == {"a": 1, "R": 2} and g[3] == {"a": 2, "R": 1}


def test_grid_rejects_a_scalar_axis_and_says_how_to_write_it():
    with pytest.raises(TypeError, match=r"grid: axis R=4 .* write R=\[4\]"):
        lp.grid(R=4)


def test_sweep_returns_one_tidy_row_per_config_with_config_columns_first():
    df = lp.sweep(lp.grid(a=[1, 2], R=[1, 2]), Counter(), progress=False)
    assert list(df.columns) == ["a", "R", "y", "diverged", "error"]
    assert df["y"].tolist() == [1, 2, 2, 4]
    assert df["diverged"].dtype == bool and not df["diverged"].any()


def test_a_dataframe_result_becomes_several_rows_per_config():
    def per_visit(cfg):
        return pd.DataFrame({"visit": range(cfg["R"]), "norm": [1.0] * cfg["R"]})

    df = lp.sweep(lp.grid(R=[1, 3]), per_visit, progress=False)
    assert len(df) == 4
    assert df.groupby("R").size().to_dict() == {1: 1, 3: 3}


def test_second_run_reads_the_cache_and_does_not_call_the_diagnostic(tmp_path):
    diag = Counter()
    first = lp.sweep(lp.grid(a=[1, 2], R=[1, 2, 4]), diag, cache_dir=tmp_path, progress=False)
    assert diag.calls == 6
    again = Counter()
    second = lp.sweep(lp.grid(a=[1, 2], R=[1, 2, 4]), again, cache_dir=tmp_path, progress=False)
    assert again.calls == 0
    pd.testing.assert_frame_equal(first, second)
    assert len(stored_cells(tmp_path)) == 6


def test_cache_key_ignores_dict_order_but_not_values_or_version():
    assert cell_key({"a": 1, "R": 2}, "d") == cell_key({"R": 2, "a": 1}, "d")
    assert cell_key({"a": 1, "R": 2}, "d") != cell_key({"a": 1, "R": 4}, "d")
    assert cell_key({"a": 1}, "d", version=1) != cell_key({"a": 1}, "d", version=2)
    assert cell_key({"a": 1}, "d", code="f1") != cell_key({"a": 1}, "d", code="f2")
    assert len(cell_key({"a": 1}, "d")) == 20


def test_bumping_the_version_recomputes(tmp_path):
    diag = Counter()
    lp.sweep(lp.grid(a=[1], R=[1, 2]), diag, cache_dir=tmp_path, progress=False)
    lp.sweep(lp.grid(a=[1], R=[1, 2]), diag, cache_dir=tmp_path, progress=False, version=2)
    assert diag.calls == 4


def test_an_interrupted_sweep_resumes_with_only_the_unfinished_cells(tmp_path):
    cells = lp.grid(a=[1, 2], R=[1, 2, 4])
    broken = Counter(interrupt_after=4)
    with pytest.raises(KeyboardInterrupt):
        lp.sweep(cells, broken, cache_dir=tmp_path, progress=False, name="c")
    assert broken.calls == 4
    assert len(stored_cells(tmp_path)) == 4
    resumed = Counter()
    df = lp.sweep(cells, resumed, cache_dir=tmp_path, progress=False, name="c")
    assert resumed.calls == 2
    assert df["y"].tolist() == [1, 2, 4, 2, 4, 8]


def test_a_half_written_cache_file_is_recomputed(tmp_path):
    diag = Counter()
    lp.sweep(lp.grid(a=[1], R=[1]), diag, cache_dir=tmp_path, progress=False, name="c")
    (path,) = stored_cells(tmp_path)
    path.write_bytes(path.read_bytes()[:10])
    df = lp.sweep(lp.grid(a=[1], R=[1]), diag, cache_dir=tmp_path, progress=False, name="c")
    assert diag.calls == 2 and df["y"].tolist() == [1]


def test_a_nan_result_is_a_diverged_row_and_the_sweep_goes_on():
    df = lp.sweep(lp.grid(a=[1], R=[1, 2, 4]), Counter(nan_on=2), progress=False)
    assert df["diverged"].tolist() == [False, True, False]
    assert df.loc[1, "error"] == "non-finite values in y"
    assert df.loc[2, "y"] == 4


def test_a_raising_diagnostic_is_a_diverged_row_with_the_error_text_and_is_not_cached(tmp_path):
    diag = Counter(fail_on=2)
    df = lp.sweep(lp.grid(a=[1], R=[1, 2, 4]), diag, cache_dir=tmp_path, progress=False)
    assert df["diverged"].tolist() == [False, True, False]
    assert df.loc[1, "error"] == "RuntimeError: loss exploded"
    assert math.isnan(df.loc[1, "y"])
    assert len(stored_cells(tmp_path)) == 2
    lp.sweep(lp.grid(a=[1], R=[1, 2, 4]), diag, cache_dir=tmp_path, progress=False)
    assert diag.calls == 4  # only the failed cell ran again


def test_failed_cells_are_cached_when_asked_and_retry_failed_recomputes_them(tmp_path):
    diag, cells = Counter(fail_on=2), lp.grid(a=[1], R=[1, 2, 4])
    lp.sweep(cells, diag, cache_dir=tmp_path, progress=False, cache_failed=True)
    again = lp.sweep(cells, diag, cache_dir=tmp_path, progress=False, cache_failed=True)
    assert diag.calls == 3 and len(stored_cells(tmp_path)) == 3
    assert again.loc[1, "error"] == "RuntimeError: loss exploded"
    diag.fail_on = None
    fixed = lp.sweep(cells, diag, tmp_path, progress=False, cache_failed=True, retry_failed=True)
    assert diag.calls == 4 and fixed["y"].tolist() == [1, 2, 4]


@pytest.mark.parametrize("error", [TypeError, AttributeError, KeyError, NameError])
def test_a_programming_error_in_the_diagnostic_is_raised_not_recorded_as_divergence(error):
    def broken(cfg):
        raise error("a bug in the diagnostic")

    with pytest.raises(error, match="a bug in the diagnostic"):
        lp.sweep(lp.grid(R=[1, 2]), broken, progress=False)


def test_only_the_diverge_on_columns_mark_a_row_diverged_and_only_that_row():
    def per_visit(cfg):
        # U_norm NaN = undefined (a visit the loss does not see); loss NaN = a blow-up
        return [
            {"visit": 0, "U_norm": math.nan, "loss": 1.0},
            {"visit": 1, "U_norm": 2.0, "loss": math.nan if cfg["R"] == 2 else 1.0},
        ]

    plain = lp.sweep(lp.grid(R=[1, 2]), per_visit, progress=False)
    assert not plain["diverged"].any() and plain["error"].isna().all()
    marked = lp.sweep(lp.grid(R=[1, 2]), per_visit, progress=False, diverge_on="loss")
    assert marked["diverged"].tolist() == [False, False, False, True]
    assert marked["error"].iloc[3] == "non-finite values in loss"
    assert marked["error"].iloc[:3].isna().all()


def test_diverge_on_a_column_the_diagnostic_does_not_return_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"sweep: diverge_on names \['loss'\]"):
        lp.sweep(lp.grid(R=[1]), lambda c: {"y": 1.0}, progress=False, diverge_on=["loss"])
    with pytest.raises(TypeError, match="sweep: diverge_on must be a column name"):
        lp.sweep(lp.grid(R=[1]), lambda c: {"y": 1.0}, progress=False, diverge_on=3)


def test_a_healthy_truncated_model_alignment_with_documented_nans_is_not_diverged():
    def alignment(model):
        rep = lp.visit_alignment(lp.attach(model), x, lambda out, _: ((out - target) ** 2).sum())
        return rep.to_frame()

    x, target = randn(3, 6), randn(3, 6, seed=7)
    df = lp.sweep(
        [("truncated", lambda: make(TruncatedModel, C=3, C_L=2))], alignment, progress=False
    )
    assert len(df) == 9 and df["U_norm"].isna().sum() == 6  # the no_grad cycles' visits
    assert not df["diverged"].any()


def test_editing_the_diagnostic_source_invalidates_its_cached_cells(tmp_path, monkeypatch):
    module = tmp_path / "src" / "edited_diag.py"
    module.parent.mkdir()
    module.write_text("def diag(cfg):\n    return {'y': 1}\n")
    monkeypatch.syspath_prepend(str(module.parent))
    import edited_diag

    cache = tmp_path / "cache"
    assert lp.sweep(lp.grid(R=[1]), edited_diag.diag, cache, progress=False)["y"].item() == 1
    module.write_text("def diag(cfg):\n    return {'y': 2}\n")
    importlib.reload(edited_diag)
    try:
        df = lp.sweep(lp.grid(R=[1]), edited_diag.diag, cache, progress=False)
    finally:
        sys.modules.pop("edited_diag", None)
    assert df["y"].item() == 2


def test_a_diagnostic_may_report_its_own_divergence():
    df = lp.sweep(lp.grid(R=[1]), lambda c: {"y": math.nan, "diverged": False}, progress=False)
    assert df["diverged"].tolist() == [False]


@dataclasses.dataclass(frozen=True)
class Cfg:
    R: int
    norm: str = "deeploop"
    sizes: tuple = (1, 2)


def test_dataclass_configs_give_their_scalar_fields_as_columns(tmp_path):
    seen = []
    df = lp.sweep(
        [Cfg(R=1), Cfg(R=2)],
        lambda c: seen.append(c) or {"R2": c.R**2},
        cache_dir=tmp_path,
        progress=False,
        name="sq",
    )
    assert list(df.columns) == ["R", "norm", "R2", "diverged", "error"]
    assert seen == [Cfg(R=1), Cfg(R=2)]
    assert cell_key(Cfg(R=1), "d") != cell_key({"R": 1, "norm": "deeploop"}, "d")


def test_name_factory_pairs_pass_the_built_object_and_key_by_name(tmp_path):
    built = []

    def factory():
        built.append(1)
        return [1.0, 2.0, 3.0]

    df = lp.sweep(
        [("three", factory)],
        lambda xs: {"n": len(xs)},
        cache_dir=tmp_path,
        progress=False,
        name="len",
    )
    assert df.to_dict("records") == [{"config": "three", "n": 3, "diverged": False, "error": None}]
    lp.sweep(
        [("three", factory)],
        lambda xs: {"n": len(xs)},
        cache_dir=tmp_path,
        progress=False,
        name="len",
    )
    assert len(built) == 1


def test_a_mapping_of_diagnostics_adds_a_diagnostic_column():
    df = lp.sweep(
        lp.grid(a=[1], R=[2]),
        {"double": lambda c: {"y": 2 * c["R"]}, "square": lambda c: {"y": c["R"] ** 2}},
        progress=False,
    )
    assert df[["diagnostic", "y"]].values.tolist() == [["double", 4], ["square", 4]]


def test_partial_diagnostics_with_different_arguments_do_not_share_cache_cells(tmp_path):
    def scaled(cfg, k):
        return {"y": k * cfg["R"]}

    a = lp.sweep(lp.grid(R=[1]), functools.partial(scaled, k=2), tmp_path, progress=False)
    b = lp.sweep(lp.grid(R=[1]), functools.partial(scaled, k=3), tmp_path, progress=False)
    assert (a["y"].item(), b["y"].item()) == (2, 3)


def test_lambdas_cannot_key_a_cache_without_a_name(tmp_path):
    with pytest.raises(ValueError, match="sweep: cannot key the cache by a lambda"):
        lp.sweep(lp.grid(R=[1]), lambda c: {"y": 1}, cache_dir=tmp_path, progress=False)


def test_bad_grid_items_and_bad_return_values_are_type_errors_naming_the_fix():
    with pytest.raises(TypeError, match="sweep: each grid item must be a dict"):
        lp.sweep([3], Counter(), progress=False)
    with pytest.raises(TypeError, match="sweep: the diagnostic returned float"):
        lp.sweep(lp.grid(R=[1]), lambda c: 1.0, progress=False)


def test_an_unwritable_cache_dir_is_an_error_before_any_call(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    diag = Counter()
    with pytest.raises(ValueError, match="sweep: cache_dir=.* is not a writable directory"):
        lp.sweep(lp.grid(a=[1], R=[1]), diag, cache_dir=blocker / "sub", progress=False)
    assert diag.calls == 0
