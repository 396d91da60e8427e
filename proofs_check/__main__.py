"""``python -m proofs_check [--json] [--thorough] [--only TEXT]``: run every check.

Prints one row per check and a summary; exits 1 when any statement does not pass or any
wrong variant does not fail (or a check crashes), else 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import proofs_check as pc


def table(results: list[pc.Result]) -> str:
    head = ("statement", "reference", "method", "status", "figure")
    rows = []
    for r in results:
        name = r.statement if r.kind == "statement" else f"wrong: {r.statement}"
        status = r.status if r.ok else f"{r.status.upper()} (expected {r.expected})"
        if r.ok and r.kind != "statement":
            status = "fail (expected)"
        rows.append((name, r.reference, r.method, status, r.figure))
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(4)] + [0]

    def line(cells: tuple) -> str:
        parts = [c.ljust(w) if w else c for c, w in zip(cells, widths, strict=True)]
        return "  ".join(parts).rstrip()

    out = [line(head), line(tuple("-" * max(w, 6) for w in widths))]
    out += [line(r) for r in rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m proofs_check", description=__doc__)
    ap.add_argument("--json", action="store_true", help="print a JSON list of result objects")
    ap.add_argument(
        "--thorough", action="store_true", help="more hypothesis examples, wider sweeps"
    )
    ap.add_argument(
        "--only", default=None, help="run only checks whose name or module contains this"
    )
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    results = pc.run_all("thorough" if args.thorough else "ci", only=args.only)
    elapsed = time.perf_counter() - t0
    bad = [r for r in results if not r.ok]
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=1))
    else:
        print(table(results))
        n_stat = sum(r.kind == "statement" for r in results)
        n_wrong = len(results) - n_stat
        print(
            f"\n{n_stat} statements, {n_wrong} wrong variants; {len(bad)} not as expected; "
            f"{elapsed:.1f} s ({'thorough' if args.thorough else 'ci'} profile)"
        )
        for r in bad:
            print(f"\n--- {r.statement} [{r.module}]: {r.status}, expected {r.expected}")
            print(f"{r.figure}\n{r.note}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
