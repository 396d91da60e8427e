"""Every result says whether it can be trusted: ``converged`` and ``reason`` at the top level."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from thirdparty_models import ForLoopModel, make, randn
from torch import nn

import loopprobe as lp
from loopprobe.estimate import sensitivity
from loopprobe.estimate.alignment import _kappa_checks, visit_alignment
from loopprobe.estimate.bound import bound_check
from loopprobe.estimate.implicit import input_dependence
from loopprobe.estimate.sensitivity import choose_method, lanczos_group


def reference(norm: str = "deeploop", dtype=torch.float64):
    cfg = lp.models.GPTConfig(K=2, R=4, norm=norm, d_model=16, n_heads=2, seq_len=16)
    model = lp.models.LoopedGPT(cfg, generator=torch.Generator().manual_seed(0)).to(dtype)
    idx, tg = lp.tasks.random_tokens(4, 16, 64, generator=torch.Generator().manual_seed(0))
    return model, idx, lambda out, inp: F.cross_entropy(out.flatten(0, 1), tg.flatten())


def test_the_default_method_converges_on_the_reference_model_well_inside_its_budget():
    model, idx, loss = reference()
    rep = visit_alignment(lp.attach(model), idx, loss)
    assert rep.converged, rep.reason
    assert rep.sensitivity.method == "lanczos"
    assert rep.visits.iterations.max() < 50  # of max_iter=100
    assert 0 < rep.kappa <= 8


def test_lanczos_is_chosen_while_one_basis_fits_and_operators_are_grouped_to_fit():
    assert choose_method(10_000, 100, torch.float64) == "lanczos"
    assert choose_method(1_000_000, 100, torch.float64) == "lanczos"  # 0.8 GB per basis
    assert choose_method(10_000_000, 100, torch.float64) == "lanczos"  # capped, restarted basis
    assert lanczos_group(20, 10_000, 100, torch.float64) == 20  # 160 MB together
    assert lanczos_group(20, 524_288, 100, torch.float32) == 5  # d 256: 210 MB each
    assert lanczos_group(20, 1_000_000, 100, torch.float64) == 1


def test_lanczos_in_groups_gives_the_one_batch_answers(monkeypatch):
    model, idx, loss = reference()
    one = lp.sensitivity_norms(lp.attach(model), idx)
    probe = lp.attach(model)
    n_max = max(g.sublayer.numel for g in probe.groups(idx))
    monkeypatch.setattr(sensitivity, "LANCZOS_BYTES", 3 * 100 * n_max * 8)  # groups of 3
    assert lanczos_group(20, n_max, 100, torch.float64) == 3
    grouped = lp.sensitivity_norms(probe, idx)
    assert grouped.method == one.method == "lanczos"
    a = [*one.visit_norms, *one.tied_norms.values()]
    b = [*grouped.visit_norms, *grouped.tied_norms.values()]
    assert [e.iterations for e in a] == [e.iterations for e in b]
    assert [e.value for e in a] == pytest.approx([e.value for e in b], rel=1e-12)


def test_a_kappa_above_R_or_nan_is_flagged_not_printed_as_a_measurement():
    sub = pd.DataFrame(
        {
            "sublayer": ["a", "b", "c", "d"],
            "R_g": [3, 3, 3, 0],
            "kappa": [2.5, 3.2, float("nan"), float("nan")],
        }
    )
    ok, problems = _kappa_checks(sub)
    assert ok == [True, False, False, True]
    assert "outside [0, R_j = 3]" in problems[1] and "b" in problems[1]
    assert "kappa of c is NaN" in problems[2]


class TwoBranches(nn.Module):
    """Sublayer ``a`` feeds the output F; sublayer ``b`` feeds only the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ha, hb = x, x
        for _ in range(3):
            ha, hb = ha + torch.tanh(self.a(ha)), hb + torch.tanh(self.b(hb))
        return ha, hb


def test_a_nan_kappa_is_named_and_kappa_bar_divides_by_the_visits_it_counts():
    model = make(TwoBranches)
    x = randn(5, 4)
    rep = visit_alignment(
        lp.attach(model),
        x,
        lambda out, inp: out[0].square().sum() + out[1].square().sum(),
        output=lambda out: out[0],
    )
    by = rep.sublayers.set_index("sublayer")
    assert by.loc["a", "kappa_ok"] and not by.loc["b", "kappa_ok"]
    assert not rep.converged and "kappa of b is NaN" in rep.reason
    assert rep.kappa_bar == pytest.approx(by.loc["a", "kappa"], rel=1e-12)  # not halved


def test_input_dependence_at_a_point_that_is_not_fixed_says_so():
    step = lambda h, x: 0.5 * h + x  # noqa: E731 - fixed point h* = 2x
    x = randn(6)
    good = input_dependence(step, 2 * x, x)
    assert good.converged and good.reason == ""
    assert good.value == pytest.approx(2.0, rel=1e-8)  # (I - 0.5 I)^-1
    bad = input_dependence(step, x, x)
    assert not bad.converged and "not a fixed point" in bad.reason


def test_a_float32_true_change_near_roundoff_is_taken_in_float64(monkeypatch):
    model = make(ForLoopModel, K=1, R=3).float()
    x = randn(3, 5).float()
    loss = lambda out, inp: out.square().mean()  # noqa: E731
    chk = bound_check(lp.attach(model), x, loss, lr=1e-6, alpha=1.0, beta=1.0)
    assert chk.converged, chk.reason
    assert chk.dF_roundoff < 1e-6  # float64: the difference is exact to many digits
    assert chk.dF_true == pytest.approx(chk.dF_first, rel=1e-3)  # a tiny step is first order
    import loopprobe.estimate.bound as bound

    monkeypatch.setattr(bound, "FLOAT64_COPY_LIMIT", 0)  # too large to copy: flag instead
    flagged = bound_check(lp.attach(model), x, loss, lr=1e-6, alpha=1.0, beta=1.0)
    assert flagged.dF_roundoff > 1e-3
    assert not flagged.converged and "roundoff" in flagged.reason


def test_bound_check_reports_both_visit_counts_for_a_truncated_model():
    cfg = lp.models.GPTConfig(K=1, R=4, norm="deeploop", d_model=16, n_heads=2, grad_rounds=2)
    model = lp.models.LoopedGPT(cfg).double()
    idx, tg = lp.tasks.random_tokens(2, 8, 64, generator=torch.Generator().manual_seed(0))
    chk = bound_check(
        lp.attach(model), idx, lambda o, i: F.cross_entropy(o.flatten(0, 1), tg.flatten())
    )
    assert (chk.M, chk.M_g) == (8, 4)
    assert chk.prediction_M == pytest.approx(2 * chk.prediction, rel=1e-12)
    assert "converged" in chk.to_dict() and "reason" in chk.to_dict()


def test_a_sweep_row_carries_the_verdict_of_the_result_it_came_from(tmp_path):
    model = make(ForLoopModel, K=1, R=3)
    x = randn(3, 5)

    def alignment(cfg):
        return visit_alignment(
            lp.attach(model), x, lambda o, i: o.square().mean(), method="power",
            max_iter=cfg["iters"],
        )  # fmt: skip

    df = lp.sweep(lp.grid(iters=[2, 200]), alignment, cache_dir=tmp_path)
    by = df.groupby("iters").result_converged.all()
    assert not by[2] and by[200]
    assert df[df.iters == 2].result_reason.str.contains("not converged").all()
