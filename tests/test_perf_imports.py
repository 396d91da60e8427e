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
