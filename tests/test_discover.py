"""Discovery picks the loop: chaining, roles of reuse that is not recurrence, nesting,
partial ties, and the caller's seed (issue 10 item 5, issue 11 item 9).

The models below are written the way third-party code is written: none knows about
loopprobe. The expected structure of each is read off its ``forward``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from thirdparty_models import (
    AlbertModel,
    ForLoopModel,
    MLPBlock,
    TruncatedModel,
    make,
    randn,
)
from torch import nn

import loopprobe as lp
from loopprobe.record.discover import Call, find_sublayers, nesting


class LoopedEncoder(nn.Module):
    """K blocks looped R times (the network that the models below call twice)."""

    def __init__(self, d: int = 6, K: int = 2, R: int = 3) -> None:
        super().__init__()
        self.R = R
        self.layers = nn.ModuleList(MLPBlock(d) for _ in range(K))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.R):
            for layer in self.layers:
                x = layer(x)
        return x


class SelfDistillation(nn.Module):
    """A student pass with gradient and a teacher pass of the same network under no_grad."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.encoder = LoopedEncoder(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        student = self.encoder(x)
        with torch.no_grad():
            teacher = self.encoder(x.flip(0))
        return student - teacher


class QNetwork(nn.Module):
    def __init__(self, obs: int = 5, d: int = 6, actions: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(obs, d)
        self.core = LoopedEncoder(d)
        self.out = nn.Linear(d, actions)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.out(self.core(self.inp(obs)))


class DQN(nn.Module):
    """Q-learning: the same Q network on the state, and under no_grad on the next state."""

    def __init__(self) -> None:
        super().__init__()
        self.q = QNetwork()

    def forward(self, obs: torch.Tensor, next_obs: torch.Tensor) -> torch.Tensor:
        q = self.q(obs).max(-1).values
        with torch.no_grad():
            target = 1.0 + 0.9 * self.q(next_obs).max(-1).values
        return q - target


class DeepSupervision(nn.Module):
    """A looped block conditioned on the step, read out after every step, then a final
    norm and head applied after the loop and again after a coda block."""

    def __init__(self, d: int = 6, R: int = 3, vocab: int = 4) -> None:
        super().__init__()
        self.R = R
        self.step_emb = nn.Embedding(R, d)
        self.time_mlp = nn.Sequential(nn.Linear(1, d), nn.SiLU(), nn.Linear(d, d))
        self.block = MLPBlock(d)
        self.readout = nn.Linear(d, vocab)
        self.norm = nn.LayerNorm(d)
        self.coda = MLPBlock(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        preds = []
        for r in range(self.R):
            t = torch.full((1,), float(r), dtype=x.dtype)
            x = self.block(x + self.step_emb(torch.tensor(r)) + self.time_mlp(t))
            preds.append(self.readout(x))
        main = self.head(self.norm(x))
        x = self.coda(x)
        return main + self.head(self.norm(x)) + torch.stack(preds).mean(0)


class HRMStyle(nn.Module):
    """H/L cycles: C cycles of C_L steps of two L blocks, then two H blocks."""

    def __init__(self, d: int = 6, C: int = 2, C_L: int = 3) -> None:
        super().__init__()
        self.C, self.C_L = C, C_L
        self.L = nn.ModuleList(MLPBlock(d) for _ in range(2))
        self.H = nn.ModuleList(MLPBlock(d) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        zl, zh = torch.zeros_like(x), torch.zeros_like(x)
        for _ in range(self.C):
            for _ in range(self.C_L):
                for layer in self.L:
                    zl = layer(zl + zh + x)
            for layer in self.H:
                zh = layer(zh + zl)
        return zh


class CoinFlipDepth(nn.Module):
    """Loops one of two blocks, picked by a coin flip from torch's RNG (random routing)."""

    def __init__(self, d: int = 6, R: int = 3) -> None:
        super().__init__()
        self.R = R
        self.a, self.b = MLPBlock(d), MLPBlock(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        block = self.a if float(torch.rand(())) < 0.5 else self.b
        for _ in range(self.R):
            x = block(x)
        return x


def _by_name(table, column):
    return dict(zip(table.sublayer, table[column], strict=True))


# --------------------------------------------------------------------------- the loop


def test_a_network_called_again_under_no_grad_yields_its_looped_blocks_not_itself():
    model = make(SelfDistillation)
    table = lp.attach(model).visit_table(randn(2, 6))
    # Each pass runs 2 blocks x 3 steps; the teacher pass adds 6 forward-only visits.
    assert list(table.sublayer) == ["encoder.layers.0", "encoder.layers.1"]
    assert list(table.role) == ["body", "body"]
    assert (table.attrs["M"], table.attrs["M_g"]) == (12, 6)
    assert list(table.no_grad_visits) == [3, 3]


def test_q_learning_target_pass_keeps_the_loop_and_labels_the_projections():
    model = make(DQN)
    obs, next_obs = randn(4, 5), randn(4, 5, seed=2)
    table = lp.attach(model).visit_table((obs, next_obs))
    assert _by_name(table, "role") == {
        "q.inp": "embedding",
        "q.core.layers.0": "body",
        "q.core.layers.1": "body",
        "q.out": "head",
    }
    body = table[table.role == "body"]
    assert int(body.visits.sum()) == 12 and int(body.grad_visible.sum()) == 6
    assert (table.attrs["M"], table.attrs["M_g"]) == (16, 8)


def test_step_embedders_readouts_and_a_final_norm_after_a_coda_get_their_roles():
    model = make(DeepSupervision)
    probe = lp.attach(model)
    table = probe.visit_table(randn(2, 6))
    assert _by_name(table, "role") == {
        "step_emb": "embedding",  # an Embedding class
        "time_mlp": "embedding",  # computed from the step alone, reads no body visit
        "block": "body",
        "readout": "head",  # reads every step, feeds no later step
        "norm": "norm",
        "head": "head",
    }
    assert _by_name(table, "visits") == {
        "step_emb": 3,
        "time_mlp": 3,
        "block": 3,
        "readout": 3,
        "norm": 2,
        "head": 2,
    }
    reasons = {s.name: s.role_reason for s in probe.sublayers()}
    assert reasons["block"] == "visits chain (2 of 2 consecutive pairs)"
    assert "reads no body visit" in reasons["time_mlp"]


def test_kappa_R_is_the_max_over_body_sublayers_and_names_the_ones_left_out():
    model = make(DeepSupervision)

    def loss_fn(out, x):
        return out.pow(2).sum()

    report = lp.visit_alignment(lp.attach(model), randn(2, 6), loss_fn)
    sub = report.sublayers.set_index("sublayer")
    body_kappa = float(sub.loc["block", "kappa"])
    others = sub[sub.role != "body"].kappa
    # The reuse that is not recurrence is still measured, and here it aligns more than
    # the loop does: a max over every sublayer would report one of them.
    assert others.notna().all() and float(others.max()) > body_kappa
    assert report.kappa == body_kappa
    assert list(sub.role) == ["embedding", "embedding", "body", "head", "norm", "head"]
    for name in ("step_emb", "time_mlp", "readout", "norm", "head"):
        assert repr(name) in report.kappa_note


# --------------------------------------------------------------------------- nesting


def test_hrm_style_cycles_report_the_L_blocks_nested_in_the_H_loop():
    table = lp.attach(make(HRMStyle)).visit_table(randn(2, 6))
    assert _by_name(table, "nested_in") == {
        "L.0": "H.0,H.1",
        "L.1": "H.0,H.1",
        "H.0": "",
        "H.1": "",
    }
    assert _by_name(table, "steps_per_outer")["L.0"] == 3.0  # C_L steps per H visit
    assert _by_name(table, "visits") == {"L.0": 6, "L.1": 6, "H.0": 2, "H.1": 2}
    truncated = lp.attach(make(TruncatedModel, C=3, C_L=2)).visit_table(randn(2, 6))
    assert _by_name(truncated, "nested_in") == {"low": "high", "high": ""}


def test_blocks_of_one_loop_are_siblings_not_nested():
    table = lp.attach(make(ForLoopModel, K=2, R=3)).visit_table(randn(2, 5))
    assert list(table.nested_in) == ["", ""]


def test_nesting_of_a_three_level_visit_sequence_picks_the_innermost_loop():
    # a a b a a b c, twice: a runs 2 per b, b runs 2 per c.
    seq = ([0, 0, 1] * 2 + [2]) * 2
    assert nesting(seq, [0, 1, 2]) == {0: ([1], 2.0), 1: ([2], 2.0)}
    assert nesting([0, 1] * 3, [0, 1]) == {}


# --------------------------------------------------------------------------- chaining


def _log(names_reads: list[tuple[str, int]]) -> list[Call]:
    """A flat call log of one-module groups: (module, reads as call indices)."""
    keys = {n: frozenset([n]) for n, _ in names_reads}
    return [Call(n, -1, keys[n], nn.Linear, sum(1 << c for c in reads)) for n, reads in names_reads]


def test_a_group_chains_when_half_of_its_consecutive_visits_read_the_previous_one():
    # f runs twice as a loop (f1 reads f0), then twice more on fresh inputs: 1 of 3 pairs.
    calls = _log([("f", []), ("f", [0]), ("f", []), ("f", [])])
    assert [f.role for f in find_sublayers(calls)] == ["other"]
    calls = _log([("f", []), ("f", [0]), ("f", [1]), ("f", [])])
    assert [f.role for f in find_sublayers(calls)] == ["body"]


class PreallocatedStates(nn.Module):
    """Writes every step's state into a preallocated tensor and reads the next input
    back from it (how caches and scan-style loops are often written)."""

    def __init__(self, d: int = 6, R: int = 3) -> None:
        super().__init__()
        self.R = R
        self.block = MLPBlock(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        states = x.new_zeros(self.R + 1, *x.shape)
        states[0] = x
        for r in range(self.R):
            states[r + 1] = self.block(states[r].clone())
        return states[-1]


def test_a_loop_carried_through_in_place_writes_into_a_buffer_still_chains():
    probe = lp.attach(make(PreallocatedStates))
    table = probe.visit_table(randn(2, 6))
    assert list(table.role) == ["body"] and list(table.visits) == [3]
    assert probe.sublayers()[0].role_reason == "visits chain (2 of 2 consecutive pairs)"


# --------------------------------------------------------------------------- ties, seeds


def test_a_module_with_only_some_parameters_tied_warns_and_full_tying_does_not():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lp.attach(make(AlbertModel, R=3)).sublayers(randn(2, 6))
    model = make(AlbertModel, R=3)
    q = model.layers[1].mix.q
    q.bias = nn.Parameter(q.bias.detach().clone())  # tying forgot one bias
    with pytest.warns(UserWarning, match=r"'layers.0.mix.q' and 'layers.1.mix.q'.*partly tied"):
        lp.attach(model).sublayers(randn(2, 6))


def _calls_under_seed(model: nn.Module, x: torch.Tensor, seed: int) -> dict[str, int]:
    """The oracle: module calls of one plain forward with torch's RNG at ``seed``."""
    counts: dict[str, int] = {}
    hooks = [
        m.register_forward_hook(lambda *a, n=n: counts.__setitem__(n, counts.get(n, 0) + 1))
        for n, m in model.named_children()
    ]
    try:
        with torch.random.fork_rng(), torch.no_grad():
            torch.manual_seed(seed)
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return counts


@pytest.mark.parametrize("seed", [0, 1])
def test_discovery_runs_the_call_graph_of_the_callers_seed(seed):
    model = make(CoinFlipDepth)
    x = randn(2, 6)
    expected = _calls_under_seed(model, x, seed)
    assert _calls_under_seed(model, x, 1 - seed) != expected  # the seed changes the graph
    table = lp.attach(model).visit_table(x, seed=seed)
    assert _by_name(table, "visits") == expected
    report = lp.visit_alignment(lp.attach(model), x, lambda out, x: out.pow(2).sum(), seed=seed)
    assert list(report.sublayers.sublayer) == list(expected)


def test_discovery_with_seed_none_sees_the_draws_of_the_measured_call():
    model = make(CoinFlipDepth)
    x = randn(2, 6)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        table = lp.attach(model).visit_table(x, seed=None)
    assert _by_name(table, "visits") == _calls_under_seed(model, x, 1)


class RefusesDispatchModes(nn.Module):
    """Code that refuses to run under a torch dispatch mode (as some custom kernels do)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = MLPBlock(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        if _get_current_dispatch_mode() is not None:
            raise RuntimeError("no dispatch modes here")
        return self.block(self.block(x))


def test_a_forward_that_fails_under_data_flow_tracking_falls_back_with_a_warning():
    with pytest.warns(UserWarning, match="failed under data-flow tracking.*no dispatch modes"):
        table = lp.attach(make(RefusesDispatchModes)).visit_table(randn(2, 6))
    assert list(table.sublayer) == ["block"] and list(table.visits) == [2]


class _Readout(nn.Module):
    """Holds the loop block's weight object and uses it outside any visit of the block."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)


class _TiedReadout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(4, 4)
        self.out = _Readout(self.block.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = x + torch.tanh(self.block(x))
        return self.out(x) + self.out(x)


def test_visit_table_counts_calls_of_a_module_holding_the_sublayers_weight_outside_visits():
    torch.manual_seed(0)
    model = _TiedReadout()
    table = lp.attach(model, sublayers=["block"]).visit_table(torch.randn(2, 4))
    row = table.set_index("sublayer").loc["block"]
    assert row["visits"] == 3
    assert row["outside_calls"] == 2  # the readout, twice: the per-visit offsets miss it
