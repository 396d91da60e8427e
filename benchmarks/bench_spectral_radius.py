"""Spectral radius of one round: Arnoldi on JVPs vs the dense Jacobian, in one run.

The round is a LoopedGPT round (K=1, recall="add", outer norm) in float64 at state
dimension n = seq_len * d_model (default 64 * 64 = 4096). The dense twin builds the
n x n Jacobian with ``torch.func.jacrev`` and calls ``torch.linalg.eigvals``; the
library runs ARPACK on a ``LinearOperator`` of JVPs (``lp.spectral_radius``).
Targets (issue 5): >= 20x faster, relative error <= 1e-4. Not a test.

    .venv/bin/python benchmarks/bench_spectral_radius.py [--seq-len 64 --d-model 64 --threads 1]
    .venv/bin/python benchmarks/bench_spectral_radius.py --sizes 8x16,16x32,16x64,64x64

``--parts`` (the same sizes): where the dense path's time goes — the library with and
without its check of the top pairs, the twin, and eigvals / eig / ARPACK on the dense J.

``--sizes`` (issue 29.5, CPU time of one thread, ``time.process_time``): at each size
``seq x d`` the library's default (``method="auto"``: the dense Jacobian from batched JVPs
up to ``DENSE_N`` entries, Arnoldi above), Arnoldi alone (``method="arnoldi"``, the only
path before) and the dense twin (``jacrev`` + ``torch.linalg.eigvals``; skipped above
``--dense-max``), with the relative error of each against the twin.

On a shared machine one thread is the fair setting (two threads that wait on each other on a
loaded box slow small JVPs down many times more than they speed up the dense eigvals).
"""

from __future__ import annotations

import argparse
import time

import torch

import loopprobe as lp
from loopprobe.models import GPTConfig, LoopedGPT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--k", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--sizes", default="", help="seq x d list, e.g. 8x16,16x32 (CPU time)")
    parser.add_argument("--parts", default="", help="seq x d list: where the dense time goes")
    parser.add_argument("--dense-max", type=int, default=1024, help="largest n for the twin")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.sizes:
        return sizes(args)
    if args.parts:
        return parts(args)

    cfg = GPTConfig(vocab_size=64, seq_len=args.seq_len, d_model=args.d_model, n_heads=4,
                    K=1, R=8, recall="add", outer_norm=True)  # fmt: skip
    g = torch.Generator().manual_seed(args.seed)
    model = LoopedGPT(cfg, generator=g).double()
    rm = lp.round_map(model, torch.randint(0, 64, (1, args.seq_len), generator=g))
    h = lp.round_residuals(rm.T, rm.h0, cfg.R).h  # the state the model's own rounds reach
    n = h.numel()
    print(f"state dimension n = {n} (seq_len {args.seq_len} x d_model {args.d_model}), float64, "
          f"{args.threads} thread(s)")  # fmt: skip

    # warm-up of both sides on a tiny map: the first forward-mode JVP in a process loads
    # torch's JVP decompositions (about 1 s) and the first jacrev sets up vmap
    tiny = torch.randn(8, dtype=torch.float64, generator=g)
    lp.spectral_radius(torch.tanh, tiny, k=2)
    torch.linalg.eigvals(torch.func.jacrev(torch.tanh)(tiny))

    start = time.perf_counter()
    sr = lp.spectral_radius(rm.T, h, k=args.k)
    t_arnoldi = time.perf_counter() - start
    print(f"arnoldi: rho = {sr.value:.10f}  converged={sr.converged}  JVPs={sr.iterations}  "
          f"{t_arnoldi:.2f} s")  # fmt: skip

    start = time.perf_counter()
    J = torch.func.jacrev(rm.T)(h).reshape(n, n).detach()
    t_jac = time.perf_counter() - start
    rho = torch.linalg.eigvals(J).abs().max().item()
    t_dense = time.perf_counter() - start
    print(f"dense:   rho = {rho:.10f}  jacrev {t_jac:.2f} s + eigvals {t_dense - t_jac:.2f} s")

    print(f"speed ratio dense / arnoldi = {t_dense / t_arnoldi:.1f}x (target >= 20x)")
    print(f"relative error = {abs(sr.value - rho) / rho:.2e} (target <= 1e-4)")


def state(seq: int, d: int, seed: int = 0):
    cfg = GPTConfig(vocab_size=64, seq_len=seq, d_model=d, n_heads=4, K=1, R=8,
                    recall="add", outer_norm=True)  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    model = LoopedGPT(cfg, generator=g).double()
    rm = lp.round_map(model, torch.randint(0, 64, (1, seq), generator=g))
    return rm.T, lp.round_residuals(rm.T, rm.h0, cfg.R).h


def sizes(args) -> None:
    tiny = torch.randn(8, dtype=torch.float64)  # warm-up: JVP decompositions, vmap
    for method in ("arnoldi", "dense"):
        lp.spectral_radius(torch.tanh, tiny, k=2, method=method)
    torch.linalg.eigvals(torch.func.jacrev(torch.tanh)(tiny))
    print(f"{'n':>5} {'auto s':>7} {'method':>8} {'arnoldi s':>9} {'dense twin s':>12} "
          f"{'auto/twin':>9} {'err auto':>8} {'err arnoldi':>11}")  # fmt: skip
    for item in args.sizes.split(","):
        seq, d = map(int, item.split("x"))
        T, h = state(seq, d, args.seed)
        n = h.numel()
        t = time.process_time()
        auto = lp.spectral_radius(T, h, k=args.k)
        t_auto = time.process_time() - t
        t = time.process_time()
        arn = lp.spectral_radius(T, h, k=args.k, method="arnoldi")
        t_arn = time.process_time() - t
        rho, t_twin = float("nan"), float("nan")
        if n <= args.dense_max:
            t = time.process_time()
            J = torch.func.jacrev(T)(h).reshape(n, n).detach()
            rho = torch.linalg.eigvals(J).abs().max().item()
            t_twin = time.process_time() - t
        ref = rho if rho == rho else arn.value
        print(f"{n:>5} {t_auto:7.2f} {auto.method:>8} {t_arn:9.2f} {t_twin:12.2f} "
              f"{t_auto / t_twin:9.2f} {abs(auto.value - ref) / ref:8.1e} "
              f"{abs(arn.value - ref) / ref:11.1e}", flush=True)  # fmt: skip


def cpu_per_call(fn, repeats: int) -> float:
    """Mean CPU seconds of one call over ``repeats`` calls, after one warm-up call."""
    fn()
    t = time.process_time()
    for _ in range(repeats):
        fn()
    return (time.process_time() - t) / repeats


def parts(args) -> None:
    """Where the dense path's time goes, per size (mean CPU-s of 20 calls at n <= 256, else 3):
    the library (``method="dense"``), the same without its fresh-JVP check of the top pairs
    (replaced by zeros; for this measurement only), the dense twin, and on the twin's J the
    solvers: all eigenvalues, all eigenpairs (``numpy.linalg.eig``), the top pairs by ARPACK."""
    print(f"{'n':>5} {'library':>8} {'no check':>8} {'twin':>8} {'eigvals':>8} "
          f"{'eig+vecs':>8} {'ARPACK':>8}  (CPU-s per call)")  # fmt: skip
    for item in args.parts.split(","):
        seq, d = map(int, item.split("x"))
        T, h = state(seq, d, args.seed)
        times = parts_of(T, h, max(args.k, 2))
        print(f"{h.numel():>5} " + " ".join(f"{t:8.4f}" for t in times), flush=True)


def parts_of(T, h: torch.Tensor, k: int) -> list[float]:
    import numpy as np
    from scipy.sparse.linalg import eigs

    from loopprobe.estimate import fixedpoint

    n = h.numel()
    reps = 20 if n <= 256 else 3
    lib = cpu_per_call(lambda: lp.spectral_radius(T, h, k=k, method="dense"), reps)
    checked = fixedpoint.checked_pairs
    fixedpoint.checked_pairs = lambda jvp, h, vals, vecs, calls: np.zeros(len(vals))
    try:
        bare = cpu_per_call(lambda: lp.spectral_radius(T, h, k=k, method="dense"), reps)
    finally:
        fixedpoint.checked_pairs = checked

    def twin() -> float:
        J = torch.func.jacrev(T)(h).reshape(n, n).detach()
        return torch.linalg.eigvals(J).abs().max().item()

    A = torch.func.jacrev(T)(h).reshape(n, n).detach().numpy()
    v0 = np.ones(n)
    return [
        lib,
        bare,
        cpu_per_call(twin, reps),
        cpu_per_call(lambda: np.linalg.eigvals(A), reps),
        cpu_per_call(lambda: np.linalg.eig(A), reps),
        cpu_per_call(lambda: eigs(A, k=k, which="LM", v0=v0, tol=1e-8), reps),
    ]


if __name__ == "__main__":
    main()
