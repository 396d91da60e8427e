"""Helpers shared by the subcommands: list parsing, tables, JSON output, thread choice,
and telling an error raised inside the user's model from one raised by loopprobe."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any, TextIO

from loopprobe._io import to_jsonable

if TYPE_CHECKING:
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


class DefaultOutput:
    """Picks F when no ``--output`` is given: the output itself if it is a tensor, else
    its ``.logits`` (Hugging Face ``ModelOutput`` and similar objects) or ``["logits"]``.

    ``picked`` records what was used, so the command can say so.
    """

    def __init__(self) -> None:
        self.picked: str | None = None

    def __call__(self, out: Any) -> torch.Tensor:
        import torch

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


def apply_threads(args: Any, work: float | None) -> int:
    """Set torch's intra-op threads for a command: ``--threads`` or the size rule.

    ``work`` is the model's parameter-tokens (:func:`loopprobe._threads.work`); ``None``
    for commands that do no torch computation. The count is stored in ``args.threads_used``.
    """
    import torch

    from loopprobe._threads import auto_threads

    if args.threads is not None:
        n = args.threads
    elif work is None:
        n = 1
    else:
        n = auto_threads(work, default=args.torch_default_threads)
    torch.set_num_threads(n)
    args.threads_used = n
    return n


#: where :func:`print_json` writes while :func:`json_only_on_stdout` holds stdout for it
_RESULT_STREAMS: list[TextIO] = []


@contextlib.contextmanager
def json_only_on_stdout(enabled: bool = True) -> Iterator[None]:
    """For ``--json``: while the command runs, everything printed to ``sys.stdout`` (the
    user's factory or forward, a library's progress line) goes to stderr, and only
    :func:`print_json` writes to the real stdout, so stdout is exactly one JSON object.

    Python-level: output that C code writes to file descriptor 1 itself is not moved.
    """
    if not enabled:
        yield
        return
    _RESULT_STREAMS.append(sys.stdout)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        _RESULT_STREAMS.pop()


def print_json(obj: Any) -> None:
    """``obj`` as strict JSON (NaN and inf as strings, see :func:`to_jsonable`) on stdout."""
    out = _RESULT_STREAMS[-1] if _RESULT_STREAMS else sys.stdout
    print(json.dumps(to_jsonable(obj), indent=2, allow_nan=False), file=out, flush=True)


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


# --------------------------------------------------------------------------- whose error


def model_frame(err: BaseException) -> tuple[FrameType, int] | None:
    """The frame and line in the model's own code where ``err`` was raised, or ``None`` when
    it was not raised inside the model.

    Inside the model: below loopprobe's last frame on the traceback (a hook loopprobe put
    on the model raising is loopprobe's error) there is a method of an ``nn.Module``: its
    ``forward``, or any method defined outside torch (``embed``, ``step``). The reported
    frame is the deepest of those outside torch (the user's line), else the deepest. A
    call that fails while binding its arguments (``model(dict)`` for a keyword-only
    forward) never enters the model: that is bad input, not the model's error.
    """
    nn = sys.modules.get("torch.nn")
    if nn is None:  # torch never loaded: no model ran
        return None
    import loopprobe

    root = os.path.dirname(os.path.abspath(loopprobe.__file__)) + os.sep
    torch_root = os.path.dirname(os.path.abspath(sys.modules["torch"].__file__)) + os.sep
    found: list[tuple[FrameType, int, bool]] = []
    tb = err.__traceback__
    while tb is not None:
        frame, file = tb.tb_frame, os.path.abspath(tb.tb_frame.f_code.co_filename)
        ours = file.startswith(root) and not file.startswith(root + "models" + os.sep)
        if ours:
            found = []  # whatever ran the model before loopprobe's last frame is not the raiser
        elif isinstance(frame.f_locals.get("self"), nn.Module):
            in_torch = file.startswith(torch_root)
            if frame.f_code.co_name == "forward" or not in_torch:
                found.append((frame, tb.tb_lineno, in_torch))
        tb = tb.tb_next
    user = [f for f in found if not f[2]] or found
    return (user[-1][0], user[-1][1]) if user else None


def where(frame: FrameType, line: int) -> str:
    """``file.py:17, Model.forward``: a frame as a user finds it in their code."""
    owner = type(frame.f_locals.get("self")).__name__
    return f"{os.path.basename(frame.f_code.co_filename)}:{line}, {owner}.{frame.f_code.co_name}"
