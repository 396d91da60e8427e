"""What kappa's cross-check costs on the whole graph and on narrowed copies of it.

LoopedGPT (DeepLoop, float32, vocab 256, 64-dim heads, random tokens, cross-entropy, seeded
weights; ``bench_visits.build``), seq 128, batch 8, K 2, one thread, CPU time.

The cross-check (``sensitivity_runs.beaten``) applies each sublayer's operators to each
other's top vectors: every visit to its tied operator's vector (``visits_on_tied``, one row
per visit) and, where the tied operator's own upper end is in use, the tied operator to each
visit's vector (one row per visit). ``sensitivity_runs.cross_norms`` makes these rows on the
whole graph (``groups=None``), or, as ``sensitivity_norms`` calls it, each operator on the
copy of the graph its products need (``groups=_product_groups``; building the copies, and the
whole graph again after them, is inside the timing): a visit's rows from its visit number
on, a tied operator's with its own sublayer's visits alone. Printed per kind of row: the CPU
seconds of both (median of ``--repeats``, alternating, after a warm-up of each), their
ratio, and the largest relative difference of the squared norms. ``--at N``: the model
first trains N AdamW steps (lr 1e-3).

``--what rows``: what one product (a JVP by reverse over reverse and a VJP) costs per row as
a vmapped call carries 1, 4 and 16 rows, on the narrowed copy of each visit number, R-1 down
to 0 (min of 3 after a warm-up): whether fewer rows or fewer calls is what saves, and what a
row costs at each depth.

    nice -n 19 .venv/bin/python benchmarks/bench_kappa_cross.py --R 4,8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_visits as bv  # noqa: E402

from loopprobe.differentiate.jacobian import VisitJacobian  # noqa: E402
from loopprobe.estimate import sensitivity_runs as sr  # noqa: E402
from loopprobe.estimate.sensitivity import _operators  # noqa: E402


def setup(d: int, R: int, at: int):
    model, probe, idx, loss_fn = bv.build(d, max(1, d // 64), 128, 8, 2, R)
    if at:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(at):
            opt.zero_grad(set_to_none=True)
            loss_fn(model(idx), idx).backward()
            opt.step()
    visits = [v for v in probe.visits(idx) if v.grad_visible]
    jac = VisitJacobian(probe, idx, visits)
    jac.vjp_fn()
    sr.forward_probe(jac, 1, "bench")  # as sensitivity_norms does: copies then run reverse
    ops, keys = _operators(visits)
    gen = torch.Generator().manual_seed(0)
    vectors = torch.randn(len(ops), jac.n_max, generator=gen)
    for b, ks in enumerate(ops):
        vectors[b, jac.n[ks[0]] :] = 0
    return jac, visits, ops, keys, vectors


def compare(jac, masks, vectors, pairs, groups, repeats: int) -> tuple[float, float, float]:
    """CPU seconds of the rows ``pairs`` on the whole graph and on copies (medians), and the
    largest relative difference of their squared norms."""
    rows, cols = [b for b, _ in pairs], [c for _, c in pairs]
    out: dict[str, list[float]] = {}

    def whole() -> None:
        out["whole"] = sr.cross_norms(jac, masks, vectors, rows, cols, None, None)

    def copies() -> None:
        out["copies"] = sr.cross_norms(jac, masks, vectors, rows, cols, None, None, groups=groups)
        jac.vjp_fn()  # the whole graph back (released meanwhile): charged here

    times = bv.interleaved({"whole": whole, "copies": copies}, repeats)
    pairs_out = zip(out["whole"], out["copies"], strict=True)
    diff = max(abs(x - y) / abs(x) for x, y in pairs_out)
    return statistics.median(times["whole"]), statistics.median(times["copies"]), diff


def rows(jac, visits, R: int) -> None:
    """CPU ms per row of one product on the copy of each visit number."""
    for r in range(R - 1, -1, -1):
        ks = [k for k, v in enumerate(visits) if v.r == r]
        jac.release()
        sub = jac.restricted(ks)
        for n in (1, 4, 16):
            masks = torch.zeros(n, len(ks))
            masks[torch.arange(n), torch.arange(n) % len(ks)] = 1
            V = torch.randn(n, sub.n_max, generator=torch.Generator().manual_seed(n))

            def product(V=V, masks=masks, sub=sub) -> None:
                sub.rmatvec(sub.matvec(V, masks), masks)

            product()
            t = min(bv.timed(product) for _ in range(3))
            print(f"{R:>3} r={r:<2} {n:>3} rows: {1000 * t:8.1f} ms a call, "
                  f"{1000 * t / n:6.1f} ms a row", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--R", default="4,8", help="R values, comma-separated")
    ap.add_argument("--at", type=int, default=0, help="AdamW steps before")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--what", default="cross", help="cross and/or rows")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if "rows" in args.what:
        for R in map(int, args.R.split(",")):
            jac, visits, *_ = setup(args.d, R, args.at)
            rows(jac, visits, R)
    if "cross" not in args.what:
        return
    print(f"{'d':>4} {'R':>3} {'rows':>16} {'n':>4} {'whole s':>8} {'copies s':>8} "
          f"{'ratio':>6} {'max rel diff':>12}")  # fmt: skip
    for R in map(int, args.R.split(",")):
        jac, visits, ops, keys, vectors = setup(args.d, R, args.at)
        groups = partial(sr._product_groups, visits, ops, narrow=True)
        families = sr.tied_families(keys, visits)
        kinds = {
            "visits on tied": [(b, t) for t, mine in families for b in mine],
            "tied on visits": [(t, b) for t, mine in families for b in mine],
        }
        for kind, pairs in kinds.items():
            a, b, diff = compare(jac, jac.masks(ops), vectors, pairs, groups, args.repeats)
            print(f"{args.d:>4} {R:>3} {kind:>16} {len(pairs):>4} {a:8.3f} {b:8.3f} "
                  f"{b / a:6.2f} {diff:12.1e}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
