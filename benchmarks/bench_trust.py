"""What the self-checks of issue 24 cost, each against the call it guards, in one run.

On the reference LoopedGPT (DeepLoop, float32, random tokens, cross-entropy), one thread,
this process's CPU time, variants timed round-robin after a warm-up, medians of per-repeat
ratios (see benchmarks/README.md). Not a test.

1. ``sum_r G = tied gradient`` (always on in ``per_visit_updates``): G against one plain
   forward + backward, full and low-memory. The check has no switch, so the ratio is
   compared with the same ratio at a baseline checkout (``--baseline DIR``, e.g. a
   ``git worktree`` of the commit before the checks), run in a subprocess of this script.
2. the F(0) check (one plain forward per ``VisitJacobian``) against a default
   ``sensitivity_norms`` call.
3. the stale-parameter check (``Probe._current``, run at every probe call) against one
   no-grad forward.
4. the replay check of ``replay_round`` (one call of the module with round r's recorded
   arguments) against ``spectral_radius`` of the replayed map.

    .venv/bin/python benchmarks/bench_trust.py [--repeats 5] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from bench_visits import CLOCK, interleaved, median_ratio  # the same timing harness

G_SIZES = [(32, 4, 16, 4, 2, 8), (64, 4, 32, 8, 2, 8)]  # d, heads, seq, batch, K, R


def build(d: int, heads: int, T: int, B: int, K: int, R: int):
    import loopprobe as lp

    cfg = lp.models.GPTConfig(
        vocab_size=64, seq_len=T, d_model=d, n_heads=heads, K=K, R=R, norm="deeploop"
    )
    model = lp.models.LoopedGPT(cfg, generator=torch.Generator().manual_seed(0))
    idx, tg = lp.tasks.random_tokens(B, T, 64, torch.Generator().manual_seed(1))

    def loss_fn(out: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out.reshape(-1, 64), tg.reshape(-1))

    return model, lp.attach(model), idx, loss_fn


def g_ratios(repeats: int) -> list[dict]:
    """Section 1 at this checkout: G full / low against a plain forward + backward."""
    return [g_ratio(size, repeats) for size in G_SIZES]


def g_ratio(size: tuple, repeats: int) -> dict:
    import loopprobe as lp

    model, probe, idx, loss_fn = build(*size)
    params = [p for p in model.parameters() if p.requires_grad]
    fns = {
        "plain": lambda: torch.autograd.grad(loss_fn(model(idx), idx), params),
        "full": lambda: lp.per_visit_updates(probe, idx, loss_fn),
        "low": lambda: lp.per_visit_updates(probe, idx, loss_fn, memory="low"),
    }
    t = interleaved(fns, repeats)
    return {
        "size": size,
        "full_x": median_ratio(t["full"], t["plain"]),
        "low_x": median_ratio(t["low"], t["plain"]),
    }


def no_grad_forwards(model: torch.nn.Module, idx: torch.Tensor, n: int) -> None:
    with torch.no_grad():
        for _ in range(n):
            model(idx)


def section_checks(repeats: int) -> None:
    import loopprobe as lp
    from loopprobe.differentiate.jacobian import VisitJacobian

    model, probe, idx, loss_fn = build(32, 4, 16, 4, 2, 4)
    visits = probe.visits(idx)
    jac = VisitJacobian(probe, idx, visits)
    jac.vjp_fn()  # F0 is computed here; the check below is what it adds
    t = interleaved(
        {
            "f0": jac._F0_problems,
            "sens": lambda: lp.sensitivity_norms(probe, idx),
            "current": lambda: [probe._current() for _ in range(100)],
            "forward": lambda: no_grad_forwards(model, idx, 10),
        },
        repeats,
    )
    f0, sens = statistics.median(t["f0"]), statistics.median(t["sens"])
    cur, fwd = statistics.median(t["current"]) / 100, statistics.median(t["forward"]) / 10
    print(f"2. F(0) check {1e3 * f0:.1f} ms vs sensitivity_norms {sens:.2f} s: {f0 / sens:.2%}")
    print(
        f"3. stale-parameter check {1e6 * cur:.0f} us vs one forward {1e3 * fwd:.1f} ms: "
        f"{cur / fwd:.2%}"
    )

    class Looped(torch.nn.Module):  # a third-party loop: one encoder layer, six rounds
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.TransformerEncoderLayer(32, 4, 64, 0.0, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(6):
                x = self.layer(x)
            return x

    torch.manual_seed(0)
    loop = Looped().double().eval()
    x = torch.randn(2, 8, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    rm = lp.replay_round(loop, x, "layer")
    t = interleaved(
        {
            "build": lambda: lp.replay_round(loop, x, "layer"),
            "call": lambda: rm.step(rm.h0, rm.x),  # the one extra call the check makes
            "rho": lambda: lp.spectral_radius(rm.step, rm.h0, x=rm.x),
        },
        repeats,
    )
    b, c, r = (statistics.median(t[k]) for k in ("build", "call", "rho"))
    print(
        f"4. replay check: one module call {1e3 * c:.2f} ms (replay_round {1e3 * b:.1f} ms in "
        f"all) vs spectral_radius {r:.2f} s: {c / r:.2%}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--baseline", help="a checkout to measure section 1 at, for comparison")
    ap.add_argument("--g-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    CLOCK.update(fn=time.process_time, name="CPU")  # one thread: CPU time ignores other load
    if args.g_only:  # the baseline's subprocess
        print(json.dumps(g_ratios(args.repeats)))
        return
    print(f"one thread, CPU time, {args.repeats} repeats")
    here = g_ratios(args.repeats)
    base = None
    if args.baseline:
        env = dict(os.environ, PYTHONPATH=os.path.abspath(args.baseline))
        cmd = [sys.executable, __file__, "--g-only", "--repeats", str(args.repeats)]
        res = subprocess.run(cmd, env=env, cwd=args.baseline, capture_output=True, text=True)
        if res.returncode != 0:
            raise SystemExit(f"baseline run failed: {res.stderr.strip().splitlines()[-1]}")
        base = json.loads(res.stdout.strip().splitlines()[-1])
    print("1. per-visit G (with the sum check) vs one plain forward+backward, K=2, R=8")
    for k, r in enumerate(here):
        d, _, T, B = r["size"][:4]
        line = f"   d {d} seq {T} batch {B}: full {r['full_x']:.2f}x, low {r['low_x']:.2f}x"
        if base is not None:
            line += f" (baseline {base[k]['full_x']:.2f}x, {base[k]['low_x']:.2f}x)"
        print(line)
    section_checks(args.repeats)


if __name__ == "__main__":
    main()
