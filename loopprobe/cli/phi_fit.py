"""``loopprobe phi-fit``: fit the iso-depth joint law and phi (how much one recurrence is worth).

Example::

    loopprobe phi-fit runs.csv                       # law, phi with 95% CI, restricted fits
    loopprobe phi-fit runs.csv --bootstrap 200 --plot phi.png --json

``runs.csv``: one row per training run with columns ``loss, r, n_once, n_rec, tokens,
budget`` (+ optional ``arch``, ``seed``). Reference: seed 001 (arXiv 2604.21106), Eq. 3-4.
"""

from __future__ import annotations

import argparse
import pathlib
from typing import TYPE_CHECKING

from loopprobe.cli._common import add_json_arg, check_writable, emit, text_table

if TYPE_CHECKING:
    import pandas as pd


#: the CSV columns of a run (tests check them against loopprobe.estimate.scaling_law.COLUMNS;
#: listed here so that --help does not import scipy and torch)
COLUMNS = ("loss", "r", "n_once", "n_rec", "tokens", "budget")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "phi-fit",
        help="fit L = E + A (N_once + r^phi N_rec)^-alpha + B D^-beta and phi with a CI",
        description=(
            "Fit the joint iso-depth law of arXiv 2604.21106 (Huber 1e-3 on log loss, LSE "
            "form, L-BFGS-B with restarts) to a CSV of runs; report phi with a block-bootstrap "
            "CI over (budget, arch) cells, the restricted phi = 0 / phi = 1 fits, and the "
            f"residuals per architecture. Columns: {', '.join(COLUMNS)} (+ arch, seed)."
        ),
    )
    parser.add_argument("csv", help="runs CSV")
    parser.add_argument("--bootstrap", type=int, default=200, help="resamples (0: no CI)")
    parser.add_argument("--restarts", type=int, default=8, help="random starts per fit")
    parser.add_argument("--seed", type=int, default=0, help="seed of starts and resamples")
    parser.add_argument(
        "--max-ci-width", type=float, default=1.0,
        help="a phi CI wider than this means phi is not identified (default 1)",
    )  # fmt: skip
    parser.add_argument("--plot", default=None, help="write loss vs N_eff with the law (PNG)")
    add_json_arg(parser)
    parser.set_defaults(func=run)


def _read(path: str) -> pd.DataFrame:
    import pandas as pd

    p = pathlib.Path(path)
    if not p.is_file():
        raise ValueError(f"{path}: no such file; give the path of a runs CSV")
    try:
        return pd.read_csv(p)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not a readable CSV ({err})") from None


def run(args: argparse.Namespace) -> int:
    from loopprobe.estimate import scaling

    if args.plot:
        check_writable(args.plot, "--plot")  # before the fit, not after it
    df = _read(args.csv)
    fit = scaling.fit_recurrence_law(
        df, bootstrap=args.bootstrap, restarts=args.restarts, seed=args.seed,
        max_ci_width=args.max_ci_width,
    )  # fmt: skip
    if args.plot:
        fit.plot().savefig(args.plot, dpi=110)
    per_arch = (
        fit.residuals.groupby("arch")["residual"]
        .agg(
            n="size",
            mean="mean",
            max_abs=lambda v: v.abs().max(),
            rmse=lambda v: (v**2).mean() ** 0.5,
        )
        .reset_index()
    )
    report = fit.summary() | {"csv": args.csv, "per_arch": per_arch.to_dict("records")}
    if not fit.identified:  # the estimate stays available, under a name that says so
        report["phi_unidentified"] = report.pop("phi")
        report["phi"] = None
        if "ci" in report:
            report["ci_unidentified"] = report.pop("ci")
    if args.plot:
        report["plot"] = args.plot
    return emit(report, args.json, _text)


def _text(rep: dict) -> str:
    ci = rep.get("ci", {}).get("phi")
    if rep["identified"]:
        phi = f"phi = {rep['phi']:.3f}" + (f"  95% CI [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")
    else:
        phi = f"phi not identified: {rep['identification']}"
    lines = [
        f"joint law on {rep['n']} runs: L = E + A (N_once + r^phi N_rec)^-alpha + B D^-beta",
        phi,
        f"A = {rep['A']:.4g}  alpha = {rep['alpha']:.3f}  B = {rep['B']:.4g}  "
        f"beta = {rep['beta']:.3f}  E = {rep['E']:.3f}",
        f"R^2 = {rep['r2']:.4f}  RMSE = {rep['rmse']:.4f} nats  Huber = {rep['huber']:.3e}  "
        f"converged = {rep['converged']} ({rep['reason']})",
        "",
    ]
    shown = f"{rep['phi']:.3f}" if rep["identified"] else "not identified"
    rows = [["phi free", shown, f"{rep['alpha']:.3f}", f"{rep['beta']:.3f}",
             f"{rep['E']:.3f}", f"{rep['r2']:.4f}"]]  # fmt: skip
    for name, r in rep.get("restricted", {}).items():
        rows.append([name, f"{r['phi']:.3f}", f"{r['alpha']:.3f}", f"{r['beta']:.3f}",
                     f"{r['E']:.3f}", f"{r['r2']:.4f}"])  # fmt: skip
    lines += text_table(["form", "phi", "alpha", "beta", "E", "R^2"], rows) + [""]
    rows = [[a["arch"], str(a["n"]), f"{a['mean']:+.4f}", f"{a['max_abs']:.4f}", f"{a['rmse']:.4f}"]
            for a in rep["per_arch"]]  # fmt: skip
    lines += text_table(["arch", "n", "mean resid", "max |resid|", "RMSE"], rows)
    if rep.get("per_arch_fits"):
        rows = [[k, str(f["n"]), f"{f['A']:.4g}", f"{f['alpha']:.3f}", f"{f['B']:.4g}",
                 f"{f['beta']:.3f}", f"{f['E']:.3f}", f"{f['r2']:.4f}",
                 "yes" if f["converged"] else "no"]
                for k, f in rep["per_arch_fits"].items()]  # fmt: skip
        lines += ["", "per-architecture standard law L = E + A N^-alpha + B D^-beta "
                  "(N = N_once + N_rec)"]  # fmt: skip
        lines += text_table(["arch", "n", "A", "alpha", "B", "beta", "E", "R^2", "converged"],
                            rows)  # fmt: skip
    if rep.get("plot"):
        lines.append(f"plot: {rep['plot']}")
    return "\n".join(lines)
