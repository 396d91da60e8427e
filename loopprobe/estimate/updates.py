"""Per-visit updates ``G_{r,j}``: one backward pass, optionally optimizer-preconditioned.

``G_{r,j} = d loss / d delta_{r,j}``: the gradient the shared parameters ``phi_j`` would get
from visit ``(r, j)`` alone if that visit had its own (untied) copy. All of them come from
one backward pass: at each visit the module computes with a fresh leaf that holds the
same values as ``phi_j``, and ``torch.autograd.grad`` differentiates the loss with
respect to those leaves. ``sum_r G_{r,j}`` is the ordinary tied gradient of ``phi_j``.
The model's ``.grad`` fields are never touched.

With an optimizer other than plain SGD the *effective* update is the optimizer's
preconditioned step. For Adam/AdamW the next step moves ``phi`` along
``m_hat / (sqrt(v_hat) + eps)``; the part of ``m_hat`` contributed by this batch's
gradient is ``c * g`` with ``c = (1 - beta1) / (1 - beta1^(t+1))``, so the visit-resolved
effective update is ``G_eff_{r,j} = c * G_{r,j} / (sqrt(v_hat) + eps)`` with ``v_hat``
from the optimizer state updated by the tied gradient (a fresh optimizer: ``t = 0``,
``c = 1``, ``v_hat = g^2``). Then ``sum_r G_eff_{r,j}`` is exactly the new-gradient
part of the step; the momentum history (absent for a fresh optimizer) is reported as a
norm, not split over visits. ``Updates.method`` says which rule was used.

``sum_r G_{r,j} = tied gradient`` is checked on every call, in the same backward pass: the
gradient is taken with respect to the per-visit leaves *and* the sublayer's own
parameters, which (the leaves standing in for them inside every visit) receive only what
is read outside the visits: a tied read-out ``F.linear(h, block.weight)``, a parameter
read in the parent's forward or in ``loss_fn``. ``Updates.outside_share[j]`` is that
part's share of the true tied (effective) update; above ``OUTSIDE_EPS`` eps of the dtype
the result is ``converged=False`` and ``reason`` names the sublayer and the share.
Reference: seed 002, Eq. 11-12 (``G_{r,j}``) and docs/definitions.md §2.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch

from loopprobe._html import HTMLView
from loopprobe._stats import cosine_matrix
from loopprobe.estimate.update_rules import check_update, precondition
from loopprobe.record.probe import Probe, first_nonfinite_visit
from loopprobe.record.session import real_parameters
from loopprobe.record.types import Forward, LossFn, Visit, call_model, default_loss, seeded


@dataclass
class Updates(HTMLView):
    """Visit-resolved updates of every physical sublayer.

    ``G[j]`` has shape ``(R_j, n_j)``: one flattened effective update per forward visit
    of sublayer j (zero rows for visits that are not gradient-visible); ``visible[j]``
    marks the gradient-visible ones (a gradient that exists and is not exactly zero).
    ``grad[j]`` is the raw ``d loss / d delta``.
    ``history_norm[j]`` is the norm of the optimizer-momentum part of the next step.
    With ``memory="low"`` only ``G_norms[j]`` (R_j,) and ``G_tied[j]`` (n_j,) are kept and
    ``G``/``grad`` are ``None``. ``outside_share[j]`` is ``||P g_out|| / ||P g_tied||``: the
    share of the true tied (effective, ``P`` the preconditioner) update of sublayer j that
    comes from reads of its parameters outside its visits, which no ``G_{r,j}`` holds
    (0 when there are none; NaN where it could not be measured). ``converged`` is False
    when a share exceeds ``OUTSIDE_EPS`` eps of the dtype (``sum_r G_{r,j}`` is then not the
    tied gradient); ``reason`` says which sublayer and by how much, and also names
    parameters that could not be checked (``requires_grad=False``).
    """

    _html_keys = ("loss", "method", "memory")

    visits: list[Visit]
    sublayers: list[str]
    visible: list[torch.Tensor]
    G_norms: list[torch.Tensor]
    G_tied: list[torch.Tensor]
    method: str
    loss: float
    history_norm: list[float] = field(default_factory=list)
    G: list[torch.Tensor] | None = None
    grad: list[torch.Tensor] | None = None
    memory: str = "full"
    outside_share: list[float] = field(default_factory=list)
    converged: bool = True
    reason: str = ""

    def tied(self, j: int) -> torch.Tensor:
        """``sum_r G_{r,j}``: the tied (effective) update of sublayer j, flattened."""
        return self.G_tied[j]

    def norms(self, j: int) -> torch.Tensor:
        """``||G_{r,j}||`` for every forward visit r of sublayer j."""
        return self.G_norms[j]

    def gram(self, j: int, *, visible_only: bool = True) -> torch.Tensor:
        """Gram matrix ``<G_r, G_s>`` over the visits of sublayer j."""
        if self.G is None:
            raise ValueError(
                "Updates.gram: memory='low' keeps no per-visit G; rerun with memory='full'"
            )
        g = self.G[j][self.visible[j]] if visible_only else self.G[j]
        return g @ g.T

    def cosine(self, j: int, *, visible_only: bool = True) -> torch.Tensor:
        """Cosine matrix of the visit updates (NaN where an update is zero)."""
        return cosine_matrix(self.gram(j, visible_only=visible_only))

    def to_frame(self) -> pd.DataFrame:
        rows = []
        for v in self.visits:
            rows.append(
                {
                    "sublayer": v.sublayer,
                    "j": v.j,
                    "r": v.r,
                    "i": v.i,
                    "module": v.module,
                    "grad_visible": bool(self.visible[v.j][v.r]),
                    "G_norm": float(self.G_norms[v.j][v.r]),
                }
            )
        df = pd.DataFrame(rows)
        df.attrs["method"] = self.method
        df.attrs["memory"] = self.memory
        df.attrs.update(converged=self.converged, reason=self.reason)
        return df


def per_visit_updates(
    probe: Probe,
    inputs: Any,
    loss_fn: LossFn | None = None,
    *,
    forward: Forward | None = None,
    update: str | torch.optim.Optimizer = "sgd",
    seed: int | None = 0,
    memory: str = "full",
) -> Updates:
    """``G_{r,j}`` for every visit of every sublayer from one backward pass.

    ``loss_fn(output, inputs)`` returns a scalar; ``None`` (default): the scalar ``.loss``
    the model returns itself (Hugging Face, given labels; :func:`loopprobe.record.types.
    model_loss`), a ``ValueError`` when it returns none. ``update``: ``"sgd"`` (``G`` is the
    gradient, the step is ``-lr * G``), ``"adam"``/``"adamw"`` (a fresh optimizer's first
    step), or a ``torch.optim.Adam``/``AdamW``/``SGD`` instance whose state is read (never
    written). ``seed``: torch's RNG is forked and seeded for the forward (same dropout
    masks as the other estimates of one report; ``None`` leaves the RNG alone).
    ``memory="full"`` stores every G (R_j x n_j per sublayer); ``"low"`` streams each
    visit's gradient out of the backward pass as soon as it is computed and keeps only
    the norms ``||G_{r,j}||`` and the tied sums (about one copy of the parameters; no
    Gram matrices; a second backward for Adam, whose preconditioner needs the tied
    gradient first). Every call also checks ``sum_r G_{r,j}`` against the tied gradient, in
    the same backward (``Updates.converged``/``reason``/``outside_share``; module
    docstring). Reference: seed 002, Eq. 11.
    """
    call = "per_visit_updates"
    loss_fn = default_loss(loss_fn, call)
    check_update(update, call)
    if memory not in ("full", "low"):
        raise ValueError(f"{call}: memory={memory!r}; choose 'full' or 'low'")
    ranks = probe.ranks  # G reduced across ranks as DDP reduces .grad (loopprobe.distributed)
    if ranks is not None and memory == "low":
        raise ValueError(
            f"{call}: memory='low' keeps only norms, which cannot be reduced across "
            f"{ranks.size} ranks; use memory='full' (or attach to model.module for per-rank)"
        )
    groups = probe.groups(inputs, forward, seed=seed)
    real_parameters(call, groups)
    leaves: list[tuple[Visit, list[torch.Tensor]]] = []

    def enter(v: Visit, module: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        new = [p.detach().requires_grad_(True) for p in groups[v.j].params]
        leaves.append((v, new))
        return new

    device = _device(groups[0].params)
    with (
        torch.enable_grad(),
        seeded(seed, device),
        probe.session(enter, call=call, transforms=False) as trace,
    ):
        out = call_model(probe.model, inputs, forward)
        loss = loss_fn(out, inputs)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"{call}: loss_fn must return a scalar tensor, got {loss!r}")
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"{call}: the loss is {float(loss.detach())}; "
                + first_nonfinite_visit(probe, inputs, forward, seed)
            )
        counts = [sum(v.j == j for v in trace.visits) for j in range(len(groups))]
        return _collect(loss, leaves, groups, counts, trace.visits, update, call, memory, ranks)


def _raise_first_bad(visits: list[Visit], is_bad: Any, call: str) -> None:
    for v in reversed(visits):
        if is_bad(v):
            raise FloatingPointError(
                f"{call}: non-finite gradient at visit r={v.r} of sublayer {v.sublayer!r} "
                f"(module {v.module!r}, execution index {v.i}), the first such visit in "
                "backward order"
            )


def _collect(loss, leaves, groups, counts, visits, update, call, memory, ranks=None) -> Updates:
    """Stream every visit's gradient out of the backward pass as soon as it is computed.

    One backward into every visit's leaves and the sublayers' own parameters
    (:func:`_backward_in_place`, or :func:`_backward` with hooks where that is not safe).
    ``full``: each leaf's gradient lands in its row of ``raw`` (R_j x n_j): one copy of all
    G. ``low``: only running tied sums and squared norms are kept; Adam's preconditioner
    needs the tied gradient first, so the preconditioned norms take a second backward pass.
    A gradient that never arrives leaves a zero row (not gradient-visible). The own
    parameters' gradients (reads outside the visits) give the check ``sum_r G_{r,j} = tied
    gradient`` (:func:`_outside_check`).
    """
    flat = [(v, k, t) for v, ts in leaves for k, t in enumerate(ts)]
    offsets = [[0] for _ in groups]
    for g, off in zip(groups, offsets, strict=True):
        for p in g.params:
            off.append(off[-1] + p.numel())
    sgd = isinstance(update, str) and update.lower() == "sgd"
    names = [g.sublayer.name for g in groups]
    if memory == "full":
        raw = [
            torch.zeros(c, g.sublayer.numel, dtype=_dtype(g.params), device=_device(g.params))
            for c, g in zip(counts, groups, strict=True)
        ]

        def into_raw(v: Visit, a: int, b: int, g: torch.Tensor) -> None:
            row = raw[v.j][v.r, a:b]
            row.add_(g.to(row.device))

        outside = (
            None if ranks is not None else _backward_in_place(loss, flat, groups, offsets, raw=raw)
        )
        if outside is None:
            outside = _backward(loss, flat, groups, offsets, into_raw, retain=False)
        if ranks is not None:  # the mean over ranks, as DDP averages .grad
            ranks.agree(counts, "the number of visits of each sublayer", call)
            raw = [ranks.mean(r) for r in raw]
            outside = [ranks.mean(o) for o in outside]
            loss = ranks.mean(loss.detach())
        sq = [torch.linalg.vector_norm(r, dim=1).double().square() for r in raw]
        _check_finite(raw, sq, visits, call)
        tied = [r.sum(0) for r in raw]
        true = [t + o for t, o in zip(tied, outside, strict=True)]
        visible = [(q > 0).cpu() for q in sq]
        G, method, history = precondition(raw, groups, update, true)
        if sgd:  # G is raw: its norms and sums are the ones just computed
            norms = [q.sqrt().to(r.dtype) for q, r in zip(sq, raw, strict=True)]
        else:
            norms, tied = [g.norm(dim=1) for g in G], [g.sum(0) for g in G]
        share, ok, reason = _outside_check(groups, update, outside, true)
        return Updates(
            visits, names, visible, norms, tied, method, float(loss.detach()), history, G, raw,
            outside_share=share, converged=ok, reason=reason,
        )  # fmt: skip

    def stream(scale: list[torch.Tensor] | None, retain: bool) -> tuple:
        tied = [g.params[0].new_zeros(g.sublayer.numel) for g in groups]
        sq = [
            torch.zeros(c, dtype=torch.float64, device=t.device)
            for c, t in zip(counts, tied, strict=True)
        ]

        def into_sums(v: Visit, a: int, b: int, g: torch.Tensor) -> None:
            g = g.reshape(-1).to(tied[v.j].device)
            if scale is not None:
                g = g * scale[v.j][a:b]
            tied[v.j][a:b] += g
            # float64 norm: not finite iff an entry is not (float32 cannot overflow it)
            sq[v.j][v.r] += torch.linalg.vector_norm(g, dtype=torch.float64).square()

        outside = _backward_in_place(loss, flat, groups, offsets, sink=into_sums, retain=retain)
        if outside is None:
            outside = _backward(loss, flat, groups, offsets, into_sums, retain=retain)
        return tied, sq, outside

    tied, sq, outside = stream(None, retain=not sgd)
    finite = [torch.isfinite(q) for q in sq]
    _raise_first_bad(visits, lambda v: not bool(finite[v.j][v.r]), call)
    # Visible: a gradient that exists and is not exactly zero.
    visible = [(q > 0).cpu() for q in sq]
    true = [t + o for t, o in zip(tied, outside, strict=True)]
    method, history = "sgd: G = dL/d delta (the step is -lr * G)", [0.0] * len(groups)
    if not sgd:
        ones = [torch.ones(1, t.numel(), dtype=t.dtype, device=t.device) for t in tied]
        G1, method, history = precondition(ones, groups, update, true)
        tied, sq, _ = stream([g[0] for g in G1], retain=False)
    norms = [q.sqrt().to(t.dtype) for q, t in zip(sq, tied, strict=True)]
    share, ok, reason = _outside_check(groups, update, outside, true)
    return Updates(
        visits, names, visible, norms, tied, method, float(loss.detach()), history,
        memory="low", outside_share=share, converged=ok, reason=reason,
    )  # fmt: skip


def _backward_in_place(
    loss, flat, groups, offsets, *, raw=None, sink=None, retain: bool = False
) -> list[torch.Tensor] | None:
    """:func:`_backward` without wrapping every gradient: one ``torch.autograd.backward``
    into the visits' leaves and the sublayers' own parameters, whose ``.grad`` is set
    beforehand to a view of its slice of ``outside`` (the parameters' own ``.grad`` objects
    are put back in ``finally``). ``raw`` given (``full``): each leaf's ``.grad`` is a view
    of its row, so the backward accumulates every G in place, no Python call per visit (as
    before the check existed). ``sink`` given (``low``): a post-accumulate hook hands each
    leaf's gradient to ``sink(visit, a, b, grad)`` and frees it. ``None`` where this is not
    safe: a parameter with hooks of its own (a backward into it would run them), a dtype
    or device that differs from its slice; then :func:`_backward` does it."""
    own = [(j, k, p) for j, g in enumerate(groups) for k, p in enumerate(g.params)]
    own = [(j, k, p) for j, k, p in own if p.requires_grad]
    outside = [g.params[0].new_zeros(g.sublayer.numel) for g in groups]
    views = [] if raw is None else [
        (t, raw[v.j][v.r, offsets[v.j][k] : offsets[v.j][k + 1]]) for v, k, t in flat
    ]  # fmt: skip
    for j, k, p in own:
        if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None) or not p.is_leaf:
            return None
        views.append((p, outside[j][offsets[j][k] : offsets[j][k + 1]]))
    if any(t.dtype != row.dtype or t.device != row.device for t, row in views):
        return None
    saved, handles = [(p, p.grad) for _, _, p in own], []

    def hook_for(v: Visit, k: int) -> Any:
        a, b = offsets[v.j][k], offsets[v.j][k + 1]

        def hook(leaf: torch.Tensor) -> None:
            g = leaf.grad
            leaf.grad = None  # free it now
            sink(v, a, b, (g.to_dense() if g.layout != torch.strided else g).reshape(-1))

        return hook

    try:
        for t, row in views:
            t.grad = row.view(t.shape)
        if sink is not None:
            handles = [t.register_post_accumulate_grad_hook(hook_for(v, k)) for v, k, t in flat]
        if loss.requires_grad and flat:
            inputs = [t for _, _, t in flat] + [p for _, _, p in own]
            torch.autograd.backward(loss, inputs=inputs, retain_graph=retain)
        for t, row in views:  # a sparse gradient replaces a dense .grad instead of adding
            if t.grad is not None and t.grad.data_ptr() != row.data_ptr():
                row.add_(t.grad.to_dense().reshape(-1))
    finally:
        for h in handles:
            h.remove()
        for _, _, t in flat:
            t.grad = None
        for p, g in saved:
            p.grad = g
    return outside


def _backward(loss, flat, groups, offsets, sink, *, retain: bool) -> list[torch.Tensor]:
    """One ``torch.autograd.grad`` over every visit's leaves and the sublayers' own parameters.

    A hook hands each leaf's gradient to ``sink(visit, a, b, grad)`` (``a:b`` its slice of
    the flattened sublayer) as soon as it is computed and leaves a zero-stride zero in its
    place, so one leaf's gradient is alive at a time. Inside a visit the leaves stand in for
    the parameters, so the parameters themselves get only what is read outside every visit;
    returned flattened per sublayer (zeros where nothing is). ``torch.autograd.grad`` never
    writes ``.grad`` nor runs post-accumulate hooks (DDP's, an optimizer-in-backward's).
    """
    own = [(j, k, p) for j, g in enumerate(groups) for k, p in enumerate(g.params)]
    own = [(j, k, p) for j, k, p in own if p.requires_grad]
    outside = [g.params[0].new_zeros(g.sublayer.numel) for g in groups]

    def hook_for(v: Visit, k: int) -> Any:
        a, b = offsets[v.j][k], offsets[v.j][k + 1]

        def hook(grad: torch.Tensor) -> torch.Tensor:
            dense = grad.to_dense() if grad.layout != torch.strided else grad  # sparse Embedding
            sink(v, a, b, dense.reshape(-1))
            if grad.layout != torch.strided:
                return torch.zeros_like(grad)  # an empty sparse tensor
            return grad.new_zeros(()).expand(grad.shape)  # holds no memory

        return hook

    handles = [t.register_hook(hook_for(v, k)) for v, k, t in flat]
    try:
        if loss.requires_grad and flat:
            inputs = [t for _, _, t in flat] + [p for _, _, p in own]
            grads = torch.autograd.grad(loss, inputs, allow_unused=True, retain_graph=retain)
            for (j, k, _), g in zip(own, grads[len(flat) :], strict=True):
                if g is not None:
                    g = g.to_dense() if g.layout != torch.strided else g
                    outside[j][offsets[j][k] : offsets[j][k + 1]] = g.reshape(-1)
    finally:
        for h in handles:
            h.remove()
    return outside


#: ``sum_r G_{r,j}`` may miss at most this many eps (of the sublayer's dtype) of the tied
#: update before the result is not converged. An outside read that does not exist gives an
#: exact zero; one that does is a real share, far above roundoff.
OUTSIDE_EPS = 256


def _outside_check(groups, update, outside, true) -> tuple[list[float], bool, str]:
    """``||P g_out|| / ||P g_tied||`` per sublayer (``P`` the preconditioner built from the
    true tied gradient), whether every share is within ``OUTSIDE_EPS`` eps, and why not."""
    pairs = [torch.stack([o, t]) for o, t in zip(outside, true, strict=True)]
    P = precondition(pairs, groups, update, true)[0]
    share, problems, unchecked = [], [], []
    for g, (o, t) in zip(groups, P, strict=True):
        no, nt = float(o.double().norm()), float(t.double().norm())
        s = no / nt if nt > 0 else (0.0 if no == 0 else 1.0)
        share.append(s)
        tol = OUTSIDE_EPS * torch.finfo(_dtype(g.params)).eps
        name = g.sublayer.name
        if not s <= tol:  # NaN fails too
            problems.append(
                f"sum over visits of G differs from the tied update of sublayer {name!r} by "
                f"{s:.3g} of its norm (||outside|| / ||tied|| > {tol:.1g}): its parameters are "
                "also read outside "
                "the module's calls (a tied read-out such as F.linear(h, block.weight), the "
                "parent's forward, or loss_fn), and no visit holds that part; route the read "
                "through a call of the module or untie it"
            )
        frozen = [
            n for n, p in zip(g.sublayer.param_names, g.params, strict=True) if not p.requires_grad
        ]
        if frozen:
            unchecked.append(
                f"sum over visits of G = tied gradient not checked for {frozen} of {name!r} "
                "(requires_grad=False: reads outside the visits are invisible)"
            )
    return share, not problems, "; ".join(problems + unchecked)


def _check_finite(raw: list[torch.Tensor], sq: list[torch.Tensor], visits, call) -> None:
    """Raise at the first non-finite gradient; rows are scanned only where a norm is not
    finite (a finite norm implies finite entries; an infinite one may be float overflow)."""
    if all(bool(torch.isfinite(q).all()) for q in sq):
        return
    finite = [torch.isfinite(r).all(1) for r in raw]
    _raise_first_bad(visits, lambda v: not bool(finite[v.j][v.r]), call)


def _dtype(params: list[torch.Tensor]) -> torch.dtype:
    return params[0].dtype


def _device(params: list[torch.Tensor]) -> torch.device:
    return params[0].device
