"""``loopprobe theory``: the predicted scales and bounds for a looped configuration.

Example::

    loopprobe theory --K 2 --R 4                 # aligned table, DeepNorm vs DeepLoop
    loopprobe theory --K 2 --R 4 --p 0.4 --json  # plus the general exponent, as JSON
    loopprobe theory --K 2 --R 4 --C 3 --K-H 1 --C-L 4 --K-L 1   # plus HRM counts

Reference: seed 002, Eqs. 5, 8, 10, 14-18 and 21.
"""

from __future__ import annotations

import argparse

from loopprobe import theory
from loopprobe.cli._common import emit, text_table

_HRM_ARGS = ("C", "K_H", "C_L", "K_L")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "theory",
        help="predicted alpha, beta, M and perturbation bounds for K blocks x R rounds",
        description=(
            "Closed forms of the DeepLoop derivation (seed 002): alpha, beta, beta/alpha, "
            "N = KR, M = 2KR, the untied bound M(beta/alpha)^2 and the aligned tied bound "
            "M R (beta/alpha)^2, for DeepNorm (p=1/4), DeepLoop (p=1/2) and optionally a "
            "general exponent p. The HRM arguments (all four together) add the forward and "
            "gradient-visible visit counts and the kappa_bar_g range (Eqs. 17-21)."
        ),
    )
    parser.add_argument("--K", type=int, required=True, help="physical blocks")
    parser.add_argument("--R", type=int, required=True, help="rounds (loop count)")
    parser.add_argument("--p", type=float, default=None, help="general family exponent p > 0")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    hrm = parser.add_argument_group("hierarchical (HRM-style) counts")
    hrm.add_argument("--C", type=int, default=None, help="outer cycles")
    hrm.add_argument("--K-H", dest="K_H", type=int, default=None, help="blocks in module H")
    hrm.add_argument("--C-L", dest="C_L", type=int, default=None, help="L iterations per cycle")
    hrm.add_argument("--K-L", dest="K_L", type=int, default=None, help="blocks in module L")
    parser.set_defaults(func=run, uses_torch=False)


def scheme_row(K: int, R: int, norm: str, p: float | None = None) -> dict:
    """One scheme's scales, counts and bounds at ``N = K R`` (plain floats and ints)."""
    N, M = theory.unrolled_depth(K, R), theory.visit_count(K, R)
    sc = theory.scales(N, norm, p=p)
    return {
        "p": sc.p,
        "alpha": sc.alpha,
        "beta": sc.beta,
        "ratio": sc.ratio,
        "N": N,
        "M": M,
        "untied_bound": theory.untied_bound(N, sc),
        "aligned_tied_bound": theory.aligned_tied_bound(K, R, sc),
        "bound_exponent_decorrelated": theory.bound_exponent(sc.p, 0.0),
        "bound_exponent_aligned": theory.bound_exponent(sc.p, 1.0),
    }


def hierarchical_report(C: int, K_H: int, C_L: int, K_L: int, p: float | None) -> dict:
    """HRM counts plus, per scheme at ``N_g``, the bound ``M_g kappa_bar (beta/alpha)^2`` range."""
    counts = theory.hierarchical_counts(C, K_H, C_L, K_L)
    lo, hi = counts["kappa_bar_range"]
    report = dict(counts, kappa_bar_range=[lo, hi])
    schemes = [("deepnorm", None), ("deeploop", None)] + ([("postp", p)] if p is not None else [])
    for norm, q in schemes:
        sc = theory.scales(counts["N_g"], norm, p=q)
        report["p" if norm == "postp" else norm] = {
            "p": sc.p,
            "alpha": sc.alpha,
            "beta": sc.beta,
            "ratio": sc.ratio,
            "bound_range": [theory.bound(counts["M_g"], k, sc.ratio) for k in (lo, hi)],
        }
    return report


def build_report(args: argparse.Namespace) -> dict:
    report = {
        "K": args.K,
        "R": args.R,
        "deepnorm": scheme_row(args.K, args.R, "deepnorm"),
        "deeploop": scheme_row(args.K, args.R, "deeploop"),
    }
    if args.p is not None:
        report["p"] = scheme_row(args.K, args.R, "postp", p=args.p)
        report["p_threshold"] = {
            "decorrelated": theory.exponent_threshold(0.0),
            "aligned": theory.exponent_threshold(1.0),
        }
    given = [name for name in _HRM_ARGS if getattr(args, name) is not None]
    if given and len(given) != len(_HRM_ARGS):
        missing = ", ".join("--" + n.replace("_", "-") for n in _HRM_ARGS if n not in given)
        raise ValueError(f"hierarchical counts need --C, --K-H, --C-L and --K-L; missing {missing}")
    if given:
        report["hierarchical"] = hierarchical_report(args.C, args.K_H, args.C_L, args.K_L, args.p)
    return report


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def format_table(report: dict) -> str:
    """The report as aligned plain-text tables (one row per scheme)."""
    head = ["scheme", "p", "alpha", "beta", "beta/alpha", "N", "M", "M(b/a)^2", "MR(b/a)^2"]
    rows = []
    for key in ("deepnorm", "deeploop", "p"):
        if key in report:
            r = report[key]
            name = "postp" if key == "p" else key
            rows.append([name, _fmt(r["p"]), _fmt(r["alpha"]), _fmt(r["beta"]), _fmt(r["ratio"])]
                        + [str(r["N"]), str(r["M"])]
                        + [_fmt(r["untied_bound"]), _fmt(r["aligned_tied_bound"])])  # fmt: skip
    lines = [f"K={report['K']} physical blocks, R={report['R']} rounds (seed 002, Eqs. 5-16)"]
    lines += text_table(head, rows)
    if "p_threshold" in report:
        t = report["p_threshold"]
        lines.append(
            f"bounded iff p >= {_fmt(t['decorrelated'])} (decorrelated) or "
            f"p >= {_fmt(t['aligned'])} (aligned); Prop. 3.1"
        )
    if "hierarchical" in report:
        h = report["hierarchical"]
        lo, hi = h["kappa_bar_range"]
        lines += [
            "",
            f"hierarchical: C={h['C']} K_H={h['K_H']} C_L={h['C_L']} K_L={h['K_L']} "
            "(seed 002, Eqs. 17-21)",
            f"M={h['M']} forward visits, M_g={h['M_g']} gradient-visible, N_g={h['N_g']}, "
            f"kappa_bar_g in [{_fmt(lo)}, {_fmt(hi)}]",
        ]
        hrows = []
        for key in ("deepnorm", "deeploop", "p"):
            if key in h:
                r = h[key]
                b_lo, b_hi = r["bound_range"]
                name = "postp" if key == "p" else key
                hrows.append(
                    [name, _fmt(r["p"]), _fmt(r["ratio"]), f"[{_fmt(b_lo)}, {_fmt(b_hi)}]"]
                )
        lines += text_table(["scheme", "p", "beta/alpha", "M_g kappa_bar (b/a)^2"], hrows)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    return emit(build_report(args), args.json, format_table)
