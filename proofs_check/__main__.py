"""``python -m proofs_check [--json] [--thorough] [--only TEXT]``: run every check.

``--model pkg.mod:factory`` (with ``--inputs``, ``--loss``, ``--R``, ``--max-slope``,
``--C-max``) runs the statements about a model on your own family instead
(proofs_check/user_model.py).

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
    user = ap.add_argument_group("your own model family (runs only the statements about a model)")
    user.add_argument("--model", default=None, metavar="PKG.MOD:FACTORY", help="factory(R)")
    user.add_argument("--inputs", default=None, metavar="PKG.MOD:FN", help="fn(model) -> inputs")
    user.add_argument("--loss", default=None, metavar="PKG.MOD:FN", help="fn(output, inputs)")
    user.add_argument("--R", default="2,4,8", help="loop counts, comma-separated (2,4,8)")
    user.add_argument("--max-slope", type=float, default=None, help="claimed slope in R, upper")
    user.add_argument("--min-slope", type=float, default=None, help="claimed slope in R, lower")
    user.add_argument("--C-max", dest="C_max", type=float, default=None, help="claimed constant")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.model is not None:
        from proofs_check.user_model import run_user_model

        results = run_user_model(
            args.model,
            "thorough" if args.thorough else "ci",
            inputs=args.inputs,
            loss=args.loss,
            Rs=[int(r) for r in args.R.split(",")],
            max_slope=args.max_slope,
            min_slope=args.min_slope,
            C_max=args.C_max,
        )
    else:
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
