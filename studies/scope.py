"""What each verdict was tested at, and what would decide an undecided one (issue 39.7).

A study's verdict is about the scale and design it ran, not the paper's: every row of
``studies/verdicts.csv`` carries ``[tested: ...]`` after its claim (model, budget, optimizer
setting, seeds), and every undecided row says in ``why`` what would decide it. The entries
are matched by study and claim prefix, first match wins; :func:`worded` applies them.
"""

from __future__ import annotations

import dataclasses

from loopprobe.report.verdicts import UNKNOWN, Verdict

_LRT1 = "pre-norm LoopedGPT d 32, N 1-8, 120 AdamW steps, octave lr grid, 8 seeds"
_LRT2 = "pre-norm LoopedGPT d 32, N 1-8, 200 AdamW steps, half-octave lr grid, 12 seeds"
_LRT_DECIDE = ("an interval narrower than the 0.75-octave margin: more seeds (about 4x) or a "
               "finer grid around each optimum")  # fmt: skip
_REACH = "one-block pre-norm LoopedGPT d 32, R 4, prefix sums and sudoku-like, <= 1000 steps"
_REACH64 = _REACH + ", 36 runs x 64 inputs"
_REACH_RD = ("one-block LoopedGPT d 32, R 4, pre-norm + outer norm vs post-norm without it, "
             "prefix sums and sudoku-like, <= 600 steps, 60 runs x 64 inputs")  # fmt: skip
_REACH_DECIDE = ("a no-outer-norm arm that can have fixed points (post-norm) and >= 10 runs "
                 "per arm (pre-registered in docs/studies/reachability.md)")  # fmt: skip
_DL = ("post-norm LoopedGPT d 32, K 2, 1000 steps, one lr 3e-3 for every arm (below each arm's "
       "optimum), clip 1, 12 seeds")  # fmt: skip
_EDGE = ("pre-norm LoopedGPT d 32, K 1, N 1-16, 200 steps, clip 1, failure = ending within "
         "0.1 nats of the unigram floor, 6 seeds")  # fmt: skip
_FS = ("3 trained models (pre-norm d 32, K 1, R 4, prefix sums, 600 steps), intervals over "
       "inputs only")  # fmt: skip
_FLT = "LT and FLT d 32, K 2, R 12, 300 steps, lr 1e-2 and 3e-2, no clipping, 5 seeds"
_FLT_PILOT = ("the redesign's pilot (LT d 32, K 2, R 12 and 24, lr 3e-2, 6e-2 and 1e-1, 300 "
              "steps, 3 seeds; docs/studies/flt.md) found no positive control: 6 of 18 runs "
              "collapsed, no (R, lr) in 3 of 3")  # fmt: skip

#: (study, claim prefix, what was tested, what would decide it if undecided)
SCOPES: list[tuple[str, str, str, str]] = [
    ("lr_transfer", "run 1", _LRT1, _LRT_DECIDE),
    ("lr_transfer", "run 2: 1/√N moves the optimum 1.5", _LRT2,
     "a contrast interval that excludes -1.5 under the quartic vertex too: more seeds"),
    ("lr_transfer", "run 2", _LRT2, _LRT_DECIDE),
    ("reachability", "redesign: recall", _REACH_RD, "intervals about half as wide (0.25-0.40 "
     "at 10 vs 10 runs; between-run sd 0.13-0.42): about 4x the runs per arm"),
    ("reachability", "redesign: with outer norm on", _REACH_RD, "a verdict that survives 2x the "
     "hard cap: more iterations for the slow misses, or more runs"),
    ("reachability", "redesign", _REACH_RD, "more runs per arm: at 10 the intervals are "
     "0.09 (accuracy) to 0.37 (reach) wide; about 4x the runs"),
    ("reachability", "64-input study", _REACH64, _REACH_DECIDE),
    ("reachability", "outer norm is what", _REACH + ", 24 runs; without the outer norm the "
     "pre-norm stream drifts linearly, so no weights reach a fixed point: holds by construction",
     ""),
    ("reachability", "A: recall", _REACH + ", 24 runs",
     "more iterations per miss and >= 10 runs per arm"),
    ("reachability", "B: without recall", _REACH + ", 24 runs",
     "a design where the no-recall fixed point is not input-free by construction"),
    ("reachability", "", _REACH + ", 24 runs", _REACH_DECIDE),
    ("deeploop", "DeepLoop: p-sweep", "the design above at R = 3 only, 5 seeds",
     "the p-sweep across R in {2, 4, 8, 16} with an instability outcome (pre-registered in "
     "docs/studies/deeploop.md, Redesign)"),
    ("deeploop", "DeepLoop (redesign): p-sweep", "postp LoopedGPT d 32, K 2, R 2/4/8/16, 1000 "
     "steps, lr 1e-2, no clipping, 3 seeds; unstable = divergence or a 0.5-nat loss rise",
     "more seeds per cell, or a higher lr where some p is unstable"),
    ("deeploop", "DeepLoop (redesign): seed's backbone", "LoopedGPT d 32, K 2 with RoPE and an "
     "input-embedding RMSNorm, R 1 and 3, 1000 steps, clip 1, each arm at its lr tuned on "
     "learned positions (not re-tuned), 6 seeds", "each arm's lr tuned on this backbone, or "
     "more seeds where an interval straddles the criterion"),
    ("deeploop", "DeepLoop (redesign): R = 7", "post-norm LoopedGPT d 32, K 2, R 7, 1000 steps, "
     "clip 1, each arm at its best of 3-4 rates around its R = 7 pilot optimum (one rate added "
     "beyond an end optimum), 6 seeds", "the two lr choices agreeing: at its pilot optimum "
     "3e-3 DeepNorm stays on the floor in 3 of 6 seeds, so that interval spans 0; more seeds "
     "there, or DeepNorm's pilot re-run on more seeds (docs/studies/deeploop.md)"),
    ("deeploop", "DeepLoop (redesign): whole claim", "post-norm LoopedGPT d 32, K 2, R 1, 3 "
     "and 7, 1000 steps, clip 1, each arm at its best of 3 rates per R (3-4 at R = 7), 6 seeds",
     "every part decided (docs/studies/deeploop.md, Second redesign)"),
    ("deeploop", "DeepLoop (redesign)", "post-norm LoopedGPT d 32, K 2, R 1 and 3, 1000 steps, "
     "clip 1, each arm at its best of 3 rates (bracketed; the pilot's rates agree), 6 seeds",
     "the redesign's cells complete (docs/studies/deeploop.md)"),
    ("deeploop", "", _DL,
     "each arm at its own tuned lr, >= 6 seeds (the redesign in docs/studies/deeploop.md)"),
    ("lr_edge", "LR edge (redesign)", "pre-norm LoopedGPT d 32, K 1, N 1-16, 200 steps, no "
     "clipping, unstable = non-finite or a 0.5-nat rise of the 10-step mean training loss, "
     "half-octave lr grid 2^-7 .. 2^1, the complete seeds of 100-105 (count in the measured "
     "text)", "the rest of the pre-registered seeds (resumable: python -m studies lr_edge "
     "--design redesign), then both intervals narrower than 1/2"),
    ("lr_edge", "LR edge (post hoc", _EDGE.replace(", failure = ending within 0.1 nats of the "
     "unigram floor", ""), "a pre-registered run with failure defined by instability during "
     "training (docs/studies/lr_edge.md, Redesign)"),
    ("lr_edge", "LR edge cells (post hoc", _EDGE.split(", failure")[0] + ", 6 seeds; the "
     "rates every seed ran (octave grid 2^-7 .. 2^0)", ""),
    ("lr_edge", "", _EDGE, "an edge defined by instability during training, not by the floor"),
    ("lr_l", "LR vs L (redesign", "pre-norm LoopedGPT, eps = 1/(N sqrt L), d 32, L 1-2 x N 1-8, "
     "byte-level text, 200 AdamW steps, clip 1, half-octave lr grid 2^-9 .. 2^-3, 4 seeds",
     "drift intervals narrower than the 1-octave band (at 4 seeds they are 3.4 and 4.0 octaves "
     "wide; one seed's optimum moves by about 0.9 octave): about 16x the seeds, or a budget "
     "where the loss against lr is less flat near its optimum"),
    ("lr_l", "", "pilot task search only, d 32, <= 2000 steps, 1 seed",
     "the grid without the gate: L in {1, 2} x N in {1, 2, 4, 8}, half-octave lr grid, >= 4 "
     "seeds (pre-registered in docs/studies/lr_l.md)"),
    ("finite_step", "finite step, 10 models", "10 trained models (seeds 100-109, pre-norm d 32, "
     "K 1, R 4, prefix sums, 600 steps; train loss 0.25-0.44), t interval over models",
     "more models: the interval over 10 is about +-0.07 for H1"),
    ("finite_step", "finite step, over", _FS.replace("intervals over inputs only",
     "t interval over the 3 models"), ">= 10 trained models (pre-registered in "
     "docs/studies/finite_step.md): with 3 the t quantile is 4.30"),
    ("finite_step", "", _FS,
     ">= 10 trained models with statistics per model and intervals over models (pre-registered "
     "in docs/studies/finite_step.md)"),
    ("flt", "FLT: oscillation", _FLT + "; the signal is the across-visit gradient cosine, not "
     "the paper's per-layer gradient-norm oscillation", "the paper's own diagnostic in a regime "
     "where the looped baseline collapses reliably; " + _FLT_PILOT + ", and there (exploratory) "
     "the paper's diagnostic fired by step 30 in all 18 runs, collapsed or not"),
    ("flt", "FLT: explosion", _FLT + "; the flag is an absolute stream RMS > 10, on at "
     "initialisation for unscaled loops", "a growth flag relative to each run's own start"),
    ("flt", "FLT (redesign)", "LT and FLT d 32, K 2, at the pilot's (R, lr) (docs/studies/"
     "flt.md), 300 steps, no clipping, 10 seeds", "more seeds at the same (R, lr)"),
    ("flt", "", _FLT, "a regime where the looped baseline collapses reliably (a positive "
     "control); " + _FLT_PILOT + ": longer runs, more loops or the authors' backbone and "
     "optimizer"),
]  # fmt: skip


def scope_of(study: str, claim: str) -> tuple[str, str]:
    """(what was tested, what would decide it) for a verdict of ``study`` on ``claim``."""
    for s, prefix, tested, decide in SCOPES:
        if s == study and claim.startswith(prefix):
            return tested, decide
    raise ValueError(f"scope_of: no scope for study {study!r}, claim {claim!r}; add one to "
                     "studies.scope.SCOPES")  # fmt: skip


def worded(study: str, v: Verdict) -> Verdict:
    """``v`` with ``[tested: ...]`` after its claim and, when undecided, what would decide it."""
    tested, decide = scope_of(study, v.claim)
    why = v.why
    if v.verdict == UNKNOWN and decide:
        why = f"{why}; would decide it: {decide}" if why else f"would decide it: {decide}"
    return dataclasses.replace(v, claim=f"{v.claim} [tested: {tested}]", why=why)
