"""Every study's tables and figures from its committed CSVs (no training; about a minute).

    python scripts/analyze_studies.py            # all of them
    python scripts/analyze_studies.py deeploop   # one (names below)

Each study keeps its own analysis (criteria fixed in its pre-registration under docs/studies/);
this runs them in turn, each in its own process, one torch thread, and stops at the first that
fails. The report's ``reproductions`` section reads the same CSVs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

STUDIES = {
    "lr_transfer+reachability": ["scripts/repro_analysis.py"],  # issue 17, 30.3
    "deeploop": ["scripts/deeploop_study.py", "--analyze"],  # issue 30.1
    "lr_edge": ["scripts/lr_edge_study.py", "--analyze"],  # issue 30.2
    "lr_l": ["scripts/lr_l_study.py", "--analyze"],  # issue 30.2 part 2
    "finite_step": ["scripts/finite_step_study.py", "--analyze"],  # issue 30.4
    "flt": ["scripts/flt_study.py", "--analyze"],  # issue 30.5
}


def main(names: list[str]) -> int:
    unknown = sorted(set(names) - set(STUDIES))
    if unknown:
        print(f"unknown study {unknown}; choose from {list(STUDIES)}", file=sys.stderr)
        return 2
    env = dict(os.environ, OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    for name in names or list(STUDIES):
        if not os.path.exists(STUDIES[name][0]):
            print(f"== {name}: {STUDIES[name][0]} not in this checkout, skipped", flush=True)
            continue
        print(f"== {name}", flush=True)
        t = time.perf_counter()
        rc = subprocess.call([sys.executable, *STUDIES[name]], env=env)
        print(f"== {name}: exit {rc}, {time.perf_counter() - t:.1f} s", flush=True)
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
