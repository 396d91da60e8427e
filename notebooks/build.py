"""Write the numbered notebooks from the cell sources below, with outputs stripped.

    .venv/bin/python notebooks/build.py          # rewrite notebooks/*.ipynb
    .venv/bin/python notebooks/build.py --check  # exit 1 if a stored notebook differs

Every notebook opens with the question it answers and the seed it comes from, imports
only ``loopprobe`` (plus torch/os where a user would), and runs at reduced size when
``LOOPPROBE_NOTEBOOK_SMALL=1`` (the test suite sets it). Any helper longer than a few
lines belongs in the library, not here.
"""

from __future__ import annotations

import pathlib
import sys

import nbformat

HERE = pathlib.Path(__file__).resolve().parent

SETUP = """\
import os

import torch

import loopprobe as lp

SMALL = os.environ.get("LOOPPROBE_NOTEBOOK_SMALL") == "1"  # the test suite's reduced size
torch.set_num_threads(1)  # tiny models: per-op overhead dominates, threads only add to it"""

NOTEBOOKS: dict[str, list[tuple[str, str]]] = {}

# ------------------------------------------------------------------------------------ 01

NOTEBOOKS["01_visit_alignment"] = [
    (
        "md",
        """\
# 01 · Visit alignment κ_R and the tied-depth bound

**Question.** When one block is looped R times, do its R visits push the output in the same
direction (κ_R ≈ R), and does the output change after one optimizer step then follow the
bound M·κ_R·(β/α)² — growing like R under DeepNorm but flat under DeepLoop?

**Seed.** 002, the DeepLoop derivation: per-visit updates G_{r,j} and sensitivities U_{r,j}
(Eq. 11), the alignment coefficient κ_j (Eq. 12), the bound (Eqs. 13–16).

Takes about a minute on 2 CPU cores (seconds with `LOOPPROBE_NOTEBOOK_SMALL=1`).""",
    ),
    ("code", SETUP),
    (
        "code",
        """\
from torch.nn.functional import cross_entropy

from loopprobe.models import GPTConfig, LoopedGPT

size = dict(vocab_size=64, seq_len=8 if SMALL else 16, d_model=16 if SMALL else 32,
            n_heads=2 if SMALL else 4)
idx, targets = lp.tasks.random_tokens(2 if SMALL else 4, size["seq_len"], size["vocab_size"],
                                      torch.Generator().manual_seed(0))


def loss_fn(logits, _inputs):
    return cross_entropy(logits.flatten(0, 1), targets.flatten())


def gpt(norm, R, K=2):
    cfg = GPTConfig(**size, K=K, R=R, norm=norm)
    return LoopedGPT(cfg, generator=torch.Generator().manual_seed(0))""",
    ),
    (
        "md",
        """\
## The visits of one model

`lp.attach` finds the physical sublayers (one attention and one MLP branch per block) and
counts their visits from one real forward pass; M and M_g are measured, not assumed.""",
    ),
    (
        "code",
        """\
model = gpt("deeploop", R=4)
with lp.attach(model) as probe:
    table = probe.visit_table(idx)
    rep = lp.visit_alignment(probe, idx, loss_fn, max_iter=30, tol=1e-6)
print(f"M = {table.attrs['M']} visits (2KR = {2 * 2 * 4}), M_g = {table.attrs['M_g']}, "
      f"kappa_R = {rep.kappa:.3f}")
table""",
    ),
    (
        "code",
        """\
rep.sublayers[["sublayer", "R_g", "kappa", "U_tied", "U_max", "G_tied", "G_max"]]""",
    ),
    (
        "md",
        """\
κ_j close to R_j: the G_{r,j} of different visits are nearly parallel, which the cosine
matrices show directly (near 1 off the diagonal).""",
    ),
    (
        "code",
        """\
lp.plots.visit_norms(rep.visits)""",
    ),
    (
        "code",
        """\
cos = {name: c.numpy() for name, c in rep.cos_G.items()}
lp.plots.visit_cosines(cos, max_panels=len(cos))  # every sublayer: the default shows 4""",
    ),
    (
        "md",
        """\
## The bound check over R

One cell per (scheme, R): `lp.bound_check` takes one real SGD step on the looped sublayers
and measures ‖ΔF‖/‖F‖ (first order and the true finite change) next to the prediction
M·κ_R·(β/α)². `lp.sweep` runs the grid into one tidy frame (pass `cache_dir=` to keep
finished cells on disk, so re-plotting never recomputes).""",
    ),
    (
        "code",
        """\
Rs = [1, 2, 4] if SMALL else [1, 2, 4, 8, 16]


def bound_cell(cfg):
    with lp.attach(gpt(cfg["norm"], cfg["R"])) as probe:
        return lp.bound_check(probe, idx, loss_fn, max_iter=20, tol=1e-4).to_dict()


bound = lp.sweep(lp.grid(norm=["deepnorm", "deeploop"], R=Rs), bound_cell, progress=False)
bound[["norm", "R", "kappa", "M", "dF_first", "dF_true", "prediction", "C"]]""",
    ),
    (
        "code",
        """\
predicted = lp.plots.predicted_slopes(["deepnorm", "deeploop"])
for norm, g in bound.groupby("norm", sort=False):
    slope = lp.plots.loglog_slope(g.R, g.dF_true)
    print(f"{norm}: fitted slope of ||dF|| in R = {slope:+.3f}, predicted "
          f"{predicted[norm]:+.0f} (aligned); C max/min = {g.C.max() / g.C.min():.3f}")""",
    ),
    (
        "code",
        """\
lp.plots.kappa_vs_R(bound)""",
    ),
    (
        "code",
        """\
lp.plots.delta_f_vs_R(bound, y="dF_true")""",
    ),
    (
        "md",
        """\
DeepNorm's ‖ΔF‖ grows like R because its β/α only shrinks like N^(-1/2) while the aligned
visits add κ_R ≈ R; DeepLoop's (β/α)² ∝ N^(-2) absorbs both. The constant C stays in a
narrow band across R, which is what makes the bound predictive, not just an upper bound.""",
    ),
]

# ------------------------------------------------------------------------------------ 02

NOTEBOOKS["02_increment_regimes"] = [
    (
        "md",
        """\
# 02 · Increment regimes and the coordinate check across N

**Question.** A shared block looped N times adds N correlated increments to the residual
stream. Does the depth-μP multiplier 1/√N still keep ‖h_N − h_0‖ flat, or is the
loop-aware 1/N needed — and does training then stay N-stable (flat coordinate check)?

**Seed.** 004 (Loop-μP) and 003 (residual scaling for looped models);
docs/definitions.md §3 and §5.""",
    ),
    ("code", SETUP),
    (
        "md",
        """\
## Increments of one looped model

`lp.increments` records what every visit adds to the stream and compares the visits of each
physical sublayer: cosine matrix, mean off-diagonal cosine, and ‖Σ inc‖²/Σ‖inc‖²
(1 uncorrelated, R aligned).""",
    ),
    (
        "code",
        """\
from loopprobe.experiments.growth import start_at_rms
from loopprobe.models import GPTConfig, LoopedGPT

N = 4 if SMALL else 8
cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, K=1, R=N, norm="pre",
                residual="1/sqrt(N)")
model = LoopedGPT(cfg, generator=torch.Generator().manual_seed(0))
idx, _ = lp.tasks.random_tokens(4, 16, 64, torch.Generator().manual_seed(1))
inc = lp.increments(model, idx, forward=start_at_rms(1.0))
inc.group_frame()""",
    ),
    (
        "code",
        """\
inc.heatmap()""",
    ),
    (
        "md",
        """\
## Growth regimes over N

`lp.experiments.reference_growth` sweeps N on the pre-norm reference model (tied: one block N times;
untied: N blocks once), fits the log-log exponent of ‖h_N − h_0‖/‖h_0‖ and names the regime.""",
    ),
    (
        "code",
        """\
import pandas as pd

Ns = [1, 2, 4, 8] if SMALL else [1, 2, 4, 8, 16, 32]
seeds = [0] if SMALL else [0, 1, 2]
growth = {(t, r): lp.experiments.reference_growth(t, r, Ns=Ns, seeds=seeds, d_model=32, seq_len=16, batch=4)
          for t in ("tied", "untied") for r in ("1/sqrt(N)", "1/N")}
pd.DataFrame([{"tying": t, "residual": r, "slope": g.slope, "regime": g.regime,
               "mean off-diag cos": g.mean_offdiag_cos} for (t, r), g in growth.items()])""",
    ),
    (
        "code",
        """\
lp.plots.increment_growth(pd.concat([g.rows for g in growth.values()], ignore_index=True))""",
    ),
    (
        "md",
        """\
## Coordinate check across N

The looped analogue of mup's coordinate check: a few Adam steps at each N, then the RMS
change of the final state since step 0. Flat in N means the parameterization transfers.""",
    ),
    (
        "code",
        """\
schemes = ["pre:1/sqrt(N)", "pre:1/N"] + ([] if SMALL else ["deepnorm", "deeploop"])
cc = lp.experiments.reference_coord_check(schemes, Ns=[1, 2, 4, 8] if SMALL else [1, 2, 4, 8, 16],
                              seeds=[0], steps=2 if SMALL else 4, d_model=32, seq_len=16,
                              batch=4)
cc.flatness()""",
    ),
    (
        "code",
        """\
cc.plot("pre:1/sqrt(N)")""",
    ),
    (
        "code",
        """\
cc.plot("pre:1/N")""",
    ),
    (
        "md",
        """\
Under 1/√N the tied block's state change grows with N (slope ≈ ½); under 1/N it stays
flat. The same block untied is fine under 1/√N: it is the weight sharing, through the
correlation of the increments, that calls for the loop-aware rule.""",
    ),
]

# ------------------------------------------------------------------------------------ 03

NOTEBOOKS["03_fixed_points"] = [
    (
        "md",
        """\
# 03 · Fixed points, recall and outer normalization

**Question.** If one round T(h; x) is iterated to a fixed point h*, is h* reachable
(ρ(∂T/∂h) < 1), and does it depend on the input x? Without recall the input only sets the
start, so h* cannot depend on x; recall plus an outer normalization should give reachable
fixed points that do.

**Seed.** 000 / 003 (the fixed-point framework: reachability, input-dependence, geometry);
docs/definitions.md §4.""",
    ),
    ("code", SETUP),
    (
        "md",
        """\
## A linear loop: the estimators against closed forms

`LinearLoop` iterates h ← h + ε W h with a planted spectrum, so ρ(∂T/∂h) = max|1 + ε λ|.""",
    ),
    (
        "code",
        """\
from loopprobe.models import LinearLoop, LinearLoopConfig

spectrum = [-0.9, -0.5, -0.2, 0.1, 0.3, 0.5, 0.7, 0.8]
lin = LinearLoop(LinearLoopConfig(d=8, R=4, spectrum=spectrum, eps=0.5),
                 generator=torch.Generator().manual_seed(0)).double()
x = torch.randn(1, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
sr = lp.spectral_radius(lambda h: lin.step(h, x), x, k=4)
print(f"rho by Arnoldi on JVPs: {sr.value:.12f}  closed form: "
      f"{max(abs(1 + 0.5 * l) for l in spectrum):.12f}  converged: {sr.converged}")""",
    ),
    (
        "md",
        """\
## Recall variants of a looped GPT, briefly trained

Each one-block model is trained for a few AdamW steps on prefix sums, then one round is
iterated (Picard and Anderson) at a held-out input.""",
    ),
    (
        "code",
        """\
import pandas as pd

from loopprobe.experiments import recall as study

variants = [("none", True), ("add", True)] + ([] if SMALL else [("add", False), ("internal", True)])
rows, traces, eig = [], [], []
for recall, outer in variants:
    model, losses = study.train("prefix_sums", recall, outer, steps=20 if SMALL else 40)
    idx, _, _ = study.task_batch("prefix_sums", 1, 16, torch.Generator().manual_seed(10_000))
    rm = lp.round_map(model.double(), idx)
    name = f"recall={recall}" + (", outer norm" if outer else "")
    fp = lp.fixed_point(rm.T, rm.h0, tol=1e-6, max_iter=200)
    traces.append(fp.to_frame().assign(variant=name))
    sr = lp.spectral_radius(rm.T, fp.h, k=4)
    eig.append(sr.to_frame().assign(variant=name))
    dep = lp.input_dependence(rm.step, fp.h, rm.x, rounds=rm.rounds, norm_tol=1e-4)
    rows.append({"variant": name, "train loss": losses[-1], "converged": fp.converged,
                 "rate": fp.rate, "rho": sr.value, "||dh*/dx|| implicit": dep.value,
                 "||dh_R/dx|| unrolled": dep.unrolled.value})
pd.DataFrame(rows)""",
    ),
    (
        "code",
        """\
lp.plots.fixed_point_residuals(pd.concat(traces, ignore_index=True), tol=1e-6)""",
    ),
    (
        "code",
        """\
lp.plots.eigenvalues(pd.concat(eig, ignore_index=True))""",
    ),
    (
        "md",
        """\
Without recall the implicit ‖dh*/dx‖ is exactly 0 (∂T/∂x = 0), however strongly the
unrolled R rounds depend on x: whatever the model computes from x lives in the transient,
not in the fixed point. With recall the fixed point itself carries the input, and the
outer norm keeps ρ below 1 so that it is reached.""",
    ),
]

# ------------------------------------------------------------------------------------ 04

NOTEBOOKS["04_lr_transfer"] = [
    (
        "md",
        """\
# 04 · Learning-rate transfer across loop count

**Question.** Tune the learning rate at one loop count N; is it still the best at 4N?
Under the loop-aware residual rule 1/N the best lr should stay put, while under 1/√N it
should move with N.

**Seed.** 004 (Loop-μP); issue 4. This runs at a size that fits a few CPU minutes: report
what it shows, including when it does not reproduce the paper's claim.""",
    ),
    ("code", SETUP),
    (
        "code",
        """\
lrs = [4e-3, 1.6e-2, 6.4e-2, 2.56e-1] if SMALL else [2e-3 * 2**k for k in range(7)]
tr = lp.experiments.reference_lr_transfer(
    residuals=("1/sqrt(N)", "1/N"),
    Ns=[1, 4] if SMALL else [1, 2, 4, 8],
    lrs=lrs,
    steps=30 if SMALL else 150,
    d_model=16 if SMALL else 32,
    seq_len=16 if SMALL else 32,
    batch=4 if SMALL else 8,
    eval_batches=2 if SMALL else 4,
)
tr.best()""",
    ),
    (
        "code",
        """\
tr.drift()""",
    ),
    (
        "code",
        """\
tr.plot()""",
    ),
    (
        "md",
        """\
`drift` counts how many grid steps the argmin moves from the smallest to the largest N;
`edge` flags an argmin at the end of the grid (then widen the grid before concluding).
At this scale and training length the curves are shallow; read the drift together with the
plotted curves, and rerun at a larger size before drawing conclusions.""",
    ),
]

# ------------------------------------------------------------------------------------ 05

NOTEBOOKS["05_hierarchical"] = [
    (
        "md",
        """\
# 05 · Hierarchical reasoners: forward visits M vs gradient-visible visits M_g

**Question.** An HRM-style model runs its slow module H and fast module L for C cycles, but
with the one-step gradient only the last cycle carries gradient. Which count enters the
perturbation bound — the forward visits M = 2C(K_H + C_L·K_L) or the gradient-visible
M_g = 2(K_H + C_L·K_L) — and what alignment κ̄_g does the model show?

**Seed.** 002, Eqs. 17–21 (hierarchical counts and the aggregate κ̄_g).""",
    ),
    ("code", SETUP),
    (
        "code",
        """\
import pandas as pd
from torch.nn.functional import cross_entropy

from loopprobe.models import HierarchicalLoop, HRMConfig

C, C_L = (2, 2) if SMALL else (3, 4)
idx, targets = lp.tasks.random_tokens(2, 8, 32, torch.Generator().manual_seed(0))


def loss_fn(logits, _inputs):
    return cross_entropy(logits.flatten(0, 1), targets.flatten())


rows, reports = [], {}
for one_step in (True, False):
    cfg = HRMConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, C=C, C_L=C_L,
                    norm="deeploop", one_step_grad=one_step)
    model = HierarchicalLoop(cfg, generator=torch.Generator().manual_seed(0))
    with lp.attach(model) as probe:
        table = probe.visit_table(idx)
        rep = lp.visit_alignment(probe, idx, loss_fn, max_iter=20, tol=1e-4)
    reports[one_step] = rep
    kappa = dict(zip(rep.sublayers["sublayer"], rep.sublayers["kappa"]))
    rows.append({"one_step_grad": one_step, "M measured": table.attrs["M"], "M formula": cfg.M,
                 "M_g measured": table.attrs["M_g"], "M_g formula": cfg.M_g,
                 "kappa_R": rep.kappa, "kappa L attn": kappa["L_blocks.0.attn"],
                 "kappa H attn": kappa["H_blocks.0.attn"]})
pd.DataFrame(rows)""",
    ),
    (
        "md",
        """\
With the one-step gradient the earlier cycles run under `torch.no_grad()`: the probe sees
them in the forward pass (M) but no gradient reaches them (M_g = M / C). The theory's
counts and the aggregate κ̄_g range follow:""",
    ),
    (
        "code",
        """\
counts = lp.theory.hierarchical_counts(C, 1, C_L, 1)
kappa_L = rows[0]["kappa L attn"]
M_g = rows[0]["M_g measured"]
kbar = lp.theory.kappa_bar_g(counts["J_H"], counts["J_L"], C_L, kappa_L, M_g)
print(f"theory: M = {counts['M']}, M_g = {counts['M_g']}, kappa_bar_g range "
      f"{counts['kappa_bar_range']}; with the measured kappa_L = {kappa_L:.2f}: "
      f"kappa_bar_g = {kbar:.2f}")""",
    ),
    (
        "md",
        """\
Per-visit norms with the one-step gradient: only the last cycle's visits appear (the
gradient-visible ones), C_L visits of each L sublayer and one of each H sublayer.""",
    ),
    (
        "code",
        """\
lp.plots.visit_norms(reports[True].visits)""",
    ),
]

# ------------------------------------------------------------------------------------ 06

NOTEBOOKS["06_attach_your_model"] = [
    (
        "md",
        """\
# 06 · Attach loopprobe to your own looped model

**Question.** I have my own weight-tied model, written without loopprobe in mind. Which of
its modules are reused, how aligned are their visits, how do its increments add up, and
does its round map have a reachable fixed point?

**Seed.** 002 (visits, κ), docs/definitions.md §2–4. The model below is written the way a user would
write it: a plain `nn.Module`, a block called in a Python loop, input re-injected each round.""",
    ),
    ("code", SETUP),
    (
        "code",
        """\
from torch import nn


class TinyLoopLM(nn.Module):
    \"\"\"One pre-norm block applied `rounds` times, the input embedding added every round.\"\"\"

    def __init__(self, vocab=32, d=16, rounds=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.head = nn.Linear(d, vocab)
        self.rounds = rounds

    def attend(self, h):
        q, k, v = self.qkv(self.norm1(h)).chunk(3, dim=-1)
        mask = torch.ones(h.shape[1], h.shape[1], dtype=torch.bool).tril()
        att = (q @ k.transpose(1, 2) / q.shape[-1] ** 0.5).masked_fill(~mask, float("-inf"))
        return self.proj(att.softmax(-1) @ v)

    def block(self, h):
        h = h + self.attend(h)
        return h + self.mlp(self.norm2(h))

    def forward(self, tokens):
        x = self.emb(tokens)
        h = torch.zeros_like(x)
        for _ in range(self.rounds):
            h = self.block(h + x)
        return self.head(h)


torch.manual_seed(0)
model = TinyLoopLM(rounds=3 if SMALL else 6)
tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))""",
    ),
    (
        "md",
        """\
## Which modules are looped?

No names given: `lp.attach` hooks every module that owns parameters for one forward and
groups them by parameter identity. `qkv`, `proj` and the MLP are called once per round;
the embedding and the head once.""",
    ),
    (
        "code",
        """\
with lp.attach(model) as probe:
    table = probe.visit_table(tokens)
table""",
    ),
    (
        "md",
        """\
## Visit alignment

Any scalar loss works; here half the mean square of the logits.""",
    ),
    (
        "code",
        """\
def loss_fn(logits, _tokens):
    return 0.5 * logits.pow(2).mean()


with lp.attach(model) as probe:
    rep = lp.visit_alignment(probe, tokens, loss_fn, max_iter=30, tol=1e-5)
print(f"kappa_R = {rep.kappa:.3f}")
rep.sublayers[["sublayer", "R_g", "kappa", "cos_G_adjacent"]]""",
    ),
    (
        "code",
        """\
cos = {name: c.numpy() for name, c in rep.cos_G.items()}
lp.plots.visit_cosines(cos, max_panels=len(cos))  # every sublayer: the default shows 4""",
    ),
    (
        "md",
        """\
## Increments

The looped sublayers found above are the raw `Linear` layers; to look at what is added to
the stream, name the residual branch outputs instead — here the MLP (an `nn.Sequential`,
called once per round, whose output is exactly the increment).""",
    ),
    (
        "code",
        """\
inc = lp.increments(model, tokens, sublayers=["mlp"])
inc.group_frame()""",
    ),
    (
        "md",
        """\
## The round map and its fixed point

A round of this model is `h -> block(h + x)` with `x = emb(tokens)`: a three-line callable
is all the fixed-point tools need. Next to it, the same round followed by an outer RMS
normalization of the state — an experiment on the round map, not a change to the model.""",
    ),
    (
        "code",
        """\
import pandas as pd

model64 = TinyLoopLM(rounds=model.rounds).double()
model64.load_state_dict(model.state_dict())
x = model64.emb(tokens).detach()


def step(h):
    return model64.block(h + x)


def step_outer_norm(h):
    out = model64.block(h + x)
    return out / out.pow(2).mean(-1, keepdim=True).sqrt()


rows, traces = [], []
for name, T in (("as written", step), ("with outer norm", step_outer_norm)):
    fp = lp.fixed_point(T, torch.zeros_like(x), tol=1e-8, max_iter=300)
    sr = lp.spectral_radius(T, fp.h, k=4)
    rows.append({"round": name, "converged": fp.converged, "iterations": fp.iterations,
                 "rate": fp.rate, "rho(dT/dh)": sr.value, "why it stopped": fp.reason})
    traces.append(fp.to_frame().assign(variant=name))
pd.DataFrame(rows)""",
    ),
    (
        "code",
        """\
lp.plots.fixed_point_residuals(pd.concat(traces, ignore_index=True), tol=1e-8)""",
    ),
    (
        "md",
        """\
As written, the round has ρ(∂T/∂h) ≈ 1: the un-normalized residual stream keeps drifting
and plain iteration crawls (Anderson acceleration even blows up). With an outer
normalization the same block contracts (ρ < 1) and the fixed point is reached in a few
dozen rounds — the recall + outer-norm recipe of notebook 03.""",
    ),
    (
        "md",
        """\
## The same from the command line

Put the model in a module and point the report at it; it runs every diagnostic that
applies and says why it skipped the others:

```bash
loopprobe report --model mypkg.models:make --inputs mypkg.models:batch --out my-report
loopprobe kappa  --model mypkg.models:make --inputs mypkg.models:batch --json
```""",
    ),
]


# ------------------------------------------------------------------------------------ 07

NOTEBOOKS["07_property_tests"] = [
    (
        "md",
        """\
# 07 · Property tests of the bounds on your own model family

**Question.** I designed a new looped architecture. Does it keep the tied-depth bound the
theory promises — the output change after one step flat in R under DeepLoop scaling — and if
a bug breaks it, what is the smallest configuration that shows the break?

**Seed.** 002 (Eqs. 13–16: M·κ_R·(β/α)², DeepLoop flat in R). `loopprobe.testing` turns each
statement into a check that raises an `AssertionError` with the figures, and hypothesis
strategies that draw members of your family and shrink a failure (docs/definitions.md §2).""",
    ),
    ("code", SETUP),
    (
        "code",
        """\
import torch.nn.functional as F
from hypothesis import find
from torch import nn

import loopprobe.testing as lpt


class MyLoop(nn.Module):
    \"\"\"K post-norm MLP blocks applied R times: h <- LayerNorm(alpha h + W2 tanh(W1 h)).\"\"\"

    def __init__(self, R=4, K=1, d=8, p=0.5, scale_from_blocks=False):
        super().__init__()
        N = K * R  # block visits: DeepLoop (p=1/2) scales with visits, not blocks
        self.cfg = lp.theory.scales(N, "postp", p=p)  # alpha=(2N)^p, beta=(8N)^-p: read by checks
        self.run_alpha = (2 * K) ** p if scale_from_blocks else self.cfg.alpha  # planted bug
        self.R, self.inp, self.out = R, nn.Linear(d, d), nn.Linear(d, d)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 2 * d, bias=False), nn.Tanh(),
                          nn.Linear(2 * d, d, bias=False))
            for _ in range(K))
        for b in self.blocks:
            for lin in (b[0], b[2]):
                nn.init.xavier_normal_(lin.weight, gain=self.cfg.beta)

    def forward(self, x):
        h = self.inp(x)
        for _ in range(self.R):
            for b in self.blocks:
                h = F.layer_norm(self.run_alpha * h + b(h), h.shape[-1:])
        return self.out(h)


def make(R=4, K=1, d=8):
    torch.manual_seed(0)
    return MyLoop(R, K, d).double()


def broken(R=4, K=1, d=8):
    torch.manual_seed(0)
    return MyLoop(R, K, d, scale_from_blocks=True).double()


def batch(model, generator):
    return torch.randn(3, 5, model.inp.in_features, generator=generator, dtype=torch.float64)


def loss(out, inputs):
    return out.pow(2).mean()""",
    ),
    (
        "md",
        """\
## The statement that holds

DeepLoop scaling declared and applied: the log-log slope of ‖ΔF‖/‖F‖ in R stays near 0.""",
    ),
    (
        "code",
        """\
x = batch(make(), torch.Generator().manual_seed(0))
sweep = lpt.check_bound_slope(make, x, loss, max_slope=0.15)
slope_ok = sweep.slope
print(f"slope {slope_ok:.3f}, C max/min {sweep.C_ratio:.3f}: the check passes")
lp.plots.delta_f_vs_R(sweep.to_frame().assign(norm="deeploop"), y="dF_true")""",
    ),
    (
        "md",
        """\
## A planted bug, shrunk to the smallest failure

The broken family computes its residual scale from the K blocks instead of the K·R visits.
`hypothesis.find` searches its configurations for one where the measured output change
exceeds the stated constant and shrinks it to the smallest.""",
    ),
    (
        "code",
        """\
def breaks_the_bound(cfg):
    try:
        lpt.check_bound(cfg.model, cfg.batch, cfg.loss, C_max=2e-3)
    except AssertionError as err:
        print(str(err).splitlines()[0])
        return True
    return False


Rs = (2, 6) if SMALL else (2, 16)
smallest = find(lpt.configs(broken, batch=batch, loss=loss, R=Rs, K=(1, 2), d=[8, 16]),
                breaks_the_bound, settings=lpt.settings("ci"))
print("smallest failing configuration:", smallest)""",
    ),
]

# ------------------------------------------------------------------------------------ build


def render(name: str) -> str:
    """The notebook's JSON: cells with stable ids, no outputs, no execution counts."""
    nb = nbformat.v4.new_notebook()
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    for i, (kind, source) in enumerate(NOTEBOOKS[name]):
        new = nbformat.v4.new_markdown_cell if kind == "md" else nbformat.v4.new_code_cell
        nb.cells.append(new(source, id=f"nb{name[:2]}-{i:02d}"))
    nbformat.validate(nb)
    return nbformat.writes(nb) + "\n"


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for name in NOTEBOOKS:
        path = HERE / f"{name}.ipynb"
        text = render(name)
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
    if stale:
        print(f"stale notebooks (run notebooks/build.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
