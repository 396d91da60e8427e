"""Issue 18.1: no thread collapse. The CLI's default thread count vs two threads, one core busy.

Runs ``loopprobe kappa`` and ``loopprobe bound`` as subprocesses (``python -m
loopprobe.cli``, the import included in the time) while another process keeps one core
busy (a Python busy loop), first with ``--threads 2`` (the old default on a 2-core machine:
torch's) and then with the new default (one thread below ``loopprobe._threads.THRESHOLD``),
interleaved repeat by repeat, and prints the wall times and their ratio. A run that passes
``--timeout`` is stopped and counted at the timeout, so its ratio is a lower bound (">").

``--calibrate`` also times one forward+backward of the reference LoopedGPT (K=2, R=4,
DeepLoop) at growing sizes with 1 and 2 threads, idle and with one core busy, next to the
size measure ``parameters x token positions`` the CLI's rule uses: where two threads stop
losing badly to a busy core and start gaining on an idle one is the threshold.

Usage::

    .venv/bin/python benchmarks/bench_threads.py      # kappa, bound: minutes (2 threads capped)
    .venv/bin/python benchmarks/bench_threads.py --max-iter 20 --repeats 1 --calibrate
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class busy_core:  # noqa: N801 - used as a context manager
    """Another process spinning on one core for the duration of the block."""

    def __enter__(self) -> busy_core:
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.5)
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait()


def run_cli(argv: list[str], timeout: float) -> tuple[float, bool]:
    """Wall seconds of ``python -m loopprobe.cli argv`` and whether it finished in time."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    try:
        subprocess.run(
            [sys.executable, "-m", "loopprobe.cli", *argv],
            check=True,
            env=env,
            stdout=subprocess.DEVNULL,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return timeout, False
    return time.perf_counter() - t0, True


def commands(max_iter: int) -> dict[str, list[str]]:
    it = ["--max-iter", str(max_iter)]
    return {
        "kappa --K 2 --R 4 --norm deeploop": [
            "kappa", "--K", "2", "--R", "4", "--norm", "deeploop", *it,
        ],
        "bound --K 2 --R 1,2,4 --norm deeploop": [
            "bound", "--K", "2", "--R", "1,2,4", "--norm", "deeploop", *it,
        ],
    }  # fmt: skip


def bench_cli(args: argparse.Namespace) -> None:
    print(
        f"CLI with one core busy ({os.cpu_count()} cores, torch {torch.__version__}, "
        f"--max-iter {args.max_iter}, timeout {args.timeout:.0f} s, {args.repeats} repeat(s); "
        "wall time includes the ~3 s import)"
    )
    print(f"{'command':<40} {'threads 2 (before)':>19} {'default (after)':>16} {'ratio':>8}")
    with busy_core():
        for name, argv in commands(args.max_iter).items():
            before, after, capped = [], [], False
            for _ in range(args.repeats):  # interleaved: load drifts hit both alike
                t, ok = run_cli([*argv, "--threads", "2"], args.timeout)
                before.append(t)
                capped |= not ok
                t, ok = run_cli(argv, args.timeout)
                after.append(t)
                if not ok:
                    print(f"  warning: the default run of {name} passed the timeout")
            b, a = min(before), min(after)
            ratio = f"{'>' if capped else ''}{b / a:.1f}x"
            print(f"{name:<40} {b:>17.1f} s {a:>14.1f} s {ratio:>8}", flush=True)


def step_time(d: int, seq: int, batch: int, threads: int, repeats: int = 3) -> tuple[float, float]:
    """Best-of wall seconds of one forward+backward; and its parameter-tokens."""
    from loopprobe import tasks
    from loopprobe._threads import work
    from loopprobe.models import GPTConfig, LoopedGPT

    cfg = GPTConfig(vocab_size=64, seq_len=seq, d_model=d, n_heads=4, K=2, R=4, norm="deeploop")
    model = LoopedGPT(cfg, generator=torch.Generator().manual_seed(0))
    x, y = tasks.random_tokens(batch, seq, 64, torch.Generator().manual_seed(0))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:

        def once() -> None:
            model.zero_grad()
            logits = model(x)
            torch.nn.functional.cross_entropy(logits.reshape(-1, 64), y.reshape(-1)).backward()

        once()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            once()
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(previous)
    return best, work(model, x)


def calibrate() -> None:
    sizes = [(32, 16, 4), (64, 32, 8), (128, 64, 8), (256, 128, 8)]
    print("\nforward+backward of LoopedGPT K=2 R=4 DeepLoop: 2 threads / 1 thread (>1: slower)")
    print(f"{'d seq batch':<14} {'param-tokens':>13} {'idle':>7} {'1 core busy':>12}")
    for d, seq, batch in sizes:
        t1, w = step_time(d, seq, batch, 1)
        t2, _ = step_time(d, seq, batch, 2)
        with busy_core():
            b1, _ = step_time(d, seq, batch, 1)
            b2, _ = step_time(d, seq, batch, 2)
        row = f"{d:>3} {seq:>4} {batch:>4}   {w:>13.2e} {t2 / t1:>6.2f}x {b2 / b1:>11.2f}x"
        print(row, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-iter", type=int, default=20, help="power iterations (20)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run (300)")
    ap.add_argument("--calibrate", action="store_true", help="also time fwd+bwd per size")
    ap.add_argument("--no-cli", action="store_true", help="only --calibrate")
    args = ap.parse_args()
    if not args.no_cli:
        bench_cli(args)
    if args.calibrate:
        calibrate()


if __name__ == "__main__":
    main()
