"""The health check (``lp.health``, ``report --sections health``) on user-style models.

Three shapes not in ``lp.models`` (tests/health_models.py): a post-norm SDPA + RMSNorm GPT
block with an input-injection layer, the same called with a dict and returning an HF-style
output, and a looped MLP with a round map. For every threshold a pair of models sits on
either side of it and the verdict flips; κ_R, ρ and the gradient readings are checked
against a dense float64 brute force (untied copies, ``torch.func.jacrev``, ``eigvals``).
"""

from __future__ import annotations

import json

import health_models as hm
import pytest
import torch
from torch.func import functional_call, jacrev

import loopprobe as lp
from loopprobe.estimate import health as H
from loopprobe.report.verdicts import Verdict

BRANCHES = ["block.attn", "block.mlp"]  # the residual branches of the GPT block
KINDS = {"alignment": "measurement", "bound": "measurement", "scaling": "inference",
         "increments": "measurement", "growth rule": "inference", "fixed point": "measurement",
         "spectral radius": "measurement", "oscillation": "measurement",
         "explosion": "measurement"}  # fmt: skip


def check(model, inputs, **kw) -> H.Health:
    return lp.health(model, inputs, progress=False, **kw)


@pytest.fixture(scope="module")
def runs() -> dict[str, H.Health]:
    """One health check per model; each pair of them sits on two sides of a threshold."""
    torch.set_num_threads(1)
    tok, x = hm.tokens(), hm.features()
    return {
        "deeploop": check(hm.gpt(4, 0.5, inject=False), tok, sublayers=BRANCHES),
        "deepnorm": check(hm.gpt(4, 0.25, inject=False), tok, sublayers=BRANCHES),
        "injected": check(hm.gpt(4, 0.5), tok),
        "dict": check(hm.dict_gpt(), hm.dict_batch()),
        "contracting": check(hm.loop_contracting(), x),
        "expanding": check(hm.loop_expanding(), x, alpha=1.0, beta=1.0),
        "smooth": check(hm.loop_smooth(), x),
        "overrelaxed": check(hm.loop_overrelaxed(), x),
    }


def row(h: H.Health, name: str) -> dict:
    return h.frame.set_index("check").loc[name].to_dict()


# --------------------------------------------------------------------------- the frame


def test_every_check_is_one_row_saying_measured_theory_threshold_verdict_and_kind(runs):
    for h in runs.values():
        assert list(h.frame.columns) == H.COLUMNS
        assert dict(zip(h.frame.check, h.frame.kind, strict=True)) == KINDS
        assert set(h.frame.verdict) <= {H.HOLDS, H.FAILS, H.UNKNOWN}
        assert h.frame.predicted.str.len().min() > 0 and h.frame.threshold.str.len().min() > 0
        text = str(h)
        assert set(h.frame.reading) <= {H.FINE, H.RISK, H.UNKNOWN}
        assert h.frame.advice.str.len().min() > 0  # what to change, or what would tell
        assert len(h.lines()) == 3 + 3 * len(KINDS) and text.startswith("health of ")
        assert "(inference)" in text and "(measurement)" in text
        assert h.converged, h.reason


@pytest.mark.parametrize(
    ("check_", "holds", "fails", "threshold", "above"),
    [
        ("alignment", "deeploop", "injected", H.ALIGNED, True),
        ("bound", "deeploop", "deepnorm", H.BOUND_MAX, False),
        ("increments", "deeploop", "contracting", H.CORRELATED, True),
        ("growth rule", "injected", "deeploop", H.SQRT_RULE, False),
        ("fixed point", "contracting", "expanding", H.FIXED_POINT_TOL, False),
        ("spectral radius", "contracting", "expanding", H.RHO_MAX, False),
        ("oscillation", "smooth", "contracting", H.OSCILLATION, True),
        ("explosion", "contracting", "overrelaxed", H.EXPLOSION, False),
    ],
)
def test_each_threshold_has_a_model_on_either_side_and_the_verdict_flips(
    runs, check_, holds, fails, threshold, above
):
    good, bad = row(runs[holds], check_), row(runs[fails], check_)
    assert (good["verdict"], bad["verdict"]) == (H.HOLDS, H.FAILS), (good, bad)
    if above:
        assert good["value"] >= threshold > bad["value"]
    else:
        assert good["value"] <= threshold < bad["value"] or (
            check_ == "spectral radius" and good["value"] < threshold <= bad["value"]
        )


SIDES = {  # the side of its threshold on which a check holds
    "alignment": lambda v: v >= H.ALIGNED,
    "bound": lambda v: v <= H.BOUND_MAX,
    "increments": lambda v: v >= H.CORRELATED,
    "growth rule": lambda v: v <= H.SQRT_RULE,
    "fixed point": lambda v: v <= H.FIXED_POINT_TOL,
    "spectral radius": lambda v: v < H.RHO_MAX,
    "oscillation": lambda v: v >= H.OSCILLATION,
    "explosion": lambda v: v <= H.EXPLOSION,
}


def test_every_verdict_sits_on_its_side_of_the_stated_threshold(runs):
    judged = 0
    for name, h in runs.items():
        for r in h.frame.to_dict("records"):
            if r["check"] not in SIDES or r["verdict"] == H.UNKNOWN:
                continue
            judged += 1
            assert (r["verdict"] == H.HOLDS) == SIDES[r["check"]](r["value"]), (name, r)
            if r["check"] == "growth rule" and r["verdict"] == H.FAILS:
                assert r["value"] >= H.LINEAR_RULE, (name, r)
    assert judged >= 50


def test_the_scaling_line_compares_the_model_s_exponent_with_the_one_that_keeps_it_flat(runs):
    dl, dn = runs["deeploop"], runs["deepnorm"]
    assert (dl.verdict("scaling"), dn.verdict("scaling")) == (H.HOLDS, H.FAILS)
    assert dl.values["p"] == pytest.approx(0.5) and dn.values["p"] == pytest.approx(0.25)
    for h in (dl, dn):  # aligned visits: gamma near 1, the DeepLoop exponent is needed
        assert h.values["gamma"] > 0.9 and h.values["p_needed"] > 0.47
        need = h.values["p_needed"]
        assert (h.values["p"] >= need - H.SCALING_TOL) == (h.verdict("scaling") == H.HOLDS)
    # the bound next to DeepNorm's and DeepLoop's at N = M_g / 2 = 4 (here the model's own N)
    assert f"DeepLoop {dl.values['bound']:.3g}" in row(dl, "bound")["predicted"]
    assert f"DeepNorm {dn.values['bound']:.3g}" in row(dn, "bound")["predicted"]


def test_alpha_and_beta_are_read_from_the_model_and_the_line_says_where(runs):
    assert "alpha model.alpha, beta model.beta" in row(runs["deeploop"], "bound")["measured"]
    assert "alpha model.cfg.alpha" in row(runs["dict"], "bound")["measured"]
    assert "alpha given, beta given" in row(runs["expanding"], "bound")["measured"]
    alpha, beta = hm.scales(4, 0.5)
    assert (runs["dict"].values["alpha"], runs["dict"].values["beta"]) == (alpha, beta)


def test_a_check_that_cannot_run_says_cannot_tell_and_names_the_option(runs):
    no_step = row(runs["deeploop"], "fixed point")
    assert no_step["verdict"] == H.UNKNOWN and "--step" in no_step["why"]
    assert row(runs["deeploop"], "spectral radius")["verdict"] == H.UNKNOWN
    for name in ("bound", "scaling"):
        r = row(runs["contracting"], name)  # no alpha/beta given, none on the model
        assert r["verdict"] == H.UNKNOWN and "--alpha --beta" in r["why"]
    h = check(hm.loop_contracting(), hm.features(), sublayers=["cell.W"])
    for name in ("increments", "growth rule"):  # W's output is not an increment
        r = row(h, name)
        assert r["verdict"] == H.UNKNOWN and "--increment" in r["why"]


def test_unconverged_kappa_is_cannot_tell_and_marks_the_result_unconverged():
    h = check(hm.loop_smooth(), hm.features(), max_iter=1, alpha=1.0, beta=1.0)
    assert not h.converged and h.reason.startswith("κ_R:")
    for name in ("alignment", "bound", "scaling"):
        assert h.verdict(name) == H.UNKNOWN
        assert "not converged" in row(h, name)["why"]


def test_the_round_map_can_be_given_as_one_round_or_as_a_roundmap_factory(runs):
    model, x = hm.loop_contracting(), hm.features()
    by_fn = check(model, x, step=hm.step_fn)  # fn(model, h, x) -> h
    rm = lp.round_map(model, x)
    by_map = check(model, x, step=lambda m, inputs: rm)  # fn(model, inputs) -> RoundMap
    rho = row(runs["contracting"], "spectral radius")["value"]
    for h in (by_fn, by_map):
        assert row(h, "spectral radius")["value"] == pytest.approx(rho, rel=1e-8)
    with pytest.raises(TypeError, match="fn\\(model, h, x\\) -> h"):
        check(model, x, step=3)


def test_bad_alpha_is_a_value_error_naming_the_fix():
    with pytest.raises(ValueError, match="alpha=-1.0 \\(given\\).*--alpha --beta"):
        check(hm.loop_smooth(), hm.features(), alpha=-1.0, beta=1.0)


def test_probing_leaves_the_model_its_grads_mode_and_the_rng_alone():
    model, x = hm.loop_contracting(), hm.features()
    model.train()
    model.head.weight.grad = torch.ones_like(model.head.weight)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    check(model, x, alpha=1.0, beta=1.0)
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training and all(m.training for m in model.modules())
    assert torch.equal(model.head.weight.grad, torch.ones_like(model.head.weight))
    assert model.cell.W.weight.grad is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# --------------------------------------------------------------------------- brute force


def untied(model: hm.RelaxedLoop, x: torch.Tensor):
    """F and the loss of the loop with one private copy of the cell's parameters per visit."""
    names = [n for n, _ in model.cell.named_parameters()]

    def F(*flat: torch.Tensor) -> torch.Tensor:
        e = model.embed(x)
        h = e
        for theta in flat:
            params, i = {}, 0
            for n, p in model.cell.named_parameters():
                params[n] = theta[i : i + p.numel()].view_as(p)
                i += p.numel()
            h = functional_call(model.cell, params, (h, e))
        return model.head(h).reshape(-1)

    theta = torch.cat([p.detach().reshape(-1) for _, p in model.cell.named_parameters()])
    assert names == ["W.weight", "W.bias", "U.weight"]
    return F, [theta.clone() for _ in range(model.R)]


def test_kappa_rho_and_gradient_readings_match_a_dense_untied_brute_force():
    model, x = hm.loop_contracting(), hm.features()
    h = check(model, x, tol=1e-10, max_iter=300)
    F, thetas = untied(model, x)
    with torch.no_grad():
        J = jacrev(F, argnums=tuple(range(len(thetas))))(*thetas)  # U_r: dense (9, 136)
    thetas = [t.requires_grad_() for t in thetas]
    out = F(*thetas)
    G = torch.autograd.grad(0.5 * out.pow(2).mean(), thetas)  # G_r of the untied copies
    norm2 = lambda m: float(torch.linalg.matrix_norm(m, 2))  # noqa: E731
    R = len(G)
    kappa = (norm2(sum(J)) * float(sum(G).norm())) / (
        R * max(norm2(j) for j in J) * max(float(g.norm()) for g in G)
    )
    assert h.values["kappa"] == pytest.approx(kappa, rel=1e-5)
    cos = [float(torch.nn.functional.cosine_similarity(G[r], G[r - 1], 0)) for r in range(1, R)]
    assert row(h, "oscillation")["value"] == pytest.approx(sum(cos) / len(cos), rel=1e-8)
    norms = [float(g.norm()) for g in G]
    assert row(h, "explosion")["value"] == pytest.approx(max(norms) / norms[-1], rel=1e-8)
    # rho: the dense Jacobian of one round at the fixed point, and its eigenvalues
    with torch.no_grad():
        e, hs = model.embed(x), model.embed(x)
        for _ in range(500):
            hs = model.step(hs, e)
    dense = jacrev(lambda s: model.step(s, e))(hs).detach().reshape(hs.numel(), hs.numel())
    rho = float(torch.linalg.eigvals(dense).abs().max())
    assert row(h, "spectral radius")["value"] == pytest.approx(rho, rel=1e-6)


# --------------------------------------------------------------------------- the report


def test_verdict_kind_is_optional_and_shown_in_the_line():
    plain = Verdict("s", "claim", "holds", "1", "2")
    assert plain.line() == "[holds] claim: 1 (expected 2)" and plain.to_dict()["kind"] == ""
    assert (
        "[holds] claim (inference): 1"
        in Verdict("s", "claim", "holds", "1", "2", "", "inference").line()
    )


def test_report_sections_health_on_a_user_model_writes_its_verdicts(tmp_path, capsys):
    from loopprobe.cli import main

    out = tmp_path / "r"
    argv = ["report", "--model", "health_models:gpt_plain", "--inputs", "health_models:tokens"]
    argv += ["--step", "health_models:gpt_round", "--sections", "health", "--out", str(out)]
    assert main([*argv, "--no-progress"]) == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    assert results["sections"]["health"]["status"] == "ok"
    verdicts = [v for v in results["verdicts"] if v["section"] == "health"]
    assert [v["claim"].split(":")[0] for v in verdicts] == list(KINDS)
    assert {v["claim"].split(":")[0]: v["kind"] for v in verdicts} == KINDS
    by = {v["claim"].split(":")[0]: v for v in verdicts}
    assert by["fixed point"]["verdict"] != H.UNKNOWN  # --step made the round map known
    assert by["spectral radius"]["verdict"] != H.UNKNOWN
    assert "model.alpha" in by["bound"]["measured"]
    text = capsys.readouterr().out
    assert "verdicts:" in text and "(inference)" in text


def test_the_health_section_skips_the_reference_model_with_the_reason(tmp_path):
    from loopprobe import report

    results = report.run_report(tmp_path, sections=["health"], progress=False, echo=lambda s: None)
    assert results["sections"]["health"]["status"] == "skipped"
    assert "--model" in results["sections"]["health"]["reason"]
