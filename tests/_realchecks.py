"""The checks every test_real_<family>.py runs on its model, each against a brute force.

Every check probes the model exactly as built (tests/realmodels.py) with only the user's
``forward=``/``output=``/``loss_fn=``, and returns the figures it measured (relative
errors, kappa, rho) so that a failure message and the README table can quote them.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch
from _oracles import (
    assert_unchanged,
    dense_norm_of_visit,
    renamed,
    restart,
    snapshot,
    untied_twin,
)
from realmodels import RealModel

import loopprobe as lp
from loopprobe.estimate.sensitivity import sensitivity_norms
from loopprobe.estimate.updates import per_visit_updates
from loopprobe.record.types import call_model

# float64 end to end: the two sides of each check differ by summation order only.
EXACT = 1e-12
# Operator norms by Lanczos on U^T U: the default power iteration needs 250+ products on
# ALBERT (close top singular values) and misses its 1e-10 tolerance within 500 on HRM-Text
# (float32 norms inside), where Lanczos converges in 15-25 (same values to 2e-9).


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def probe(case: RealModel) -> lp.Probe:
    return lp.attach(case.model)


def loss_of(case: RealModel, model: torch.nn.Module) -> torch.Tensor:
    return case.loss_fn(call_model(model, case.inputs, case.forward), case.inputs)


def untie_key(case: RealModel, param_names: tuple[str, ...]) -> str:
    """The reused module (a key of ``case.visit_prefixes``) that holds a sublayer."""
    for key in case.visit_prefixes:
        if all(n.startswith(key + ".") for n in param_names):
            return key
    raise AssertionError(f"no untied module of the twin holds {param_names[:2]}...")


def updates(case: RealModel) -> tuple[lp.Probe, Any]:
    p = probe(case)
    return p, per_visit_updates(p, case.inputs, case.loss_fn, forward=case.forward)


def check_sum_of_G_is_the_tied_gradient(case: RealModel) -> float:
    """``sum_r G_{r,j}`` against ``torch.autograd.grad`` of the loss (a fresh deep copy)."""
    p, up = updates(case)
    ref = copy.deepcopy(case.model)
    worst = 0.0
    for g in p.groups():
        params = [ref.get_parameter(n) for n in g.sublayer.param_names]
        grads = torch.autograd.grad(loss_of(case, ref), params, allow_unused=True)
        tied = torch.cat(
            [
                (gr if gr is not None else torch.zeros_like(q)).reshape(-1)
                for gr, q in zip(grads, params, strict=True)
            ]
        )
        if tied.norm() == 0:  # the loss does not reach this sublayer: neither may G
            assert float(up.tied(g.sublayer.index).abs().max()) == 0.0, g.sublayer.name
            continue
        err = rel(up.tied(g.sublayer.index), tied)
        assert err < EXACT, f"{g.sublayer.name}: sum_r G vs tied gradient, rel err {err:.2e}"
        worst = max(worst, err)
    return worst


def check_G_per_visit_is_the_untied_twin(case: RealModel) -> tuple[float, int]:
    """Each ``G_{r,j}`` against the gradient of visit r's private copy in the untied twin."""
    p, up = updates(case)
    twin = restart(untied_twin(case.model, case.untie))
    loss_of(case, twin).backward()
    twin_params = dict(twin.named_parameters())
    worst, compared = 0.0, 0
    for g in p.groups():
        s = g.sublayer
        key = untie_key(case, s.param_names)
        prefixes = case.visit_prefixes[key]
        G = up.G[s.index]
        assert G.shape == (len(prefixes), s.numel), f"{s.name}: G {tuple(G.shape)}"
        for r, prefix in enumerate(prefixes):
            names = renamed(s.param_names, key, prefix)
            brute = torch.cat(
                [
                    (
                        twin_params[n].grad
                        if twin_params[n].grad is not None
                        else torch.zeros_like(twin_params[n])
                    ).reshape(-1)
                    for n in names
                ]
            )
            if brute.norm() == 0:  # a gradient-invisible visit: G must be exactly zero
                assert float(G[r].abs().max()) == 0.0 and not bool(up.visible[s.index][r])
                continue
            err = rel(G[r], brute)
            assert err < EXACT, f"{s.name} visit {r}: G vs untied twin, rel err {err:.2e}"
            worst, compared = max(worst, err), compared + 1
    return worst, compared


def check_one_U_is_the_dense_jacobian_norm(case: RealModel, rtol: float = 1e-8) -> float:
    """``||U_{r,j}||`` of the last gradient-visible visit of sublayer 0 against the top
    singular value of the dense ``jacrev`` Jacobian of F over that visit's private copy."""
    p = probe(case)
    sens = sensitivity_norms(
        p, case.inputs, forward=case.forward, output=case.output, method="lanczos", max_iter=100
    )
    assert all(e.converged for e in sens.visit_norms), [e for e in sens.visit_norms]
    k = max(i for i, v in enumerate(sens.visits) if v.j == 0)
    v, est = sens.visits[k], sens.visit_norms[k]
    s = p.groups()[0].sublayer
    key = untie_key(case, s.param_names)
    names = renamed(s.param_names, key, case.visit_prefixes[key][v.r])
    twin = untied_twin(case.model, case.untie)
    expected = dense_norm_of_visit(
        twin, lambda m: case.F(call_model(m, case.inputs, case.forward)), names
    )
    err = abs(est.value - expected) / expected
    assert err < rtol, f"{s.name} visit {v.r}: ||U|| {est.value} vs dense {expected} ({err:.2e})"
    return err


def check_kappa_lies_in_zero_to_R(case: RealModel) -> Any:
    rep = lp.visit_alignment(
        probe(case),
        case.inputs,
        case.loss_fn,
        forward=case.forward,
        output=case.output,
        method="lanczos",
        max_iter=100,
    )
    reached = rep.sublayers[rep.sublayers.R_g > 0]  # kappa_j needs a visit the loss reaches
    assert len(reached) > 0
    for row in reached.itertuples():
        assert -1e-12 <= row.kappa <= row.R_g * (1 + 1e-9), (row.sublayer, row.kappa, row.R_g)
    assert rep.kappa in set(reached.kappa), (rep.kappa, list(reached.kappa))
    return rep


def check_increments_run(case: RealModel, increment: Any = "auto") -> Any:
    with torch.random.fork_rng():
        torch.manual_seed(20261201)  # not a state that seeding inside the call reproduces
        torch.rand(7)
        rng = torch.get_rng_state()
        inc = lp.increments(probe(case), case.inputs, forward=case.forward, increment=increment)
        assert torch.equal(torch.get_rng_state(), rng), "lp.increments advanced the caller's RNG"
    assert len(inc.visits) == len(inc.inc_norm) > 0
    assert bool(np.isfinite(inc.inc_norm).all())
    return inc


def check_spectral_radius_is_the_dense_one(case: RealModel, module: str) -> float:
    """rho of the replayed round against the dense eigenvalues of ``jacrev(T)(h0)``."""
    rm = lp.replay_round(case.model, case.inputs, module, forward=case.forward)
    sr = lp.spectral_radius(rm.step, rm.h0, x=rm.x)
    n = rm.h0.numel()
    J = torch.func.jacrev(rm.T)(rm.h0.detach()).reshape(n, n)
    rho = float(torch.linalg.eigvals(J.detach()).abs().max())
    assert sr.converged, sr.reason
    assert abs(sr.value - rho) <= 1e-6 * rho, (sr.value, rho)
    return rho


def check_probing_changes_nothing(case: RealModel, round_module: str | None = None) -> list[str]:
    """Every entry point on the model, then params, .grad, buffers, modes, hooks and RNG
    compared bit for bit. A call that raises (reported by its own test) must leave the
    model unchanged too; the names of those calls are returned."""
    with torch.random.fork_rng():
        # a state no seeding inside the calls would reproduce (seed 0 would be)
        torch.manual_seed(20261201)
        torch.rand(7)
        return _probe_every_entry_point(case, round_module)


def _probe_every_entry_point(case: RealModel, round_module: str | None) -> list[str]:
    model = case.model
    for i, q in enumerate(model.parameters()):
        q.grad = torch.full_like(q, float(i + 1))
    before = snapshot(model)
    kw = dict(forward=case.forward)
    calls = {
        "visit_table": lambda p: p.visit_table(case.inputs, output=case.output, **kw),
        "updates": lambda p: per_visit_updates(p, case.inputs, case.loss_fn, **kw),
        "sensitivity": lambda p: sensitivity_norms(
            p, case.inputs, output=case.output, max_iter=5, **kw
        ),
        "alignment": lambda p: lp.visit_alignment(
            p, case.inputs, case.loss_fn, output=case.output, max_iter=5, **kw
        ),
        "increments": lambda p: lp.increments(p, case.inputs, **kw),
    }
    if round_module is not None:

        def radius(p: lp.Probe) -> Any:
            rm = lp.replay_round(model, case.inputs, round_module, **kw)
            return lp.spectral_radius(rm.step, rm.h0, x=rm.x, max_iter=5)

        calls["spectral_radius"] = radius
    raised = []
    for name, call in calls.items():
        try:
            call(lp.attach(model))
        except Exception:  # noqa: BLE001 - the failure itself is another test's subject
            raised.append(name)
        assert_unchanged(before, model)
    return raised
