"""The automatic chunk size of the batched operators (loopprobe/_memory.py): the rule, where
the free memory comes from, that an explicit chunk_size wins and that chunks never change
the numbers."""

from __future__ import annotations

import pytest
import torch
from thirdparty_models import SharedBlockModel, make, randn

import loopprobe as lp
from loopprobe import _memory
from loopprobe.differentiate.jacobian import VisitJacobian
from loopprobe.estimate.sensitivity import sensitivity_norms

MiB = 2**20


def test_every_operator_in_one_batch_when_they_fit_else_the_largest_chunk_that_does():
    # 128 MiB floor, half of 64 GiB free: 128 MiB / 10 MiB = 12 operators per chunk.
    assert _memory.chunk_size(8, 10 * MiB, 10 * MiB, 64 * 2**30) is None
    assert _memory.chunk_size(25, 10 * MiB, 10 * MiB, 64 * 2**30) == 12
    # One forward's activations above the floor: 1 GiB / 100 MiB = 10 (not four forwards').
    assert _memory.chunk_size(50, 100 * MiB, 2**30, 64 * 2**30) == 10
    # Half of the free memory caps it: 300 MiB / 100 MiB = 3.
    assert _memory.chunk_size(50, 100 * MiB, 2**30, 600 * MiB) == 3
    # Unknown free memory: the activations or the floor alone.
    assert _memory.chunk_size(50, 10 * MiB, 10 * MiB, None) == 12
    assert _memory.chunk_size(50, 100 * MiB, 2**30, None) == 10


def test_the_chunk_is_never_zero_because_zero_means_no_batching_at_all():
    assert _memory.chunk_size(50, 10 * 2**30, 2**30, 2**30) == 1
    assert _memory.chunk_size(3, 10 * 2**30, 2**30, 0) == 1


def test_free_memory_is_read_from_meminfo_and_lowered_to_a_cgroup_limit(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  8000000 kB\nMemAvailable:    2048 kB\n")
    assert _memory._meminfo_available(str(meminfo)) == 2048 * 1024
    assert _memory._meminfo_available(str(tmp_path / "missing")) is None
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("1000000\n")
    (v2 / "memory.current").write_text("400000\n")
    assert _memory._cgroup_room(str(v2)) == 600000
    (v2 / "memory.max").write_text("max\n")
    assert _memory._cgroup_room(str(v2)) is None
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(str(2**63 - 4096))
    (v1 / "memory.usage_in_bytes").write_text("5")
    assert _memory._cgroup_room(str(tmp_path / "v1")) is None  # v1's "unlimited"
    assert _memory.available_bytes("cpu") > 0
    assert _memory.available_bytes("meta") is None


def test_saved_bytes_counts_activations_once_and_leaves_out_the_parameters():
    w = torch.randn(64, 64, dtype=torch.float64, requires_grad=True)
    x = torch.randn(16, 64, dtype=torch.float64)

    def f(w: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ w)  # saves x (excluded below), w (excluded) and tanh's output
        return (h * h).sum()  # saves h twice: one storage

    assert _memory.saved_bytes(f, w, exclude=[w, x]) == 16 * 64 * 8


def test_auto_chunk_size_shrinks_with_free_memory_and_stays_at_least_one(monkeypatch):
    probe = lp.attach(make(SharedBlockModel, R=3))
    x = randn(2, 6)
    jac = VisitJacobian(probe, x, probe.visits(x))
    jac.vjp_fn()
    assert _memory.auto_chunk_size(jac, 4) is None  # plenty of memory on any machine
    monkeypatch.setattr(_memory, "available_bytes", lambda device: 1)
    assert _memory.auto_chunk_size(jac, 4) == 1


def record_chunks(monkeypatch) -> list:
    seen = []
    matvec = VisitJacobian.matvec

    def spy(self, V, masks, chunk_size=None):
        seen.append(chunk_size)
        return matvec(self, V, masks, chunk_size)

    monkeypatch.setattr(VisitJacobian, "matvec", spy)
    return seen


def test_an_explicit_chunk_size_wins_over_the_automatic_one(monkeypatch):
    monkeypatch.setattr(_memory, "available_bytes", lambda device: 1)  # auto would say 1
    seen = record_chunks(monkeypatch)
    probe = lp.attach(make(SharedBlockModel, R=3))
    sensitivity_norms(probe, randn(2, 6), max_iter=3, tol=0.0, chunk_size=3)
    assert set(seen) == {3}
    seen.clear()
    sensitivity_norms(probe, randn(2, 6), max_iter=3, tol=0.0)
    assert set(seen) == {1}


def test_chunking_never_changes_the_u_norms(monkeypatch):
    probe = lp.attach(make(SharedBlockModel, R=3))
    x = randn(2, 6)
    seen = record_chunks(monkeypatch)
    whole = sensitivity_norms(probe, x, max_iter=25)
    assert set(seen) == {None}  # every operator in one batch
    seen.clear()
    monkeypatch.setattr(_memory, "available_bytes", lambda device: 1)  # forces chunks of 1
    chunked = sensitivity_norms(probe, x, max_iter=25)
    assert set(seen) == {1}
    pairs = [*zip(whole.visit_norms, chunked.visit_norms, strict=True)]
    pairs += [(whole.tied_norms[j], chunked.tied_norms[j]) for j in whole.tied_norms]
    for a, b in pairs:
        assert a.value == pytest.approx(b.value, rel=1e-12, abs=1e-12)
        assert a.iterations == b.iterations


def test_a_forward_plain_autograd_refuses_leaves_the_operators_in_one_batch(monkeypatch):
    probe = lp.attach(make(SharedBlockModel, R=3))
    x = randn(2, 6)
    jac = VisitJacobian(probe, x, probe.visits(x))
    jac.vjp_fn()
    monkeypatch.setattr(_memory, "available_bytes", lambda device: 1)  # would give 1

    def refuse(*args, **kwargs):
        raise RuntimeError("a leaf Variable that requires grad is being used in-place")

    monkeypatch.setattr(_memory, "saved_bytes", refuse)
    assert _memory.auto_chunk_size(jac, 4) is None


def test_saved_bytes_counts_every_saved_output_and_keeps_none_of_them():
    w = torch.randn(64, 64, dtype=torch.float64, requires_grad=True)
    x = torch.randn(16, 64, dtype=torch.float64)
    one = 16 * 64 * 8  # exp saves its output

    def chain(w: torch.Tensor) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64)
        for _ in range(4):  # each output dies before the next (its address may come back)
            total = total + torch.exp(x @ w).sum()
        return total

    # A graph that kept its saved tensors would hold four outputs: four storages.
    assert _memory.saved_bytes(chain, w, exclude=[w, x]) == 4 * one

    def backward(w: torch.Tensor) -> None:
        torch.exp(x @ w).sum().backward()

    with pytest.raises(RuntimeError, match="only measures"):  # nothing was kept to use
        _memory.saved_bytes(backward, w, exclude=[w, x])


def test_a_released_graph_is_rebuilt_without_its_checks_and_gives_the_same_products(
    monkeypatch,
):
    probe = lp.attach(make(SharedBlockModel, R=3))
    x = randn(2, 6)
    jac = VisitJacobian(probe, x, probe.visits(x))
    checks = []
    f0 = VisitJacobian._F0_problems
    monkeypatch.setattr(VisitJacobian, "_F0_problems", lambda s: checks.append(1) or f0(s))
    V = torch.randn(2, jac.n_max, dtype=jac.dtype, generator=torch.Generator().manual_seed(3))
    masks = jac.masks([[0], [0, 1, 2]])
    before = (jac.matvec(V, masks), jac.matvec(V, masks), jac.rmatvec(jac.matvec(V, masks), masks))
    assert len(checks) == 1
    jac.release()
    assert jac._vjp_fn is None and jac._jvp2 is None  # the graphs are gone
    after = (jac.matvec(V, masks), jac.matvec(V, masks), jac.rmatvec(jac.matvec(V, masks), masks))
    assert len(checks) == 1  # rebuilt by one forward, not checked again
    # the first product before was forward mode (the adjointness check); the rest reverse
    # over reverse, as every product after the rebuild
    torch.testing.assert_close(before[0], after[0], rtol=1e-12, atol=1e-12)
    assert torch.equal(before[1], after[1]) and torch.equal(before[2], after[2])


def test_low_memory_forms_every_product_in_forward_mode_and_gives_the_same_norms(monkeypatch):
    probe = lp.attach(make(SharedBlockModel, R=3))
    x = randn(2, 6)
    full = sensitivity_norms(probe, x, max_iter=25)
    seen = []
    jvp_by_vjp = VisitJacobian._jvp_by_vjp
    monkeypatch.setattr(
        VisitJacobian, "_jvp_by_vjp", lambda s, v, m: seen.append(1) or jvp_by_vjp(s, v, m)
    )
    sensitivity_norms(probe, x, max_iter=25)
    assert seen  # the default goes through the backward's graph
    seen.clear()
    low = sensitivity_norms(probe, x, max_iter=25, memory="low")
    assert not seen  # no graph of the backward was built or used
    pairs = [*zip(full.visit_norms, low.visit_norms, strict=True)]
    pairs += [(full.tied_norms[j], low.tied_norms[j]) for j in full.tied_norms]
    for a, b in pairs:
        assert a.value == pytest.approx(b.value, rel=1e-10)
        assert a.converged and b.converged
    with pytest.raises(ValueError, match="memory='small'; choose 'full' or 'low'"):
        sensitivity_norms(probe, x, memory="small")
