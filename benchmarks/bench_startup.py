"""Issue 12.3: startup. ``import loopprobe`` vs ``import torch``; ``loopprobe theory``, ``--help``.

Each case is a fresh subprocess (``python -c "import ..."`` or ``python -m loopprobe.cli
...``) with ``PYTHONPATH`` set to the checkout under test, timed by wall clock, cases
interleaved round-robin repeat by repeat; the figure is the median over ``--repeats``.
Targets (issue 12): ``import loopprobe`` at most ~0.5 s beyond ``import torch``;
``loopprobe theory`` and every ``--help`` under 2 s.

``--baseline DIR`` times a second checkout (e.g. ``git worktree add /tmp/base <commit>``
or the main checkout) in the same rounds and prints after/before ratios (medians of the
per-repeat ratios, which background load hits on both sides alike). The last section is
``python -X importtime -c "import loopprobe"``: the slowest imports made directly by
loopprobe's modules (cumulative, nested imports included), so a new heavy import shows.

Usage::

    .venv/bin/python benchmarks/bench_startup.py                      # this checkout, 5 repeats
    .venv/bin/python benchmarks/bench_startup.py --baseline /work/main --repeats 7
"""

from __future__ import annotations

import argparse
import os
import pkgutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def commands(root: str) -> list[str]:
    """The CLI's subcommands in the checkout at ``root`` (its modules not starting with _)."""
    path = os.path.join(root, "loopprobe", "cli")
    return sorted(m.name for m in pkgutil.iter_modules([path]) if not m.name.startswith("_"))


def cases(root: str) -> dict[str, list[str]]:
    py = [sys.executable]
    out = {
        "import torch": py + ["-c", "import torch"],
        "import loopprobe": py + ["-c", "import loopprobe"],
        "import loopprobe; lp.visit_alignment": py
        + ["-c", "import loopprobe as lp; lp.visit_alignment"],
        "loopprobe theory --K 2 --R 4": py + ["-m", "loopprobe.cli", "theory", "--K=2", "--R=4"],
        "loopprobe --help": py + ["-m", "loopprobe.cli", "--help"],
    }
    for cmd in commands(root):
        name = cmd.replace("_", "-")  # module coord_check is command coord-check
        out[f"loopprobe {name} --help"] = py + ["-m", "loopprobe.cli", name, "--help"]
    return out


def wall(argv: list[str], root: str) -> float:
    env = {**os.environ, "PYTHONPATH": root}
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=env, cwd=root, capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{argv} in {root} exited {proc.returncode}: {proc.stderr[-500:]}")
    return elapsed


def importtime(root: str, top: int) -> list[tuple[float, float, str]]:
    """(cumulative s without torch, self s, name) of the slowest imports at depth 1-2.

    Depth 1-2 under ``import loopprobe`` are loopprobe's modules and what they import
    directly. torch is subtracted from the cumulative time of whichever module imports it
    first (it is the floor every variant pays), so the table shows what loopprobe adds.
    """
    env = {**os.environ, "PYTHONPATH": root}
    argv = [sys.executable, "-X", "importtime", "-c", "import loopprobe"]
    err = subprocess.run(argv, env=env, cwd=root, capture_output=True, text=True).stderr
    entries = []  # post-order: a module's nested imports are listed just before it
    for line in err.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, cum_us, name = line[len("import time:") :].split("|")
        depth = (len(name) - len(name.lstrip())) // 2
        entries.append((depth, name.strip(), int(self_us) / 1e6, int(cum_us) / 1e6))
    rows = []
    for i, (depth, name, own, cum) in enumerate(entries):
        torch_inside, k = 0.0, i - 1
        while k >= 0 and entries[k][0] > depth:  # the entries nested under this one
            if entries[k][1] == "torch":
                torch_inside += entries[k][3]
            k -= 1
        if 1 <= depth <= 2 and name != "torch":
            rows.append((cum - torch_inside, own, name))
    return sorted(rows, reverse=True)[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--baseline", default=None, help="another checkout to compare against")
    ap.add_argument("--top", type=int, default=12, help="rows of the importtime table")
    args = ap.parse_args()
    roots = {"after": ROOT} | ({"before": os.path.abspath(args.baseline)} if args.baseline else {})
    table = {side: cases(root) for side, root in roots.items()}
    names = list(table["after"])
    times: dict[tuple[str, str], list[float]] = {}
    for side in roots:
        wall(table[side]["import torch"], roots[side])  # warm the page cache
    for _ in range(args.repeats):
        for name in names:
            for side, root in roots.items():
                if name in table[side]:
                    times.setdefault((side, name), []).append(wall(table[side][name], root))
    load = os.getloadavg()[0]
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cores, load average {load:.2f}")
    print(f"median wall time of {args.repeats} fresh processes (shared machine: absolute")
    print("times move with other load; the ratios much less)\n")
    head = f"{'case':38s} {'after':>8s}"
    if "before" in roots:
        head += f" {'before':>8s} {'after/before':>13s}"
    print(head + "   target")
    for name in names:
        after = times[("after", name)]
        line = f"{name:38s} {statistics.median(after):7.2f}s"
        if ("before", name) in times:
            before = times[("before", name)]
            ratio = statistics.median(a / b for a, b in zip(after, before, strict=True))
            line += f" {statistics.median(before):7.2f}s {ratio:12.2f}x"
        elif "before" in roots:
            line += f" {'-':>8s} {'-':>13s}"
        target = "< 2 s" if name.startswith("loopprobe") else ""
        print(line + ("   " + target if target else ""))
    for side in roots:
        torch_t = [t for t in times[(side, "import torch")]]
        # since names load on first use, the honest figure is the first use of an estimator
        key = "import loopprobe; lp.visit_alignment"
        lp_t = times.get((side, key)) or times[(side, "import loopprobe")]
        beyond = statistics.median(a - b for a, b in zip(lp_t, torch_t, strict=True))
        print(f"\n[{side}] {key} beyond import torch: {beyond:.2f} s (target <= ~0.5 s)")
    for side, root in roots.items():
        print(f"\n[{side}] python -X importtime -c 'import loopprobe': slowest imports made by")
        print("loopprobe's modules (depth 1-2; cumulative: what they import, torch excluded)")
        for cum, own, name in importtime(root, args.top):
            print(f"  {cum:6.3f} s cumulative {own:6.3f} s self  {name}")


if __name__ == "__main__":
    main()
