"""Helpers shared by the subcommands: list parsing, tables, JSON output, thread choice."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

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


def model_loss(out: Any) -> torch.Tensor | None:
    """The scalar ``.loss`` (or ``["loss"]``) a model returned itself (Hugging Face style)."""
    import torch

    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss.reshape(())
    return None


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
