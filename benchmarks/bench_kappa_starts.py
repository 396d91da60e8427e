"""Where kappa's warm visits start: how close the neighbour's and the line's vectors are.

LoopedGPT (DeepLoop, float32, vocab 256, 64-dim heads, random tokens, cross-entropy, seeded
weights; ``bench_visits.build``), seq 128, batch 8, K 2, one thread.

``geometry``: one kappa to error <= 1e-4, whose top right singular vectors stand in for the
exact ones; for each sublayer and visit r, ``1 - |cos|`` between visit r's vector and the
start ``warm_visits`` would give it from the visits after it: the neighbour's ``v_{r+1}``
(the start before the line) and the line ``2 v_{r+1} - v_{r+2}`` (signs aligned), median
over the visits that have both.

``noise``: kappa at error <= ``--tol`` with the random part of the warm visits' starts
(``sensitivity_starts.VISIT_NOISE``) set to each value asked; printed: the mean Lanczos
iterations of the warm visits (every visit but the last, which starts cold) and the products.

``spectrum``: why the cold last visits take 10-19 Lanczos iterations: the top singular values
of each sublayer's last visit (``scipy.sparse.linalg.svds`` on ``lp.sensitivity_operators``),
next to the iterations a kappa at error <= ``--tol`` spent on it. Close top values (a ratio
sigma_2 / sigma_1 near 1) slow a Krylov run's residual, which the certificate needs, far more
than its value.

``batch``: the last visits started from the top vectors of the same operators on the first
``b`` sequences of the batch (``lp.sensitivity_norms`` on them, Lanczos to a residual of 0.1;
its products printed too, each a row of ``b``/8 of a full one's batch), the rest of kappa as
usual; printed: ``|cos|`` of those starts to the full batch's converged vectors and kappa's
products against a cold kappa's. The start is given through the start function kappa calls
(patched here).

    nice -n 19 .venv/bin/python benchmarks/bench_kappa_starts.py --d 64 --R 4,8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_visits as bv  # noqa: E402

import loopprobe as lp  # noqa: E402
from loopprobe.estimate import sensitivity_starts  # noqa: E402


def model(d: int, R: int):
    return bv.build(d, max(1, d // 64), 128, 8, 2, R)


def one_minus_cos(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return 1 - float((a @ b).abs() / (a.norm() * b.norm()))


def geometry(d: int, R: int) -> None:
    _, probe, idx, loss_fn = model(d, R)
    sens = lp.visit_alignment(probe, idx, loss_fn, tol=1e-4).sensitivity
    vec = sens.start_vectors()
    by: dict[str, dict[int, torch.Tensor]] = {}
    for v in sens.visits:
        by.setdefault(v.sublayer, {})[v.r] = vec[("visit", v.i)]
    for name, vs in by.items():
        near, line = [], []
        for r in range(R - 2):
            one, two = vs[r + 1], vs[r + 2]
            two = two * torch.sign((two * one).sum())
            near.append(one_minus_cos(vs[r], one))
            line.append(one_minus_cos(vs[r], 2 * one - two))
        mid = f"neighbour {statistics.median(near):8.1e}  line {statistics.median(line):8.1e}"
        print(f"{d:>4} {R:>3} {name:>16}  {mid}  (r = 0: {near[0]:.1e}, {line[0]:.1e})")


def noise(d: int, R: int, tol: float, values: list[float]) -> None:
    _, probe, idx, loss_fn = model(d, R)
    kept = sensitivity_starts.VISIT_NOISE
    try:
        for value in values:
            sensitivity_starts.VISIT_NOISE = value
            sens = lp.visit_alignment(probe, idx, loss_fn, tol=tol).sensitivity
            warm = [e.iterations for v, e in zip(sens.visits, sens.visit_norms, strict=True)
                    if v.r < R - 1]  # fmt: skip
            products = sum(e.iterations for e in sens.visit_norms)
            products += sum(e.iterations for e in sens.tied_norms.values())
            print(f"{d:>4} {R:>3} tol {tol:g} noise {value:g}: warm visits "
                  f"{statistics.mean(warm):.2f} iterations, {products} products")  # fmt: skip
    finally:
        sensitivity_starts.VISIT_NOISE = kept


def spectrum(d: int, R: int, tol: float) -> None:
    import numpy as np
    from scipy.sparse.linalg import svds

    _, probe, idx, loss_fn = model(d, R)
    sens = lp.visit_alignment(probe, idx, loss_fn, tol=tol).sensitivity
    ops = lp.sensitivity_operators(probe, idx)
    for v, e in zip(sens.visits, sens.visit_norms, strict=True):
        if v.r != R - 1:
            continue
        top = np.sort(svds(ops[(v.sublayer, v.r)], k=4, tol=1e-6, return_singular_vectors=False))
        top = top[::-1]
        print(
            f"{d:>4} {R:>3} {v.sublayer:>16} r {v.r}: top values "
            + " ".join(f"{x:.5f}" for x in top)
            + f"  sigma_2/sigma_1 {top[1] / top[0]:.4f}  iterations {e.iterations}"
        )


def batch(d: int, R: int, tol: float, sizes: list[int]) -> None:
    from loopprobe.estimate import sensitivity

    _, probe, idx, loss_fn = model(d, R)

    def products(sens) -> int:
        return sum(e.iterations for e in (*sens.visit_norms, *sens.tied_norms.values()))

    cold = lp.visit_alignment(probe, idx, loss_fn, tol=tol).sensitivity
    ref = cold.start_vectors()

    def last_iterations(sens) -> list[int]:
        pairs = zip(sens.visits, sens.visit_norms, strict=True)
        return [e.iterations for v, e in pairs if v.r == R - 1]

    last = sorted(("visit", v.i) for v in cold.visits if v.r == R - 1)
    print(
        f"{d:>4} {R:>3} tol {tol:g} cold: {products(cold)} products, the last visits "
        f"{last_iterations(cold)}"
    )
    kept = sensitivity._start
    for b in sizes:
        part = lp.sensitivity_norms(probe, idx[:b], tol=0.1, method="lanczos")
        sub = part.start_vectors()

        def start(jac, ops, keys, gen, given, call, sub=sub):
            v0 = kept(jac, ops, keys, gen, given, call)
            for q, key in enumerate(keys):
                if key in last:
                    v0[q] = 0
                    v0[q, : sub[key].numel()] = sub[key].to(v0.dtype)
            return v0

        sensitivity._start = start
        try:
            warm = lp.visit_alignment(probe, idx, loss_fn, tol=tol).sensitivity
        finally:
            sensitivity._start = kept
        cos = [one_minus_cos(sub[k], ref[k]) for k in last]
        its = last_iterations(warm)
        print(
            f"{d:>4} {R:>3} tol {tol:g} first {b} of 8 sequences: |cos| to the converged "
            f"{[round(1 - c, 3) for c in cos]} (after {products(part)} products there); kappa "
            f"{products(warm)} products, the last visits {its}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", default="64", help="d_model values, comma-separated")
    ap.add_argument("--R", default="4,8", help="R values, comma-separated")
    ap.add_argument("--tol", type=float, default=1e-2, help="kappa's error bound (noise)")
    ap.add_argument("--noise", default="0.1,0.01,0.001", help="VISIT_NOISE values")
    ap.add_argument("--what", default="geometry,noise", help="geometry, noise, spectrum, batch")
    ap.add_argument("--batch", default="1,2,4", help="sequences for --what batch")
    args = ap.parse_args()
    torch.set_num_threads(1)
    values = [float(x) for x in args.noise.split(",")]
    for d in map(int, args.d.split(",")):
        for R in map(int, args.R.split(",")):
            if "geometry" in args.what:
                geometry(d, R)
            if "noise" in args.what:
                noise(d, R, args.tol, values)
            if "spectrum" in args.what:
                spectrum(d, R, args.tol)
            if "batch" in args.what:
                batch(d, R, args.tol, [int(b) for b in args.batch.split(",")])


if __name__ == "__main__":
    main()
