"""Iterations to converge and operator work of the kappa estimators (issues 11.2 and 18.2).

Default (issue 11.2), per scheme (DeepLoop, DeepNorm): LoopedGPT K=2, R=4, d 16, seq 16,
batch 4, float64, one thread; ``visit_alignment`` with power iteration and with Lanczos
(the default), both with ``max_iter=100`` and the default tolerance (1e-10 in float64).
Prints, per method, whether every estimate converged, the max and mean iterations over
the 20 operators, the CPU time and kappa_R.

``--work`` (issue 18.2): the work of the U norms behind kappa on LoopedGPT DeepLoop K=2
(``--d 32 --R 8 --seq 16 --batch 4`` by default), float64, one thread, in units of one
forward+backward (fb) of the same model and batch, and of one training step (fb plus an
AdamW step). One *product* is one operator's ``U^T U v`` (a JVP and a VJP); the cost of
one, per operator, comes from one batched JVP+VJP over all 2KR + 2K operators. Rows:
the cold start (every operator from a random vector), ``warm_visits`` (visits started
from their sublayer's tied vector), tolerance sweeps (which tolerance gives kappa to 1e-6),
float32 iterations finished in float64, scipy's LOBPCG on one operator, and the training
monitor (kappa after 200 AdamW steps, cold and warm-started from the earlier vectors).
Run with ``PYTHONPATH`` at an older checkout (without ``warm_visits``), it prints the
cold row only: the before figure of the same script.

    .venv/bin/python benchmarks/bench_convergence.py
    .venv/bin/python benchmarks/bench_convergence.py --work [--d 32 --R 8 --seq 16 --batch 4]
    .venv/bin/python benchmarks/bench_convergence.py --bound   # `loopprobe bound`, 2 tolerances
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import statistics
import time

import torch
import torch.nn.functional as F

import loopprobe as lp


def main() -> None:
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", action="store_true", help="issue 18.2: operator work")
    parser.add_argument(
        "--bound", action="store_true", help="`loopprobe bound` at the old and new tolerance"
    )
    parser.add_argument("--d", type=int, default=32)
    parser.add_argument("--R", type=int, default=8)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200, help="AdamW steps (monitor)")
    parser.add_argument(
        "--quick", action="store_true", help="cold and default rows only (larger sizes)"
    )
    args = parser.parse_args()
    if args.work:
        work(args)
    elif args.bound:
        bound_cost()
    else:
        iterations()


def iterations() -> None:
    idx, tg = lp.tasks.random_tokens(4, 16, 64, generator=torch.Generator().manual_seed(0))

    def loss(out: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), tg.flatten())

    print("scheme    method   converged  iters max  iters mean  CPU-s  kappa_R")
    for norm in ("deeploop", "deepnorm"):
        cfg = lp.models.GPTConfig(K=2, R=4, norm=norm, d_model=16, n_heads=2, seq_len=16)
        model = lp.models.LoopedGPT(cfg, generator=torch.Generator().manual_seed(0)).double()
        for method in ("power", "lanczos"):
            t = time.process_time()
            rep = lp.visit_alignment(lp.attach(model), idx, loss, method=method, max_iter=100)
            cpu = time.process_time() - t
            it = rep.visits.iterations
            print(
                f"{norm:9s} {method:8s} {str(rep.converged):9s}  {it.max():9d}  "
                f"{it.mean():10.1f}  {cpu:5.1f}  {rep.kappa:.6f}"
            )


def bound_cost() -> None:
    """CPU time of the README's `loopprobe bound --K 2 --R 1,2,4,8,16` per scheme, at the
    default tolerance and at the earlier default (--tol 1e-10), one run each, same machine."""
    import resource
    import subprocess
    import sys

    exe = [sys.executable, "-c", "from loopprobe.cli import main; raise SystemExit(main())"]
    print("scheme    tolerance        CPU-s  wall-s  kappa_R at R=16")
    for norm in ("deepnorm", "deeploop"):
        for tol in ([], ["--tol", "1e-10"]):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            wall = time.perf_counter()
            cmd = [*exe, "bound", "--K", "2", "--R", "1,2,4,8,16", "--norm", norm, "--json", *tol]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            wall = time.perf_counter() - wall
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            rows = json.loads(out)["rows"]
            name = "default" if not tol else "1e-10 (before)"
            print(f"{norm:9s} {name:15s} {cpu:6.1f}  {wall:6.1f}  {rows[-1]['kappa']:.10f}")


# -- issue 18.2: operator work -----------------------------------------------------------


def work(args: argparse.Namespace) -> None:
    cfg = lp.models.GPTConfig(
        K=2, R=args.R, norm="deeploop", d_model=args.d, n_heads=4, seq_len=args.seq
    )
    model = lp.models.LoopedGPT(cfg, generator=torch.Generator().manual_seed(0)).double()
    gen = torch.Generator().manual_seed(0)
    idx, tg = lp.tasks.random_tokens(args.batch, args.seq, cfg.vocab_size, generator=gen)

    def loss(out: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), tg.flatten())

    fb, step = fb_cost(model, idx, loss)
    per_op, ops = product_cost(model, idx)
    new = "warm_visits" in inspect.signature(lp.sensitivity_norms).parameters
    print(
        f"LoopedGPT deeploop K=2 R={args.R} d {args.d} seq {args.seq} batch {args.batch}, "
        f"float64, 1 thread: {ops} operators; fb {fb * 1e3:.1f} ms, training step "
        f"{step * 1e3:.1f} ms; one product (JVP+VJP, batched, per operator) {per_op / fb:.2f} fb"
    )
    ups = lp.per_visit_updates(lp.attach(model), idx, loss)
    ref = kappa(model, idx, ups, tol=1e-12, **({"warm_visits": False} if new else {}))
    print(f"reference kappa_R {ref.kappa:.12f} (Lanczos, tol 1e-12)")
    print("row                               conv  products  max it  CPU-s     fb  dkappa/kappa")

    def row(label: str, m: torch.nn.Module, base=None, unit=fb, **kw) -> object:
        t = time.process_time()
        rep = kappa(m, idx, ups, **kw)
        cpu = time.process_time() - t
        prod, top = products(rep.sensitivity, new)
        dk = abs(rep.kappa - base.kappa) / base.kappa if base else abs(rep.kappa - ref.kappa)
        dk = dk / ref.kappa if not base else dk
        print(
            f"{label:33s} {str(rep.converged):5s} {prod:8d}  {top:6d}  {cpu:5.1f}  "
            f"{cpu / unit:5.0f}  {dk:.1e}"
        )
        return rep

    if not new:
        row("cold start (before)", model)
        return
    tols = (1e-4,) if args.quick else (1e-4, 1e-6, 1e-8)
    row("cold start", model, warm_visits=False)
    for tol in tols:
        row(f"cold start, tol {tol:g}", model, tol=tol, warm_visits=False)
    default = row("visits from tied vector", model, warm_visits=True)
    for tol in tols:
        row(f"visits from tied, tol {tol:g}", model, tol=tol, warm_visits=True)
    suffix_cost(model, idx, fb)
    if args.quick:
        return
    ups32 = ups_float(model, idx, loss)
    t = time.process_time()
    low = kappa(copy.deepcopy(model).float(), idx, ups32)
    cpu32 = time.process_time() - t
    print(
        f"float32 first (tol 1e-5)          {str(low.converged):5s} "
        f"{products(low.sensitivity, new)[0]:8d}  {'':6s}  {cpu32:5.1f}  {cpu32 / fb:5.0f}"
    )
    row("  then float64 from its vectors", model, start=low.sensitivity)
    lobpcg(model, idx)
    monitor(args, model, idx, tg, loss, default, step)


def kappa(model, idx, ups, **kw):
    """kappa_R from the given G (one backward, shared) and fresh U norms."""
    from loopprobe.estimate.alignment import _report

    probe = lp.attach(model)
    visible = [v for v in ups.visits if bool(ups.visible[v.j][v.r])]
    sens = lp.sensitivity_norms(probe, idx, visits=visible, method="lanczos", max_iter=100, **kw)
    return _report(ups, sens, {s.name: s.role for s in probe.sublayers()})


def ups_float(model, idx, loss):
    return lp.per_visit_updates(lp.attach(copy.deepcopy(model).float()), idx, loss)


def products(sens, new: bool) -> tuple[int, int]:
    """Operator products spent, and the most iterations of one operator. Before operators
    left the batch on converging, every operator ran as long as the slowest one."""
    ests = list({id(e): e for e in (*sens.visit_norms, *sens.tied_norms.values())}.values())
    top = max(e.iterations for e in ests)
    return (sum(e.iterations for e in ests) if new else top * len(ests)), top


def fb_cost(model, idx, loss) -> tuple[float, float]:
    """Median CPU seconds of one forward+backward and of one AdamW training step."""
    m = copy.deepcopy(model)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)

    def once(optimize: bool) -> float:
        t = time.process_time()
        m.zero_grad()
        loss(m(idx), idx).backward()
        if optimize:
            opt.step()
        return time.process_time() - t

    for _ in range(3):
        once(False)
    fb = statistics.median(once(False) for _ in range(15))
    return fb, statistics.median(once(True) for _ in range(15))


def product_cost(model, idx) -> tuple[float, int]:
    """Median CPU seconds of one batched JVP+VJP, per operator, over all operators."""
    from loopprobe.differentiate.jacobian import VisitJacobian
    from loopprobe.estimate.sensitivity import _operators

    probe = lp.attach(model)
    visits = [v for v in probe.visits(idx) if v.grad_visible]
    jac = VisitJacobian(probe, idx, visits)
    ops, _ = _operators(visits)
    masks = jac.masks(ops)
    V = torch.randn(len(ops), jac.n_max, dtype=jac.dtype, generator=torch.Generator())
    jac.rmatvec(jac.matvec(V, masks), masks)
    times = []
    for _ in range(3):
        t = time.process_time()
        jac.rmatvec(jac.matvec(V, masks), masks)
        times.append(time.process_time() - t)
    return statistics.median(times) / len(ops), len(ops)


def suffix_cost(model, idx, fb: float, groups: int = 4) -> None:
    """Not implemented, measured: the visit operators split into ``groups`` by position,
    each group's products from a VisitJacobian over its own visits only (tangents start,
    and the backward stops, at the group's first visit) against one batch over all."""
    from loopprobe.differentiate.jacobian import VisitJacobian

    probe = lp.attach(model)
    visits = [v for v in probe.visits(idx) if v.grad_visible]

    def cost(vs: list) -> tuple[float, float]:
        jac = VisitJacobian(probe, idx, vs)
        masks = jac.masks([[k] for k in range(len(vs))])
        V = torch.randn(len(vs), jac.n_max, dtype=jac.dtype, generator=torch.Generator())
        jac.rmatvec(jac.matvec(V, masks), masks)
        t = time.process_time()
        u = jac.matvec(V, masks)
        a = time.process_time() - t
        jac.rmatvec(u, masks)
        return a, time.process_time() - t - a

    M = len(visits)
    whole = cost(visits)
    parts = [cost(visits[g * M // groups : (g + 1) * M // groups]) for g in range(groups)]
    print(
        f"visit products, one batch of {M}: JVP {whole[0] / fb:.0f} fb, VJP {whole[1] / fb:.0f} "
        f"fb; in {groups} groups from their first visit: JVP {sum(p[0] for p in parts) / fb:.0f}"
        f" fb, VJP {sum(p[1] for p in parts) / fb:.0f} fb"
    )


def lobpcg(model, idx) -> None:
    """scipy's LOBPCG (block 1, 2, 4) on U^T U of one tied operator, products to the same
    relative residual (1e-10) as Lanczos on the same operator."""
    import numpy as np
    from scipy.sparse.linalg import LinearOperator
    from scipy.sparse.linalg import lobpcg as scipy_lobpcg

    from loopprobe.differentiate.jacobian import VisitJacobian

    probe = lp.attach(model)
    visits = [v for v in probe.visits(idx) if v.grad_visible]
    j0 = visits[0].j
    jac = VisitJacobian(probe, idx, visits)
    mask = jac.masks([[k for k, v in enumerate(visits) if v.j == j0]])
    n = jac.n[0]
    count = [0]

    def ata(X: np.ndarray) -> np.ndarray:
        X = np.atleast_2d(X.T).T if X.ndim == 1 else X
        V = torch.zeros(X.shape[1], jac.n_max, dtype=jac.dtype)
        V[:, :n] = torch.from_numpy(np.ascontiguousarray(X.T))
        masks = mask.expand(X.shape[1], -1)
        count[0] += X.shape[1]
        return jac.rmatvec(jac.matvec(V, masks), masks)[:, :n].numpy().T

    op = LinearOperator((n, n), matvec=ata, matmat=ata, dtype=np.float64)
    g = torch.Generator().manual_seed(0)
    v0 = torch.randn(1, n, generator=g, dtype=torch.float64)
    kry = lp.linalg.operator_norm_krylov(
        lambda v: jac.matvec(pad(v, jac.n_max), mask),
        lambda u: jac.rmatvec(u, mask)[:, :n],
        v0,
        max_iter=100,
        tol=1e-10,
    )[0]
    print(f"tied operator of {visits[0].sublayer}: Lanczos {kry.iterations} products", end="")
    for k in (1, 2, 4):
        count[0] = 0
        X = torch.randn(n, k, generator=g, dtype=torch.float64).numpy()
        lam, _ = scipy_lobpcg(op, X, largest=True, tol=1e-10 * kry.value**2, maxiter=200)
        err = abs(float(np.sqrt(lam[0])) - kry.value) / kry.value
        print(f"; LOBPCG block {k}: {count[0]} products (sigma off by {err:.0e})", end="")
    print()


def pad(v: torch.Tensor, n: int) -> torch.Tensor:
    return torch.nn.functional.pad(v, (0, n - v.shape[1]))


def monitor(args, model, idx, tg, loss, before, step: float) -> None:
    """kappa after ``--steps`` AdamW steps on fresh random batches: cold, and warm-started
    from the vectors of the measurement before training (in training steps)."""
    trained = copy.deepcopy(model)
    opt = torch.optim.AdamW(trained.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(args.steps):
        x, y = lp.tasks.random_tokens(args.batch, args.seq, model.cfg.vocab_size, generator=g)
        opt.zero_grad()
        F.cross_entropy(trained(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
    trained.zero_grad(set_to_none=True)
    ups = lp.per_visit_updates(lp.attach(trained), idx, loss)
    old = before.sensitivity.start_vectors()
    for label, kw in (("cold", {}), ("warm-started", {"start": before.sensitivity})):
        t = time.process_time()
        rep = kappa(trained, idx, ups, **kw)
        cpu = time.process_time() - t
        prod, top = products(rep.sensitivity, True)
        print(
            f"after {args.steps} AdamW steps, {label:12s}: converged {rep.converged}, {prod} "
            f"products, max {top} it, {cpu:.1f} CPU-s = {cpu / step:.0f} training steps, "
            f"kappa_R {rep.kappa:.9f}"
        )
    cos = [float(v @ old[k]).__abs__() for k, v in rep.sensitivity.start_vectors().items()]
    print(
        f"|cos| of each operator's top vector before and after: min {min(cos):.3f}, "
        f"median {statistics.median(cos):.3f}"
    )


if __name__ == "__main__":
    main()
