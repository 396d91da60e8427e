"""``loopprobe kappa`` and ``loopprobe bound``: JSON keys and values, tables, --model, errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

import loopprobe as lp
from loopprobe.cli import main
from loopprobe.models import GPTConfig, LoopedGPT

# A tiny reference model keeps every call to a few seconds.
TINY = ["--d-model", "8", "--heads", "2", "--seq", "4", "--batch", "2", "--vocab", "11"]
FAST = ["--max-iter", "60", "--tol", "1e-9"]


def run_json(capsys, *argv: str) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def run_error(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith(f"loopprobe {argv[0]}: error:")
    return captured.err


@pytest.fixture(scope="module")
def kappa_k2_r3() -> dict:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["kappa", "--K", "2", "--R", "3", "--norm", "deeploop", *TINY, *FAST, "--json"])
    assert code == 0
    return json.loads(buf.getvalue())


# --------------------------------------------------------------------------- kappa


def test_kappa_json_has_the_documented_keys_and_M_equals_2KR(kappa_k2_r3):
    out = kappa_k2_r3
    for key in ("kappa", "M", "M_g", "alpha", "beta", "sublayers", "visits", "update", "converged"):
        assert key in out
    assert (out["K"], out["R"], out["norm"]) == (2, 3, "deeploop")
    assert (out["M"], out["M_g"]) == (2 * 2 * 3, 2 * 2 * 3)
    assert out["alpha"] == pytest.approx(math.sqrt(12), rel=1e-12)  # (2N)^(1/2), N = 6
    assert out["beta"] == pytest.approx(48**-0.5, rel=1e-12)  # (8N)^(-1/2)
    names = [s["sublayer"] for s in out["sublayers"]]
    assert names == ["blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp"]
    assert len(out["visits"]) == 12 and out["converged"] is True


def test_kappa_json_values_lie_in_zero_to_R_and_kappa_R_is_the_max(kappa_k2_r3):
    out = kappa_k2_r3
    kappas = [s["kappa"] for s in out["sublayers"]]
    assert all(s["R"] == s["R_g"] == 3 for s in out["sublayers"])
    assert all(0.0 <= k <= 3.0 for k in kappas)
    assert out["kappa"] == max(kappas)
    for s in out["sublayers"]:  # kappa_j recomputed from the norms it reports
        expected = s["U_tied"] * s["G_tied"] / (s["R_g"] * s["U_max"] * s["G_max"])
        assert s["kappa"] == pytest.approx(expected, rel=1e-12)
        assert s["U_tied"] <= s["U_sum"] * (1 + 1e-9) and s["G_tied"] <= s["G_sum"] * (1 + 1e-12)
    assert out["bound"] == pytest.approx(12 * out["kappa"] * out["ratio"] ** 2, rel=1e-12)


def test_kappa_json_equals_the_python_api_on_the_same_model_and_batch(kappa_k2_r3):
    cfg = GPTConfig(vocab_size=11, seq_len=4, d_model=8, n_heads=2, K=2, R=3, norm="deeploop")
    model = LoopedGPT(cfg, generator=torch.Generator().manual_seed(0)).double()
    idx, targets = lp.tasks.random_tokens(2, 4, 11, torch.Generator().manual_seed(0))

    def loss_fn(out, inputs):
        return torch.nn.functional.cross_entropy(out.reshape(-1, 11), targets.reshape(-1))

    rep = lp.visit_alignment(
        lp.attach(model),
        idx,
        loss_fn,
        max_iter=60,
        tol=1e-9,
        generator=torch.Generator().manual_seed(0),
        seed=0,
    )
    assert kappa_k2_r3["kappa"] == pytest.approx(rep.kappa, rel=1e-12)
    assert kappa_k2_r3["loss"] == pytest.approx(rep.loss, rel=1e-12)


def test_kappa_is_one_for_every_sublayer_when_R_is_1(capsys):
    out = run_json(capsys, "kappa", "--K", "1", "--R", "1", *TINY, *FAST)
    assert (out["M"], out["M_g"]) == (2, 2)
    assert [s["kappa"] for s in out["sublayers"]] == pytest.approx([1.0, 1.0], rel=1e-12)


def test_kappa_with_adam_in_float32_says_which_update_and_converges_at_the_float32_tolerance(
    capsys,
):
    argv = ["kappa", "--K", "1", "--R", "2", "--update", "adam", "--dtype", "float32", *TINY]
    out = run_json(capsys, *argv)
    assert out["update"].startswith("adam (fresh, first step)")
    assert out["M"] == 4 and 0 <= out["kappa"] <= 2
    assert out["converged"] is True  # the default tol is 1e-5 outside float64


def test_kappa_table_has_one_aligned_row_per_sublayer_and_the_kappa_R_line(capsys):
    assert main(["kappa", "--K", "1", "--R", "2", "--norm", "deepnorm", *TINY, *FAST]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("loopprobe kappa: LoopedGPT K=1 R=2 norm=deepnorm")
    assert "M=4 forward visits, M_g=4 gradient-visible" in lines[1]
    i = next(k for k, line in enumerate(lines) if line.startswith("sublayer"))
    rows = lines[i + 1 : i + 3]
    assert [r.split()[0] for r in rows] == ["blocks.0.attn", "blocks.0.mlp"]
    assert len({len(line) for line in lines[i : i + 3]}) == 1  # aligned columns
    kappa_line = next(line for line in lines if line.startswith("kappa_R = "))
    kappa = float(kappa_line.split()[2])
    assert 0 < kappa <= 2 and kappa == pytest.approx(max(float(r.split()[2]) for r in rows))


# --------------------------------------------------------------------------- --model


def test_kappa_on_a_user_factory_with_inputs_output_and_loss_functions(capsys):
    argv = [
        "kappa",
        "--model",
        "user_models:shared",
        "--R",
        "3",
        "--inputs",
        "user_models:batch",
        "--output",
        "user_models:first",
        "--loss",
        "user_models:squared_error",
        *FAST,
    ]
    out = run_json(capsys, *argv)
    assert (out["M"], out["M_g"]) == (3, 3)
    assert [s["sublayer"] for s in out["sublayers"]] == ["block"]
    assert 0 <= out["kappa"] <= 3
    assert out["alpha"] is None and out["bound"] is None and out["K"] is None
    assert out["loss_fn"] == "user_models:squared_error"


def test_kappa_calls_a_factory_without_arguments_when_R_is_not_given(capsys):
    argv = [
        "kappa",
        "--model",
        "user_models:shared_no_args",
        "--inputs",
        "user_models:batch_no_args",
        "--output",
        "user_models:first",
        *FAST,
    ]
    out = run_json(capsys, *argv)
    assert out["M"] == 4 and out["R"] is None  # shared_no_args builds R = 4
    assert out["loss_fn"].startswith("0.5 * mean(F^2)")


def test_kappa_on_a_user_reference_model_draws_tokens_from_its_config(capsys):
    out = run_json(capsys, "kappa", "--model", "user_models:gpt", "--R", "2", *FAST)
    assert (out["M"], out["M_g"]) == (4, 4)
    assert out["alpha"] == pytest.approx(math.sqrt(4)) and out["loss_fn"].startswith("cross")


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--model", "user_models"], "must look like package.module:factory"),
        (["--model", "no_such_module_lp:make"], "cannot import 'no_such_module_lp'"),
        (["--model", "user_models:missing"], "has no attribute 'missing'"),
        (["--model", "user_models:NOT_CALLABLE"], "'NOT_CALLABLE' is not callable"),
        (["--model", "user_models:not_a_module"], "returned a int, not a torch.nn.Module"),
        (["--model", "user_models:shared_no_args", "--R", "3"], "shared_no_args(3) raised TypeErr"),
        (["--model", "user_models:shared"], "pass --inputs package.module:fn"),
        (["--model", "user_models:unlooped", "--inputs", "user_models:batch"], "nothing is looped"),
        (["--inputs", "user_models:batch"], "--inputs only applies together with --model"),
        (["--R", "0"], "--R must be an integer >= 1, got 0"),
        (["--K", "0"], "--K must be an integer >= 1, got 0"),
    ],
)
def test_kappa_bad_input_prints_one_line_and_exits_2(capsys, argv, needle):
    err = run_error(capsys, "kappa", *argv, *TINY)
    assert needle in err


# --------------------------------------------------------------------------- bound


@pytest.fixture(scope="module")
def bound_k1() -> dict:
    import contextlib
    import io

    buf = io.StringIO()
    argv = ["bound", "--K", "1", "--R", "1,2,4", "--norm", "deepnorm", *TINY, *FAST, "--json"]
    with contextlib.redirect_stdout(buf):
        assert main(argv) == 0
    return json.loads(buf.getvalue())


def test_bound_json_has_one_row_per_R_with_C_and_the_fitted_slope(bound_k1):
    out = bound_k1
    assert out["R"] == [1, 2, 4] and [r["R"] for r in out["rows"]] == [1, 2, 4]
    for r in out["rows"]:
        assert r["M"] == r["M_g"] == 2 * r["R"]
        assert 0 <= r["kappa"] <= r["R"]
        assert r["ratio"] == pytest.approx(1 / (2 * math.sqrt(r["R"])), rel=1e-12)  # DeepNorm
        assert r["prediction"] == pytest.approx(r["M_g"] * r["kappa"] * r["ratio"] ** 2)
        assert r["C"] == pytest.approx(r["dF_true"] / r["prediction"], rel=1e-12)
        assert r["dF_first"] == pytest.approx(r["dF_true"], rel=0.05)  # lr 1e-3: linear regime
    assert out["rows"][0]["kappa"] == pytest.approx(1.0, rel=1e-12)
    assert out["C"] == [r["C"] for r in out["rows"]]
    logR = [math.log(r["R"]) for r in out["rows"]]
    logF = [math.log(r["dF_true"]) for r in out["rows"]]
    mR, mF = sum(logR) / 3, sum(logF) / 3
    slope = sum((a - mR) * (b - mF) for a, b in zip(logR, logF, strict=True)) / sum(
        (a - mR) ** 2 for a in logR
    )
    assert out["slope"] == pytest.approx(slope, rel=1e-9)
    assert out["theory"] == {"p": 0.25, "aligned": 1.0, "decorrelated": 0.0}
    assert out["C_ratio"] == pytest.approx(max(out["C"]) / min(out["C"]))


def test_bound_table_lists_each_R_and_the_slope_line(capsys):
    argv = ["bound", "--K", "1", "--R", "1,2", "--norm", "deeploop", *TINY, *FAST]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("loopprobe bound: LoopedGPT K=1 R=1,2 norm=deeploop")
    i = next(k for k, line in enumerate(lines) if line.startswith("R "))
    assert [line.split()[0] for line in lines[i + 1 : i + 3]] == ["1", "2"]
    assert [line.split()[1] for line in lines[i + 1 : i + 3]] == ["2", "4"]  # M_g
    slope_line = next(line for line in lines if line.startswith("log-log slope in R"))
    assert "theory (p=0.5): 0 aligned, -1 decorrelated" in slope_line
    assert any(line.startswith("C max/min across R = ") for line in lines)


def test_bound_on_a_user_factory_needs_alpha_and_beta_and_calls_factory_with_each_R(capsys):
    base = [
        "bound",
        "--model",
        "user_models:shared",
        "--R",
        "2,3",
        "--inputs",
        "user_models:batch",
        "--output",
        "user_models:first",
        *FAST,
    ]
    assert "pass --alpha and --beta" in run_error(capsys, *base)
    out = run_json(capsys, *base, "--alpha", "1", "--beta", "1")
    assert [(r["R"], r["M"], r["alpha"], r["beta"]) for r in out["rows"]] == [
        (2, 2, 1.0, 1.0),
        (3, 3, 1.0, 1.0),
    ]
    assert out["theory"] is None and math.isfinite(out["slope"])


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--R", "4"], "at least two distinct values"),
        (["--R", "2,2"], "at least two distinct values"),
        (["--R", "0,2"], "--R values must be integers >= 1, got 0"),
        (["--R", "1,2", "--lr", "0"], "--lr must be > 0"),
        (["--R", "1,2", "--model", "user_models:not_a_module"], "not_a_module(1) raised TypeError"),
    ],
)
def test_bound_bad_input_prints_one_line_and_exits_2(capsys, argv, needle):
    assert needle in run_error(capsys, "bound", *argv, *TINY)


def test_bound_rejects_a_malformed_R_list_through_argparse(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bound", "--R", "1,x"])
    assert exc.value.code == 2
    assert "expected comma-separated integers" in capsys.readouterr().err


def test_bound_with_adamw_states_the_optimizer_and_judges_the_adam_form(capsys):
    base = ["bound", "--K", "1", "--R", "1,2,4", "--norm", "deepnorm", "--optimizer", "adamw"]
    out = run_json(capsys, *base, *TINY, *FAST)
    assert out["optimizer"] == "adamw" and out["family"] == "adam"
    assert out["prediction_form"] == "J_g kappa_U (beta/alpha)"
    for r in out["rows"]:
        assert r["family"] == "adam" and r["J_g"] == 2
        assert r["prediction"] == pytest.approx(2 * r["kappa_U"] * r["ratio"], rel=1e-12)
        assert r["prediction_sgd"] == pytest.approx(r["M_g"] * r["kappa"] * r["ratio"] ** 2)
        assert r["C"] == pytest.approx(r["dF_true"] / r["prediction"], rel=1e-12)
    assert out["theory"] == {"p": 0.25, "aligned": 0.5, "decorrelated": -0.5}
    assert "one adamw step" in out["verdicts"][0]["claim"]
    assert main([*base, *TINY, *FAST]) == 0
    text = capsys.readouterr().out
    assert "prediction for adamw: J_g kappa_U (beta/alpha)" in text
    assert "J_g kU (b/a)" in text and "kappa_U" in text
