"""Thread count (issue 18.1): the opt-in ``lp.threads``, the size rule, and the CLI default."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

import loopprobe as lp
from loopprobe import tasks
from loopprobe._threads import THRESHOLD, auto_threads, work
from loopprobe.cli import main
from loopprobe.cli._common import apply_threads
from loopprobe.models import GPTConfig, LoopedGPT

lp_threads = importlib.import_module("loopprobe._threads")  # the module; lp.threads is the function
TINY = ["--d-model", "8", "--heads", "2", "--seq", "4", "--batch", "2", "--vocab", "11"]


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield n
    torch.set_num_threads(n)


def gpt(d: int, seq: int, K: int = 2, R: int = 4) -> LoopedGPT:
    cfg = GPTConfig(vocab_size=64, seq_len=seq, d_model=d, n_heads=4, K=K, R=R, norm="deeploop")
    return LoopedGPT(cfg, generator=torch.Generator().manual_seed(0))


def test_lp_threads_sets_the_count_and_restores_it_on_exit_and_on_error(restore_threads):
    torch.set_num_threads(3)
    with lp.threads(1) as n:
        assert n == 1 and torch.get_num_threads() == 1
    assert torch.get_num_threads() == 3
    with pytest.raises(KeyError), lp.threads(2):
        assert torch.get_num_threads() == 2
        raise KeyError("inside")
    assert torch.get_num_threads() == 3


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_lp_threads_rejects_a_count_that_is_not_a_positive_integer(bad):
    with pytest.raises(ValueError, match=r"threads: n=.*integer >= 1"), lp.threads(bad):
        pass


def test_the_library_never_sets_the_thread_count(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(n))
    model = gpt(8, 4, K=1, R=2).double()
    idx, targets = tasks.random_tokens(2, 4, 64, torch.Generator().manual_seed(0))

    def loss(logits, _inputs):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 64), targets.reshape(-1))

    with lp.attach(model) as probe:
        lp.visit_alignment(probe, idx, loss, max_iter=3)
    lp.increments(model, idx)
    assert calls == []


def test_work_is_parameters_times_token_positions():
    model = gpt(32, 16)
    params = sum(p.numel() for p in model.parameters())
    ids = torch.zeros(4, 16, dtype=torch.long)
    assert work(model, ids) == params * 64
    assert work(model, (ids, torch.ones(4, 16))) == params * 64  # the token ids count
    assert work(model, {"x": torch.ones(4, 16, 32)}) == params * 64  # features dropped
    assert work(model, None) == params


def test_the_reference_sizes_fall_on_both_sides_of_the_threshold():
    small = work(gpt(32, 16), torch.zeros(4, 16, dtype=torch.long))  # the CLI default
    large = work(gpt(256, 128), torch.zeros(8, 128, dtype=torch.long))  # issue 18's size
    assert small < THRESHOLD / 100 and large > THRESHOLD
    assert auto_threads(small, default=2, idle=2) == 1
    assert auto_threads(large, default=2, idle=2) == 2


def test_above_the_threshold_the_default_is_capped_at_the_idle_cores(monkeypatch):
    assert auto_threads(2 * THRESHOLD, default=8, idle=3) == 3
    assert auto_threads(2 * THRESHOLD, default=2, idle=16) == 2
    monkeypatch.setattr(lp_threads, "idle_cores", lambda: None)  # no load average (Windows)
    assert auto_threads(2 * THRESHOLD, default=4) == 4
    monkeypatch.setattr(lp_threads, "idle_cores", lambda: 1)
    assert auto_threads(2 * THRESHOLD, default=4) == 1


def test_idle_cores_is_at_least_one_and_at_most_the_cores():
    idle = lp_threads.idle_cores()
    assert idle is None or 1 <= idle <= (os.cpu_count() or 1)


def test_apply_threads_prefers_the_flag_then_the_rule(restore_threads, monkeypatch):
    monkeypatch.setattr(lp_threads, "idle_cores", lambda: 8)
    ns = argparse.Namespace(threads=None, torch_default_threads=3)
    assert apply_threads(ns, 10.0) == 1 and torch.get_num_threads() == 1
    assert apply_threads(ns, 2 * THRESHOLD) == 3 and torch.get_num_threads() == 3
    assert apply_threads(ns, None) == 1  # no torch work
    ns.threads = 2
    assert apply_threads(ns, 10.0) == 2 and ns.threads_used == 2


def test_kappa_on_a_small_model_uses_one_thread_and_restores_the_callers_count(
    restore_threads, capsys
):
    torch.set_num_threads(2)
    assert main(["kappa", "--K", "1", "--R", "2", *TINY, "--max-iter", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["threads"] == 1
    assert torch.get_num_threads() == 2


def test_threads_flag_overrides_the_rule_for_the_whole_command(restore_threads, monkeypatch):
    import loopprobe.cli.kappa as kappa

    seen = []

    def recording(args):
        seen.append(torch.get_num_threads())
        raise ValueError("stop here")

    monkeypatch.setattr(kappa, "build_report", recording)
    torch.set_num_threads(1)
    assert main(["kappa", "--K", "1", "--R", "2", "--threads", "3"]) == 2
    assert seen == [3] and torch.get_num_threads() == 1


def test_the_theory_calculator_runs_without_loading_torch():
    code = (
        "import sys\nfrom loopprobe.cli import main\n"
        "main(['theory', '--K', '2', '--R', '4'])\nassert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
