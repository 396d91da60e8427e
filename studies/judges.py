"""Each issue-30 study's judge: its cells -> tables, report verdicts and notes.

Each study's cells are committed in its folder (``studies/<study>/``) and its criteria are
fixed in its page under ``docs/studies`` (committed before its results). A judge applies the
study's own analysis (``studies.<study>.analysis``) to the cells and turns its verdicts into
:class:`~loopprobe.report.verdicts.Verdict` objects. The finite-step study's 2,000-resample
paired bootstrap takes half a minute, so its driver writes the verdicts next to its cells
(``finite_step_verdicts.csv``, from ``python -m studies finite_step --analyze``) and the
judge reads them. A study whose CSV is missing is left out with a note.

A new study: a folder with its driver and analysis, and one entry in :data:`STUDIES`.
"""

from __future__ import annotations

import pathlib

import pandas as pd

from loopprobe.report.verdicts import FAILS, HOLDS, UNKNOWN, Verdict

MAPPING = {"holds": HOLDS, "fails": FAILS}


def _verdict(study: str, claim: str, verdict: str, measured: str, page: str) -> Verdict:
    """A study's holds / fails / undecided (a reason after "undecided" is kept as ``why``)."""
    status = MAPPING.get(verdict.split(" ")[0], UNKNOWN)
    why = "" if status is not UNKNOWN else verdict
    return Verdict("reproductions", f"{study}: {claim}", status, measured,
                   f"pre-stated in docs/studies/{page}", why)  # fmt: skip


def deeploop(path: pathlib.Path) -> tuple[list, list[Verdict], list[str]]:
    """DeepLoop vs post-norm and DeepNorm across R, and the p-sweep (issue 30.1)."""
    from studies.deeploop import analysis as dl

    cells = pd.read_csv(path)
    table = dl.comparisons(cells)
    show = table[["baseline", "R", "n", "diff", "ci_low", "ci_high", "criterion", "verdict"]]
    sweep = dl.p_sweep(cells)
    boundary = dl.p_boundary(sweep)
    out = [
        _verdict(
            "DeepLoop",
            f"vs {b}: neutral at R = 1, better at R > 1",
            *dl.claim(table, b),
            "deeploop.md",
        )  # fmt: skip
        for b in ("post", "deepnorm")
    ]
    # Issue 39: the pre-registered criterion gives its verdict, but one R cannot test a
    # boundary that should hold at every depth, and "stays on the floor" mixes unstable runs
    # with slow ones: reported undecided, the pre-registered outcome kept in the reason.
    out.append(_verdict("DeepLoop", "p-sweep: stability boundary near p = 1/2",
                        "undecided (the design cannot decide it: a sweep at one R cannot test "
                        "a boundary meant for every depth, and 'escaped the floor' mixes "
                        f"unstable runs with slow ones; the pre-registered criterion gave "
                        f"'{boundary['verdict']}')", boundary["reason"],
                        "deeploop.md"))  # fmt: skip
    from studies.deeploop.redesign_analysis import redesign_verdicts  # issue 39.1

    more, redesign_notes = redesign_verdicts(path.parent)
    out += [_verdict("DeepLoop (redesign)", c, v, m, "deeploop.md") for c, v, m in more]
    cpu = cells.drop_duplicates(["arm", "p", "R", "seed"])["cpu_s"].sum() / 60
    tables = [("DeepLoop − baseline, final held-out loss (paired, 95 % t)", show),
              ("DeepLoop p-sweep at R = 3 (escaped the unigram floor)", sweep)]  # fmt: skip
    notes = [f"DeepLoop study: {cells.seed.nunique()} seeds, {cpu:.1f} CPU-min"]
    return tables, out, notes + redesign_notes


def lr_edge(path: pathlib.Path) -> tuple[list, list[Verdict], list[str]]:
    """The edge learning rate against N under 1/sqrt(N) and 1/N (issue 30.2)."""
    from studies.lr_edge import analysis as le

    cells = pd.read_csv(path)
    e = le.edges(cells)
    s = le.slopes(e)
    v, why = le.verdict(e, s)
    tables = [("LR edge: slope of log2 η_edge on log2 N (95 % t over seeds)", s)]
    from studies.lr_edge.posthoc import posthoc_verdicts
    from studies.lr_edge.redesign_analysis import redesign_verdicts  # issue 39.2

    more, redesign_notes = redesign_verdicts(path.parent)
    return (
        tables,
        [_verdict("LR edge", "slope −½ under 1/√N, 0 under 1/N", v, why, "lr_edge.md")]
        + posthoc_verdicts(cells)
        + [_verdict("LR edge (redesign)", c, rv, m, "lr_edge.md") for c, rv, m in more],
        [f"LR-edge study: {cells.seed.nunique()} seeds"] + redesign_notes,
    )


def lr_l(path: pathlib.Path) -> tuple[list, list[Verdict], list[str]]:
    """The optimal lr against L and N under Loop-muP (issue 30.2 part 2): the task search,
    and the estimator's verdict once a confirmatory ``lr_l_study.csv`` exists."""
    from studies.lr_l import analysis as ll

    pilot = pd.read_csv(path)
    study = path.with_name("lr_l_study.csv")
    redesign = path.with_name("redesign.csv")  # issue 39.3: the grid without the gate
    claim = "the optimum depends on L, not N, under 1/(N√L)"
    title = "LR vs L: task search (N = 8 must beat N = 1 first)"
    notes = [f"LR-vs-L task search: {pilot['cpu_s'].sum() / 60:.1f} CPU-min"]
    if redesign.exists():
        cells = pd.read_csv(redesign)
        v, why = ll.redesign_claim(cells)
        notes.append(f"LR-vs-L redesign: {len(cells)} cells, {cells['cpu_s'].sum() / 60:.1f} "
                     "CPU-min")  # fmt: skip
        out = _verdict("LR vs L (redesign, no gate)", claim, v, why, "lr_l.md")
    else:
        v, why = ll.claim(pilot, pd.read_csv(study) if study.exists() else None)
        out = _verdict("LR vs L", claim, v, why, "lr_l.md")
    return [(title, ll.pilot_table(pilot))], [out], notes


def finite_step(path: pathlib.Path) -> tuple[list, list[Verdict], list[str]]:
    """Finite-step failures and the quarter step (issue 30.4), verdicts from the script."""
    v = pd.read_csv(path)
    out = [_verdict("finite step", r["criterion"], r["verdict"],
                    f"{r['estimate']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}]", "finite_step.md")
           for r in v.to_dict("records")]  # fmt: skip
    from studies.finite_step import per_model as pm  # issue 39.5: intervals over models

    cells = path.with_name(pathlib.Path(pm.CELLS).name)
    if not cells.exists():
        return [("Finite-step failures, transition 4 → 5 (paired bootstrap)", v)], out, [
            f"finite step: no {cells.name} beside the verdicts, no per-model rows"]
    models = pm.over_models(pm.per_model(pd.read_csv(cells)))
    out += [_verdict(f"finite step, over {r['models']} models (post hoc)", r["criterion"],
                     r["verdict"], f"{r['estimate']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}] "
                     f"(t over models: {r['values']}; stated after the data, issue 39)",
                     "finite_step.md") for r in models.to_dict("records")]  # fmt: skip
    tables = [("Finite-step failures, transition 4 → 5 (paired bootstrap)", v),
              ("Finite-step criteria over models (t, post hoc)", models)]  # fmt: skip
    from studies.finite_step import models as fm  # issue 39.5's redesign: seeds 100-109

    ten = fm.cells(where=path.parent / "models")
    if ten.empty or ten["seed"].nunique() < len(fm.SEEDS):
        done = 0 if ten.empty else ten["seed"].nunique()
        return tables, out, [f"finite step redesign: running, {done} of {len(fm.SEEDS)} models"]
    t = pm.over_models(pm.per_model(ten))
    out += [_verdict(f"finite step, {r['models']} models (redesign)", r["criterion"],
                     r["verdict"], f"{r['estimate']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}] "
                     f"(t over models: {r['values']})", "finite_step.md")
            for r in t.to_dict("records")]  # fmt: skip
    return tables + [("Finite-step criteria over 10 models (redesign)", t)], out, []


def flt(path: pathlib.Path) -> tuple[list, list[Verdict], list[str]]:
    """LT vs the Fully Looped Transformer at 12 loops, and the instability signals (30.5)."""
    from studies.flt import analysis as fl

    cells = pd.read_csv(path)
    claim = fl.avoids_claim(cells)
    out = [_verdict("FLT", "avoids the looped transformer's collapse", claim["verdict"],
                    claim["reason"], "flt.md")]  # fmt: skip
    for s in fl.PRIMARY:
        w = fl.warns(cells, s)
        out.append(_verdict("FLT", f"{s} fires before collapse", w["verdict"], w["reason"],
                            "flt.md"))  # fmt: skip
    return [], out + _flt_redesign(path.parent), []


def _flt_redesign(folder: pathlib.Path) -> list[Verdict]:
    """The redesign's rows (issue 39.6) once its pilot found a control and its 20 cells are in
    (with no control its study is not run, as pre-registered: the first design's rows say so)."""
    from studies.flt import redesign as rd

    pilot_path, cells_path = folder / "flt_redesign_pilot.csv", folder / "flt_redesign.csv"
    if not (pilot_path.exists() and cells_path.exists()):
        return []
    if rd.choose_control(pd.read_csv(pilot_path)) is None:
        return []
    cells = pd.read_csv(cells_path)
    if cells.groupby(rd.KEY).ngroups < 2 * len(rd.SEEDS):
        return []
    j = rd.judge(cells)
    a = j["avoids"]
    out = [_verdict("FLT (redesign)", "avoids the looped transformer's collapse", a["verdict"],
                    a["reason"], "flt.md")]  # fmt: skip
    for s, w in j["warns"].items():
        tag = "" if s in rd.PRIMARY else " (secondary)"
        out.append(_verdict("FLT (redesign)", f"{s}{tag} fires before collapse", w["verdict"],
                            w["reason"], "flt.md"))  # fmt: skip
    return out


#: study (its folder under studies/) -> (its cells in that folder, the function that judges them)
STUDIES = {
    "deeploop": ("deeploop_study.csv", deeploop),
    "lr_edge": ("lr_edge_study.csv", lr_edge),
    "lr_l": ("lr_l_pilot.csv", lr_l),
    "finite_step": ("finite_step_verdicts.csv", finite_step),
    "flt": ("flt_study.csv", flt),
}


def issue30_studies(root: pathlib.Path) -> tuple[list, list[tuple[str, Verdict]], list[str]]:
    """Tables, ``(study, verdict)`` pairs and notes of every study whose cells are under
    ``root/<study>/``."""
    tables, verdicts, notes = [], [], []
    for name, (csv, judge) in STUDIES.items():
        path = root / name / csv
        if not path.exists():
            notes.append(f"{name} study: no {csv} under {path.parent}, not judged")
            continue
        t, v, n = judge(path)
        tables += t
        verdicts += [(name, x) for x in v]
        notes += n
    return tables, verdicts, notes
