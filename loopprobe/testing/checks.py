"""Checks of the theory's statements on a user's model: each returns the measurement when
the statement holds and raises ``AssertionError`` with the figures, the tolerance and the
visit/sublayer when it does not.

``loss(output, inputs)`` returns a scalar (as everywhere in loopprobe); ``forward`` and
``output`` are passed through to the probes. ``alpha``/``beta`` default to
``model.cfg.alpha``/``.beta`` (1.0 and 1.0 for a plain pre-norm model). Needs neither
pytest nor hypothesis.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn

import loopprobe as lp
from loopprobe._stats import loglog_slope
from loopprobe.record.types import call_model, seeded
from loopprobe.testing._family import rebuilder


def _fmt(xs: Sequence[float]) -> str:
    return "[" + ", ".join(f"{float(x):.4g}" for x in xs) + "]"


def _fail(call: str, what: str, figures: str, fix: str = "") -> None:
    __tracebackhide__ = True  # pytest shows the user's line, not this one
    msg = f"{call}: {what}\n  {figures}"
    raise AssertionError(msg + (f"\n  {fix}" if fix else ""))


def _own_forward_changes(model: nn.Module, batch: Any, forward: Callable | None) -> list[str]:
    """What a plain forward of a copy of the model changes in it (nothing, for a sane model)."""
    import random

    twin = copy.deepcopy(model)
    before = _snapshot(twin)
    py, npy = random.getstate(), np.random.get_state()
    try:
        with torch.no_grad(), torch.random.fork_rng():
            call_model(twin, copy.deepcopy(batch), forward)
        # torch's RNG is forked here; the global ones a forward draws from are the model's
        return [d for d in _differences(before, twin) if "torch's" not in d or "RNG" not in d]
    finally:
        random.setstate(py)
        np.random.set_state(npy)


@contextmanager
def _blame_model(call: str, model: nn.Module, batch: Any, forward: Callable | None) -> Iterator:
    """A probe that crashes because the model's own forward writes its parameters (a block
    re-initialised at every visit) becomes an AssertionError that says so."""
    try:
        yield
    except RuntimeError as exc:
        own = _own_forward_changes(model, batch, forward)
        if not own:
            raise
        raise AssertionError(
            f"{call}: the model's own forward changes its state, so no derivative of it is "
            f"meaningful (a block re-initialised at every visit?)\n  a plain forward changed: "
            + "; ".join(own[:4])
            + f"\n  (the probe stopped with: {str(exc).splitlines()[0][:160]})"
        ) from exc


# ------------------------------------------------------------------- per-visit updates


def check_updates_sum_to_tied_gradient(
    model: nn.Module,
    batch: Any,
    loss: Callable,
    *,
    forward: Callable | None = None,
    sublayers: Sequence[str] | None = None,
    rtol: float = 1e-6,
    seed: int | None = 0,
) -> dict[str, float]:
    """``sum_r G_{r,j}`` equals the tied gradient ``dL/dphi_j`` of plain autograd, per
    sublayer (seed 002, Eq. 11). Returns the relative error per sublayer.

    Fails when the probe sees fewer (or other) uses of a shared parameter than autograd:
    a parameter also used outside its module call (``F.linear(h, block.weight)``)."""
    __tracebackhide__ = True  # a failure points at the user\'s test line
    call = "check_updates_sum_to_tied_gradient"
    with _blame_model(call, model, batch, forward), lp.attach(model, sublayers) as probe:
        groups = probe.groups(batch, forward, seed=seed)
        ups = lp.per_visit_updates(probe, batch, loss, forward=forward, seed=seed)
    params = [p for g in groups for p in g.params]
    with torch.enable_grad(), seeded(seed):
        value = loss(call_model(model, batch, forward), batch)
        grads = torch.autograd.grad(value, params, allow_unused=True)
    errors, k = {}, 0
    for j, g in enumerate(groups):
        tied = torch.cat(
            [
                (torch.zeros_like(p) if gr is None else gr).reshape(-1)
                for p, gr in zip(g.params, grads[k : k + len(g.params)], strict=True)
            ]
        )
        k += len(g.params)
        summed = ups.G[j].sum(0)
        err = float((summed - tied).norm() / tied.norm().clamp_min(1e-300))
        errors[g.sublayer.name] = err
        if not err <= rtol:
            worst = int((summed - tied).abs().argmax())
            _fail(
                call,
                f"sublayer {g.sublayer.name!r}: the per-visit updates over its "
                f"{ups.G[j].shape[0]} visits do not sum to its tied gradient",
                f"||sum_r G_r - dL/dphi|| / ||dL/dphi|| = {err:.3g} > rtol={rtol:g}; "
                f"||dL/dphi|| = {float(tied.norm()):.4g}, ||sum_r G_r|| = "
                f"{float(summed.norm()):.4g}, worst entry {worst}: {float(summed[worst]):.4g} "
                f"vs {float(tied[worst]):.4g}",
                "a shared parameter used outside its module call (F.linear(h, blk.weight)) is "
                "invisible to the probe: wrap that use in the module, or exclude it",
            )
    return errors


# ------------------------------------------------------------------------------ kappa


def check_kappa_in_range(
    model: nn.Module,
    batch: Any,
    loss: Callable,
    *,
    sublayers: Sequence[str] | None = None,
    slack: float = 1e-6,
    **alignment_kwargs: Any,
) -> lp.results.AlignmentReport:
    """``0 <= kappa_j <= R_j`` for every loop-body sublayer, from converged estimates
    (seed 002, Eq. 12; ``slack`` relative). Returns the alignment report."""
    __tracebackhide__ = True  # a failure points at the user\'s test line
    call = "check_kappa_in_range"
    forward = alignment_kwargs.get("forward")
    with _blame_model(call, model, batch, forward), lp.attach(model, sublayers) as probe:
        rep = lp.visit_alignment(probe, batch, loss, **alignment_kwargs)
    rows = rep.sublayers
    body = rows[rows.role.eq("body")] if rows.role.eq("body").any() else rows
    for r in body.itertuples():
        R = int(r.R_g)
        if not (math.isfinite(r.kappa) and -slack <= r.kappa <= R * (1 + slack)):
            _fail(
                call,
                f"sublayer {r.sublayer!r}: kappa_j outside [0, R_j]",
                f"kappa_j = {r.kappa:.6g}, R_j = {R} (gradient-visible visits), slack {slack:g}",
            )
    if not rep.converged:
        _fail(
            call,
            "the estimates behind kappa did not converge, so kappa_R is not a measurement",
            f"kappa_R = {rep.kappa:.4g}; {rep.reason}",
            "raise max_iter= or probe the model in float64",
        )
    return rep


# ---------------------------------------------------------------------- model unchanged


#: the hook dicts of a module that a probe may add to (and must empty again)
_MODULE_HOOKS = (
    ("_forward_pre_hooks", "forward pre-hook"),
    ("_forward_hooks", "forward hook"),
    ("_backward_pre_hooks", "backward pre-hook"),
    ("_backward_hooks", "backward hook"),
    ("_state_dict_pre_hooks", "state-dict pre-hook"),
    ("_state_dict_hooks", "state-dict hook"),
    ("_load_state_dict_pre_hooks", "load-state-dict pre-hook"),
    ("_load_state_dict_post_hooks", "load-state-dict post-hook"),
)
#: torch's hooks on every module (``nn.modules.module.register_module_*_hook``)
_GLOBAL_HOOKS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
    "_global_module_registration_hooks",
    "_global_parameter_registration_hooks",
    "_global_buffer_registration_hooks",
)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bytes: equal exactly when the values are bitwise equal (a NaN
    equals itself, -0.0 differs from 0.0, as ``torch.equal`` does not say)."""
    t = t.detach()
    try:
        return t.contiguous().reshape(-1).view(torch.uint8)
    except RuntimeError:  # a layout without a byte view (sparse, quantized): by value
        return t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, with the same dtype, shape and device."""
    if (a.dtype, a.shape, a.device) != (b.dtype, b.shape, b.device):
        return False
    return bool(torch.equal(_bits(a), _bits(b)))


def _hook_keys(hooks: Any) -> frozenset:
    return frozenset(hooks.keys()) if hooks else frozenset()


def _rng_state() -> dict:
    """torch's CPU (and, once initialised, CUDA) RNG, Python's and numpy's global RNG."""
    import random

    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (np_state[0], np_state[1].tobytes(), *np_state[2:]),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _snapshot(model: nn.Module) -> dict:
    """Everything of ``model`` a probe must leave as it was, copied (values bitwise)."""
    from torch.nn.modules import module as torch_module

    named = [*model.named_parameters(), *model.named_buffers()]
    return {
        "objects": dict(named),
        "values": {k: v.detach().clone() for k, v in named},
        "grads": {
            n: None if p.grad is None else p.grad.detach().clone()
            for n, p in model.named_parameters()
        },
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "modes": {n: m.training for n, m in model.named_modules()},
        "hooks": {
            (n, what): _hook_keys(getattr(m, attr, None))
            for n, m in model.named_modules()
            for attr, what in _MODULE_HOOKS
        }
        | {
            (n, what): _hook_keys(getattr(t, attr, None))
            for n, t in named
            for attr, what in (
                ("_backward_hooks", "tensor hook"),
                ("_post_accumulate_grad_hooks", "post-accumulate-grad hook"),
            )
        }
        | {
            ("(torch, every module)", attr.strip("_").replace("_", " ")): _hook_keys(
                getattr(torch_module, attr, None)
            )
            for attr in _GLOBAL_HOOKS
        },
        "rng": _rng_state(),
    }


def _differences(before: dict, model: nn.Module) -> list[str]:
    """What changed since ``before`` (:func:`_snapshot`), one phrase per change."""
    after = _snapshot(model)
    out = []
    for k in before["values"].keys() | after["values"].keys():
        a, b = before["values"].get(k), after["values"].get(k)
        if a is None or b is None:
            out.append(f"{k}: {'added' if a is None else 'removed'}")
        elif before["objects"][k] is not after["objects"][k]:
            out.append(f"{k}: replaced by another tensor object")
        elif not _same(a, b):
            out.append(f"{k}: value changed ({_change(a, b)})")
    for n, g in before["grads"].items():
        h = after["grads"].get(n)
        if (g is None) != (h is None) or (g is not None and not _same(g, h)):
            was, now = ("None" if x is None else "set" for x in (g, h))
            out.append(f"{n}.grad changed ({was} -> {now})")
    for key, what in (("requires_grad", "requires_grad"), ("modes", "train/eval mode")):
        for n, v in before[key].items():
            if after[key].get(n) != v:
                out.append(f"{n or '(model)'}: {what} {v} -> {after[key].get(n)}")
    for (n, what), keys in before["hooks"].items():
        now = after["hooks"].get((n, what), frozenset())
        if now != keys:
            change = f"{len(keys)} hooks -> {len(now)}" if len(now) != len(keys) else "replaced"
            out.append(f"{n or '(model)'}: {change} ({what})")
    for name, state in before["rng"].items():
        now = after["rng"].get(name)
        same = all(map(torch.equal, state, now)) if name == "cuda" else _rng_equal(state, now)
        if not same:
            out.append(f"{_RNG_NAMES[name]} advanced")
    return out


_RNG_NAMES = {
    "torch": "torch's global RNG state",
    "cuda": "torch's CUDA RNG state",
    "python": "Python's global random state",
    "numpy": "numpy's global random state",
}


def _rng_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return bool(torch.equal(a, b))
    return a == b


def _change(a: torch.Tensor, b: torch.Tensor) -> str:
    """How a value changed: which entries differ bitwise and by how much at most."""
    if (a.dtype, a.shape, a.device) != (b.dtype, b.shape, b.device):
        return f"{a.dtype} {tuple(a.shape)} {a.device} -> {b.dtype} {tuple(b.shape)} {b.device}"
    bits_a, bits_b = _bits(a), _bits(b)
    if bits_a.dtype == torch.uint8 and a.dtype != torch.uint8:
        changed = (bits_a != bits_b).reshape(-1, a.element_size()).any(1)
    else:
        changed = (a != b).reshape(-1)
    text = f"{int(changed.sum())} of {a.numel()} entries differ bitwise"
    if a.is_floating_point() or a.is_complex():
        wide = torch.complex128 if a.is_complex() else torch.float64
        diff = (a.reshape(-1)[changed].to(wide) - b.reshape(-1)[changed].to(wide)).abs()
        text += f", max |diff| {float(diff.max()):.3g}"  # nan when a NaN came or went
    return text


def check_probe_leaves_model_unchanged(
    model: nn.Module,
    batch: Any,
    loss: Callable,
    *,
    forward: Callable | None = None,
    alpha: float | None = None,
    beta: float | None = None,
) -> None:
    """Probing (alignment, one bound step, increments) leaves the model exactly as it was:
    parameter and buffer values bitwise (NaN payloads and the sign of zero included) with
    their dtype, shape, device and identity, ``.grad``, ``requires_grad``, train/eval modes,
    module, tensor and torch-global hooks, and the RNGs (torch's CPU and CUDA, Python's,
    numpy's).

    When something changed, a plain forward of a copy of the model is run too, to say
    whether the model's own forward writes its state (a block re-initialised at every
    visit, a counter buffer) rather than the probe."""
    __tracebackhide__ = True  # a failure points at the user\'s test line
    call = "check_probe_leaves_model_unchanged"
    before = _snapshot(model)
    with _blame_model(call, model, batch, forward):
        with lp.attach(model) as probe:
            lp.bound_check(probe, batch, loss, forward=forward, alpha=alpha, beta=beta)
        lp.increments(model, batch, forward=forward)
    diffs = _differences(before, model)
    if not diffs:
        return
    own_diffs = _own_forward_changes(model, batch, forward)
    cause = (
        "the model's own forward changes it too (plain forward of a copy: "
        + "; ".join(own_diffs[:3])
        + "): e.g. a block re-initialised at every visit; fix the model"
        if own_diffs
        else "a plain forward leaves the model as it was, so the probe changed it: "
        "a loopprobe bug, please report it"
    )
    _fail(call, f"{len(diffs)} things changed across probing", "; ".join(diffs[:6]), cause)


# ------------------------------------------------------------------ first-order change


def check_first_order_change(
    model: nn.Module,
    batch: Any,
    loss: Callable,
    *,
    lr: float = 1e-4,
    rtol: float = 0.05,
    alpha: float | None = None,
    beta: float | None = None,
    **bound_kwargs: Any,
) -> lp.results.BoundCheck:
    """For a small SGD step on the loop body, the true change ``||F(theta + d) - F||`` matches
    the tied first-order change ``||J d||`` of one JVP (seed 002, Eq. 11 summed over the
    visits) to ``rtol``, and is not zero. Returns the :class:`loopprobe.BoundCheck`.

    Fails when the step does not reach the output the way autograd says it does: a model
    that re-initialises (or otherwise overwrites) its block inside forward."""
    __tracebackhide__ = True  # a failure points at the user\'s test line
    call = "check_first_order_change"
    fwd = bound_kwargs.get("forward")
    with _blame_model(call, model, batch, fwd), lp.attach(model) as probe:
        chk = lp.bound_check(probe, batch, loss, lr=lr, alpha=alpha, beta=beta, **bound_kwargs)
    ref = max(chk.dF_first, chk.dF_true)
    rel = abs(chk.dF_true - chk.dF_first) / ref if ref > 0 else math.inf
    if not rel <= rtol:
        _fail(
            call,
            "the finite change of F after one small step does not match its first-order "
            "(JVP) change",
            f"lr={lr:g}: dF/F true = {chk.dF_true:.4g}, first order = {chk.dF_first:.4g}, "
            f"relative difference {rel:.3g} > rtol={rtol:g}",
            "a true change of 0 means the step never reaches the output: does forward "
            "overwrite the parameters (re-initialise the block)?"
            if chk.dF_true == 0
            else "reduce lr= if the model is very curved, or check the loop's parameters",
        )
    if chk.dF_roundoff > 1e-3:
        _fail(call, "the true change is within roundoff", chk.reason, "probe in float64")
    return chk


# ------------------------------------------------------------------------- the bound


def check_bound(
    model: nn.Module,
    batch: Any,
    loss: Callable,
    *,
    C_max: float,
    lr: float = 1e-3,
    alpha: float | None = None,
    beta: float | None = None,
    **bound_kwargs: Any,
) -> lp.results.BoundCheck:
    """``||Delta F|| / ||F|| <= C_max * M_g kappa_R (beta/alpha)^2`` after one step, with
    converged estimates (seed 002, Eq. 14; ``C_max`` is the constant you state)."""
    __tracebackhide__ = True  # a failure points at the user\'s test line
    call = "check_bound"
    fwd = bound_kwargs.get("forward")
    with _blame_model(call, model, batch, fwd), lp.attach(model) as probe:
        chk = lp.bound_check(probe, batch, loss, lr=lr, alpha=alpha, beta=beta, **bound_kwargs)
    if not chk.converged:
        _fail(call, "the measurement did not converge", chk.reason)
    if not chk.dF_true <= C_max * chk.prediction:
        _fail(
            call,
            "the output change after one step exceeds the stated bound",
            f"dF/F = {chk.dF_true:.4g} > C_max * M_g kappa_R (beta/alpha)^2 = {C_max:g} * "
            f"{chk.M_g} * {chk.kappa:.4g} * ({chk.beta:.4g}/{chk.alpha:.4g})^2 = "
            f"{C_max * chk.prediction:.4g} (measured C = {chk.C:.4g}, lr={lr:g})",
            "a residual scale applied in forward that differs from the alpha you declare "
            "makes C grow with depth",
        )
    return chk


def check_bound_slope(
    model_or_factory: nn.Module | Callable[[int], nn.Module],
    batch: Any,
    loss: Callable,
    *,
    max_slope: float,
    min_slope: float = -math.inf,
    Rs: Sequence[int] = (2, 4, 8),
    **bound_kwargs: Any,
) -> lp.results.BoundSweep:
    """The log-log slope in R of the true ``||Delta F|| / ||F||`` after one step lies in
    ``[min_slope, max_slope]`` (seed 002, Eq. 13-16: DeepLoop flat, DeepNorm slope 1).

    ``model_or_factory``: a model drawn by :func:`loopprobe.testing.configs` (its family is
    rebuilt at each R with the same other settings and batch seed) or a factory ``R ->
    model`` (then ``batch`` is a tensor or ``batch(model)``)."""
    __tracebackhide__ = True  # a failure points at the user\'s test line
    call = "check_bound_slope"
    rebuild = rebuilder(model_or_factory, batch, call)
    built = {R: rebuild(R) for R in Rs}
    sweep = lp.bound_sweep(
        lambda R: built[R][0], list(Rs), lambda m: _batch_of(built, m), loss, **bound_kwargs
    )
    f = sweep.frame
    figures = (
        f"R = {list(Rs)}: dF/F = {_fmt(f.dF_true)}, kappa_R = {_fmt(f.kappa)}, C = {_fmt(f.C)}"
    )
    if not sweep.converged:
        _fail(call, "a measurement did not converge", sweep.reason)
    if not min_slope <= sweep.slope <= max_slope:
        _fail(
            call,
            f"log-log slope of dF/F in R is {sweep.slope:.3g}, outside "
            f"[{min_slope:g}, {max_slope:g}]",
            figures,
            "slope near 1 with kappa_R ~ R: the residual scale does not shrink with the number"
            " of visits (DeepNorm-like, or alpha computed from the blocks instead of visits)",
        )
    return sweep


def _batch_of(built: dict, model: nn.Module) -> Any:
    return next(b for m, b in built.values() if m is model)


# ------------------------------------------------------------------------- increments


def check_increment_growth(
    model_or_factory: nn.Module | Callable[[int], nn.Module],
    batch: Any,
    *,
    band: tuple[float, float],
    Rs: Sequence[int] = (2, 4, 8),
    forward: Callable | None = None,
    increment: str = "auto",
) -> np.ndarray:
    """The growth exponent over R of ``||h_R - h_0|| / ||h_0||`` (the forward increments'
    accumulation, docs/definitions.md §3) lies in ``band``. Returns the growth per R."""
    __tracebackhide__ = True  # a failure points at the user\'s test line
    call = "check_increment_growth"
    rebuild = rebuilder(model_or_factory, batch, call)
    growth, reasons = [], []
    for R in Rs:
        m, x = rebuild(R)
        inc = lp.increments(m, x, forward=forward, increment=increment)
        growth.append(inc.growth)
        if not inc.converged:
            reasons.append(f"R={R}: {inc.reason}")
    if reasons:
        _fail(call, "an increment measurement did not converge", "; ".join(reasons))
    slope = loglog_slope(list(Rs), growth)
    lo, hi = band
    if not lo <= slope <= hi:
        _fail(
            call,
            f"growth exponent {slope:.3g} outside [{lo:g}, {hi:g}]",
            f"R = {list(Rs)}: growth = {_fmt(growth)}",
        )
    return np.asarray(growth)


# ------------------------------------------------------------------------ fixed points


def check_fixed_point_contracts(
    model: nn.Module | lp.RoundMap,
    batch: Any = None,
    module: str | None = None,
    *,
    max_rho: float = 1.0,
    tol: float = 1e-8,
    max_iter: int = 500,
    **replay_kwargs: Any,
) -> lp.results.SpectralRadius:
    """The loop reaches a fixed point ``h* = T(h*)`` from its start and the spectral radius
    of ``dT/dh`` there is below ``max_rho`` (docs/definitions.md §4), both converged.

    ``model`` is a :class:`loopprobe.RoundMap`, or a model with ``module`` naming the
    module that runs one round (:func:`loopprobe.replay_round`)."""
    __tracebackhide__ = True  # a failure points at the user\'s test line
    call = "check_fixed_point_contracts"
    if isinstance(model, lp.RoundMap):
        rm = model
    else:
        if module is None:
            raise TypeError(f"{call}: pass module='name' (the module that runs one round)")
        rm = lp.replay_round(model, batch, module, **replay_kwargs)
    fp = lp.fixed_point(rm.T, rm.h0, tol=tol, max_iter=max_iter)
    if not fp.converged:
        _fail(
            call,
            "no fixed point reached",
            f"{fp.reason}; residual {fp.residual:.3g} after {fp.iterations} rounds, observed "
            f"rate {fp.rate:.3g}",
        )
    rho = lp.spectral_radius(rm.T, fp.h)
    if not rho.converged:
        _fail(call, "the spectral radius did not converge", rho.reason)
    if not rho.value < max_rho:
        _fail(
            call,
            f"spectral radius at the fixed point is {rho.value:.4g} >= {max_rho:g}",
            f"top eigenvalue moduli {_fmt(np.abs(rho.eigenvalues))}; fixed-point residual "
            f"{fp.residual:.3g}",
        )
    return rho
