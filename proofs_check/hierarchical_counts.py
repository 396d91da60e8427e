"""Eq. 17-22: visit counts of a hierarchical (HRM-style) reasoner and the range of kappa_bar_g.

Statement (seed 002, Eq. 17-22). H has K_H blocks, L has K_L blocks (two residual
sublayers each); C outer cycles, L iterating C_L times per cycle before one H update.
- Eq. 17: forward visits M = 2C (K_H + C_L K_L).
- Eq. 18: with the one-step gradient (earlier cycles detached) the gradient-visible visits
  are M_g = 2 (K_H + C_L K_L), so M = C M_g.
- Eq. 19: per physical sublayer on the gradient-visible cycle R_g^(H) = 1, R_g^(L) = C_L.
- Eq. 20-21: kappa_g^(H) <= 1 (one term), kappa_g^(L) in [0, C_L], and
  kappa_bar_g = (J_H + J_L C_L kappa_g^(L)) / M_g lies in
  [J_H / M_g, 1 + J_L C_L (C_L - 1) / M_g] (J_H = 2K_H, J_L = 2K_L).
- Eq. 22: with alpha = (c N_g)^p, beta = (d N_g)^(-p), N_g = M_g/2:
  M_g kappa_bar_g (cd)^(-2p) N_g^(-4p) = 2^(4p) (cd)^(-2p) kappa_bar_g M_g^(1-4p).

Checks:
- count: on the reference HierarchicalLoop, ``lp.attach(model).visit_table`` counts, from
  one real forward with hooks, the forward visits, the gradient-visible ones (whose
  per-visit offset reaches the output) and the visits per sublayer, for a grid of
  (C, K_H, C_L, K_L); all must equal Eq. 17-19 and ``theory.hierarchical_counts``.
- symbolic: the upper end of the Eq. 21 range equals the definition at kappa_L = C_L; the
  Eq. 22 identity.
- exact (measured kappa): kappa_j on the gradient-visible visits with
  ``lp.visit_alignment`` (Lanczos on JVP/VJP, convergence required), cross-checked against
  brute force (``lp.attach`` per-visit parameter swap, dense jacrev; agreement 1e-6);
  kappa_g^(H) <= 1, kappa_g^(L) in [0, C_L], R_g^(L) = C_L, and the resulting kappa_bar_g
  inside the Eq. 21 range.

Wrong variant: "every forward visit is gradient-visible (M_g = M)".

What a check cannot establish: the bound (20) for the untruncated forward map (the seed
notes it needs an extra read factor), nor HRM's training dynamics.
"""

from __future__ import annotations

import functools
import itertools

import sympy as sp
import torch
from torch.func import jacrev

import loopprobe as lp
from loopprobe import theory
from loopprobe.models import HierarchicalLoop, HRMConfig
from proofs_check._common import cross_entropy, kappa, opnorm, tokens
from proofs_check._registry import Outcome, Profile, statement, wrong_variant

REF = "seed 002, Eq. 17-22"


def _grid(profile: Profile) -> list[tuple[int, int, int, int]]:
    vals = (1, 2, 3) if profile.wide else (1, 2)
    grid = list(itertools.product(vals, vals, vals + (3,) if not profile.wide else vals, vals))
    return sorted(set(grid))


def _model(C: int, K_H: int, C_L: int, K_L: int, seed: int = 0) -> HierarchicalLoop:
    cfg = HRMConfig(vocab_size=16, seq_len=4, d_model=8, n_heads=2, K_H=K_H, K_L=K_L, C=C, C_L=C_L)
    return HierarchicalLoop(cfg, generator=torch.Generator().manual_seed(seed)).double()


@functools.cache
def measured_counts(C: int, K_H: int, C_L: int, K_L: int) -> dict:
    model = _model(C, K_H, C_L, K_L)
    idx, _ = tokens(16, 2, 4, 0)
    df = lp.attach(model).visit_table(idx)
    H = df[df.sublayer.str.startswith("H_blocks")]
    L = df[df.sublayer.str.startswith("L_blocks")]
    return {
        "M": df.attrs["M"],
        "M_g": df.attrs["M_g"],
        "J_H": len(H),
        "J_L": len(L),
        "R_H": sorted(set(H.visits)),
        "R_L": sorted(set(L.visits)),
        "R_g_H": sorted(set(H.grad_visible)),
        "R_g_L": sorted(set(L.grad_visible)),
    }


@statement("Eq 17-19: M, M_g, R_g^H = 1, R_g^L = C_L counted on HierarchicalLoop", REF, "count")
def check_counts(profile: Profile) -> Outcome:
    bad, grid = [], _grid(profile)
    for C, K_H, C_L, K_L in grid:
        got = measured_counts(C, K_H, C_L, K_L)
        th = theory.hierarchical_counts(C, K_H, C_L, K_L)
        want = {
            "M": th["M"],
            "M_g": th["M_g"],
            "J_H": th["J_H"],
            "J_L": th["J_L"],
            "R_H": [C],
            "R_L": [C * C_L],
            "R_g_H": [th["R_g_H"]],
            "R_g_L": [th["R_g_L"]],
        }
        if got != want or th["M"] != C * th["M_g"]:
            bad.append(f"(C,K_H,C_L,K_L)={C, K_H, C_L, K_L}: {got} vs {want}")
    return Outcome(
        not bad,
        f"{len(grid) - len(bad)}/{len(grid)} configs: measured M, M_g, J, R_g match Eq. 17-19"
        + (f"; first mismatch {bad[0]}" if bad else ""),
    )


@wrong_variant("every forward visit is gradient-visible (M_g = M)", REF, "count")
def wrong_mg_equals_m(profile: Profile) -> Outcome:
    grid = [g for g in _grid(profile) if g[0] > 1]
    hits = [(g, measured_counts(*g)) for g in grid]
    same = [g for g, m in hits if m["M_g"] == m["M"]]
    g, m = hits[0]
    return Outcome(
        len(same) == len(grid),
        f"{len(same)}/{len(grid)} configs with C>1 have M_g = M "
        f"(e.g. C={g[0]}: M={m['M']}, M_g={m['M_g']})",
    )


@statement("Eq 21-22: range of kappa_bar_g and the M_g^(1-4p) form", REF, "symbolic")
def check_symbolic(profile: Profile) -> Outcome:
    J_H, J_L, C_L, kL, c, d, p, kb = sp.symbols(
        "J_H J_L C_L kappa_L c d p kappa_bar", positive=True
    )
    M_g = J_H + J_L * C_L  # = 2(K_H + C_L K_L)
    bar = (J_H + J_L * C_L * kL) / M_g
    ok_hi = sp.simplify(bar.subs(kL, C_L) - (1 + J_L * C_L * (C_L - 1) / M_g)) == 0
    ok_lo = sp.simplify(bar.subs(kL, 0) - J_H / M_g) == 0
    ok_mono = sp.simplify(sp.diff(bar, kL)).is_positive
    Mg = sp.symbols("M_g", positive=True)
    lhs = Mg * kb * (c * d) ** (-2 * p) * (Mg / 2) ** (-4 * p)
    rhs = 2 ** (4 * p) * (c * d) ** (-2 * p) * kb * Mg ** (1 - 4 * p)
    ok22 = sp.simplify(sp.powsimp(sp.expand_power_base(lhs / rhs, force=True), force=True)) == 1
    worst = 0.0
    for C, K_H, C_L_, K_L in _grid(profile):
        th = theory.hierarchical_counts(C, K_H, C_L_, K_L)
        lo, hi = th["kappa_bar_range"]
        want_hi = 1 + th["J_L"] * C_L_ * (C_L_ - 1) / th["M_g"]
        worst = max(worst, abs(lo - th["J_H"] / th["M_g"]), abs(hi - want_hi))
    ok = ok_hi and ok_lo and bool(ok_mono) and ok22 and worst < 1e-12
    return Outcome(
        ok, f"range ends, monotonicity and Eq. 22 hold in sympy; theory.py err {worst:.0e}"
    )


def _per_visit_hrm(C: int, K_H: int, C_L: int, K_L: int, seed: int):
    model = _model(C, K_H, C_L, K_L, seed)
    idx, tgt = tokens(16, 2, 4, seed)
    probe = lp.attach(model)
    visits = [v for v in probe.visits(idx) if v.grad_visible]
    groups = probe.groups(idx)
    params = [[p.detach() for p in g.params] for g in groups]
    slot = {v.i: n for n, v in enumerate(visits)}

    def F(deltas: list[list[torch.Tensor]]) -> torch.Tensor:
        def enter(v, mod, args, kw):
            if v.i not in slot:
                return None
            return [p + dl for p, dl in zip(params[v.j], deltas[slot[v.i]], strict=True)]

        with probe.session(enter):
            return model(idx).reshape(-1)

    zeros = [[torch.zeros_like(p) for p in params[v.j]] for v in visits]
    J = jacrev(F)(zeros)
    F0 = F(zeros).detach()
    dLdF = torch.func.grad(lambda z: cross_entropy(z.reshape(2, 4, -1), tgt))(F0)
    per_j: dict[int, tuple[list, list]] = {}
    for n, v in enumerate(visits):
        Ur = torch.cat([t.reshape(F0.numel(), -1) for t in J[n]], 1)
        Us, Gs = per_j.setdefault(v.j, ([], []))
        Us.append(Ur.detach())
        Gs.append((Ur.t() @ dLdF).detach())
    rep = lp.visit_alignment(
        probe, idx, lambda out, inp: cross_entropy(out, tgt), method="lanczos", max_iter=30
    )
    lib = rep.sublayers.set_index("sublayer")
    out = {}
    for j, (Us, Gs) in per_j.items():
        name = groups[j].sublayer.name
        brute = kappa(Us, Gs, max(opnorm(U) for U in Us), max(float(G.norm()) for G in Gs))
        row = lib.loc[name]
        out[name] = (int(row.R_g), float(row.kappa), brute, bool(row.converged))
    return out


@statement(
    "Eq 20-21 measured: kappa_g^H <= 1, kappa_g^L in [0, C_L], kappa_bar_g in range", REF, "exact"
)
def check_kappa(profile: Profile) -> Outcome:
    cases = [(2, 1, 2, 1, 0), (2, 1, 3, 1, 1)] + (
        [(3, 2, 2, 1, 2), (2, 1, 4, 2, 3)] if profile.wide else []
    )
    bad, figs, gap = [], [], 0.0
    for C, K_H, C_L, K_L, seed in cases:
        ks = _per_visit_hrm(C, K_H, C_L, K_L, seed)
        gap = max([gap] + [abs(k / b - 1) for _, k, b, _ in ks.values()])
        if not all(c for *_, c in ks.values()):
            bad.append(("not converged", C, K_H, C_L, K_L))
        kH = max(k for n, (R, k, _, _) in ks.items() if n.startswith("H_blocks"))
        kL = max(k for n, (R, k, _, _) in ks.items() if n.startswith("L_blocks"))
        RL = {R for n, (R, *_) in ks.items() if n.startswith("L_blocks")}
        th = theory.hierarchical_counts(C, K_H, C_L, K_L)
        kb = theory.kappa_bar_g(th["J_H"], th["J_L"], C_L, kL, th["M_g"])
        lo, hi = th["kappa_bar_range"]
        if not (
            kH <= 1 + 1e-12 and 0 <= kL <= C_L * (1 + 1e-12) and RL == {C_L} and lo <= kb <= hi
        ):
            bad.append((C, K_H, C_L, K_L))
        figs.append(f"C_L={C_L}: kappa_L={kL:.2f}, kappa_bar_g={kb:.2f} in [{lo:.2f}, {hi:.2f}]")
    if gap > 1e-6:
        bad.append(f"lp.visit_alignment vs brute force differ by {gap:.1e}")
    return Outcome(
        not bad,
        "; ".join(figs)
        + f" (lp.visit_alignment; brute force agrees to {gap:.0e})"
        + (f"; violated at {bad}" if bad else ""),
    )
