"""The result record, the run profiles, and the registry that collects every check.

A check is a function ``f(profile) -> Outcome`` registered with :func:`statement` (the
theory's claim; expected to hold) or :func:`wrong_variant` (a natural mis-statement of the
same claim; expected NOT to hold, so that the check is shown able to fail). Registering
returns a function ``g(profile="ci") -> Result`` with the same name, so every statement
module exposes functions that return result records.
"""

from __future__ import annotations

import contextlib
import io
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import torch
from hypothesis import HealthCheck, Phase, settings

METHODS = ("symbolic", "property", "rate", "exact", "count")


@dataclass(frozen=True)
class Profile:
    """How hard to look: hypothesis examples, seeds and sweep sizes.

    ``ci`` (default) is derandomized and sized so the whole folder runs in under three
    minutes on two cores; ``thorough`` runs ten times the examples and wider sweeps.
    """

    name: str = "ci"
    examples: int = 25
    seeds: int = 2
    wide: bool = False

    def hypothesis(self, examples: int | None = None) -> settings:
        """Hypothesis settings for one property (``examples`` overrides the profile count)."""
        n = self.examples if examples is None else max(1, examples * self.examples // 25)
        phases = (Phase.explicit, Phase.generate, Phase.target)
        if self.wide:
            phases = (*phases, Phase.shrink)
        return settings(
            max_examples=n,
            derandomize=not self.wide,
            deadline=None,
            database=None,
            phases=phases,
            suppress_health_check=list(HealthCheck),
            print_blob=False,
        )


PROFILES = {
    "ci": Profile("ci", examples=25, seeds=2, wide=False),
    "thorough": Profile("thorough", examples=250, seeds=4, wide=True),
}


class Outcome(NamedTuple):
    """What a check function returns: did the claim hold, and the measured figure."""

    holds: bool
    figure: str
    note: str = ""


@dataclass
class Result:
    """One row of the table.

    ``status`` is what the check found (``pass``: the claim held; ``fail``: it did not;
    ``error``: the check itself crashed). ``expected`` is ``pass`` for statements and
    ``fail`` for wrong variants; a row is ``ok`` when the two agree.
    """

    statement: str
    reference: str
    method: str
    status: str
    figure: str
    kind: str
    expected: str
    seconds: float
    module: str
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.status == self.expected

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        return d


@dataclass(frozen=True)
class Check:
    name: str
    reference: str
    method: str
    kind: str
    func: Callable[[Profile], Outcome] = field(compare=False)
    module: str = ""

    @property
    def expected(self) -> str:
        return "pass" if self.kind == "statement" else "fail"

    def run(self, profile: Profile | str = "ci") -> Result:
        prof = PROFILES[profile] if isinstance(profile, str) else profile
        t0 = time.perf_counter()
        sink = io.StringIO()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tiny tensors: one thread is several times faster
        try:
            with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                out = self.func(prof)
            status = "pass" if out.holds else "fail"
            figure, note = out.figure, out.note
        except Exception as exc:  # a crashing check is reported, never hidden
            status, figure = "error", f"{type(exc).__name__}: {exc}"[:160]
            note = traceback.format_exc(limit=3)
        finally:
            torch.set_num_threads(threads)
        return Result(
            statement=self.name,
            reference=self.reference,
            method=self.method,
            status=status,
            figure=figure,
            kind=self.kind,
            expected=self.expected,
            seconds=time.perf_counter() - t0,
            module=self.module,
            note=note,
        )


REGISTRY: list[Check] = []


def _register(kind: str, name: str, reference: str, method: str):
    if method not in METHODS:
        raise ValueError(f"register: method={method!r} is not one of {METHODS}")

    def deco(func: Callable[[Profile], Outcome]) -> Callable[..., Result]:
        module = func.__module__.rsplit(".", 1)[-1]
        check = Check(name, reference, method, kind, func, module)
        if any(c.name == name and c.kind == kind for c in REGISTRY):
            raise ValueError(f"register: a {kind} named {name!r} is already registered")
        REGISTRY.append(check)

        def run(profile: Profile | str = "ci") -> Result:
            return check.run(profile)

        run.__name__ = func.__name__
        run.__doc__ = func.__doc__
        run.check = check  # type: ignore[attr-defined]
        return run

    return deco


def statement(name: str, reference: str, method: str):
    """Register a claim of the theory; its row is ok when the check passes."""
    return _register("statement", name, reference, method)


def wrong_variant(name: str, reference: str, method: str):
    """Register a natural wrong version of a claim; its row is ok when the check FAILS."""
    return _register("wrong variant", name, reference, method)
