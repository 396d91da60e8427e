"""What in a user's forward made ``torch.func`` refuse it, and where: one error that names the
construct, the ``autograd.Function``, the module and the line (:func:`refused_at`), and the
module that runs an op with no forward-AD rule (:func:`module_running`)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["module_running", "refused_at", "refused_function", "transform_refusal"]


_REFUSALS = (
    ("must override the setup_context staticmethod", "an autograd.Function without setup_context"),
    ("attempting to call Tensor.", "{call} on a tensor made in the forward"),
    ("cannot register a hook on a tensor", "a tensor hook (Tensor.register_hook) in the forward"),
    ("can't retain_grad on Tensor", "Tensor.retain_grad() in the forward"),
    ("does not require grad", "torch.autograd.grad (or .backward) inside the forward"),
)
_CALLED = re.compile(r"attempting to call (Tensor\.\w+\(\))")


def transform_refusal(error: BaseException) -> str | None:
    """What in the forward made ``torch.func`` refuse it (torch's error ``error``), else
    ``None`` (an error of another kind, to be raised as it is)."""
    if not isinstance(error, RuntimeError):
        return None
    text = str(error)
    for pattern, what in _REFUSALS:
        if pattern in text:
            m = _CALLED.search(text)
            return what.format(call=m.group(1) if m else "Tensor.requires_grad_()")
    return None


def _frames(error: BaseException) -> list[tuple[Any, int]]:
    out, tb = [], error.__traceback__
    while tb is not None:
        out.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    return out


def refused_function(error: BaseException) -> str | None:
    """The ``autograd.Function`` whose ``apply`` raised ``error``, by qualified name."""
    for frame, _ in reversed(_frames(error)):
        cls = frame.f_locals.get("cls") if frame.f_code.co_name == "apply" else None
        if isinstance(cls, type) and issubclass(cls, torch.autograd.Function):
            return cls.__qualname__
    return None


def refused_at(error: BaseException, model: torch.nn.Module | None = None) -> str:
    """`` (Fn.apply in module 'block', at file.py:12: `source`)``: where in the user's code
    ``error`` was raised (the Function, the innermost module of ``model``, the line)."""
    import linecache
    import os

    names = {id(m): n for n, m in model.named_modules()} if model is not None else {}
    inside = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(__file__) + os.sep)
    module = line = None
    for frame, lineno in reversed(_frames(error)):
        me = frame.f_locals.get("self")
        if module is None and me is not None and id(me) in names:
            module = names[id(me)]
        path = frame.f_code.co_filename
        if line is None and not path.startswith(inside) and not path.startswith("<frozen"):
            src = linecache.getline(path, lineno).strip()
            line = f"{os.path.basename(path)}:{lineno}" + (f": `{src}`" if src else "")
    fn = refused_function(error)
    parts = [f"{fn}.apply" if fn else None]
    parts.append(None if module is None else f"in module {module!r}" if module else "in the model")
    parts.append(f"at {line}" if line else None)
    said = " ".join(p for p in parts if p)
    return f" ({said})" if said else ""


def module_running(model: torch.nn.Module, fn: Callable[[], Any], op: str) -> str | None:
    """The innermost module of ``model`` that runs the aten op ``op`` during ``fn()``."""
    names = {id(m): n for n, m in model.named_modules()}
    stack: list[str] = []
    found: list[str] = []

    def pre(module: torch.nn.Module, args: Any) -> None:
        if id(module) in names:
            stack.append(names[id(module)])

    def post(module: torch.nn.Module, args: Any, out: Any) -> None:
        if id(module) in names and stack:
            stack.pop()

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            if not found and func.__name__.split(".")[0] == op:
                found.append(stack[-1] if stack else "")
            return func(*args, **(kwargs or {}))

    from torch.nn.modules.module import (
        register_module_forward_hook,
        register_module_forward_pre_hook,
    )

    handles = [register_module_forward_pre_hook(pre), register_module_forward_hook(post)]
    try:
        with torch.no_grad(), Spy():
            fn()
    except Exception:  # noqa: BLE001 - only a diagnostic; the caller raises the real error
        pass
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None
