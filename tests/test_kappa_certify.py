"""kappa's certificate certifies: the default call is converged where the number is right.

Models written the way third-party code is (a zero pad of the default dtype, a float32
router gate in a float64 model, a model returning only its loss, a read-out after every
round), each with an explicitly untied twin: dense Jacobians and exact gradients in float64
give the exact kappa_j, which must lie in the reported interval while ``converged`` is True.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from test_sensitivity import top_sv
from thirdparty_models import MLPBlock, SharedBlockModel, make, randn
from torch import nn
from torch.func import functional_call, jacrev

import loopprobe as lp
from loopprobe.estimate.alignment import visit_alignment
from loopprobe.estimate.kappa_bounds import KappaStop, default_kappa_tol
from loopprobe.precision import dtypes_on_path


class PaddedLoop(nn.Module):
    """Injects its input, padded with ``torch.zeros`` of the default dtype, every round."""

    def __init__(self, d: int = 6, extra: int = 2, R: int = 3) -> None:
        super().__init__()
        self.R, self.extra = R, extra
        self.inp = nn.Linear(4, d - extra)
        self.block = MLPBlock(d)
        self.out = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.inp(x)
        inj = torch.cat([e, torch.zeros(*e.shape[:-1], self.extra)], -1)  # float32 zeros
        h = inj
        for _ in range(self.R):
            h = self.block(h + inj)
        return self.out(h)


class GatedLoop(nn.Module):
    """A router gate kept in float32 inside a float64 model (cast back after it)."""

    def __init__(self, d: int = 6, R: int = 3) -> None:
        super().__init__()
        self.R = R
        self.block = MLPBlock(d)
        self.gate = nn.Linear(d, 1)
        self.out = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for _ in range(self.R):
            g = torch.sigmoid(self.gate(h.to(next(self.gate.parameters()).dtype))).to(h.dtype)
            h = h + g * (self.block(h) - h)
        return self.out(h)


class LossOnlyLoop(nn.Module):
    """Returns only its loss (PonderNet in train mode): a scalar output, summed over the
    rounds into an accumulator made by ``torch.zeros`` of the default dtype."""

    def __init__(self, d: int = 6, R: int = 3) -> None:
        super().__init__()
        self.R = R
        self.block = MLPBlock(d)
        self.out = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = torch.zeros(())  # float32: promoted away by the first addition
        for _ in range(self.R):
            x = self.block(x)
            total = total + (self.out(x) ** 2).mean() / self.R
        return total


class Untied(nn.Module):
    """The k-th call goes to a private copy of the module (an explicitly untied twin)."""

    def __init__(self, module: nn.Module, R: int) -> None:
        super().__init__()
        self.copies = nn.ModuleList(copy.deepcopy(module) for _ in range(R))
        self.calls = 0

    def forward(self, *args):
        out = self.copies[self.calls % len(self.copies)](*args)
        self.calls += 1
        return out


def exact_kappas(model, x, loss, names: list[str], R: int) -> dict[str, float]:
    """kappa_j of each named module from a float64 untied twin: dense Jacobians, exact G."""
    twin = copy.deepcopy(model).double()
    for name in names:
        setattr(twin, name, Untied(getattr(twin, name), R))
    x = x.double() if x.is_floating_point() else x
    params = {n: p.detach() for n, p in twin.named_parameters()}
    J = jacrev(lambda ps: functional_call(twin, ps, (x,)).reshape(-1))(params)
    grads = dict(zip(params, torch.autograd.grad(loss(twin(x), x), list(twin.parameters())),
                     strict=True))  # fmt: skip
    out = {}
    for name in names:
        keys = [[n for n in params if n.startswith(f"{name}.copies.{r}.")] for r in range(R)]
        Js = [torch.cat([J[n].reshape(J[n].shape[0], -1) for n in ks], 1) for ks in keys]
        Gs = [torch.cat([grads[n].reshape(-1) for n in ks]) for ks in keys]
        num = top_sv(sum(Js)) * float(sum(Gs).norm())
        out[name] = num / (R * max(top_sv(a) for a in Js) * max(float(g.norm()) for g in Gs))
    return out


def sq(out, inputs):
    return (out**2).sum()


def build(kind: str):
    """(model, inputs, names of the reused modules, R) for one precision setting."""
    if kind == "padded float64":
        return make(PaddedLoop, seed=0), randn(3, 4), ["block"], 3
    if kind == "mixed float32 gate":
        model = make(GatedLoop, seed=1)
        model.gate.float()
        return model, randn(3, 6), ["block", "gate"], 3
    if kind == "float32":
        return make(SharedBlockModel, seed=2, R=3).float(), randn(3, 6).float(), ["block"], 3
    raise ValueError(kind)


KINDS = ["padded float64", "mixed float32 gate", "float32"]


@pytest.mark.parametrize("kind", KINDS)
def test_the_default_call_is_converged_with_the_exact_kappa_inside_its_interval(kind):
    model, x, names, R = build(kind)
    before = copy.deepcopy(model.state_dict())
    rep = visit_alignment(lp.attach(model), x, sq)
    assert rep.converged, rep.reason
    assert 0 <= rep.kappa_err <= rep.tol
    exact = exact_kappas(model, x, sq, names, R)
    rows = rep.sublayers.set_index("sublayer")
    for name, value in exact.items():
        row = rows.loc[name]
        assert row.kappa_lo <= value <= row.kappa_hi, (name, value, row.kappa_lo, row.kappa_hi)
        assert abs(row.kappa - value) <= row.kappa_err <= rep.tol
    assert rep.kappa_lo <= max(exact.values()) <= rep.kappa_hi
    for k, v in model.state_dict().items():  # probing never changes the model
        assert torch.equal(v, before[k])


def test_a_float32_zero_pad_leaves_a_float64_model_float64():
    model, x, _, _ = build("padded float64")
    assert dtypes_on_path(lambda: model(x)) == {torch.float64}
    rep = visit_alignment(lp.attach(model), x, sq)
    assert rep.tol == default_kappa_tol(torch.float64) == 1e-6
    assert rep.sensitivity.eps == torch.finfo(torch.float64).eps
    assert rep.kappa_err <= 1e-6 and "default" not in rep.reason


def test_a_float32_gate_makes_the_operators_float32_and_the_reason_says_so():
    model, x, _, _ = build("mixed float32 gate")
    assert dtypes_on_path(lambda: model(x)) == {torch.float32, torch.float64}
    rep = visit_alignment(lp.attach(model), x, sq)
    assert rep.tol == default_kappa_tol(torch.float32) == 1e-3
    assert "float32 default" in rep.reason and rep.converged
    asked = visit_alignment(lp.attach(model), x, sq, tol=1e-2)
    assert asked.tol == 1e-2 and "default" not in asked.reason


def test_a_cast_down_rounds_and_counts_a_view_or_a_wider_copy_does_not():
    x = torch.randn(4, dtype=torch.float64)
    z = torch.zeros(4)  # float32, made without arithmetic
    assert dtypes_on_path(lambda: torch.cat([x, z]) * 2) == {torch.float64}
    assert dtypes_on_path(lambda: x + z.to(torch.float64).view(2, 2).reshape(-1)) == {torch.float64}
    assert dtypes_on_path(lambda: x.float() * 2) == {torch.float32}
    assert torch.float32 in dtypes_on_path(lambda: x.float())  # the cast itself rounds
    assert torch.float32 in dtypes_on_path(lambda: z + 1)  # arithmetic in float32
    table = nn.Embedding(5, 4)  # float32 rows looked up, then widened: nothing rounds
    assert dtypes_on_path(lambda: table(torch.tensor([1, 2])).double() + x) == {torch.float64}


def test_visit_rows_are_converged_only_when_their_own_norm_is_within_its_bound():
    model, x, names, R = build("padded float64")
    rep = visit_alignment(lp.attach(model), x, sq, tol=1e-4)
    twin = copy.deepcopy(model)
    twin.block = Untied(twin.block, R)
    params = {n: p.detach() for n, p in twin.named_parameters()}
    J = jacrev(lambda ps: functional_call(twin, ps, (x,)).reshape(-1))(params)
    vis = rep.visits[rep.visits.sublayer == "block"].sort_values("r")
    for row in vis.itertuples():
        ks = [n for n in params if n.startswith(f"block.copies.{row.r}.")]
        exact = top_sv(torch.cat([J[n].reshape(J[n].shape[0], -1) for n in ks], 1))
        assert row.U_lo <= exact <= row.U_hi
        assert abs(row.U_norm - exact) <= row.U_err * (1 + 1e-9)
        assert row.converged == (row.U_err <= 1e-4 * row.U_norm)
        if row.converged:
            assert abs(row.U_norm - exact) <= 1e-4 * exact * (1 + 1e-9)
    # visits that cannot be the max stop early (their Krylov runs are done) but do not
    # claim their own value to 1e-4: here r = 1, 2 (relative bounds 1.5e-4, 4.4e-3)
    assert vis.stopped.all() and not vis.converged.all()
    assert rep.converged, rep.reason


def test_a_model_returning_only_its_loss_is_converged_and_exact():
    model = make(LossOnlyLoop, seed=3)
    x = randn(3, 6)
    rep = visit_alignment(lp.attach(model), x, lambda out, inputs: out)
    assert rep.converged, rep.reason
    exact = exact_kappas(model, x, lambda out, inputs: out, ["block"], 3)["block"]
    row = rep.sublayers.set_index("sublayer").loc["block"]
    assert row.kappa_lo <= exact <= row.kappa_hi
    assert abs(rep.kappa - exact) <= rep.kappa_err <= rep.tol


def test_the_stopping_rule_is_an_object_that_takes_the_precision_of_the_run():
    from loopprobe.estimate.sensitivity_runs import RunContext

    model, x, _, _ = build("padded float64")
    rep = visit_alignment(lp.attach(model), x, sq, tol=1e-4)
    ups, sens = rep.updates, rep.sensitivity
    rule = KappaStop(sens.keys, list(sens.visits), ups, None)
    assert rule.tol is None
    rule.bind(RunContext(torch.float32, float(torch.finfo(torch.float32).eps), False))
    assert rule.tol == 1e-3 and not rule.warm_visits
    n = len(sens.keys)
    nan = torch.full((n,), float("nan"), dtype=torch.float64)
    assert not rule(torch.arange(n), nan, nan).any()  # nothing estimated: nothing stops
    done = torch.zeros(n, dtype=torch.float64)
    values = torch.tensor([e.value for e in sens.visit_norms]
                          + [sens.tied_norms[k[1]].value for k in sens.keys if k[0] == "tied"],
                          dtype=torch.float64)  # fmt: skip
    assert rule(torch.arange(n), values, done).all()  # exact norms: everything stops


# --------------------------------------------------------------------------- the CLI


class HeadEveryRound(nn.Module):
    """x-transformers ``looped=True`` style: the logits are read out after every round and
    averaged, so the head is called R times too."""

    def __init__(self, d: int = 6, R: int = 3) -> None:
        super().__init__()
        self.R = R
        self.block = MLPBlock(d)
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for _ in range(self.R):
            x = self.block(x)
            outs.append(self.head(x))
        return torch.stack(outs).mean(0)


def head_every_round(R: int = 3) -> nn.Module:
    return make(HeadEveryRound, seed=4, R=R)


def head_inputs() -> torch.Tensor:
    return randn(2, 6, seed=5)


def test_the_cli_counts_the_loop_body_only_when_a_head_runs_after_every_round(capsys):
    from loopprobe.cli import main

    argv = ["kappa", "--model", f"{__name__}:head_every_round", "--inputs",
            f"{__name__}:head_inputs", "--R", "3", "--alpha", "1", "--beta", "0.5",
            "--json"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    roles = {s["sublayer"]: s["role"] for s in out["sublayers"]}
    body = [s for s in out["sublayers"] if s["role"] == "body"]
    assert roles.get("head") != "body" and body
    M_g = sum(s["R_g"] for s in body)
    assert out["M_g"] == M_g == 3 and out["M"] == 3
    assert out["bound"] == pytest.approx(M_g * out["kappa"] * 0.25)
    model = head_every_round(3)
    chk = lp.bound_check(lp.attach(model), head_inputs(), sq, alpha=1.0, beta=0.5)
    assert chk.M_g == out["M_g"]
    assert out["kappa_lo"] <= out["kappa"] <= out["kappa_hi"]
    assert 0 <= out["kappa_err"] <= out["tol"]
    assert {"U_lo", "U_hi", "U_err"} <= set(out["visits"][0])


def test_health_takes_kappas_default_tolerance_from_the_precision():
    """lp.health once hard-coded tol=1e-4, below a float32 kappa's roundoff allowance (about
    5e-5 kappa): a right float32 kappa came back not converged and alignment 'cannot tell'."""
    model = make(SharedBlockModel, seed=2, R=3).float()
    h = lp.health(model, randn(3, 6).float(), alpha=1.0, beta=1.0, progress=False)
    assert not [p for p in h.problems if p.startswith("κ_R")], h.problems
    assert h.frame.set_index("check").loc["alignment", "verdict"] != "cannot tell"


def test_the_cli_text_prints_kappas_bound_and_interval_and_the_body_count(capsys):
    from loopprobe.cli import main

    argv = ["kappa", "--model", f"{__name__}:head_every_round", "--inputs",
            f"{__name__}:head_inputs", "--R", "3"]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "M=3 forward visits, M_g=3 gradient-visible" in text
    assert "kappa_R error bound" in text and "the exact kappa_R lies in [" in text
