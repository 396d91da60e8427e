"""No wrong number is reported as valid: discovery and the probe's view of the model
(issue 24, cases 1, 4, 6 and 9).

Each model below is written the way third-party code is written (plain ``nn.Module``,
nothing from loopprobe); each reproduces a number the old code got wrong while saying
``converged=True``, or a call it failed with torch's raw message:

1. a final norm applied after the loop and again after a coda that reads the normed
   state chains through the coda and was taken for the loop body (kappa_R 1.02 for the
   blocks' 0.495 on ``FinalNormCoda``);
4. blocks that share their MLP but not their attention gave no warning, and the kappa of
   the shared MLP looked like the whole block's;
6. a probe kept across ``load_state_dict(sd, assign=True)`` or a replaced submodule
   measured the old tensors (kappa_R 2.07 for the fresh probe's 0.80; M 6 -> 3);
9. a forward that needs grad mode made discovery (run under ``no_grad``) fail.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from thirdparty_models import make, randn
from torch import nn

import loopprobe as lp
from loopprobe.record import discover, ties
from loopprobe.testing.checks import _differences, _snapshot


def _loss(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return out.pow(2).sum() + out.sum()


class Block(nn.Module):
    """Pre-norm residual MLP block."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 16)
        self.fc2 = nn.Linear(16, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.ln(x))))


# --------------------------------------------------------------------------- case 1


class Coda(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class FinalNormCoda(nn.Module):
    """``h = loop(h); h = norm(h); h = coda(h); h = norm(h)``: one final norm instance,
    and the coda reads the normed state, so the norm's second call reads its first."""

    def __init__(self, d: int = 8, R: int = 3) -> None:
        super().__init__()
        self.R = R
        self.blocks = nn.ModuleList([Block(d)])
        self.norm = nn.LayerNorm(d)
        self.coda = Coda(d)
        with torch.no_grad():  # a trained-looking norm, and blocks far from the identity
            self.norm.weight.mul_(3.0).add_(torch.randn(d))
            for p in self.blocks.parameters():
                p.mul_(3.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.R):
            for block in self.blocks:
                x = block(x)
        x = self.norm(x)
        x = self.coda(x)
        return self.norm(x)


class NormInTheLoop(nn.Module):
    """A norm module of its own, applied after the block at every step: it is the loop."""

    def __init__(self, d: int = 8, R: int = 3) -> None:
        super().__init__()
        self.R = R
        self.block = Block(d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.R):
            x = self.norm(self.block(x))
        return x


def test_a_final_norm_reapplied_after_a_coda_that_reads_the_normed_state_is_not_the_body():
    model, x = make(FinalNormCoda, seed=1), randn(3, 8, seed=0)
    probe = lp.attach(model)
    table = probe.visit_table(x)
    assert dict(zip(table.sublayer, table.role, strict=True)) == {
        "blocks.0": "body",
        "norm": "norm",
    }
    reason = {s.name: s.role_reason for s in probe.sublayers()}["norm"]
    assert reason.startswith("visits chain (1 of 1 pairs) but never through a visit of the loop")
    auto = lp.visit_alignment(probe, x, _loss)
    by_hand = lp.visit_alignment(lp.attach(model, sublayers=["blocks.0"]), x, _loss)
    norm_kappa = float(auto.sublayers.set_index("sublayer").kappa["norm"])
    assert norm_kappa > 2 * by_hand.kappa  # the old kappa_R (1.02) was the norm's, not 0.495
    assert auto.converged and auto.kappa == pytest.approx(by_hand.kappa, rel=1e-12)
    assert "'norm'" in auto.kappa_note


def test_a_norm_module_applied_at_every_step_of_the_loop_stays_body():
    table = lp.attach(make(NormInTheLoop)).visit_table(randn(3, 8))
    assert list(table.role) == ["body", "body"] and list(table.visits) == [3, 3]


def test_a_norm_that_chains_when_nothing_else_loops_stays_body():
    calls = [discover.Call("n", -1, frozenset(["n"]), nn.LayerNorm, r) for r in (0, 1)]
    assert [f.role for f in discover.find_sublayers(calls)] == ["body"]


# --------------------------------------------------------------------------- case 4


class Attn(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.q = nn.Linear(d, d)
        self.o = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(torch.softmax(self.q(x) @ x.transpose(-1, -2), -1) @ x)


class MLP(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 16)
        self.fc2 = nn.Linear(16, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class AttnBlock(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.attn = Attn(d)
        self.mlp = MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class MiswiredRecursive(nn.Module):
    """Meant to be one block applied R times; the tying loop forgot the attention."""

    def __init__(self, d: int = 8, R: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(AttnBlock(d) for _ in range(R))
        for b in self.blocks[1:]:
            b.mlp = self.blocks[0].mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def test_blocks_sharing_their_mlp_but_not_their_attention_warn_and_say_what_kappa_covers():
    model, x = make(MiswiredRecursive), randn(2, 5, 8)
    probe = lp.attach(model)
    with pytest.warns(
        UserWarning, match=r"'blocks.0' and 'blocks.1' \(AttnBlock\) are partly"
    ) as w:
        table = probe.visit_table(x)
    msg = next(str(r.message) for r in w if "partly tied" in str(r.message))
    assert "share ['mlp.*'] but not ['attn.*']" in msg and "blocks.3" in msg
    assert list(table.sublayer) == ["blocks.0.mlp"] and int(table.parameters[0]) == 280
    assert "only their shared part, so its kappa is over 280 parameters" in table.note[0]
    assert probe.sublayers()[0].note == table.note[0]
    assert table.attrs["partial_ties"] == [
        "blocks.0, blocks.1, blocks.2, blocks.3 (AttnBlock) are partly tied: they share "
        "['mlp.*'] but not ['attn.*']"
    ]
    rep = lp.visit_alignment(probe, x, _loss)
    assert "blocks.0.mlp: " in rep.kappa_note and "over 280 parameters" in rep.kappa_note


def test_partial_ties_compare_parameters_recursively_and_skip_per_layer_norms():
    model = make(MiswiredRecursive, R=2)
    (a, b, shared, rest), *more = ties.partial_ties(model)
    assert (a, b, more) == ("blocks.0", "blocks.1", [])
    assert shared == ["mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias"]
    assert ties.summarize(rest, rest + shared) == ["attn.*"]
    for blk in model.blocks[1:]:
        blk.attn = model.blocks[0].attn  # tied in full now
    assert ties.partial_ties(model) == []
    for blk in model.blocks:
        blk.norm = nn.LayerNorm(8)  # per-layer norms around a shared block: a design
    assert ties.partial_ties(model) == []


# --------------------------------------------------------------------------- case 6


class Looped(nn.Module):
    def __init__(self, d: int = 8, K: int = 2, R: int = 3) -> None:
        super().__init__()
        self.R = R
        self.blocks = nn.ModuleList(Block(d) for _ in range(K))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.R):
            for b in self.blocks:
                x = b(x)
        return x


def _checkpoint() -> dict[str, torch.Tensor]:
    return {n: 3.0 * t for n, t in make(Looped, seed=5).state_dict().items()}


def _same_G(a, b) -> None:
    assert a.sublayers == b.sublayers
    for ga, gb in zip(a.G, b.G, strict=True):
        torch.testing.assert_close(ga, gb, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("sublayers", [None, ["blocks.*"]])
def test_a_probe_kept_across_load_state_dict_assign_measures_the_loaded_parameters(sublayers):
    model, x = make(Looped), randn(2, 8)
    probe = lp.attach(model, sublayers)
    before = lp.visit_alignment(probe, x, _loss)
    model.load_state_dict(_checkpoint(), assign=True)
    kept = lp.visit_alignment(probe, x, _loss)
    fresh = lp.visit_alignment(lp.attach(model, sublayers), x, _loss)
    assert abs(before.kappa - fresh.kappa) > 0.5  # the old probe reported `before` again
    assert kept.converged and kept.kappa == pytest.approx(fresh.kappa, rel=1e-12, abs=1e-12)
    _same_G(lp.per_visit_updates(probe, x, _loss), lp.per_visit_updates(lp.attach(model), x, _loss))


def test_a_probe_kept_across_a_replaced_submodule_counts_and_measures_the_new_one():
    model, x = make(Looped), randn(2, 8)
    probe = lp.attach(model)
    assert probe.visit_table(x).attrs["M"] == 6
    with torch.random.fork_rng():
        torch.manual_seed(7)
        model.blocks[1] = Block().double()
    table = probe.visit_table(x)
    assert (table.attrs["M"], table.attrs["M_g"]) == (6, 6)  # the old probe saw 3
    _same_G(lp.per_visit_updates(probe, x, _loss), lp.per_visit_updates(lp.attach(model), x, _loss))
    model.blocks[0].fc1 = nn.Linear(8, 16).double()  # deeper inside a sublayer
    _same_G(lp.per_visit_updates(probe, x, _loss), lp.per_visit_updates(lp.attach(model), x, _loss))


def test_a_probe_on_an_unchanged_model_discovers_once(monkeypatch):
    model, x = make(Looped), randn(2, 8)
    probe = lp.attach(model)
    runs = []
    real = discover.record_calls
    monkeypatch.setattr(discover, "record_calls", lambda *a: runs.append(1) or real(*a))
    for _ in range(3):
        probe.visit_table(x)
    lp.visit_alignment(probe, x, _loss)
    assert len(runs) == 1


def test_a_probe_whose_model_changed_asks_for_inputs_when_it_has_none():
    model, x = make(Looped), randn(2, 8)
    probe = lp.attach(model)
    probe.sublayers(x)
    model.load_state_dict(_checkpoint(), assign=True)
    with pytest.raises(ValueError, match=r"Probe.groups: the model's parameters or modules"):
        probe.groups()


# --------------------------------------------------------------------------- case 9


class ClipsTheStateGradient(nn.Module):
    """Registers a tensor hook on the carried state (gradient clipping per step)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = self.block(x)
            x.register_hook(lambda g: g.clamp(-1, 1))
        return x


class EnergyDescent(nn.Module):
    """An energy-based loop: each step descends the gradient of E(x), inside the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.energy = Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            if not x.requires_grad:
                x = x.detach().requires_grad_()
            (g,) = torch.autograd.grad(self.energy(x).pow(2).sum(), x, create_graph=True)
            x = x - 0.1 * g
        return x


@pytest.mark.parametrize("cls", [ClipsTheStateGradient, EnergyDescent])
def test_discovery_runs_a_forward_that_needs_grad_mode_and_leaves_the_model_as_it_was(cls):
    model, x = make(cls), randn(2, 8)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    before = _snapshot(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to untracked discovery either
        table = lp.attach(model).visit_table(x)
    assert (list(table.role), list(table.visits), table.attrs["M_g"]) == (["body"], [3], 3)
    assert _differences(before, model) == []


class Broken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.block(x)) @ torch.ones(3, 3, dtype=x.dtype)


def test_a_forward_that_fails_in_either_grad_mode_raises_its_own_error():
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        lp.attach(make(Broken)).visit_table(randn(2, 8))


class NaNBufferLoop(nn.Module):
    """A block holding a buffer with a NaN in it (a mask or statistics nobody reset)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block(4)
        self.block.register_buffer("stats", torch.tensor([float("nan"), 1.0]))
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = self.block(x)
        return self.head(x)


def test_a_buffer_holding_nan_is_left_alone_not_copied_back_inside_a_transform():
    # NaN != NaN made the buffer look changed, and copying it back inside the bound check's
    # JVP raised torch.func's "mutate a captured Tensor"
    model, x = make(NaNBufferLoop), randn(2, 4)
    probe = lp.attach(model)
    b = lp.bound_check(probe, x, _loss, lr=1e-3, alpha=1.0, beta=1.0)
    assert b.converged, b.reason
    assert torch.isnan(model.block.stats[0]) and model.block.stats[1] == 1.0


def test_increments_of_a_forward_that_needs_grad_mode_are_measured_and_leave_grads():
    model, x = make(ClipsTheStateGradient), randn(2, 8)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    before = _snapshot(model)
    inc = lp.increments(model, x)
    assert inc.converged, inc.reason
    # the twin: the loop's own states, by hand; the block returns the updated stream
    h, states = x.clone(), [x.clone()]
    for _ in range(3):
        h = model.block(h).detach()
        states.append(h)
    by_hand = torch.stack([(b - a).flatten() for a, b in zip(states, states[1:], strict=False)])
    unit = by_hand / by_hand.norm(dim=1, keepdim=True)
    assert inc.inc_norm == pytest.approx(by_hand.norm(dim=1).numpy(), rel=1e-12)
    assert inc.cos[0] == pytest.approx((unit @ unit.T).numpy(), rel=1e-12)
    assert _differences(before, model) == []


class RunsItsOwnBackward(nn.Module):
    """A forward that calls .backward() (an auxiliary loss stepped inside the model)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = self.block(x)
        if not torch.is_grad_enabled():
            raise RuntimeError("this model needs grad mode")
        x.square().sum().backward(retain_graph=True)
        return x


def test_discovery_puts_back_grads_a_forward_accumulated_in_place():
    model, x = make(RunsItsOwnBackward), randn(2, 8)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    before = _snapshot(model)
    assert list(lp.attach(model).visit_table(x).visits) == [3]
    assert _differences(before, model) == []
