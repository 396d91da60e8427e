"""The public surface (issue 28.4): lp. lists what you call, lp.results what they return."""

from __future__ import annotations

import inspect
import subprocess
import sys
import warnings

import pytest

import loopprobe as lp
from loopprobe import results


def test_the_top_level_lists_verbs_and_submodules_but_no_result_type():
    listed = set(lp.__all__) - {"__version__"}
    assert not listed & set(results.__all__)
    for name in listed:
        obj = getattr(lp, name)
        assert inspect.ismodule(obj) or callable(obj), name
    assert {"attach", "visit_alignment", "Monitor", "sweep", "results"} <= listed
    assert {"record", "differentiate", "estimate", "monitor"}.isdisjoint(listed)


@pytest.mark.parametrize("name", results.__all__)
def test_every_result_type_is_in_results_and_is_what_its_estimator_returns(name):
    cls = getattr(results, name)
    assert inspect.isclass(cls) and cls.__name__ == name
    assert name in dir(results)


def test_estimators_annotate_the_types_results_lists():
    hints = {
        lp.visit_alignment: "AlignmentReport",
        lp.per_visit_updates: "Updates",
        lp.spectral_radius: "SpectralRadius",
        lp.health: "Health",
    }
    for fn, name in hints.items():
        assert inspect.signature(fn).return_annotation in (name, getattr(results, name)), fn


def test_an_old_top_level_result_name_warns_and_is_the_same_class():
    with pytest.warns(DeprecationWarning, match="lp.results.AlignmentReport"):
        old = lp.AlignmentReport
    assert old is results.AlignmentReport
    assert "AlignmentReport" not in dir(lp)


@pytest.mark.parametrize("module", [lp, results], ids=["lp", "lp.results"])
def test_dir_shows_exactly_what_all_lists_also_after_names_were_loaded(module):
    _ = lp.visit_alignment, lp.record, results.AlignmentReport  # loaded names land in globals()
    assert dir(module) == sorted(module.__all__)
    assert not {"warnings", "importlib", "TYPE_CHECKING", "Any"} & set(dir(module))


def test_the_layer_packages_stay_importable_unlisted():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lp.record.__name__ == "loopprobe.record"
        assert lp.estimate.__name__ == "loopprobe.estimate"


def test_a_misspelled_name_raises_attribute_error():
    with pytest.raises(AttributeError, match="visit_alignmnt"):
        _ = lp.visit_alignmnt
    with pytest.raises(AttributeError, match="Alignment"):
        _ = results.Alignment


def test_importing_results_loads_no_torch():
    code = "import sys, loopprobe.results; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
