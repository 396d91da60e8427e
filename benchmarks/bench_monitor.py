"""Overhead of lp.Monitor per training step at a realistic cadence (issue 13).

LoopedGPT small (K=2, R=4, d_model 64, 4 heads, pre-norm with 1/N residual scaling, float32),
AdamW on 16 x 64-token batches; the monitor watches a held-out 4 x 64 probe batch. Timed
in one run, in this process's CPU time (``time.process_time``; ``--clock wall`` for wall
time), one thread, interleaved (a block of plain training steps, then one monitor call of
each kind, repeated), medians over the repeats:

- a plain training step (forward, backward, ``optimizer.step()``);
- one ``monitor.step`` with the default diagnostics (``updates``, ``increments``), alone,
  with a TensorBoard sink writing scalars only, and with scalars plus the two heat-map
  images (``heatmap_every=1``; the default, 10, draws them on every 10th call), and the opt-in
  ``kappa`` (+ ``sensitivity``) and ``rho`` (one call each: they are long), and
  ``bound_check`` given the kappa report (what ``bound`` adds to ``kappa``);

and prints the overhead per training step, ``cost of one call / (k * plain step)``, at
``every=k``: the default diagnostics at k = 50, the others at k = 500. A last check runs
``--steps`` training steps with and without the monitor (default diagnostics, every 50),
interleaved in blocks of 50 steps, and prints the measured ratio of the two loops.

    .venv/bin/python benchmarks/bench_monitor.py [--repeats 3] [--steps 200] [--clock wall]

About 90 s on one core.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

import loopprobe as lp
from loopprobe.monitor.monitor import Monitor

CLOCK = {"cpu": time.process_time, "wall": time.perf_counter}
clock = CLOCK["cpu"]
CFG = lp.models.GPTConfig(
    vocab_size=256, seq_len=64, d_model=64, n_heads=4, K=2, R=4, norm="pre", residual="1/N"
)


def setup():
    model = lp.models.LoopedGPT(CFG, generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1)
    probe, probe_tgt = lp.tasks.random_tokens(
        4, 64, 256, generator=torch.Generator().manual_seed(2)
    )

    def train_step() -> float:
        idx, tgt = lp.tasks.random_tokens(16, 64, 256, generator=data)
        opt.zero_grad()
        loss = F.cross_entropy(model(idx).flatten(0, 1), tgt.flatten())
        loss.backward()
        opt.step()
        return loss.item()

    def loss_fn(out: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), probe_tgt.flatten())

    return model, opt, probe, loss_fn, train_step


def timed(fn, n: int = 1) -> float:
    t = clock()
    for _ in range(n):
        fn()
    return (clock() - t) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--clock", choices=list(CLOCK), default="cpu")
    args = ap.parse_args()
    global clock
    clock = CLOCK[args.clock]
    torch.set_num_threads(1)
    model, opt, probe, loss_fn, train_step = setup()
    tb = tempfile.TemporaryDirectory()
    try:
        from loopprobe.monitor.sinks import TensorBoardSink

        TensorBoardSink(f"{tb.name}/probe").close()
    except ImportError:
        TensorBoardSink = None  # noqa: N806
    cheap = {"default (updates, increments)": []}
    if TensorBoardSink is not None:
        cheap["default + TensorBoard scalars"] = [
            TensorBoardSink(f"{tb.name}/a", heatmap_every=10**9)
        ]
        cheap["default + TB scalars + heat maps"] = [
            TensorBoardSink(f"{tb.name}/b", heatmap_every=1)
        ]
    monitors = {
        name: Monitor(model, probe, loss_fn, every=1, sinks=sinks) for name, sinks in cheap.items()
    }
    counter = iter(range(10**9))
    for _ in range(5):
        train_step()  # warm-up (and an optimizer state)
    for mon in monitors.values():
        mon.step(next(counter))  # warm-up: discovery, first-call costs
    step_t, cost = [], {name: [] for name in monitors}
    for _ in range(args.repeats):
        step_t.append(timed(train_step, 20))
        for name, mon in monitors.items():
            cost[name].append(timed(lambda mon=mon: mon.step(next(counter))))
    # the opt-in diagnostics: one call each (each is hundreds of training steps long)
    for name, diags in [("kappa (+ U, G)", ["kappa"]), ("rho (Arnoldi, k=2)", ["rho"])]:
        mon = Monitor(model, probe, loss_fn, diagnostics=diags, every=1)
        cost[name] = [timed(lambda mon=mon: mon.step(next(counter)))]
    with lp.attach(model) as p:
        rep = lp.visit_alignment(p, probe, loss_fn, max_iter=2)  # bound's cost needs no converged U
        cost["bound (given the kappa report)"] = [
            timed(lambda: lp.bound_check(p, probe, loss_fn, report=rep))
        ]
    plain = statistics.median(step_t)
    print(
        f"torch {torch.__version__}, 1 thread, {args.clock} time, median of {args.repeats} "
        f"interleaved repeats (opt-in diagnostics: one call); LoopedGPT K=2 R=4 d_model 64, "
        f"train batch 16x64, probe 4x64"
    )
    if TensorBoardSink is None:
        print("tensorboard is not installed: the TensorBoard row is skipped")
    print(f"plain training step: {plain * 1e3:.1f} ms")
    print(f"{'diagnostics':32} {'one call':>10} {'x step':>8} {'every':>6} {'overhead/step':>14}")
    for name, ts in cost.items():
        c = statistics.median(ts)
        k = 50 if name.startswith("default") else 500
        print(f"{name:32} {c:>9.3f}s {c / plain:>8.1f} {k:>6} {c / (k * plain):>13.1%}")
    for mon in monitors.values():
        mon.close()
    tb.cleanup()
    # end to end: plain and monitored training interleaved in blocks of 50 steps (so load
    # on the machine hits both alike); each monitored block starts with one monitor call
    plain_run, watched_run = setup(), setup()
    mon = Monitor(watched_run[0], watched_run[2], watched_run[3], every=50)
    t_plain = t_watched = 0.0
    for block in range(args.steps // 50):
        t_plain += timed(lambda: [plain_run[4]() for _ in range(50)])

        def watched(block: int = block) -> None:
            for s in range(block * 50, (block + 1) * 50):
                mon.step(s, loss=watched_run[4]())

        t_watched += timed(watched)
    print(
        f"end to end, {args.steps // 50 * 50} steps in interleaved blocks of 50, default "
        f"diagnostics every 50 (the first call includes discovery): {t_watched / t_plain:.3f}x "
        f"the plain loop ({t_plain:.1f}s vs {t_watched:.1f}s)"
    )


if __name__ == "__main__":
    main()
