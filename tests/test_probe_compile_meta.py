"""A model compiled in place (``model.compile()``) is probed eagerly: the same kappa as its
uncompiled twin, and Dynamo never traces loopprobe's hooks (before: "no visit of any sublayer
gets a gradient"); a model on the meta device is one error naming the fix."""

from __future__ import annotations

import copy

import pytest
import thirdparty_models as tp
import torch
import torch.nn.functional as F

import loopprobe as lp


def mse(out: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


@pytest.mark.parametrize("build", ["reference", "third-party"])
def test_a_model_compiled_in_place_has_its_uncompiled_twins_kappa_and_stays_compiled(build):
    if build == "reference":
        cfg = lp.models.GPTConfig(K=1, R=3, d_model=8, n_heads=2, seq_len=6, vocab_size=16)
        model = lp.models.LoopedGPT(cfg, generator=torch.Generator().manual_seed(0)).double()
        x, tgt = lp.tasks.random_tokens(2, 6, 16, generator=torch.Generator().manual_seed(1))

        def loss(out, inputs):
            return F.cross_entropy(out.flatten(0, 1), tgt.flatten())
    else:
        model, x, loss = tp.make(tp.ForLoopModel), tp.randn(2, 4, 5), mse
    twin = copy.deepcopy(model)
    model.compile(backend="eager")  # in place: Module.__call__ runs the compiled forward
    out = model(x)  # the user's compiled forward, traced once
    with lp.attach(twin) as probe:
        want = lp.visit_alignment(probe, x, loss, tol=1e-6)
    torch._dynamo.utils.counters.clear()
    with lp.attach(model) as probe:
        got = lp.visit_alignment(probe, x, loss, tol=1e-6)
    assert got.kappa == want.kappa and got.converged
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0  # nothing traced
    assert model._compiled_call_impl is not None and torch.equal(model(x), out)


def test_a_model_on_the_meta_device_is_one_error_naming_the_fix():
    cfg = lp.models.GPTConfig(K=1, R=3, d_model=8, n_heads=2, seq_len=6, vocab_size=16)
    with torch.device("meta"):
        model = lp.models.LoopedGPT(cfg)
    with pytest.raises(ValueError, match="'tok_emb.weight' is on the meta device.*materialise"):
        lp.attach(model)
    with pytest.raises(ValueError, match="materialise the model first"):
        lp.Monitor(model, torch.zeros(2, 6, dtype=torch.long), every=1)
