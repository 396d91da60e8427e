"""kappa's peak memory against one training step's, before and after, at the sizes asked.

LoopedGPT (DeepLoop, float32, vocab 256, 64-dim heads, random tokens, cross-entropy, seeded
weights; ``bench_visits.build``), seq 128, batch 8, K 2, one thread. Each row runs in a
fresh subprocess, so one measurement's high-water mark cannot hide another's:

* ``step``: the first AdamW training step of the model (forward, backward, the optimizer's
  state and update): the unit;
* ``kappa``: one ``lp.visit_alignment`` call at error <= ``--tol`` (default 1e-2, a
  monitor's) with the automatic chunk size; ``--what`` adds ``low`` (``memory="low"``:
  forward-mode products) or given chunk sizes (integers).

Peak: the process's peak resident set (``ru_maxrss``) above its resident set just before the
call (``/proc/self/statm``), MiB; CPU time of the call (``time.process_time``). ``--base``: an
older tree measured in the same run ("before"; e.g. ``git worktree add /tmp/mem_base
<commit>``).

    nice -n 19 .venv/bin/python benchmarks/bench_kappa_memory.py --d 256 --R 4
    nice -n 19 .venv/bin/python benchmarks/bench_kappa_memory.py --d 256 --R 4 --what auto,low
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from bench_kappa_cost import worker_json  # noqa: E402

WORKER = r"""
import json, resource, sys, time
import torch
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[1] + "/benchmarks")
import bench_visits as bv
import loopprobe as lp
d, R, tol, what = int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
model, probe, idx, loss_fn = bv.build(d, max(1, d // 64), 128, 8, 2, R)
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
base, cpu = rss(), time.process_time()
if what == "step":
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss_fn(model(idx), idx).backward()
    opt.step()
    out = {}
else:
    kw = {"auto": {}, "low": {"memory": "low"}}.get(what)
    kw = {"chunk_size": int(what)} if kw is None else kw
    rep = lp.visit_alignment(probe, idx, loss_fn, tol=tol, **kw)
    out = {"kappa": rep.kappa, "kappa_err": rep.kappa_err, "converged": bool(rep.converged)}
cpu = time.process_time() - cpu
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
print(json.dumps({"peak": peak / 2**20, "cpu": cpu, **out}))
"""


def case(tree: str, d: int, R: int, tol: float, what: str) -> dict:
    return worker_json(WORKER, tree, tree, d, R, tol, what)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", default="256", help="d_model values, comma-separated")
    ap.add_argument("--R", default="4", help="R values, comma-separated")
    ap.add_argument("--tol", type=float, default=1e-2, help="kappa's error bound")
    ap.add_argument("--what", default="auto", help="auto, low and/or chunk sizes (integers)")
    ap.add_argument("--base", help="an older tree, measured in the same run as 'before'")
    args = ap.parse_args()
    trees = [("after", ROOT)] + ([("before", args.base)] if args.base else [])
    print(f"{'d':>4} {'R':>2} {'tree':>6} {'what':>9} {'peak MiB':>9} {'x step':>7} "
          f"{'CPU s':>7} kappa")  # fmt: skip
    for d in [int(x) for x in args.d.split(",")]:
        for R in [int(x) for x in args.R.split(",")]:
            step = case(ROOT, d, R, args.tol, "step")
            print(f"{d:>4} {R:>2} {'':>6} {'step':>9} {step['peak']:9.0f} {1:7.2f} "
                  f"{step['cpu']:7.1f}", flush=True)  # fmt: skip
            for name, tree in trees:
                for what in args.what.split(","):
                    r = case(tree, d, R, args.tol, what)
                    label = {"auto": "kappa", "low": "low"}.get(what, f"chunk {what}")
                    print(f"{d:>4} {R:>2} {name:>6} {label:>9} {r['peak']:9.0f} "
                          f"{r['peak'] / step['peak']:7.2f} {r['cpu']:7.1f} {r['kappa']:.6f} "
                          f"+- {r['kappa_err']:.1g} {'converged' if r['converged'] else 'NOT'}",
                          flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
