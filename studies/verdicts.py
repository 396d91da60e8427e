"""Every study's verdicts in one committed table, ``studies/verdicts.csv`` (the report's source).

:func:`collect` applies each study's own analysis and pre-stated criteria to its committed
cells and returns tables, :class:`~loopprobe.report.verdicts.Verdict` objects and notes;
:func:`write` saves the verdicts (one row per claim: ``study, claim, verdict, measured,
expected, why``) to ``studies/verdicts.csv``, which ``loopprobe report`` reads in its
``reproductions`` section (``--studies DIR``), so the report needs no study code.
``python -m studies`` rewrites it; ``tests/test_study_verdicts.py`` recomputes it from the cells
and compares, so the committed table cannot drift from the analysis.

A new study adds its judge to :data:`studies.judges.STUDIES` (cells CSV -> tables, verdicts,
notes); its verdicts then land here with its folder name as ``study``.
"""

from __future__ import annotations

import math
import pathlib

import pandas as pd

from loopprobe.report.verdicts import FAILS, HOLDS, UNKNOWN, Verdict
from studies import scope
from studies.judges import issue30_studies
from studies.lr_transfer.analysis import (
    LR_RUNS,
    MARGIN,
    PREDICTED_DRIFT,
    lr_claim,
    lr_contrast,
    lr_contrast_sensitivity,
    lr_divergence,
    lr_drift,
    lr_loop_cost,
    lr_rule_gap,
)
from studies.reachability.analysis import reach_claims, reach_outer_norm_effect, reach_summary
from studies.reachability.analysis64 import study_claims, study_summary
from studies.reachability.analysis_redesign import redesign_claims, redesign_summary

#: The studies tree (this package) and its verdict table.
HERE = pathlib.Path(__file__).resolve().parent
VERDICTS = HERE / "verdicts.csv"
COLUMNS = ["study", "claim", "verdict", "measured", "expected", "why"]
STUDY_CELLS = "reach_runs.csv"  # the 64-input reachability study (studies/reachability/run.py)
REDESIGN_CELLS = "reach_redesign.csv"  # its redesign (studies/reachability/redesign.py)


def collect(root: pathlib.Path = HERE) -> tuple[list, list[tuple[str, Verdict]], list[str]]:
    """Tables, ``(study, verdict)`` pairs and notes of every study whose cells are under
    ``root`` (the studies tree: ``root/<study>/<cells>.csv``)."""
    root = pathlib.Path(root)
    lr_dir, reach_dir = root / "lr_transfer", root / "reachability"
    found = [r for r, spec in LR_RUNS.items() if (lr_dir / spec["cells"]).exists()]
    reach_path = reach_dir / "reachability_study.csv"
    study_path = reach_dir / STUDY_CELLS
    tables: list[tuple[str, pd.DataFrame]] = []
    verdicts: list[tuple[str, Verdict]] = []
    notes = [f"cached cells: {root}"]
    divs: list[dict] = []
    tested = None
    for run in found:
        spec = LR_RUNS[run]
        cells = pd.read_csv(lr_dir / spec["cells"])
        table = lr_drift(cells, half_width=spec["half_width"])
        contrast = lr_contrast(cells, half_width=spec["half_width"])
        tables.append((f"LR transfer, run {run}: optimum drift N = 1 → 8 (octaves)", table))
        claim = lr_claim(table)
        notes.append(
            f"LR transfer run {run}: claim {claim}; contrast drift(1/√N) − drift(1/N) "
            f"{contrast['contrast']:+.2f} [{contrast['ci_low']:+.2f}, {contrast['ci_high']:+.2f}]"
            f" ({'pre-stated' if spec['contrast_prestated'] else 'post hoc'}: "
            f"{contrast['verdict']})"
        )
        sens, statement = lr_contrast_sensitivity(cells, half_width=spec["half_width"])
        tables.append((f"LR transfer, run {run}: the contrast under three vertex estimators",
                       sens))  # fmt: skip
        notes.append(f"LR transfer run {run}, contrast: {statement}")
        lr = _lr_verdicts(run, table, contrast, spec["contrast_prestated"], sens)
        divs.append(lr_divergence(cells))
        cost = lr_loop_cost(cells)
        tables.append((f"LR transfer, run {run}: loss at the optimum, N = 8 minus N = 1 (nats)",
                       cost))  # fmt: skip
        if spec["contrast_prestated"]:
            tested = (run, cost, sens)
            lr.append(_rule_gap_verdict(run, lr_rule_gap(cells)))
        verdicts += [("lr_transfer", v) for v in lr]
    if tested is not None:
        div = {k: sum(d[k] for d in divs) for k in ("rows", "trainings", "diverged")}
        notes.append(_what_was_tested(*tested, div=div, runs=len(divs)))
    if reach_path.exists():
        runs = pd.read_csv(reach_path)
        claims = reach_claims(runs)
        tables.append(("Fixed-point reachability per task, recall and outer norm",
                       reach_summary(runs)))  # fmt: skip
        tables.append(("Reachability claims", claims))
        effect = reach_outer_norm_effect(runs)
        tables.append(("Reachability: which factor makes a fixed point reachable (Fisher)",
                       effect))  # fmt: skip
        reach = _reach_effect_verdicts(effect)
        mapping = {"holds": HOLDS, "fails": FAILS, "undecided": UNKNOWN}
        reach += [
            Verdict(
                "reproductions",
                r["claim"],
                mapping.get(r["verdict"], UNKNOWN),
                r["measured"] if r["verdict"] in mapping else f"{r['measured']}; {r['verdict']}",
                r["expected"],
            )  # fmt: skip
            for r in claims.to_dict("records")
        ]
        verdicts += [("reachability", v) for v in reach]
    if study_path.exists():
        runs = pd.read_csv(study_path)
        claims = study_claims(runs)
        tables.append(("Reachability on 64 inputs per run (issue 30.3)", study_summary(runs)))
        tables.append(("Reachability on 64 inputs per run: pre-stated claims", claims))
        verdicts += [("reachability", v) for v in _study_verdicts(claims)]
        cpu = runs[["cpu_train_s", "cpu_probe_s"]].sum() / 60
        notes.append(f"64-input reachability study: {len(runs)} runs, {cpu.sum():.1f} CPU-min "
                     f"(training {cpu['cpu_train_s']:.1f}, probe {cpu['cpu_probe_s']:.1f}); "
                     "design and criteria: docs/studies/reachability.md")  # fmt: skip
    if (reach_dir / REDESIGN_CELLS).exists():
        runs = pd.read_csv(reach_dir / REDESIGN_CELLS)
        claims = redesign_claims(runs)
        tables.append(("Reachability redesign: pre-norm + outer norm vs post-norm (issue 39.4)",
                       redesign_summary(runs)))  # fmt: skip
        tables.append(("Reachability redesign: pre-stated claims", claims))
        verdicts += [("reachability", v) for v in _study_verdicts(claims, "redesign")]
        cpu = runs[["cpu_train_s", "cpu_probe_s"]].sum() / 60
        notes.append(f"reachability redesign: {len(runs)} runs, {cpu.sum():.1f} CPU-min "
                     f"(training {cpu['cpu_train_s']:.1f}, probe {cpu['cpu_probe_s']:.1f}); "
                     "design and criteria: docs/studies/reachability.md")  # fmt: skip
    more_tables, more_verdicts, more_notes = issue30_studies(root)
    tables += more_tables
    verdicts += more_verdicts
    notes += more_notes
    verdicts = [(study, scope.worded(study, v)) for study, v in verdicts]  # issue 39.7
    return tables, verdicts, notes


def frame(verdicts: list[tuple[str, Verdict]]) -> pd.DataFrame:
    """The verdict table: one row per claim, columns :data:`COLUMNS`."""
    rows = [{"study": study, **{k: getattr(v, k) for k in COLUMNS[1:]}} for study, v in verdicts]
    return pd.DataFrame(rows, columns=COLUMNS)


def write(path: pathlib.Path = VERDICTS, root: pathlib.Path = HERE) -> pd.DataFrame:
    """Recompute every verdict from the cells under ``root`` and save the table at ``path``."""
    table = frame(collect(root)[1])
    table.to_csv(path, index=False)
    return table


def _study_verdicts(claims: pd.DataFrame, name: str = "64-input study") -> list:
    """A reachability study's claims as verdicts (``undecided (why)`` keeps its reason)."""
    mapping = {"holds": HOLDS, "fails": FAILS}
    return [
        Verdict(
            "reproductions",
            f"{name}: {r['claim']}",
            mapping.get(r["verdict"], UNKNOWN),
            r["measured"],
            f"{r['expected']} (pre-stated, docs/studies/reachability.md)",
            "" if r["verdict"] in mapping else r["verdict"],
        )  # fmt: skip
        for r in claims.to_dict("records")
    ]


def _ci(lo: float, hi: float, digits: int = 2) -> str:
    return f"[{lo:+.{digits}f}, {hi:+.{digits}f}]"


def _what_was_tested(run: int, cost: pd.DataFrame, sens: pd.DataFrame, *, div: dict,
                     runs: int) -> str:  # fmt: skip
    """Issue 27's scope statement for the LR-transfer claim, from the figures: divergence over
    every run's cells, the loop cost and the contrast's sensitivity from the pre-stated run."""
    c = cost.set_index("arm")
    losses = "; ".join(f"{a} {r['gap']:+.2f} {_ci(r['ci_low'], r['ci_high'])}"
                       for a, r in c.iterrows())  # fmt: skip
    ex = sens["excludes_bound"]
    bound = "the bound-based prediction (−1.5 oct) is excluded at d 32"
    if not ex.all():
        rest = "; ".join(f"{r['estimator']}: {r['verdict']}" for r in sens[~ex].to_dict("records"))
        bound += f" by the {' and '.join(sens.loc[ex, 'estimator']) or 'no'} vertex only ({rest})"
    worse = bool((c["ci_low"] > 0).all())
    untested = div["diverged"] == 0 and worse
    return (
        f"LR transfer, what was tested: {div['diverged']} of {div['trainings']} trainings "
        f"({runs} run{'s' if runs > 1 else ''}, {div['rows']} cells) diverged, so the stability "
        f"bound behind the −1.5 prediction "
        f"{'never came into play' if div['diverged'] == 0 else 'was reached'}; in run {run} the "
        f"loss at the optimum, N = 8 minus N = 1 (nats): {losses} "
        f"({'worse at every rule' if worse else 'not worse at every rule'}; the paper "
        f"has loops helping). {'The paper’s claim is untested at this scale; ' if untested else ''}"
        f"{bound}."
    )


def _rule_gap_verdict(run: int, gap: dict) -> Verdict:
    v = {"1/N better": HOLDS, "1/sqrt(N) better": FAILS}.get(gap["verdict"], UNKNOWN)
    return Verdict(
        "reproductions", f"run {run}, N = {gap['N']}: 1/N gives a lower loss than 1/√N",
        v, f"loss(1/√N) − loss(1/N) at each rule's best grid lr = {gap['gap']:+.3f} "
        f"{_ci(gap['ci_low'], gap['ci_high'], 3)} nats, {gap['seeds']} seeds paired "
        "(paper: 0.025 at L 12)", "95 % interval above 0 (stated after the data, issue 27)",
        "" if v != UNKNOWN else "the interval contains 0")  # fmt: skip


def _reach_effect_verdicts(effect: pd.DataFrame) -> list:
    out = []
    r = effect.iloc[0]  # outer norm on vs off
    v = UNKNOWN if r["verdict"] != "differs" else (
        HOLDS if r["frac_with"] > r["frac_without"] else FAILS)  # fmt: skip
    out.append(Verdict("reproductions", "outer norm is what makes fixed points reachable", v,
                       f"reached with outer norm {r['with']}, without {r['without']}; Fisher "
                       f"p = {r['p']:.2g}", "more reached with it, two-sided Fisher p < 0.05 "
                       "(stated after the data, issue 27)",
                       "" if v != UNKNOWN else r["verdict"]))  # fmt: skip
    r = effect.iloc[1]  # with outer norm: recall vs none
    v = FAILS if r["verdict"] == "differs" else UNKNOWN
    out.append(Verdict("reproductions", "with outer norm on, recall does not change "
                       "reachability", v, f"reached with recall (add, internal) {r['with']}, "
                       f"without {r['without']}; Fisher p = {r['p']:.2g}",
                       "no difference (a difference: p < 0.05, two-sided Fisher; stated after "
                       "the data, issue 27)", "" if v != UNKNOWN else
                       "no difference detected, which is not evidence of none: with "
                       f"{r['with'].split('/')[1]} and {r['without'].split('/')[1]} runs only "
                       "a large difference could show"))  # fmt: skip
    return out


def _lr_verdicts(run: int, table: pd.DataFrame, contrast: dict, prestated: bool,
                 sens: pd.DataFrame | None = None) -> list:  # fmt: skip
    out = []
    for r in table.to_dict("records"):
        arm, predicted = r["arm"], PREDICTED_DRIFT.get(r["arm"], math.nan)
        expect = "drifts" if predicted != 0 else "stays"
        measured = f"drift {r['drift']:+.2f} [{r['ci_low']:+.2f}, {r['ci_high']:+.2f}] oct"
        verdict = UNKNOWN if r["verdict"] not in ("stays", "drifts") else (
            HOLDS if r["verdict"] == expect else FAILS)  # fmt: skip
        why = "" if verdict != UNKNOWN else (
            "optimum off the grid in > 10 % of resamples" if "grid" in r["verdict"] else
            f"the interval straddles the margin ({MARGIN:g} oct)")  # fmt: skip
        out.append(Verdict("reproductions", f"run {run}, {arm}: the optimal lr {expect} from "
                           "N = 1 to 8", verdict, measured, f"{predicted:+.1f} oct "
                           f"(margin {MARGIN:g})", why))  # fmt: skip
    if prestated:
        v = contrast["verdict"]
        verdict = {"differ as predicted": HOLDS, "do not differ as predicted": FAILS}.get(
            v, UNKNOWN
        )
        others = "" if sens is None else "; ".join(
            f"{r['estimator']} vertex: {r['contrast']:+.2f} {_ci(r['ci_low'], r['ci_high'])}, "
            f"{r['verdict']}" for r in sens.iloc[1:].to_dict("records"))  # fmt: skip
        out.append(Verdict(
            "reproductions", f"run {run}: 1/√N moves the optimum more than 1/N does",
            verdict, f"drift(1/√N) − drift(1/N) = {contrast['contrast']:+.2f} "
            f"[{contrast['ci_low']:+.2f}, {contrast['ci_high']:+.2f}] oct",
            f"{contrast['predicted']:+.1f} (beyond {contrast['predicted'] / 2:+.2f})",
            f"pre-stated argmin-window vertex; sensitivity: {others}" if others else "",
        ))  # fmt: skip
        if sens is not None:
            every = bool(sens["excludes_bound"].all())
            some = ", ".join(sens.loc[sens["excludes_bound"], "estimator"]) or "none"
            out.append(Verdict(
                "reproductions", f"run {run}: 1/√N moves the optimum {-contrast['predicted']:.1f}"
                " octave further than 1/N (the stability bound's prediction), every vertex "
                "estimator", FAILS if every else UNKNOWN, "excluded under: " + some
                + "; lows " + ", ".join(f"{x:+.2f}" for x in sens["ci_low"]),
                f"{contrast['predicted']:+.1f} inside the contrast's 95 % interval",
                "" if every else "not excluded under every estimator"))  # fmt: skip
    return out
