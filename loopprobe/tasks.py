"""Small tasks that need no download, for probing and training tiny looped models.

Every function draws its randomness from the ``generator`` it is given (a CPU
``torch.Generator``) and never touches the global RNG, so the same generator state
gives the same batch. Token tasks return ``(inputs, targets)`` as ``torch.long``.

The tasks are the ones the looped-Transformer papers test on: language modelling
(seed 002, Sec. 5), prefix sums and sudoku (seed 003, fixed-point abstract), modular
arithmetic, and in-context linear regression (looped Transformers as optimizers).
"""

from __future__ import annotations

import functools
import os
import pathlib
import sysconfig

import torch

from loopprobe._checks import count as _check_int

__all__ = [
    "STDLIB_FILES",
    "linear_regression",
    "modular_addition",
    "pointer_chasing",
    "prefix_sums",
    "random_tokens",
    "stdlib_text",
    "sudoku_like",
]

STDLIB_FILES: tuple[str, ...] = (
    "abc", "argparse", "ast", "base64", "bisect", "calendar", "contextlib", "copy",
    "csv", "dataclasses", "difflib", "enum", "fnmatch", "fractions", "functools",
    "heapq", "inspect", "keyword", "linecache", "numbers", "operator", "pprint",
    "queue", "random", "shlex", "statistics", "string", "textwrap", "tokenize", "weakref",
)  # fmt: skip
"""Standard-library modules whose source is the ``stdlib_text`` corpus, in this order.

Each resolves to ``<stdlib>/name.py`` or, where a module became a package in a later
Python, ``<stdlib>/name/__init__.py``; modules missing from an installation are skipped.
"""

_VAL_FRACTION = 0.1  # last 10% of the concatenated bytes is the validation split


# ------------------------------------------------------------------------------ checks


def _check_generator(call: str, generator: object) -> torch.Generator:
    if not isinstance(generator, torch.Generator):
        raise TypeError(
            f"{call}: generator must be a torch.Generator, got {type(generator).__name__}; "
            "pass generator=torch.Generator().manual_seed(0)"
        )
    return generator


# -------------------------------------------------------------------------- LM batches


def random_tokens(
    batch: int, seq_len: int, vocab_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform random token sequences as a next-token LM batch.

    Draws ``x`` of shape ``(batch, seq_len + 1)`` uniformly from ``[0, vocab_size)`` and
    returns ``idx = x[:, :-1]`` and ``targets = x[:, 1:]``, both ``(batch, seq_len)`` long.
    """
    call = "random_tokens"
    _check_int(call, "batch", batch, 1)
    _check_int(call, "seq_len", seq_len, 1)
    _check_int(call, "vocab_size", vocab_size, 1)
    _check_generator(call, generator)
    x = torch.randint(vocab_size, (batch, seq_len + 1), generator=generator)
    return x[:, :-1], x[:, 1:]


def _stdlib_paths() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for name in STDLIB_FILES:
        module, package = os.path.join(root, f"{name}.py"), os.path.join(root, name, "__init__.py")
        for candidate in (module, package):
            if os.path.isfile(candidate):
                paths.append(candidate)
                break
    return paths


@functools.lru_cache(maxsize=1)
def _stdlib_corpus() -> torch.Tensor:
    """The concatenated bytes of ``STDLIB_FILES`` as a uint8 tensor (read once, cached)."""
    paths = _stdlib_paths()
    if not paths:
        raise ValueError(
            f"stdlib_text: none of STDLIB_FILES found under {sysconfig.get_paths()['stdlib']!r}"
        )
    data = b"".join(pathlib.Path(path).read_bytes() for path in paths)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def stdlib_text(
    batch: int, seq_len: int, generator: torch.Generator, split: str = "train"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte-level (vocab 256) windows of Python standard-library source text.

    The corpus is the source of the modules in ``STDLIB_FILES`` read from
    ``sysconfig.get_paths()["stdlib"]``, concatenated in that order and cached in memory;
    its first 90% is ``split="train"``, the last 10% ``split="val"``. Each row is a window
    at a uniformly drawn start ``s`` inside the split: ``idx = bytes[s : s + seq_len]``,
    ``targets = bytes[s + 1 : s + seq_len + 1]``, both ``(batch, seq_len)`` long in
    ``[0, 256)``. The corpus depends on the installed Python version (deterministic for one
    interpreter).
    """
    call = "stdlib_text"
    _check_int(call, "batch", batch, 1)
    _check_int(call, "seq_len", seq_len, 1)
    _check_generator(call, generator)
    if split not in ("train", "val"):
        raise ValueError(f"{call}: split must be 'train' or 'val', got {split!r}")
    data = _stdlib_corpus()
    cut = int(len(data) * (1.0 - _VAL_FRACTION))
    part = data[:cut] if split == "train" else data[cut:]
    n_starts = len(part) - seq_len
    if n_starts < 1:
        raise ValueError(
            f"{call}: seq_len={seq_len} is too long for the {split!r} split "
            f"({len(part)} bytes); use seq_len <= {len(part) - 1}"
        )
    starts = torch.randint(n_starts, (batch, 1), generator=generator)
    window = part[starts + torch.arange(seq_len + 1)].long()  # (batch, seq_len + 1)
    return window[:, :-1], window[:, 1:]


# ----------------------------------------------------------------- algorithmic tasks


def prefix_sums(
    batch: int, seq_len: int, generator: torch.Generator, modulus: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    """Binary inputs with running-sum targets: ``targets[:, t] = sum(inputs[:, :t+1]) % modulus``.

    ``inputs`` are uniform in ``{0, 1}``; ``modulus = 2`` is the running parity. Both
    tensors are ``(batch, seq_len)`` long; vocabulary size ``modulus`` (``>= 2``).
    """
    call = "prefix_sums"
    _check_int(call, "batch", batch, 1)
    _check_int(call, "seq_len", seq_len, 1)
    _check_int(call, "modulus", modulus, 2)
    _check_generator(call, generator)
    inputs = torch.randint(2, (batch, seq_len), generator=generator)
    return inputs, inputs.cumsum(dim=1) % modulus


def modular_addition(
    batch: int, generator: torch.Generator, p: int = 13
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences ``[a, b, =]`` with target ``(a + b) mod p``.

    Token layout (vocabulary ``p + 1``): tokens ``0 .. p-1`` are the residues, token
    ``p`` is ``=``. ``inputs`` is ``(batch, 3)`` long with rows ``[a, b, p]``, ``a`` and
    ``b`` uniform in ``[0, p)``; ``targets`` is ``(batch,)`` long, the answer expected at
    the last position (``logits[:, -1]``).
    """
    call = "modular_addition"
    _check_int(call, "batch", batch, 1)
    _check_int(call, "p", p, 2)
    _check_generator(call, generator)
    ab = torch.randint(p, (batch, 2), generator=generator)
    equals = torch.full((batch, 1), p, dtype=torch.long)
    return torch.cat([ab, equals], dim=1), ab.sum(dim=1) % p


def linear_regression(
    batch: int,
    n_points: int,
    dim: int,
    generator: torch.Generator,
    noise: float = 0.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """In-context linear regression: ``ys = xs @ w + noise * eps`` per task.

    ``xs`` ``(batch, n_points, dim)`` and ``w`` ``(batch, dim)`` are standard normal,
    ``eps`` standard normal; returns ``(xs, ys, w)`` with ``ys`` of shape
    ``(batch, n_points)``, all of ``dtype``.
    """
    call = "linear_regression"
    _check_int(call, "batch", batch, 1)
    _check_int(call, "n_points", n_points, 1)
    _check_int(call, "dim", dim, 1)
    _check_generator(call, generator)
    if not float(noise) >= 0.0:
        raise ValueError(f"{call}: noise must be a number >= 0, got {noise!r}")
    xs = torch.randn(batch, n_points, dim, generator=generator, dtype=dtype)
    w = torch.randn(batch, dim, generator=generator, dtype=dtype)
    ys = torch.einsum("bnd,bd->bn", xs, w)
    if noise > 0:
        ys = ys + noise * torch.randn(batch, n_points, generator=generator, dtype=dtype)
    return xs, ys, w


def _batched_perm(batch: int, n: int, generator: torch.Generator) -> torch.Tensor:
    """``(batch, n)`` independent uniform permutations of ``0 .. n-1``."""
    return torch.rand(batch, n, generator=generator).argsort(dim=1)


def sudoku_like(
    batch: int, generator: torch.Generator, n: int = 4, mask_frac: float = 0.5
) -> tuple[torch.Tensor, torch.Tensor]:
    """Complete a partially masked ``n x n`` Latin square (each symbol once per row/column).

    Each grid is the cyclic square ``L[i, j] = (i + j) mod n`` with its rows, columns and
    symbols permuted at random (so always a valid Latin square, from the isotopy class of
    the cyclic group table). Exactly ``round(mask_frac * n * n)`` cells, chosen uniformly,
    are replaced by the mask token ``n``. Returns ``inputs`` and ``targets`` of shape
    ``(batch, n * n)`` long (row-major flattening); symbols are ``0 .. n-1``, vocabulary
    ``n + 1``, and ``targets`` is the full grid (the mask is ``inputs == n``).
    """
    call = "sudoku_like"
    _check_int(call, "batch", batch, 1)
    _check_int(call, "n", n, 2)
    _check_generator(call, generator)
    if not 0.0 <= float(mask_frac) <= 1.0:
        raise ValueError(f"{call}: mask_frac must lie in [0, 1], got {mask_frac!r}")
    rows, cols, syms = (_batched_perm(batch, n, generator) for _ in range(3))
    base = (rows[:, :, None] + cols[:, None, :]) % n  # (batch, n, n), entries of L[rows, cols]
    grid = syms.gather(1, base.reshape(batch, -1))  # relabel symbols: (batch, n*n)
    n_masked = round(float(mask_frac) * n * n)
    masked = _batched_perm(batch, n * n, generator)[:, :n_masked]
    inputs = grid.scatter(1, masked, n)
    return inputs, grid


def pointer_chasing(
    batch: int, generator: torch.Generator, m: int = 8, hops: int = 3
) -> tuple[torch.Tensor, torch.Tensor]:
    """k-hop pointer chasing: ``m`` pair tokens of a random permutation ``f``, a query ``q``;
    target ``f^hops(q)``.

    Each row draws a uniform permutation ``f`` of ``0 .. m-1`` and writes it as ``m`` pair
    tokens ``a * m + f(a)`` in a uniformly shuffled order (so position carries nothing), then
    the query token ``m * m + q`` with ``q`` uniform. Vocabulary ``m * m + m``; ``inputs`` is
    ``(batch, m + 1)`` long; ``targets`` is ``(batch,)`` long in ``[0, m)``, the answer expected
    at the last position (``logits[:, -1]``). One attention read at the query follows one
    pointer, so ``hops`` reads need ``hops`` sequential layers (or loops); at small ``m`` a
    single layer can instead look the answer up from the whole permutation (at ``m = 6`` one
    block reaches 80 % on 2 hops: docs/studies/lr_l.md).
    """
    call = "pointer_chasing"
    _check_int(call, "batch", batch, 1)
    _check_int(call, "m", m, 2)
    _check_int(call, "hops", hops, 1)
    _check_generator(call, generator)
    f = _batched_perm(batch, m, generator)  # f[b, a]
    order = _batched_perm(batch, m, generator)  # the symbol written at each pair position
    pairs = order * m + f.gather(1, order)
    q = torch.randint(m, (batch, 1), generator=generator)
    x = q
    for _ in range(hops):
        x = f.gather(1, x)
    return torch.cat([pairs, m * m + q], dim=1), x[:, 0]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of ``(B, T, V)`` logits against ``(B, T)`` targets."""
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    )
