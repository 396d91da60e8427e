"""Per-visit offsets as inputs: F(delta_1, ..., delta_M) and its batched JVPs and VJPs.

:class:`VisitJacobian` evaluates the model's output F with every chosen visit computing
with ``phi_j + delta_{r,j}`` (through the probe's session, the one parameter swap), and
applies, for many *operators* at once, ``U t`` (one forward-mode JVP, batched with
``torch.vmap``) and ``U^T u`` (one VJP graph, built once and reused). An operator is a
sublayer j and a subset S of its visits: ``t -> sum_{i in S} U_i t`` on ``R^{n_j}``.
:func:`loopprobe.visit_function` is its public face. No dense Jacobian is formed.
Definitions: docs/definitions.md (U, per-visit offsets).

A forward that ``torch.func`` refuses (an old-style ``autograd.Function``,
``requires_grad_()`` in the forward, a tensor hook, ``autograd.grad`` inside) gets the same
products from plain ``torch.autograd`` (:class:`loopprobe.autodiff.AutogradProducts`, one
vector at a time); ``jvp.mode`` says so and names what was refused, and where.

Invariant checked on every call (``problems``: one sentence per failed check, empty when
all hold): F at zero offsets, the probed forward, is the model's own output on the same
inputs under the same seed (one plain forward, no probe; bitwise on LoopedGPT in float32
and float64, with dropout 0.1 in train mode; only the attention kernel swap of
``transform_safe`` moves bits, 3.8e-8 in float32 and 1.0e-16 in float64 on a 3-visit
SDPA loop, so differences up to ``sqrt(eps)`` of the lowest precision on the path pass).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch.func import vjp, vmap

from loopprobe.autodiff import JVP, AutogradProducts
from loopprobe.precision import dtypes_on_path, lowest_precision
from loopprobe.record import session
from loopprobe.record.probe import Probe, first_nonfinite_visit
from loopprobe.record.session import buffer_values, put_back, real_parameters, restored
from loopprobe.record.types import Forward, Output, Visit, call_model, pick_output, seeded
from loopprobe.refusals import refused_at, refused_function, transform_refusal


class VisitJacobian:
    """F as a function of per-visit offsets, with batched JVP/VJP for a set of operators.

    ``visits`` are the visits that get an offset input (others compute with the plain
    parameters). An *operator* is a sublayer j and a subset S of its visits: the map
    ``t -> sum_{i in S} U_i t`` on ``R^{n_j}``. Vectors are padded to ``n_max``.
    """

    def __init__(
        self,
        probe: Probe,
        inputs: Any,
        visits: Sequence[Visit],
        *,
        forward: Forward | None = None,
        output: Output | None = None,
        seed: int | None = 0,
        call: str = "sensitivity",
    ) -> None:
        self.probe, self.inputs, self.forward, self.output = probe, inputs, forward, output
        self.groups = probe.groups(inputs, forward, seed=seed)
        real_parameters(call, self.groups)
        self.visits = list(visits)
        self.pos = {v.i: k for k, v in enumerate(self.visits)}
        self.n = [self.groups[v.j].sublayer.numel for v in self.visits]
        self.n_max = max(g.sublayer.numel for g in self.groups)
        p0 = self.groups[0].params[0]
        # Vectors in the widest dtype of the parameters (a float32 gate in a float64 model
        # keeps float64 directions exact), each part cast to its own in :meth:`unflatten`.
        every = [p.dtype for g in self.groups for p in g.params if p.is_floating_point()]
        self.dtype = max(every, key=lambda d: torch.finfo(d).bits, default=p0.dtype)
        self.device = p0.device
        self.seed, self.call = seed, call
        # Primals are the parameter values themselves (shared, not copied): offset 0.
        self.primals = tuple(
            tuple(p.detach() for p in self.groups[v.j].params) for v in self.visits
        )
        self.shapes = [[p.shape for p in self.groups[v.j].params] for v in self.visits]
        self.param_dtypes = [[p.dtype for p in self.groups[v.j].params] for v in self.visits]
        self._expected: list[tuple[int, int]] | None = None
        self._vjp_fn = None
        self.F0: torch.Tensor | None = None
        self.jvp = JVP(probe.model, call)
        self.buffer_writes: list[str] | None = None
        self.buffer_places = [
            (mod, name)
            for mod in probe.model.modules()
            for name, b in mod._buffers.items()
            if b is not None
        ]
        self.dtypes: set[torch.dtype] = {self.dtype}
        self.products: AutogradProducts | None = None  # set when torch.func refuses the forward
        self.refusal: str | None = None  # what torch.func refused, and where
        self._refused_fn: str | None = None
        self.problems: list[str] = []
        self._jvp2: Any = None  # U t by reverse over reverse (:meth:`_reverse_jvp`)
        self._forward_checked = False  # a forward-mode product has run
        self.forward_probed = False  # the whole graph's was checked: copies need none
        self.reverse_over_reverse = True  # False: every U t in forward mode (less memory)
        self._checked = False  # vjp_fn has run its checks (F finite, F(0), dtypes) once

    def restricted(self, ks: Sequence[int], check: bool = True) -> VisitJacobian:
        """The same F with offsets at the selected visits ``ks`` only (the others compute
        with the plain parameters), sharing discovery, seed and checks: its JVP carries
        tangents from the first of them on and its VJP graph reaches back to it only, with
        weight gradients for them alone, so an operator over some visits costs their part of
        the loop rather than all of it. Masks index ``ks`` in order. ``self`` where the
        products are not ``torch.func``'s (plain autograd, buffer writes): one graph.
        ``check``: its first ``U t`` is forward mode (what the solver's adjointness check
        compares with the backward graph) unless the whole graph's was checked so
        (``forward_probed``); False: reverse over reverse from the first (for products no
        check reads: the cross-check's)."""
        if not self._checked:
            self.vjp_fn()
        if self.products is not None or self.buffer_writes is not None or self.jvp.reverse:
            return self
        sub = copy.copy(self)
        sub.visits = [self.visits[k] for k in ks]
        sub.pos = {v.i: k for k, v in enumerate(sub.visits)}
        sub.n = [self.n[k] for k in ks]
        sub.primals = tuple(self.primals[k] for k in ks)
        sub.shapes = [self.shapes[k] for k in ks]
        sub.param_dtypes = [self.param_dtypes[k] for k in ks]
        sub._vjp_fn, sub.F0 = None, None
        sub._jvp2, sub._forward_checked = None, self.forward_probed or not check
        sub._vjp_by_transforms()
        return sub

    def f(self, *deltas: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Flattened F, computing with ``deltas[k]`` (one tensor per parameter, the value
        ``phi_j + delta``) in place of ``phi_j`` at the k-th selected visit.

        A model that writes its buffers in place during forward (running statistics, a
        cache) cannot be transformed as it is (``torch.func`` refuses to mutate captured
        tensors): then F is functionalized with fresh copies of the buffers as inputs, the
        writes become out-of-place, and JVPs come from reverse mode.
        """
        if self.buffer_writes is None:
            return self._f(*deltas)
        places = self.buffer_places
        fresh = [mod._buffers[name].clone() for mod, name in places]
        return torch.func.functionalize(self._f_with_buffers, remove="mutations_and_views")(
            deltas, fresh
        )

    def _f_with_buffers(self, deltas: tuple, buffers: list[torch.Tensor]) -> torch.Tensor:
        saved = [mod._buffers[name] for mod, name in self.buffer_places]
        try:
            for (mod, name), b in zip(self.buffer_places, buffers, strict=True):
                mod._buffers[name] = b
            return self._f(*deltas)
        finally:
            for (mod, name), b in zip(self.buffer_places, saved, strict=True):
                mod._buffers[name] = b

    def _written_buffers(self) -> list[str]:
        """Names of the buffers one plain forward changes (``_restored`` puts them back)."""
        named = list(self.probe.model.named_buffers())
        before = [b._version for _, b in named]  # bumped by the write (and by the restore)
        with torch.no_grad():
            self._f(*self.primals)
        return [n for (n, b), old in zip(named, before, strict=True) if b._version != old]

    def _f(self, *deltas: tuple[torch.Tensor, ...]) -> torch.Tensor:

        def enter(v: Visit, module: Any, args: tuple, kwargs: dict) -> Sequence | None:
            k = self.pos.get(v.i)
            if k is None:
                return None
            if self.visits[k].j != v.j:
                self._diverged(v)
            return deltas[k]

        with seeded(self.seed, self.device), self.probe.session(enter, call=self.call) as trace:
            out = call_model(self.probe.model, self.inputs, self.forward)
            F = pick_output(out, self.output, call=self.call)
        seen = [(v.i, v.j) for v in trace.visits]
        if self._expected is None:
            self._expected = seen
        elif seen != self._expected:
            raise RuntimeError(
                f"{self.call}: the model took a different path on re-evaluation "
                f"({len(seen)} visits instead of {len(self._expected)}); its trip counts "
                "depend on randomness that the seed does not control. Use model.eval() or "
                "a deterministic forward="
            )
        return F.reshape(-1)

    def _diverged(self, v: Visit) -> None:
        raise RuntimeError(
            f"{self.call}: visit {v.i} is sublayer {v.sublayer!r} now but was another one "
            "when the visits were counted; the execution order is not reproducible"
        )

    def release(self) -> None:
        """Drop the VJP and reverse-over-reverse graphs while narrowed copies do the work;
        the next product rebuilds them (one forward, no checks again). ``torch.func`` only."""
        if self._checked and self.products is None and self.buffer_writes is None:
            self._vjp_fn, self._jvp2 = None, (None if self._jvp2 is not False else False)

    def vjp_fn(self) -> Any:
        if self._vjp_fn is None and self._checked:  # released: the graph again, no checks
            self._vjp_by_transforms()
        elif self._vjp_fn is None:
            try:
                self._vjp_by_transforms()
            except RuntimeError as e:
                if transform_refusal(e) is None:
                    raise
                self._to_autograd(e)
            # Tolerances follow the lowest precision the forward computes in, not the
            # parameters' dtype (a float64 model may cast F, a norm or RoPE to float32).
            assert self.F0 is not None
            self.dtypes = self._dtypes_on_path() | {self.F0.dtype}
            if not torch.isfinite(self.F0).all():
                raise FloatingPointError(
                    f"{self.call}: the output F is not finite; "
                    + first_nonfinite_visit(self.probe, self.inputs, self.forward, self.seed)
                )
            self.problems = self._F0_problems()
            self._checked = True
        return self._vjp_fn

    def _vjp_by_transforms(self) -> None:
        # Outer no_grad: torch.func still differentiates, but no autograd graph is
        # recorded for the model's own parameters (much faster, less memory).
        saved = buffer_values(self.probe.model)
        try:
            with torch.no_grad():
                self.F0, self._vjp_fn = vjp(self.f, *self.primals)
        except RuntimeError as e:
            # the failed attempt may have written buffers (spectral_norm's u/v) that nothing
            # under the transform could put back: back before any fallback runs
            put_back(saved)
            if "mutate a captured Tensor" not in str(e) or self.buffer_writes is not None:
                raise
            written = self._written_buffers()
            self.buffer_writes = written
            self.jvp.reverse = True
            self.jvp.mode = (
                "reverse mode (a VJP of a VJP) on a functionalized forward: the model "
                f"writes buffers in place ({', '.join(written) or 'a captured tensor'})"
            )
            with torch.no_grad():
                self.F0, self._vjp_fn = vjp(self.f, *self.primals)

    def _dtypes_on_path(self) -> set[torch.dtype]:
        if self.products is not None:
            return self.products.dtypes
        try:
            return dtypes_on_path(lambda: self.f(*self.primals))
        except RuntimeError:  # a forward that needs grad mode (a tensor hook, autograd.grad)
            leaves = [tuple(p.detach().requires_grad_() for p in ps) for ps in self.primals]
            return dtypes_on_path(lambda: self.f(*leaves), grad=True)

    # -- plain autograd, where torch.func refuses the forward ------------------------
    def _to_autograd(self, error: RuntimeError) -> None:
        """Products from plain ``torch.autograd`` from now on (``error``: torch's refusal)."""
        self.refusal = f"{transform_refusal(error)}{refused_at(error, self.probe.model)}"
        self._refused_fn = refused_function(error)
        try:
            self.products = AutogradProducts(self._f, self.primals)
        except RuntimeError as e:
            raise self._unusable(e) from None
        self.F0 = self.products.out.detach()
        self._vjp_fn = self._autograd_vjp
        self.jvp.reverse = True
        self.jvp.mode = (
            "reverse mode by plain torch.autograd (a double backward, one vector at a time): "
            f"torch.func refuses {self.refusal}"
        )

    def _unusable(self, error: RuntimeError) -> RuntimeError:
        fn = self._refused_fn
        way = (
            f"give {fn} a setup_context staticmethod (forward without ctx) and a jvp, so "
            "that torch.func can run it (https://pytorch.org/docs/stable/notes/extending.func"
            ".html), or a backward torch can differentiate (no @once_differentiable)"
            if fn
            else "remove that call from the forward while probing, or exclude the sublayers "
            "that need it (lp.attach(model, exclude=[...]))"
        )
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return RuntimeError(
            f"{self.call}: torch.func refuses this forward ({self.refusal}) and plain "
            f"torch.autograd cannot form its Jacobian-vector products either ({first}). "
            f"Way out: {way}"
        )

    @session.bounded_backward
    def _autograd_vjp(self, u: torch.Tensor) -> tuple:
        assert self.products is not None
        try:
            return self.products.vjp(u)
        except (RuntimeError, SystemError) as e:
            raise self._unusable(e) from None

    @session.bounded_backward
    def _autograd_jvp(self, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        assert self.products is not None
        tangents = tuple(self.unflatten(k, mask[k] * v[: self.n[k]]) for k in range(len(self.n)))
        try:
            return self.products.jvp(tangents)
        except (RuntimeError, SystemError) as e:
            raise self._unusable(e) from None

    def _F0_problems(self) -> list[str]:
        """``[]`` when F at zero offsets is the model's own output (one plain forward, no
        probe, same inputs and seed, grad enabled as in training), else one sentence."""
        model, check = self.probe.model, "the F(0) check"
        try:
            with seeded(self.seed, self.device), restored(model), torch.enable_grad():
                out = call_model(model, self.inputs, self.forward)
                ref = pick_output(out, self.output, call=self.call).detach().reshape(-1)
        except Exception as e:  # noqa: BLE001 - reported, not raised: the check cannot run
            return [f"{check} could not run: the model's own forward raised {e!r}"]
        F0 = self.F0
        assert F0 is not None
        if ref.shape != F0.shape:
            return [
                f"{check} failed: the probed forward gives {F0.numel()} numbers but the "
                f"model's own output has {ref.numel()}; the probed function is not the model"
            ]
        if torch.equal(ref, F0):
            return []
        low = lowest_precision(self.dtypes)
        tol = torch.finfo(low).eps ** 0.5
        diff = (F0 - ref.to(F0.dtype)).abs().max()
        rel = float(diff / ref.abs().max().to(F0.dtype).clamp_min(torch.finfo(F0.dtype).tiny))
        if rel <= tol:
            return []
        return [
            f"{check} failed: F at zero offsets differs from the model's own output by "
            f"{rel:.3g} (max |difference| / max |output|, allowed {tol:.2g} = sqrt(eps) of "
            f"{str(low).replace('torch.', '')}), so the probed function is not the model: "
            "its forward branches on isinstance(p, nn.Parameter), reads a counter or other "
            "state that changes between calls, or draws randomness the seed does not "
            "control (e.g. attention dropout inside scaled_dot_product_attention, which "
            "torch's math kernel draws differently from the fused one)"
        ]

    # -- operators -----------------------------------------------------------------
    def masks(self, operators: Sequence[Sequence[int]]) -> torch.Tensor:
        """``(B, K)`` 0/1 matrix: operator b uses the selected visits in ``operators[b]``."""
        m = torch.zeros(len(operators), len(self.visits), dtype=self.dtype, device=self.device)
        for b, ks in enumerate(operators):
            m[b, list(ks)] = 1
        return m

    def unflatten(self, k: int, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out, off = [], 0
        for shape, dtype in zip(self.shapes[k], self.param_dtypes[k], strict=True):
            n = shape.numel()
            out.append(t[off : off + n].view(shape).to(dtype))
            off += n
        return tuple(out)

    def jvp_one(self, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        tangents = tuple(self.unflatten(k, mask[k] * v[: self.n[k]]) for k in range(len(self.n)))
        return self.jvp(self.f, self.primals, tangents)[1]

    def vjp_one(self, u: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        grads = self.flat_grads(self.vjp_fn()(u))
        w = torch.zeros(self.n_max, dtype=self.dtype, device=self.device)
        for k, g in enumerate(grads):
            w = w + torch.nn.functional.pad(mask[k] * g, (0, self.n_max - self.n[k]))
        return w

    @staticmethod
    def flat_grads(grads: tuple) -> list[torch.Tensor]:
        return [torch.cat([t.reshape(-1) for t in g]) for g in grads]

    def matvec(self, V: torch.Tensor, masks: torch.Tensor, chunk_size: int | None = None):
        """``U_b v_b`` for every operator b: one vmapped JVP (``chunk_size=0``: a loop; a
        loop of plain-autograd products where torch.func refuses the forward)."""
        self.vjp_fn()
        with torch.no_grad():
            if self.products is None:
                try:
                    return self._matvec_by_transforms(V, masks, chunk_size)
                except RuntimeError as e:
                    if transform_refusal(e) is None:
                        raise
                    self._to_autograd(e)
            return torch.stack([self._autograd_jvp(v, m) for v, m in zip(V, masks, strict=True)])

    def _matvec_by_transforms(self, V: torch.Tensor, masks: torch.Tensor, chunk_size: int | None):
        if chunk_size == 0:
            return torch.stack([self.jvp_one(v, m) for v, m in zip(V, masks, strict=True)])
        if self._forward_checked and self._reverse_jvp() is not None:
            try:
                return vmap(self._jvp_by_vjp, randomness="same", chunk_size=chunk_size)(V, masks)
            except (NotImplementedError, RuntimeError):  # an op without a double backward
                self._jvp2 = False
        self._forward_checked = True
        return vmap(self.jvp_one, randomness="same", chunk_size=chunk_size)(V, masks)

    def _reverse_jvp(self) -> Any:
        """``u -> U^T u``'s own VJP, built once from the VJP graph: ``U t`` as a backward
        of the backward. Forward-mode dual tensors cost 1.4-2x a VJP
        (benchmarks/bench_jvp_modes.py: 0.68x the forward-mode product at d 64); this
        reuses the one graph. It is used from the second product on: the first is forward
        mode, so the adjointness check of every product (``<U^T U v, v> = ||U v||^2``) still
        compares forward-mode tangents with the backward graph once per graph (a ``no_grad``
        region after a visit shows there, and a forward that ``torch.func`` refuses switches
        to plain autograd). A :meth:`restricted` copy of a graph whose whole forward was
        checked so (``forward_probed``,
        :func:`~loopprobe.estimate.sensitivity_runs.forward_probe`) starts by reverse over
        reverse; any other copy checks itself. ``None`` where it cannot be built."""
        if self._jvp2 is None and self.reverse_over_reverse:
            assert self.F0 is not None
            try:
                with torch.no_grad():
                    self._jvp2 = vjp(self.vjp_fn(), torch.zeros_like(self.F0))[1]
            except (NotImplementedError, RuntimeError):
                self._jvp2 = False
        return self._jvp2 or None

    def _jvp_by_vjp(self, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        tangents = tuple(self.unflatten(k, mask[k] * v[: self.n[k]]) for k in range(len(self.n)))
        return self._jvp2(tangents)[0]

    def rmatvec(self, U: torch.Tensor, masks: torch.Tensor, chunk_size: int | None = None):
        """``U_b^T u_b`` for every operator b, reusing one VJP graph (``chunk_size=0``: a loop)."""
        self.vjp_fn()
        with torch.no_grad():
            if chunk_size == 0 or self.products is not None:
                return torch.stack([self.vjp_one(u, m) for u, m in zip(U, masks, strict=True)])
            return vmap(self.vjp_one, randomness="same", chunk_size=chunk_size)(U, masks)

    def linear_operator(self, ks: Sequence[int], chunk_size: int | None = None) -> Any:
        """``sum_{k in ks} U_k`` (visits of one sublayer) as a
        ``scipy.sparse.linalg.LinearOperator``, shape ``(F.numel(), n_j)``, float64 numpy
        in and out: ``matvec``/``matmat`` are :meth:`matvec` (one vmapped JVP for all
        columns), ``rmatvec``/``rmatmat`` are :meth:`rmatvec` (the one VJP graph)."""
        import numpy as np
        from scipy.sparse.linalg import LinearOperator

        self.vjp_fn()
        assert self.F0 is not None
        m, n = self.F0.numel(), self.n[ks[0]]
        mask = self.masks([ks])

        def tensor(X: Any, rows: int) -> torch.Tensor:  # (rows, k) numpy -> (k, rows)
            X = np.asarray(X, dtype=np.float64).reshape(rows, -1)
            return torch.from_numpy(X.T.copy()).to(self.dtype).to(self.device)

        def matmat(X: Any) -> Any:
            V = tensor(X, n)
            V = torch.nn.functional.pad(V, (0, self.n_max - n))
            U = self.matvec(V, mask.repeat(len(V), 1), chunk_size)
            return U.double().cpu().numpy().T

        def rmatmat(Y: Any) -> Any:
            U = tensor(Y, m)
            W = self.rmatvec(U, mask.repeat(len(U), 1), chunk_size)[:, :n]
            return W.double().cpu().numpy().T

        return LinearOperator(
            (m, n), matvec=matmat, rmatvec=rmatmat, matmat=matmat, rmatmat=rmatmat,
            dtype=np.float64,
        )  # fmt: skip

    def transpose_all(self, u: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``U_i^T u`` for every selected visit i, flattened (one backward)."""
        fn = self.vjp_fn()
        with torch.no_grad():
            return tuple(self.flat_grads(fn(u)))
