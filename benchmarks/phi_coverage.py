"""Coverage of the phi CI on the paper's grid (issue 27, item 6a): is a 95 % CI 95 %?

Runs drawn from the planted paper law (loopprobe.experiments.scaling_grid) with per-run noise
and per-(budget, r) cell noise, each fitted and bootstrapped; prints the fraction of CIs that
contain the planted phi. One thread on a shared CPU, 200 resamples: about 4-7 s per dataset
(cells, boot_restarts 0), 9 s (wild) and 18 s (cells, boot_restarts 2, the default).

    OMP_NUM_THREADS=1 python benchmarks/phi_coverage.py --datasets 20 --method cells
    OMP_NUM_THREADS=1 python benchmarks/phi_coverage.py --datasets 20 --method wild
"""

import argparse
import json

from loopprobe._threads import blas_threads
from loopprobe.experiments.scaling_grid import coverage


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datasets", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0, help="first dataset seed")
    ap.add_argument("--noise", type=float, default=0.010, help="per-run noise (nats)")
    ap.add_argument("--cell-noise", type=float, default=0.010, help="per-cell noise (nats)")
    ap.add_argument("--bootstrap", type=int, default=200)
    ap.add_argument("--boot-restarts", type=int, default=2)
    ap.add_argument("--informed", type=int, default=0, help="data-informed starts per refit")
    ap.add_argument("--method", choices=["cells", "wild"], default="cells")
    ap.add_argument("--level", type=float, default=0.95)
    ap.add_argument("--csv", default=None, help="write the per-dataset table here")
    a = ap.parse_args()
    with blas_threads(1):
        out = coverage(
            a.datasets, noise=a.noise, cell_noise=a.cell_noise, bootstrap=a.bootstrap,
            boot_restarts=a.boot_restarts, method=a.method, informed=a.informed,
            level=a.level, seed=a.seed,
        )  # fmt: skip
    if a.csv:
        out.to_csv(a.csv, index=False)
    k = int(out.covered.sum())
    print(json.dumps({"method": a.method, "boot_restarts": a.boot_restarts,
                      "informed": a.informed,
                      "noise": a.noise, "cell_noise": a.cell_noise, "level": a.level,
                      "covered": k, "datasets": len(out), "coverage": k / len(out),
                      "median_width": float(out.width.median()),
                      "median_abs_err": float((out.phi_hat - 0.459).abs().median()),
                      "seconds": float(out.seconds.sum())}))  # fmt: skip


if __name__ == "__main__":
    main()
