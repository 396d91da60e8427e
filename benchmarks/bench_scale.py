"""Issue 18.4: what probing costs at sizes a user would probe, in units of one training step.

LoopedGPT (DeepLoop, float32, vocab 256, 64-dim heads, random tokens, cross-entropy,
weights from ``torch.Generator().manual_seed(0)``), seq 128, batch 8, K=2, one thread.
For each size and each quantity a fresh subprocess builds the model and measures:

- ``step``: one plain training step (forward + backward + ``torch.optim.AdamW.step``),
  the unit of the table; median of 3 after a warm-up step;
- ``G``, ``G low``: ``lp.per_visit_updates`` (full, ``memory="low"``), one warm-up, then
  the median of 2;
- ``G_vs_step`` (not in the default): a step and ``lp.per_visit_updates`` alternated in one
  process, 5 times each after a warm-up of both, the minimum of each: G's cost in steps
  where load shifts between fresh processes (the ``steps`` column is that ratio);
- ``U``: ``lp.sensitivity_norms`` with ``max_iter`` capped (default 5) and ``tol=0``, so
  every operator runs exactly ``max_iter`` iterations (the estimates are NOT converged;
  the cost of a converged estimate is that of its iteration count, see the per-iteration
  column); one run (no warm-up: the first call is what a user pays);
- ``U1``: the same with ``max_iter=1`` (set-up plus one iteration), from which the cost of
  one more iteration is ``(U - U1) / (max_iter - 1)`` (the set-up includes one-off costs
  of a first call in a process, about 2 s: torch.func's initialisation);
- ``kappa``: ``lp.visit_alignment`` (G + U) at the same cap; one run (``U`` alone is not
  in the default: it costs what kappa costs less G and one visibility pass);
- ``kappa_conv`` (not in the default): ``lp.visit_alignment`` with its defaults (converged
  to the default tolerance, warm visits where they are on); one run; prints whether it
  converged and its operator products (iterations summed over operators);
- ``kappa_1e-2`` (not in the default): the same with ``tol=1e-2``, kappa's error bound a
  training monitor affords;
- ``U_whole`` (not in the default): ``U`` with every operator in one batch (an explicit
  ``chunk_size`` larger than the batch), to see what the automatic chunking costs and saves.

Time: wall and CPU (``time.process_time``; one thread, so CPU time is the cost whatever
else runs). Memory: the peak resident set of the subprocess (``resource.getrusage``
``ru_maxrss``) above its resident set just before the first measured call (``/proc/self/
statm``); a fresh subprocess per quantity, so one quantity's peak cannot hide another's.
A peak that does not rise above the process's earlier high-water mark (the import) is
printed as an upper bound ``<=``. The batched operators run with the chunk size
``loopprobe._memory`` picks from free memory (printed; ``-`` means one batch).

    .venv/bin/python benchmarks/bench_scale.py                      # default: d 256, R 4 and 8
    .venv/bin/python benchmarks/bench_scale.py --d 256,512 --R 4,8,16   # the full grid (hours)
    .venv/bin/python benchmarks/bench_scale.py --what step,G,U --max-iter 5

The default (d 256, R 4 and 8, ``max_iter`` 5, without ``U`` alone) takes about 14
CPU-minutes on one core; ``--R 4`` about 3.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
QUANTITIES = [
    "step", "G", "G_low", "G_vs_step", "U1", "U", "kappa", "U_whole", "kappa_conv", "kappa_1e-2",
]  # fmt: skip
DEFAULT = "step,G,G_low,U1,kappa"  # U alone (--what ...,U) is kappa minus G, less one pass


# --------------------------------------------------------------------------- worker


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def worker(d: int, R: int, T: int, B: int, K: int, what: str, max_iter: int) -> dict:
    """Measure one quantity on one size in this (fresh) process; returns a JSON-able dict."""
    import torch

    sys.path.insert(0, HERE)
    import bench_visits as bv

    import loopprobe as lp
    import loopprobe.estimate.sensitivity as sensitivity

    torch.set_num_threads(1)
    model, probe, idx, loss_fn = bv.build(d, d // 64, T, B, K, R)
    chunks: list = []
    auto = sensitivity.auto_chunk_size

    def spy(jac, operators):
        chunks.append((auto(jac, operators), operators))
        return chunks[-1][0]

    sensitivity.auto_chunk_size = spy
    extra: dict = {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)  # state made by the first step only

    def one_step():
        opt.zero_grad(set_to_none=True)
        loss_fn(model(idx), idx).backward()
        opt.step()

    if what == "step":
        fn = one_step
        repeats, warm = 3, True
    elif what == "G_vs_step":

        def one_G():
            return lp.per_visit_updates(probe, idx, loss_fn)

        best = {"step": float("inf"), "G": float("inf")}
        for _ in range(6):  # the first round is the warm-up
            for name, f in (("step", one_step), ("G", one_G)):
                c = time.process_time()
                f()
                best[name] = min(best[name], time.process_time() - c) if _ else best[name]
        extra = {"step_cpu": best["step"], "ratio": best["G"] / best["step"]}

        def fn():
            return None

        repeats, warm = 1, False
    elif what in ("G", "G_low"):
        memory = "low" if what == "G_low" else "full"

        def fn():
            return lp.per_visit_updates(probe, idx, loss_fn, memory=memory)

        repeats, warm = 2, True
    elif what in ("U", "U1", "U_whole"):
        it = 1 if what == "U1" else max_iter
        chunk = 10**9 if what == "U_whole" else None  # explicit: one batch, no auto rule

        def fn():
            return lp.sensitivity_norms(
                probe,
                idx,
                max_iter=it,
                tol=0.0,
                generator=torch.Generator().manual_seed(0),
                chunk_size=chunk,
            )

        repeats, warm = 1, False
    elif what in ("kappa_conv", "kappa_1e-2"):  # converged: kappa's default bound or 1e-2
        tol = 1e-2 if what == "kappa_1e-2" else None

        def fn():
            return lp.visit_alignment(
                probe, idx, loss_fn, tol=tol, generator=torch.Generator().manual_seed(0)
            )

        repeats, warm = 1, False
    elif what == "kappa":

        def fn():
            return lp.visit_alignment(
                probe,
                idx,
                loss_fn,
                max_iter=max_iter,
                tol=0.0,
                generator=torch.Generator().manual_seed(0),
            )

        repeats, warm = 1, False
    else:
        raise ValueError(f"bench_scale: what={what!r}; choose from {QUANTITIES}")
    base, high = rss_bytes(), maxrss_bytes()
    if warm:
        fn()
    walls, cpus = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        out = fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    peak = maxrss_bytes()
    if what in ("kappa", "kappa_conv", "kappa_1e-2"):
        extra = {
            "kappa": out.kappa,
            "kappa_err": out.kappa_err,
            "method": out.sensitivity.method,
            "converged": bool(out.converged),
            "products": sum(
                e.iterations
                for e in (*out.sensitivity.visit_norms, *out.sensitivity.tied_norms.values())
            ),
        }
        # fmt: skip
    elif what in ("U", "U1", "U_whole"):
        extra = {"method": out.method, "operators": len(out.visit_norms) + len(out.tied_norms)}
    if what == "G_vs_step":
        walls = cpus = [extra["ratio"] * extra["step_cpu"]]
    return {
        "wall": statistics.median(walls),
        "cpu": statistics.median(cpus),
        "peak": peak - base,
        "bounded": peak <= high,  # never rose above the import's high-water mark
        "chunk": chunks[0][0] if chunks else None,
        "params": sum(p.numel() for p in model.parameters()),
        **extra,
    }


# --------------------------------------------------------------------------- driver


def measure(d: int, R: int, args: argparse.Namespace, what: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", what]
    cmd += ["--d", str(d), "--R", str(R), "--seq", str(args.seq), "--batch", str(args.batch)]
    cmd += ["--K", str(args.K), "--max-iter", str(args.max_iter)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def mib(r: dict) -> str:
    return ("<=" if r["bounded"] else "") + f"{r['peak'] / 2**20:.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", default="256", help="d_model values, comma-separated")
    ap.add_argument("--R", default="4,8", help="loop counts, comma-separated")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--K", type=int, default=2)
    ap.add_argument("--max-iter", type=int, default=5, help="cap on U/kappa iterations")
    ap.add_argument("--what", default=DEFAULT, help=f"quantities, from {QUANTITIES}")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        r = worker(int(args.d), int(args.R), args.seq, args.batch, args.K, args.worker,
                   args.max_iter)  # fmt: skip
        print(json.dumps(r))
        return
    sys.stdout.reconfigure(line_buffering=True)
    what = [w for w in QUANTITIES if w in args.what.split(",")]
    if "step" not in what:
        what = ["step", *what]
    t0 = time.perf_counter()
    cpu_total = 0.0
    print(
        f"LoopedGPT DeepLoop float32, seq {args.seq}, batch {args.batch}, K={args.K}, one thread; "
        f"U and kappa capped at max_iter={args.max_iter} with tol=0 (not converged). "
        "Costs in CPU seconds and in training steps (x: CPU time / one AdamW step's); "
        "peak: resident set above the pre-call one, MiB (fresh subprocess each)."
    )
    head = f"{'d':>4} {'R':>3} {'what':>6} {'wall s':>8} {'CPU s':>8} {'steps':>8} {'peak MiB':>9}"
    print(head + "  notes")
    for d in [int(x) for x in args.d.split(",")]:
        for R in [int(x) for x in args.R.split(",")]:
            rows = {}
            for w in what:
                r = rows[w] = measure(d, R, args, w)
                cpu_total += r["cpu"] * (3 if w in ("step", "G", "G_low") else 1)
                x = r["cpu"] / rows["step"]["cpu"]
                note = ""
                if w == "G_vs_step":  # its own ratio, to the step measured beside it
                    x = r["ratio"]
                    note = f"min of 5 alternations; its step {r['step_cpu']:.2f} CPU-s"
                if w in ("U", "U1", "U_whole", "kappa", "kappa_conv", "kappa_1e-2"):
                    note = f"{r['method']}, chunk {r['chunk'] or '-'}"
                    note += f", kappa {r['kappa']:.7g}" if "kappa" in r else ""
                    if w in ("kappa_conv", "kappa_1e-2"):
                        note += f" (error bound {r['kappa_err']:.2g}), converged "
                        note += f"{r['converged']}, {r['products']} products"
                    note += f", {r['operators']} operators" if "operators" in r else ""
                print(
                    f"{d:4d} {R:3d} {w:>6} {r['wall']:8.2f} {r['cpu']:8.2f} {x:8.2f} "
                    f"{mib(r):>9}  {note}"
                )
            if "U1" in rows and ("U" in rows or "kappa" in rows) and args.max_iter > 1:
                # U = kappa - G, less the visibility pass U1 makes (about one step)
                U = rows["U"]["cpu"] if "U" in rows else rows["kappa"]["cpu"] - rows["G"]["cpu"]
                per = (U - rows["U1"]["cpu"]) / (args.max_iter - 1)
                step = rows["step"]["cpu"]
                setup = rows["U1"]["cpu"] - per
                src = "U" if "U" in rows else "kappa - G"
                print(
                    f"{d:4d} {R:3d} {'':>6} U (from {src}, U1): set-up {setup:.1f} s + {per:.2f} s "
                    f"per iteration = {setup / step:.1f} + {per / step:.2f} x iterations steps"
                )
    print(f"\ntotal {time.perf_counter() - t0:.0f} s wall, ~{cpu_total:.0f} CPU-s measured")


if __name__ == "__main__":
    main()
