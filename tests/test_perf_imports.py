"""What the default report pays for at import and on its first model call: no scipy when
the report's modules load (scipy is imported by the functions that use it), no Dynamo when
an uncompiled model is called (``call_model`` sets the eager stance only once Dynamo is
loaded, i.e. once something may be compiled). Each check runs in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fresh(code: str) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_report_modules_do_not_import_scipy():
    got = _fresh(
        "import sys, json\n"
        "import loopprobe.report.sections, loopprobe.report.pipeline\n"
        "import loopprobe.estimate.health_checks, loopprobe.estimate.scaling\n"
        "import loopprobe.estimate.finitestep_summary\n"
        "print(json.dumps({'scipy': sorted(m for m in sys.modules if m.startswith('scipy'))}))"
    )
    assert got["scipy"] == []


def test_calling_an_uncompiled_model_does_not_import_dynamo():
    got = _fresh(
        "import sys, json, torch\n"
        "from loopprobe.record.types import call_model\n"
        "m = torch.nn.Linear(3, 3)\n"
        "y = call_model(m, torch.ones(2, 3))\n"
        "ok = torch.equal(y, m(torch.ones(2, 3)))\n"
        "print(json.dumps({'dynamo': 'torch._dynamo' in sys.modules, 'same': ok}))"
    )
    assert got == {"dynamo": False, "same": True}


def test_round_map_jvp_is_traced_only_once_plain_jvps_cost_as_much(monkeypatch):
    import types

    import torch

    from loopprobe.differentiate import roundmap
    from loopprobe.differentiate.roundmap import TracedJVP

    clock = [0.0]

    def process_time():  # every plain JVP measures 6 ms of CPU
        clock[0] += 0.006
        return clock[0]

    monkeypatch.setattr(roundmap, "time", types.SimpleNamespace(process_time=process_time))
    W = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    h, v = torch.ones(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    jvp = TracedJVP(lambda x: torch.tanh(W @ x), h, trace=True)
    first = jvp(v)
    for _ in range(29):  # 30 calls, 0.18 s: less than a trace costs
        jvp(v)
    assert jvp.traced is None and not jvp.tried
    for _ in range(15):  # 45 calls, 0.27 s: the trace pays from here on
        jvp(v)
    assert jvp.tried and jvp.traced is not None
    assert torch.allclose(jvp(v), first, rtol=1e-12, atol=0)
