"""The report's sizes (:class:`ReportConfig`) and the records sections pass around."""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from loopprobe.record.target import Target


@dataclass(frozen=True)
class ReportConfig:
    """Sizes of the embedded default run (reference LoopedGPT, random-token LM batch)."""

    vocab_size: int = 64
    seq_len: int = 16
    d_model: int = 32
    n_heads: int = 4
    batch: int = 4
    K: int = 2  # physical blocks in the alignment sweep
    Rs: tuple[int, ...] = (1, 2, 4, 8)  # rounds in the alignment sweep
    norms: tuple[str, ...] = ("deepnorm", "deeploop")
    lr: float = 1e-3  # SGD step of the bound check
    power_iters: int = 30  # power iterations per ||U|| estimate
    Ns: tuple[int, ...] = (1, 2, 4, 8, 16, 32)  # loop counts of the growth sweep
    rules: tuple[str, ...] = ("1/sqrt(N)", "1/N")
    tyings: tuple[str, ...] = ("tied", "untied")
    seeds: tuple[int, ...] = (0, 1, 2)
    cc_schemes: tuple[str, ...] = ("pre:1/sqrt(N)", "pre:1/N")  # coordinate check
    cc_Ns: tuple[int, ...] = (1, 2, 4, 8, 16)
    cc_steps: int = 3
    fp_R: int = 4  # rounds of the fixed-point model (one block, its own size)
    fp_d_model: int = 32
    fp_seq_len: int = 16
    fp_variants: tuple[tuple[str, bool], ...] = (("add", True), ("none", True))
    fp_task: str = "prefix_sums"  # trained on briefly before the fixed-point probe
    fp_train_steps: int = 40
    fp_max_iter: int = 200
    seed: int = 0
    optimizer: str = "sgd"  # what --model trains with: the health section's bound judges its step
    studies: str | None = None  # the studies tree holding verdicts.csv (default ./studies)

    @classmethod
    def quick(cls) -> ReportConfig:
        """A smaller run for tests and a first look (about half a minute on 2 cores)."""
        return cls(
            seq_len=8,
            d_model=16,
            n_heads=2,
            batch=2,
            Rs=(1, 2, 4),
            power_iters=10,
            Ns=(1, 2, 4, 8),
            seeds=(0,),
            cc_Ns=(1, 2, 4, 8),
            cc_steps=2,
            fp_max_iter=100,
        )


#: a user's model from ``--model pkg.mod:factory``: the one target object of the CLI too
UserModel = Target


@dataclass
class Context:
    """What every section gets: the config or the user's model, where to cache, progress."""

    cfg: ReportConfig
    user: UserModel | None = None
    cache_dir: pathlib.Path | None = None
    progress: bool = True
    rerun: str = "loopprobe report"  # the command that recomputes a section (+ --sections)


@dataclass
class Fig:
    """A figure, the frame it is drawn from and the one-line call that redraws it.

    The figure is built from ``frame`` (a key of ``Result.frames``, saved as CSV), filtered
    by the pandas ``query`` if given, with ``plots.<plot>(df, **kwargs)``; the HTML shows
    exactly that call, so re-plotting never recomputes.
    """

    name: str
    caption: str
    frame: str
    plot: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    query: str | None = None


@dataclass
class Result:
    """What a section returns (see the module docstring)."""

    frames: dict[str, pd.DataFrame] = field(default_factory=dict)
    figures: list[Fig] = field(default_factory=list)
    tables: list[tuple[str, pd.DataFrame]] = field(default_factory=list)
    summary: pd.DataFrame | None = None
    values: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


class Skip(Exception):  # noqa: N818 - a signal, not an error
    """Raised by a section that does not apply; the message says why."""


@dataclass(frozen=True)
class Section:
    key: str
    title: str
    question: str
    run: Callable[[Context], Result]
