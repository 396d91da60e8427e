"""The health check's readings a researcher acts on: fine / risk / cannot tell, with margins.

On user-style models (tests/health_models.py, tests/huginn_model.py): every line reads fine,
risk (with what to change) or cannot tell (with what would tell), the theory's premise shown
as context; a reading inside its noise is "cannot tell"; the increments' cosines, the growth
exponent and the oscillation mean match a float64 brute force from hooks; the loss named is
the loss used; and the report's exit codes a CI job can trust.
"""

from __future__ import annotations

import json
import math

import health_models as hm
import huginn_model as hg
import numpy as np
import pandas as pd
import pytest
import torch
from scipy.stats import t as student_t

import loopprobe as lp
from loopprobe.estimate import health as H


def check(model, inputs, **kw) -> H.Health:
    return lp.health(model, inputs, progress=False, **kw)


def row(h: H.Health, name: str) -> dict:
    return h.frame.set_index("check").loc[name].to_dict()


@pytest.fixture(scope="module")
def huginn() -> H.Health:
    return check(hg.huginn(), hg.batch())


# --------------------------------------------------------------------------- readings


def test_every_line_reads_fine_risk_or_cannot_tell_and_says_what_to_do(huginn):
    f = huginn.frame
    assert set(f.reading) <= {H.FINE, H.RISK, H.UNKNOWN} and f.advice.str.len().min() > 10
    for name in ("alignment", "increments"):  # the theory's premises: context, not a failure
        r = row(huginn, name)
        assert "premise" in r["claim"]
        assert r["verdict"] == H.HOLDS or r["reading"] != H.RISK  # an unmet premise: no risk
    # decorrelated visits at init: the premise does not hold, and that is fine, not a risk
    a = row(huginn, "alignment")
    assert (a["verdict"], a["reading"]) == (H.FAILS, H.FINE) and "decorrelated" in a["measured"]
    for name in ("fixed point", "spectral radius"):  # no round map: says what would tell
        assert row(huginn, name)["reading"] == H.UNKNOWN and "step=" in row(huginn, name)["advice"]
    lines = huginn.lines()
    assert lines[1].startswith("[fine] alignment (measurement)") and lines[3].startswith("    → ")
    counts = dict(zip(f.reading.value_counts().index, f.reading.value_counts(), strict=True))
    assert lines[-2] == ", ".join(f"{counts.get(k, 0)} {k}" for k in (H.RISK, H.UNKNOWN, H.FINE))


def test_a_risk_names_what_to_change():
    h = check(hm.loop_expanding(), hm.features(), alpha=1.0, beta=1.0)
    bound, scaling = row(h, "bound"), row(h, "scaling")
    assert bound["reading"] == H.RISK and "learning rate" in bound["advice"]
    assert f"{bound['value']:.3g}×" in bound["advice"]
    need = h.values["p_needed"]
    assert scaling["reading"] == H.RISK and f"(p = {need:.3g})" in scaling["advice"]
    rho = row(h, "spectral radius")
    assert rho["reading"] == H.RISK and rho["value"] > 1 and "damp" in rho["advice"]
    assert h.reading("bound") == H.RISK and h.risks()["bound"] == bound["advice"]
    assert set(h.risks()) == set(h.frame.check[h.frame.reading == H.RISK])


def test_the_alpha_beta_advice_says_what_they_mean_without_a_residual(huginn):
    advice = row(huginn, "bound")["advice"]
    assert "--alpha --beta" in advice and "no residual across rounds" in advice


def test_a_partly_aligned_model_is_not_called_aligned():
    # under-relaxed loop: κ_R/R = 0.55 with a certified interval well inside (0.5, 0.8)
    h = check(hm.loop_smooth(), hm.features())
    r = row(h, "alignment")
    R = h.values["R"]
    assert 0.5 < h.values["kappa_lo"] / R <= h.values["kappa_hi"] / R < 0.8
    assert (r["verdict"], r["reading"]) == (H.FAILS, H.FINE) and "partly aligned" in r["measured"]
    assert "κ_R/R ≥ 0.8" == r["threshold"]


def test_kappa_r_names_the_sublayer_it_is_the_max_of(huginn):
    name = huginn.values["kappa_sublayer"]
    assert f"the largest κ_j, of {name}" in row(huginn, "alignment")["measured"]
    with lp.attach(hg.huginn()) as probe:
        rep = lp.visit_alignment(probe, hg.batch(), max_iter=50, tol=1e-4)
    body = rep.sublayers[rep.sublayers.role.eq("body")]
    assert body.loc[body.kappa.idxmax(), "sublayer"] == name
    assert huginn.values["kappa"] == pytest.approx(rep.kappa, rel=1e-6)


# --------------------------------------------------------------------------- margins


@pytest.mark.parametrize(("gain", "relax"), [(0.9, 0.85), (1.0, 0.8)])
def test_an_oscillation_mean_within_its_noise_of_zero_is_cannot_tell(gain, relax):
    # the two loops' means sit on either side of 0 (-0.05, +0.02): a coin flip, not a verdict
    model, x = hm.loop(6, gain, relax), hm.features()
    h = check(model, x)
    r = row(h, "oscillation")
    cos = _consecutive_G_cosines(model, x)
    mean, q = np.mean(cos), student_t.ppf(0.975, len(cos) - 1)
    half = q * np.std(cos, ddof=1) / math.sqrt(len(cos))
    assert r["value"] == pytest.approx(mean, abs=1e-10) and abs(mean) < half
    assert (r["verdict"], r["reading"]) == (H.UNKNOWN, H.UNKNOWN)
    assert f"{mean:.3g} ± {half:.2g}" in r["measured"]


def test_a_mean_far_outside_its_noise_still_decides():
    h = check(hm.loop_contracting(), hm.features())  # consecutive cosines ≈ -0.5 each
    assert row(h, "oscillation")["reading"] == H.RISK


def test_increments_on_their_threshold_within_noise_are_cannot_tell():
    h = check(hm.gpt(4, 0.5), hm.tokens())  # mean cos 0.48 over 6 pairs that spread widely
    r = row(h, "increments")
    assert abs(r["value"] - H.CORRELATED) < 0.1 and r["verdict"] == H.UNKNOWN
    # ... and the growth line says why "partly correlated" can still grow like √R: the
    # size-weighted coherence is near 0 (one increment dominates the sum)
    assert "size-weighted coherence m = " in row(h, "growth rule")["why"]


def _consecutive_G_cosines(model: hm.RelaxedLoop, x: torch.Tensor) -> list[float]:
    """cos(G_r, G_r+1) of the cell's visits, from an untied float64 copy (brute force)."""
    from test_health import untied

    F, thetas = untied(model, x)
    thetas = [t.requires_grad_() for t in thetas]
    G = torch.autograd.grad(0.5 * F(*thetas).pow(2).mean(), thetas)
    cos = torch.nn.functional.cosine_similarity
    return [float(cos(G[r], G[r - 1], 0)) for r in range(1, len(G))]


# --------------------------------------------------------------------------- brute force


@pytest.mark.parametrize("model", [hm.loop_contracting, hm.loop_smooth, hm.loop_overrelaxed])
def test_increment_cosines_and_growth_exponent_match_a_brute_force_from_hooks(model):
    m, x = model(), hm.features()
    incs = []
    hook = m.cell.register_forward_hook(lambda mod, args, out: incs.append(out - args[0]))
    with torch.no_grad():
        m(x)
    hook.remove()
    V = torch.stack([i.reshape(-1) for i in incs]).double()  # (R, d): one increment per visit
    n = len(V)
    C = torch.nn.functional.cosine_similarity(V[:, None], V[None], dim=-1)
    mean_cos = float((C.sum() - C.trace()) / (n * (n - 1)))
    c = float(V.sum(0).pow(2).sum() / V.pow(2).sum())
    e = 0.5 * (1 + math.log(c) / math.log(n))
    h = check(m, x)
    assert row(h, "increments")["value"] == pytest.approx(mean_cos, rel=1e-9, abs=1e-12)
    assert row(h, "growth rule")["value"] == pytest.approx(e, rel=1e-9, abs=1e-12)
    assert f"m = {(c - 1) / (n - 1):.3g}" in row(h, "growth rule")["why"]


# --------------------------------------------------------------------------- one loss


def test_the_loss_named_is_the_loss_used_and_kappa_is_its_kappa(huginn):
    assert huginn.values["loss"] == "the model's own .loss"
    model = hg.huginn()
    with lp.attach(model) as probe:
        own = lp.visit_alignment(probe, hg.batch(), lambda out, _: out.loss, max_iter=50, tol=1e-4)
    assert huginn.values["kappa"] == pytest.approx(own.kappa, rel=1e-6)
    plain = check(hg.huginn(), hg.no_labels())  # no labels: no .loss, the rule falls back
    assert plain.values["loss"].startswith("0.5 * mean(F^2)")
    with lp.attach(model) as probe:
        half = lp.visit_alignment(
            probe, hg.no_labels(), lambda out, _: 0.5 * out.logits.pow(2).mean(),
            max_iter=50, tol=1e-4,
        )  # fmt: skip
    assert plain.values["kappa"] == pytest.approx(half.kappa, rel=1e-6)
    assert abs(half.kappa - own.kappa) > 1e-3  # two losses, two κ: the label matters


def test_one_default_loss_rule_for_library_cli_and_report():
    from loopprobe.record import types
    from loopprobe.report import common

    loss, name = common.resolve_loss(None, lambda out: out.logits)
    assert isinstance(loss, types.DefaultLoss) and name.startswith("default: ")
    assert isinstance(types.default_loss(None, "visit_alignment"), types.DefaultLoss)
    out = hg.huginn()(**hg.no_labels())
    assert float(loss(out, None)) == pytest.approx(float(0.5 * out.logits.pow(2).mean()))
    assert loss.used.startswith("0.5 * mean(F^2)") and types.loss_label(loss) == loss.used
    with pytest.raises(ValueError, match="visit_alignment: loss_fn=None uses the loss"):
        types.default_loss(None, "visit_alignment")(out, None)


# --------------------------------------------------------------------------- the report


def test_the_report_health_section_shows_the_loss_it_used_and_readings(tmp_path, capsys):
    from loopprobe.cli import main

    out = tmp_path / "r"
    argv = ["report", "--model", "huginn_model:huginn", "--inputs", "huginn_model:batch"]
    assert main([*argv, "--sections", "health", "--out", str(out), "--no-progress"]) == 0
    res = json.loads((out / "results.json").read_text())
    sec = res["sections"]["health"]
    assert "loss: the model's own .loss" in sec["notes"]
    assert [n for n in sec["notes"] if n.startswith("loss:")] == ["loss: the model's own .loss"]
    assert res["config"]["loss"] == "the model's own .loss"
    assert {v["verdict"] for v in res["verdicts"]} <= {H.FINE, H.RISK, H.UNKNOWN}
    assert "[fine] alignment: the visits are aligned" in capsys.readouterr().out
    pngs = [f["png"] for f in sec["figures"]]  # the user's own per-visit figures
    assert pngs == ["health_visit_norms.png", "health_cosines.png"]
    assert all((out / p).read_bytes().startswith(b"\x89PNG") for p in pngs)
    visits = pd.read_csv(out / "health_visits.csv")
    assert len(visits[visits.sublayer == "core.0"]) == 4  # two core blocks, 4 rounds each


def test_a_requested_section_that_cannot_run_exits_2_with_one_line(tmp_path, capsys):
    from loopprobe.cli import main

    argv = ["report", "--model", "huginn_model:flat", "--inputs", "huginn_model:features"]
    code = main([*argv, "--sections", "health", "--out", str(tmp_path / "r"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("loopprobe report: error: --sections health could not run (health: ")


def test_ctrl_c_in_a_report_is_one_line_130_and_leaves_no_empty_folder(
    tmp_path, capsys, monkeypatch
):
    from loopprobe import report
    from loopprobe.cli import main

    def interrupted(*args, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "run_report", interrupted)
    out = tmp_path / "new" / "r"
    argv = ["report", "--model", "huginn_model:huginn", "--inputs", "huginn_model:batch"]
    assert main([*argv, "--out", str(out), "--no-progress"]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "interrupted" in err
    assert not out.exists() and not out.parent.exists()  # the folders it made are gone
    kept = tmp_path / "kept"
    kept.mkdir()
    assert main([*argv, "--out", str(kept), "--no-progress"]) == 130
    assert kept.is_dir()  # a folder the user made is theirs


def test_ctrl_c_during_start_up_is_one_line_and_130(capsys, monkeypatch):
    import loopprobe.cli as cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["theory"]) == 130
    assert capsys.readouterr().err == "loopprobe: interrupted\n"


def test_two_spectral_radii_in_one_report_say_where_each_was_taken(tmp_path):
    from loopprobe.cli import main

    out = tmp_path / "r"
    argv = ["report", "--model", "health_models:loop_expanding", "--inputs"]
    argv += ["health_models:features", "--sections", "health,fixedpoint,alignment"]
    assert main([*argv, "--out", str(out), "--no-progress", "--alpha", "1", "--beta", "1"]) == 0
    res = json.loads((out / "results.json").read_text())["sections"]
    health_rho = next(v for v in res["health"]["values"]["verdicts"] if "spectral" in v["claim"])
    assert "at Picard's last iterate" in health_rho["measured"]  # Picard diverges: ρ 1.35
    variant = res["fixedpoint"]["values"]["variants"][0]  # Anderson finds the unstable h*
    assert variant["converged"] and variant["method"] == "anderson"
    assert variant["ρ at"] == "the fixed point" and variant["ρ(∂T/∂h)"] > 1
    assert any("The health section's ρ" in n for n in res["fixedpoint"]["notes"])
    fp_verdict = res["fixedpoint"]["values"]["verdicts"][0]["measured"]
    assert f"at {variant['ρ at']}" in fp_verdict
    name = res["alignment"]["values"]["kappa_sublayer"]
    assert name == "cell" and any(f"of {name}" in n for n in res["alignment"]["notes"])


def test_the_cli_and_the_report_build_one_target_object(monkeypatch):
    from loopprobe import report
    from loopprobe.cli import _target, build_parser
    from loopprobe.record.target import Target
    from loopprobe.record.types import DefaultLoss

    args = build_parser().parse_args(
        ["kappa", "--model", "huginn_model:huginn", "--inputs", "huginn_model:batch"]
    )
    cli = _target.build_target(args, None)
    rep = report.load_user_model("huginn_model:huginn", "huginn_model:batch")
    assert type(cli) is type(rep) is Target and report.UserModel is Target
    assert isinstance(cli.loss_fn, DefaultLoss) and isinstance(rep.loss_fn, DefaultLoss)
    h = lp.health(rep.model, rep.inputs, loss_fn=rep.loss_fn, progress=False,
                  **rep.probe_kwargs())  # fmt: skip
    assert rep.loss_label == h.values["loss"] == "the model's own .loss"
    assert cli.loss_label.startswith("default: ")  # not run yet: the rule, not a guess


def test_nan_weights_are_a_finding_naming_the_visit_not_an_exception():
    model = hm.loop_contracting()
    with torch.no_grad():
        model.cell.W.weight[0, 0] = float("nan")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    h = check(model, hm.features())
    first = h.frame.iloc[0]
    assert (first.check, first.reading, first.verdict) == ("finite", H.RISK, H.FAILS)
    assert "visit r=0 of sublayer 'cell'" in first.measured
    assert "non-finite parameters: cell.W.weight" in first.measured
    assert list(h.frame.check[1:]) == list(H.CHECKS) and set(h.frame.reading[1:]) == {H.UNKNOWN}
    assert not h.converged and h.reason.startswith("not finite:")
    assert h.values["non_finite"] == ["cell.W.weight"]
    for k, v in model.state_dict().items():  # probing left the model as it was, NaN included
        assert torch.allclose(before[k], v, equal_nan=True)
    assert str(h).startswith("health of RelaxedLoop: ? gradient-visible")


def test_a_real_sigint_at_start_up_or_mid_run_is_one_line_130_and_no_folder(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    from _liveness import cpu_seconds

    tests = os.path.dirname(os.path.abspath(__file__))
    cli = [sys.executable, "-m", "loopprobe.cli", "report", "--no-progress"]
    cli += ["--model", "huginn_model:huginn", "--inputs", "huginn_model:batch"]
    for when in ("start-up", "mid-run"):
        out = tmp_path / when / "r"
        p = subprocess.Popen(
            [*cli, "--out", str(out)], cwd=tests, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
        deadline = time.monotonic() + 120
        if when == "start-up":  # past the interpreter and `import loopprobe.cli` (0.04 CPU-s),
            # inside the torch import main makes (0.9 CPU-s): counted in CPU, not wall, time so
            # that a loaded machine cannot land the signal in the interpreter's own start-up
            while cpu_seconds([p.pid]) < 0.3 and p.poll() is None:
                time.sleep(0.01)
        else:  # the folder is made just before the computation starts
            while not out.exists() and time.monotonic() < deadline and p.poll() is None:
                time.sleep(0.02)
            assert out.exists(), "the report never started"
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
        assert p.returncode == 130 and err.decode().count("\n") == 1, err.decode()
        assert "interrupted" in err.decode() and not (tmp_path / when).exists()
