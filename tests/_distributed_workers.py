"""What each rank runs in tests/test_distributed.py (gloo on 127.0.0.1, spawned processes).

Every case trains one step (so ``.grad`` and the optimizer state are not trivial), probes,
checks that nothing changed, then trains one more step next to an identical twin that was
never probed. Results go to ``out/rank{q}.pt``; the parent compares them with a
single-process run on the concatenated batch.
"""

from __future__ import annotations

import copy
import faulthandler
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as Fn
from realmodels import LoopedEncoder, seeded_build
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import loopprobe as lp
from loopprobe.distributed import Ranks, full_replica
from loopprobe.models import GPTConfig, LoopedGPT

KRYLOV = {"method": "lanczos", "max_iter": 60}


def lm_loss(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of the shard (DDP's mean of means = the global mean)."""
    flat = logits[:, :-1].reshape(-1, logits.shape[-1])
    return Fn.cross_entropy(flat, idx[:, 1:].reshape(-1))


def gpt() -> nn.Module:
    cfg = GPTConfig(vocab_size=16, seq_len=8, d_model=16, n_heads=2, K=2, R=3)
    return LoopedGPT(cfg, generator=torch.Generator().manual_seed(0)).double()


def encoder() -> nn.Module:
    """A plain-torch looped model, one TransformerEncoderLayer, checkpointed every round."""
    return seeded_build(lambda: LoopedEncoder(vocab=16, R=3, checkpointing="non_reentrant"))


BUILD: dict[str, Callable[[], nn.Module]] = {"gpt": gpt, "ckpt": encoder}
BATCH = {
    "gpt": torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(1)),
    "ckpt": torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(2)),
}


def f64(column) -> torch.Tensor:
    """A frame column as float64 (``torch.tensor`` of Python floats would give float32)."""
    return torch.tensor(list(column), dtype=torch.float64)


def summary(rep: lp.AlignmentReport, probe: lp.Probe) -> dict:
    """The numbers compared across runs, as plain tensors."""
    names = {id(p): n for n, p in probe.model.named_parameters()}
    return {
        "kappa": f64(rep.sublayers.kappa),
        "U": f64(rep.visits.U_norm),
        "G": f64(rep.visits.G_norm),
        "keys": list(zip(rep.visits.sublayer, rep.visits.r, strict=True)),
        "G_tied": [rep.updates.tied(j) for j in range(len(rep.updates.sublayers))],
        "params": [[names[id(p)] for p in g.params] for g in probe.groups()],
        "converged": rep.converged,
    }


def state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor training reads: parameters (local shards), .grad, optimizer state."""
    out = []
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        out.append(local.detach().clone())
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        out.append(g.detach().clone())
    for s in opt.state.values():
        out += [t.clone() for t in s.values() if isinstance(t, torch.Tensor)]
    return out


def largest_change(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    lm_loss(model(x), x).backward()
    opt.step()


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """``.grad`` of every parameter as the training wrapper left it (DDP: the mean over
    ranks; FSDP2: the reduce-scattered shard, gathered here)."""
    out = {}
    for n, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[n.removeprefix("module.")] = g.detach().clone()
    return out


def ddp_case(kind: str, rank: int, world: int) -> dict:
    model, twin = BUILD[kind](), BUILD[kind]()
    ddp, ddp_twin = DDP(model), DDP(twin)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    opt_twin = torch.optim.SGD(ddp_twin.parameters(), lr=0.1, momentum=0.9)
    x = BATCH[kind].chunk(world)[rank]
    train_step(ddp, opt, x)
    train_step(ddp_twin, opt_twin, x)
    weights = copy.deepcopy(model.state_dict())
    before = state(model, opt)
    probe = lp.attach(ddp)
    rep = lp.visit_alignment(probe, x, lm_loss, **KRYLOV)
    per_rank = lp.visit_alignment(lp.attach(model), x, lm_loss, **KRYLOV)
    out = {"weights": weights, "changed": largest_change(state(model, opt), before)}
    out |= {"global": summary(rep, probe), "per_rank": summary(per_rank, probe)}
    out["increments_scope"] = lp.increments(probe, x).attrs["scope"]
    if kind == "gpt":  # the monitor probes through the same Probe: its G rows are global
        rows = lp.Monitor(ddp, x, lm_loss, diagnostics=("updates",), every=1).step(0)
        G = rows[rows.quantity == "G_norm"]
        keys = zip(G.sublayer, G.visit, strict=True)
        out["monitor_G"] = dict(zip(keys, G.value, strict=True))
    if kind == "ckpt":  # Adam's preconditioner needs the global tied gradient
        out["adam"] = summary(lp.visit_alignment(probe, x, lm_loss, update="adam", **KRYLOV), probe)
    train_step(ddp, opt, x)
    out["ddp_grad"] = full_grads(ddp)
    train_step(ddp_twin, opt_twin, x)
    out["vs_twin"] = largest_change(state(model, opt), state(twin, opt_twin))
    out["mode"] = (model.training, ddp.training)
    return out


def fsdp2_case(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))

    def sharded() -> nn.Module:
        m = gpt()
        for block in m.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(m, mesh=mesh)

    model, twin = sharded(), sharded()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt_twin = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    x = BATCH["gpt"].chunk(world)[rank]
    train_step(model, opt, x)
    train_step(twin, opt_twin, x)
    before = state(model, opt)
    placements = [str(p.placements) for p in model.parameters()]
    out: dict = {}
    try:
        lp.attach(model)
    except TypeError as err:
        out["refusal"] = str(err)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    try:
        lp.attach(FSDP1(gpt(), device_id=torch.device("cpu")))
    except TypeError as err:
        out["refusal_fsdp1"] = str(err)
    # The replica route the refusals name.
    replica = full_replica(model, gpt())
    out["weights"] = copy.deepcopy(replica.state_dict())
    probe = lp.attach(replica, ranks=Ranks())
    out["global"] = summary(lp.visit_alignment(probe, x, lm_loss, **KRYLOV), probe)
    out["changed"] = largest_change(state(model, opt), before)
    out["placements_kept"] = placements == [str(p.placements) for p in model.parameters()]
    out["still_dtensor"] = all(hasattr(p, "to_local") for p in model.parameters())
    train_step(model, opt, x)
    out["ddp_grad"] = full_grads(model)
    train_step(twin, opt_twin, x)
    out["vs_twin"] = largest_change(state(model, opt), state(twin, opt_twin))
    return out


def disagreeing_visits(rank: int, world: int) -> str:
    """Ranks whose forwards visit a sublayer a different number of times (as ACT halting
    would) have no global per-visit G: the probe must say so on every rank, not hang."""
    model = seeded_build(lambda: LoopedEncoder(vocab=16, R=2 + rank))
    x = BATCH["ckpt"].chunk(world)[rank]
    try:
        lp.per_visit_updates(lp.attach(model, ranks=Ranks()), x, lm_loss)
    except ValueError as err:
        return str(err)
    return "no error"


def disagreeing_lengths(rank: int) -> str:
    """Ranks that found a different number of sublayers: refused on every rank (a reduction
    of unequal lengths would hang)."""
    try:
        Ranks().agree([2] if rank == 0 else [2, 3], "the visits", "call")
    except ValueError as err:
        return str(err)
    return "no error"


def run(rank: int, world: int, out: str) -> None:
    """One rank: its stderr (with a C-level traceback on a crash) goes to ``out/rank{q}.err``,
    which the parent shows if the rank dies; the process group meets through a file in ``out``
    (no TCP port to race for) and gloo talks over the loopback device only."""
    err = open(os.path.join(out, f"rank{rank}.err"), "w")  # noqa: SIM115 (lives as the process)
    os.dup2(err.fileno(), 2)
    faulthandler.enable(err)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    url = "file://" + os.path.join(out, "store")
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world)
    try:
        res = {kind: ddp_case(kind, rank, world) for kind in BUILD}
        res["fsdp2"] = fsdp2_case(rank, world)
        res["disagree"] = disagreeing_visits(rank, world)
        res["disagree_lengths"] = disagreeing_lengths(rank)
        torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
