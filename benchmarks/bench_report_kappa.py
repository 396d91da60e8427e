"""The report's alignment cells alone: what κ costs at the bound the report asks.

For each (norm, R) cell of the default ``loopprobe report`` (:class:`ReportConfig`
defaults: d 32, K 2, R 1, 2, 4, 8, DeepNorm and DeepLoop, float32; ``--d-model`` for other
widths) this runs the cell's ``bound_check`` at the report's bound
(:func:`~loopprobe.report.sections_alignment.report_tol`: the float32 default 1e-3) three
ways, one thread, CPU time (``time.process_time``), best of ``--repeats``:

- ``grouped``: the operators in groups by visit number (``narrow=True``, κ's default);
- ``one batch``: every operator in one batch, each product over every visit
  (``narrow=False``, what the report's cells use below
  :data:`~loopprobe.report.sections_alignment.NARROW_FROM_D`);
- ``warm``: grouped with ``warm_visits=True``;

and prints per way the CPU-s, the operator products (Lanczos iterations summed over the
visit and tied operators), κ's certified error bound and whether κ converged, then κ of
each way and the sums over the cells. A warm-up cell runs first (imports, first vmap).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_report_kappa.py [--repeats 3]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_report_kappa.py --d-model 64 --R 4,8
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

import loopprobe
from loopprobe.estimate.bound import bound_check
from loopprobe.report import sections_alignment as sa
from loopprobe.report.config import ReportConfig

WAYS = {
    "grouped": {"narrow": True, "warm_visits": False},
    "one batch": {"narrow": False, "warm_visits": False},
    "warm": {"narrow": True, "warm_visits": True},
}


def run(cfg: ReportConfig, norm: str, R: int, kw: dict, repeats: int) -> tuple[float, object]:
    idx, targets = sa._batch(cfg)
    best, rep = float("inf"), None
    for _ in range(repeats):
        model = sa._gpt(cfg, K=cfg.K, R=R, norm=norm)
        with loopprobe.attach(model) as probe:
            t = time.process_time()
            chk = bound_check(probe, idx, sa._lm_loss(targets), lr=cfg.lr,
                              max_iter=cfg.power_iters, tol=sa.report_tol(model), **kw)  # fmt: skip
            best = min(best, time.process_time() - t)
        rep = chk.report
    return best, rep


def products(rep) -> int:
    s = rep.sensitivity
    return sum(e.iterations for e in [*s.visit_norms, *s.tied_norms.values()])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--d-model", type=int, default=ReportConfig.d_model)
    ap.add_argument("--R", default="", help="comma-separated R (default: the report's)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = dataclasses.replace(ReportConfig(), d_model=args.d_model)
    Rs = [int(r) for r in args.R.split(",")] if args.R else list(cfg.Rs)
    run(cfg, cfg.norms[0], 2, {}, 1)  # warm-up: imports, the first vmap
    print(f"d {cfg.d_model}; per way: CPU-s, products, κ error bound, converged")
    total = {w: [0.0, 0] for w in WAYS}
    for norm in cfg.norms:
        for R in Rs:
            line, kappas = f"{norm:>9} R {R:>2}", []
            for way, kw in WAYS.items():
                t, rep = run(cfg, norm, R, kw, args.repeats)
                n = products(rep)
                total[way][0] += t
                total[way][1] += n
                kappas.append(f"{rep.kappa:.7f}")
                line += f" | {way}: {t:6.2f} {n:4d} {rep.kappa_err:7.2g} {rep.converged!s:>5}"
            print(f"{line} | kappa {' / '.join(kappas)}", flush=True)
    sums = ", ".join(f"{w} {t:.2f}, {n}" for w, (t, n) in total.items())
    print(f"sums (CPU-s, products): {sums}")


if __name__ == "__main__":
    main()
