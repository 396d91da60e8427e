"""lp.scaling: the iso-depth joint law fit (seed 001, arXiv 2604.21106) and ``phi-fit``.

The recovery on the paper's full grid with its CI and the wrong variants live in
proofs_check/recurrence_fit.py; here: the gradient, exact recovery, restart-seed
independence, the default-tolerance trap, input errors, the visit-table parameter split
and the command line.
"""

import json
import pathlib

import numpy as np
import pandas as pd
import pytest
import torch

from loopprobe.cli import main
from loopprobe.estimate import scaling as sc
from loopprobe.estimate import scaling_law as sl
from loopprobe.experiments import scaling_grid as sg
from loopprobe.models import GPTConfig, LoopedGPT


@pytest.fixture(scope="module")
def exact():
    return sg.synthetic_runs(noise=0.0)


@pytest.fixture(scope="module")
def noisy():
    return sg.synthetic_runs(noise=0.010, cell_noise=0.003, seed=5)


@pytest.mark.parametrize("target", ["log", "raw"])
def test_analytic_gradient_matches_central_differences(noisy, target):
    X = sl._design(noisy)
    rng = np.random.default_rng(0)
    for _ in range(5):
        theta = np.array([3.0, 0.2, 7.0, 0.37, 0.45, 0.46]) + 0.1 * rng.standard_normal(6)
        f, g = sl.objective(theta, X, target)
        num = np.zeros(6)
        for i in range(6):
            h = np.zeros(6)
            h[i] = 1e-6
            num[i] = (
                sl.objective(theta + h, X, target)[0] - sl.objective(theta - h, X, target)[0]
            ) / 2e-6
        np.testing.assert_allclose(g, num, rtol=1e-5, atol=1e-9 * max(1.0, abs(f)))


def test_paper_grid_has_116_runs_and_reproduces_the_955m_tokens_of_table_5():
    g = sg.paper_grid()
    assert len(g) == 116 and g.groupby("r").size().tolist() == [29, 29, 29, 29]
    assert g.groupby(["budget", "r"]).ngroups == 24
    cell = g[(g.s == 10) & (g.r == 4) & (g.budget == 1e18)].iloc[0]
    assert cell.tokens == pytest.approx(0.955e9, rel=5e-3)  # Table 5: 955M
    assert cell.n_once + cell.n_rec == 98 * 640**2  # N(4) = 98 d^2


def test_planted_law_passes_through_both_published_anchor_runs():
    p = sg.planted_params()
    for r, s, D, L in sg.ANCHORS:
        n_once, n_rec = sg.split_counts(r, 64 * s)
        row = pd.DataFrame({"r": [r], "n_once": [n_once], "n_rec": [n_rec], "tokens": [D]})
        assert sl.predict(p, row)[0] == pytest.approx(L, abs=1e-12)


def test_exact_losses_are_recovered_to_solver_precision(exact):
    fit = sc.fit_law(sl.check_runs(exact), restarts=2)
    truth = sg.planted_params()
    for k, v in truth.items():
        assert fit.params[k] == pytest.approx(v, rel=1e-6), k
    assert fit.r2 == pytest.approx(1.0, abs=1e-12) and fit.converged, fit.reason


def test_fit_does_not_depend_on_the_restart_seed(noisy):
    df = sl.check_runs(noisy)
    phis = [sc.fit_law(df, restarts=3, seed=s).params["phi"] for s in (0, 11, 23)]
    assert max(phis) - min(phis) < 1e-6, phis


def test_scipy_default_tolerances_stop_far_from_the_optimum_that_tight_ones_reach(noisy):
    df = sl.check_runs(noisy)
    start = [np.array([20.0, 1.0, 10.0, 0.5, 0.5, 1.5])]
    loose = sc.fit_law(df, restarts=0, informed=0, starts=start, options={}, rescale=False)
    tight = sc.fit_law(df, restarts=0, informed=0, starts=start)
    best = sc.fit_law(df, restarts=2)
    assert tight.huber == pytest.approx(best.huber, rel=1e-8)
    assert loose.huber > 1.5 * best.huber, (loose.huber, best.huber)


def test_restricted_fits_lose_r2_and_standard_law_fits_one_architecture(noisy):
    fit = sc.fit_recurrence_law(noisy, bootstrap=0, restarts=2)
    assert fit.r2 > fit.restricted["phi=0"].r2 and fit.r2 > fit.restricted["phi=1"].r2
    assert fit.restricted["phi=1"].params["phi"] == 1.0
    r1 = sl.check_runs(sg.synthetic_runs(noise=0.0)).query("r == 1").reset_index(drop=True)
    std = sc.fit_law(r1, form="standard", restarts=2)
    assert std.params["alpha"] == pytest.approx(0.199, rel=1e-5) and "phi" not in std.params


def test_block_bootstrap_resamples_cells_and_brackets_the_estimate(noisy):
    df = sl.check_runs(noisy)
    fit = sc.fit_law(df, restarts=2)
    draws, ci = sc.block_bootstrap(df, fit, 20, boot_restarts=0, seed=3)
    again, _ = sc.block_bootstrap(df, fit, 20, boot_restarts=0, seed=3)
    assert draws.shape == (20, 6) and np.array_equal(draws, again)
    lo, hi = ci["phi"]
    assert lo < fit.params["phi"] < hi and hi - lo < 0.3
    assert len(fit.cells) == 24 and set(fit.cells.columns) >= {"n", "mean", "max_abs", "rmse"}
    # the stated level: 95 % by default, i.e. the 2.5th and 97.5th percentiles of the refits
    for i, p in enumerate(("A", "alpha", "B", "beta", "E", "phi")):
        assert ci[p] == pytest.approx(tuple(np.percentile(draws[:, i], [2.5, 97.5])), rel=1e-12)
    _, half = sc.block_bootstrap(df, fit, 20, boot_restarts=0, seed=3, level=0.5)
    assert half["phi"] == pytest.approx(tuple(np.percentile(draws[:, 5], [25, 75])), rel=1e-12)
    law = sc.fit_recurrence_law(df, bootstrap=8, restarts=1, boot_restarts=0, restricted=False)
    expect = tuple(np.percentile(law.bootstrap[:, 5], [2.5, 97.5]))
    assert law.ci["phi"] == pytest.approx(expect, rel=1e-12)  # the public fit's level: 95 %


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.drop(columns="tokens"), "missing column"),
        (lambda d: d.assign(loss=-1.0), "'loss' must be > 0"),
        (lambda d: d.assign(tokens="x"), "non-numeric"),
        (lambda d: d[(d.budget != 1e18) | (d.r == 1)], "one architecture only"),
        (lambda d: d.assign(r=1.0), "same r"),
    ],
)
def test_bad_runs_get_a_clear_error(exact, change, message):
    with pytest.raises(ValueError, match=message):
        sc.fit_recurrence_law(change(exact.copy()), bootstrap=0)


def test_param_split_reads_once_and_recurrent_parameters_from_the_visit_table():
    d = 32
    cfg = GPTConfig(vocab_size=64, seq_len=8, d_model=d, n_heads=2, K=2, R=3, prelude=1,
                    coda=2, recall="linear", tie_embeddings=False)  # fmt: skip
    model = LoopedGPT(cfg, generator=torch.Generator().manual_seed(0))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    split = sc.param_split(model, torch.randint(0, 64, (1, 8)), exclude=["lm_head"])
    # independent count from parameter names: 12 d^2 per block, 2 d^2 injection, no norms
    assert split.n_once == 3 * 12 * d * d and split.n_rec == 2 * 12 * d * d + 2 * d * d
    assert split.r == 3 and split.unused == []
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with_norms = sc.param_split(model, torch.randint(0, 64, (1, 8)), norms=True)
    assert with_norms.n_once > split.n_once  # norm gains and the unexcluded lm_head


def test_cli_fits_a_runs_csv_and_writes_json_and_a_plot(tmp_path, capsys, noisy):
    path = tmp_path / "runs.csv"
    noisy.drop(columns=["s", "d"]).to_csv(path, index=False)
    png = tmp_path / "phi.png"
    argv = ["phi-fit", str(path), "--bootstrap", "10", "--restarts", "2", "--json"]
    assert main([*argv, "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert abs(out["phi"] - 0.459) < 0.1 and out["ci"]["phi"][0] < out["phi"]
    assert set(out["restricted"]) == {"phi=0", "phi=1"} and png.stat().st_size > 1000
    assert main(["phi-fit", str(path), "--bootstrap", "0", "--restarts", "1"]) == 0
    assert "phi = " in capsys.readouterr().out


def test_cli_reports_a_bad_csv_in_one_line(tmp_path, capsys):
    path = tmp_path / "bad.csv"
    pd.DataFrame({"loss": [2.0], "r": [1]}).to_csv(path, index=False)
    assert main(["phi-fit", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "missing column" in err and "\n" not in err
    assert main(["phi-fit", str(tmp_path / "none.csv")]) == 2


def test_a_fit_with_a_parameter_at_the_box_bound_is_not_reported_converged():
    csv = pathlib.Path(__file__).parents[1] / "docs" / "data" / "iso_depth_runs.csv"
    fit = sc.fit_law(pd.read_csv(csv))  # the tiny demo: E runs into the paper's box
    assert not fit.converged and "at the box bound" in fit.reason and "e" in fit.reason
