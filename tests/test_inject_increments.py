"""Issue 25.3: increments of a loop that feeds its input back through an injection layer.

``h <- block(inject(cat[h, e]))`` (``inject`` a ``Linear(2d, d)``): no sublayer returns an
increment of the stream the loop carries, and ``inject`` is not even residual-shaped. The
library must find that stream (the output of ``block``, which every next round's first
visit reads as a slice of its input) and measure ``h_{r+1} - h_r``, or ask one question
that names this model's own sublayers, the same before and after training; the monitor and
the report must get the same. The toys are plain ``nn.Module`` code; every figure is checked
against the loop run by hand in float64.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import loopprobe as lp
from loopprobe.monitor.monitor import Monitor
from loopprobe.report.config import Context, ReportConfig, Skip, UserModel
from loopprobe.report.sections_growth import increments_section

D, V, R = 8, 11, 5
CARRIED = "carried stream h_(r+1) - h_r"


class Block(nn.Module):
    """A residual transformer-ish block returning the updated stream ``u + mlp(norm(u))``;
    ``prenorm``: a second pre-norm residual branch (``u + mix(norm2(u))``) in front."""

    def __init__(self, prenorm: bool = False) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.norm2 = nn.LayerNorm(D) if prenorm else None
        self.mix = nn.Linear(D, D) if prenorm else None

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        if self.mix is not None:
            u = u + self.mix(self.norm2(u))
        return u + self.fc2(torch.relu(self.fc1(self.norm(u))))


class InjectLoop(nn.Module):
    """``e = embed(idx)``; R rounds of ``h = block(inject(cat[h, e]))`` (``style="cat"``,
    ``order`` "he" or "eh", ``h_0`` zero or ``e``) or ``h = block(h + inject(e))``
    (``style="add"``); ``two``: a second stream ``g <- g + h/2`` is concatenated instead
    of ``e`` (the loop then carries two streams); a head to the vocabulary."""

    def __init__(
        self,
        style: str = "cat",
        prenorm: bool = False,
        order: str = "he",
        h0: str = "zero",
        two: bool = False,
        r: int = R,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.style, self.order, self.h0, self.two, self.R = style, order, h0, two, r
        self.embed = nn.Embedding(V, D)
        self.inject = nn.Linear(2 * D if style == "cat" else D, D)
        self.block = Block(prenorm)
        self.head = nn.Linear(D, V)
        self.double()

    def rounds(self, idx: torch.Tensor) -> list[torch.Tensor]:
        """h_0, h_1, ..., h_R: the loop run by hand."""
        e = self.embed(idx)
        h = torch.zeros_like(e) if self.h0 == "zero" and self.style == "cat" else e
        g, hs = e, [h]
        for _ in range(self.R):
            if self.style == "add":
                h = self.block(h + self.inject(e))
            else:
                u = self.inject(torch.cat([h, g] if self.order == "he" else [g, h], -1))
                h = self.block(u)
                g = g + 0.5 * h if self.two else g
            hs.append(h)
        return hs

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.rounds(idx)[-1])


def _idx(B: int = 3, T: int = 6, seed: int = 5) -> torch.Tensor:
    return torch.randint(V, (B, T), generator=torch.Generator().manual_seed(seed))


def _by_hand(model: InjectLoop, idx: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    with torch.no_grad():
        hs = model.rounds(idx)
    return hs, [hs[r + 1] - hs[r] for r in range(len(hs) - 1)]


def _cos(zs: list[torch.Tensor]) -> np.ndarray:
    Z = torch.stack([z.reshape(-1) for z in zs])
    Z = Z / Z.norm(dim=1, keepdim=True)
    return (Z @ Z.T).numpy()


def _train(model: nn.Module, steps: int = 20) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        idx = torch.randint(V, (8, 6), generator=gen)
        loss = F.cross_entropy(model(idx).flatten(0, 1), idx.roll(1, -1).flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()


def _decision(model: nn.Module, **kw) -> tuple:
    try:
        inc = lp.increments(model, _idx(), **kw)
    except ValueError as e:
        return ("asks", str(e).split(":")[1])
    return ("measures", dict(inc.measured), inc.attrs.get("carried"), inc.converged)


# --------------------------------------------------------------------------- the library


@pytest.mark.parametrize(
    "prenorm, order, h0", [(False, "he", "zero"), (True, "he", "zero"), (False, "eh", "e")]
)
def test_the_carried_stream_matches_the_loop_run_by_hand_in_float64(prenorm, order, h0):
    model, idx = InjectLoop(prenorm=prenorm, order=order, h0=h0), _idx()
    hs, zs = _by_hand(model, idx)
    inc = lp.increments(model, idx)
    assert inc.measured == {"block": CARRIED} and inc.increment == CARRIED
    assert inc.attrs["carried"] == "block" and inc.summary()["carried"] == "block"
    off = 0 if order == "he" else D
    assert f"[{off}:{off + D}] along dim 2" in inc.evidence["block"]
    assert "concatenation" in inc.attrs["carried_by"] and "not measured" in inc.evidence["inject"]
    assert [(v.sublayer, v.r) for v in inc.visits] == [("block", r) for r in range(R)]
    np.testing.assert_allclose(inc.inc_norm, [float(z.norm()) for z in zs], rtol=1e-12)
    np.testing.assert_allclose(inc.cos[0], _cos(zs), atol=1e-12)
    rms = [float(h.pow(2).mean().sqrt()) for h in hs]
    np.testing.assert_allclose(inc.stream_rms, rms[1:], rtol=1e-12)
    assert inc.h0_rms == pytest.approx(rms[0], rel=1e-12, abs=1e-300)
    dist = float((hs[-1] - hs[0]).norm())
    want = dist / float(hs[0].norm()) if h0 == "e" else dist / hs[0].numel() ** 0.5
    assert inc.growth == pytest.approx(want, rel=1e-12)
    assert inc.hN_source == "carried stream (last output of 'block')"
    assert inc.converged and inc.reason == ""


def test_h_plus_inject_e_measures_the_same_change_of_the_carried_stream():
    model, idx = InjectLoop(style="add"), _idx()
    _, zs = _by_hand(model, idx)
    inc = lp.increments(model, idx)
    assert inc.measured == {"block": "output + injection - input"} and inc.converged
    np.testing.assert_allclose(inc.inc_norm, [float(z.norm()) for z in zs], rtol=1e-12)
    np.testing.assert_allclose(inc.cos[0], _cos(zs), atol=1e-12)


@pytest.mark.parametrize(
    "kw, probe",
    [({}, None), ({"prenorm": True}, None), ({"style": "add"}, None), ({}, ["block"])],
)
def test_the_decision_is_the_same_before_and_after_20_adam_steps(kw, probe):
    model = InjectLoop(**kw)
    before = _decision(model, sublayers=probe)
    _train(model)
    after = _decision(model, sublayers=probe)
    assert before == after
    if probe is None:
        assert before[0] == "measures" and before[-1] is True
    else:  # the injection layer is not probed: nothing tells what block's next visit reads
        assert before[0] == "asks" and "cannot tell whether sublayer 'block'" in before[1]


def test_a_loop_carrying_two_streams_is_one_question_naming_this_models_sublayers():
    with pytest.raises(ValueError) as e:
        lp.increments(InjectLoop(two=True), _idx())
    msg = str(e.value)
    assert msg.startswith("increments: cannot locate the residual increment of sublayer 'inject'")
    assert "the loop carries more than one stream" in msg
    assert "lp.increments(model, inputs, sublayers=['block'], increment='delta')" in msg
    assert "blocks.*.attn" not in msg


def test_a_block_probed_without_its_injection_layer_is_asked_about_with_its_name():
    with pytest.raises(ValueError, match="cannot tell whether sublayer 'block'") as e:
        lp.increments(InjectLoop(), _idx(), sublayers=["block"])
    assert "sublayers=['block'], increment='delta'" in str(e.value)
    assert "probing it too" in str(e.value)


def test_an_explicit_increment_on_the_injection_layer_names_this_models_sublayers():
    with pytest.raises(ValueError, match=r"'inject'.*\(3, 6, 8\).*\(3, 6, 16\)") as e:
        lp.increments(InjectLoop(), _idx(), increment="delta")
    assert "this probe's sublayers: ['inject', 'block']" in str(e.value)
    assert "blocks.*.attn" not in str(e.value)


def test_two_rounds_are_enough_for_a_concatenation_but_not_for_an_injection():
    model, idx = InjectLoop(r=2), _idx()
    _, zs = _by_hand(model, idx)
    inc = lp.increments(model, idx)
    assert inc.measured == {"block": CARRIED}
    np.testing.assert_allclose(inc.inc_norm, [float(z.norm()) for z in zs], rtol=1e-12)


def test_finding_the_carried_stream_changes_nothing_in_the_model_or_the_rng():
    model = InjectLoop()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(11)
    rng = torch.get_rng_state()
    lp.increments(model, _idx())
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


# --------------------------------------------------------------------------- monitor, report


def _loss(out: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), idx.roll(1, -1).flatten())


def test_the_monitor_records_the_carried_increments_during_training():
    model, idx = InjectLoop(), _idx()
    mon = Monitor(model, idx, _loss, diagnostics=("increments",), every=1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(3):
        opt.zero_grad()
        _loss(model(idx), idx).backward()
        opt.step()
        mon.step(step)
        inc = lp.increments(model, idx)
        rows = mon.frame[(mon.frame.quantity == "inc_rms") & (mon.frame.step == step)]
        assert rows.sublayer.tolist() == ["block"] * R and rows.converged.all()
        np.testing.assert_allclose(rows.value.to_numpy(), inc.inc_rms, rtol=1e-12)
    assert "increments_failed" not in set(mon.frame.quantity)


def test_the_monitor_records_the_one_question_as_a_failure_row_and_training_goes_on():
    model, idx = InjectLoop(two=True), _idx()
    mon = Monitor(model, idx, _loss, diagnostics=("increments",), every=1)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for step in range(2):
            _loss(model(idx), idx).backward()
            mon.step(step)
    failed = mon.frame[mon.frame.quantity == "increments_failed"]
    assert failed.step.tolist() == [0, 1] and failed.value.isna().all()
    assert failed.reason.str.contains("sublayers=['block'], increment='delta'", regex=False).all()


def _user(model: nn.Module, **kw) -> Context:
    user = UserModel("tests:InjectLoop", model, _idx(), _loss, "next token", **kw)
    return Context(ReportConfig(), user=user, progress=False)


def test_the_report_shows_the_carried_increments_of_the_injection_model():
    model = InjectLoop()
    res = increments_section(_user(model))
    inc = lp.increments(model, _idx())
    assert res.values["carried"] == "block" and res.values["increment"] == CARRIED
    np.testing.assert_allclose(res.frames["visits"].inc_norm, inc.inc_norm, rtol=1e-12)
    assert any(n.startswith("block: increment measured as carried stream") for n in res.notes)
    assert any(n.startswith("inject: not measured") for n in res.notes)


def test_the_reports_skip_reason_is_the_one_question_naming_the_option():
    with pytest.raises(
        Skip, match="cannot locate the residual increment of sublayer 'inject'"
    ) as e:
        increments_section(_user(InjectLoop(two=True)))
    assert "sublayers=['block'], increment='delta'" in str(e.value)
    # the option it names works: --sublayers block --increment delta
    res = increments_section(_user(InjectLoop(two=True), sublayers=["block"], increment="delta"))
    assert res.values["measured"] == {"block": "output - input"}


def _small_branch() -> InjectLoop:
    """Probed without its injection layer, block's first decision is by size alone."""
    model = InjectLoop()
    with torch.no_grad():
        model.block.fc2.weight.mul_(0.1)
        model.block.fc2.bias.mul_(0.1)
    return model


def test_a_decision_by_size_alone_says_it_can_change_as_the_model_trains():
    model = _small_branch()
    inc = lp.increments(model, _idx(), sublayers=["block"])
    assert inc.measured == {"block": "output - input"}
    assert (
        "by size only" in inc.evidence["block"]
        and "increment='delta' fixes it" in (inc.evidence["block"])
    )
    _train(model)  # and it does change: 20 Adam steps later, auto asks
    with pytest.raises(ValueError, match="cannot tell whether sublayer 'block'"):
        lp.increments(model, _idx(), sublayers=["block"])


def test_the_monitor_keeps_its_first_decision_by_size_for_the_whole_run():
    model, idx = _small_branch(), _idx()
    mon = Monitor(model, idx, _loss, diagnostics=("increments",), every=1, sublayers=["block"])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(3)
    for step in range(20):
        x = torch.randint(V, (8, 6), generator=gen)
        opt.zero_grad()
        _loss(model(x), x).backward()
        opt.step()
        mon.step(step)
    rows = mon.frame[mon.frame.quantity == "inc_rms"]
    assert sorted(set(rows.step)) == list(range(20))
    assert "increments_failed" not in set(mon.frame.quantity)
    delta = lp.increments(model, idx, sublayers=["block"], increment="delta")
    last = rows[rows.step == 19].value.to_numpy()
    np.testing.assert_allclose(last, delta.inc_rms, rtol=1e-12)
