"""What ``torch.func`` transforms need from a model nobody wrote for them.

Three gaps between real models and ``torch.func`` are closed here, inside loopprobe's
probes and inside ``with lp.transform_safe():`` in anyone's code (:func:`transform_safe`,
public: e.g. ``torch.func.jvp`` through ``F.scaled_dot_product_attention``, which torch
refuses on its fused kernels); the user's settings are untouched outside them:

- **Fused attention.** ``F.scaled_dot_product_attention`` dispatches on CPU (and CUDA) to
  fused kernels that have no forward-AD rule (nor a double backward). Inside
  :func:`transform_safe` torch's own math kernel computes attention (``sdpa_kernel``), which
  every transform supports, and a ``TorchFunctionMode`` lays the output of each direct
  call out in memory exactly as the kernel the user's settings would have chosen does (the
  fused CPU kernel follows the query's layout, the math one is contiguous), so user code
  that ``.view``-s the result keeps working. The layout is measured once per argument
  signature on plain tensors, not assumed. Values agree with the fused kernel to roundoff.
- **Activation checkpointing.** ``torch.func`` supports neither checkpoint variant (saved
  tensor hooks; an ``autograd.Function`` without ``setup_context``), and a recompute in
  backward would re-fire the visit hooks as if it were a new visit. Inside
  :func:`transform_safe`, ``torch.utils.checkpoint.checkpoint`` (also when the user holds
  it as ``functools.partial``, as Hugging Face does) runs its function inline: the same
  values, no recompute, so every visit is counted once and gets its own offset. The
  reentrant variant keeps its gradient semantics: a segment none of whose tensor inputs
  requires grad passes no gradient, as in training. Memory is that of the model without
  checkpointing while loopprobe probes it.
- **Ops with no forward-mode rule at all.** :class:`JVP` computes ``J v`` with forward AD,
  and when torch reports that an op lacks a forward-AD formula it computes the same
  product from reverse mode instead: ``J v`` is the VJP of the linear map ``u -> J^T u``
  (a VJP of a VJP), and says so in its ``mode``. An op with neither rule is one error
  naming the op and the module that runs it (:func:`module_running`).

- **Forwards that torch.func refuses outright.** An old-style ``torch.autograd.Function``
  (``ctx`` in ``forward``, no ``setup_context``), ``requires_grad_()`` / ``retain_grad()``
  on a tensor made in the forward, a tensor hook, ``torch.autograd.grad`` inside the
  forward: :func:`transform_refusal` recognises torch's refusal and :func:`refused_at`
  names the Function, the module and the line; :class:`AutogradProducts` then gives the
  same ``J^T u`` and ``J v`` from plain ``torch.autograd`` (one graph, a double backward for
  ``J v``, one vector at a time), and a backward that cannot be differentiated again is one
  error naming the Function and the way out.

It also measures which floating dtypes a forward rounds in (:func:`dtypes_on_path`:
arithmetic and casts to a coarser dtype, not tensors merely made or moved), so that
tolerances follow the lowest precision on the path, not the parameters' dtype.
(Buffers written in place during forward: ``transform_safe(module)`` gives a transform
fresh copies; where loopprobe builds F, ``loopprobe.differentiate.jacobian.VisitJacobian``
functionalizes it instead.) The layout mode intercepts
every torch call while a probe runs; on LoopedGPT's sensitivity loop everything here
cost 1.03x (``benchmarks/bench_transform_safe.py``).
"""

from __future__ import annotations

import re
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, _cur_sdpa_kernel_backends, sdpa_kernel
from torch.overrides import TorchFunctionMode

from loopprobe.precision import _Dtypes
from loopprobe.refusals import module_running

_SDPA = F.scaled_dot_product_attention


def _plain_like(t: Any) -> Any:
    """A plain zero tensor with ``t``'s shape, strides, dtype and device (else ``t``)."""
    if not isinstance(t, torch.Tensor):
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).zero_()


def _key(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.stride(), x.dtype, x.device.type)
    return x


class _AttentionLayout(TorchFunctionMode):
    """Give direct ``scaled_dot_product_attention`` calls the memory layout of the kernel
    the user's settings would have chosen, while the math kernel computes them."""

    def __init__(self, user_backends: list[SDPBackend]) -> None:
        super().__init__()
        self.user = user_backends
        self._strides: dict[Any, tuple[int, ...]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is not _SDPA or not isinstance(out, torch.Tensor):
            return out
        key = (tuple(_key(a) for a in args), tuple((k, _key(v)) for k, v in kwargs.items()))
        if key not in self._strides:
            with torch.no_grad(), sdpa_kernel(self.user):
                plain = func(
                    *[_plain_like(a) for a in args],
                    **{k: _plain_like(v) for k, v in kwargs.items()},
                )
            self._strides[key] = plain.stride()
        return _relayout(out, self._strides[key])


def _relayout(t: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    """``t`` with the memory order of ``strides`` (a dense permutation layout)."""
    order = sorted(range(t.dim()), key=lambda d: (-strides[d], -d))
    if order == list(range(t.dim())):
        return t.contiguous()
    inverse = sorted(range(t.dim()), key=lambda d: order[d])
    return t.permute(order).contiguous().permute(inverse)


class _InlineCheckpoint:
    """Stands in for ``torch.utils.checkpoint.CheckpointFunction`` (the reentrant variant)."""

    @staticmethod
    def apply(function: Callable, preserve_rng_state: bool, *args: Any) -> Any:
        # Plain autograd (G, gradient visibility): a reentrant segment passes no gradient
        # unless a tensor input requires one, as in training. Under torch.func transforms
        # requires_grad means something else; the visits that training cannot reach were
        # already measured as gradient-invisible and carry no offset there.
        traced = torch._C._functorch.maybe_current_level() is not None
        if traced or any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return function(*args)
        with torch.no_grad():
            return function(*args)


def _inline_generator(*args: Any, **kwargs: Any) -> Iterator[None]:
    """Stands in for the non-reentrant variant's set-up/tear-down generator: no hooks."""
    yield


@contextmanager
def inline_checkpoint() -> Iterator[None]:
    import torch.utils.checkpoint as ckpt

    names = {"CheckpointFunction": _InlineCheckpoint}
    names["_checkpoint_without_reentrant_generator"] = _inline_generator
    saved = {n: getattr(ckpt, n) for n in names if hasattr(ckpt, n)}
    try:
        for n in saved:
            setattr(ckpt, n, names[n])
        yield
    finally:
        for n, f in saved.items():
            setattr(ckpt, n, f)


@contextmanager
def transform_safe(*modules: torch.nn.Module) -> Iterator[None]:
    """A block in which ``torch.func`` transforms (``jvp``, ``jacfwd``, ``vjp``, ``jacrev``,
    ``hessian``, ``vmap``) run through fused attention, activation checkpointing and
    in-place buffer writes, which torch's own transforms refuse.

    What changes inside the block, and only there:

    - ``F.scaled_dot_product_attention`` (also inside ``nn.MultiheadAttention`` and
      ``nn.TransformerEncoderLayer``) runs on torch's math kernel (``sdpa_kernel``), which
      has forward-AD and double-backward rules; the fused CPU/CUDA kernels have neither.
      Each direct call's output gets the memory layout (strides) the user's kernel would
      have given it, so code that ``.view``-s it keeps working. Values agree with the fused
      kernel to roundoff; attention dropout draws differently from the fused kernel.
    - ``torch.utils.checkpoint.checkpoint`` (both variants) runs its function inline: the
      same values, no recompute, the memory of the model without checkpointing.
    - For each module in ``modules``: while a ``torch.func`` transform runs it, every
      buffer of the module and its children is a fresh copy made inside the transform,
      so in-place writes (BatchNorm running statistics, counters, caches) go to the copies
      and are dropped: the transform sees the forward's values and the module's buffers
      are left as they were. Calls outside a transform write the buffers as usual.

    On exit the attention kernel selection, ``torch.utils.checkpoint`` and the modules'
    hooks are restored, also when the block raises. The first two are process-wide
    settings: other threads see them while the block runs.

    Example::

        with lp.transform_safe():
            out, tangent = torch.func.jvp(
                lambda q: F.scaled_dot_product_attention(q, q, q), (q,), (v,))
    """
    for m in modules:
        if not isinstance(m, torch.nn.Module):
            raise TypeError(
                f"transform_safe: got a {type(m).__name__}; pass the nn.Module(s) whose "
                "buffers are written in place during forward, or nothing"
            )
    load_jvp_decompositions()
    user = _cur_sdpa_kernel_backends()
    with sdpa_kernel(SDPBackend.MATH), _AttentionLayout(user), inline_checkpoint():
        with _fresh_buffers(modules):
            yield


_JVP_DECOMPOSITIONS = "torch._decomp.decompositions_for_jvp"


def load_jvp_decompositions() -> None:
    """Load torch's forward-AD decompositions now, without torch's own deprecation warning.

    On the first forward-mode call torch imports them, registering each with
    ``torch.jit.script``, which recent torch deprecates (torch 2.13: 18
    ``DeprecationWarning``-s about torch's internals that a user cannot act on, and an error
    under ``-W error``). Only that message, only during that import, is ignored; the import
    happens once per process.
    """
    if _JVP_DECOMPOSITIONS in sys.modules:
        return
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"`torch\.jit\.script` is deprecated", category=DeprecationWarning
        )
        try:
            __import__(_JVP_DECOMPOSITIONS)
        except ImportError:  # a torch without it loads nothing there
            pass


@contextmanager
def _fresh_buffers(modules: tuple[torch.nn.Module, ...]) -> Iterator[None]:
    """Under a ``torch.func`` transform, each of ``modules`` computes on copies of its
    buffers (made inside the transform, so torch.func may write them)."""
    stacks: dict[int, list[list]] = {}

    def pre(root: torch.nn.Module, args: Any) -> None:
        saved: list = []
        if torch._C._functorch.maybe_current_level() is not None:
            for mod in root.modules():
                for name, b in mod._buffers.items():
                    if b is not None:
                        saved.append((mod, name, b))
                        mod._buffers[name] = b.clone()
        stacks.setdefault(id(root), []).append(saved)

    def post(root: torch.nn.Module, args: Any, out: Any) -> None:
        for mod, name, b in reversed(stacks[id(root)].pop()):
            mod._buffers[name] = b

    handles = []
    try:
        for m in dict.fromkeys(modules):
            handles.append(m.register_forward_pre_hook(pre))
            handles.append(m.register_forward_hook(post, always_call=True))
        yield
    finally:
        for h in handles:
            h.remove()


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass (e.g. a checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1


# --------------------------------------------------------------------------- JVP fallback

_NO_FORWARD_AD = re.compile(r"Trying to use forward AD with (\S+) that does not support it")


def forward_ad_missing(error: BaseException) -> str | None:
    """The op named by torch's "no forward-AD formula" error, else ``None``."""
    m = _NO_FORWARD_AD.search(str(error))
    return m.group(1) if m else None


def jvp_by_reverse(f: Callable, primals: tuple, tangents: tuple) -> tuple[Any, Any]:
    """``(f(primals), J tangents)`` from reverse mode: the VJP of ``u -> J^T u``."""
    out, vjp_fn = torch.func.vjp(f, *primals)
    _, vjp_of_vjp = torch.func.vjp(vjp_fn, torch.zeros_like(out))
    return out, vjp_of_vjp(tuple(tangents))[0]


class JVP:
    """``torch.func.jvp`` that switches to :func:`jvp_by_reverse` once an op has no
    forward-AD rule, and remembers why in ``mode`` (results report it).

    ``model``: where to look for the module that runs an op neither mode can differentiate,
    so the error names it.
    """

    def __init__(self, model: torch.nn.Module | None = None, call: str = "jvp") -> None:
        self.mode = "forward mode"
        self.reverse = False
        self.model, self.call = model, call

    def __call__(self, f: Callable, primals: tuple, tangents: tuple) -> tuple[Any, Any]:
        if not self.reverse:
            load_jvp_decompositions()
            try:
                return torch.func.jvp(f, primals, tangents)
            except (NotImplementedError, RuntimeError) as e:
                op = forward_ad_missing(e)
                if op is None:
                    raise
                self.reverse = True
                self.mode = f"reverse mode (a VJP of a VJP): {op} has no forward-AD rule"
        try:
            return jvp_by_reverse(f, primals, tangents)
        except (NotImplementedError, RuntimeError) as e:
            if not self.reverse or "derivative for" not in str(e):
                raise
            op = self.mode.split(": ")[1].split()[0]
            where = module_running(self.model, lambda: f(*primals), op) if self.model else None
            raise RuntimeError(
                f"{self.call}: {op}{f' (in module {where!r})' if where else ''} has neither a "
                "forward-AD rule nor a double backward, so no Jacobian-vector product can pass "
                "through it. Exclude the sublayers whose sensitivity needs it, or swap that op "
                f"for a differentiable equivalent while probing (torch: {e})"
            ) from None


class AutogradProducts:
    """``J^T u`` and ``J v`` of ``f(*primals)`` by plain ``torch.autograd``, for a forward
    that ``torch.func`` refuses (:func:`transform_refusal`).

    ``primals``: one tuple of tensors per argument of ``f``. ``f`` runs once, with grad
    enabled, on fresh leaves (``out``; the floating dtypes it computes in are ``dtypes``).
    Every ``J^T u`` is one backward through that graph; every ``J v`` one backward through
    the graph of the linear map ``u -> J^T u`` (built at the first ``J v``: a double
    backward), so ``J v`` needs a backward that torch can differentiate. One vector per
    call (no ``vmap``).
    """

    def __init__(self, f: Callable, primals: tuple) -> None:
        self.leaves = tuple(tuple(p.detach().requires_grad_() for p in ps) for ps in primals)
        self.flat = [p for ps in self.leaves for p in ps]
        mode = _Dtypes()
        with torch.enable_grad(), mode:
            self.out = f(*self.leaves)
        self.dtypes = mode.seen
        self._u0: torch.Tensor | None = None
        self._g: list[torch.Tensor] = []
        self._used: list[int] = []

    def _grads(self, outs: Any, inputs: list, v: Any) -> tuple:
        if not any(o.requires_grad for o in outs):  # F does not depend on any offset
            return (None,) * len(inputs)
        return torch.autograd.grad(outs, inputs, v, retain_graph=True, allow_unused=True)

    def vjp(self, u: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], ...]:
        """``J^T u``, one tuple per argument of ``f`` (zeros where F does not depend on it)."""
        grads = iter(self._grads([self.out], self.flat, [u]))
        return tuple(
            tuple(torch.zeros_like(p) if (g := next(grads)) is None else g for p in ps)
            for ps in self.leaves
        )

    def jvp(self, tangents: tuple) -> torch.Tensor:
        """``J v`` for ``tangents`` shaped like ``primals``: the VJP of ``u -> J^T u``."""
        if self._u0 is None:
            self._u0 = torch.zeros_like(self.out, requires_grad=True)
            g: tuple = (None,) * len(self.flat)
            if self.out.requires_grad:
                with torch.enable_grad():
                    g = torch.autograd.grad(
                        self.out, self.flat, self._u0, create_graph=True, allow_unused=True
                    )
            broken = [i for i, t in enumerate(g) if t is not None and not t.requires_grad]
            if broken:
                raise RuntimeError(
                    "the backward of the forward is not differentiable (its gradient left "
                    "torch's graph, e.g. through numpy or .detach()), so J v cannot be formed "
                    "from it"
                )
            self._used = [i for i, t in enumerate(g) if t is not None]
            self._g = [g[i] for i in self._used]
            self._check_adjoint()
        return self._jvp([t for ts in tangents for t in ts])

    def _jvp(self, flat: list[torch.Tensor]) -> torch.Tensor:
        if not self._g:
            return torch.zeros_like(self.out)
        (Jv,) = self._grads(self._g, [self._u0], [flat[i] for i in self._used])
        return torch.zeros_like(self.out) if Jv is None else Jv

    def _check_adjoint(self) -> None:
        """``<u, J v> = <J^T u, v>`` for one random pair: a backward that autograd cannot
        differentiate again (``@once_differentiable`` drops the edge silently) gives
        ``J v = 0`` for its part, which no later product would reveal."""
        gen = torch.Generator(self.out.device).manual_seed(0)
        rand = lambda t: torch.randn(t.shape, generator=gen, dtype=t.dtype, device=t.device)  # noqa: E731
        u, v = rand(self.out), [rand(p) for p in self.flat]
        Jv = self._jvp(v)
        JTu = [g for ps in self.vjp(u) for g in ps]
        pairs = list(zip(JTu, v, strict=True))
        a = float((u * Jv).sum())
        b = float(sum((g * t).sum() for g, t in pairs))
        scale = float(u.norm() * Jv.norm()) + float(sum(g.norm() * t.norm() for g, t in pairs))
        if abs(a - b) > torch.finfo(self.out.dtype).eps ** 0.5 * max(scale, 1e-300):
            raise RuntimeError(
                f"the double backward disagrees with the backward: <u, J v> = {a:.6g} but "
                f"<J^T u, v> = {b:.6g} for random u, v (a backward marked "
                "@once_differentiable, or one that leaves torch's graph)"
            )
