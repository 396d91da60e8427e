"""Discovery of physical sublayers and visits on third-party-style models, and recording."""

from __future__ import annotations

import pytest
import torch
from thirdparty_models import (
    AlbertModel,
    ForLoopModel,
    HaltingModel,
    InplaceModel,
    KeywordModel,
    PlainMLP,
    ReuseModel,
    SharedBlockModel,
    TruncatedModel,
    make,
    randn,
)

import loopprobe as lp


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def test_modulelist_looped_by_for_loop_gives_one_sublayer_per_block_with_R_visits():
    model = make(ForLoopModel, K=2, R=3)
    table = lp.attach(model).visit_table(randn(4, 5))
    assert list(table.sublayer) == ["layers.0", "layers.1"]
    assert list(table.visits) == [3, 3]
    assert table.attrs["M"] == 6 and table.attrs["M_g"] == 6


def test_one_block_instance_called_R_times_is_one_sublayer_with_R_visits():
    table = lp.attach(make(SharedBlockModel, R=4)).visit_table(randn(2, 6))
    assert list(table.sublayer) == ["block"]
    assert list(table.visits) == [4]


def test_albert_tying_groups_different_instances_by_parameter_identity():
    model = make(AlbertModel, R=3)
    probe = lp.attach(model)
    (sub,) = probe.sublayers(randn(2, 6))
    assert sub.modules == ("layers.0.mix", "layers.1.mix", "layers.2.mix")
    assert sub.numel == 6 * 6 + 6 + 6 * 6
    visits = probe.visits(randn(2, 6))
    assert [(v.r, v.module) for v in visits] == [
        (0, "layers.0.mix"),
        (1, "layers.1.mix"),
        (2, "layers.2.mix"),
    ]


def test_keyword_only_calls_are_recorded_with_their_kwargs():
    model = make(KeywordModel, R=3)
    rec = lp.attach(model).record(randn(2, 6))
    assert [v.r for v in rec.visits] == [0, 1, 2]
    assert [v.kwargs["scale"] for v in rec.visits] == [1.0, 0.5, 1.0 / 3.0]
    torch.testing.assert_close(rec.visits[1].kwargs["hidden"], rec.visits[0].output)


def test_recorded_outputs_are_copies_taken_before_in_place_modification():
    model = make(InplaceModel, R=3)
    x = randn(2, 6)
    rec = lp.attach(model).record(x)
    # The caller halves each output in place after the call; the record keeps the value
    # the block returned, so the next visit's input is exactly half of it.
    for a, b in zip(rec.visits, rec.visits[1:], strict=False):
        torch.testing.assert_close(b.args[0], 0.5 * a.output, rtol=0, atol=0)
    direct = model.block(x)
    torch.testing.assert_close(rec.visits[0].output, direct, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["no_grad", "detach"])
def test_truncated_cycles_count_forward_M_and_gradient_visible_M_g_as_measured(mode):
    model = make(TruncatedModel, C=3, C_L=2, mode=mode)
    table = lp.attach(model).visit_table(randn(2, 6))
    assert dict(zip(table.sublayer, table.visits, strict=False)) == {"low": 6, "high": 3}
    assert dict(zip(table.sublayer, table.grad_visible, strict=False)) == {"low": 2, "high": 1}
    assert table.attrs["M"] == 9 and table.attrs["M_g"] == 3
    expected_no_grad = {"low": 4, "high": 2} if mode == "no_grad" else {"low": 0, "high": 0}
    assert dict(zip(table.sublayer, table.no_grad_visits, strict=False)) == expected_no_grad


def test_data_dependent_trip_counts_are_reported_per_input():
    model = make(HaltingModel, max_steps=12, threshold=0.5)
    probe = lp.attach(model)
    steps = {}
    for thr in (1.2, 3.0):
        model.threshold = thr
        t = probe.visit_table(randn(2, 6))
        steps[thr] = int(t.set_index("sublayer").loc["step", "visits"])
    assert 1 < steps[1.2] < steps[3.0] <= 12
    # The halting head only decides when to stop: it never reaches F.
    assert int(t.set_index("sublayer").loc["halt", "grad_visible"]) == 0


def test_reuse_that_is_not_recurrence_can_be_excluded_and_tied_embeddings_are_not_a_loop():
    model = make(ReuseModel, R=3).eval()
    idx = torch.randint(0, 7, (2, 5), generator=torch.Generator().manual_seed(0))
    auto = lp.attach(model).visit_table(idx)
    assert list(auto.sublayer) == ["block", "final_norm"]  # dropout, embed/head: not sublayers
    table = lp.attach(model, exclude=["final_norm"]).visit_table(idx)
    assert list(table.sublayer) == ["block"]
    assert table.attrs["M"] == 3


def test_user_named_glob_sublayers_override_discovery():
    model = make(ForLoopModel, K=2, R=2)
    probe = lp.attach(model, sublayers=["layers.*.fc1"])
    table = probe.visit_table(randn(3, 5))
    assert list(table.sublayer) == ["layers.0.fc1", "layers.1.fc1"]
    assert list(table.visits) == [2, 2]


def test_model_with_nothing_looped_raises_value_error_that_says_how_to_name_sublayers():
    with pytest.raises(ValueError, match=r"nothing is looped.*sublayers="):
        lp.attach(make(PlainMLP)).visit_table(randn(2, 6))


def test_overlapping_or_unknown_or_parameter_free_names_raise_value_error():
    model = make(ForLoopModel)
    x = randn(2, 5)
    with pytest.raises(ValueError, match="share some but not all"):
        lp.attach(model, sublayers=["layers.0", "layers.0.fc1"]).visit_table(x)
    with pytest.raises(ValueError, match="not a module"):
        lp.attach(model, sublayers=["layers.9"]).visit_table(x)
    with pytest.raises(ValueError, match="matches no sublayer"):
        lp.attach(model, exclude=["nope"]).visit_table(x)
    with pytest.raises(TypeError, match="lists of names"):
        lp.attach(model, sublayers="layers.0")


def test_reference_model_default_grouping_is_one_attention_or_mlp_branch_per_block():
    from loopprobe.models import GPTConfig, HierarchicalLoop, HRMConfig, LoopedGPT

    cfg = GPTConfig(vocab_size=16, seq_len=8, d_model=16, n_heads=2, K=2, R=3)
    model = LoopedGPT(cfg, generator=torch.Generator().manual_seed(0))
    idx = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(1))
    table = lp.attach(model).visit_table(idx)
    assert list(table.sublayer) == [
        "blocks.0.attn",
        "blocks.0.mlp",
        "blocks.1.attn",
        "blocks.1.mlp",
    ]
    assert table.attrs["M"] == cfg.M == 12
    hcfg = HRMConfig(vocab_size=16, seq_len=8, d_model=16, n_heads=2, C=3, C_L=2)
    hrm = HierarchicalLoop(hcfg)
    t = lp.attach(hrm).visit_table(idx)
    assert (t.attrs["M"], t.attrs["M_g"]) == (hcfg.M, hcfg.M_g) == (18, 6)
    assert (t.attrs["M_formula"], t.attrs["M_g_formula"]) == (18, 6)


def test_probing_leaves_no_hooks_mode_or_buffers_changed_even_when_the_forward_raises():
    model = make(ForLoopModel).train()
    model.register_buffer("count", torch.zeros(1))
    before = _hooks(model)
    probe = lp.attach(model)
    probe.visit_table(randn(2, 5))

    def boom(m, x):
        m(x)
        m.count.add_(1)
        m.eval()
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        probe.record(randn(2, 5), forward=boom)
    assert _hooks(model) == before
    assert model.training and all(m.training for m in model.modules())
    assert float(model.count) == 0.0
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())


def test_exception_inside_a_visit_restores_the_swapped_parameters():
    model = make(SharedBlockModel, R=3)
    params = {n: p for n, p in model.named_parameters()}
    probe = lp.attach(model)
    probe.sublayers(randn(2, 6))

    def enter(v, module, args, kwargs):
        if v.r == 1:
            raise RuntimeError("inside visit")
        return [p + 0 for p in probe.groups()[0].params]

    with pytest.raises(RuntimeError, match="inside visit"), probe.session(enter):
        model(randn(2, 6))
    assert all(p is params[n] for n, p in model.named_parameters())
    assert _hooks(model) == 0


def test_context_manager_detaches_and_a_detached_probe_refuses_to_run():
    model = make(SharedBlockModel)
    with lp.attach(model) as probe:
        assert len(probe.visits(randn(2, 6))) == 4
    with pytest.raises(ValueError, match="detached"):
        probe.visits(randn(2, 6))


def test_recording_to_frame_has_one_row_per_visit_in_execution_order():
    model = make(ForLoopModel, K=2, R=2)
    frame = lp.attach(model).record(randn(2, 5)).to_frame()
    assert list(frame.i) == [0, 1, 2, 3]
    assert list(frame.sublayer) == ["layers.0", "layers.1", "layers.0", "layers.1"]
    assert list(frame.r) == [0, 0, 1, 1]


class DetachedStack(torch.nn.Module):
    """Every step's prediction is stacked; the carry between steps is detached."""

    def __init__(self) -> None:
        super().__init__()
        self.block = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        preds = []
        for _ in range(3):
            x = self.block(x.detach())
            preds.append(x)
        return torch.stack(preds)


def test_a_visit_reachable_only_through_a_zero_gradient_slice_is_not_gradient_visible():
    model = make(DetachedStack)
    visits = lp.attach(model).visits(randn(2, 4), output=lambda out: out[-1])
    assert [v.grad_visible for v in visits] == [False, False, True]
    everything = lp.attach(model).visits(randn(2, 4))
    assert [v.grad_visible for v in everything] == [True, True, True]
