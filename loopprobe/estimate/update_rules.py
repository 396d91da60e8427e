"""Optimizer preconditioning of the per-visit updates: the effective update an SGD, Adam or
AdamW step makes of each visit's gradient (:func:`loopprobe.estimate.updates.per_visit_updates`;
the rule is in that module's docstring). The optimizer's state is read, never written.
"""

from __future__ import annotations

from typing import Any

import torch


def check_update(update: Any, call: str) -> None:
    ok_str = ("sgd", "adam", "adamw")
    if isinstance(update, str):
        if update.lower() not in ok_str:
            raise ValueError(
                f"{call}: update={update!r}; choose one of {list(ok_str)} or pass "
                "a torch.optim.SGD/Adam/AdamW instance"
            )
        return
    if not isinstance(update, torch.optim.SGD | torch.optim.Adam | torch.optim.AdamW):
        raise TypeError(
            f"{call}: update={type(update).__name__} is not supported; pass 'sgd', 'adam', "
            "'adamw' or a torch.optim.SGD/Adam/AdamW instance"
        )


def precondition(
    raw: list[torch.Tensor], groups: list, update: Any, tieds: list[torch.Tensor]
) -> tuple[list[torch.Tensor], str, list[float]]:
    """Effective updates ``P (.) raw`` with the preconditioner built from the tied
    gradients ``tieds``; also the rule used and the momentum-history norms."""
    if isinstance(update, str) and update.lower() == "sgd":
        return raw, "sgd: G = dL/d delta (the step is -lr * G)", [0.0] * len(raw)
    if isinstance(update, str):
        opt_cls = torch.optim.AdamW if update.lower() == "adamw" else torch.optim.Adam
        hp = {"betas": (0.9, 0.999), "eps": 1e-8, "amsgrad": False}
        states: dict = {}
        name = update.lower()
    else:
        opt_cls, name = type(update), type(update).__name__
        hp, states = None, update.state
    G, history = [], []
    stepped = []
    for j, g in enumerate(groups):
        tied = tieds[j]
        if opt_cls is torch.optim.SGD:
            G_j, hist, t = _sgd(raw[j], tied, g.params, update, states)
        else:
            G_j, hist, t = _adam(raw[j], tied, g.params, hp or _hyper(update, g.params), states)
        G.append(G_j)
        history.append(hist)
        stepped.append(t)
    t = max(stepped)
    if opt_cls is torch.optim.SGD:
        return (
            G,
            f"{name} (state at step {t}): G = (1 - dampening) dL/d delta; momentum excluded",
            history,
        )
    rule = "G = c * dL/d delta / (sqrt(v_hat) + eps)"
    if t == 0:
        return G, f"{name} (fresh, first step): {rule}, c = 1, v_hat = g^2 (tied gradient)", history
    return G, f"{name} (state at step {t}): {rule}, momentum history excluded", history


def _hyper(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> dict:
    ids = {id(p) for p in params}
    for group in opt.param_groups:
        if any(id(p) in ids for p in group["params"]):
            if group.get("maximize", False):
                raise ValueError("per_visit_updates: maximize=True optimizers are not supported")
            return {"betas": group["betas"], "eps": group["eps"], "amsgrad": group["amsgrad"]}
    raise ValueError(
        "per_visit_updates: the optimizer does not hold the parameters of this sublayer; "
        "pass the optimizer that trains the model"
    )


def _flat_state(states: dict, params: list[torch.Tensor], key: str) -> torch.Tensor | None:
    parts = []
    for p in params:
        s = states.get(p, {})
        if key not in s:
            return None
        parts.append(s[key].detach().reshape(-1).to(p.dtype))
    return torch.cat(parts)


def _adam(raw, tied, params, hp, states) -> tuple[torch.Tensor, float, int]:
    b1, b2 = hp["betas"]
    eps = hp["eps"]
    m = _flat_state(states, params, "exp_avg")
    v = _flat_state(states, params, "exp_avg_sq")
    fresh = m is None or v is None
    t = 0 if fresh else int(states[params[0]]["step"])
    if fresh:
        m, v = torch.zeros_like(tied), torch.zeros_like(tied)
    v_new = b2 * v + (1 - b2) * tied * tied
    if hp.get("amsgrad") and not fresh:
        vmax = _flat_state(states, params, "max_exp_avg_sq")
        if vmax is not None:
            v_new = torch.maximum(vmax, v_new)
    bc1, bc2 = 1 - b1 ** (t + 1), 1 - b2 ** (t + 1)
    denom = (v_new / bc2).sqrt() + eps
    c = (1 - b1) / bc1
    G = c * raw / denom
    history = float((b1 * m / bc1 / denom).norm())
    return G, history, t


def _sgd(raw, tied, params, opt, states) -> tuple[torch.Tensor, float, int]:
    ids = {id(p) for p in params}
    group = next(g for g in opt.param_groups if any(id(q) in ids for q in g["params"]))
    buf = _flat_state(states, params, "momentum_buffer")
    if buf is None or group["momentum"] == 0:
        return raw, 0.0, 0
    return (1 - group["dampening"]) * raw, float((group["momentum"] * buf).norm()), 1
