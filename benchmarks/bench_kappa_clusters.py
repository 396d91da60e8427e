"""How often kappa comes back converged with an interval that misses the exact kappa, on
models whose operators have a cluster of nearly equal top singular values.

The family of ``tests/test_kappa_err.py``'s cluster test, widened: small steps
``x + eps W x`` (eps 1e-6, d 8, float64), as ``lp.models.LinearLoop`` and as a plain module
written the way third-party code is, R in {2, 3, 4, 5, 6, 8}, three seeds each (36 models).
Each visit ``U_r`` then has d top singular values split by ~1e-6 relative, the width of
the float64 default bound: a Krylov run can settle inside the cluster and certify a lower
member (the caveat of :func:`loopprobe.linalg.norm_bounds`), which only the cluster
safeguards can catch (the cross-check ``repair_tops``, and the second start of a largest
visit whose top is seen to be clustered, ``sensitivity_clusters``). The exact kappa comes
from dense Jacobians of an untied twin. A stopping rule that stops earlier saves products
and gives that cross-check less to see: run a candidate against ``--base`` (a ``git
worktree`` of the tree before it) with cold and with warm starts (``warm_visits``, the default from
``WARM_VISITS_N`` parameters on, which these small models are below).

    git worktree add /tmp/base HEAD
    nice -n 19 .venv/bin/python benchmarks/bench_kappa_clusters.py --base /tmp/base
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
import json, sys
import torch
import loopprobe as lp
torch.set_num_threads(1)
warm = sys.argv[1] == "warm"
sys.path.insert(0, sys.argv[2] + "/tests")  # this tree's family and oracle, any tree's library
from _small_steps import exact_small_step_kappa, family_member

rows = []
for R in (2, 3, 4, 5, 6, 8):
    for kind in ("lp", "plain"):
        for seed in (0, 1, 2):
            model, x, y = family_member(R, kind, seed)
            exact = exact_small_step_kappa(model, x, y, R)
            rep = lp.visit_alignment(
                lp.attach(model), x, lambda out, inp: 0.5 * (out - y).pow(2).sum(),
                method="lanczos", max_iter=30, warm_visits=warm)
            s = rep.sensitivity
            its = sum(e.iterations for e in s.visit_norms)
            its += sum(e.iterations for e in s.tied_norms.values())
            inside = bool(rep.kappa_lo <= exact <= rep.kappa_hi)
            rows.append({"R": R, "kind": kind, "seed": seed, "converged": bool(rep.converged),
                         "inside": inside, "products": its,
                         "miss": max(rep.kappa_lo - exact, exact - rep.kappa_hi, 0.0)})
print(json.dumps(rows))
"""


def run(tree: str, mode: str) -> list[dict]:
    return worker_json(WORKER, tree, mode, ROOT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="/tmp/base", help="the 'before' tree")
    ap.add_argument("--cases", default="before,after", help="which trees: before, after")
    ap.add_argument("--modes", default="cold,warm", help="start modes: cold, warm")
    args = ap.parse_args()
    trees = [t for t in [("before", args.base), ("after", ROOT)] if t[0] in args.cases]
    print(f"{'case':>7} {'starts':>6} {'wrong and converged':>20} {'converged':>9} "
          f"{'products':>8}  wrong (R, kind, seed: how far outside)")  # fmt: skip
    for label, tree in trees:
        for mode in args.modes.split(","):
            rows = run(tree, mode)
            wrong = [r for r in rows if r["converged"] and not r["inside"]]
            conv = sum(r["converged"] for r in rows)
            text = ", ".join(f"{r['R']} {r['kind']} {r['seed']}: {r['miss']:.1e}" for r in wrong)
            print(f"{label:>7} {mode:>6} {len(wrong):>13} of {len(rows):<4} {conv:>9} "
                  f"{sum(r['products'] for r in rows):>8}  {text}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
