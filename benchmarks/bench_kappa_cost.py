"""Issue 29: what a kappa costs in training steps, before and after, at two error bounds.

LoopedGPT (DeepLoop, float32, vocab 256, 64-dim heads, random tokens, cross-entropy, seeded
weights; ``bench_visits.build``), seq 128, batch 8, K=2, one thread. For each size a fresh
subprocess per case measures one training step (forward + backward + AdamW, the minimum of
3 CPU times after a warm-up) and one ``lp.visit_alignment`` call (CPU time,
``time.process_time``: the machine may be loaded, one thread's CPU time is still the cost),
and prints its operator products (Lanczos iterations summed over the visit and tied
operators) and the iterations of each operator.

Cases: ``before`` is the tree at ``--base`` (a ``git worktree`` of an earlier commit; at
fec01d3, before issue 29, ``tol`` was Lanczos's relative residual, since 7d5b794 it bounds
kappa's error), ``after`` this tree, where ``tol`` bounds kappa's error (``kappa_err`` is
printed). ``--tols``: 1e-6 (the CLI/report default in float64; in float32 the default is
1e-3 and 1e-6 is below the roundoff floor, see ``converged``), 1e-2 (a training
monitor's).

    git worktree add /tmp/perf_base <commit>        # the "before" tree
    nice -n 19 .venv/bin/python benchmarks/bench_kappa_cost.py --d 64 --R 4

``--again`` times the same call a second time in the process (printed as ``later``, in
steps): the first call also pays what a process pays once (torch imports and scripts its
forward-mode decompositions on the first forward-mode product), a monitor's later kappas do
not.

``--floor`` times, in the same process, the same kappa started from the converged top
vectors of the same weights (a kappa to ``tol/100`` made first, untimed; printed as ``floor``
with its products, and in brackets the steps of it the cluster cross-check took:
``visits_on_tied``, ``beaten`` and ``tied_on_visits``, the tied rows the first ``beaten``
reads, made on the tied runs' copies since 5ad746e; the first kappa's cross-check is printed
as ``cross-check``; then the training step's CPU time): what a kappa costs when no start has
to be found, one product per operator plus the fixed work (the cross-check, the copies of
the graph, the forward check, G). The cold kappa's excess over it is the price of finding
the top vectors.

``--repeats N`` alternates the trees N times per case and prints the median steps: on this
2-core machine one run's steps move by 10-25 % with the other core's load, more than a change
of a few products.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

WORKER = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[1] + "/benchmarks")
import bench_visits as bv
import loopprobe as lp
d, R, tol, max_iter = int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
again, floor = sys.argv[6] == "1", sys.argv[7] == "1"
model, probe, idx, loss_fn = bv.build(d, max(1, d // 64), 128, 8, 2, R)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
def step():
    opt.zero_grad(set_to_none=True)
    loss_fn(model(idx), idx).backward()
    opt.step()
step()
times = []
for _ in range(3):
    t = time.process_time(); step(); times.append(time.process_time() - t)
spent = [0.0]
if floor:  # time the cluster cross-check (its functions, where the tree has them)
    import loopprobe.estimate.sensitivity as S
    def timed(f):
        def g(*a, **k):
            t = time.process_time()
            try:
                return f(*a, **k)
            finally:
                spent[0] += time.process_time() - t
        return g
    for name in ("visits_on_tied", "beaten", "tied_on_visits"):
        if hasattr(S, name):
            setattr(S, name, timed(getattr(S, name)))
t = time.process_time()
rep = lp.visit_alignment(probe, idx, loss_fn, max_iter=max_iter, tol=tol)
cpu, cross = time.process_time() - t, spent[0]
later = float("nan")
if again:  # the same call once more: what each later kappa of a process costs
    t = time.process_time()
    lp.visit_alignment(probe, idx, loss_fn, max_iter=max_iter, tol=tol)
    later = time.process_time() - t
floor_cpu, floor_products, floor_cross = float("nan"), 0, float("nan")
if floor:  # from the converged top vectors of the same weights: no start left to find
    ref = lp.visit_alignment(probe, idx, loss_fn, max_iter=max_iter, tol=tol / 100)
    spent[0] = 0.0
    t = time.process_time()
    low = lp.visit_alignment(probe, idx, loss_fn, max_iter=max_iter, tol=tol, start=ref)
    floor_cpu, floor_cross = time.process_time() - t, spent[0]
    floor_products = sum(e.iterations for e in low.sensitivity.visit_norms) + sum(
        e.iterations for e in low.sensitivity.tied_norms.values())
sens = rep.sensitivity
multi = {j for j in sens.tied_norms if sum(v.j == j for v in sens.visits) > 1}
its = [e.iterations for e in sens.visit_norms]
its += [sens.tied_norms[j].iterations for j in sorted(multi)]
print(json.dumps({"step": min(times), "cpu": cpu, "cross": cross, "later": later,
    "products": sum(its),
    "floor": floor_cpu, "floor_products": floor_products, "floor_cross": floor_cross,
    "iterations": its,
    "kappa": rep.kappa, "kappa_err": getattr(rep, "kappa_err", float("nan")),
    "converged": bool(rep.converged)}))
"""


def worker_json(worker: str, tree: str, *args: object) -> Any:
    """Run ``worker`` (Python source) in a fresh process on the library of ``tree``, one
    thread, with ``args`` as its argv; the JSON its last printed line holds."""
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-c", worker, *map(str, args)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tree)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def case(
    tree: str, d: int, R: int, tol: float, max_iter: int, again: bool = False, floor: bool = False
) -> dict:
    return worker_json(WORKER, tree, tree, d, R, tol, max_iter, int(again), int(floor))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", default="64", help="d_model values, comma-separated")
    ap.add_argument("--R", default="4", help="R values, comma-separated")
    ap.add_argument("--base", default="/tmp/perf_base", help="the 'before' tree")
    ap.add_argument("--max-iter", type=int, default=100)
    ap.add_argument("--tols", default="1e-6,1e-2", help="kappa's error bounds, comma-separated")
    ap.add_argument("--cases", default="before,after", help="which trees: before, after")
    ap.add_argument("--repeats", type=int, default=1,
                    help="alternate the trees this many times per case; print each run and "
                    "the median steps")  # fmt: skip
    ap.add_argument("--again", action="store_true",
                    help="time the same kappa a second time in the process too (column "
                    "'later': without the process's one-off costs)")  # fmt: skip
    ap.add_argument("--floor", action="store_true",
                    help="time the same kappa from the converged vectors of the same weights "
                    "too (column 'floor': steps / products)")  # fmt: skip
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    trees = [t for t in [("before", args.base), ("after", ROOT)] if t[0] in args.cases]
    print(f"{'d':>4} {'R':>3} {'case':>12} {'steps':>7} {'products':>8} {'kappa':>9} "
          f"{'kappa_err':>9} conv  iterations per operator (visits, then tied)")  # fmt: skip
    rows = []
    for d in map(int, args.d.split(",")):
        for R in map(int, args.R.split(",")):
            for tol in map(float, args.tols.split(",")):
                runs: dict[str, list[float]] = {label: [] for label, _ in trees}
                for _ in range(args.repeats):  # alternating, so load drifts hit both trees
                    for label, tree in trees:
                        r = case(tree, d, R, tol, args.max_iter, args.again, args.floor)
                        r.update(d=d, R=R, case=f"{label} {tol:g}", steps=r["cpu"] / r["step"])
                        later = r["later"] / r["step"]
                        rows.append(r)
                        runs[label].append(r["steps"])
                        print(
                            f"{d:>4} {R:>3} {r['case']:>12} {r['steps']:7.0f} "
                            f"{r['products']:8d} {r['kappa']:9.6f} {r['kappa_err']:9.2g} "
                            f"{str(r['converged'])[0]:>4}  {r['iterations']}"
                            + (f"  later {later:.0f}" if args.again else "")
                            + (
                                f"  cross-check {r['cross'] / r['step']:.0f}"
                                f"  floor {r['floor'] / r['step']:.0f} / {r['floor_products']}"
                                f" (cross-check {r['floor_cross'] / r['step']:.0f})"
                                f"  step {r['step'] * 1e3:.0f} ms"
                                if args.floor
                                else ""
                            ),
                            flush=True,
                        )
                if args.repeats > 1:
                    text = ", ".join(f"{k} {statistics.median(v):.0f}" for k, v in runs.items())
                    print(f"{d:>4} {R:>3} {tol:g}: median steps over {args.repeats} runs: {text}")
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
