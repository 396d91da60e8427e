"""Helpers shared by the subcommands: list parsing, JSON output, loading a user's model."""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch


def int_list(text: str) -> list[int]:
    """Parse ``"1,2,4"`` into ``[1, 2, 4]`` (for argparse ``type=``)."""
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError as err:
        raise ValueError(f"expected comma-separated integers like 1,2,4, got {text!r}") from err
    if not values:
        raise ValueError(f"expected comma-separated integers like 1,2,4, got {text!r}")
    return values


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
    shape = "package.module:" + ("factory" if what == "--model" else "fn")
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"{what} {spec!r} must look like {shape}")
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise ValueError(f"{what} {spec!r} must look like {shape}")
    importlib.invalidate_caches()  # a module written since the last import is found
    try:
        with cwd_on_path():
            module = importlib.import_module(mod_name)
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


def call_user(fn: Callable[..., Any], what: str, spec: str, *args: Any) -> Any:
    """``fn(*args)``; any exception it raises becomes one ``ValueError`` line naming it."""
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001 - the user's code: report it in one line
        call = f"{spec.partition(':')[2]}({', '.join(type(a).__name__ for a in args)})"
        raise ValueError(f"{what} {spec}: {call} raised {type(err).__name__}: {err}") from err


class DefaultOutput:
    """Picks F when no ``--output`` is given: the output itself if it is a tensor, else
    its ``.logits`` (Hugging Face ``ModelOutput`` and similar objects) or ``["logits"]``.

    ``picked`` records what was used, so the command can say so.
    """

    def __init__(self) -> None:
        self.picked: str | None = None

    def __call__(self, out: Any) -> torch.Tensor:
        if isinstance(out, torch.Tensor):
            self.picked = self.picked or "the model output"
            return out
        logits = getattr(out, "logits", None)
        if isinstance(logits, torch.Tensor):
            self.picked = self.picked or f".logits of the model's {type(out).__name__}"
            return logits
        if isinstance(out, dict) and isinstance(out.get("logits"), torch.Tensor):
            self.picked = self.picked or "the model output's ['logits']"
            return out["logits"]
        keys = list(out.keys()) if isinstance(out, dict) else None
        raise TypeError(
            f"the model returned a {type(out).__name__}"
            + (f" with keys {keys}" if keys is not None else "")
            + ", not a tensor and without a .logits tensor; pass --output package.module:fn "
            "returning the tensor F"
        )


def model_loss(out: Any) -> torch.Tensor | None:
    """The scalar ``.loss`` (or ``["loss"]``) a model returned itself (Hugging Face style)."""
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss.reshape(())
    return None


def apply_threads(args: Any, work: float | None) -> int:
    """Set torch's intra-op threads for a command: ``--threads`` or the size rule.

    ``work`` is the model's parameter-tokens (:func:`loopprobe.threads.work`); ``None``
    for commands that do no torch computation. The count is stored in ``args.threads_used``.
    """
    from loopprobe.threads import auto_threads

    if args.threads is not None:
        n = args.threads
    elif work is None:
        n = 1
    else:
        n = auto_threads(work, default=args.torch_default_threads)
    torch.set_num_threads(n)
    args.threads_used = n
    return n


def to_jsonable(obj: Any) -> Any:
    """Convert numpy/torch scalars, NaN and nested containers to plain JSON values."""
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "ndim", 0) == 0:
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def print_json(obj: Any) -> None:
    print(json.dumps(to_jsonable(obj), indent=2))


def emit(report: dict, as_json: bool, format_text: Callable[[dict], str]) -> int:
    """Print a command's report as one JSON object or as text; exit code 0."""
    if as_json:
        print_json(report)
    else:
        print(format_text(report))
    return 0


def text_table(head: list[str], rows: list[list[str]]) -> list[str]:
    """Aligned plain-text rows: first column (names) left-aligned, the rest right-aligned."""
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    return [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in [head, *rows]
    ]


def setup_sweep(args: Any, work: float | None = None) -> None:
    """Shared start of the sweep commands: check ``--seeds``, then choose the threads."""
    if args.seeds < 1:
        raise ValueError(f"--seeds {args.seeds}: give at least 1")
    apply_threads(args, work)


def reference_work(d_model: int, seq_len: int, batch: int, blocks: int, vocab: int = 256) -> float:
    """Parameter-tokens of a reference LoopedGPT with ``blocks`` physical blocks (12 d^2
    each: attention 4 d^2, MLP 8 d^2) plus embedding and head."""
    return float((12 * d_model**2 * blocks + 2 * vocab * d_model) * seq_len * batch)
