"""The CLI on a user's own model (issue 10.8): a module in the current directory, a model
called with keyword arguments through ``--forward``, a Hugging Face style output (``.logits``,
``.loss``), ``report --alpha/--beta``, one-line errors with exit 2 and ``--debug``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid

import pandas as pd
import pytest
import torch

import loopprobe as lp
from loopprobe.cli import build_parser, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = ["--max-iter", "60", "--tol", "1e-9"]

# A model written the way third-party code is: keyword-only forward, a ModelOutput-like
# return value (an OrderedDict with attribute access, unset fields None), own loss.
USER_MODULE = textwrap.dedent(
    '''
    import collections

    import torch
    import torch.nn.functional as F
    from torch import nn


    class Output(collections.OrderedDict):
        """Like transformers.ModelOutput: a dict of the fields that are set, and attributes."""

        def __init__(self, logits=None, loss=None):
            fields = (("loss", loss), ("logits", logits))
            super().__init__((k, v) for k, v in fields if v is not None)

        def __getattr__(self, name):
            if name in ("loss", "logits"):
                return self.get(name)
            raise AttributeError(name)


    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.lin = nn.Linear(d, d)

        def forward(self, h):
            return torch.tanh(self.lin(h))


    class KwModel(nn.Module):
        def __init__(self, R=3, d=6, vocab=11):
            super().__init__()
            self.R = R
            self.emb = nn.Embedding(vocab, d)
            self.block = Block(d)
            self.head = nn.Linear(d, vocab)

        def forward(self, *, input_ids, labels=None):
            h = self.emb(input_ids)
            for _ in range(self.R):
                h = h + self.block(h)
            logits = self.head(h)
            loss = None
            if labels is not None:
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
            return Output(logits=logits, loss=loss)


    def make(R=3):
        torch.manual_seed(0)
        return KwModel(R).double()


    def batch():
        ids = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
        return {"input_ids": ids, "labels": ids.roll(-1, 1)}


    def batch_unlabeled():
        return {"input_ids": batch()["input_ids"]}


    def call(model, inputs):
        return model(**inputs)


    def call_hidden(model, inputs):
        return {"hidden": model(**inputs).logits}


    def make_fails():
        raise RuntimeError("weights file not found")


    def bad_loss(out, inputs):
        raise RuntimeError("loss blew up")
    '''
)


@pytest.fixture
def user_dir(fresh_cwd):
    """The user's module in a fresh cwd, not on sys.path (tests/conftest.py); its name."""
    return fresh_cwd("usermodel", USER_MODULE)


def user_module(name: str):
    sys.path.insert(0, os.getcwd())
    try:
        return __import__(name)
    finally:
        sys.path.remove(os.getcwd())


def run_json(capsys, *argv: str) -> dict:
    code = main([*argv, "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def run_error(capsys, argv: list[str], code: int = 2) -> str:
    assert main(argv) == code
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith(f"loopprobe {argv[0]}: error:")
    return captured.err


def library_kappa(mod, loss_fn, output) -> float:
    model, inputs = mod.make(), mod.batch() if loss_fn is None else mod.batch_unlabeled()
    with lp.attach(model) as probe:
        rep = lp.visit_alignment(
            probe,
            inputs,
            (lambda out, _inputs: out.loss) if loss_fn is None else loss_fn,
            forward=mod.call,
            output=output,
            max_iter=60,
            tol=1e-9,
            generator=torch.Generator().manual_seed(0),
            seed=0,
        )
    return rep.kappa


# --------------------------------------------------------------------------- finding the module


def test_the_console_entry_finds_a_model_module_in_the_current_directory(user_dir, tmp_path):
    # -P keeps python from putting the cwd on sys.path itself, as the console script does
    env = {**os.environ, "PYTHONPATH": ROOT}
    argv = ["kappa", "--model", f"{user_dir}:make", "--inputs", f"{user_dir}:batch"]
    argv += ["--forward", f"{user_dir}:call", *FAST, "--json"]
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "loopprobe.cli", *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["M"] == 3


def test_main_imports_from_the_cwd_and_leaves_sys_path_as_it_was(user_dir, capsys):
    before = list(sys.path)
    out = run_json(
        capsys,
        "kappa",
        "--model",
        f"{user_dir}:make",
        "--inputs",
        f"{user_dir}:batch",
        "--forward",
        f"{user_dir}:call",
        *FAST,
    )
    assert out["M"] == 3 and out["R"] is None
    assert sys.path == before


# --------------------------------------------------------------------------- --forward, ModelOutput


def test_forward_and_a_model_output_give_the_kappa_of_logits_and_the_models_own_loss(
    user_dir, capsys
):
    argv = ["--model", f"{user_dir}:make", "--inputs", f"{user_dir}:batch"]
    out = run_json(capsys, "kappa", *argv, "--forward", f"{user_dir}:call", *FAST)
    assert out["loss_fn"] == "the model's own .loss"
    assert out["F"].startswith(".logits of the model's Output")
    mod = user_module(user_dir)
    expected = library_kappa(mod, None, lambda o: o.logits)
    assert out["kappa"] == pytest.approx(expected, rel=1e-10)
    # the logits' cross-entropy is what the model returns as .loss: the loss is not F^2
    own = mod.call(mod.make(), mod.batch()).loss.detach()
    assert out["loss"] == pytest.approx(float(own), rel=1e-12)


def test_an_output_without_loss_falls_back_to_half_mean_square_and_says_so(user_dir, capsys):
    argv = ["--model", f"{user_dir}:make", "--inputs", f"{user_dir}:batch_unlabeled"]
    out = run_json(capsys, "kappa", *argv, "--forward", f"{user_dir}:call", *FAST)
    assert out["loss_fn"].startswith("0.5 * mean(F^2)")
    mod = user_module(user_dir)
    expected = library_kappa(mod, lambda o, _i: 0.5 * o.logits.pow(2).mean(), lambda o: o.logits)
    assert out["kappa"] == pytest.approx(expected, rel=1e-10)


def test_the_text_report_names_what_F_is(user_dir, capsys):
    argv = ["kappa", "--model", f"{user_dir}:make", "--inputs", f"{user_dir}:batch"]
    assert main([*argv, "--forward", f"{user_dir}:call", "--max-iter", "5"]) == 0
    text = capsys.readouterr().out
    assert "F: .logits of the model's Output (default; pass --output" in text


def test_bound_runs_on_a_keyword_model_with_a_model_output(user_dir, capsys):
    argv = ["bound", "--R", "2,3", "--model", f"{user_dir}:make", "--inputs", f"{user_dir}:batch"]
    out = run_json(capsys, *argv, "--forward", f"{user_dir}:call", "--alpha", "1", "--beta", "1")
    assert [r["R"] for r in out["rows"]] == [2, 3]
    assert [r["M"] for r in out["rows"]] == [2, 3]
    assert out["loss_fn"] == "the model's own .loss" and ".logits" in out["F"]
    assert all(r["dF_true"] > 0 for r in out["rows"])


# --------------------------------------------------------------------------- report


def report_results(user_dir, tmp_path, *extra: str) -> dict:
    out = tmp_path / f"r{uuid.uuid4().hex[:6]}"
    argv = ["report", "--quick", "--no-progress", "--sections", "visits,alignment"]
    argv += ["--model", f"{user_dir}:make", "--inputs", f"{user_dir}:batch"]
    argv += ["--forward", f"{user_dir}:call", "--out", str(out), *extra]
    assert main(argv) == 0
    return json.loads((out / "results.json").read_text())["sections"]


def test_report_with_alpha_and_beta_runs_the_bound_check_on_a_keyword_model(
    user_dir, tmp_path, capsys
):
    sections = report_results(user_dir, tmp_path, "--alpha", "2", "--beta", "0.5")
    assert sections["visits"]["status"] == "ok", sections["visits"]
    assert sections["visits"]["values"]["M"] == 3
    al = sections["alignment"]
    assert al["status"] == "ok", al
    v = al["values"]
    assert (v["alpha"], v["beta"]) == (2.0, 0.5)
    assert v["prediction"] == pytest.approx(v["M_g"] * v["kappa"] * (0.5 / 2) ** 2, rel=1e-12)
    assert not any("bound check skipped" in n for n in al["notes"])


def test_report_without_alpha_and_beta_says_which_flags_enable_the_bound_check(
    user_dir, tmp_path, capsys
):
    al = report_results(user_dir, tmp_path)["alignment"]
    assert al["status"] == "ok", al
    assert "prediction" not in al["values"]
    assert any("bound check skipped" in n and "--alpha and --beta" in n for n in al["notes"])


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_report_health_judges_the_bound_for_the_optimizer_you_train_with(
    optimizer, user_dir, tmp_path, capsys
):
    out = tmp_path / f"h{optimizer}"
    argv = ["report", "--no-progress", "--sections", "health", "--model", f"{user_dir}:make",
            "--inputs", f"{user_dir}:batch", "--forward", f"{user_dir}:call", "--alpha", "2",
            "--beta", "0.5", "--optimizer", optimizer, "--out", str(out)]
    assert main(argv) == 0
    health = json.loads((out / "results.json").read_text())["sections"]["health"]
    assert f"optimizer: {optimizer} (the bound and scaling lines judge its step" in " ".join(
        health["notes"]
    )
    rows = pd.read_csv(out / health["csv"]["checks"])
    bound = rows[rows.check == "bound"].measured.item()
    form = "J_g κ^U_R (β/α) under adamw" if optimizer == "adamw" else "M_g"
    assert form in bound, bound


def test_report_optimizer_without_a_model_is_refused_in_one_line(tmp_path, capsys):
    out = tmp_path / "unused"
    assert main(["report", "--optimizer", "adamw", "--out", str(out)]) == 2
    assert "--optimizer needs --model" in capsys.readouterr().err
    assert not out.exists()  # refused before anything was written


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["kappa", "--threads", "0"], "argument --threads: expected an integer >= 1, got '0'"),
        (["kappa", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["bound", "--R", "x"], "argument --R: expected comma-separated integers"),
    ],
)
def test_argument_errors_are_one_line_with_exit_2(capsys, argv, needle):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1, captured.err
    assert needle in captured.err and f"(see loopprobe {argv[0]} --help)" in captured.err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["kappa", "--model", "{m}:make_fails"], "make_fails() raised RuntimeError: weights"),
        (["kappa", "--model", "{m}:make", "--forward", "{m}:nope"], "has no attribute 'nope'"),
        (["kappa", "--model", "{m}:make", "--forward", "{m}"], "must look like package.module:fn"),
        (["kappa", "--forward", "{m}:call"], "--forward only applies together with --model"),
        (
            [
                "kappa",
                "--model",
                "{m}:make",
                "--inputs",
                "{m}:batch",
                "--forward",
                "{m}:call_hidden",
            ],
            "with keys ['hidden'], not a tensor and without a .logits tensor; pass --output",
        ),
        (["kappa", "--model", "missing_mod_xyz:make"], "cannot import 'missing_mod_xyz'"),
        (["kappa", "--model", "broken_mod:make"], "importing 'broken_mod' raised SyntaxError"),
        (["kappa", "--model", "needs_dep:make"], "it imports 'no_such_dep_xyz', which is missing"),
        (["fixed-point", "--model", "{m}:make_fails"], "make_fails() raised RuntimeError"),
        (["report", "--alpha", "1", "--out", "r"], "--alpha needs --model"),
        (["report", "--model", "{m}:make", "--beta", "-1", "--out", "r"], "--beta must be a pos"),
    ],
)
def test_user_input_errors_are_one_line_on_stderr_with_exit_2(user_dir, capsys, argv, needle):
    with open("broken_mod.py", "w") as f:
        f.write("def make(:\n")
    with open("needs_dep.py", "w") as f:
        f.write("import no_such_dep_xyz\n")
    try:
        err = run_error(capsys, [a.replace("{m}", user_dir) for a in argv])
    finally:
        for mod in ("broken_mod", "needs_dep"):
            sys.modules.pop(mod, None)
    assert needle in err


def test_debug_shows_the_traceback_instead(user_dir):
    with pytest.raises(ValueError, match="make_fails"):
        main(["kappa", "--model", f"{user_dir}:make_fails", "--debug"])


def test_a_failure_that_is_not_bad_input_is_one_line_with_exit_1_and_names_debug(user_dir, capsys):
    argv = ["kappa", "--model", f"{user_dir}:make", "--inputs", f"{user_dir}:batch"]
    argv += ["--forward", f"{user_dir}:call", "--loss", f"{user_dir}:bad_loss"]
    err = run_error(capsys, argv, code=1)
    assert "RuntimeError: loss blew up" in err and "--debug" in err
    with pytest.raises(RuntimeError, match="loss blew up"):
        main([*argv, "--debug"])


def test_every_command_takes_threads_and_debug_and_its_help_says_the_thread_default(capsys):
    commands = build_parser()._subparsers._group_actions[0].choices
    assert {"kappa", "bound", "report", "increments", "fixed-point", "theory"} <= set(commands)
    for name, sub in commands.items():
        flags = {s for a in sub._actions for s in a.option_strings}
        assert {"--threads", "--debug"} <= flags, name
        assert "Default: 1 for models below 1e+09 parameter-tokens" in " ".join(
            sub.format_help().split()
        ), name
