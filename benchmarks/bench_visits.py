"""Visit-probe costs (issue 3): G overhead, batched vs looped U, cost in R, low-memory G.

Everything is measured in one run on the reference LoopedGPT (DeepLoop, float32, random
tokens, cross-entropy). Variants are timed round-robin, repeat by repeat, and ratios are
medians of per-repeat ratios; with one thread (the default) the clock is this process's
CPU time, so other load on the machine does not leak into the numbers. Not a test.

1. per-visit G for all visits (``per_visit_updates``, full and low-memory mode) against
   one plain forward + backward of the same model and batch (``torch.autograd.grad`` of
   the loss w.r.t. every parameter); target <= 1.3x.
2. kappa with U norms (20 power iterations, ``tol=0`` so every operator runs all 20)
   batched over visits (``torch.vmap``, the default) against the same estimate visit by
   visit in a Python loop (the core's ``chunk_size=0``), at R = 8; target >= 3x. The two
   kappas must agree.
3. cost against R in {2, 4, 8, 16} at fixed K: plain forward+backward, G, U and the whole
   kappa estimate, with fitted log-log exponents; target <= 1.15.
4. peak memory of G: full storage (R_j x n_j per sublayer) against the low-memory mode
   (norms and tied sums only) and a plain forward+backward: the peak of the heap in use
   (glibc ``mallinfo2``, sampled every 0.2 ms; torch's CPU tensors come from malloc, and
   ``tracemalloc`` does not see them) above what was in use before the call.
5. G at the limit (issue 18.3): all-visit G against one plain forward+backward at d_model
   64, 128 and 256 (seq/batch 32/8, 64/8, 128/8, K=2, R=8; target <= 1.15x), and the
   per-visit Python overhead at d_model 32: a forward with the probe's session hooks
   installed (no swap) against the same forward without them, divided by the number of
   visits, split into the transform-safe settings (``loopprobe.autodiff.transform_safe``,
   whose attention-layout mode intercepts every torch call) and the hooks themselves.

    .venv/bin/python benchmarks/bench_visits.py [--threads 1] [--repeats 5] [--quick]
        [--sections 1,2,3,4,5]

The GPT-2-small GPU run of the issue (d_model 768, 12 heads, K=2, R=8, seq 1024,
batch 8) is ``benchmarks/bench_gpu.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import inspect
import statistics
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

import loopprobe as lp
from loopprobe.estimate.updates import per_visit_updates
from loopprobe.models import GPTConfig, LoopedGPT

VOCAB = 256
CLOCK = {"fn": time.perf_counter, "name": "wall"}


def build(
    d: int, heads: int, T: int, B: int, K: int, R: int, seed: int = 0, *, vocab: int = VOCAB,
    device: str | torch.device = "cpu",
):  # fmt: skip
    """Model (float32, DeepLoop), probe, tokens and the cross-entropy loss, on ``device``
    (built on CPU from seeded generators, then moved: the same weights on every device)."""
    cfg = GPTConfig(
        vocab_size=vocab, seq_len=T, d_model=d, n_heads=heads, K=K, R=R, norm="deeploop"
    )
    model = LoopedGPT(cfg, generator=torch.Generator().manual_seed(seed)).to(device)
    idx, targets = lp.tasks.random_tokens(B, T, vocab, torch.Generator().manual_seed(seed + 1))
    idx, targets = idx.to(device), targets.to(device)

    def loss_fn(out: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out.reshape(-1, vocab), targets.reshape(-1))

    return model, lp.attach(model), idx, loss_fn


def plain_step(model, idx, loss_fn) -> Callable[[], object]:
    params = [p for p in model.parameters() if p.requires_grad]
    return lambda: torch.autograd.grad(loss_fn(model(idx), idx), params)


def timed(fn: Callable[[], object]) -> float:
    t = CLOCK["fn"]()
    fn()
    return CLOCK["fn"]() - t


def interleaved(fns: dict, repeats: int, warmup: bool = True) -> dict[str, list[float]]:
    """Warm up each (optionally), then time them round-robin ``repeats`` times."""
    if warmup:
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            times[k].append(timed(fn))
    return times


def median_ratio(num: list[float], den: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(num, den, strict=True))


def exponent(xs: list[int], ys: list[float]) -> float:
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def kappa_estimate(probe, idx, loss_fn, chunk_size: int | None, iters: int = 20):
    """kappa with U norms from exactly ``iters`` power iterations (tol=0: none stops early)."""
    return lp.visit_alignment(probe, idx, loss_fn, max_iter=iters, tol=0.0, chunk_size=chunk_size)


# --------------------------------------------------------------------------- 1. G


def bench_G(size: tuple, repeats: int) -> dict:
    model, probe, idx, loss_fn = build(*size)
    fns = {
        "plain": plain_step(model, idx, loss_fn),
        "full": lambda: per_visit_updates(probe, idx, loss_fn),
        "low": lambda: per_visit_updates(probe, idx, loss_fn, memory="low"),
    }
    t = interleaved(fns, repeats)
    return {
        "plain_ms": 1e3 * statistics.median(t["plain"]),
        "full_x": median_ratio(t["full"], t["plain"]),
        "low_x": median_ratio(t["low"], t["plain"]),
    }


# --------------------------------------------------------------------------- 2. batched U


def bench_batched(size: tuple, repeats: int) -> dict:
    """A cheap warm-up of the batched path, then each variant ``repeats`` times."""
    model, probe, idx, loss_fn = build(*size)
    kappa_estimate(probe, idx, loss_fn, None, iters=2)
    results = {}

    def run(name: str, chunk: int | None) -> Callable[[], None]:
        def fn() -> None:
            results[name] = kappa_estimate(probe, idx, loss_fn, chunk)

        return fn

    t = interleaved({"batched": run("batched", None), "loop": run("loop", 0)}, repeats, False)
    a, b = results["batched"], results["loop"]
    return {
        "operators": int(a.M_g + len(a.sublayers)),
        "batched_s": statistics.median(t["batched"]),
        "loop_s": statistics.median(t["loop"]),
        "speedup": median_ratio(t["loop"], t["batched"]),
        "kappa_rel_diff": abs(a.kappa - b.kappa) / abs(b.kappa),
    }


# --------------------------------------------------------------------------- 3. cost in R


def bench_R(size: tuple, Rs: list[int], repeats: int, iters: int) -> dict:
    """Cost of plain fwd+bwd, G, U (``iters`` power iterations) and kappa at each R."""
    d, heads, T, B, K = size
    rows = []
    for R in Rs:
        model, probe, idx, loss_fn = build(d, heads, T, B, K, R)
        kappa_estimate(probe, idx, loss_fn, None, iters=1)  # warm-up (discovery, vmap)
        fns = {
            "plain": plain_step(model, idx, loss_fn),
            "G": lambda p=probe, x=idx, f=loss_fn: per_visit_updates(p, x, f),
            "U": lambda p=probe, x=idx: lp.sensitivity_norms(p, x, max_iter=iters, tol=0.0),
            "kappa": lambda p=probe, x=idx, f=loss_fn: kappa_estimate(p, x, f, None, iters),
        }
        t = interleaved(fns, repeats, warmup=False)
        rows.append({"R": R, **{k: statistics.median(v) for k, v in t.items()}})
    out: dict = {"rows": rows}
    for k in ("plain", "G", "U", "kappa"):
        out[f"exp_{k}"] = exponent(Rs, [r[k] for r in rows])
    ops = [2 * K * R + 2 * K for R in Rs]
    out["exp_U_per_operator"] = exponent(Rs, [r["U"] / n for r, n in zip(rows, ops, strict=True)])
    return out


# --------------------------------------------------------------------------- 4. memory


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def heap_in_use() -> Callable[[], int] | None:
    """Bytes malloc has handed out (arenas + mmapped chunks; glibc ``mallinfo2``) or None."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None

    def in_use() -> int:
        m = libc.mallinfo2()
        return m.uordblks + m.hblkhd

    return in_use


def peak_extra(fn: Callable[[], object], in_use: Callable[[], int]) -> float:
    """Peak heap in use while ``fn`` runs, above the heap in use before it (MiB)."""
    base = in_use()
    peak, done = [base], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], in_use())
            time.sleep(2e-4)

    thread = threading.Thread(target=sample)
    thread.start()
    try:
        out = fn()
        peak[0] = max(peak[0], in_use())  # the result is still alive here
        del out
    finally:
        done.set()
        thread.join()
    return (peak[0] - base) / 2**20


def bench_memory(size: tuple, in_use: Callable[[], int]) -> dict:
    model, probe, idx, loss_fn = build(*size)
    fns = {
        "plain": plain_step(model, idx, loss_fn),
        "full": lambda: per_visit_updates(probe, idx, loss_fn),
        "low": lambda: per_visit_updates(probe, idx, loss_fn, memory="low"),
    }
    for fn in fns.values():
        fn()  # warm-up: discovery, allocator caches
    out: dict = {k: max(peak_extra(fn, in_use) for _ in range(2)) for k, fn in fns.items()}
    out["looped_params"] = sum(s.numel for s in probe.sublayers())
    return out


# --------------------------------------------------------------------------- 5. G at the limit


def bench_overhead(size: tuple, repeats: int) -> dict:
    """Per-visit cost of the session (hooks, no swap) on a no-grad forward, in microseconds."""
    from loopprobe.autodiff import transform_safe

    model, probe, idx, _ = build(*size)

    def forward(ctx: Callable[[], object]) -> Callable[[], None]:
        def fn() -> None:
            with torch.no_grad(), ctx():
                model(idx)

        return fn

    fns = {
        "bare": forward(contextlib.nullcontext),
        "transform_safe": forward(transform_safe),
        "session": forward(lambda: probe.session(None)),
    }
    if "transforms" in inspect.signature(probe.session).parameters:
        fns["hooks_only"] = forward(lambda: probe.session(None, transforms=False))
    t = {k: statistics.median(v) for k, v in interleaved(fns, repeats).items()}
    n = len(probe.visits(idx))
    out = {"visits": n, "forward_ms": 1e3 * t["bare"]}
    out.update({f"{k}_us": 1e6 * (t[k] - t["bare"]) / n for k in fns if k != "bare"})
    return out


# --------------------------------------------------------------------------- main


def fmt_size(size: tuple) -> str:
    d, heads, T, B, K, *R = size
    return f"d_model {d}, {heads} heads, seq {T}, batch {B}, K={K}" + (f", R={R[0]}" if R else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    ap.add_argument(
        "--sections", default="1,2,3,4,5", help="comma-separated sections to run (default all)"
    )
    args = ap.parse_args()
    sections = {int(s) for s in args.sections.split(",")}
    sys.stdout.reconfigure(line_buffering=True)
    torch.set_num_threads(args.threads)
    if args.threads == 1:  # one thread: CPU time is the cost, whatever else runs
        CLOCK.update(fn=time.process_time, name="CPU")
    reps = 3 if args.quick else args.repeats
    small = (32, 4, 16, 4, 2, 8)  # the CLI default
    g_size = (64, 4, 32, 4, 2, 8) if args.quick else (128, 4, 64, 8, 2, 8)
    mem_size = (128, 4, 32, 2, 2, 16) if args.quick else (256, 4, 32, 2, 2, 16)
    limit_sizes = [(64, 4, 32, 8, 2, 8), (128, 4, 64, 8, 2, 8)]
    limit_sizes += [] if args.quick else [(256, 4, 128, 8, 2, 8)]
    Rs, iters = ([2, 4, 8] if args.quick else [2, 4, 8, 16]), 5
    t0, c0 = time.perf_counter(), time.process_time()
    print(
        f"loopprobe {lp.__version__}, torch {torch.__version__}, {args.threads} thread(s), "
        f"float32, {CLOCK['name']} time, medians over interleaved repeats"
    )
    if 1 in sections:
        section_G(small, g_size, reps)
    if 2 in sections:
        section_batched(small)
    if 3 in sections:
        section_R(small, Rs, max(1, reps - 2), iters)
    if 4 in sections:
        section_memory(mem_size)
    if 5 in sections:
        section_limit(limit_sizes, small, reps)
    print(
        "\nGPU run (GPT-2-small: d_model 768, 12 heads, K=2, R=8, seq 1024, batch 8): see "
        "benchmarks/bench_gpu.py"
    )
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(f"\ntotal {wall:.0f} s wall, {cpu:.0f} s CPU in this process")


def section_G(small: tuple, g_size: tuple, reps: int) -> None:
    print(
        "\n1. per-visit G for all visits vs one plain forward+backward (target <= 1.3x), "
        f"{reps} repeats"
    )
    for size in (small, g_size):
        r = bench_G(size, reps)
        print(
            f"   {fmt_size(size)}: plain {r['plain_ms']:.1f} ms; "
            f"G full {r['full_x']:.2f}x, G low-memory {r['low_x']:.2f}x"
        )


def section_batched(small: tuple) -> None:
    print(
        "\n2. kappa with U norms (20 power iterations, tol=0), batched over visits vs a Python "
        "loop over visits, R=8 (target >= 3x), 1 repeat"
    )
    r = bench_batched(small, 1)
    print(
        f"   {fmt_size(small)}: {r['operators']} operators; batched {r['batched_s']:.2f} s, "
        f"loop {r['loop_s']:.2f} s: {r['speedup']:.2f}x faster "
        f"(kappa agrees to {r['kappa_rel_diff']:.1e})"
    )


def section_R(small: tuple, Rs: list[int], rep3: int, iters: int) -> None:
    print(
        f"\n3. cost vs R in {Rs}, {fmt_size(small[:5])} (target: exponent <= 1.15); "
        f"U and kappa with {iters} power iterations, {rep3} repeat(s)"
    )
    r = bench_R(small[:5], Rs, rep3, iters)
    print("      R   plain ms     G ms      U s   kappa s")
    for row in r["rows"]:
        print(
            f"   {row['R']:4d} {1e3 * row['plain']:10.1f} {1e3 * row['G']:8.1f} "
            f"{row['U']:8.2f} {row['kappa']:9.2f}"
        )
    print(
        f"   fitted exponents: plain {r['exp_plain']:.2f}, G {r['exp_G']:.2f}, "
        f"U {r['exp_U']:.2f} (per operator {r['exp_U_per_operator']:.2f}), "
        f"kappa {r['exp_kappa']:.2f}"
    )


def section_memory(mem_size: tuple) -> None:
    print(f"\n4. peak memory of G, {fmt_size(mem_size)} (heap in use above the model)")
    in_use = heap_in_use()
    if in_use is None:
        print("   skipped: needs glibc's mallinfo2 to see torch's CPU allocations")
        return
    m = bench_memory(mem_size, in_use)
    n, R = m["looped_params"], mem_size[5]
    print(f"   G itself: R x looped parameters = {R} x {n} floats = {R * n * 4 / 2**20:.1f} MiB")
    for key, label in (("plain", "plain forward+backward"), ("full", "G full storage"),
                       ("low", "G low-memory")):  # fmt: skip
        print(f"   {label:24s} peak +{m[key]:7.1f} MiB")
    print(
        f"   low-memory / full: {m['low'] / m['full']:.2f}; "
        f"low-memory / plain: {m['low'] / m['plain']:.2f}"
    )


def section_limit(sizes: list[tuple], small: tuple, reps: int) -> None:
    print(f"\n5. G at the limit: all-visit G vs one plain forward+backward (target <= 1.15x), "
          f"{reps} repeats")  # fmt: skip
    for size in sizes:
        r = bench_G(size, reps)
        print(
            f"   {fmt_size(size)}: plain {r['plain_ms']:.1f} ms; "
            f"G full {r['full_x']:.2f}x, G low-memory {r['low_x']:.2f}x"
        )
    r = bench_overhead(small, max(reps, 7))
    print(
        f"   per-visit overhead, {fmt_size(small)} ({r['visits']} visits; no-grad forward "
        f"{r['forward_ms']:.1f} ms): session {r['session_us']:.0f} us/visit, of which the "
        f"transform-safe settings {r['transform_safe_us']:.0f} us/visit"
        + (f"; hooks alone {r['hooks_only_us']:.0f} us/visit" if "hooks_only_us" in r else "")
    )


if __name__ == "__main__":
    main()
