"""Issue 39.5: the finite-step statistics per trained model and the interval over models."""

from __future__ import annotations

import math

import pandas as pd
import pytest
from scipy import stats

from loopprobe.estimate.finitestep_summary import summarize
from studies.finite_step import per_model as pm


def test_per_model_is_each_seeds_own_summary_and_a_copied_model_matches_its_original():
    cells = pd.read_csv(pm.CELLS)
    cells = cells[cells["transition"] == pm.PRIMARY]
    copy = cells[cells["seed"] == 1].assign(seed=9)
    t = pm.per_model(pd.concat([cells, copy])).set_index("seed")
    own = summarize(cells[cells["seed"] == 2])
    assert t.loc[2, "spearman_AQ"] == pytest.approx(own["spearman_AQ"], abs=1e-12)
    assert t.loc[9].equals(t.loc[1]) and len(t) == 4
    with pytest.raises(ValueError, match="no cells at transition '9->10'"):
        pm.per_model(cells, "9->10")


def test_over_models_is_a_t_interval_over_models_with_the_prestated_directions():
    models = pd.DataFrame({"recovery_quarter": [0.9, 0.8, 0.85, 0.95],
                           "sign_acc_AQ": [0.90, 0.91, 0.92, 0.93],
                           "spearman_AQ": [0.995, 0.997, 0.996, 0.998],
                           "spearman_generic_max": [0.5, 0.1, 0.2, 0.3],
                           "n_finite_step": [10, 10, 10, 10]})  # fmt: skip
    t = pm.over_models(models).set_index("criterion")
    v = models["recovery_quarter"]
    h = stats.t.ppf(0.975, 3) * v.std(ddof=1) / math.sqrt(4)
    h1 = t.loc["H1 quarter step recovers >= 72%"]
    assert (h1["lo"], h1["hi"]) == pytest.approx((v.mean() - h, v.mean() + h))
    assert h1["verdict"] == "holds"
    assert t.loc["H2 sign(A+Q) accuracy >= 97%", "verdict"] == "fails"
    assert t.loc["H3 Spearman(A+Q, dU) >= 0.99", "verdict"] == "holds"
    assert t.loc["H4 generic |Spearman| <= 0.29", "verdict"] == "undecided"
    few = pm.over_models(models.assign(n_finite_step=[10, 10, 10, 4])).set_index("criterion")
    assert few.loc["H1 quarter step recovers >= 72%", "models"] == 3  # the 4-failure model out
    assert few.loc["H2 sign(A+Q) accuracy >= 97%", "models"] == 4
    low = pm.over_models(models.assign(spearman_generic_max=[0.10, 0.12, 0.11, 0.13]))
    assert low.set_index("criterion").loc["H4 generic |Spearman| <= 0.29", "verdict"] == "holds"


def test_power_over_models_grows_with_models_and_is_about_the_level_at_no_gap():
    assert pm.power_over_models(0.1, 0.1, 3) < pm.power_over_models(0.1, 0.1, 10) < 1
    assert pm.power_over_models(0.1, 0.0, 10) == pytest.approx(0.025, abs=1e-9)
    assert math.isnan(pm.power_over_models(0.0, 0.1, 10))
