"""benchmarks/bench_gpu.py runs in CI at reduced size on CPU (its CUDA run needs a GPU)."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_gpu.py"


def run(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, env=env, timeout=120
    )


def test_the_gpu_benchmark_runs_on_cpu_at_reduced_size_and_reports_every_quantity():
    proc = run("--device", "cpu", "--small", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["device"] == "CPU" and report["max_iter"] == 2
    rows = report["rows"]
    assert list(rows) == ["step", "G", "G low", "U", "kappa"]
    for row in rows.values():
        assert row["wall"] > 0 and math.isfinite(row["wall"])
    # K=2, R=2: one operator per visit (2KR = 8) and one tied sum per sublayer (2K = 4).
    assert rows["U"]["note"].startswith("12 operators")
    kappa = float(rows["kappa"]["note"].split()[1].rstrip(","))
    assert 0 < kappa < math.inf  # 2 iterations: not converged, so 0 <= kappa <= R need not hold


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_the_default_gpu_run_says_it_was_not_run():
    proc = run()
    assert proc.returncode != 0
    assert "NOT RUN on a GPU" in proc.stderr
