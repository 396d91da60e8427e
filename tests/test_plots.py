"""Tests for loopprobe.plots on small synthetic frames: Figures, axes, lines, PNGs."""

from __future__ import annotations

import subprocess
import sys

import matplotlib.image
import numpy as np
import pandas as pd
import pytest
from matplotlib.figure import Figure

from loopprobe import plots
from loopprobe._stats import loglog_slope


def data_lines(ax) -> list:
    """Lines that carry data (seaborn/legend proxies have none)."""
    return [line for line in ax.get_lines() if len(line.get_xdata())]


def saves_png(fig: Figure, tmp_path, name: str) -> np.ndarray:
    path = tmp_path / f"{name}.png"
    fig.savefig(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return matplotlib.image.imread(path)


@pytest.fixture
def kappa_frame() -> pd.DataFrame:
    rows = []
    for norm, gamma in (("deepnorm", 1.0), ("deeploop", 0.0)):
        for R in (1, 2, 4, 8):
            for seed in (0, 1):
                rows.append(
                    {
                        "norm": norm,
                        "R": R,
                        "seed": seed,
                        "kappa": R**gamma,
                        "delta_F": 0.01 * R ** (1 - 4 * (0.25 if gamma else 0.5) + 1),
                        "diverged": False,
                    }
                )
    rows.append(
        {
            "norm": "deeploop",
            "R": 16,
            "seed": 0,
            "kappa": np.nan,
            "delta_F": np.nan,
            "diverged": True,
        }
    )
    return pd.DataFrame(rows)


def test_kappa_vs_R_draws_one_line_per_scheme_plus_two_bounds(kappa_frame, tmp_path):
    fig = plots.kappa_vs_R(kappa_frame)
    (ax,) = fig.axes
    assert len(data_lines(ax)) == 2 + 2
    assert ax.get_ylabel() == "κ_R" and "κ_R" in ax.get_title()
    # the diverged R=16 row is left out
    assert max(max(line.get_xdata()) for line in data_lines(ax)) == 8
    assert saves_png(fig, tmp_path, "kappa").shape[2] in (3, 4)


def test_delta_f_vs_R_fits_slopes_and_draws_the_predicted_ones(kappa_frame, tmp_path):
    fig = plots.delta_f_vs_R(kappa_frame)
    (ax,) = fig.axes
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    labels = [line.get_label() for line in data_lines(ax)]
    assert labels == [
        "deepnorm (fit 1.00)",
        "deepnorm predicted slope 1",
        "deeploop (fit 0.00)",
        "deeploop predicted slope 0",
    ]
    assert ax.get_ylabel() == "‖ΔF‖ / ‖F‖"
    saves_png(fig, tmp_path, "delta_f")


def test_predicted_slopes_are_one_for_deepnorm_and_zero_for_deeploop_when_aligned():
    assert plots.predicted_slopes(["deepnorm", "deeploop", "mine"]) == {
        "deepnorm": 1.0,
        "deeploop": 0.0,
    }
    assert plots.predicted_slopes(["deepnorm"], gamma=0.0) == {"deepnorm": 0.0}


def test_loglog_slope_recovers_a_power_law_and_is_nan_on_one_point():
    assert loglog_slope([1, 2, 4, 8], [3, 6, 12, 24]) == pytest.approx(1.0)
    assert np.isnan(loglog_slope([2, 2], [1, 3]))


def test_visit_norms_has_a_U_and_a_G_panel_with_a_line_per_sublayer(tmp_path):
    df = pd.DataFrame(
        [
            {"sublayer": s, "r": r, "U_norm": 1.0 + r, "G_norm": 0.1 * (r + 1)}
            for s in ("blocks.0.attn", "blocks.0.mlp", "blocks.1.attn")
            for r in range(4)
        ]
    )
    fig = plots.visit_norms(df)
    assert len(fig.axes) == 2
    assert [len(data_lines(ax)) for ax in fig.axes] == [3, 3]
    assert [ax.get_ylabel() for ax in fig.axes] == ["‖U_r,j‖", "‖G_r,j‖"]
    assert len(plots.visit_norms(df, G=None).axes) == 1
    saves_png(fig, tmp_path, "norms")


def test_visit_cosines_draws_a_heatmap_per_sublayer_from_a_frame_or_a_dict(tmp_path):
    R = 4
    cos = np.eye(R) * 0.5 + 0.5
    long = pd.DataFrame(
        [
            {"sublayer": s, "r": r, "s": c, "cosine": cos[r, c]}
            for s in ("a", "b")
            for r in range(R)
            for c in range(R)
        ]
    )
    fig = plots.visit_cosines(long)
    heatmaps = [ax for ax in fig.axes if ax.get_title() in ("a", "b")]
    assert len(heatmaps) == 2
    assert heatmaps[0].collections[0].get_array().reshape(R, R)[0, 1] == pytest.approx(0.5)
    fig2 = plots.visit_cosines({"x": cos, "y": cos, "z": cos}, max_panels=2)
    assert len([ax for ax in fig2.axes if ax.get_title() in ("x", "y", "z")]) == 2
    saves_png(fig, tmp_path, "cos")


def test_increment_growth_draws_a_line_per_rule_and_tying_plus_reference_slopes(tmp_path):
    rows = [
        {
            "N": N,
            "residual": rule,
            "tying": tying,
            "seed": seed,
            "growth": N ** (0.5 if (rule, tying) == ("1/sqrt(N)", "tied") else 0.0),
        }
        for rule in ("1/sqrt(N)", "1/N")
        for tying in ("tied", "untied")
        for N in (1, 2, 4, 8)
        for seed in (0, 1)
    ]
    fig = plots.increment_growth(pd.DataFrame(rows))
    (ax,) = fig.axes
    lines = data_lines(ax)
    assert len(lines) == 4 + 2
    assert "1/sqrt(N) tied (slope 0.50)" in [line.get_label() for line in lines]
    assert ax.get_xscale() == "log"
    saves_png(fig, tmp_path, "growth")


def test_coord_check_has_one_panel_per_step_with_log2_N_axis(tmp_path):
    rows = [
        {"N": N, "step": t, "group": g, "seed": s, "value": 1.0 + 0.1 * t}
        for N in (1, 2, 4, 8)
        for t in range(3)
        for g in ("attn", "mlp", "out")
        for s in (0, 1)
    ]
    fig = plots.coord_check(pd.DataFrame(rows))
    assert len(fig.axes) == 3
    assert [ax.get_title() for ax in fig.axes] == ["step 0", "step 1", "step 2"]
    assert all(len(data_lines(ax)) == 3 for ax in fig.axes)
    assert fig.axes[0].get_xscale() == "log"
    assert len(plots.coord_check(pd.DataFrame(rows), max_cols=2).axes) == 2
    saves_png(fig, tmp_path, "coord")


def test_lr_transfer_draws_a_curve_and_a_star_per_N(tmp_path):
    rows = [
        {"lr": lr, "N": N, "loss": (np.log10(lr) + 2) ** 2 + N * 0.01}
        for lr in (1e-3, 1e-2, 1e-1)
        for N in (1, 4)
    ]
    fig = plots.lr_transfer(pd.DataFrame(rows))
    (ax,) = fig.axes
    stars = [line for line in data_lines(ax) if line.get_marker() == "*"]
    assert len(data_lines(ax)) == 4 and len(stars) == 2
    assert stars[0].get_xdata()[0] == pytest.approx(1e-2)
    saves_png(fig, tmp_path, "lr")


def test_each_hue_level_keeps_its_palette_colour_in_order_of_first_appearance():
    import seaborn as sns

    colorblind = [tuple(c) for c in sns.color_palette("colorblind", 3)]
    df = pd.DataFrame(
        [
            {"sublayer": s, "r": r, "U_norm": 1.0 + r, "G_norm": 0.1 * (r + 1)}
            for s in ("mlp", "attn", "head")  # not sorted: first appearance decides
            for r in range(3)
        ]
    )
    for ax in plots.visit_norms(df).axes:  # the same colour per sublayer on both panels
        lines = data_lines(ax)
        assert [line.get_label() for line in lines] == ["mlp", "attn", "head"]
        assert [tuple(line.get_color()) for line in lines] == colorblind
    fp = pd.DataFrame({"variant": ["b", "b", "a", "a"], "iteration": [0, 1, 0, 1],
                       "residual": [1.0, 0.5, 1.0, 0.9]})  # fmt: skip
    (ax,) = plots.fixed_point_residuals(fp).axes
    assert [tuple(line.get_color()) for line in data_lines(ax)] == colorblind[:2]


def test_fixed_point_residuals_is_log_y_with_a_trace_per_variant_and_the_tolerance(tmp_path):
    df = pd.DataFrame(
        [
            {"variant": v, "iteration": k, "residual": rate**k}
            for v, rate in (("recall", 0.5), ("none", 0.9))
            for k in range(20)
        ]
    )
    fig = plots.fixed_point_residuals(df, tol=1e-6)
    (ax,) = fig.axes
    assert ax.get_yscale() == "log"
    assert len(data_lines(ax)) == 2 + 1
    saves_png(fig, tmp_path, "fp")


def test_eigenvalues_are_drawn_against_the_unit_circle_with_rho_in_the_legend(tmp_path):
    df = pd.DataFrame(
        {"variant": ["a", "a", "b"], "real": [0.5, 0.5, -0.2], "imag": [0.3, -0.3, 0.0]}
    )
    fig = plots.eigenvalues(df)
    (ax,) = fig.axes
    labels = [line.get_label() for line in data_lines(ax)]
    assert labels[0] == "|λ| = 1"
    assert labels[1] == f"a: ρ = {np.hypot(0.5, 0.3):.3g}" and labels[2] == "b: ρ = 0.2"
    saves_png(fig, tmp_path, "eig")


def test_a_missing_column_names_the_plot_the_column_and_the_keyword():
    with pytest.raises(ValueError, match=r"kappa_vs_R: the frame has no column 'kappa'.*y="):
        plots.kappa_vs_R(pd.DataFrame({"R": [1], "norm": ["a"]}))
    with pytest.raises(TypeError, match="eigenvalues: expected a pandas DataFrame"):
        plots.eigenvalues([1, 2])


def test_hue_none_draws_a_single_line():
    fig = plots.kappa_vs_R(pd.DataFrame({"R": [1, 2, 4], "kappa": [1.0, 1.5, 2.0]}), hue=None)
    assert len(data_lines(fig.axes[0])) == 1 + 2


def test_plt_savefig_after_a_loopprobe_plot_saves_that_figure_not_a_blank_one(tmp_path):
    # in a subprocess: importing pyplot here would make every later figure pyplot-managed
    code = f"""
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import subprocess
import sys

import matplotlib.image
import pandas as pd
import loopprobe as lp
df = pd.DataFrame({{"norm": ["deepnorm"] * 3, "R": [1, 2, 4], "kappa": [1.0, 1.9, 3.7]}})
fig = lp.plots.kappa_vs_R(df)
assert plt.gcf() is fig
plt.savefig({str(tmp_path / "k.png")!r})
img = matplotlib.image.imread({str(tmp_path / "k.png")!r})
assert img[..., :3].std() > 0.01, "blank image"
"""
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)


def test_without_pyplot_a_plot_is_a_bare_figure_that_pyplot_does_not_track():
    code = (
        "import sys, pandas as pd, loopprobe as lp\n"
        "df = pd.DataFrame({'norm': ['deepnorm'] * 3, 'R': [1, 2, 4], 'kappa': [1.0, 1.9, 3.7]})\n"
        "lp.plots.kappa_vs_R(df)\n"
        "import matplotlib.pyplot as plt\n"
        "assert plt.get_fignums() == []\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
