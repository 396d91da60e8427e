"""A user's suite run with ``-W error`` passes on a correct model: no warning of torch's about
its own internals reaches the user from inside loopprobe (torch 2.13 deprecates the
``torch.jit.script`` its forward-AD setup calls 18 times, on the first JVP of a process).
Each flow runs in a fresh interpreter, as a user's first call does."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

FLOW = """
import sys
sys.path.insert(0, "tests")
import torch
import torch.nn.functional as F
import loopprobe as lp
torch.set_num_threads(1)
cfg = lp.models.GPTConfig(K=1, R=3, d_model=8, n_heads=2, seq_len=6, vocab_size=16)
model = lp.models.LoopedGPT(cfg, generator=torch.Generator().manual_seed(0))
idx, tgt = lp.tasks.random_tokens(2, 6, 16, generator=torch.Generator().manual_seed(1))
def loss_fn(out, inputs):
    return F.cross_entropy(out.flatten(0, 1), tgt.flatten())
"""

FLOWS = {
    "the sensitivity norms (the first JVP) of the reference model": """
import warnings
with lp.attach(model) as probe:
    value = lp.sensitivity_norms(probe, idx).visit_norms[0].value
with warnings.catch_warnings(record=True) as caught:  # the filter is narrow: a user's own
    warnings.simplefilter("always")                   # torch.jit.script still warns
    torch.jit.script(torch.nn.ReLU())
assert any("torch.jit.script" in str(w.message) for w in caught)
print(value)
""",
    "the monitor's JVP diagnostics on a third-party for-loop model": """
import thirdparty_models as tp
m = tp.make(tp.ForLoopModel)
x = tp.randn(2, 4, 5)
mon = lp.Monitor(m, x, lambda out, inp: out.pow(2).mean(), every=1, strict=True,
                 diagnostics=["updates", "increments", "sensitivity"])
print(len(mon.step(0)))
""",
    "the spectral radius of one round (a traced JVP)": """
rm = lp.round_map(model, idx)
print(lp.spectral_radius(rm.T, rm.h0, k=2).value)
""",
}


@pytest.mark.parametrize("flow", list(FLOWS), ids=lambda s: s.split(" (")[0].replace(" ", "_"))
def test_a_first_call_of_a_user_flow_raises_no_warning_under_W_error(flow):
    code = FLOW + textwrap.dedent(FLOWS[flow])
    out = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.split()[-1]) > 0  # the flow computed its number
