"""The 64-input reachability study (issue 30.3): the probe against its twins, and the
pre-stated verdicts (docs/studies/reachability.md) on planted runs with a known answer."""

import math

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

import loopprobe as lp
from loopprobe.experiments.recall import distinct_points, picard_many, reach_probe
from studies.reachability.analysis64 import boot_mean, study_claims, study_summary

# ---------------------------------------------------------------- the probe


class Contraction(nn.Module):
    """A third-party-style round: h <- a_i * tanh(W h) + x, a per-input gain a_i."""

    def __init__(self, gains):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        w = torch.randn(6, 6, generator=g, dtype=torch.float64)
        self.W = nn.Parameter(w / torch.linalg.matrix_norm(w, 2))
        self.register_buffer("a", torch.tensor(gains, dtype=torch.float64))

    def forward(self, h, x):
        return self.a.view(-1, 1) * torch.tanh(h @ self.W.T) + x


def test_picard_many_matches_fixed_point_input_by_input():
    # gain 0.5 reaches within the base phase, 0.97 only after the rate-based extension
    step = Contraction([0.5, 0.9, 0.97, 0.97])
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = picard_many(step, x, x, tol=1e-10, base_iter=20, hard_cap=2000, window=10)
    assert got["reached"].all()
    for i in range(4):
        one = Contraction([step.a[i].item()])
        fp = lp.fixed_point(lambda h, xi=x[i : i + 1], m=one: m(h, xi), x[i : i + 1], tol=1e-10,
                            max_iter=2000)  # fmt: skip
        assert fp.converged and fp.iterations == int(got["iterations"][i])
        torch.testing.assert_close(got["h"][i : i + 1], fp.h, rtol=0, atol=1e-12)
    assert int(got["iterations"][2]) > 20  # needed the extension


def test_picard_many_sets_each_cap_from_its_own_rate():
    # h <- a h + (1 - a) c from h0 = c + 1: the relative residual shrinks by about a per
    # iteration; the oracle iterates the scalar map in plain Python
    a = torch.tensor([0.5, 0.97, 0.9995, 1.02], dtype=torch.float64)
    step = lambda h, c: a.view(-1, 1) * h + (1 - a.view(-1, 1)) * c  # noqa: E731
    c = torch.full((4, 1), 1000.0, dtype=torch.float64)
    got = picard_many(step, c, c + 1, tol=1e-12, base_iter=300, hard_cap=4000)

    def need(a_, h=1001.0, k=0):
        while abs(a_ * h + (1 - a_) * 1000 - h) / abs(h) > 1e-12:
            h, k = a_ * h + (1 - a_) * 1000, k + 1
        return k

    need = [need(0.5), need(0.97)]
    assert got["reached"].tolist() == [True, True, False, False]
    assert got["iterations"][:2].tolist() == need and need[1] > 300  # a fixed 300 cap misses it
    assert got["iterations"][2:].tolist() == [300, 300]  # rate >= 0.999: not contracting, stop
    assert got["rate"][2] == pytest.approx(0.9995, abs=1e-4) and got["rate"][3] > 1
    # 2x the hard cap: 0.9995 needs ~25,700 more iterations at tol 1e-12 (no), ~5,900 at 2e-8
    assert got["reach_2x"].tolist() == [True, True, False, False]
    loose = picard_many(step, c, c + 1, tol=2e-8, base_iter=300, hard_cap=4000)
    assert loose["reach_2x"][2:].tolist() == [True, False] and not loose["reached"][2:].any()


def test_distinct_points_counts_planted_clusters():
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(3, 5, 4, generator=g, dtype=torch.float64)
    labels = torch.arange(64) % 3
    near = centres[labels] * (1 + 1e-6 * torch.randn(64, 5, 4, generator=g, dtype=torch.float64))
    got = distinct_points(near, 1e-3)
    assert got["count"] == 3 and got["spread"] < 1e-4 and got["gap"] > 0.1
    assert (pd.crosstab(got["labels"], labels.numpy()).to_numpy() > 0).sum() == 3  # 1-to-1
    far = centres[labels] + 0.1 * torch.randn(64, 5, 4, generator=g, dtype=torch.float64)
    assert distinct_points(far, 1e-3)["count"] == 64
    # single linkage: a chain of steps below delta is one cluster, the same points spaced
    # above delta are all distinct
    chain = torch.ones(10, 3, dtype=torch.float64) + 5e-4 * torch.arange(10.0).view(-1, 1)
    assert distinct_points(chain, 1e-3)["count"] == 1
    assert distinct_points(chain, 1e-4)["count"] == 10


class SignLoop(nn.Module):
    """A third-party-style looped model: embed, step, head. Without recall the round is
    h <- tanh(2 h) per coordinate, whose stable fixed points are +-0.957: each start goes to
    its sign pattern, so the distinct fixed points are the distinct sign patterns of x
    (tokens 0 and 1 share one)
    (countable, locally constant). With recall the round is h <- 0.5 tanh(h) + x."""

    def __init__(self, recall: bool):
        super().__init__()
        self.recall = recall
        self.emb = nn.Embedding(4, 3).double()
        self.out = nn.Linear(3, 2).double()
        with torch.no_grad():
            self.emb.weight.copy_(torch.tensor([[1, -1, 2], [2, -1, 1], [1, 1, -1], [-2, -1, -1]],
                                               dtype=torch.float64) * 0.3)  # fmt: skip

    def embed(self, idx):
        return self.emb(idx)

    def step(self, h, x):
        return 0.5 * torch.tanh(h) + x if self.recall else torch.tanh(2 * h)

    def head(self, h):
        return self.out(h)


def test_reach_probe_counts_sign_patterns_without_recall_and_keeps_the_model():
    idx = torch.randint(0, 4, (32, 2), generator=torch.Generator().manual_seed(2))
    patterns = torch.unique(torch.sign(SignLoop(False).embed(idx)).flatten(1), dim=0).shape[0]
    out = {}
    for recall in (False, True):
        model = SignLoop(recall).eval()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        out[recall] = reach_probe(model, idx, idx % 2, n_rho=2)
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert out[recall]["reached"] == 32 and out[recall]["reach_frac"] == 1.0
        assert 0 < out[recall]["rho_max"] < 0.6  # 2 (1 - 0.957^2) = 0.17; 0.5 with recall
    none, rec = out[False], out[True]
    assert none["distinct"] == patterns and 1 < patterns < none["distinct_inputs"]
    assert none["local_sensitivity"] < 1e-3 and rec["local_sensitivity"] > 0.5
    assert rec["distinct"] == rec["distinct_inputs"]  # each input its own fixed point
    assert none["distinct_outputs"] <= none["distinct"]


# ---------------------------------------------------------------- the verdicts


def test_boot_mean_is_the_pooled_mean_with_a_normal_width_interval():
    rng = np.random.default_rng(0)
    a, b = rng.normal(0, 1, 200), rng.normal(0, 1, 200)
    m, lo, hi = boot_mean([a, b])
    assert m == pytest.approx(np.concatenate([a, b]).mean())
    half = 1.96 / math.sqrt(400)
    assert (hi - lo) / 2 == pytest.approx(half, rel=0.15)  # statistical: 15 % tolerance
    d, dlo, dhi = boot_mean([a], [b])
    assert d == pytest.approx(a.mean() - b.mean()) and dlo < d < dhi
    assert boot_mean([np.full(5, 0.5)]) == (0.5, 0.5, 0.5)


def runs(reach=None, reach_2x=None, acc_internal=0.7, distinct_none=3 / 64, seeds=3,
         reached_none=64):  # fmt: skip
    """Planted runs: reach[(recall, outer)] = the reach fraction of every run of that arm."""
    reach = {**{(r, o): 1.0 if o else 0.0 for r in ("none", "add", "internal")
                for o in (False, True)}, **(reach or {})}  # fmt: skip
    rows = []
    for (recall, outer), f in reach.items():
        for task in ("t1", "t2"):
            for seed in range(seeds):
                n = reached_none if recall == "none" else round(64 * f)
                rows.append({"task": task, "recall": recall, "outer_norm": outer, "seed": seed,
                             "reach_frac": f, "reach_frac_2x": (reach_2x or {}).get(
                                 (recall, outer), f), "reached": round(64 * f) if recall !=
                             "none" else n, "distinct_frac": distinct_none if recall == "none"
                             else 1.0, "local_sensitivity": 0.0 if recall == "none" else 2.0,
                             "distinct_outputs": 3, "distinct_inputs": 64,
                             "acc_R4": acc_internal if recall == "internal" else 0.7,
                             "acc_R16": 0.6, "acc_fixed": 0.6, "rho_median": 0.5,
                             "rho_max": 0.7, "steps": 600})  # fmt: skip
    return pd.DataFrame(rows)


def verdicts(df):
    return dict(zip(*study_claims(df, n_boot=300)[["claim", "verdict"]].T.values, strict=True))


A = "A: standard recall + outer norm reliably reach a fixed point"
A2 = "A': internal recall + outer norm reliably reach a fixed point"
OUTER = "outer norm makes fixed points reachable"
RECALL = "with outer norm on, recall does not change reachability"
INTERNAL = "internal recall is competitive with standard recall once outer norm is on"
C = "C: without recall, inputs select among few fixed points"


def test_planted_runs_give_the_prestated_verdicts():
    assert verdicts(runs()) == {A: "holds", A2: "holds", OUTER: "holds", RECALL: "holds",
                                INTERNAL: "holds", C: "holds"}  # fmt: skip
    half = verdicts(runs({("add", True): 0.5}))
    assert half[A] == "fails" and half[A2] == "holds"  # 0.5 < 0.8
    assert half[RECALL] == "fails"  # recall 0.75 vs none 1.0: outside +-0.1
    same = verdicts(runs({(r, False): 1.0 for r in ("none", "add", "internal")}))
    assert same[OUTER] == "fails"  # on - off = 0 < 0.1
    assert verdicts(runs(acc_internal=0.5))[INTERNAL] == "fails"
    assert verdicts(runs(distinct_none=1.0))[C] == "fails"


def test_one_run_per_arm_or_too_few_reached_is_undecided():
    one = verdicts(runs(seeds=1))  # 2 runs per arm (one per task)
    assert one.pop(OUTER) == "holds"  # pooled over recalls: 6 runs a side
    assert one.pop(C) == "holds"  # pooled over outer norm: 4 no-recall runs
    assert all(v == "undecided (2 runs, 4 needed)" for v in one.values()), one
    few = verdicts(runs(reached_none=5))  # no no-recall run has 8 reached inputs
    assert few[C] == "undecided (0 runs, 4 needed)" and few[A] == "holds"


def test_a_verdict_that_flips_with_the_cap_or_straddles_the_threshold_is_undecided():
    flip = verdicts(runs({("add", True): 0.5}, reach_2x={("add", True): 1.0}))
    assert flip[A] == "undecided (flips with the cap: fails at it, holds at 2x)"
    mixed = runs()
    sel = (mixed["recall"] == "add") & mixed["outer_norm"]
    mixed.loc[sel, "reach_frac"] = [0.5, 1.0, 0.9, 0.6, 1.0, 0.95]  # mean 0.825, wide
    mixed.loc[sel, "reach_frac_2x"] = mixed.loc[sel, "reach_frac"]
    got = verdicts(mixed)[A]
    assert got.startswith("undecided (the interval [") and "contains the threshold; 6 runs" in got


def test_study_summary_has_one_row_per_arm():
    s = study_summary(runs({("add", True): 0.5})).set_index(["task", "recall", "outer_norm"])
    assert len(s) == 12 and s.loc[("t1", "add", True), "reach"] == 0.5
    assert (s["runs"] == 3).all()


def test_the_committed_runs_give_the_study_verdicts_and_the_verdict_table_states_them(tmp_path):
    import pathlib
    import shutil

    from loopprobe import report
    from studies.verdicts import collect

    data = pathlib.Path(__file__).resolve().parents[1] / "studies/reachability/reach_runs.csv"
    runs = pd.read_csv(data)
    assert len(runs) == 36 and (runs["inputs"] == 64).all() and runs["error"].isna().all()
    got = verdicts(runs)
    assert got[OUTER] == "holds"
    assert all(got[k].startswith("undecided (the interval") for k in (A, A2, RECALL, INTERNAL, C))
    (tmp_path / "reachability").mkdir()  # only this study: the LR bootstraps take long
    shutil.copy(data, tmp_path / "reachability" / data.name)
    _, pairs, notes = collect(tmp_path)
    v = {x.claim.split(" [tested: ")[0]: x.to_dict() for _, x in pairs}  # issue 39.7's scope
    assert {study for study, _ in pairs} == {"reachability"}
    assert v[f"64-input study: {OUTER}"]["verdict"] == report.verdicts.HOLDS
    assert v[f"64-input study: {C}"]["verdict"] == report.verdicts.UNKNOWN
    assert any("64-input reachability study: 36 runs" in n for n in notes)
