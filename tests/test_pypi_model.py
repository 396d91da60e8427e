"""Probing a looped model someone else published on PyPI, without changing its code.

The model is ``tiny-recursive-model`` 0.0.15 (TRM, a test-only dependency in the ``dev``
extra). What its code does (``tiny_recursive_model/trm.py``):

- one shared ``network`` (an ``MLPMixer1D``: ``depth`` blocks, each a token-mixing and a
  channel-mixing ``PreNormResidual``, then a final ``LayerNorm``) is the only reused module;
- ``deep_refinement`` runs ``T = num_refinement_blocks`` blocks; each block calls the
  network ``n = num_latent_refinements`` times on the latents and once on the outputs, so
  the forward makes ``T (n + 1)`` network calls;
- every block but the last runs under ``torch.no_grad()``, so only the last ``n + 1``
  calls carry gradient (forward-visible ``M = T(n+1)``, gradient-visible ``M_g = n+1``);
- ``predict`` repeats ``deep_refinement`` until a halting head fires (ACT-style, data
  dependent), all under ``torch.no_grad()``;
- the variant in ``trm_dense_loss.py`` never uses ``no_grad``: it *detaches* the carry
  after every block but the last ``recurrent_grad_depth`` ones, and its loss reads the
  prediction of every block.

The oracles are the code's own counts (checked twice: from the formula above and by an
independent forward hook on ``model.network``) and an explicitly untied twin: a deep copy
of the model whose ``network`` attribute is replaced by one deep copy of the network per
call (the instance is changed, never the package's code).
"""

from __future__ import annotations

import copy

import pytest
import torch
from _oracles import counting_calls, dense_jacobian, flat_grads
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call

import loopprobe as lp
import loopprobe.testing as lpt
from loopprobe.estimate.sensitivity import sensitivity_norms
from loopprobe.estimate.updates import per_visit_updates

trm = pytest.importorskip("tiny_recursive_model", reason="the dev extra installs it")
trm_dense = pytest.importorskip("tiny_recursive_model.trm_dense_loss")

D, TOKENS, SEQ, BATCH = 8, 6, 5, 2


def make_trm(
    T: int = 3,
    n: int = 2,
    *,
    depth: int = 1,
    dense: bool = False,
    grad_depth: int = 1,
    seed: int = 0,
) -> nn.Module:
    """A tiny TRM in float64, built under a forked RNG (the package draws from torch's)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        net = trm.MLPMixer1D(dim=D, depth=depth, seq_len=SEQ)
        kw = dict(dim=D, num_tokens=TOKENS, network=net)
        kw.update(num_refinement_blocks=T, num_latent_refinements=n)
        if dense:
            model = trm_dense.TinyRecursiveModel(**kw, recurrent_grad_depth=grad_depth)
        else:
            model = trm.TinyRecursiveModel(**kw)
        # The halting head is zero-initialised by the package; give it weights so that
        # the halting decision depends on the data.
        nn.init.normal_(model.to_halt_pred[1].weight, std=1.0)
    return model.double()


def trm_batch(model: nn.Module, seed: int = 1) -> tuple[tuple, torch.Tensor]:
    """``(seq, outputs, latents)`` as the package's Trainer passes them, and labels."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(TOKENS, (BATCH, SEQ), generator=g)
    labels = torch.randint(TOKENS, (BATCH, SEQ), generator=g)
    outputs, latents = model.get_initial()
    return (seq, outputs, latents), labels


def pred(out: tuple) -> torch.Tensor:
    """F = the token logits, the third element of the package's return tuple."""
    return out[2]


def ce_loss(labels: torch.Tensor):
    def loss_fn(out: tuple, inputs: tuple) -> torch.Tensor:
        return nn.functional.cross_entropy(pred(out).reshape(-1, TOKENS), labels.reshape(-1))

    return loss_fn


def package_loss(labels: torch.Tensor):
    """The package's own training loss: call the model with ``labels=``."""

    def forward(model: nn.Module, inputs: tuple) -> tuple:
        return model(*inputs, labels=labels)

    return forward, (lambda out, inputs: out[0])


class UntiedNetwork(nn.Module):
    """One deep copy of the network per call: call k computes with ``copies[k]``."""

    def __init__(self, net: nn.Module, calls: int) -> None:
        super().__init__()
        self.copies = nn.ModuleList(copy.deepcopy(net) for _ in range(calls))
        self.k = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.k += 1
        return self.copies[self.k - 1](x)


def untied_twin(model: nn.Module, calls: int) -> nn.Module:
    twin = copy.deepcopy(model)
    twin.network = UntiedNetwork(model.network, calls)
    return twin


# --------------------------------------------------------------------------- discovery


@pytest.mark.parametrize("T, n", [(2, 1), (3, 2), (4, 3)])
def test_discovery_finds_the_shared_network_with_T_times_n_plus_1_visits_and_n_plus_1_with_grad(
    T, n
):
    model = make_trm(T, n)
    inputs, _ = trm_batch(model)
    with counting_calls(model.network) as calls:
        model(*inputs)
    assert len(calls) == T * (n + 1) and sum(calls) == n + 1  # the code, read independently
    table = lp.attach(model).visit_table(inputs, output=pred)
    assert list(table.sublayer) == ["network"]
    row = table.iloc[0]
    assert row.parameters == sum(p.numel() for p in model.network.parameters())
    assert row.visits == T * (n + 1)
    assert row.grad_visible == n + 1
    assert row.no_grad_visits == (T - 1) * (n + 1)
    assert (table.attrs["M"], table.attrs["M_g"]) == (T * (n + 1), n + 1)


def test_heads_and_embeddings_called_once_are_not_sublayers():
    model = make_trm()
    inputs, _ = trm_batch(model)
    subs = lp.attach(model).sublayers(inputs)
    assert [s.modules for s in subs] == [("network",)]
    names = {name for s in subs for name in s.param_names}
    assert all(name.startswith("network.") for name in names)
    assert len(names) == len(list(model.network.parameters())) == 11


@pytest.mark.parametrize("depth", [1, 2])
def test_mixer_residual_branches_named_by_pattern_are_two_sublayers_per_mixer_block(depth):
    T, n = 3, 2
    model = make_trm(T, n, depth=depth)
    inputs, _ = trm_batch(model)
    # network.<block>.<0 token mixing | 1 channel mixing>; the final LayerNorm is
    # network.<depth> (one segment) and is not matched: the paper's grouping.
    table = lp.attach(model, sublayers=["network.*.*"]).visit_table(inputs, output=pred)
    expected = [f"network.{b}.{k}" for b in range(depth) for k in (0, 1)]
    assert list(table.sublayer) == expected
    assert list(table.visits) == [T * (n + 1)] * 2 * depth
    assert list(table.grad_visible) == [n + 1] * 2 * depth
    assert (table.attrs["M"], table.attrs["M_g"]) == (2 * depth * T * (n + 1), 2 * depth * (n + 1))
    token_mixing = model.network[0][0]
    assert table.parameters[0] == sum(p.numel() for p in token_mixing.parameters())


def test_halting_predict_has_data_dependent_trip_counts_and_no_gradient_visible_visit():
    T, n, max_steps = 2, 1, 6
    model = make_trm(T, n)
    inputs, _ = trm_batch(model)
    seq = inputs[0]
    probe = lp.attach(model)
    probe.sublayers(inputs)  # discovered on the training forward
    counts = {}
    for thres in (0.0, 1.1, 0.5):
        fwd = lambda m, x, thres=thres: m.predict(x, thres, max_steps)  # noqa: E731
        with counting_calls(model.network) as calls:
            _, steps = model.predict(seq, thres, max_steps)
        table = probe.visit_table(seq, forward=fwd, output=lambda out: out[0])
        counts[thres] = int(table.visits[0])
        assert counts[thres] == len(calls) == int(steps.max()) * T * (n + 1)
        assert int(table.grad_visible[0]) == 0 and int(table.no_grad_visits[0]) == len(calls)
    assert counts[0.0] == T * (n + 1)  # sigmoid >= 0 always: halts after the first step
    assert counts[1.1] == max_steps * T * (n + 1)  # never halts


@pytest.mark.parametrize("grad_depth", [1, 2])
def test_dense_loss_variant_detaches_the_carry_and_its_own_loss_reaches_every_visit(grad_depth):
    T, n = 3, 2
    model = make_trm(T, n, dense=True, grad_depth=grad_depth)
    inputs, labels = trm_batch(model)
    with counting_calls(model.network) as calls:
        model(*inputs)
    assert calls == [True] * T * (n + 1)  # no torch.no_grad() anywhere in this variant
    table = lp.attach(model).visit_table(inputs, output=pred)
    assert (int(table.visits[0]), int(table.no_grad_visits[0])) == (T * (n + 1), 0)
    # The package's own loss reads the logits of every block: every visit carries gradient,
    # and the carry's detach shows up as zero cross-block terms, not as missing visits.
    forward, loss = package_loss(labels)
    up = per_visit_updates(lp.attach(model), inputs, loss, forward=forward)
    assert up.visible[0].tolist() == [True] * T * (n + 1)
    assert bool((up.G[0].norm(dim=1) > 0).all())


@pytest.mark.parametrize("grad_depth", [1, 2])
def test_dense_loss_variant_counts_only_the_last_blocks_as_gradient_visible_from_F(grad_depth):
    T, n = 3, 2
    model = make_trm(T, n, dense=True, grad_depth=grad_depth)
    inputs, labels = trm_batch(model)
    up = per_visit_updates(lp.attach(model), inputs, ce_loss(labels))  # loss of F alone
    nonzero = (up.G[0].norm(dim=1) > 0).tolist()
    assert nonzero == [False] * (T - grad_depth) * (n + 1) + [True] * grad_depth * (n + 1)
    # F = pred[-1] slices logits stacked from every block: the detached blocks are reachable
    # in the autograd graph with exactly zero gradient, and must not count as visible.
    table = lp.attach(model).visit_table(inputs, output=pred)
    assert int(table.grad_visible[0]) == grad_depth * (n + 1) == table.attrs["M_g"]
    assert up.visible[0].tolist() == nonzero
    rep = lp.visit_alignment(lp.attach(model), inputs, ce_loss(labels), output=pred, max_iter=5)
    assert int(rep.sublayers.R_g[0]) == grad_depth * (n + 1)


# --------------------------------------------------------------------------- G and U


def test_per_visit_updates_sum_to_the_tied_gradient_and_match_the_untied_twin():
    T, n = 3, 2
    model = make_trm(T, n)
    inputs, labels = trm_batch(model)
    up = per_visit_updates(lp.attach(model), inputs, ce_loss(labels))
    G = up.G[0]
    assert G.shape == (T * (n + 1), sum(p.numel() for p in model.network.parameters()))
    assert up.visible[0].tolist() == [False] * (T - 1) * (n + 1) + [True] * (n + 1)
    assert float(G[: (T - 1) * (n + 1)].abs().max()) == 0.0  # no_grad visits get nothing

    lpt.check_updates_sum_to_tied_gradient(model, inputs, ce_loss(labels), rtol=1e-12)
    errors = lpt.check_updates_match_untied_copy(model, inputs, ce_loss(labels), rtol=1e-12)
    assert sorted(errors) == [("network", r) for r in range((T - 1) * (n + 1), T * (n + 1))]


def test_adam_effective_update_sums_to_the_step_a_fresh_torch_adam_takes():
    model = make_trm(2, 1)
    inputs, labels = trm_batch(model)
    up = per_visit_updates(lp.attach(model), inputs, ce_loss(labels), update="adam")
    assert up.method.startswith("adam (fresh, first step)")
    ref = copy.deepcopy(model)
    before = torch.cat([p.detach().reshape(-1) for p in ref.network.parameters()])
    opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    ce_loss(labels)(ref(*trm_batch(ref)[0]), None).backward()
    opt.step()
    after = torch.cat([p.detach().reshape(-1) for p in ref.network.parameters()])
    torch.testing.assert_close(up.tied(0), (before - after) / 1e-3, rtol=1e-6, atol=1e-9)
    assert float(up.G[0][:2].abs().max()) == 0.0  # the no_grad block contributes nothing


def test_visit_sensitivities_match_dense_jacobians_of_the_untied_twin():
    T, n = 2, 1
    model = make_trm(T, n)
    inputs, _ = trm_batch(model)
    sens = sensitivity_norms(lp.attach(model), inputs, output=pred, max_iter=300)
    assert [v.r for v in sens.visits] == [2, 3]  # the gradient-visible visits of the last block
    assert all(e.converged for e in sens.visit_norms)

    full = dict(model.named_parameters())

    def F_model(ps: dict) -> torch.Tensor:
        return pred(functional_call(model, {**full, **ps}, inputs)).reshape(-1)

    errors = lpt.check_sensitivity_matches_dense_jacobian(
        model, inputs, output=pred, visits=[(0, 2), (0, 3)], rtol=1e-6, max_iter=300
    )
    assert sorted(errors) == [("network", 2), ("network", 3)]
    shared = {k: p.detach() for k, p in full.items() if k.startswith("network.")}
    expected = float(torch.linalg.matrix_norm(dense_jacobian(F_model, shared), 2))
    assert sens.tied_norms[0].value == pytest.approx(expected, rel=1e-6)


# --------------------------------------------------------------------------- kappa


def test_kappa_of_each_mixer_branch_equals_the_dense_untied_oracle():
    T, n = 2, 2
    model = make_trm(T, n)
    inputs, labels = trm_batch(model)
    probe = lp.attach(model, sublayers=["network.*.*"])
    rep = lp.visit_alignment(probe, inputs, ce_loss(labels), output=pred, max_iter=300)
    assert (rep.M, rep.M_g) == (2 * T * (n + 1), 2 * (n + 1))
    assert list(rep.sublayers.R) == [T * (n + 1)] * 2
    assert list(rep.sublayers.R_g) == [n + 1] * 2

    twin = untied_twin(model, T * (n + 1))
    ce_loss(labels)(twin(*inputs), None).backward()
    visible = range((T - 1) * (n + 1), T * (n + 1))
    full, twin_full = dict(model.named_parameters()), dict(twin.named_parameters())

    def F_model(ps: dict) -> torch.Tensor:
        return pred(functional_call(model, {**full, **ps}, inputs)).reshape(-1)

    def F_twin(ps: dict) -> torch.Tensor:
        twin.network.k = 0
        return pred(functional_call(twin, {**twin_full, **ps}, inputs)).reshape(-1)

    for j, k in enumerate((0, 1)):
        mine = {n_: p.detach() for n_, p in full.items() if n_.startswith(f"network.0.{k}.")}
        U_tied = torch.linalg.matrix_norm(dense_jacobian(F_model, mine), 2)
        U, G = [], []
        for r in visible:
            copy_r = twin.network.copies[r][0][k]
            G.append(flat_grads(copy_r))
            prefix = f"network.copies.{r}.0.{k}."
            ps = {n_: p.detach() for n_, p in twin_full.items() if n_.startswith(prefix)}
            U.append(float(torch.linalg.matrix_norm(dense_jacobian(F_twin, ps), 2)))
        G_tied = float(torch.stack(G).sum(0).norm())
        kappa = float(U_tied) * G_tied / ((n + 1) * max(U) * max(float(g.norm()) for g in G))
        row = rep.sublayers.iloc[j]
        assert row.kappa == pytest.approx(kappa, rel=1e-6)
        assert 0.0 <= row.kappa <= n + 1
    assert rep.kappa == max(rep.sublayers.kappa)


@settings(max_examples=4)
@given(
    T=st.integers(2, 3),
    n=st.integers(1, 2),
    depth=st.integers(1, 2),
    seed=st.integers(0, 2**16),
    update=st.sampled_from(["sgd", "adam"]),
)
@example(T=2, n=1, depth=1, seed=0, update="sgd")
def test_kappa_of_every_sublayer_lies_in_zero_to_its_gradient_visible_visits(
    T, n, depth, seed, update
):
    model = make_trm(T, n, depth=depth, seed=seed)
    inputs, labels = trm_batch(model, seed=seed + 1)
    rep = lpt.check_kappa_in_range(
        model,
        inputs,
        ce_loss(labels),
        sublayers=["network.*.*"],
        slack=1e-9,
        output=pred,
        update=update,
        max_iter=100,
    )
    assert len(rep.sublayers) == 2 * depth and rep.M_g == 2 * depth * (n + 1)
    for row in rep.sublayers.itertuples():
        assert row.R_g == n + 1 and row.R == T * (n + 1)


# --------------------------------------------------------------------------- safety


@pytest.mark.parametrize("train", [False, True])
def test_probing_the_package_model_leaves_it_bit_identical(train):
    model = make_trm(2, 1).train(train)
    inputs, labels = trm_batch(model)
    ran = lpt.check_probe_leaves_model_unchanged(
        model, inputs, ce_loss(labels), output=pred, alpha=1.0, beta=1.0, increment="delta"
    )
    assert len(ran) == 6  # every entry point but the round (no module holds one here)
