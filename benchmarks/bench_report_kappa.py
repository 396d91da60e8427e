"""The report's alignment cells alone: what κ costs at the bound the report asks (issue 29).

For each (norm, R) cell of the default ``loopprobe report`` (:class:`ReportConfig`
defaults: d 32, K 2, R 1, 2, 4, 8, DeepNorm and DeepLoop, float32) this runs the cell's
``bound_check`` three ways, one thread, CPU time (``time.process_time``):

- ``tol=1e-4``, the bound the report asked before issue 29's end (one call);
- the report's bound now (:func:`~loopprobe.report.sections_alignment.report_tol`: the
  float32 default 1e-3), cold starts, best of ``--repeats``;
- the same with ``warm_visits=True``, best of ``--repeats``;

and prints κ, its error bound and whether it converged, then the sums over the cells.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_report_kappa.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import torch

import loopprobe
from loopprobe.estimate.bound import bound_check
from loopprobe.report import sections_alignment as sa
from loopprobe.report.config import ReportConfig


def run(model, cfg, tol, warm: bool, repeats: int) -> tuple[float, object]:
    idx, targets = sa._batch(cfg)
    best, chk = float("inf"), None
    for _ in range(repeats):
        with loopprobe.attach(model) as probe:
            t = time.process_time()
            chk = bound_check(probe, idx, sa._lm_loss(targets), lr=cfg.lr,
                              max_iter=cfg.power_iters, tol=tol, warm_visits=warm)  # fmt: skip
            best = min(best, time.process_time() - t)
    return best, chk.report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = ReportConfig()
    print(f"{'norm':>9} {'R':>2}  {'tol 1e-4: s, err, conv':>26}  {'report tol: s, err, conv':>26}"
          f"  {'warm visits: s':>14}")  # fmt: skip
    total = {"1e-4": 0.0, "report": 0.0, "warm": 0.0}
    for norm in cfg.norms:
        for R in cfg.Rs:
            model = sa._gpt(cfg, K=cfg.K, R=R, norm=norm)
            t4, r4 = run(model, cfg, 1e-4, False, 1)
            tr, rr = run(model, cfg, sa.report_tol(model), False, args.repeats)
            tw, _ = run(model, cfg, sa.report_tol(model), True, args.repeats)
            total["1e-4"] += t4
            total["report"] += tr
            total["warm"] += tw
            print(f"{norm:>9} {R:>2}  {t4:8.2f} {r4.kappa_err:8.2g} {r4.converged!s:>8}  "
                  f"{tr:8.2f} {rr.kappa_err:8.2g} {rr.converged!s:>8}  {tw:14.2f}   "
                  f"kappa {r4.kappa:.6f} / {rr.kappa:.6f}", flush=True)  # fmt: skip
    print("sums, CPU-s: " + ", ".join(f"{k} {v:.1f}" for k, v in total.items()))


if __name__ == "__main__":
    main()
