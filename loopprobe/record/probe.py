"""Attach to any looped ``nn.Module``: physical sublayers, their visits, per-visit offsets.

A *physical sublayer* ``j`` is a group of parameters ``phi_j`` that is reused; a *visit*
``(r, j)`` is the r-th call (execution order, 0-based here) of a module that computes with
``phi_j``. Nothing in the model's code changes: one real forward with hooks finds the
sublayers and counts the visits, and every probe installs its hooks for one call only and
removes them in ``finally``.

Recording API (stable; other modules build on it)::

    probe = lp.attach(model)                 # or sublayers=["blocks.*.attn"], exclude=[...]
    probe.sublayers(inputs)                  # list[Sublayer] (discovered once, then cached)
    probe.visits(inputs)                     # list[Visit]: who was called when, M and M_g
    probe.visit_table(inputs)                # DataFrame, one row per sublayer; .attrs M, M_g
    rec = probe.record(inputs)               # Recording: per-visit copies of inputs/outputs
    rec.visits[i].args, .kwargs, .output     # detached clones taken at call time
    with lp.attach(model) as probe: ...      # detaches on exit

``inputs`` is what the model is called with: a tensor, or a tuple of positional arguments.
``forward(model, inputs)`` replaces the call for anything else (e.g.
``forward=lambda m, x: m.hidden(x)``); ``output(out)`` picks the tensor F from the result.

Discovery (when neither ``sublayers=`` nor ``model.loopprobe_sublayers`` names them) is
:mod:`loopprobe.record.discover`: one forward (under the caller's ``seed``) records every call of
a module that owns parameters and which earlier calls its inputs were computed from;
modules with the same parameter set form a group; reused groups whose visits chain (the
output of visit r feeds visit r+1) are the loop, preferred over an outer pass that is
merely called twice; reuse that is not recurrence is listed with a ``role`` (``head``,
``norm``, ``embedding``, ``other``; the loop is ``body``). Named sublayers are ``body``.
Parameter-free modules are never sublayers. Discovery runs under ``no_grad`` (no graph
kept) and, when that forward fails, again in grad mode, for a forward that needs it
(``x.register_hook``, ``torch.autograd.grad`` inside); ``.grad`` is put back either way.

The sublayers are cached, and checked at every call: each module and parameter owner is
still at its name and holds the same parameter objects (attribute lookups, no forward:
50-80 us against a 9-11 ms forward of LoopedGPT K=4, d_model 32). After
``load_state_dict(sd, assign=True)`` or a replaced submodule the check fails and the
sublayers are found again (named ones from the same names, discovered ones by discovery
on this call's inputs), so a probe kept for a training run never measures tensors the
model no longer computes with.

Gradient-visible visits are measured: a visit whose offset gets no gradient (it ran under
``torch.no_grad()``, or its output was detached before F) is forward-visible only.
Reference: seed 002, Eq. 11-12 (visits), Eq. 17-18 (M and M_g).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import pandas as pd
import torch
from torch import nn

from loopprobe.distributed import Ranks, unwrap
from loopprobe.record import discover, discover_cache
from loopprobe.record.session import (  # noqa: F401 - grads_kept: imported from here too
    Group,
    device_of,
    grads_kept,
    owners_of,
    restored,
    session,
)
from loopprobe.record.table import visit_frame
from loopprobe.record.ties import TieNote, partial_tie_notes, warn_partial_ties, with_tie_note
from loopprobe.record.types import (
    Forward,
    Output,
    Recording,
    Sublayer,
    Trace,
    Visit,
    VisitRecord,
    call_model,
    copy_tree,
    pick_output,
    seeded,
)


class Probe:
    """Visit-resolved view of a model; create it with :func:`loopprobe.attach`.

    The probe holds no hooks between calls: each method installs its hooks for one
    forward pass and removes them in ``finally``. Parameters, buffers, ``.grad``, and
    train/eval mode are left exactly as they were.
    """

    def __init__(
        self,
        model: nn.Module,
        sublayers: Sequence[str] | None = None,
        exclude: Sequence[str] | None = None,
        ranks: Ranks | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"attach: expected an nn.Module, got {type(model).__name__}")
        model, found = unwrap(model, "attach")
        self.ranks = ranks if ranks is not None else found  # reduce over these (None: local)
        if isinstance(sublayers, str) or isinstance(exclude, str):
            raise TypeError("attach: sublayers= and exclude= take lists of names, not one string")
        self.model = model
        self._requested = list(sublayers) if sublayers is not None else None
        self._exclude = list(exclude or [])
        self._groups: list[Group] | None = None
        self._closed = False
        self._last_outside: list[tuple[int, str]] = []
        self._owners: list | None = None
        self._discovered = False
        self._depth = 0  # open sessions: inside one, parameters are swapped on purpose
        self._ties: list[TieNote] = []
        self._pnames = _param_names(model)

    # -- context manager ---------------------------------------------------------
    def __enter__(self) -> Probe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def detach(self) -> None:
        """Forget the model. Hooks never outlive a call, so there is nothing to remove."""
        self._closed = True

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise ValueError(f"{call}: this probe was detached; call lp.attach(model) again")

    # -- discovery ---------------------------------------------------------------
    def sublayers(
        self, inputs: Any = None, *, forward: Forward | None = None, seed: int | None = 0
    ) -> list[Sublayer]:
        """The physical sublayers (discovered from one forward on ``inputs`` the first time,
        with torch's RNG at ``seed``; ``None``: from the caller's RNG state, not advanced)."""
        groups = self._ensure_groups(inputs, forward, "Probe.sublayers", seed)
        return [g.sublayer for g in groups]

    def _ensure_groups(
        self, inputs: Any, forward: Forward | None, call: str, seed: int | None = 0
    ) -> list[Group]:
        self._check_open(call)
        if self._groups is not None and not self._depth and not self._current():
            # The model changed under the probe (load_state_dict(assign=True), a replaced
            # submodule): the cached parameters are not the ones the model computes with.
            if self._discovered and inputs is None:
                raise ValueError(
                    f"{call}: the model's parameters or modules changed since its sublayers "
                    "were discovered (load_state_dict(..., assign=True) or a replaced "
                    "submodule); pass inputs so they can be discovered again"
                )
            self._groups, self._owners = None, None
        if self._groups is None:
            self._pnames = _param_names(self.model)
            self._ties = ties = partial_tie_notes(self.model)
            warn_partial_ties(ties, call)
            names = self._requested
            if names is None:
                names = getattr(self.model, "loopprobe_sublayers", None)
            self._discovered = names is None
            if names is not None:
                groups = self._groups_from_names(list(names), call)
            else:
                if inputs is None:
                    raise ValueError(f"{call}: discovering sublayers needs inputs; pass inputs")
                groups = self._discover(inputs, forward, call, seed)
            groups = self._apply_exclude(groups, call)
            groups = [with_tie_note(g, ties) for g in groups]
            self._groups = [g.renumbered(j) for j, g in enumerate(groups)]
        return self._groups

    def _current(self) -> bool:
        """The cached groups are still the model's (see :meth:`Group.current`)."""
        return all(g.current(self.model) for g in self._groups or [])

    def _groups_from_names(self, names: list[str], call: str) -> list[Group]:
        all_modules = dict(self.model.named_modules())
        units = discover.groups_from_names(self.model, names, call)
        return [self._make_group(u, all_modules) for u in units]

    def _discover(
        self, inputs: Any, forward: Forward | None, call: str, seed: int | None = 0
    ) -> list[Group]:
        all_modules = dict(self.model.named_modules())
        owners = {n: m for n, m in all_modules.items() if any(True for _ in m.parameters())}
        device = device_of(self.model)
        cuda = [device.index or 0] if device.type == "cuda" else []

        def run(grad: bool) -> Callable[[], None]:
            def go() -> None:
                # Forked: with seed=None discovery draws what the measured call draws next.
                with torch.random.fork_rng(devices=cuda), seeded(seed, device):
                    with torch.set_grad_enabled(grad):
                        call_model(self.model, inputs, forward)

            return go

        cache_key = discover_cache.key(self.model, inputs, forward, seed)
        found = discover_cache.lookup(self.model, cache_key)
        if found is None:
            with restored(self.model), grads_kept(self.model):
                try:  # no_grad first: no graph is kept, the cheapest forward
                    calls = discover.record_calls(owners, run(False))
                except Exception:  # noqa: BLE001 - retried in grad mode; a real error raises
                    # A forward that needs grad mode (x.register_hook, torch.autograd.grad or
                    # requires_grad_() inside it) runs as the measured calls will run it.
                    calls = discover.record_calls(owners, run(True))
            found = discover.find_sublayers(calls)
            if found and all(c.reads is not None for c in calls):  # tracked: safe to keep
                discover_cache.store(self.model, cache_key, found)
        if not found:
            called = [n for n in owners if any(c.name == n for c in calls)]
            raise ValueError(
                f"{call}: nothing is looped in {type(self.model).__name__}: no module that owns "
                f"parameters was called more than once in one forward (called once: "
                f"{called[:8]}). Name the reused sublayers by hand, e.g. "
                "lp.attach(model, sublayers=['blocks.*.attn', 'blocks.*.mlp']); parameters used "
                "without a module call (F.linear(x, self.w) in a loop) need an nn.Module wrapper"
            )
        return [self._make_group(list(f.modules), all_modules, f.role, f.reason) for f in found]

    def _make_group(
        self,
        names: list[str],
        all_modules: dict[str, nn.Module],
        role: str = "body",
        reason: str = "named by the user",
    ) -> Group:
        rep = all_modules[names[0]]
        params = [p for _, p in rep.named_parameters()]
        index = {id(p): k for k, p in enumerate(params)}
        places, paths = [], []
        for n in names:
            locs = []
            paths.append((n, all_modules[n]))
            for rel, owner in all_modules[n].named_modules(prefix=n):
                for pname, p in owner._parameters.items():
                    if p is not None and id(p) in index:
                        locs.append((owner, pname, index[id(p)]))
                        paths.append((rel, owner))
            places.append(locs)
        sub = Sublayer(
            name=names[0],
            index=0,
            modules=tuple(names),
            param_names=tuple(self._pnames[id(p)] for p in params),
            shapes=tuple(tuple(p.shape) for p in params),
            numel=sum(p.numel() for p in params),
            role=role,
            role_reason=reason,
        )
        modules = [all_modules[n] for n in names]
        return Group(sub, params, modules, places, tuple(dict.fromkeys(paths)))

    def _apply_exclude(self, groups: list[Group], call: str) -> list[Group]:
        for pat in self._exclude:
            if not any(discover.match(pat, n) for g in groups for n in g.sublayer.modules):
                raise ValueError(
                    f"{call}: exclude pattern {pat!r} matches no sublayer; sublayers are "
                    f"{[g.sublayer.name for g in groups]}"
                )
        kept = [
            g
            for g in groups
            if not any(discover.match(p, n) for p in self._exclude for n in g.sublayer.modules)
        ]
        if not kept:
            raise ValueError(f"{call}: exclude={self._exclude} removed every sublayer")
        return kept

    def groups(
        self, inputs: Any = None, forward: Forward | None = None, *, seed: int | None = 0
    ) -> list[Group]:
        """Sublayers with their live parameter tensors (for the estimators)."""
        return self._ensure_groups(inputs, forward, "Probe.groups", seed)

    # -- the hook session -------------------------------------------------------
    def session(
        self,
        enter: Callable[[Visit, nn.Module, tuple, dict], Sequence[torch.Tensor] | None]
        | None = None,
        leave: Callable[[Visit, tuple, dict, Any], None] | None = None,
        *,
        call: str = "probe",
        transforms: bool = True,
    ) -> contextlib.AbstractContextManager[Trace]:
        """Hooks on every sublayer for one ``with`` block: :func:`loopprobe.record.session.session`
        on this probe's sublayers (``enter`` may swap a visit's parameters, ``leave`` sees
        its output; ``transforms=False``: plain autograd only, see ``session``)."""
        groups = self._ensure_groups(None, None, call)
        if self._owners is None:
            self._owners = owners_of(self.model, groups)
        return self._counted(
            session(
                self.model, groups, self._owners, enter, leave, call=call, transforms=transforms
            )
        )

    @contextlib.contextmanager
    def _counted(self, cm: contextlib.AbstractContextManager[Trace]) -> Any:
        self._depth += 1
        try:
            with cm as trace:
                yield trace
        finally:
            self._depth -= 1

    # -- public measurements -----------------------------------------------------
    def visits(
        self,
        inputs: Any,
        *,
        forward: Forward | None = None,
        output: Output | None = None,
        seed: int | None = 0,
    ) -> list[Visit]:
        """All visits of one forward on ``inputs``, with ``grad_visible`` measured.

        A visit is gradient-visible when its offset ``delta_{r,j}`` gets a nonzero gradient
        from F (one backward with a random cotangent; the model's ``.grad`` is not
        touched): visits under ``no_grad``, whose output was detached, or whose output
        F only reaches through a zero-gradient path (a slice that drops it) are not. Every probe
        forward runs with torch's RNG forked and set to ``seed`` (the caller's RNG state
        is left as it was; ``None``: use and advance the caller's RNG).
        """
        groups = self._ensure_groups(inputs, forward, "Probe.visits", seed)
        leaves: list[list[torch.Tensor]] = []

        def enter(v: Visit, module: nn.Module, args: tuple, kwargs: dict) -> list[torch.Tensor]:
            new = [p.detach().requires_grad_(True) for p in groups[v.j].params]
            leaves.append(new)
            return new

        device = device_of(self.model)
        with (
            torch.enable_grad(),
            seeded(seed, device),
            self.session(enter, call="Probe.visits") as trace,
        ):
            F = pick_output(call_model(self.model, inputs, forward), output, call="Probe.visits")
            flat = [t for ts in leaves for t in ts]
            seen = [False] * len(leaves)
            if F.requires_grad and flat:
                # A random cotangent: a visit is visible iff U_i^T w != 0, which (almost
                # surely) means U_i != 0. Ones could cancel (softmax outputs sum to 1).
                gen = torch.Generator().manual_seed(0 if seed is None else seed)
                w = torch.randn(F.shape, generator=gen, dtype=torch.float64)
                w = w.to(dtype=F.dtype, device=F.device)
                grads = torch.autograd.grad(F, flat, grad_outputs=w, allow_unused=True)
                n = 0
                for a, ts in enumerate(leaves):
                    seen[a] = any(_nonzero(gr) for gr in grads[n : n + len(ts)])
                    n += len(ts)
        self._last_outside = trace.outside
        return [replace(v, grad_visible=s) for v, s in zip(trace.visits, seen, strict=True)]

    def visit_table(
        self,
        inputs: Any,
        *,
        forward: Forward | None = None,
        output: Output | None = None,
        seed: int | None = 0,
    ) -> pd.DataFrame:
        """One row per physical sublayer: role, nesting, parameters, visits R_j, visible visits.

        ``role``: see :class:`Sublayer`. ``nested_in``: the body sublayers (comma-joined)
        of the loop this one's visits run inside (HRM: the L blocks run inside the H
        cycle), ``steps_per_outer`` visits per visit of it; empty when not nested (see
        :func:`loopprobe.record.discover.nesting`).

        ``df.attrs`` holds the totals ``M`` (forward-visible visits) and ``M_g``
        (gradient-visible visits), both measured, and ``M_formula``/``M_g_formula`` from
        ``model.cfg.M``/``.M_g`` when the model states them. Reference: seed 002, Eq. 17-18.
        """
        visits = self.visits(inputs, forward=forward, output=output, seed=seed)
        subs = [g.sublayer for g in self.groups()]
        return visit_frame(visits, subs, self._last_outside, self._ties, self.model)

    def record(
        self,
        inputs: Any,
        *,
        forward: Forward | None = None,
        copy: bool = True,
        seed: int | None = 0,
    ) -> Recording:
        """Run one forward and keep, for every visit, copies of its inputs and its output.

        Copies are detached clones taken when the call returns (outputs may be modified in
        place afterwards); ``copy=False`` keeps references instead. ``seed`` as in
        :meth:`visits`. The record of visit i
        is ``rec.visits[i]`` with ``sublayer``, ``j``, ``r``, ``module``, ``grad_enabled``,
        ``args``, ``kwargs`` and ``output``.
        """
        self._ensure_groups(inputs, forward, "Probe.record", seed)
        records: list[VisitRecord] = []
        keep = copy_tree if copy else (lambda x: x)

        def leave(v: Visit, args: tuple, kwargs: dict, out: Any) -> None:
            records.append(VisitRecord(v, keep(args), keep(kwargs), keep(out)))

        with seeded(seed, device_of(self.model)), self.session(None, leave, call="Probe.record"):
            out = call_model(self.model, inputs, forward)
        records.sort(key=lambda rec: rec.visit.i)
        return Recording(records, keep(out), self.sublayers())


def first_nonfinite_visit(
    probe: Probe, inputs: Any, forward: Forward | None = None, seed: int | None = 0
) -> str:
    """A sentence naming the first visit whose output is NaN/inf (for error messages)."""
    rec = probe.record(inputs, forward=forward, seed=seed)
    for v in rec.visits:
        outs = v.output if isinstance(v.output, tuple | list) else (v.output,)
        if any(isinstance(o, torch.Tensor) and not torch.isfinite(o).all() for o in outs):
            return (
                f"the first non-finite value appears in the output of visit r={v.r} of "
                f"sublayer {v.sublayer!r} (module {v.module!r}, execution index {v.i})"
            )
    return "no visit output is non-finite (it appears outside the looped sublayers)"


def _nonzero(grad: torch.Tensor | None) -> bool:
    return grad is not None and bool(grad.ne(0).any())


def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def attach(
    model: nn.Module,
    sublayers: Sequence[str] | None = None,
    *,
    exclude: Sequence[str] | None = None,
    ranks: Ranks | None = None,
) -> Probe:
    """Attach a :class:`Probe` to ``model`` without changing its code.

    ``sublayers``: module names or dotted globs (``"blocks.*.attn"``; ``*`` is one path
    segment, ``**`` several). Modules that hold the same parameter objects are one physical
    sublayer. Default: ``model.loopprobe_sublayers`` if present, else discovery from the
    first forward (see :mod:`loopprobe.record.discover`). ``exclude``: patterns removed from
    the list.
    A DDP-wrapped model is probed through its ``.module`` and G, U and kappa come out global
    over DDP's ranks; ``ranks=`` (a :class:`loopprobe.distributed.Ranks`) makes the results
    of any model replicated on every rank global (see :mod:`loopprobe.distributed`).

    Example::

        with lp.attach(model) as probe:
            print(probe.visit_table(idx))
            rep = lp.visit_alignment(probe, idx, loss_fn)
    """
    return Probe(model, sublayers, exclude, ranks)
