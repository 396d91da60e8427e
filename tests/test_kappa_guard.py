"""`loopprobe kappa` refuses an R that cannot fit, with its estimate, before it computes.

The estimate is one forward's saved tensors at R = 1 and 2, linear in R, times the measured
peak of a κ run per saved byte (``loopprobe._memory.KAPPA_PEAK_PER_SAVED``). Its linear part
is checked against a forward at the larger R itself.
"""

from __future__ import annotations

import torch

from loopprobe import _memory
from loopprobe._memory import GiB, check_fits, rounds_bytes, saved_bytes
from loopprobe.cli import main
from loopprobe.models import GPTConfig, LoopedGPT

SMALL = ["kappa", "--d-model", "16", "--heads", "2", "--seq", "4", "--batch", "1"]


def _saved(R: int) -> int:
    model = LoopedGPT(GPTConfig(vocab_size=16, seq_len=4, d_model=8, n_heads=2, K=2, R=R),
                      generator=torch.Generator().manual_seed(0)).double()
    tokens = torch.randint(0, 16, (2, 4), generator=torch.Generator().manual_seed(1))
    return saved_bytes(model, tokens, exclude=[*model.parameters(), *model.buffers()])


def test_the_linear_estimate_matches_the_bytes_a_forward_at_R_saves():
    for R in (5, 12):
        assert abs(rounds_bytes(_saved(1), _saved(2), R) - _saved(R)) <= 0.05 * _saved(R)


def test_an_R_that_cannot_fit_is_refused_with_the_estimate_and_exit_code_2(monkeypatch, capsys):
    monkeypatch.setattr(_memory, "available_bytes", lambda device="cpu": 2**20)  # 1 MiB free
    assert main([*SMALL, "--R", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "kappa --R 8 needs about" in err and "GiB is free; lower --R" in err


def test_an_R_that_fits_runs_and_the_guard_passes(monkeypatch, capsys):
    monkeypatch.setattr(_memory, "available_bytes", lambda device="cpu": 64 * GiB)
    assert main([*SMALL, "--R", "3", "--max-iter", "5", "--json"]) == 0
    assert '"kappa"' in capsys.readouterr().out


def test_check_fits_without_a_reading_of_free_memory_lets_the_run_go():
    check_fits("x", 10 * GiB, None, "fix")  # no reading: no refusal
    check_fits("x", GiB, 2 * GiB, "fix")
