"""Sweeps: a grid of configs x a diagnostic -> one tidy DataFrame, cached cell by cell.

A *cell* is one config run through one diagnostic. Every finished cell is stored in
``cache_dir`` (through ``joblib.Memory``) as soon as it completes, keyed by a stable hash
of the config, the diagnostic's name, version and source code, so re-plotting never
recomputes, editing the diagnostic does, and an interrupted sweep (Ctrl-C, a killed job)
resumes where it stopped. A run that blows up becomes data: a diagnostic that raises
(other than a programming error such as ``TypeError``) gives a row with ``diverged=True``
and the ``error`` text, as does a NaN/inf in a column named by ``diverge_on``; the sweep
goes on.

Example::

    import loopprobe as lp

    def growth(cfg):                      # config -> dict (one row) or DataFrame (rows)
        model = lp.models.LoopedGPT(lp.models.GPTConfig(**cfg))
        ...
        return {"rel_change": 0.3}

    df = lp.sweep(lp.grid(norm=["deepnorm", "deeploop"], R=[1, 2, 4, 8]), growth,
                  cache_dir=".loopprobe-cache", diverge_on="rel_change")
    # columns: norm, R, rel_change, diverged, error

This is the looped-model analogue of mup's coord-check frame: one long-format table that
every plotting function in :mod:`loopprobe.plots` takes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import itertools
import json
import math
import os
import pathlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
from joblib import Memory
from joblib.func_inspect import get_func_code
from tqdm import tqdm

__all__ = ["cell_key", "grid", "sweep"]

Diagnostic = Callable[[Any], Any]


# --------------------------------------------------------------------------------- grid


def grid(**axes: Iterable[Any]) -> list[dict[str, Any]]:
    """The cartesian product of named axes, as a list of config dicts (last axis fastest).

    Example: ``grid(norm=["deepnorm", "deeploop"], R=[1, 2])`` ->
    ``[{"norm": "deepnorm", "R": 1}, {"norm": "deepnorm", "R": 2}, {"norm": "deeploop", ...}]``.
    """
    names = list(axes)
    values = []
    for name in names:
        v = axes[name]
        if isinstance(v, (str, bytes)) or not isinstance(v, Iterable):
            raise TypeError(
                f"grid: axis {name}={v!r} must be a list of values; write {name}=[{v!r}]"
            )
        values.append(list(v))
    return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*values)]


# ------------------------------------------------------------------------ config hashing


def _canonical(obj: Any) -> Any:
    """A JSON-serialisable, order-independent form of a config, for hashing."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: _canonical(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return {"__dataclass__": type(obj).__qualname__, **fields}
    if isinstance(obj, Mapping):
        return {str(k): _canonical(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, (list, tuple)):
        return [_canonical(v) for v in obj]
    if isinstance(obj, (bool, int, str)) or obj is None:
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else repr(obj)
    if isinstance(obj, np.generic):
        return _canonical(obj.item())
    if callable(obj):
        return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"
    return repr(obj)


def _diagnostic_id(diagnostic: Diagnostic, name: str | None) -> str:
    if name is not None:
        return name
    if isinstance(diagnostic, functools.partial):
        inner = _diagnostic_id(diagnostic.func, None)
        bound = _canonical({"args": list(diagnostic.args), "kwargs": diagnostic.keywords})
        return f"{inner}{json.dumps(bound, sort_keys=True)}"
    qual = getattr(diagnostic, "__qualname__", None) or type(diagnostic).__qualname__
    return f"{getattr(diagnostic, '__module__', '?')}.{qual}"


def cell_key(config: Any, diagnostic: str, version: str | int = 0, code: str = "") -> str:
    """The cache key of one cell: sha256 of the canonical config, diagnostic name, version
    and code fingerprint (what :func:`sweep` hands to ``joblib.Memory`` to hash).

    Stable across processes and Python sessions (no ``hash()``); dict key order does not
    matter; dataclass configs hash by class name and field values.
    """
    payload = {
        "config": _canonical(config),
        "diagnostic": diagnostic,
        "version": str(version),
        "code": code,
    }
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:20]


# ------------------------------------------------------------------------------- cells


def _normalise_item(item: Any, call: str) -> tuple[dict[str, Any], Any, Callable[[], Any]]:
    """(config columns, hashable config, thunk producing the diagnostic's argument)."""
    if isinstance(item, Mapping):
        return dict(item), dict(item), lambda: item
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        columns = {
            f.name: getattr(item, f.name)
            for f in dataclasses.fields(item)
            if _is_scalar(getattr(item, f.name))
        }
        return columns, item, lambda: item
    if (
        isinstance(item, tuple)
        and len(item) == 2
        and isinstance(item[0], str)
        and callable(item[1])
    ):
        name, factory = item
        return {"config": name}, {"config": name}, factory
    raise TypeError(
        f"{call}: each grid item must be a dict, a dataclass config or a (name, factory) "
        f"pair, got {type(item).__name__} {item!r}"
    )


def _is_scalar(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str, np.generic))


def _rows(result: Any, call: str, where: str) -> list[dict[str, Any]]:
    """A diagnostic's return value as a list of row dicts."""
    if isinstance(result, pd.DataFrame):
        return result.to_dict("records")
    if isinstance(result, pd.Series):
        return [result.to_dict()]
    if isinstance(result, Mapping):
        return [dict(result)]
    if isinstance(result, Sequence) and all(isinstance(r, Mapping) for r in result):
        return [dict(r) for r in result]
    if hasattr(result, "to_frame") and callable(result.to_frame):
        rows = result.to_frame().to_dict("records")
        if hasattr(result, "converged") and hasattr(result, "reason"):
            # The result's own verdict travels with every row it contributes.
            for row in rows:
                row.update(result_converged=bool(result.converged), result_reason=result.reason)
        return rows
    raise TypeError(
        f"{call}: the diagnostic returned {type(result).__name__} for {where}; return a dict "
        "(one row), a list of dicts or a pandas DataFrame (one row per sublayer/visit/step)"
    )


_PROGRAMMING_ERRORS = (
    TypeError,
    AttributeError,
    NameError,
    ImportError,
    SyntaxError,
    AssertionError,
    LookupError,
    NotImplementedError,
)
"""Exceptions that mean the diagnostic (or its call) is wrong: re-raised, never data."""


class _CellFailed(Exception):
    """Raised inside the cached function so that joblib does not store a failed cell."""

    def __init__(self, cell: dict[str, Any]):
        super().__init__(cell["error"])
        self.cell = cell


def _evaluate(
    key: str,
    *,
    diagnostic: Diagnostic,
    make_arg: Callable[[], Any],
    call: str,
    where: str,
    cache_failed: bool,
) -> dict[str, Any]:
    """One cell as ``{"rows": [...], "error": text or None}``; the joblib-cached function.

    ``key`` (config, diagnostic name, version and code fingerprint) is the only argument
    joblib hashes. A diagnostic that raises a non-programming exception gives a failed
    cell, which is raised as :class:`_CellFailed` (so not stored) unless ``cache_failed``.
    """
    try:
        result = diagnostic(make_arg())
    except (KeyboardInterrupt, SystemExit, MemoryError, *_PROGRAMMING_ERRORS):
        raise
    except Exception as err:  # noqa: BLE001 - a failing run (e.g. a blow-up) is data
        cell = {"rows": [], "error": f"{type(err).__name__}: {err}"}
        if cache_failed:
            return cell
        raise _CellFailed(cell) from err
    return {"rows": _rows(result, call, where), "error": None}  # bad return type: raise


def _non_finite(row: Mapping[str, Any], columns: Sequence[str]) -> list[str]:
    """Those of ``columns`` that hold a NaN or inf number in ``row``."""
    bad = []
    for k in columns:
        v = row.get(k)
        if isinstance(v, (bool, np.bool_)) or v is None:
            continue
        if isinstance(v, (int, float, np.number)) and not math.isfinite(float(v)):
            bad.append(k)
    return bad


def _mark(cell: dict[str, Any], diverge_on: Sequence[str], call: str, where: str) -> list[dict]:
    """The cell's rows with ``diverged`` and ``error`` filled in (copies; the cache is kept).

    A failed cell is one row ``diverged=True`` with the exception text. Otherwise a row
    is diverged when one of ``diverge_on`` is NaN/inf in it; NaN in any other column is a
    value (loopprobe uses NaN for "not defined", e.g. the U norm of a visit the loss does
    not see) and marks nothing. A row that carries its own ``diverged`` keeps it.
    """
    if cell["error"] is not None:
        return [{"diverged": True, "error": cell["error"]}]
    rows = [dict(r) for r in cell["rows"]]
    if not rows:
        return [{"diverged": False, "error": None}]
    present = {k for r in rows for k in r}
    missing = [c for c in diverge_on if c not in present]
    if missing:
        raise ValueError(
            f"{call}: diverge_on names {missing} but the diagnostic's rows for {where} have "
            f"the columns {sorted(present)}; pass diverge_on= with columns it returns"
        )
    for row in rows:
        bad = _non_finite(row, diverge_on)
        if "diverged" not in row:
            row["diverged"] = bool(bad)
        if "error" not in row:
            row["error"] = f"non-finite values in {', '.join(bad)}" if bad else None
    return rows


# ------------------------------------------------------------------------------- cache


def _code_fingerprint(diagnostic: Diagnostic) -> str:
    """A hash of the diagnostic's source code, so that editing it invalidates its cells.

    Functions (and the function inside a ``functools.partial``) hash their own source as
    joblib reads it; callable objects hash their class's source. Code the diagnostic
    calls is not included: bump ``version`` when that changes what it returns.
    """
    if isinstance(diagnostic, functools.partial):
        return _code_fingerprint(diagnostic.func)
    if hasattr(diagnostic, "__code__"):
        source = get_func_code(diagnostic)[0]
    else:
        try:
            source = inspect.getsource(type(diagnostic))
        except (OSError, TypeError):  # defined where no source is kept (a REPL, exec)
            source = get_func_code(type(diagnostic).__call__)[0]
    return hashlib.sha256(source.encode()).hexdigest()[:20]


def _prepare_cache(cache_dir: str | os.PathLike | None, call: str) -> Memory | None:
    if cache_dir is None:
        return None
    path = pathlib.Path(cache_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ValueError(
            f"{call}: cache_dir={str(cache_dir)!r} is not a writable directory ({err}); "
            "pass another path or cache_dir=None"
        ) from err
    return Memory(path, verbose=0)


def _cell(memo, key: str, kwargs: dict[str, Any], retry_failed: bool) -> dict[str, Any]:
    """Read one cell from the cache or compute it (storing it unless it failed)."""
    try:
        if memo is None:
            return _evaluate(key, **kwargs)
        cell = memo(key, **kwargs)
        if retry_failed and cell["error"] is not None:
            cell = memo.call(key, **kwargs)[0]
        return cell
    except _CellFailed as failed:
        return failed.cell


# ------------------------------------------------------------------------------- sweep


def sweep(
    grid: Iterable[Any],
    diagnostic: Diagnostic | Mapping[str, Diagnostic],
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
    *,
    name: str | None = None,
    version: str | int | None = None,
    diverge_on: str | Sequence[str] | None = None,
    cache_failed: bool = False,
    retry_failed: bool = False,
) -> pd.DataFrame:
    """Run ``diagnostic`` on every config of ``grid`` and return one tidy DataFrame.

    ``grid`` items may be dicts (their items become columns, the dict is passed to the
    diagnostic), frozen dataclass configs (scalar fields become columns, the dataclass is
    passed), or ``(name, factory)`` pairs (column ``config`` = name; ``factory()`` is
    called and its result, e.g. a model, is passed). The diagnostic returns a dict (one
    row), a list of dicts, a DataFrame, or an object with ``.to_frame()`` (a loopprobe
    result also gives every row its verdict: ``result_converged`` and ``result_reason``);
    every row gets the config columns in front and the columns ``diverged`` and ``error``
    at the end.
    ``diagnostic`` may also be a mapping ``{name: callable}``: then each config runs
    through each, and a ``diagnostic`` column says which.

    Divergence and failure. A row is ``diverged`` when one of the ``diverge_on`` columns
    (default: the diagnostic's ``diverge_on`` attribute, else none) is NaN or inf in that
    row, unless the row carries its own ``diverged``. NaN in other columns is a value, not
    a divergence: loopprobe reports NaN where a quantity is undefined (the U norm of a
    visit the loss does not see, ``cos_G_adjacent`` at R = 1). A diagnostic that raises
    gives one row ``diverged=True`` with the exception text, except for exceptions that
    mean the code is wrong (``TypeError``, ``AttributeError``, ``NameError``,
    ``ImportError``, ``LookupError``, ``AssertionError``, ``NotImplementedError``), which
    propagate, as do KeyboardInterrupt, SystemExit and MemoryError.

    Cache. With ``cache_dir`` each cell is stored through ``joblib.Memory`` as soon as it
    finishes, so a later call reads it instead of calling the diagnostic and an
    interrupted sweep resumes with the unfinished cells. The key is
    ``cell_key(config, name, version, code)``: ``name`` defaults to the diagnostic's
    ``module.qualname`` (required for lambdas; a ``(name, factory)`` pair is keyed by its
    name only), ``version`` to the diagnostic's ``version`` attribute or 0, and ``code``
    is a hash of the diagnostic's source, so editing the diagnostic recomputes its cells;
    bump ``version`` when code it calls changes what it returns. Cells whose diagnostic
    raised are not stored unless ``cache_failed=True``; ``retry_failed=True`` recomputes
    stored failed cells.
    """
    call = "sweep"
    if isinstance(diagnostic, Mapping):
        frames = []
        for diag_name, fn in diagnostic.items():
            df = sweep(
                grid,
                fn,
                cache_dir,
                progress,
                name=diag_name,
                version=version,
                diverge_on=diverge_on,
                cache_failed=cache_failed,
                retry_failed=retry_failed,
            )
            frames.append(df.assign(diagnostic=diag_name))
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    if not callable(diagnostic):
        raise TypeError(
            f"{call}: diagnostic must be a callable config -> dict/DataFrame, "
            f"got {type(diagnostic).__name__}"
        )
    items = list(grid)
    diag_id = _diagnostic_id(diagnostic, name)
    memory = _prepare_cache(cache_dir, call)
    if memory is not None and name is None and "<lambda>" in diag_id:
        raise ValueError(
            f"{call}: cannot key the cache by a lambda ({diag_id}); pass name='...' "
            "(and bump version= when it changes) or use a named function"
        )
    ver = version if version is not None else getattr(diagnostic, "version", 0)
    columns_to_check = _diverge_columns(diverge_on, diagnostic, call)
    code = _code_fingerprint(diagnostic) if memory is not None else ""
    memo = None
    if memory is not None:
        ignore = ["diagnostic", "make_arg", "call", "where", "cache_failed"]
        memo = memory.cache(_evaluate, ignore=ignore)
    cells = [_normalise_item(item, call) for item in items]

    out: list[dict[str, Any]] = []
    bar = tqdm(
        cells,
        desc=name or getattr(diagnostic, "__name__", "sweep"),
        disable=not progress,
        unit="cell",
        leave=False,
    )
    for columns, hashable, make_arg in bar:
        where = f"config {columns}"
        kwargs = {
            "diagnostic": diagnostic,
            "make_arg": make_arg,
            "call": call,
            "where": where,
            "cache_failed": cache_failed,
        }
        key = cell_key(hashable, diag_id, ver, code)
        for row in _mark(_cell(memo, key, kwargs, retry_failed), columns_to_check, call, where):
            merged = dict(columns)
            merged.update(row)
            out.append(merged)
    bar.close()
    return _tidy(out)


def _diverge_columns(diverge_on: Any, diagnostic: Diagnostic, call: str) -> tuple[str, ...]:
    value = diverge_on if diverge_on is not None else getattr(diagnostic, "diverge_on", ())
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, Iterable) or not all(isinstance(c, str) for c in value):
        raise TypeError(
            f"{call}: diverge_on must be a column name or a list of column names, "
            f"got {value!r}; e.g. diverge_on=['loss']"
        )
    return tuple(value)


def _tidy(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """Rows -> DataFrame with ``diverged``/``error`` last and ``diverged`` boolean."""
    if not rows:
        return pd.DataFrame(columns=["diverged", "error"])
    df = pd.DataFrame(rows)
    df["diverged"] = df["diverged"].fillna(False).astype(bool)
    if "error" not in df:
        df["error"] = None
    tail = ["diverged", "error"]
    return df[[c for c in df.columns if c not in tail] + tail]
