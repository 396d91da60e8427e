"""Loading a user's objects from ``package.module:name`` specs, and plain JSON values.

Shared by the command line and the report (which may not import the command line).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import math
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def cwd_on_path() -> Iterator[None]:
    """Put the current directory first on ``sys.path`` for the block (as ``python -m`` does).

    The ``loopprobe`` console script starts with its own ``bin/`` directory on the path, so
    ``--model mymodel:make`` would not find ``./mymodel.py`` without this. Removed on exit
    (only if this call added it).
    """
    cwd = os.getcwd()
    if cwd in sys.path or "" in sys.path:
        yield
        return
    sys.path.insert(0, cwd)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(cwd)


def load_object(spec: str, what: str = "--model") -> Callable[..., Any]:
    """Import ``package.module:attr`` (also from the current directory) and return the attr.

    Every failure is a one-line ``ValueError``/``TypeError`` naming the flag and the spec.
    """
    name = "factory" if what == "--model" else "fn"
    shape = f"package.module:{name} (or path/to/file.py:{name})"
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"{what} {spec!r} must look like {shape}")
    mod_name, _, attr = spec.rpartition(":")
    if not mod_name or not attr or ("/" in attr or attr.endswith(".py")):
        raise ValueError(f"{what} {spec!r} must look like {shape}")
    if _is_path(mod_name) and not (mod_name.endswith(".py") and os.path.isfile(mod_name)):
        hint = "" if mod_name.endswith(".py") else " (a file path must end in .py)"
        raise ValueError(
            f"{what} {spec!r}: no Python file {mod_name!r}{hint}; give path/to/file.py:{name} "
            f"or package.module:{name}"
        )
    importlib.invalidate_caches()  # a module written since the last import is found
    try:
        with cwd_on_path():
            module = _import(mod_name)
    except ModuleNotFoundError as err:
        where = "" if err.name == mod_name else f" (it imports {err.name!r}, which is missing)"
        raise ValueError(
            f"{what} {spec!r}: cannot import {mod_name!r}{where}; run from the directory that "
            "holds it or put it on PYTHONPATH"
        ) from err
    except Exception as err:  # noqa: BLE001 - the user's module failed on import: one line
        raise ValueError(
            f"{what} {spec!r}: importing {mod_name!r} raised {type(err).__name__}: {err}"
        ) from err
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as err:
            raise ValueError(
                f"{what} {spec!r}: module {mod_name!r} has no attribute {attr!r}"
            ) from err
    if not callable(obj):
        raise TypeError(f"{what} {spec!r}: {attr!r} is not callable ({type(obj).__name__})")
    return obj


def _is_path(mod_name: str) -> bool:
    return mod_name.endswith(".py") or os.sep in mod_name or "/" in mod_name


def _import(mod_name: str) -> Any:
    """``package.module``, or a file ``path/to/file.py`` (loaded once per resolved path, so
    ``--model``, ``--inputs`` and ``--loss`` naming one file share its module)."""
    if not _is_path(mod_name):
        return importlib.import_module(mod_name)
    import hashlib

    path = os.path.abspath(mod_name)
    stem = "".join(c if c.isalnum() else "_" for c in os.path.basename(path)[:-3])
    key = f"_loopprobe_file_{stem}_{hashlib.sha1(path.encode()).hexdigest()[:8]}"
    if key in sys.modules:  # in sys.modules under its own name: dataclasses, pickle work
        return sys.modules[key]
    loader = importlib.util.spec_from_file_location(key, path)
    module = importlib.util.module_from_spec(loader)
    sys.modules[key] = module
    try:
        loader.loader.exec_module(module)
    except BaseException:
        del sys.modules[key]
        raise
    return module


def call_user(fn: Callable[..., Any], what: str, spec: str, *args: Any) -> Any:
    """``fn(*args)``; any exception it raises becomes one ``ValueError`` line naming it."""
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001 - the user's code: report it in one line
        call = _call_text(spec, args)
        raise ValueError(f"{what} {spec}: {call} raised {type(err).__name__}: {err}") from err


def _call_text(spec: str, args: tuple) -> str:
    """``fn(3, Tensor)``: the call of ``spec``'s function, simple arguments shown, others named."""
    shown = (repr(a) if isinstance(a, int | float | str) else type(a).__name__ for a in args)
    return f"{spec.rpartition(':')[2]}({', '.join(shown)})"


#: how :func:`to_jsonable` writes the floats strict JSON has no literal for (RFC 8259);
#: the spellings of protobuf's JSON mapping, which ``float()`` reads back in Python
NONFINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def to_jsonable(obj: Any) -> Any:
    """Plain, strict JSON values: numpy/torch scalars and arrays become numbers and lists,
    NaN, inf and -inf the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"``.

    Strings, not ``null``, so that an undefined quantity (NaN), an overflow (inf) and a
    missing value (``None``) stay distinct; strings, not the bare tokens ``NaN``/``Infinity``
    that Python's ``json`` writes by default, so that every JSON reader (jq, JavaScript,
    Go, serde) accepts the output. ``float(value)`` reads either kind back.
    """
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "ndim", 0) == 0:
        obj = obj.item()
    elif hasattr(obj, "tolist") and callable(obj.tolist) and getattr(obj, "ndim", 0) > 0:
        return to_jsonable(obj.tolist())  # numpy arrays, tensors
    if isinstance(obj, float) and not math.isfinite(obj):
        return NONFINITE[repr(float(obj))]
    return obj


def load_model(spec: str, *args: Any, what: str = "--model") -> Any:
    """The ``nn.Module`` that the factory named by ``spec`` (``pkg.mod:fn``) returns for
    ``args``; an error in the factory, or anything but a module, is one clear error."""
    from torch import nn

    model = call_user(load_object(spec, what), what, spec, *args)
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{what} {spec}: {_call_text(spec, args)} returned a {type(model).__name__}, "
            "not a torch.nn.Module; the factory must build and return the model"
        )
    return model


# --------------------------------------------------------------------------- the loss rule

#: what ``--help`` says about the default loss (every command and the report use this rule)
LOSS_RULE = (
    "loss_fn(output, inputs) -> scalar. Default, in every command and the report: the "
    "model's own scalar .loss when its output has one (Hugging Face style, given labels); "
    "else cross-entropy of F against random next tokens when loopprobe drew the inputs "
    "(random tokens from cfg.vocab_size, no --inputs); else 0.5 * mean(F^2)"
)


def user_inputs(spec: str, model: Any) -> Any:
    """What ``--inputs spec`` returns: ``fn(model)``, or ``fn()`` when it takes no argument
    (every command the same); a list becomes a tuple of positional arguments."""
    import inspect

    fn = load_object(spec, "--inputs")
    try:
        params = inspect.signature(fn).parameters.values()
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        takes = any(p.kind in kinds or p.kind == inspect.Parameter.VAR_POSITIONAL for p in params)
    except (TypeError, ValueError):
        takes = True
    inputs = call_user(fn, "--inputs", spec, *([model] if takes else []))
    return tuple(inputs) if isinstance(inputs, list) else inputs
