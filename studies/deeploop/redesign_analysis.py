"""DeepLoop redesign (issue 39.1): each arm at its own learning rate, and the p-sweep across R.

The cells come from ``studies/deeploop/redesign.py``; the criteria are pre-registered in
docs/studies/deeploop.md ("Redesign"), committed before any of these cells ran.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from studies._common import here
from studies.deeploop import analysis as dl
from studies.deeploop.analysis import final_losses

PILOT_CSV = here(__file__, "deeploop_lr_pilot.csv")
OLD_PILOT_CSV = here(__file__, "deeploop_pilot.csv")  # lr 3e-3, seeds 0-2 (the same trainings)


def pilot_cells(where=None) -> pd.DataFrame:
    """The lr pilot's cells: the original pilot's (lr 3e-3) and the lr-grid pilot's (in
    ``where``, default this folder), R = 1, 3 and 7."""
    import pathlib

    d = pathlib.Path(where or pathlib.Path(PILOT_CSV).parent)
    frames = [pd.read_csv(d / pathlib.Path(OLD_PILOT_CSV).name)]
    if (d / pathlib.Path(PILOT_CSV).name).exists():
        frames.append(pd.read_csv(d / pathlib.Path(PILOT_CSV).name))
    df = pd.concat(frames, ignore_index=True)
    return df[df["R"].isin((1, 3, 7))].reset_index(drop=True)


def per_lr(cells: pd.DataFrame, floor: float | None = None) -> pd.DataFrame:
    """Mean final held-out loss per arm, R and lr over the seeds that ran it."""
    f = final_losses(cells, floor=floor)
    f["lr"] = cells.loc[cells["final"].astype(bool), "lr"].to_numpy()
    return (
        f.groupby(["arm", "R", "lr"])
        .agg(seeds=("loss", "size"), loss=("loss", "mean"), escaped=("escaped", "sum"))
        .reset_index()
    )


def best_lr(cells: pd.DataFrame, floor: float | None = None) -> dict:
    """(arm, R) -> the grid lr with the lowest mean final loss."""
    t = per_lr(cells, floor)
    return {k: float(g.loc[g["loss"].idxmin(), "lr"]) for k, g in t.groupby(["arm", "R"])}


# ------------------------------------------------------------------ lr study (confirmatory)


def tuned(cells: pd.DataFrame, floor: float | None = None) -> pd.DataFrame:
    """Per arm and R: the study rates, the tuned lr (lowest mean final loss over the seeds)
    and whether it is bracketed (neither the smallest nor the largest of the arm's rates)."""
    t = per_lr(cells, floor)
    rows = []
    for (arm, R), g in t.groupby(["arm", "R"]):
        best = float(g.loc[g["loss"].idxmin(), "lr"])
        rows.append({"arm": arm, "R": R, "rates": ", ".join(f"{x:g}" for x in sorted(g["lr"])),
                     "lr": best, "loss": float(g["loss"].min()),
                     "bracketed": g["lr"].min() < best < g["lr"].max()})  # fmt: skip
    return pd.DataFrame(rows)


def _at(final: pd.DataFrame, arm: str, R: int, lr: float) -> pd.Series:
    g = final[(final["arm"] == arm) & (final["R"] == R) & np.isclose(final["lr"], lr)]
    return g.set_index("seed")["loss"]


def compare_at(cells: pd.DataFrame, lrs: dict, floor: float | None = None) -> pd.DataFrame:
    """Per baseline and R: DeepLoop − baseline, each arm at ``lrs[(arm, R)]``, paired by seed;
    the t interval and the pre-registered verdict of the first design (neutral at R = 1,
    improves at R > 1)."""
    f = final_losses(cells, floor=floor)
    f["lr"] = cells.loc[cells["final"].astype(bool), "lr"].to_numpy()
    rows = []
    for b in dl.BASELINES:
        for R in sorted(set(f["R"])):
            if (dl.TARGET, R) not in lrs or (b, R) not in lrs:
                continue
            a, c = _at(f, dl.TARGET, R, lrs[(dl.TARGET, R)]), _at(f, b, R, lrs[(b, R)])
            d = (a - c).dropna().to_numpy(dtype=float)
            m, sd, lo, hi = dl.t_interval(d)
            kind = "neutral" if R == 1 else "improves"
            verdict, reason = dl._verdict(kind, len(d), lo, hi, sd)
            rows.append({"baseline": b, "R": R, "n": len(d), "diff": m, "ci_low": lo,
                         "ci_high": hi, "criterion": kind, "verdict": verdict,
                         "reason": reason})  # fmt: skip
    return pd.DataFrame(rows)


def lr_study(cells: pd.DataFrame, pilot: pd.DataFrame, floor: float | None = None) -> pd.DataFrame:
    """The pre-registered comparison: each arm at its tuned study lr (primary) and at its
    pilot optimum (sensitivity); undecided when an arm's optimum is not bracketed or when the
    two lr choices give different verdicts."""
    tt = tuned(cells, floor).set_index(["arm", "R"])
    primary = compare_at(cells, tt["lr"].to_dict(), floor)
    sens = compare_at(cells, best_lr(pilot, floor), floor).set_index(["baseline", "R"])
    out = []
    for r in primary.to_dict("records"):
        s = sens.loc[(r["baseline"], r["R"])] if (r["baseline"], r["R"]) in sens.index else None
        r["verdict_pilot_lr"] = s["verdict"] if s is not None else "missing"
        unbracketed = [a for a in (dl.TARGET, r["baseline"])
                       if not tt.loc[(a, r["R"]), "bracketed"]]  # fmt: skip
        if unbracketed:
            r["verdict"] = "undecided"
            r["reason"] = f"optimum not bracketed for {unbracketed}"
        elif r["verdict_pilot_lr"] != r["verdict"]:
            r["reason"] = (f"depends on the lr choice (tuned: {r['verdict']}, pilot optimum: "
                           f"{r['verdict_pilot_lr']})")  # fmt: skip
            r["verdict"] = "undecided"
        out.append(r)
    return pd.DataFrame(out)


# ------------------------------------------------------------------ p-sweep across R

PSWEEP_CSV = here(__file__, "deeploop_psweep.csv")
RISE = 0.5  # nats: a loss spike (pre-registered)
P_GRID = (0.0, 0.25, 0.35, 0.45, 0.55)
PSWEEP_RS = (2, 4, 8, 16)
PSWEEP_SEEDS = 3


def psweep_table(cells: pd.DataFrame) -> pd.DataFrame:
    """Per R and p: seeds, unstable (diverged or rise > RISE), escaped the floor, mean loss."""
    f = cells[cells["final"].astype(bool)].copy()
    f["unstable"] = f["diverged"].astype(bool) | (f["rise"].astype(float) > RISE)
    e = final_losses(cells)
    f["escaped"] = e["escaped"].to_numpy()
    g = f.groupby(["R", "p"])
    return g.agg(seeds=("seed", "nunique"), unstable=("unstable", "sum"),
                 escaped=("escaped", "sum"), max_rise=("rise", "max"),
                 loss=("val_loss", "mean")).reset_index()  # fmt: skip


def psweep_verdicts(table: pd.DataFrame) -> tuple[pd.DataFrame, str, str]:
    """Per R with all cells done: p_u* and the verdict; then the claim across R (holds at
    every complete R, at least 3; fails at most of them, at least 3; else undecided)."""
    rows = []
    for R, g in table.groupby("R"):
        g = g.set_index("p").reindex(P_GRID)
        if g["seeds"].isna().any() or (g["seeds"] < PSWEEP_SEEDS).any():
            rows.append({"R": R, "p_star": np.nan, "verdict": "running"})
            continue
        stable = (g["unstable"] == 0).to_numpy()
        p_star = np.nan
        for i in range(len(P_GRID) - 1, -1, -1):
            if not stable[i]:
                break
            p_star = P_GRID[i]
        low = g.loc[0.25, "unstable"] >= 2
        if p_star in (0.45, 0.55) and low:
            v = "holds"
        elif not np.isnan(p_star) and p_star <= 0.35:
            v = "fails"
        else:
            v = "undecided"
        rows.append({"R": R, "p_star": p_star, "verdict": v})
    per_r = pd.DataFrame(rows)
    done = per_r[per_r["verdict"] != "running"]
    n = int(table["seeds"].sum())
    total = len(PSWEEP_RS) * len(P_GRID) * PSWEEP_SEEDS
    if len(done) >= 3 and (done["verdict"] == "holds").all():
        return per_r, "holds", f"holds at R = {list(done['R'])}"
    if len(done) >= 3 and (done["verdict"] == "fails").sum() > len(done) / 2:
        return (
            per_r,
            "fails",
            f"fails at {int((done['verdict'] == 'fails').sum())} of {len(done)} R",
        )
    return per_r, "undecided", f"running: {n} of {total} cells" if n < total else "mixed"


# ------------------------------------------------------------------ verdicts and summary

STUDY_CSV = here(__file__, "deeploop_lr_study.csv")
STUDY_CELLS = 3 * 3 * 2 * 6  # arms x rates x R x seeds (docs/studies/deeploop.md, Redesign)
R13 = (1, 3)  # the first redesign's R; R = 7 joined the same CSVs in the second redesign
BACKBONE_CSV = here(__file__, "deeploop_backbone.csv")
BACKBONE_CELLS = 3 * 2 * 6  # arms x R x seeds, one (tuned) lr each
PILOT7_CELLS = 3 * (3 * 2 + 3)  # arms x (3 new rates x 2 seeds + the original pilot's 3e-3)


def at_r(cells: pd.DataFrame, Rs) -> pd.DataFrame:
    """The cells at the given R (the lr CSVs hold R = 1 and 3, then R = 7)."""
    return cells[cells["R"].isin(tuple(Rs))].reset_index(drop=True)


def backbone_check(backbone: pd.DataFrame, study: pd.DataFrame, floor=None) -> pd.DataFrame:
    """Second redesign, part 1: DeepLoop − baseline on the seed's backbone (RoPE + embedding
    RMSNorm), each arm at its tuned lr of the lr study (tuned on learned positions, not
    re-tuned), beside the lr study's difference and verdict at the same rates."""
    study = at_r(study, R13)
    lrs = tuned(study, floor).set_index(["arm", "R"])["lr"].to_dict()
    new, old = compare_at(backbone, lrs, floor), compare_at(study, lrs, floor)
    old = old.set_index(["baseline", "R"])
    new["learned_diff"] = [
        old.loc[(b, R), "diff"] for b, R in zip(new["baseline"], new["R"], strict=True)
    ]
    new["learned_verdict"] = [old.loc[(b, R), "verdict"]
                              for b, R in zip(new["baseline"], new["R"], strict=True)]  # fmt: skip
    return new


def r7_expected(pilot: pd.DataFrame) -> int | None:
    """How many R = 7 study cells the pilot's optima call for (None while the pilot runs)."""
    from studies.deeploop.redesign import STUDY7, study_rates

    p7 = at_r(pilot, (7,))
    if int(p7["final"].astype(bool).sum()) < PILOT7_CELLS:
        return None
    rates = study_rates(p7)
    return len(STUDY7["seeds"]) * sum(len(rates[(a, 7)]) for a in dl.ARMS)


def extension_rates(cells: pd.DataFrame, pilot: pd.DataFrame) -> dict:
    """Addendum to the R = 7 study: (arm, 7) -> (the next ladder rate beyond,) for each arm
    whose tuned lr over its registered study rates is the lowest or highest of them (one step
    only; a new optimum at the new end stays unbracketed)."""
    from studies.deeploop.redesign import LR_LADDER, study_rates

    c7, out = at_r(cells, (7,)), {}
    for (arm, R), rs in study_rates(at_r(pilot, (7,))).items():
        sub = c7[(c7["arm"] == arm) & np.isclose(c7["lr"].to_numpy()[:, None], rs).any(1)]
        if sub.empty:
            continue
        best = float(tuned(sub)["lr"].iloc[0])
        i = min(range(len(LR_LADDER)), key=lambda j: abs(np.log(LR_LADDER[j] / best)))
        j = i - 1 if np.isclose(best, min(rs)) else i + 1 if np.isclose(best, max(rs)) else None
        if j is not None and 0 <= j < len(LR_LADDER):
            out[(arm, R)] = (LR_LADDER[j],)
    return out


def _whole(parts: list[str]) -> str:
    """fails if any part fails, holds if all hold, else undecided."""
    return "fails" if "fails" in parts else "holds" if set(parts) == {"holds"} else "undecided"


def _desc(g: pd.DataFrame) -> str:
    return "; ".join(f"R={r.R} {r.criterion} {r.verdict}: {r.diff:+.3f} "
                     f"[{r.ci_low:+.3f}, {r.ci_high:+.3f}]" for r in g.itertuples())  # fmt: skip


def second_redesign(root, t13: pd.DataFrame | None) -> tuple[list, list[str]]:
    """Rows and notes of the second redesign (backbone check; the lr study at R = 7 and the
    first registration's claim whole), each only once its cells are complete. ``t13``: the
    lr study's result at R = 1 and 3 (None while it runs)."""
    import pathlib

    root, out, notes = pathlib.Path(root), [], []
    study_path = root / pathlib.Path(STUDY_CSV).name
    bb = root / pathlib.Path(BACKBONE_CSV).name
    if bb.exists() and t13 is not None:
        cells = pd.read_csv(bb)
        n = int(cells["final"].astype(bool).sum())
        if n < BACKBONE_CELLS:
            notes.append(f"DeepLoop second redesign, backbone: running, {n} of "
                         f"{BACKBONE_CELLS} cells")  # fmt: skip
        else:
            t = backbone_check(cells, pd.read_csv(study_path))
            for b in dl.BASELINES:
                g = t[t["baseline"] == b]
                same = "same as" if (g["verdict"] == g["learned_verdict"]).all() else "differs from"
                out.append((f"seed's backbone, vs {b}, each arm at its lr tuned on learned "
                            "positions: neutral at R = 1, better at R = 3",
                            _whole(list(g["verdict"])),
                            f"{_desc(g)}; {same} learned positions at these rates ("
                            + ", ".join(f"R={r.R} {r.learned_verdict} {r.learned_diff:+.3f}"
                                        for r in g.itertuples()) + ")"))  # fmt: skip
    if t13 is None or not study_path.exists():
        return out, notes
    c7 = at_r(pd.read_csv(study_path), (7,))
    pilot = pilot_cells(root)
    need, n = r7_expected(pilot), int(c7["final"].astype(bool).sum())
    if need is None:
        p7 = int(at_r(pilot, (7,))["final"].astype(bool).sum())
        notes.append(f"DeepLoop second redesign, R = 7 lr pilot: running, {p7} of "
                     f"{PILOT7_CELLS} cells (with the original pilot's 9)")  # fmt: skip
        return out, notes
    if n < need:
        notes.append(f"DeepLoop second redesign, R = 7 lr study: running, {n} of {need} cells")
        return out, notes
    ext = extension_rates(c7, pilot)
    if n < need + 6 * len(ext):
        notes.append(f"DeepLoop second redesign, R = 7 grid extension (addendum): running, "
                     f"{n - need} of {6 * len(ext)} cells")  # fmt: skip
        return out, notes
    t7 = lr_study(c7, at_r(pilot, (7,)))
    extended = "; grid extended one rate beyond an end optimum (addendum) for " + (
        ", ".join(f"{a} ({r[0]:g})" for (a, _), r in sorted(ext.items())) or "none"
    )
    for b in dl.BASELINES:
        g = t7[t7["baseline"] == b]
        r = g.iloc[0]
        why = "" if r["verdict"] != "undecided" else f" ({r['reason']})"
        out.append((f"R = 7, vs {b}, each arm at its tuned lr: better at R = 7",
                    r["verdict"] + why, _desc(g) + extended))  # fmt: skip
        whole = pd.concat([t13[t13["baseline"] == b], g], ignore_index=True)
        out.append((f"whole claim, vs {b}, each arm at its tuned lr: neutral at R = 1, better "
                    "at R = 3 and at R = 7", _whole(list(whole["verdict"])),
                    _desc(whole)))  # fmt: skip
    return out, notes


def redesign_verdicts(root) -> tuple[list[tuple[str, str, str]], list[str]]:
    """(claim, verdict, measured) of each redesign part whose cells are complete under
    ``root`` (the deeploop folder), and notes saying how far the others got."""
    import pathlib

    root = pathlib.Path(root)
    out, notes = [], []
    sweep = root / pathlib.Path(PSWEEP_CSV).name
    if sweep.exists():
        t = psweep_table(pd.read_csv(sweep))
        per_r, v, why = psweep_verdicts(t)
        per = "; ".join(f"R={r.R}: p_u*={r.p_star:g} {r.verdict}" for r in per_r.itertuples())
        esc = t.groupby("R")[["escaped", "seeds"]].sum()
        why += (f"; largest loss rise {t['max_rise'].max():.2f} nats; secondary, escaped the "
                "floor: " + ", ".join(f"R={R} {int(r.escaped)}/{int(r.seeds)}"
                                      for R, r in esc.iterrows()))  # fmt: skip
        if v == "undecided" and why.startswith("running:"):
            notes.append(f"DeepLoop redesign p-sweep: {why} ({per})")
        else:
            out.append(("p-sweep across R = 2..16: instability boundary near p = 1/2", v,
                        f"{per}; {why}"))  # fmt: skip
    study, t13 = root / pathlib.Path(STUDY_CSV).name, None
    if study.exists():
        cells = at_r(pd.read_csv(study), R13)
        n = int(cells["final"].astype(bool).sum())
        if n < STUDY_CELLS:
            notes.append(f"DeepLoop redesign lr study: running, {n} of {STUDY_CELLS} cells")
        else:
            t13 = t = lr_study(cells, at_r(pilot_cells(root), R13))
            for b in dl.BASELINES:
                g = t[t["baseline"] == b]
                vs = set(g["verdict"])
                v = "fails" if "fails" in vs else "holds" if vs == {"holds"} else "undecided"
                desc = "; ".join(f"R={r.R} {r.criterion} {r.verdict}: {r.diff:+.3f} "
                                 f"[{r.ci_low:+.3f}, {r.ci_high:+.3f}]"
                                 for r in g.itertuples())  # fmt: skip
                out.append((f"vs {b}, each arm at its tuned lr: neutral at R = 1, better at "
                            "R = 3", v, desc))  # fmt: skip
    more, more_notes = second_redesign(root, t13)
    return out + more, notes + more_notes


def summary_markdown(root=None) -> str:
    """The pilot, p-sweep and lr-study tables as markdown (what the page shows)."""
    import os
    import pathlib

    lines = ["### lr pilot: mean final loss per arm, R and lr", "",
             dl._md(per_lr(pilot_cells()))]  # fmt: skip
    if os.path.exists(PSWEEP_CSV):
        t = psweep_table(pd.read_csv(PSWEEP_CSV))
        per_r, v, why = psweep_verdicts(t)
        lines += ["", "### p-sweep across R", "", dl._md(t), "", dl._md(per_r), "",
                  f"- claim: {v} ({why})"]  # fmt: skip
    if os.path.exists(STUDY_CSV):
        allc = pd.read_csv(STUDY_CSV)
        cells = at_r(allc, R13)
        lines += ["", "### lr study: tuned lr per arm and R", "", dl._md(tuned(allc))]
        if int(cells["final"].astype(bool).sum()) >= STUDY_CELLS:
            pilot = at_r(pilot_cells(), R13)
            lines += ["", dl._md(lr_study(cells, pilot).drop(columns=["reason"]))]
        c7 = at_r(allc, (7,))
        if len(c7):
            lines += ["", "### lr study at R = 7 (per lr)", "", dl._md(per_lr(c7))]
            lines += ["", dl._md(lr_study(c7, at_r(pilot_cells(), (7,))))]
        if os.path.exists(BACKBONE_CSV):
            bb = pd.read_csv(BACKBONE_CSV)
            lines += ["", "### backbone check (RoPE + embedding RMSNorm)", "",
                      dl._md(per_lr(bb)), "", dl._md(backbone_check(bb, allc))]  # fmt: skip
    rows, notes = redesign_verdicts(pathlib.Path(STUDY_CSV).parent)
    lines += ["", "### verdict rows", ""] + [f"- {c}: **{v}** ({m})" for c, v, m in rows]
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary_markdown())


def trend_table(trend: pd.DataFrame, study: pd.DataFrame) -> pd.DataFrame:
    """The budget trend at R = 1 (descriptive, no verdict): DeepLoop − post at each arm's tuned
    lr per budget, paired over the seeds that have both; 1000 steps from the lr study."""
    lrs = tuned(study).set_index(["arm", "R"])["lr"].to_dict()
    rows = []
    for steps, cells in [(1000, study[study["seed"].isin(set(trend["seed"]))])] + list(
        trend.groupby("steps")
    ):
        f = final_losses(cells)
        f["lr"] = cells.loc[cells["final"].astype(bool), "lr"].to_numpy()
        d = _at(f, dl.TARGET, 1, lrs[(dl.TARGET, 1)]) - _at(f, "post", 1, lrs[("post", 1)])
        d = d.dropna().to_numpy(dtype=float)
        m, sd, lo, hi = dl.t_interval(d)
        rows.append({"steps": int(steps), "seeds": len(d), "diff": m, "ci_low": lo,
                     "ci_high": hi})  # fmt: skip
    return pd.DataFrame(rows)
