"""``python -m studies``: every study's tables and figures from its committed cells, then the
verdict table the report reads (no training; a minute or two).

    python -m studies                        # every study (--analyze), then studies/verdicts.csv
    python -m studies verdicts               # only recompute studies/verdicts.csv (seconds)
    python -m studies deeploop --analyze     # one study's tables and figure
    nice -n 19 python -m studies deeploop --cache DIR   # train its cells (hours; resumable)

``python -m studies NAME ...`` passes the options to ``studies/NAME/run.py`` (``--help`` lists
them). With no name each study's ``--analyze`` runs in its own process (one torch thread,
matplotlib's Agg backend), stopping at the first that fails.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time

from studies._common import ROOT

#: The pre-registered studies, in the order they are analysed: each is ``studies/<name>/``.
STUDIES = ("lr_transfer", "reachability", "deeploop", "lr_edge", "lr_l", "finite_step", "flt")


def analyze_all() -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    for name in STUDIES:
        print(f"== {name}", flush=True)
        t = time.perf_counter()
        cmd = [sys.executable, "-m", "studies", name, "--analyze"]
        rc = subprocess.call(cmd, env=env, cwd=ROOT)
        print(f"== {name}: exit {rc}, {time.perf_counter() - t:.1f} s", flush=True)
        if rc:
            return rc
    return write_verdicts()


def write_verdicts() -> int:
    from studies import verdicts

    table = verdicts.write()
    counts = table["verdict"].value_counts().to_dict()
    print(f"{len(table)} verdicts {counts} -> {verdicts.VERDICTS}", flush=True)
    return 0


def main(argv: list[str]) -> int:
    if not argv:
        return analyze_all()
    name, rest = argv[0], argv[1:]
    if name == "verdicts":
        return write_verdicts()
    if name not in STUDIES:
        print(f"unknown study {name!r}; choose from {', '.join(STUDIES)} or 'verdicts'",
              file=sys.stderr)  # fmt: skip
        return 2
    sys.argv[0] = f"python -m studies {name}"  # what argparse names in --help and errors
    importlib.import_module(f"studies.{name}.run").main(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
