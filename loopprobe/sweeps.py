"""Sweeps: a grid of configs x a diagnostic -> one tidy DataFrame, cached cell by cell.

A *cell* is one config run through one diagnostic. Every finished cell is written to
``cache_dir`` as soon as it completes, keyed by a stable hash of the config and the
diagnostic's name and version, so re-plotting never recomputes and an interrupted sweep
(Ctrl-C, a killed job) resumes where it stopped. A diagnostic that raises, or returns
NaN/inf, becomes data: its rows carry ``diverged=True`` and the ``error`` text, and the
sweep goes on.

Example::

    import loopprobe as lp

    def growth(cfg):                      # config -> dict (one row) or DataFrame (rows)
        model = lp.models.LoopedGPT(lp.models.GPTConfig(**cfg))
        ...
        return {"rel_change": 0.3}

    df = lp.sweep(lp.grid(norm=["deepnorm", "deeploop"], R=[1, 2, 4, 8]), growth,
                  cache_dir=".loopprobe-cache")
    # columns: norm, R, rel_change, diverged, error

This is the looped-model analogue of mup's coord-check frame: one long-format table that
every plotting function in :mod:`loopprobe.plots` takes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import math
import os
import pathlib
import pickle
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
from tqdm import tqdm

__all__ = ["cell_key", "grid", "sweep"]

Diagnostic = Callable[[Any], Any]
_CACHE_FORMAT = 1  # bump when the on-disk cell layout changes


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


def cell_key(config: Any, diagnostic: str, version: str | int = 0) -> str:
    """The cache key of one cell: sha256 of the canonical config, diagnostic name and version.

    Stable across processes and Python sessions (no ``hash()``); dict key order does not
    matter; dataclass configs hash by class name and field values.
    """
    payload = {"config": _canonical(config), "diagnostic": diagnostic, "version": str(version)}
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
        return result.to_frame().to_dict("records")
    raise TypeError(
        f"{call}: the diagnostic returned {type(result).__name__} for {where}; return a dict "
        "(one row), a list of dicts or a pandas DataFrame (one row per sublayer/visit/step)"
    )


def _non_finite(rows: list[dict[str, Any]]) -> list[str]:
    """Names of the columns holding a NaN or inf number in any row."""
    bad = []
    for row in rows:
        for k, v in row.items():
            if isinstance(v, (bool, np.bool_)):
                continue
            if isinstance(v, (int, float, np.number)) and not math.isfinite(float(v)):
                if k not in bad:
                    bad.append(k)
    return bad


def _run_cell(diagnostic: Diagnostic, make_arg: Callable[[], Any], call: str, where: str):
    """Rows of one cell, with ``diverged`` and ``error``; ordinary exceptions become data."""
    try:
        result = diagnostic(make_arg())
    except (KeyboardInterrupt, SystemExit, MemoryError):
        raise
    except Exception as err:  # noqa: BLE001 - a failing cell is data, not a crash
        return [{"diverged": True, "error": f"{type(err).__name__}: {err}"}]
    rows = _rows(result, call, where)  # a wrong return type is a usage bug: raise
    if not rows:
        return [{"diverged": False, "error": None}]
    bad = _non_finite(rows)
    for row in rows:
        if "diverged" not in row:
            row["diverged"] = bool(bad)
        if "error" not in row:
            row["error"] = f"non-finite values in {', '.join(bad)}" if bad else None
    return rows


# ------------------------------------------------------------------------------- cache


def _cache_path(cache_dir: pathlib.Path, key: str) -> pathlib.Path:
    return cache_dir / f"{key}.pkl"


def _load(path: pathlib.Path) -> list[dict[str, Any]] | None:
    try:
        with open(path, "rb") as fh:
            blob = pickle.load(fh)
    except (OSError, EOFError, pickle.UnpicklingError):
        return None  # missing or half-written: recompute this cell
    if not isinstance(blob, dict) or blob.get("format") != _CACHE_FORMAT:
        return None
    return blob["rows"]


def _store(path: pathlib.Path, blob: dict[str, Any]) -> None:
    """Write atomically: a killed process leaves either the old file or the new one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".pkl")
    try:
        with os.fdopen(fd, "wb") as fh:
            pickle.dump(blob, fh, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _prepare_cache(cache_dir: str | os.PathLike | None, call: str) -> pathlib.Path | None:
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
    return path


# ------------------------------------------------------------------------------- sweep


def sweep(
    grid: Iterable[Any],
    diagnostic: Diagnostic | Mapping[str, Diagnostic],
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
    *,
    name: str | None = None,
    version: str | int | None = None,
    retry_failed: bool = False,
) -> pd.DataFrame:
    """Run ``diagnostic`` on every config of ``grid`` and return one tidy DataFrame.

    ``grid`` items may be dicts (their items become columns, the dict is passed to the
    diagnostic), frozen dataclass configs (scalar fields become columns, the dataclass is
    passed), or ``(name, factory)`` pairs (column ``config`` = name; ``factory()`` is
    called and its result, e.g. a model, is passed). The diagnostic returns a dict (one
    row), a list of dicts, a DataFrame, or an object with ``.to_frame()``; every row gets
    the config columns in front and the columns ``diverged`` and ``error`` at the end. A
    diagnostic that raises (anything but KeyboardInterrupt/SystemExit/MemoryError) gives
    one row with ``diverged=True`` and the exception text; one that returns NaN or inf
    gets ``diverged=True`` and ``error`` naming the columns, unless its rows carry their
    own ``diverged``. ``diagnostic`` may also be a mapping ``{name: callable}``: then each
    config runs through each, and a ``diagnostic`` column says which.

    With ``cache_dir`` each finished cell is written at once to
    ``cache_dir/<key>.pkl``, ``key = cell_key(config, name, version)``; a later call with
    the same cells reads them instead of calling the diagnostic (a ``(name, factory)``
    pair is keyed by its name only). ``name`` defaults to the diagnostic's
    ``module.qualname`` (required for lambdas); ``version`` defaults to the diagnostic's
    ``version`` attribute or 0: bump it when the diagnostic's meaning changes. Failed
    cells are cached too; ``retry_failed=True`` recomputes them.
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
    cache = _prepare_cache(cache_dir, call)
    if cache is not None and name is None and "<lambda>" in diag_id:
        raise ValueError(
            f"{call}: cannot key the cache by a lambda ({diag_id}); pass name='...' "
            "(and bump version= when it changes) or use a named function"
        )
    ver = version if version is not None else getattr(diagnostic, "version", 0)
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
        rows = None
        if cache is not None:
            path = _cache_path(cache, cell_key(hashable, diag_id, ver))
            rows = _load(path)
            if rows is not None and retry_failed and any(r.get("diverged") for r in rows):
                rows = None
        if rows is None:
            rows = _run_cell(diagnostic, make_arg, call, where)
            if cache is not None:
                _store(
                    path,
                    {
                        "format": _CACHE_FORMAT,
                        "config": _canonical(hashable),
                        "diagnostic": diag_id,
                        "version": str(ver),
                        "rows": rows,
                    },
                )
        for row in rows:
            merged = dict(columns)
            merged.update(row)
            out.append(merged)
    bar.close()
    return _tidy(out)


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
