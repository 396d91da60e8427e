"""Issue 29.5: CPU time of the default ``loopprobe report``, before and after, per section.

For each tree (``--baseline DIR``, e.g. ``git worktree add /tmp/report_base HEAD``, then this
checkout) one fresh subprocess on one thread (``OMP_NUM_THREADS=1``,
``torch.set_num_threads(1)``) imports that tree's ``loopprobe`` and runs the default report
(the reference LoopedGPT, :class:`ReportConfig` defaults, a fresh ``--out``, so no cached
cell is reused) one section at a time in page order, as ``loopprobe report`` runs them. It
records each section's CPU time (``time.process_time``, which includes drawing its figures
and writing its files) and the subprocess's total CPU time (user + sys, from
``getrusage(RUSAGE_CHILDREN)``: imports included). CPU time, not wall time: the machine is
shared, and one thread's CPU time is still the cost, though a loaded machine inflates it
(caches, frequency), so compare the two trees' numbers of one run, not runs on other days.

It then compares the two ``results.json`` files number by number (``runtime_s`` and the
timestamps left out) and prints the largest relative difference and where it is.

    git worktree add /tmp/report_base HEAD
    nice -n 19 .venv/bin/python benchmarks/bench_report.py --baseline /tmp/report_base
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

WORKER = r"""
import json, sys, time
t0 = time.process_time()
import torch
torch.set_num_threads(1)
from loopprobe import report
out, keys = sys.argv[1], sys.argv[2].split(",") if sys.argv[2] else None
t_import = time.process_time() - t0
cpu = {}
for s in report.SECTIONS:
    if keys and s.key not in keys:
        continue
    t = time.process_time()
    report.run_report(out, report.ReportConfig(), sections=[s.key], progress=False,
                      command="loopprobe report", echo=lambda line: None)
    cpu[s.key] = time.process_time() - t
print(json.dumps({"import": t_import, "sections": cpu}))
"""

SKIP = {"runtime_s", "created", "out", "loopprobe_version"}


def run_tree(tree: str, sections: str) -> dict:
    out = tempfile.mkdtemp(prefix="bench_report_")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=tree)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, out, sections],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: the report failed:\n{proc.stderr[-3000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["total"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    res["results"] = json.loads(open(os.path.join(out, "results.json")).read())
    res["out"] = out
    return res


def numbers(obj, path: str = "") -> dict[str, float]:
    """Every number in a JSON tree by its path (``SKIP`` keys left out)."""
    found: dict[str, float] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k not in SKIP:
                found |= numbers(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            found |= numbers(v, f"{path}[{i}]")
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        found[path] = float(obj)
    return found


def compare(a: dict, b: dict) -> tuple[int, int, float, str, list[str]]:
    """(numbers compared, numbers differing, largest relative difference, where, only one side)."""
    na, nb = numbers(a), numbers(b)
    worst, where, differ = 0.0, "", 0
    for k in na.keys() & nb.keys():
        x, y = na[k], nb[k]
        if (math.isnan(x) and math.isnan(y)) or x == y:
            continue
        differ += 1
        rel = abs(x - y) / max(abs(x), abs(y), 1e-300)
        if rel > worst:
            worst, where = rel, k
    return len(na.keys() & nb.keys()), differ, worst, where, sorted(na.keys() ^ nb.keys())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="the 'before' tree (a git worktree)")
    ap.add_argument("--after", default=ROOT, help="the 'after' tree (default: this checkout)")
    ap.add_argument("--sections", default="", help="comma-separated subset (default: all)")
    args = ap.parse_args()
    trees = {"before": os.path.abspath(args.baseline), "after": os.path.abspath(args.after)}
    runs = {name: run_tree(tree, args.sections) for name, tree in trees.items()}
    b, a = runs["before"], runs["after"]
    print(f"{'CPU-s, one thread':<18}{'before':>9}{'after':>9}{'after/before':>14}")
    rows = [("import", b["import"], a["import"])]
    rows += [(k, v, a["sections"].get(k, math.nan)) for k, v in b["sections"].items()]
    rows += [("total (process)", b["total"], a["total"])]
    for name, x, y in rows:
        print(f"{name:<18}{x:>9.2f}{y:>9.2f}{y / x if x else math.nan:>14.2f}")
    n, differ, worst, where, one_side = compare(b["results"], a["results"])
    print(f"results.json: {n} numbers compared, {differ} differ; largest relative "
          f"difference {worst:.3g}{f' at {where}' if where else ''}")  # fmt: skip
    if one_side:
        print(f"on one side only ({len(one_side)}): {one_side[:10]}")
    print(f"outputs: before {b['out']}, after {a['out']}")


if __name__ == "__main__":
    main()
