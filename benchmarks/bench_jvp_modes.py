"""Issue 29.3: the forward half of a U product by three routes, per call, at equal results.

LoopedGPT (DeepLoop, float32, ``bench_visits.build``), seq 128, batch 8, K=2, R=4, one
thread, CPU time (``time.process_time``), the minimum over interleaved repeats. The batch
is the 2K tied operators (every visit carries a tangent: the widest product). Routes for
``U v`` (one call = all operators of the batch):

- ``jvp``: what :meth:`VisitJacobian.matvec` does, ``torch.vmap`` over ``torch.func.jvp``
  (forward-mode dual tensors through the whole forward, every call);
- ``linearize``: ``torch.func.linearize`` traced once per operator run (what a Lanczos
  run of one group could reuse across its iterations), then the linear function vmapped;
  its trace is reported apart (``trace``);
- ``vjp-of-vjp``: reverse over reverse, ``torch.func.vjp`` of the existing VJP function
  at a zero cotangent, built once (``trace``), then vmapped (the backward of a backward).

Each route's result is compared with ``jvp``'s (max relative difference), and the VJP
``U^T u`` (the other half of every Lanczos step) is timed as the unit.

    nice -n 19 .venv/bin/python benchmarks/bench_jvp_modes.py --d 64,256 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.func import linearize, vjp, vmap

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_visits as bv  # noqa: E402

import loopprobe as lp  # noqa: E402
from loopprobe.differentiate.jacobian import VisitJacobian  # noqa: E402


def routes(d: int, R: int, T: int, B: int):
    model, probe, idx, _ = bv.build(d, max(1, d // 64), T, B, 2, R)
    visits = [v for v in probe.visits(idx) if v.grad_visible]
    jac = VisitJacobian(probe, idx, visits)
    jac.vjp_fn()
    js = sorted({v.j for v in visits})
    masks = jac.masks([[k for k, v in enumerate(visits) if v.j == j] for j in js])
    g = torch.Generator().manual_seed(0)
    V = torch.randn(len(js), jac.n_max, generator=g).to(jac.dtype)
    U = torch.randn(len(js), jac.F0.numel(), generator=g).to(jac.dtype)

    def tangents(v, mask):
        return tuple(jac.unflatten(k, mask[k] * v[: jac.n[k]]) for k in range(len(jac.n)))

    state: dict = {}

    def trace_linearize():
        with torch.no_grad():
            state["lin"] = linearize(jac.f, *jac.primals)[1]

    def by_linearize():
        with torch.no_grad():
            return vmap(lambda v, m: state["lin"](*tangents(v, m)), randomness="same")(V, masks)

    def trace_vjp2():
        zero = torch.zeros_like(jac.F0)
        with torch.no_grad():
            state["vjp2"] = vjp(jac.vjp_fn(), zero)[1]

    def by_vjp2():
        with torch.no_grad():
            return vmap(lambda v, m: state["vjp2"](tangents(v, m))[0], randomness="same")(V, masks)

    return {
        "jvp": (None, lambda: jac.matvec(V, masks)),
        "linearize": (trace_linearize, by_linearize),
        "vjp-of-vjp": (trace_vjp2, by_vjp2),
        "vjp (unit)": (None, lambda: jac.rmatvec(U, masks)),
    }


def cpu(fn) -> float:
    t = time.process_time()
    fn()
    return time.process_time() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", default="64,256")
    ap.add_argument("--R", type=int, default=4)
    ap.add_argument("--T", type=int, default=128)
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'d':>4} {'route':>11} {'trace s':>8} {'per call s':>10} {'x jvp':>6} {'x vjp':>6} "
          "max rel diff vs jvp")  # fmt: skip
    for d in map(int, args.d.split(",")):
        rs = routes(d, args.R, args.T, args.B)
        traces = {k: cpu(tr) if tr else 0.0 for k, (tr, _) in rs.items()}
        ref = rs["jvp"][1]()
        diff = {}
        for k, (_, fn) in rs.items():
            out = fn()
            if k != "vjp (unit)":
                diff[k] = float((out - ref).abs().max() / ref.abs().max())
        best = {k: float("inf") for k in rs}
        for _ in range(args.repeats):  # interleaved
            for k, (_, fn) in rs.items():
                best[k] = min(best[k], cpu(fn))
        for k in rs:
            print(
                f"{d:>4} {k:>11} {traces[k]:8.2f} {best[k]:10.3f} "
                f"{best[k] / best['jvp']:6.2f} {best[k] / best['vjp (unit)']:6.2f} "
                f"{diff.get(k, float('nan')):.1e}",
                flush=True,
            )
    _ = lp


if __name__ == "__main__":
    main()
