"""Probing under DDP and FSDP2 (gloo, world size 2, spawned on 127.0.0.1) equals a
single-process run on the concatenated batch, and leaves training untouched.

One spawn runs every case (tests/_distributed_workers.py); the tests below read its
results. Tolerances (float64): G, U (Lanczos to a Ritz residual of 1e-10, whose value
error is about its square) and kappa to 1e-12 relative, observed ~1e-16; state changes
exactly zero.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from _distributed_workers import BATCH, BUILD, KRYLOV, f64, gpt, lm_loss, run
from _liveness import run_alive, wait_alive

import loopprobe as lp
from loopprobe.cli import build_parser
from loopprobe.cli.kappa import build_report
from loopprobe.distributed import Ranks

pytestmark = pytest.mark.slow  # a two-rank spawn: minutes of CPU

WORLD = 2
CASES = ["gpt", "ckpt", "fsdp2"]


def tails(out: Path) -> str:
    """The last lines each rank wrote to its stderr (its C-level traceback on a crash)."""
    parts = []
    for q in range(WORLD):
        path = out / f"rank{q}.err"
        lines = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
        parts.append(f"rank {q}: " + (" | ".join(lines[-12:]) or "(nothing on stderr)"))
    return "\n".join(parts)


def spawn(fn, out: Path) -> None:
    """Run ``fn(rank, WORLD, out)`` on WORLD processes; kill them all on a hang (the ranks
    used no CPU for two minutes: a slow run on a loaded machine still uses CPU, a deadlock not).
    A rank that dies raises with every rank's stderr in the message."""
    ctx = mp.spawn(fn, args=(WORLD, str(out)), nprocs=WORLD, join=False)
    try:
        wait_alive(
            lambda: ctx.join(timeout=1.0),
            lambda: [p.pid for p in ctx.processes],
            f"the {WORLD} ranks",
        )
    except TimeoutError:
        for p in ctx.processes:
            p.kill()
        raise
    except mp.ProcessExitedException as err:
        raise RuntimeError(f"{err}; the ranks' stderr:\n{tails(out)}") from err


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Every case's results on each rank. A rank killed by a signal (a crash in the transport
    or the C++ runtime, not a failed check: those are exceptions) is rerun once in a fresh
    folder, with a warning that carries the first run's stderr; a second death fails."""
    out = tmp_path_factory.mktemp("dist")
    try:
        spawn(run, out)
    except RuntimeError as err:
        if not isinstance(err.__cause__, mp.ProcessExitedException):
            raise
        warnings.warn(f"distributed test ranks died, rerunning once: {err}", stacklevel=1)
        out = tmp_path_factory.mktemp("dist")
        spawn(run, out)
    return [torch.load(out / f"rank{q}.pt", weights_only=False) for q in range(WORLD)]


def single_process(kind: str, weights: dict) -> lp.results.AlignmentReport:
    model = (gpt if kind == "fsdp2" else BUILD[kind])()
    model.load_state_dict(weights)
    idx = BATCH["gpt" if kind == "fsdp2" else kind]
    return lp.visit_alignment(lp.attach(model), idx, lm_loss, **KRYLOV)


@pytest.fixture(scope="module")
def reference(ranks) -> dict:
    return {kind: single_process(kind, ranks[0][kind]["weights"]) for kind in CASES}


@pytest.mark.parametrize("kind", CASES)
def test_distributed_kappa_and_visit_norms_equal_one_process_on_the_concatenated_batch(
    ranks, reference, kind
):
    ref = reference[kind]
    for res in ranks:
        got = res[kind]["global"]
        assert got["converged"] and ref.converged
        torch.testing.assert_close(got["G"], f64(ref.visits.G_norm), rtol=1e-12, atol=0)
        torch.testing.assert_close(got["U"], f64(ref.visits.U_norm), rtol=1e-12, atol=0)
        want = f64(ref.sublayers.kappa)
        torch.testing.assert_close(got["kappa"], want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("kind", CASES)
def test_the_reduced_tied_update_is_the_single_process_one_and_the_wrappers_averaged_grad(
    ranks, reference, kind
):
    ref = reference[kind].updates
    for res in ranks:
        got = res[kind]
        for j, names in enumerate(got["global"]["params"]):
            torch.testing.assert_close(
                got["global"]["G_tied"][j], ref.tied(j), rtol=1e-12, atol=1e-15
            )
            grad = torch.cat([got["ddp_grad"][n].reshape(-1) for n in names])
            torch.testing.assert_close(got["global"]["G_tied"][j], grad, rtol=1e-12, atol=1e-15)


def test_a_monitor_on_a_ddp_model_reports_the_global_per_visit_updates(ranks):
    for res in ranks:
        got = res["gpt"]
        want = dict(zip(got["global"]["keys"], got["global"]["G"].tolist(), strict=True))
        assert got["monitor_G"].keys() == want.keys()
        for key, value in want.items():
            assert got["monitor_G"][key] == pytest.approx(value, rel=1e-12)


def test_adam_effective_updates_are_preconditioned_with_the_global_tied_gradient(ranks):
    model = BUILD["ckpt"]()
    model.load_state_dict(ranks[0]["ckpt"]["weights"])
    ref = lp.visit_alignment(lp.attach(model), BATCH["ckpt"], lm_loss, update="adam", **KRYLOV)
    for res in ranks:
        got = res["ckpt"]["adam"]
        torch.testing.assert_close(got["G"], f64(ref.visits.G_norm), rtol=1e-12, atol=0)
        torch.testing.assert_close(got["kappa"], f64(ref.sublayers.kappa), rtol=1e-12, atol=0)


def test_per_rank_numbers_differ_from_the_global_ones_so_the_comparison_has_power(ranks):
    # Averaging the ranks' own norms is the bug the reduction avoids: on these shards it is
    # off by far more than the tolerances above.
    for kind in ("gpt", "ckpt"):
        glob = ranks[0][kind]["global"]
        mean = {
            k: (ranks[0][kind]["per_rank"][k] + ranks[1][kind]["per_rank"][k]) / 2
            for k in ("U", "G")
        }
        assert ((mean["U"] - glob["U"]).abs() / glob["U"]).max() > 1e-4
        assert ((mean["G"] - glob["G"]).abs() / glob["G"]).max() > 1e-4


@pytest.mark.parametrize("kind", CASES)
def test_probing_leaves_params_grads_optimizer_state_and_the_next_step_unchanged(ranks, kind):
    for res in ranks:
        assert res[kind]["changed"] == 0.0
        assert res[kind]["vs_twin"] == 0.0


def test_ddp_modes_are_kept_and_unreduced_increments_are_labelled_per_rank(ranks):
    for q, res in enumerate(ranks):
        assert res["gpt"]["mode"] == (True, True)
        assert (
            res["gpt"]["increments_scope"] == f"this rank's shard only (rank {q} of 2; not reduced)"
        )


def test_fsdp1_and_fsdp2_are_refused_with_the_replica_route_and_sharding_is_kept(ranks):
    for res in ranks:
        got = res["fsdp2"]
        assert "FSDP1 (FullyShardedDataParallel)" in got["refusal_fsdp1"]
        assert "full_replica(model, replica)" in got["refusal_fsdp1"]
        assert "FSDP2 fully_shard" in got["refusal"]
        assert "full_replica(model, replica)" in got["refusal"] and "ranks=" in got["refusal"]
        assert got["placements_kept"] and got["still_dtensor"]


def test_ranks_that_visit_a_sublayer_a_different_number_of_times_are_refused_on_every_rank(
    ranks,
):
    for res in ranks:
        assert "the ranks disagree on the number of visits" in res["disagree"]
        assert "max [3]" in res["disagree"] and "min [2]" in res["disagree"]
        assert "max [2, 3]" in res["disagree_lengths"]
        assert "min [2, -1]" in res["disagree_lengths"]


def test_low_memory_updates_are_refused_when_reducing_over_ranks():
    class FakeRanks:
        size = 2

    probe = lp.attach(gpt(), ranks=FakeRanks())
    with pytest.raises(ValueError, match="memory='low'.*cannot be reduced across 2 ranks"):
        lp.per_visit_updates(probe, BATCH["gpt"], lm_loss, memory="low")
    with pytest.raises(ValueError, match="bound_check: not distributed-aware"):
        lp.bound_check(probe, BATCH["gpt"], lm_loss)


def test_the_torchrun_recipe_prints_the_single_process_kappa_report(tmp_path):
    flags = ["--R", "3", "--d-model", "16", "--heads", "2", "--seq", "8", "--batch", "4"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd = [*torchrun, "--nproc-per-node", str(WORLD), "-m", "loopprobe.cli", "ddp-kappa"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    done = run_alive([*cmd, *flags, "--json"], env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)
    want = build_report(build_parser().parse_args(["kappa", *flags, "--threads", "1"]))
    assert got["ranks"] == WORLD and got["global_batch"] == 4
    assert got["kappa"] == pytest.approx(want["kappa"], rel=1e-12)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-12)
    for g, w in zip(got["visits"], want["visits"], strict=True):
        assert g["U_norm"] == pytest.approx(w["U_norm"], rel=1e-12)
        assert g["G_norm"] == pytest.approx(w["G_norm"], rel=1e-12)


def test_ddp_kappa_outside_torchrun_says_how_to_launch_it(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    args = build_parser().parse_args(["ddp-kappa", "--R", "2"])
    with pytest.raises(ValueError, match="launch it with torchrun"):
        args.func(args)


def test_ranks_without_an_initialised_process_group_say_how_to_start_one():
    with pytest.raises(ValueError, match="Ranks: torch.distributed is not initialised"):
        Ranks()


def test_a_plain_model_is_probed_as_itself_and_in_this_process_only():
    model = gpt()
    probe = lp.attach(model)
    assert probe.model is model and probe.ranks is None
