"""A resumed monitor measures what the run measured before the checkpoint."""

from __future__ import annotations

import json

import numpy as np
import test_inject_increments as ti

import loopprobe as lp
from loopprobe.monitor.monitor import Monitor


def _monitor(model) -> Monitor:
    return Monitor(model, ti._idx(), ti._loss, diagnostics=("increments",), every=1,
                   sublayers=["block"])  # fmt: skip


def test_the_first_decision_by_size_survives_a_resume_from_state_dict():
    model = ti._small_branch()
    first = _monitor(model)
    first.step(0)  # decided by size alone: output - input, pinned
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
    assert state["pinned_increment"] == {"increment": "delta"}
    ti._train(model)  # 20 Adam steps: now auto cannot tell (test_inject_increments)
    resumed = _monitor(model)
    resumed.load_state_dict(state)
    resumed.step(1)
    assert "increments_failed" not in set(resumed.frame.quantity)
    rows = resumed.frame[(resumed.frame.quantity == "inc_rms") & (resumed.frame.step == 1)]
    delta = lp.increments(model, ti._idx(), sublayers=["block"], increment="delta")
    np.testing.assert_allclose(rows.value.to_numpy(), delta.inc_rms, rtol=1e-12)
    assert sorted(set(resumed.frame.step)) == [0, 1]


def test_a_checkpoint_from_before_the_key_loads_and_the_run_decides_afresh():
    mon = _monitor(ti._small_branch())
    mon.load_state_dict({"runs": 3, "rows": []})  # no "pinned_increment": an older checkpoint
    mon.step(3)
    assert "increments_failed" not in set(mon.frame.quantity)
    assert mon.state_dict()["pinned_increment"] == {"increment": "delta"}
