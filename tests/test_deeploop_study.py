"""Issue 30.1: the DeepLoop study's analysis on planted cells with a known answer.

The planted cells give every seed a large offset shared by all its arms (1 nat wide), so only
a paired comparison resolves the planted effects of a few hundredths of a nat.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from scipy import stats

from studies.deeploop import analysis as dl
from studies.deeploop import run as deeploop_run

FLOOR = 3.11


def cells(effect: dict, seeds=range(8), noise=0.003, rng_seed=0, nan=()) -> pd.DataFrame:
    """Final-checkpoint rows: loss = 2.6 + seed offset + effect[(arm, R)] + noise; ``nan``
    lists (arm, R, seed) cells whose loss is NaN (a diverged run)."""
    rng = np.random.default_rng(rng_seed)
    offset = {s: rng.uniform(0, 1) for s in seeds}
    rows = []
    for s in seeds:
        for R in dl.RS:
            for arm in dl.ARMS:
                loss = 2.6 + offset[s] + effect.get((arm, R), 0.0) + noise * rng.normal()
                if (arm, R, s) in nan:
                    loss = math.nan
                rows.append({"arm": arm, "p": math.nan, "R": R, "seed": s, "step": 100,
                             "val_loss": loss, "final": True, "cpu_s": 1.0})  # fmt: skip
    return pd.DataFrame(rows)


def improving(gain=0.05, **kw) -> pd.DataFrame:
    """DeepLoop neutral at R = 1, better than both baselines by ``gain`` at R = 3 and 7."""
    return cells({("post", 3): gain, ("post", 7): gain, ("deepnorm", 3): gain,
                  ("deepnorm", 7): gain}, **kw)  # fmt: skip


def verdicts(table: pd.DataFrame, baseline: str) -> dict:
    t = table[table["baseline"] == baseline]
    return dict(zip(t["R"], t["verdict"], strict=True))


def test_planted_neutral_at_one_round_and_gains_beyond_give_holds_against_both_baselines():
    table = dl.comparisons(improving(), FLOOR)
    for b in dl.BASELINES:
        assert verdicts(table, b) == {1: "holds", 3: "holds", 7: "holds"}
        assert dl.claim(table, b)[0] == "holds"
    row = table[(table["baseline"] == "post") & (table["R"] == 3)].iloc[0]
    assert row["diff"] == pytest.approx(-0.05, abs=0.006)
    assert row["ci_high"] < 0 and row["boot_high"] < 0 and row["n"] == 8


def test_one_seed_is_undecided_whatever_its_difference():
    table = dl.comparisons(improving(gain=0.3, seeds=[5]), FLOOR)
    assert set(table["verdict"]) == {"undecided"}
    assert all("minimum" in r for r in table["reason"])
    assert dl.claim(table, "post")[0] == "undecided"


def test_five_seeds_are_below_the_minimum_even_with_a_clear_interval():
    table = dl.comparisons(improving(gain=0.2, seeds=range(dl.MIN_SEEDS - 1)), FLOOR)
    assert set(table["verdict"]) == {"undecided"}
    assert set(dl.comparisons(improving(gain=0.2, seeds=range(dl.MIN_SEEDS)), FLOOR)["verdict"]) \
        == {"holds"}  # fmt: skip


def test_planted_harm_beyond_one_round_fails_the_claim():
    c = cells({("post", 3): 0.05, ("post", 7): -0.05})  # DeepLoop better at 3, worse at 7
    table = dl.comparisons(c, FLOOR)
    assert verdicts(table, "post") == {1: "holds", 3: "holds", 7: "fails"}
    assert dl.claim(table, "post")[0] == "fails"


def test_a_real_difference_at_one_round_fails_neutrality_and_a_noisy_one_is_undecided():
    table = dl.comparisons(cells({("post", 1): -0.05}), FLOOR)  # DeepLoop 0.05 worse at R = 1
    assert verdicts(table, "post")[1] == "fails"
    noisy = dl.comparisons(cells({}, noise=0.03), FLOOR)
    row = noisy[(noisy["baseline"] == "post") & (noisy["R"] == 1)].iloc[0]
    assert row["verdict"] == "undecided" and "power" in row["reason"]
    assert dl.claim(noisy, "post")[0] == "undecided"


def test_a_small_but_resolved_difference_inside_the_margin_is_neutral():
    table = dl.comparisons(cells({("post", 1): -dl.DELTA / 2}, noise=0.001), FLOOR)
    row = table[(table["baseline"] == "post") & (table["R"] == 1)].iloc[0]
    assert row["ci_low"] > 0 and row["ci_high"] < dl.DELTA  # different from 0, yet neutral
    assert row["verdict"] == "holds"
    edge = dl.comparisons(cells({("post", 1): -dl.DELTA}), FLOOR)  # interval straddles +DELTA
    row = edge[(edge["baseline"] == "post") & (edge["R"] == 1)].iloc[0]
    assert row["ci_low"] > 0 and row["ci_low"] < dl.DELTA < row["ci_high"]
    assert row["verdict"] == "undecided"  # not shown non-neutral, not shown neutral


def test_an_improvement_without_the_power_to_show_it_is_undecided_and_says_its_power():
    table = dl.comparisons(improving(gain=0.01, noise=0.03), FLOOR)
    row = table[(table["baseline"] == "post") & (table["R"] == 7)].iloc[0]
    assert row["verdict"] == "undecided"
    power = dl.power_improves(row["sd"], int(row["n"]))
    assert f"{power:.2f}" in row["reason"] and 0 < power < 0.8


def test_a_diverged_run_counts_as_the_loss_of_a_model_that_learned_nothing():
    c = cells({}, nan={("post", 7, s) for s in range(8)})
    final = dl.final_losses(c, FLOOR)
    bad = final[(final["arm"] == "post") & (final["R"] == 7)]
    assert bad["failed"].all() and np.allclose(bad["loss"], math.log(256))
    assert not bad["escaped"].any()
    table = dl.comparisons(c, FLOOR)
    row = table[(table["baseline"] == "post") & (table["R"] == 7)].iloc[0]
    assert row["verdict"] == "holds" and row["failed_runs"] == 8 and row["n"] == 8


def test_pairs_use_only_seeds_that_have_both_cells():
    c = improving()
    c = c[~((c["arm"] == "post") & (c["R"] == 3) & c["seed"].isin([0, 1]))]
    table = dl.comparisons(c, FLOOR)
    assert table.set_index(["baseline", "R"]).loc[("post", 3), "n"] == 6
    assert table.set_index(["baseline", "R"]).loc[("deepnorm", 3), "n"] == 8


def test_the_t_interval_matches_scipys_one_sample_t_test():
    d = np.random.default_rng(3).normal(-0.02, 0.01, 7)
    m, sd, lo, hi = dl.t_interval(d)
    ci = stats.ttest_1samp(d, 0.0).confidence_interval(0.95)
    assert (lo, hi) == pytest.approx((ci.low, ci.high), rel=1e-12)
    assert sd == pytest.approx(np.std(d, ddof=1)) and m == pytest.approx(d.mean())


@pytest.mark.parametrize(("sd", "n"), [(0.01, 6), (0.02, 8), (0.015, 4)])
def test_the_power_of_improves_matches_a_simulation_of_the_interval(sd, n):
    rng = np.random.default_rng(11)
    d = rng.normal(-dl.GAIN, sd, (20_000, n))
    se = d.std(axis=1, ddof=1) / math.sqrt(n)
    hit = d.mean(axis=1) + stats.t.ppf(0.975, n - 1) * se < 0
    assert dl.power_improves(sd, n) == pytest.approx(hit.mean(), abs=0.015)  # 3 MC se


def test_seeds_needed_is_the_first_n_whose_power_reaches_the_target():
    n = dl.seeds_needed(0.012)
    assert dl.power_improves(0.012, n) >= 0.8 > dl.power_improves(0.012, n - 1)
    assert dl.seeds_needed(1.0, cap=20) == 21  # unreachable within the cap


# ------------------------------------------------------------------------------ p-sweep


def p_cells(escaped: dict, seeds=range(5), extra_seeds=()) -> pd.DataFrame:
    """R = 3 final rows: per p, the first escaped[p] seeds escape (loss 2.6), the rest sit at
    the floor (3.2). p = 0, 1/4, 1/2 are post / deepnorm / deeploop rows; ``extra_seeds`` have those
    arms but did not run the p-sweep."""
    rows = []
    for p, k in escaped.items():
        arm = dl.SHARED_P.get(p, "postp")
        for i, s in enumerate(list(seeds) + list(extra_seeds)):
            if arm == "postp" and s in extra_seeds:
                continue
            loss = 2.6 if (i < k or s in extra_seeds) else 3.2
            rows.append({"arm": arm, "p": p if arm == "postp" else math.nan, "R": 3, "seed": s,
                         "step": 100, "val_loss": loss, "final": True})  # fmt: skip
    return pd.DataFrame(rows)


PAPER = {0.0: 0, 0.25: 0, 0.30: 0, 0.35: 1, 0.40: 2, 0.45: 2, 0.50: 3, 0.55: 5, 0.60: 5}


def test_the_papers_escape_pattern_puts_the_boundary_at_055_and_holds():
    t = dl.p_sweep(p_cells(PAPER), FLOOR)
    assert list(t["escaped"]) == list(PAPER.values()) and set(t["seeds"]) == {5}
    b = dl.p_boundary(t)
    assert b["p_star"] == pytest.approx(0.55) and b["verdict"] == "holds"


def test_every_p_escaping_fails_and_a_boundary_above_the_grid_fails():
    assert dl.p_boundary(dl.p_sweep(p_cells(dict.fromkeys(PAPER, 5)), FLOOR))["verdict"] == "fails"
    none = dl.p_boundary(dl.p_sweep(p_cells(dict.fromkeys(PAPER, 1)), FLOOR))
    assert none["verdict"] == "fails" and math.isnan(none["p_star"])
    mid = {**PAPER, 0.40: 5, 0.45: 5, 0.50: 5}  # p* = 0.40: near but below
    assert dl.p_boundary(dl.p_sweep(p_cells(mid), FLOOR))["verdict"] == "undecided"


def test_a_lucky_low_p_does_not_move_the_boundary():
    b = dl.p_boundary(dl.p_sweep(p_cells({**PAPER, 0.35: 5}), FLOOR))
    assert b["p_star"] == pytest.approx(0.55) and b["verdict"] == "holds"


def test_the_shared_p_cells_come_only_from_seeds_that_ran_the_sweep():
    t = dl.p_sweep(p_cells(PAPER, extra_seeds=[7, 8, 9]), FLOOR)
    assert set(t["seeds"]) == {5}
    assert list(t["escaped"]) == list(PAPER.values())


def test_too_few_seeds_per_p_is_undecided():
    t = dl.p_sweep(p_cells(PAPER, seeds=range(dl.MIN_P_SEEDS - 1)), FLOOR)
    assert dl.p_boundary(t)["verdict"] == "undecided"


# ------------------------------------------------------------------------------ script


def test_a_study_cell_trains_pairs_its_arms_and_reports_checkpoints(lp_one_thread):
    mod = deeploop_run
    cfg = {**mod.BASE, "d": 16, "seq": 8, "batch": 2, "eval_batches": 2, "checkpoints": 2,
           "steps": 4, "lr": 3e-3, "seed": 0, "R": 2, "p": None}  # fmt: skip
    rows = {n: mod.train_cell({**cfg, "norm": n}) for n in ("post", "deeploop")}
    for r in rows.values():
        assert [x["step"] for x in r] == [2, 4] and [x["final"] for x in r] == [False, True]
        assert all(math.isfinite(x["val_loss"]) and not x["diverged"] for x in r)
    assert rows["post"][-1]["val_loss"] != rows["deeploop"][-1]["val_loss"]  # arms differ
    again = mod.train_cell({**cfg, "norm": "post"})
    assert [x["val_loss"] for x in again] == [x["val_loss"] for x in rows["post"]]


def test_the_summary_states_each_verdict_and_the_figure_is_drawn_from_the_cells(tmp_path):
    c = pd.concat([improving(), p_cells(PAPER, seeds=range(100, 105))], ignore_index=True)
    text = dl.summary_markdown(c, FLOOR)
    assert "**claim vs post: holds**" in text and "**claim vs deepnorm: holds**" in text
    assert "**boundary near p = 1/2: holds**" in text and "p* = 0.55" in text
    dl.figure(c, str(tmp_path / "f.png"), FLOOR)
    assert (tmp_path / "f.png").stat().st_size > 10_000


def test_the_arms_of_a_seed_share_their_init_draws_and_their_data(lp_one_thread, monkeypatch):
    mod = deeploop_run
    built, seen = {}, {}

    class Recording(mod.LoopedGPT):
        def __init__(self, cfg, generator=None):
            super().__init__(cfg, generator=generator)
            attn = self.blocks[0].attn.f
            built[cfg.norm] = (attn.q.weight.detach().clone(), attn.v.weight.detach().clone())

    real = mod.tasks.stdlib_text

    def recording_text(batch, seq, gen, split="train"):
        x, y = real(batch, seq, gen, split=split)
        if split == "train":
            seen.setdefault(current[0], []).append(x.clone())
        return x, y

    monkeypatch.setattr(mod, "LoopedGPT", Recording)
    monkeypatch.setattr(mod.tasks, "stdlib_text", recording_text)
    cfg = {**mod.BASE, "d": 16, "seq": 8, "batch": 2, "eval_batches": 1, "checkpoints": 1,
           "steps": 3, "lr": 3e-3, "seed": 4, "R": 3, "p": None}  # fmt: skip
    current = [None]
    for norm in ("post", "deeploop"):
        current[0] = norm
        mod.train_cell({**cfg, "norm": norm})
    beta = mod.GPTConfig(K=2, R=3, norm="deeploop").beta
    assert torch.equal(built["post"][0], built["deeploop"][0])  # q: gain 1 in both
    assert torch.allclose(built["deeploop"][1], beta * built["post"][1])  # v: gain beta
    assert all(torch.equal(a, b) for a, b in zip(seen["post"], seen["deeploop"], strict=True))
