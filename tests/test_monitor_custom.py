"""User-defined monitor diagnostics (``Monitor(custom={name: fn})``): their numbers are rows
of the frame next to the built-in ones, on their own every-n-th schedule, under the same
guards (the training RNG untouched, a failure a ``<name>_failed`` row and one warning)."""

from __future__ import annotations

import math

import pytest
import thirdparty_models as tp
import torch

import loopprobe as lp


def weight_norms(model, inputs):  # a Cockpit-style quantity: per-layer parameter norms
    return {name: p.norm() for name, p in model.named_parameters() if name.endswith("weight")}


def output_rms(model, inputs):
    with torch.no_grad():
        return model(inputs).pow(2).mean().sqrt()


def test_custom_diagnostics_are_rows_on_their_own_schedule_next_to_the_built_in_ones():
    model, x = tp.make(tp.ForLoopModel), tp.randn(2, 4, 5)
    mon = lp.Monitor(model, x, lambda out, inp: out.pow(2).mean(), every=1,
                     diagnostics={"updates": 1, "rms": 2},
                     custom={"weights": weight_norms, "rms": output_rms})  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        if step == 2:
            with torch.no_grad():  # what the monitor is to record at step 2
                want = float(model(x).pow(2).mean().sqrt())
        mon.step(step)
    f = mon.frame
    rms = f[f.quantity == "rms"]
    assert rms.step.tolist() == [0, 2] and rms.sublayer.isna().all()
    assert rms.value.iloc[1] == want
    w = f[(f.quantity == "weights") & (f.step == 3)]
    assert sorted(w.sublayer) == sorted(n for n, _ in model.named_parameters() if "weight" in n)
    direct = {n: float(p.detach().norm()) for n, p in model.named_parameters()}
    assert all(math.isclose(v, direct[s]) for s, v in zip(w.sublayer, w.value, strict=True))
    assert set(f[f.quantity == "G_norm"].step) == {0, 1, 2, 3}


def test_a_custom_diagnostic_that_raises_is_a_failed_row_and_leaves_the_training_rng_alone():
    model, x = tp.make(tp.ForLoopModel), tp.randn(2, 4, 5)

    def noisy(model, inputs):  # draws from torch's global RNG, then fails
        torch.randn(3)
        return "not a number"

    mon = lp.Monitor(model, x, lambda out, inp: out.pow(2).mean(), diagnostics=["updates"],
                     every=1, custom={"noisy": noisy})  # fmt: skip
    torch.manual_seed(5)
    with pytest.warns(RuntimeWarning, match="diagnostic 'noisy' failed"):
        rows = mon.step(0)
    after = torch.randn(2)
    torch.manual_seed(5)
    assert torch.equal(after, torch.randn(2))  # the monitor drew nothing from the training RNG
    failed = rows[rows.quantity == "noisy_failed"]
    assert len(failed) == 1 and "return a number" in failed.reason.iloc[0]
    assert (rows.quantity == "G_norm").any()


@pytest.mark.parametrize(
    ("custom", "err", "match"),
    [
        ({"kappa": output_rms}, ValueError, "not one of"),
        ({"a/b": output_rms}, ValueError, "no '/'"),
        ({"rms": 3}, TypeError, "must be callable"),
        ([output_rms], TypeError, "mapping"),
    ],
)
def test_bad_custom_diagnostics_are_named(custom, err, match):
    with pytest.raises(err, match=match):
        lp.Monitor(tp.make(tp.ForLoopModel), tp.randn(2, 4, 5), custom=custom)
