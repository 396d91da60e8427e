"""Find the loop: which reused parameter groups are physical sublayers, and what each does.

Hooks only record (:func:`record_calls`); everything else here is a pure function of the
recorded call log, so it can be tested on hand-written logs.

**The call log.** One forward runs with a pre- and a post-hook on every module that owns
parameters, and a ``TorchDispatchMode`` that follows the data: every tensor carries the
set (a bit mask) of recorded calls whose outputs it was computed from, and every op's
outputs get the union of its inputs' sets. This holds through any arithmetic, through
``detach()`` and ``torch.no_grad()`` (a detached carry is still the carry), through
in-place ops (the written tensor and its base) and through keyword arguments and nested
containers. Value-free ops (``zeros_like``, ``new_empty``, ...) start a clean set; a value
read back to Python (``.item()``, ``if``) does not carry one (control, not data). Each
:class:`Call` keeps its module, its parent call, its parameter set and ``reads``: the
calls its inputs were computed from.

**Groups and visits.** Modules with the same parameter set (by identity, so ALBERT-style
tying of different instances counts as one) form a group. A group's visits are its calls
that contain no other call of the group, each named by the outermost enclosing call of
the same group that contains only this visit (a block wrapping its only Linear is one
visit; the model wrapping R of them is not). A group is *reused* when it has more than
one visit and all its modules have one class (an embedding tied to an output head is
weight tying, not a loop). Parameter-free modules are never recorded.

**Chaining.** Visit r+1 chains on visit r when it reads it: its inputs were computed
from visit r's output (through anything in between, e.g. the other blocks of the loop).
A group *chains* when at least one and at least half of its consecutive visit pairs
chain: a loop run in two passes (a training pass and a ``no_grad`` target pass) still
chains; two independent calls of one network (Q and target, student and EMA teacher, a
train and an eval pass) do not.

**Selection.** Reused groups are taken outermost first. A group that overlaps a taken
one is skipped; a group that does not chain is skipped when a chaining reused group lies
inside it (its parameters include that group's): the pass is reused, the loop is inside.

**Roles** (evidence in this order; ``role_reason`` says which applied):

- ``body``: the group chains (it is the recurrence);
- ``norm``: a normalisation class (``LayerNorm``, ``RMSNorm``, ``GroupNorm``, batch and
  instance norms, or a class name containing ``Norm``): e.g. a final norm applied after
  the loop and again after a coda. Such a norm chains when the coda reads the normed
  state (``h = norm(loop(h)); h = norm(coda(h))``), so a norm group that chains is
  ``body`` only when some pair of its visits chains *through a visit of the loop* (a
  chaining group of another class): a norm looped with the blocks does, the final norm
  does not. A norm inside a block is part of the block's group anyway;
- ``embedding``: an ``Embedding`` class (or ``Embed`` in the class name), or visits that
  read no body visit (step conditioning, input injection: computed from the inputs alone);
- ``head``: reads body visits, and no later body visit reads it (a per-loop read-out);
- ``other``: everything else. When no group chains, only the class rules apply.

Non-body sublayers are listed and measured like any other; ``kappa_R`` leaves them out.

**Nesting** (:func:`nesting`, on the measured visit order): body sublayer a runs inside
body sublayer b when, in the visit sequence restricted to a and b, a always runs at least
twice in a row and b never does (HRM: L L H L L H, so L is nested in H with 2 steps per
H visit; siblings of one loop alternate: L0 L1 L0 L1). Of the sublayers a runs inside,
those visited most often form the innermost enclosing loop, which is reported.

**Partial ties** (:func:`loopprobe.record.ties.partial_ties`): two modules of one class
whose parameters, counted recursively, are partly the same objects (``q.weight`` tied,
``q.bias`` not; or blocks that share their ``mlp`` but not their ``attn``) are how silently
broken weight tying looks. The probe warns, and the sublayer that is the shared part says
so in its ``note`` (and the ``note`` column of the visit table): its kappa is over the
shared part, not over the whole module. Per-layer norms around a shared mixer
(ALBERT-style) are not reported; a shared block next to per-layer adapters (Zamba) is, and
is intended there.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from loopprobe.record.names import (  # noqa: F401 - discover.match etc., as before
    groups_from_names,
    is_glob,
    match,
    matches,
)

ROLES = ("body", "head", "norm", "embedding", "other")


@dataclass(frozen=True)
class Call:
    """One recorded module call: ``reads`` is a bit mask of earlier calls its inputs
    derive from (``None`` when data flow was not tracked)."""

    name: str
    parent: int
    key: frozenset
    cls: type
    reads: int | None


@dataclass(frozen=True)
class Found:
    """A discovered sublayer: its module names (call order), role and the evidence."""

    modules: tuple[str, ...]
    role: str
    reason: str


# --------------------------------------------------------------------------- recording


class _Flow(TorchDispatchMode):
    """Tags every tensor with the calls it was computed from (records, never changes)."""

    _fresh = {
        "zeros_like",
        "ones_like",
        "empty_like",
        "full_like",
        "rand_like",
        "randn_like",
        "randint_like",
        "new_zeros",
        "new_ones",
        "new_empty",
        "new_full",
        "new_empty_strided",
    }

    def __init__(self) -> None:
        super().__init__()
        self.tags = WeakTensorKeyDictionary()

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # True (torch's default) wraps __torch_dispatch__ in a dynamo guard whose first
        # call imports torch._dynamo: seconds, once per process, for nothing we need.
        return False

    def read(self, tree: Any) -> int:
        bits = 0
        for t in pytree.tree_leaves(tree):
            if isinstance(t, torch.Tensor):
                bits |= self.tags.get(t, 0)
        return bits

    def tag(self, tree: Any, bits: int) -> None:
        for t in pytree.tree_leaves(tree):
            if isinstance(t, torch.Tensor):
                self.tags[t] = self.tags.get(t, 0) | bits

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func._overloadpacket.__name__ in self._fresh:
            return out
        bits = self.read((args, kwargs))
        if bits:
            self.tag(out, bits)
            for a, t in zip(func._schema.arguments, args, strict=False):
                if a.alias_info is not None and a.alias_info.is_write:
                    self.tag(t, bits)
                    if isinstance(t, torch.Tensor) and t._base is not None:
                        self.tag(t._base, bits)
        return out


def record_calls(owners: dict[str, nn.Module], run: Callable[[], Any]) -> list[Call]:
    """Run ``run()`` once with hooks on ``owners`` and data-flow tracking; the call log.

    If the forward fails under the tracking mode (an op it cannot pass through), it is run
    again untracked and every :attr:`Call.reads` is ``None`` (chaining unknown).
    """
    try:
        return _record(owners, run, _Flow())
    except Exception as err:  # noqa: BLE001 - retried untracked; a genuine error raises again
        calls = _record(owners, run, None)
        warnings.warn(
            f"discovery: the forward failed under data-flow tracking ({type(err).__name__}: "
            f"{err}); sublayers are the outermost reused modules and their roles are unknown "
            "(all 'body'). Name the sublayers with lp.attach(model, sublayers=[...]) if wrong",
            stacklevel=4,
        )
        return calls


def _record(owners: dict[str, nn.Module], run: Callable[[], Any], flow: _Flow | None) -> list:
    calls: list[Call] = []
    stack: list[int] = []
    handles = []

    def pre(name: str, key: frozenset) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            reads = flow.read((args, kwargs)) if flow is not None else None
            calls.append(Call(name, stack[-1] if stack else -1, key, type(module), reads))
            stack.append(len(calls) - 1)

        return hook

    def post(module: nn.Module, args: tuple, out: Any) -> None:
        if stack:
            c = stack.pop()
            if flow is not None:
                flow.tag(out, 1 << c)

    try:
        for n, m in owners.items():
            key = frozenset(id(p) for p in m.parameters())
            handles.append(m.register_forward_pre_hook(pre(n, key), with_kwargs=True))
            handles.append(m.register_forward_hook(post, always_call=True))
        if flow is None:
            run()
        else:
            with flow:
                run()
    finally:
        for h in handles:
            h.remove()
    return calls


# --------------------------------------------------------------------------- pure logic


def visits_by_group(calls: Sequence[Call]) -> dict[frozenset, list[int]]:
    """Each parameter group's visits (call indices), in call order (see module docstring)."""
    key = [c.key for c in calls]
    parent = [c.parent for c in calls]
    has_child = [False] * len(calls)
    leaves_under = [0] * len(calls)
    for c in range(len(calls)):
        a = parent[c]
        while a >= 0:
            if key[a] == key[c]:
                has_child[a] = True
            a = parent[a]
    for c in range(len(calls)):
        if not has_child[c]:
            a = c
            while a >= 0:
                if key[a] == key[c]:
                    leaves_under[a] += 1
                a = parent[a]
    tops: dict[frozenset, list[int]] = {}
    for c in range(len(calls)):
        if has_child[c]:
            continue
        top = c
        while parent[top] >= 0 and key[parent[top]] == key[c] and leaves_under[parent[top]] == 1:
            top = parent[top]
        tops.setdefault(key[c], []).append(top)
    return tops


def chain_count(calls: Sequence[Call], visits: Sequence[int]) -> int | None:
    """How many consecutive visit pairs chain (visit r+1 reads visit r); None: unknown."""
    if any(calls[c].reads is None for c in visits):
        return None
    return sum(bool(calls[b].reads >> a & 1) for a, b in zip(visits, visits[1:], strict=False))


def chains(calls: Sequence[Call], visits: Sequence[int]) -> bool:
    """At least one and at least half of the consecutive pairs chain (unknown: True)."""
    n = chain_count(calls, visits)
    return True if n is None else n >= 1 and 2 * n >= len(visits) - 1


def find_sublayers(calls: Sequence[Call]) -> list[Found]:
    """The sublayers of one recorded forward, in call order, with roles (may be empty)."""
    tops = visits_by_group(calls)

    def depth(c: int) -> int:
        d = 0
        while calls[c].parent >= 0:
            c, d = calls[c].parent, d + 1
        return d

    reused = [k for k, cs in tops.items() if len(cs) > 1 and len({calls[c].cls for c in cs}) == 1]
    chained = {k: chains(calls, tops[k]) for k in reused}
    chosen: list[frozenset] = []
    for k in sorted(reused, key=lambda k: (depth(tops[k][0]), tops[k][0])):
        if any(k & c for c in chosen):
            continue
        if not chained[k] and any(chained[i] and i < k for i in reused):
            continue  # a reused pass around a loop: the loop is inside
        chosen.append(k)
    chosen.sort(key=lambda k: tops[k][0])
    known = all(c.reads is not None for c in calls)
    body = [k for k in chosen if chained[k] and known]
    loop = [k for k in body if not is_norm(calls[tops[k][0]].cls)]
    loop_bits = sum(1 << c for k in loop for c in tops[k])
    outside = {k: _chains_outside(calls, tops[k], loop_bits) for k in body if k not in loop}
    outside = outside if loop else {}
    body = [k for k in body if not outside.get(k)]
    body_bits = sum(1 << c for k in body for c in tops[k])
    found = []
    for k in chosen:
        if outside.get(k):
            n = chain_count(calls, tops[k])
            found.append(
                Found(
                    _names(calls, tops[k]),
                    "norm",
                    _NORM_OUTSIDE.format(
                        n=n, m=len(tops[k]) - 1, cls=calls[tops[k][0]].cls.__name__
                    ),
                )
            )
            continue
        role, reason = _role(calls, tops[k], chained[k] and known, body_bits, bool(body), known)
        found.append(Found(_names(calls, tops[k]), role, reason))
    return found


_NORM_OUTSIDE = (
    "visits chain ({n} of {m} pairs) but never through a visit of the loop; {cls} is a "
    "normalisation (e.g. a final norm applied after the loop and again after a coda)"
)


def _names(calls: Sequence[Call], visits: list[int]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(calls[c].name for c in visits))


def _chains_outside(calls: Sequence[Call], visits: list[int], loop_bits: int) -> bool:
    """No chaining pair (a, b) of ``visits`` runs through a loop visit v (b reads v, v
    reads a): the data path from one visit to the next skips the loop (a coda)."""
    for a, b in zip(visits, visits[1:], strict=False):
        if not calls[b].reads >> a & 1:
            continue
        through = calls[b].reads & loop_bits & ~((1 << (a + 1)) - 1)
        if any(through >> v & 1 and calls[v].reads >> a & 1 for v in range(a + 1, b)):
            return False
    return True


def _role(
    calls: Sequence[Call], visits: list[int], chained: bool, body_bits: int, any_body: bool, known
) -> tuple[str, str]:
    cls = calls[visits[0]].cls
    if not known:
        return "body", "data flow not tracked (the forward failed under tracking): assumed"
    if chained:
        n = chain_count(calls, visits)
        return "body", f"visits chain ({n} of {len(visits) - 1} consecutive pairs)"
    why = f"visits do not chain ({chain_count(calls, visits)} of {len(visits) - 1} pairs)"
    if is_norm(cls):
        return "norm", f"{why}; {cls.__name__} is a normalisation"
    if issubclass(cls, (nn.Embedding, nn.EmbeddingBag)) or "Embed" in cls.__name__:
        return "embedding", f"{why}; {cls.__name__} is an embedding"
    if not any_body:
        return "other", f"{why}; no group chains, so position gives no evidence"
    reads_body = any(calls[c].reads & body_bits for c in visits)
    if not reads_body:
        return "embedding", f"{why}; computed from the inputs alone (reads no body visit)"
    bits = sum(1 << c for c in visits)
    later = [c for c in range(len(calls)) if body_bits >> c & 1 and calls[c].reads & bits]
    if not later:
        return "head", f"{why}; reads the loop and feeds no later body visit (a read-out)"
    return "other", f"{why}; reads the loop and feeds it back"


def is_norm(cls: type) -> bool:
    norms = (
        nn.LayerNorm,
        nn.RMSNorm,
        nn.GroupNorm,
        nn.LocalResponseNorm,
        nn.modules.batchnorm._NormBase,
    )
    return issubclass(cls, norms) or "Norm" in cls.__name__


def nesting(seq: Sequence[int], body: Sequence[int]) -> dict[int, tuple[list[int], float]]:
    """``{a: (loop, steps)}``: body sublayer a runs nested in the loop made of the body
    sublayers ``loop``, ``steps`` visits of a per visit of them (see module docstring).
    ``seq``: the sublayer index of each visit, in execution order."""
    counts = {j: seq.count(j) for j in set(seq)}
    out: dict[int, tuple[list[int], float]] = {}
    for a in body:
        enclosing = [b for b in body if b != a and counts.get(a) and counts.get(b)]
        enclosing = [b for b in enclosing if _runs_inside(seq, a, b)]
        if enclosing:
            inner = max(counts[b] for b in enclosing)  # the innermost loop visits most
            loop = [b for b in enclosing if counts[b] == inner]
            out[a] = (loop, counts[a] / inner)
    return out


def _runs_inside(seq: Sequence[int], a: int, b: int) -> bool:
    """In ``seq`` restricted to a and b, a always runs at least twice, b only once."""
    runs: dict[int, list[int]] = {a: [], b: []}
    last = None
    for j in seq:
        if j in runs:
            if j == last:
                runs[j][-1] += 1
            else:
                runs[j].append(1)
            last = j
    return min(runs[a]) >= 2 and max(runs[b]) == 1
