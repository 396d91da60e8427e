"""Every figure of the README's "What a measurement costs" table, by one command.

One thread (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``), CPU time
(``time.process_time``: the machine may be loaded, one thread's CPU time is still the cost),
LoopedGPT float32 (``bench_visits.build``: vocab 256, 64-dim heads, random tokens,
cross-entropy, seeded weights), seq 128, batch 8, K 2. Each row runs in a fresh subprocess
of this tree:

* ``G``: all per-visit G (``per_visit_updates``) over one training step (forward +
  backward + AdamW; the minimum of 3 CPU times after a warm-up, as for every row), at
  d 256 and 512 x R 4 and 8.
* ``kappa``: one ``visit_alignment`` call (the worker of ``bench_kappa_cost.py``), in
  training steps and in operator products (Lanczos iterations summed over the visit and
  tied operators), at error <= 1e-3 (the float32 default) and <= 1e-2 (a monitor's), at
  d 64 and 256 x R 4, d 256 R 8 and d 512 R 4.
* ``spectral_radius`` n 512 (seq 8 x d 64) against dense ``jacrev`` + ``eigvals``, CPU-s
  (``bench_spectral_radius.py --sizes 8x64``).
* the default ``loopprobe report``: CPU-s per section and the process total
  (``bench_report.run_tree`` on this tree alone).
* ``warm``: a monitor's kappa from the previous kappa's vectors against a cold one, d 64 R 4,
  after 300 AdamW steps (``bench_kappa_warm.py --at 300``).
* ``memory``: kappa's peak memory at d 256 R 4 over a first AdamW step's, by default and with
  ``memory="low"`` (``bench_kappa_memory.py --what auto,low``).

The README's "before" column came from the commits the issues measured; to set a before
and an after side by side in one run use ``bench_kappa_cost.py --base`` and
``bench_report.py --baseline`` with a copy of the older tree. ``--quick``: d 64 only for
kappa, d 256 R 4 for G, no d 512 (minutes instead of an hour on one loaded core).

    nice -n 19 .venv/bin/python benchmarks/cost_table.py [--quick] [--rows G,kappa,warm,memory]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import bench_kappa_cost  # noqa: E402
import bench_report  # noqa: E402

G_WORKER = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[1] + "/benchmarks")
import bench_visits as bv
from loopprobe.estimate.updates import per_visit_updates
d, R = int(sys.argv[2]), int(sys.argv[3])
model, probe, idx, loss_fn = bv.build(d, max(1, d // 64), 128, 8, 2, R)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
def step():
    opt.zero_grad(set_to_none=True)
    loss_fn(model(idx), idx).backward()
    opt.step()
def G():
    per_visit_updates(probe, idx, loss_fn)
def best(fn):
    fn()
    times = []
    for _ in range(3):
        t = time.process_time(); fn(); times.append(time.process_time() - t)
    return min(times)
s, g = best(step), best(G)
print(json.dumps({"step": s, "G": g, "steps": g / s}))
"""


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def g_row(d: int, R: int) -> dict:
    argv = [sys.executable, "-c", G_WORKER, ROOT, str(d), str(R)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=_env(), cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def sr_row() -> str:
    argv = [sys.executable, os.path.join(HERE, "bench_spectral_radius.py"), "--sizes", "8x64"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=_env(), cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return proc.stdout.strip()


def script_row(name: str, *args: str) -> str:
    argv = [sys.executable, os.path.join(HERE, name), *args]
    proc = subprocess.run(argv, capture_output=True, text=True, env=_env(), cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return proc.stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the small sizes only")
    ap.add_argument("--rows", default="G,kappa,sr,report,warm,memory", help="which rows")
    ap.add_argument("--max-iter", type=int, default=100)
    args = ap.parse_args()
    rows = set(args.rows.split(","))
    if "G" in rows:
        sizes = [(256, 4)] if args.quick else [(256, 4), (256, 8), (512, 4), (512, 8)]
        print("all per-visit G over one training step (CPU time, one thread)")
        for d, R in sizes:
            r = g_row(d, R)
            print(f"  d {d:>3} R {R}: {r['steps']:.2f} steps (G {r['G']:.2f} s, step "
                  f"{r['step']:.2f} s)", flush=True)  # fmt: skip
    if "kappa" in rows:
        sizes = [(64, 4)] if args.quick else [(64, 4), (256, 4), (256, 8), (512, 4)]
        print("kappa (visit_alignment): training steps and operator products")
        print(f"  {'d':>4} {'R':>2} {'error <=':>8} {'steps':>6} {'products':>8} "
              f"{'kappa_err':>9} conv")  # fmt: skip
        for d, R in sizes:
            for tol in (1e-3, 1e-2):
                r = bench_kappa_cost.case(ROOT, d, R, tol, args.max_iter)
                print(f"  {d:>4} {R:>2} {tol:>8g} {r['cpu'] / r['step']:6.0f} "
                      f"{r['products']:8d} {r['kappa_err']:9.2g} {str(r['converged'])[0]:>4}",
                      flush=True)  # fmt: skip
    if "sr" in rows:
        print("spectral_radius, n 512 (CPU-s; bench_spectral_radius.py --sizes 8x64)")
        print("  " + sr_row().replace("\n", "\n  "), flush=True)
    if "warm" in rows:
        print("a monitor's kappa from the previous kappa's vectors (bench_kappa_warm.py)")
        print("  " + script_row("bench_kappa_warm.py", "--at", "300").replace("\n", "\n  "))
    if "memory" in rows:
        print("kappa's peak memory (bench_kappa_memory.py)")
        out = script_row("bench_kappa_memory.py", "--d", "256", "--R", "4", "--what", "auto,low")
        print("  " + out.replace("\n", "\n  "), flush=True)
    if "report" in rows:
        r = bench_report.run_tree(ROOT, "")
        print("the default loopprobe report (CPU-s, one thread)")
        print(f"  import {r['import']:.2f}")
        for key, cpu in r["sections"].items():
            print(f"  {key:<16}{cpu:8.2f}")
        print(f"  total (process) {r['total']:.2f}")


if __name__ == "__main__":
    main()
