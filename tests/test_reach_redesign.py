"""The reachability redesign (issue 39.4): its cells, the resumable driver, and the pre-stated
verdicts (docs/studies/reachability.md, "Redesign — pre-registration") on planted runs."""

import pandas as pd
import torch

from loopprobe.models import GPTConfig, LoopedGPT
from studies.reachability import redesign
from studies.reachability.analysis_redesign import redesign_claims, redesign_summary

RECALLS = ("none", "add", "internal")


def runs(outer=1.0, post=0.0, outer_2x=None, post_2x=None, seeds=5, outer_by_seed=None):
    """Planted runs: every pre-norm + outer-norm run reaches ``outer``, every post-norm run
    ``post`` (``outer_by_seed``: per-seed fractions of the outer arm instead)."""
    rows = []
    for recall in RECALLS:
        for norm, on, f, f2 in (("pre", True, outer, outer_2x), ("post", False, post, post_2x)):
            for task in ("t1", "t2"):
                for seed in range(seeds):
                    v = outer_by_seed[seed] if (on and outer_by_seed) else f
                    rows.append({"task": task, "recall": recall, "norm": norm, "outer_norm": on,
                                 "seed": seed, "reach_frac": v,
                                 "reach_frac_2x": v if f2 is None else f2,
                                 "reached": round(64 * v), "distinct_frac": 1.0,
                                 "local_sensitivity": 1.0, "distinct_outputs": 3,
                                 "distinct_inputs": 64, "acc_R4": 0.7, "acc_R16": 0.6,
                                 "acc_fixed": 0.6, "rho_max": 0.7, "rho_median": 0.5,
                                 "miss_not_contracting": 0, "iter_median": 20.0,
                                 "rate_median": 0.5, "steps": 600, "stop": "cap"})  # fmt: skip
    return pd.DataFrame(rows)


def verdicts(df):
    c = redesign_claims(df, n_boot=300)
    return dict(zip(c["claim"], c["verdict"], strict=True))


def outer_claim(recall):
    return f"recall {recall}: the outer norm is what makes fixed points reachable"


def test_planted_runs_give_the_prestated_outer_norm_verdict_per_recall():
    for outer, post, want in ((1.0, 0.0, "holds"), (0.75, 0.5, "holds"), (1.0, 1.0, "fails"),
                              (0.5, 0.45, "fails")):  # fmt: skip
        got = verdicts(runs(outer, post))
        assert [got[outer_claim(r)] for r in RECALLS] == [want] * 3, (outer, post, got)
    below = verdicts(runs(0.0, 1.0))[outer_claim("add")]
    assert below.startswith("undecided (the interval lies below -0.1")
    near = verdicts(runs(0.62, 0.5))[outer_claim("none")]  # 0.12: above 0.1 but not by much
    assert near == "holds"


def test_the_outer_norm_verdict_is_undecided_when_wide_when_it_flips_or_with_few_runs():
    wide = verdicts(runs(post=0.0, outer_by_seed=[0.0, 0.05, 0.1, 0.4, 0.2]))
    assert wide[outer_claim("add")].startswith("undecided (the interval [")
    flip = verdicts(runs(1.0, 0.0, post_2x=1.0))[outer_claim("internal")]
    assert flip == "undecided (flips with the cap: holds at it, fails at 2x)"
    recall = "with outer norm on, recall does not change reachability"
    fewer = runs(1.0, 0.0)
    sel = fewer["norm"].eq("pre") & fewer["recall"].ne("none")
    fewer.loc[sel, ["reach_frac", "reach_frac_2x"]] = 0.5  # recall - none = -0.5: fails ...
    assert verdicts(fewer)[recall] == "fails"
    fewer.loc[sel, "reach_frac_2x"] = 0.98  # ... unless it is inside +-0.1 at 2x the hard cap
    assert verdicts(fewer)[recall] == "undecided (flips with the cap: fails at it, holds at 2x)"
    few = verdicts(runs(seeds=1))
    assert few[outer_claim("none")] == "undecided (2 runs, 4 needed)"


def test_a_and_the_recall_contrasts_are_judged_on_the_outer_norm_arm_only():
    got = verdicts(runs(1.0, 0.0))  # the post-norm arm reaches nothing: A must not see it
    assert got["A: standard recall + outer norm reliably reach a fixed point"] == "holds"
    assert got["A': internal recall + outer norm reliably reach a fixed point"] == "holds"
    assert got["with outer norm on, recall does not change reachability"] == "holds"
    assert got["internal recall is competitive with standard recall once outer norm is on"] == (
        "holds")  # fmt: skip
    assert len(got) == 7  # 3 outer-norm contrasts + the 4 rejudged claims; C is not judged
    assert verdicts(runs(0.5, 0.0))["A: standard recall + outer norm reliably reach a fixed "
                                    "point"] == "fails"  # fmt: skip


def test_summary_has_one_row_per_task_recall_and_arm():
    s = redesign_summary(runs(1.0, 0.25)).set_index(["task", "recall", "arm"])
    assert len(s) == 12 and (s["runs"] == 5).all()
    assert s.loc[("t1", "add", "post"), "reach"] == 0.25
    assert s.loc[("t2", "none", "pre + outer norm"), "reach"] == 1.0


def test_the_design_has_sixty_cells_and_the_post_norm_arm_has_no_outer_norm():
    cells = redesign.cells({"cap": 600})
    keys = {redesign._key(c) for c in cells}
    assert len(cells) == len(keys) == 60
    assert {c["seed"] for c in cells} == set(range(200, 205))
    assert {(c["norm"], c["outer_norm"]) for c in cells} == {("pre", True), ("post", False)}
    assert [c["seed"] for c in cells[:12]] == [200] * 12  # seed-major: partial files balanced


def test_the_post_norm_round_map_is_bounded_without_an_outer_norm():
    # why the arm can have fixed points: every block ends in an RMSNorm (weights 1 at init)
    g = torch.Generator().manual_seed(0)
    for recall in RECALLS:
        cfg = GPTConfig(vocab_size=8, seq_len=6, d_model=16, n_heads=4, K=1, R=4, norm="post",
                        recall=recall, outer_norm=False)  # fmt: skip
        model = LoopedGPT(cfg, generator=g).double()
        assert model.outer_norm is None
        x = model.embed(torch.randint(0, 8, (2, 6), generator=g))
        h = 1e3 * torch.randn(x.shape, generator=g, dtype=torch.float64)
        rms = model.step(h, x).pow(2).mean(-1).sqrt()
        assert torch.allclose(rms, torch.ones_like(rms), atol=1e-6)


def test_the_driver_appends_each_cell_and_a_rerun_skips_the_finished_ones(tmp_path, monkeypatch):
    calls = []

    def fake_run(cfg):
        calls.append(redesign._key(cfg))
        if cfg["recall"] == "internal" and cfg["norm"] == "post":
            raise RuntimeError("planted failure")
        # keys in a varying order: the file keeps its own column order
        out = {"reach_frac": 0.5, "steps": 10}
        return out if len(calls) % 2 else dict(reversed(out.items()))

    monkeypatch.setattr(redesign.study, "run", fake_run)
    out = str(tmp_path / "cells.csv")
    items = redesign.cells({"cap": 60}, seeds=(200, 201), tasks=("prefix_sums",))
    assert redesign.run_cells(items[:4], out) == 4
    assert redesign.run_cells(items, out) == len(items) - 4
    assert len(calls) == len(items) == 12
    assert redesign.run_cells(items, out) == 0 and len(calls) == 12
    df = pd.read_csv(out)
    assert len(df) == 12 and (df["steps"].fillna(10) == 10).all()
    failed = df[df["error"].notna()]
    assert len(failed) == 2 and failed["error"].str.contains("planted failure").all()
    assert set(failed["recall"]) == {"internal"} and set(failed["norm"]) == {"post"}
