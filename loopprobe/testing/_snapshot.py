"""What "the model is unchanged" means for the checks: a snapshot of everything a probe must
leave as it was, and the list of what changed since one (private; the public guarantee is
:func:`loopprobe.testing.check_probe_leaves_model_unchanged`).

The snapshot covers parameter and buffer values bitwise (buffers include parametrization
state such as ``spectral_norm``'s ``u``/``v``), their dtype, shape, device and identity,
``.grad``, ``requires_grad``, train/eval modes, module, tensor and torch-global hooks, the
global RNGs (torch's CPU and CUDA, Python's, numpy's) and the state of every
``torch.Generator`` a module holds as an attribute.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

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


def _generator_states(model: nn.Module) -> dict[str, tuple[torch.Generator, torch.Tensor]]:
    """Each ``torch.Generator`` a module holds as an attribute, directly or in a list, tuple
    or dict attribute (a module that draws its own dropout masks or noise), with a copy of
    its state."""
    out = {}
    for n, m in model.named_modules():
        for attr, value in vars(m).items():
            where = f"{n}.{attr}" if n else attr
            if isinstance(value, dict):
                items = [(f"{where}[{k!r}]", v) for k, v in value.items()]
            elif isinstance(value, list | tuple):
                items = [(f"{where}[{i}]", v) for i, v in enumerate(value)]
            else:
                items = [(where, value)]
            for name, g in items:
                if isinstance(g, torch.Generator):
                    out[name] = (g, g.get_state())
    return out


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
        "generators": _generator_states(model),
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
        if (g is None) != (h is None):
            was, now = ("None" if x is None else "set" for x in (g, h))
            out.append(f"{n}.grad changed ({was} -> {now})")
        elif g is not None and not _same(g, h):
            out.append(f"{n}.grad: value changed ({_change(g, h)})")
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
    for name, (gen, state) in before["generators"].items():
        now = after["generators"].get(name)
        if now is None or now[0] is not gen:
            out.append(f"{name}: torch.Generator {'removed' if now is None else 'replaced'}")
        elif not torch.equal(state, now[1]):
            out.append(f"{name}: torch.Generator state advanced")
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
