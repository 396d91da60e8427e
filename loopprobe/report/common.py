"""Helpers the sections share: the reference model and batch, the user's model and inputs."""

from __future__ import annotations

import contextlib
import inspect
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import loopprobe
from loopprobe import tasks
from loopprobe._io import load_model, load_object
from loopprobe.record.types import DefaultLoss, check_loss
from loopprobe.report.config import ReportConfig, Skip, UserModel


def _gpt(cfg: ReportConfig, **over: Any) -> nn.Module:
    from loopprobe.models import GPTConfig, LoopedGPT

    base = dict(
        vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, d_model=cfg.d_model, n_heads=cfg.n_heads
    )
    seed = over.pop("seed", cfg.seed)
    return LoopedGPT(GPTConfig(**{**base, **over}), generator=torch.Generator().manual_seed(seed))


def _batch(cfg: ReportConfig, seed: int = 10_000) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return tasks.random_tokens(cfg.batch, cfg.seq_len, cfg.vocab_size, gen)


def _lm_loss(targets: torch.Tensor) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    def loss(logits: torch.Tensor, _inputs: Any) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return loss


def first_tensor(out: Any) -> torch.Tensor:
    """The output F of a model: the tensor itself, ``.logits``, ``["logits"]`` or the first."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(getattr(out, "logits", None), torch.Tensor):
        return out.logits
    if isinstance(out, dict):
        if isinstance(out.get("logits"), torch.Tensor):
            return out["logits"]
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        for v in out:
            if isinstance(v, torch.Tensor):
                return v
    raise TypeError(f"report: the model returned {type(out).__name__} with no tensor in it")


# --------------------------------------------------------------------------- the loss rule


def resolve_loss(
    loss_spec: str | None, pick: Callable[[Any], Any], targets: Any = None
) -> tuple[Callable[[Any, Any], Any], str]:
    """The loss of a probe and its name, by :data:`loopprobe._io.LOSS_RULE` (every CLI
    command and the report): ``--loss`` (imported and checked to take ``(output, inputs)``),
    else the one default rule, :class:`~loopprobe.record.types.DefaultLoss` (its ``used``
    names the loss actually used once it ran)."""
    if loss_spec is not None:
        return check_loss(load_object(loss_spec, "--loss"), f"--loss {loss_spec}"), loss_spec
    loss = DefaultLoss(pick, targets, call="loopprobe")
    return loss, loss.label


def _cfg_attr(model: nn.Module, *names: str) -> dict[str, Any] | None:
    cfg = getattr(model, "cfg", None)
    if cfg is None or not all(hasattr(cfg, n) for n in names):
        return None
    return {n: getattr(cfg, n) for n in names}


_LIBRARY = pathlib.Path(loopprobe.__file__).resolve().parent


def _raised_by_library_check(err: BaseException) -> bool:
    """Whether ``err`` was raised by loopprobe itself (outside the report), i.e. one of
    its input checks refusing the model, rather than by the user's code, torch or us."""
    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    where = pathlib.Path(tb.tb_frame.f_code.co_filename).resolve()
    return where.is_relative_to(_LIBRARY) and not where.is_relative_to(_LIBRARY / "report")


@contextlib.contextmanager
def refusal_is_skip() -> Iterator[None]:
    """Turn loopprobe's refusal of a model (a ValueError from its input checks, which says
    why the measurement does not apply) into :class:`Skip`.

    Everything else propagates and the section is reported *failed*: a ValueError raised
    in the user's model or in torch, and every other exception.
    """
    try:
        yield
    except ValueError as err:
        if _raised_by_library_check(err):
            raise Skip(str(err)) from err
        raise


def _call_with_model(fn: Callable, model: nn.Module) -> Any:
    """``fn(model)`` when fn takes a required positional argument, else ``fn()``."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return fn(model)
    required = [
        p
        for p in params
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return fn(model) if required else fn()


def load_user_model(
    model_spec: str,
    inputs_spec: str | None = None,
    loss_spec: str | None = None,
    seed: int = 0,
    output_spec: str | None = None,
    *,
    forward_spec: str | None = None,
    step_spec: str | None = None,
    increment: Any = None,
    sublayers: list[str] | None = None,
    exclude: list[str] | None = None,
    alpha: float | None = None,
    beta: float | None = None,
) -> UserModel:
    """Import and build a user's model, inputs and loss; one-line errors for bad specs.

    ``model_spec`` names a factory ``pkg.mod:fn`` (or ``path/to/file.py:fn``) returning an
    ``nn.Module``; ``inputs_spec`` a function ``fn(model)`` or ``fn()`` returning what the
    model is called with (default: random token ids when the model has ``cfg.vocab_size``
    and ``cfg.seq_len``); ``loss_spec`` a function ``loss(output, inputs) -> scalar``
    (default: :data:`loopprobe._io.LOSS_RULE`, the rule of every CLI command);
    ``output_spec`` a function ``output(out) -> Tensor`` picking F from what the model
    returns (default: the tensor, ``.logits``, ``["logits"]`` or the first tensor);
    ``forward_spec`` ``fn(model, inputs) -> output``; ``step_spec`` the round map
    ``fn(model, inputs) -> lp.RoundMap`` (as ``lp.round_map``); ``increment`` what
    ``lp.increments(increment=)`` takes; ``sublayers``/``exclude`` what ``lp.attach`` takes;
    ``alpha``/``beta`` the bound check's scales (default ``model.cfg``).
    """
    model = load_model(model_spec)
    targets = None
    if inputs_spec is not None:
        fn = load_object(inputs_spec, "--inputs")
        try:
            inputs = _call_with_model(fn, model)
        except Exception as err:  # noqa: BLE001
            raise ValueError(
                f"--inputs {inputs_spec!r}: calling it raised {type(err).__name__}: {err}"
            ) from err
    else:
        c = _cfg_attr(model, "vocab_size", "seq_len")
        if c is None:
            raise ValueError(
                f"--model {model_spec!r}: the model has no cfg.vocab_size/seq_len, "
                "so its inputs cannot be guessed; pass --inputs package.module:fn"
            )
        gen = torch.Generator().manual_seed(10_000 + seed)
        inputs, targets = tasks.random_tokens(2, c["seq_len"], c["vocab_size"], gen)
    if isinstance(inputs, list):
        inputs = tuple(inputs)
    output = load_object(output_spec, "--output") if output_spec is not None else first_tensor
    loss_fn, loss_name = resolve_loss(loss_spec, output, targets)
    user = UserModel(model_spec, model, inputs, loss_fn, loss_name, inputs_spec, loss_spec, output)
    user.output_spec = output_spec
    user.forward = load_object(forward_spec, "--forward") if forward_spec else None
    user.step = load_object(step_spec, "--step") if step_spec else None
    user.increment, user.sublayers, user.exclude = increment, sublayers, exclude
    user.alpha, user.beta = alpha, beta
    return user
