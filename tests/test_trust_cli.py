"""Issue 24 on the command line and in loopprobe.testing: no wrong number reported as valid.

``--json`` is exactly one strict JSON object even when the user's code prints; per-sublayer
records say their role; F is named when ``--output`` picks it; NaN, inf and a missing value
stay distinct; the model's own exception exits 1 (2 is bad input); an unconverged run says
so in text and JSON; ``check_probe_leaves_model_unchanged`` catches every kind of change a
probe could leave behind.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from _testing_family import batch, loop, loss

import loopprobe as lp
import loopprobe.testing as lpt
from loopprobe._io import to_jsonable
from loopprobe.cli import main
from loopprobe.cli._common import print_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = ["--max-iter", "30"]

# Written the way third-party code is: prints while loading and in forward, a tuple output,
# an exit head applied after every round, a forward that can raise.
USER_MODULE = textwrap.dedent(
    '''
    import torch
    from torch import nn

    D = 6


    class ExitHeadLoop(nn.Module):
        """One block R times; an exit head after every round (reused: role 'head')."""

        def __init__(self, R=3, chatty=False, broken=False):
            super().__init__()
            self.R, self.chatty, self.broken = R, chatty, broken
            self.inp = nn.Linear(D, D)
            self.block = nn.Sequential(nn.Linear(D, 2 * D), nn.Tanh(), nn.Linear(2 * D, D))
            self.head = nn.Linear(D, 3)

        def forward(self, x):
            if self.chatty:
                print("forward: running", self.R, "rounds")
            if self.broken:
                raise ValueError("mat1 and mat2 shapes cannot be multiplied (my layer)")
            h0 = self.inp(x)
            h, exits = h0, []
            for _ in range(self.R):
                h = h + self.block(h)
                exits.append(self.head(h))
            return torch.stack(exits).sum(0), h, h0


    def make(R=3):
        torch.manual_seed(0)
        return ExitHeadLoop(R).double()


    def make_chatty(R=3):
        print("loading weights from ./checkpoint.pt ... done")
        torch.manual_seed(0)
        return ExitHeadLoop(R, chatty=True).double()


    def make_broken(R=3):
        torch.manual_seed(0)
        return ExitHeadLoop(R, broken=True).double()


    def batch(model=None):
        return torch.randn(4, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


    def exits(out):
        return out[0]


    def start(out):
        """F that the loop does not reach: every U is 0, so kappa is 0/0."""
        return out[2]


    def loss_on_stream(out, inputs):
        return out[1].pow(2).mean()
    '''
)


@pytest.fixture
def mod(fresh_cwd):
    """The user's module in a fresh cwd (not on sys.path, as for the console script)."""
    return fresh_cwd("trustmodel", USER_MODULE)


def kappa_argv(mod: str, factory: str = "make", *extra: str) -> list[str]:
    return ["kappa", "--model", f"{mod}:{factory}", "--inputs", f"{mod}:batch", *extra]


def run(capsys, argv: list[str], code: int = 0) -> tuple[str, str]:
    got = main(argv)
    captured = capsys.readouterr()
    assert got == code, captured.err
    return captured.out, captured.err


# --------------------------------------------------------------------------- 1. --json purity


def test_json_stdout_is_one_object_when_the_factory_and_the_forward_print(mod, tmp_path):
    argv = kappa_argv(mod, "make_chatty", "--output", f"{mod}:exits", *FAST, "--json")
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "loopprobe.cli", *argv],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)  # the whole of stdout: nothing before or after
    assert report["M"] == 3  # the 3 block visits: the exit head's 3 are not the loop body
    assert "loading weights from ./checkpoint.pt ... done" in proc.stderr
    assert "forward: running 3 rounds" in proc.stderr


def test_in_process_json_leaves_the_users_prints_on_stderr_and_restores_stdout(mod, capsys):
    argv = kappa_argv(mod, "make_chatty", "--output", f"{mod}:exits", *FAST)
    out, err = run(capsys, [*argv, "--json"])
    assert json.loads(out)["M"] == 3  # body visits only (the exit head is not counted)
    assert "loading weights" in err and "forward: running" in err
    print("after")  # stdout is stdout again once the command returned
    assert capsys.readouterr().out == "after\n"


# --------------------------------------------------------------------------- 2. roles


def test_every_sublayer_record_of_kappa_carries_the_role_the_probe_found(mod, capsys):
    out, _ = run(capsys, [*kappa_argv(mod, "make", "--output", f"{mod}:exits", *FAST), "--json"])
    report = json.loads(out)
    sys.path.insert(0, os.getcwd())
    try:
        user = __import__(mod)
    finally:
        sys.path.remove(os.getcwd())
    with lp.attach(user.make()) as probe:
        found = {s.name: s.role for s in probe.sublayers(user.batch())}
    assert {s["sublayer"]: s["role"] for s in report["sublayers"]} == found
    assert found == {"block": "body", "head": "head"}
    assert report["kappa_note"].endswith("excluded: ['head']")


# --------------------------------------------------------------------------- 3. F named


def test_F_names_the_output_function_in_text_and_json_of_kappa_and_bound(mod, capsys):
    pick = ["--output", f"{mod}:exits"]
    named = f"the tensor --output {mod}:exits returns from the model output"
    text, _ = run(capsys, kappa_argv(mod, "make", *pick, *FAST))
    assert f"F: {named}" in text.splitlines()
    out, _ = run(capsys, [*kappa_argv(mod, "make", *pick, *FAST), "--json"])
    assert json.loads(out)["F"] == named
    argv = ["bound", "--R", "2,3", "--model", f"{mod}:make", "--inputs", f"{mod}:batch", *pick]
    argv += ["--alpha", "1", "--beta", "1", *FAST]
    out, _ = run(capsys, [*argv, "--json"])
    assert json.loads(out)["F"] == named
    text, _ = run(capsys, argv)
    assert f"F: {named}" in text.splitlines()


def test_the_reference_model_names_its_F_too(capsys):
    out, _ = run(capsys, ["kappa", "--R", "2", "--d-model", "8", "--heads", "2", "--seq", "4",
                          "--batch", "2", *FAST, "--json"])  # fmt: skip
    assert json.loads(out)["F"] == "the model output (the reference LoopedGPT's logits)"


# --------------------------------------------------------------------------- 4. NaN and inf


def test_nan_inf_and_none_come_back_distinct_from_strict_json(capsys):
    values = {
        "nan": float("nan"),
        "inf": np.float64("inf"),
        "-inf": torch.tensor(-math.inf, dtype=torch.float64),
        "none": None,
        "row": np.array([1.5, np.nan]),
    }
    print_json(values)
    text = capsys.readouterr().out
    back = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict token {c}"))
    assert back == {
        "nan": "NaN",
        "inf": "Infinity",
        "-inf": "-Infinity",
        "none": None,
        "row": [1.5, "NaN"],
    }
    assert math.isnan(float(back["nan"])) and float(back["-inf"]) == -math.inf
    assert to_jsonable(float("inf")) != to_jsonable(float("nan")) != to_jsonable(None)


def test_an_undefined_kappa_is_NaN_in_the_json_not_null_and_not_converged(mod, capsys):
    argv = kappa_argv(mod, "make", "--output", f"{mod}:start", "--loss", f"{mod}:loss_on_stream")
    out, _ = run(capsys, [*argv, *FAST, "--json"])
    report = json.loads(out)
    assert report["kappa"] == "NaN" and report["sublayers"][0]["kappa"] == "NaN"
    assert report["sublayers"][0]["U_max"] == 0.0
    assert report["converged"] is False and "NaN" in report["reason"]
    text, _ = run(capsys, [*argv, *FAST])
    assert text.splitlines()[-1] == f"converged: NO: {report['reason']}"  # no --max-iter hint


# --------------------------------------------------------------------------- 5. whose error


@pytest.mark.parametrize("command", ["kappa", "bound", "redundancy"])
def test_a_value_error_raised_in_the_models_forward_exits_1_and_is_named_as_the_models(
    mod, capsys, command
):
    argv = [command, "--model", f"{mod}:make_broken", "--inputs", f"{mod}:batch"]
    if command == "bound":
        argv += ["--R", "2,3", "--alpha", "1", "--beta", "1"]
    if command != "redundancy":
        argv += ["--output", f"{mod}:exits"]
    out, err = run(capsys, argv, code=1)
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith(
        f"loopprobe {command}: error: the model raised ValueError in its own code ({mod}.py:"
    )
    assert ", ExitHeadLoop.forward): mat1 and mat2 shapes cannot be multiplied" in err
    with pytest.raises(ValueError, match="my layer"):
        main([*argv, "--debug"])


def test_an_error_in_the_users_factory_is_still_bad_input_with_exit_2(mod, capsys):
    (open("failing_factory.py", "w")).write("def make():\n    raise ValueError('no such size')\n")
    try:
        _, err = run(capsys, ["kappa", "--model", "failing_factory:make"], code=2)
    finally:
        sys.modules.pop("failing_factory", None)
    assert "make() raised ValueError: no such size" in err


# --------------------------------------------------------------------------- 6. unconverged


def test_an_unconverged_run_says_NO_with_its_reason_in_text_and_json_and_exits_0(mod, capsys):
    argv = kappa_argv(mod, "make", "--output", f"{mod}:exits", "--max-iter", "1")
    out, _ = run(capsys, [*argv, "--json"])
    report = json.loads(out)
    assert report["converged"] is False
    assert "not converged after up to 1 iterations" in report["reason"]
    assert any(not s["converged"] for s in report["sublayers"])
    text, _ = run(capsys, argv)
    assert text.splitlines()[-1] == f"converged: NO: {report['reason']} (raise --max-iter)"


# --------------------------------------------------------------------------- 7. model unchanged


def x_for(model):
    return batch(model, torch.Generator().manual_seed(0))


def planted(monkeypatch, bug):
    """``lp.bound_check`` with ``bug(model)`` run after the real probe returned."""
    real = lp.bound_check

    def leaky(probe, *args, **kwargs):
        out = real(probe, *args, **kwargs)
        bug(probe.model)
        return out

    monkeypatch.setattr(lp, "bound_check", leaky)


def nudge(model):
    w = model.out.weight
    with torch.no_grad():  # one ulp of one entry
        w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(math.inf, dtype=w.dtype))


def flip_zero(model):
    with torch.no_grad():
        model.out.bias[0] = -0.0  # == 0.0, so torch.equal cannot see it


def write_grad(model):
    model.out.weight.grad = torch.zeros_like(model.out.weight)


def bump_buffer(model):
    model.visits_seen.add_(1)


def draw_torch(model):
    torch.rand(1)


def draw_numpy(model):
    np.random.rand()


def draw_python(model):
    random.random()


def to_eval(model):
    model.blocks[0].eval()


def freeze(model):
    model.inp.weight.requires_grad_(False)


def swap_parameter(model):
    model.out.weight = torch.nn.Parameter(model.out.weight.detach().clone())


def tensor_hook(model):
    model.inp.weight.register_hook(lambda g: g)


def global_hook(model):
    torch.nn.modules.module.register_module_forward_hook(lambda *a: None)


@pytest.mark.parametrize(
    ("bug", "needle"),
    [
        (nudge, r"out.weight: value changed \(1 of 64 entries .*, max \|diff\| [\d.]+e-1[5-8]\)"),
        (flip_zero, r"out.bias: value changed \(1 of 8 entries differ bitwise, max \|diff\| 0\)"),
        (write_grad, r"out.weight.grad: value changed \(64 of 64 entries"),
        (bump_buffer, r"visits_seen: value changed"),
        (draw_torch, r"torch's global RNG state advanced"),
        (draw_numpy, r"numpy's global random state advanced"),
        (draw_python, r"Python's global random state advanced"),
        (to_eval, r"blocks.0: train/eval mode True -> False"),
        (freeze, r"inp.weight: requires_grad True -> False"),
        (swap_parameter, r"out.weight: replaced by another tensor object"),
        (tensor_hook, r"inp.weight: 0 hooks -> 1 \(tensor hook\)"),
        (global_hook, r"\(torch, every module\): 0 hooks -> 1 \(global forward hooks\)"),
    ],
)
def test_a_probe_that_leaves_any_change_behind_fails_the_check_as_a_loopprobe_bug(
    monkeypatch, bug, needle
):
    m = loop(R=3)
    m.register_buffer("visits_seen", torch.zeros((), dtype=torch.float64))
    with torch.no_grad():
        m.out.bias[0] = 0.0
    x = x_for(m)
    lpt.check_probe_leaves_model_unchanged(m, x, loss)  # sane before the bug is planted
    planted(monkeypatch, bug)
    hooks = dict(torch.nn.modules.module._global_forward_hooks)
    try:
        with pytest.raises(AssertionError, match=needle + r".*\n.*loopprobe bug"):
            lpt.check_probe_leaves_model_unchanged(m, x, loss)
    finally:
        for k in set(torch.nn.modules.module._global_forward_hooks) - set(hooks):
            del torch.nn.modules.module._global_forward_hooks[k]


def test_the_comparison_behind_the_check_is_bitwise_a_nan_left_alone_is_unchanged():
    from loopprobe.testing.checks import _differences, _snapshot

    m = loop(R=3)
    m.register_buffer("undefined", torch.tensor([math.nan, 0.0], dtype=torch.float64))
    before = _snapshot(m)
    assert _differences(before, m) == []  # torch.equal(nan, nan) is False: not a change
    m.undefined[1] = -0.0
    assert _differences(before, m) == [
        "undefined: value changed (1 of 2 entries differ bitwise, max |diff| 0)"
    ]
