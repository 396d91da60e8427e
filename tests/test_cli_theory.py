"""``loopprobe theory``: closed-form values in the table and in the JSON object."""

import json
import math
import os
import subprocess
import sys

import pytest

from loopprobe.cli import main


def run_json(capsys, *argv):
    assert main(["theory", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_has_deeploop_closed_forms_at_k2_r4(capsys):
    out = run_json(capsys, "--K", "2", "--R", "4")
    dl = out["deeploop"]
    assert (dl["N"], dl["M"]) == (8, 16)
    assert dl["alpha"] == pytest.approx(4.0, rel=1e-12)
    assert dl["beta"] == pytest.approx(1 / 8, rel=1e-12)
    assert dl["ratio"] == pytest.approx(1 / 32, rel=1e-12)
    assert dl["untied_bound"] == pytest.approx(1 / 64, rel=1e-12)
    assert dl["aligned_tied_bound"] == pytest.approx(1 / 16, rel=1e-12)


@pytest.mark.parametrize("K, R", [(1, 1), (2, 4), (3, 7), (12, 3)])
def test_json_deepnorm_untied_is_one_half_and_aligned_is_r_over_two(capsys, K, R):
    out = run_json(capsys, "--K", str(K), "--R", str(R))
    dn, dl = out["deepnorm"], out["deeploop"]
    for key in ("alpha", "beta", "ratio", "N", "M", "untied_bound", "aligned_tied_bound"):
        assert key in dn and key in dl
    assert dn["ratio"] == pytest.approx(1 / (2 * math.sqrt(K * R)), rel=1e-12)
    assert dn["untied_bound"] == pytest.approx(0.5, rel=1e-12)
    assert dn["aligned_tied_bound"] == pytest.approx(R / 2, rel=1e-12)
    assert dl["aligned_tied_bound"] == pytest.approx(1 / (8 * K), rel=1e-12)
    assert "p" not in out and "hierarchical" not in out


def test_json_general_exponent_adds_a_p_object(capsys):
    out = run_json(capsys, "--K", "2", "--R", "4", "--p", "0.4")
    gp = out["p"]
    assert gp["p"] == 0.4
    assert gp["ratio"] == pytest.approx(16**-0.4 * 8**-0.8, rel=1e-12)
    assert gp["aligned_tied_bound"] == pytest.approx(16 * 4 * gp["ratio"] ** 2, rel=1e-12)
    assert gp["bound_exponent_aligned"] == pytest.approx(2 - 1.6)
    assert out["p_threshold"] == {"decorrelated": 0.25, "aligned": 0.5}


def test_json_hierarchical_object_has_forward_and_gradient_visible_counts(capsys):
    argv = ["--K", "1", "--R", "2", "--C", "3", "--K-H", "1", "--C-L", "4", "--K-L", "2"]
    h = run_json(capsys, *argv)["hierarchical"]
    assert (h["M"], h["M_g"], h["N_g"]) == (54, 18, 9)
    lo, hi = h["kappa_bar_range"]
    assert lo == pytest.approx(2 / 18) and hi == pytest.approx(1 + 4 * 4 * 3 / 18)
    ratio = h["deeploop"]["ratio"]
    assert ratio == pytest.approx(1 / (4 * 9))
    assert h["deeploop"]["bound_range"] == pytest.approx([18 * lo * ratio**2, 18 * hi * ratio**2])


def test_table_lists_both_schemes_with_their_bounds(capsys):
    assert main(["theory", "--K", "2", "--R", "4"]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("scheme"))
    assert "beta/alpha" in header and "MR(b/a)^2" in header
    deepnorm = next(line for line in lines if line.startswith("deepnorm")).split()
    deeploop = next(line for line in lines if line.startswith("deeploop")).split()
    assert deepnorm[-2:] == ["0.5", "2"]
    assert deeploop[2:] == ["4", "0.125", "0.03125", "8", "16", "0.015625", "0.0625"]
    # columns are aligned: every row of the table has the same width as the header
    assert len({len(line) for line in lines[1:4]}) == 1


def test_table_with_hierarchical_args_prints_the_kappa_bar_range(capsys):
    argv = ["theory", "--K", "1", "--R", "2", "--C", "2", "--K-H", "1", "--C-L", "2", "--K-L", "1"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "M=12 forward visits, M_g=6 gradient-visible" in text
    assert "kappa_bar_g in [0.333333, 1.66667]" in text


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--K", "0", "--R", "4"], "K must be an integer >= 1, got 0"),
        (["--K", "2", "--R", "-1"], "R must be an integer >= 1, got -1"),
        (["--K", "2", "--R", "4", "--p", "0"], "p must be a finite number > 0.0"),
        (["--K", "2", "--R", "4", "--C", "2"], "missing --K-H, --C-L, --K-L"),
        (["--K", "2", "--R", "4", "--C", "2", "--K-H", "1", "--C-L", "0", "--K-L", "1"], "C_L"),
    ],
)
def test_bad_input_prints_one_line_and_exits_2(capsys, argv, needle):
    assert main(["theory", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("loopprobe theory: error:") and needle in captured.err


def test_installed_console_script_prints_deeploop_closed_forms():
    script = os.path.join(os.path.dirname(sys.executable), "loopprobe")
    # ./test.sh installs the package, so the entry point declared in pyproject must exist
    assert os.path.exists(script), f"console script not installed next to {sys.executable}"
    result = subprocess.run(
        [script, "theory", "--K", "2", "--R", "4", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    dl = json.loads(result.stdout)["deeploop"]
    assert (dl["N"], dl["alpha"], dl["beta"]) == (8, 4.0, 0.125)
    assert dl["ratio"] == pytest.approx(1 / 32) and dl["aligned_tied_bound"] == pytest.approx(
        1 / 16
    )
