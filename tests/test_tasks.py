"""Download-free tasks: shapes, dtypes, determinism, and targets checked independently."""

import itertools
import pathlib
import sysconfig

import pytest
import torch

from loopprobe import tasks


def gen(seed):
    return torch.Generator().manual_seed(seed)


CALLS = {
    "random_tokens": lambda g: tasks.random_tokens(4, 9, 11, generator=g),
    "stdlib_text": lambda g: tasks.stdlib_text(4, 32, generator=g),
    "prefix_sums": lambda g: tasks.prefix_sums(4, 20, generator=g),
    "modular_addition": lambda g: tasks.modular_addition(16, generator=g),
    "linear_regression": lambda g: tasks.linear_regression(4, 6, 3, generator=g),
    "sudoku_like": lambda g: tasks.sudoku_like(4, generator=g),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_same_generator_seed_gives_identical_batches_and_other_seed_differs(name):
    a, b, c = CALLS[name](gen(0)), CALLS[name](gen(0)), CALLS[name](gen(1))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, z) for x, z in zip(a, c, strict=True))


@pytest.mark.parametrize("name", sorted(CALLS))
def test_tasks_do_not_touch_the_global_rng(name):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    CALLS[name](gen(0))
    assert torch.equal(torch.rand(3), expected)


def test_random_tokens_are_a_shifted_lm_batch_in_vocab():
    idx, targets = tasks.random_tokens(3, 8, 5, generator=gen(0))
    assert idx.shape == targets.shape == (3, 8)
    assert idx.dtype == targets.dtype == torch.long
    assert torch.equal(idx[:, 1:], targets[:, :-1])
    assert 0 <= int(idx.min()) and int(idx.max()) < 5


def test_stdlib_text_windows_are_slices_of_real_stdlib_files():
    idx, targets = tasks.stdlib_text(8, 64, generator=gen(3))
    assert idx.shape == targets.shape == (8, 64) and idx.dtype == torch.long
    assert torch.equal(idx[:, 1:], targets[:, :-1])
    assert 0 <= int(idx.min()) and int(idx.max()) < 256
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    sources = [p.read_bytes() for p in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py"))]
    # a window lies in one file or spans two consecutive ones; most lie in one
    inside = sum(any(bytes(row.tolist()) in src for src in sources) for row in idx)
    assert inside >= 6
    corpus = bytes(tasks._stdlib_corpus().tolist())
    assert all(
        bytes(row.tolist() + [int(t[-1])]) in corpus for row, t in zip(idx, targets, strict=True)
    )


def test_stdlib_text_corpus_is_the_listed_files_concatenated_in_order():
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    first = root / f"{tasks.STDLIB_FILES[0]}.py"
    corpus = tasks._stdlib_corpus()
    head = first.read_bytes()
    assert bytes(corpus[: len(head)].tolist()) == head
    assert len(corpus) > 100_000


def test_stdlib_text_train_and_val_splits_come_from_disjoint_positions():
    corpus = bytes(tasks._stdlib_corpus().tolist())
    cut = int(len(corpus) * 0.9)
    val, _ = tasks.stdlib_text(16, 128, generator=gen(0), split="val")
    for row in val:
        assert bytes(row.tolist()) in corpus[cut:]
    train, _ = tasks.stdlib_text(16, 128, generator=gen(0), split="train")
    for row in train:
        assert bytes(row.tolist()) in corpus[:cut]


def test_prefix_sums_targets_are_the_running_parity_computed_by_a_loop():
    inputs, targets = tasks.prefix_sums(5, 17, generator=gen(0))
    assert inputs.shape == targets.shape == (5, 17) and targets.dtype == torch.long
    assert set(inputs.unique().tolist()) <= {0, 1}
    for row, trow in zip(inputs.tolist(), targets.tolist(), strict=True):
        parity = 0
        for x, t in zip(row, trow, strict=True):
            parity ^= x
            assert t == parity


def test_prefix_sums_with_modulus_five_matches_python_sums():
    inputs, targets = tasks.prefix_sums(3, 30, generator=gen(1), modulus=5)
    for row, trow in zip(inputs.tolist(), targets.tolist(), strict=True):
        assert trow == [sum(row[: t + 1]) % 5 for t in range(len(row))]
    assert int(targets.max()) < 5


def test_modular_addition_layout_is_a_b_equals_and_target_is_the_sum_mod_p():
    p = 7
    inputs, targets = tasks.modular_addition(50, generator=gen(0), p=p)
    assert inputs.shape == (50, 3) and targets.shape == (50,)
    assert inputs.dtype == targets.dtype == torch.long
    assert torch.all(inputs[:, 2] == p)
    assert int(inputs[:, :2].max()) < p
    for (a, b, _), t in zip(inputs.tolist(), targets.tolist(), strict=True):
        assert t == (a + b) % p


def test_linear_regression_without_noise_is_exactly_x_w():
    xs, ys, w = tasks.linear_regression(3, 10, 4, generator=gen(0), dtype=torch.float64)
    assert xs.shape == (3, 10, 4) and ys.shape == (3, 10) and w.shape == (3, 4)
    assert xs.dtype == ys.dtype == w.dtype == torch.float64
    for b in range(3):
        assert torch.allclose(ys[b], xs[b] @ w[b], rtol=0, atol=1e-12)


def test_linear_regression_noise_has_roughly_the_requested_scale():
    xs, ys, w = tasks.linear_regression(64, 64, 4, generator=gen(0), noise=0.5)
    residual = ys - torch.einsum("bnd,bd->bn", xs, w)
    assert 0.45 < float(residual.std()) < 0.55


@pytest.mark.parametrize("n", [2, 3, 4, 5, 9])
def test_every_sudoku_like_target_is_a_latin_square_and_inputs_agree_off_the_mask(n):
    inputs, targets = tasks.sudoku_like(32, generator=gen(n), n=n)
    assert inputs.shape == targets.shape == (32, n * n) and inputs.dtype == torch.long
    symbols = set(range(n))
    for grid in targets.view(32, n, n).tolist():
        assert all(set(row) == symbols for row in grid)
        assert all(set(col) == symbols for col in zip(*grid, strict=True))
    masked = inputs == n
    assert torch.all(masked.sum(dim=1) == round(0.5 * n * n))
    assert torch.equal(inputs[~masked], targets[~masked])


def test_sudoku_like_draws_more_than_one_distinct_square():
    _, targets = tasks.sudoku_like(64, generator=gen(0), n=4)
    assert len({tuple(t) for t in targets.tolist()}) > 10


def test_sudoku_like_mask_fraction_zero_and_one():
    inputs, targets = tasks.sudoku_like(2, generator=gen(0), n=3, mask_frac=0.0)
    assert torch.equal(inputs, targets)
    inputs, _ = tasks.sudoku_like(2, generator=gen(0), n=3, mask_frac=1.0)
    assert torch.all(inputs == 3)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: tasks.random_tokens(0, 4, 4, generator=gen(0)), r"random_tokens: batch .* got 0"),
        (lambda: tasks.prefix_sums(2, 4, generator=gen(0), modulus=1), r"modulus .* >= 2"),
        (lambda: tasks.stdlib_text(2, 4, generator=gen(0), split="test"), r"'train' or 'val'"),
        (lambda: tasks.stdlib_text(1, 10**8, generator=gen(0)), r"seq_len=100000000 is too"),
        (lambda: tasks.sudoku_like(2, generator=gen(0), mask_frac=1.5), r"mask_frac .* 1.5"),
        (lambda: tasks.linear_regression(2, 2, 2, generator=gen(0), noise=-1), r"noise"),
        (lambda: tasks.modular_addition(2, generator=gen(0), p=1), r"p must be .* got 1"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_call_and_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_a_missing_generator_is_a_type_error_that_says_how_to_make_one():
    expected = r"prefix_sums: generator must be a torch.Generator, got int; .*manual_seed"
    with pytest.raises(TypeError, match=expected):
        tasks.prefix_sums(2, 4, generator=0)


def test_permutation_helper_yields_every_permutation_of_three():
    perms = tasks._batched_perm(600, 3, gen(0)).tolist()
    assert {tuple(p) for p in perms} == set(itertools.permutations(range(3)))
