"""The CLI can do what Python can (issue 25): one declared option group, one loss rule for
every command and the report, the new options used, and one-line answers to frictions."""

from __future__ import annotations

import argparse
import json
import os
import textwrap

import pytest
import torch

import loopprobe as lp
from loopprobe.cli import build_parser, main

FAST = ["--max-iter", "100", "--tol", "1e-10"]

# A model written the way third-party code is: a block looped in Python, a Hugging Face
# style output (attributes, .loss when labels are given), no loopprobe interface.
USER_FILE = textwrap.dedent(
    """
    import collections

    import torch
    import torch.nn.functional as F
    from torch import nn

    import loopprobe as lp


    class Output(collections.OrderedDict):
        def __getattr__(self, name):
            if name in ("loss", "logits"):
                return self.get(name)
            raise AttributeError(name)


    class Loop(nn.Module):
        def __init__(self, R=3, d=6, vocab=11):
            super().__init__()
            self.R = R
            self.emb = nn.Embedding(vocab, d)
            self.block = nn.Sequential(nn.Linear(d, d), nn.Tanh())
            self.side = nn.Linear(d, d)
            self.head = nn.Linear(d, vocab)

        def forward(self, input_ids, labels=None):
            h = self.emb(input_ids)
            for _ in range(self.R):
                h = h + self.block(h) + 0.1 * self.side(h)
            logits = self.head(h)
            out = Output(logits=logits)
            if labels is not None:
                out["loss"] = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            return out


    def make(R=3):
        torch.manual_seed(0)
        return Loop(R).double()


    def batch():
        ids = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
        return {"input_ids": ids, "labels": ids.roll(-1, 1)}


    def one_arg_loss(out):
        return out.logits.sum()


    def vector_loss(out, inputs):
        return out.logits.pow(2).mean(-1)


    class Contracting(nn.Module):
        '''No step/embed: its round is the module `cell`, h <- 0.5 tanh(W h) + x.'''

        def __init__(self, d=4):
            super().__init__()
            self.cell = Cell(d)

        def forward(self, x):
            h = torch.zeros_like(x)
            for _ in range(6):
                h = self.cell(h, x)
            return h


    class Cell(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.lin = nn.Linear(d, d, bias=False)

        def forward(self, h, x):
            return 0.5 * torch.tanh(self.lin(h)) + x


    def make_contracting():
        torch.manual_seed(0)
        return Contracting().double()


    def x_batch():  # one token: the power iterations of ||dh*/dx|| converge well inside budget
        return torch.randn(1, 1, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)


    def replay(model, inputs):
        return lp.replay_round(model, inputs, "cell", input_arg=1)


    def not_a_map(model, inputs):
        return inputs
    """
)


@pytest.fixture
def user_file(tmp_path, monkeypatch):
    """``path/to/userloop.py``: named by a file path, not importable as a module."""
    path = tmp_path / "sub" / "userloop.py"
    path.parent.mkdir()
    path.write_text(USER_FILE)
    monkeypatch.chdir(tmp_path)
    return "sub/userloop.py"


def run_json(capsys, *argv) -> dict:
    code = main([*argv, "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def error_of(capsys, *argv) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line, no traceback
    return err


# --------------------------------------------------------------------------- --help


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    return build_parser()._subparsers._group_actions[0].choices


def test_every_option_of_every_subcommand_has_help_text():
    missing = [
        f"{name} {action.option_strings or action.dest}"
        for name, parser in _subcommands().items()
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction) and not action.help
    ]
    assert missing == []


def test_every_command_with_a_user_model_takes_the_options_of_the_group():
    parsers = _subcommands()
    needs = {
        "kappa": {"--model", "--inputs", "--loss", "--forward", "--output", "--sublayers",
                  "--exclude", "--alpha", "--beta"},
        "bound": {"--model", "--inputs", "--loss", "--forward", "--output", "--sublayers",
                  "--exclude"},
        "report": {"--model", "--inputs", "--loss", "--forward", "--output", "--sublayers",
                   "--exclude", "--increment", "--step", "--alpha", "--beta"},
        "fixed-point": {"--model", "--inputs", "--step"},
        "increments": {"--model", "--inputs", "--sublayers", "--exclude", "--increment"},
        "redundancy": {"--model", "--inputs", "--forward"},
    }  # fmt: skip
    for name, flags in needs.items():
        have = {s for a in parsers[name]._actions for s in a.option_strings}
        assert flags <= have, (name, flags - have)
    loss_help = {
        a.help
        for n in ("kappa", "report")
        for a in parsers[n]._actions
        if "--loss" in a.option_strings
    }
    assert len(loss_help) == 1 and "own scalar .loss" in loss_help.pop()  # one text, one rule


# --------------------------------------------------------------------------- one loss rule


def test_kappa_and_report_give_the_same_kappa_on_a_hugging_face_style_model(
    user_file, capsys, tmp_path
):
    spec = ["--model", f"{user_file}:make", "--inputs", f"{user_file}:batch"]
    out = run_json(capsys, "kappa", *spec, *FAST)
    assert out["loss_fn"] == "the model's own .loss"
    from loopprobe import report

    user = report.load_user_model(f"{user_file}:make", f"{user_file}:batch")
    cfg = report.ReportConfig(power_iters=100)
    res = report.run_report(tmp_path / "r", cfg, user=user, sections=["alignment"],
                            progress=False, echo=lambda _s: None)  # fmt: skip
    entry = res["sections"]["alignment"]
    assert entry["status"] == "ok", entry.get("reason")
    assert entry["values"]["kappa"] == pytest.approx(out["kappa"], rel=1e-3)
    assert any("the model's own .loss" in n for n in entry["notes"])


def test_kappa_uses_sublayers_and_exclude(user_file, capsys):
    spec = ["--model", f"{user_file}:make", "--inputs", f"{user_file}:batch", *FAST]
    both = run_json(capsys, "kappa", *spec, "--sublayers", "block.0", "side")
    assert sorted(s["sublayer"] for s in both["sublayers"]) == ["block.0", "side"]
    one = run_json(capsys, "kappa", *spec, "--sublayers", "block.0", "side", "--exclude", "side")
    assert [s["sublayer"] for s in one["sublayers"]] == ["block.0"]


def test_bound_sweep_probes_without_the_excluded_sublayers():
    from loopprobe.models import GPTConfig, LoopedGPT

    def make(R):
        cfg = GPTConfig(vocab_size=11, seq_len=5, d_model=8, n_heads=2, K=1, R=R)
        return LoopedGPT(cfg, generator=torch.Generator().manual_seed(0)).double()

    x = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
    kw = dict(lr=1e-3, max_iter=5)
    loss = lambda out, _inputs: out.square().mean()  # noqa: E731
    full = lp.bound_sweep(make, [1, 2], x, loss, **kw)
    some = lp.bound_sweep(make, [1, 2], x, loss, exclude=["blocks.*.mlp"], **kw)
    assert (some.frame["M"] * 2 == full.frame["M"]).all()  # attention visits only


def test_a_one_argument_loss_names_the_expected_signature(user_file, capsys):
    spec = ["--model", f"{user_file}:make", "--inputs", f"{user_file}:batch"]
    err = error_of(capsys, "kappa", *spec, "--loss", f"{user_file}:one_arg_loss")
    assert "loss_fn(output, inputs)" in err and "takes 1 positional" not in err


def test_a_non_scalar_loss_is_reported_by_its_shape_not_its_values(user_file, capsys):
    spec = ["--model", f"{user_file}:make", "--inputs", f"{user_file}:batch"]
    err = error_of(capsys, "kappa", *spec, "--loss", f"{user_file}:vector_loss")
    assert "shape (2, 5)" in err and "tensor([" not in err


def test_the_library_checks_the_loss_signature_before_running():
    model = torch.nn.Linear(3, 3)
    with lp.attach(model) as probe, pytest.raises(TypeError, match=r"loss_fn\(output, inputs\)"):
        lp.visit_alignment(probe, torch.randn(2, 3), lambda out: out.sum())


# --------------------------------------------------------------------------- --step, --model path


def test_fixed_point_of_a_model_without_step_through_step_matches_the_library(user_file, capsys):
    argv = ["fixed-point", "--model", f"{user_file}:make_contracting", "--inputs",
            f"{user_file}:x_batch", "--step", f"{user_file}:replay", "--tol", "1e-10"]  # fmt: skip
    out = run_json(capsys, *argv)
    assert out["converged"] and out["rounds"] == 6
    from loopprobe._io import load_object

    mod_make = load_object(f"{user_file}:make_contracting")
    model, x = mod_make(), load_object(f"{user_file}:x_batch")()
    rm = lp.replay_round(model, x, "cell", input_arg=1)
    fp = lp.fixed_point(rm.T, rm.h0, tol=1e-10, max_iter=200)
    # brute force: dense Jacobian of the round at h*, its spectral radius
    J = torch.func.jacrev(rm.T)(fp.h).reshape(fp.h.numel(), -1)
    rho = torch.linalg.eigvals(J).abs().max().item()
    assert out["spectral_radius"] == pytest.approx(rho, rel=1e-6)
    # h* = 0.5 tanh(W h*) + x: dh*/dx = (I - J)^-1, its norm 1 / sigma_min(I - J)
    sigma_min = torch.linalg.svdvals(torch.eye(len(J), dtype=J.dtype) - J).min().item()
    assert out["input_dependence_converged"], out["input_dependence_reason"]
    assert out["input_dependence"] == pytest.approx(1 / sigma_min, rel=1e-6)


def test_step_returning_something_else_says_what_to_return(user_file, capsys):
    argv = ["fixed-point", "--model", f"{user_file}:make_contracting", "--inputs",
            f"{user_file}:x_batch", "--step", f"{user_file}:not_a_map"]  # fmt: skip
    assert main(argv) == 2
    assert "not an lp.RoundMap" in capsys.readouterr().err


def test_a_missing_model_file_is_one_clear_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    err = error_of(capsys, "kappa", "--model", "./nope.py:make")
    assert "no Python file './nope.py'" in err


def test_increments_takes_the_increment_mode_and_sublayers(user_file, capsys):
    spec = ["increments", "--model", f"{user_file}:make", "--inputs", f"{user_file}:batch"]
    out = run_json(capsys, *spec, "--sublayers", "block", "--increment", "output")
    assert out["measured"] == {"block": "output"}


# --------------------------------------------------------------------------- frictions


def test_ctrl_c_is_one_line_and_exit_130_naming_the_cache(monkeypatch, capsys, tmp_path):
    import loopprobe.experiments.growth as growth

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(growth, "reference_growth", interrupted)
    cache = str(tmp_path / "c")
    assert main(["increments", "--N", "1,2", "--cache", cache]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cached in {cache}" in err and "Traceback" not in err
    assert main(["increments", "--N", "1,2"]) == 130
    assert "nothing was cached" in capsys.readouterr().err


def test_phi_fit_checks_the_plot_path_before_fitting(tmp_path, capsys):
    err = error_of(capsys, "phi-fit", "missing.csv", "--plot", str(tmp_path / "no" / "p.png"))
    assert "--plot" in err and "does not exist" in err


def test_the_report_page_shows_paths_relative_to_the_report(tmp_path):
    from loopprobe.report.render import relative_paths

    data = tmp_path / "data"
    data.mkdir()
    results = {"notes": [f"cached cells: {data}", "rule 1/N"], "command": f"x --out {data}"}
    shown = relative_paths(results, tmp_path / "report")
    assert shown["notes"] == [f"cached cells: {os.path.join('..', 'data')}", "rule 1/N"]
    assert shown["command"] == results["command"]  # a command line stays as typed


def test_coord_check_plot_labels_the_y_axis_with_the_quantity():
    import pandas as pd

    df = pd.DataFrame({"N": [1, 2, 1, 2], "value": [1.0, 1.1, 1.0, 1.2], "step": [1, 1, 2, 2],
                       "group": "h_N", "quantity": "state_change"})  # fmt: skip
    fig = lp.plots.coord_check(df)
    assert "state_change" in fig.axes[0].get_ylabel()


def test_a_narrow_log_axis_still_has_tick_labels():
    import pandas as pd

    df = pd.DataFrame({"R": [2, 4, 8], "dF_true": [2.31e-3, 2.33e-3, 2.35e-3], "norm": "x"})
    fig = lp.plots.delta_f_vs_R(df, y="dF_true", slopes={})
    fig.canvas.draw()
    assert [t.get_text() for t in fig.axes[0].get_yticklabels() if t.get_text()]
