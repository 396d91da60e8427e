"""The figures of README's tested-models table (not a test): for each real looped family in
tests/realmodels.py, the errors of Σ_r G, per-visit G and ‖U‖ (the last gradient-visible visit
of each sublayer) against the brute force, κ_j, ρ against dense eigenvalues where one module
holds a round, and the CPU time; every figure from a public ``loopprobe.testing`` check.

    .venv/bin/python scripts/real_model_figures.py
"""

from __future__ import annotations

import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import realmodels as rm  # noqa: E402

import loopprobe.testing as lpt  # noqa: E402

ROUNDS = {"make_albert": "encoder.albert_layer_groups.0", "make_xt_looped": "attn_layers"}
ROUNDS["make_torch_encoder"] = "layer"
FAMILIES = ["make_albert", "make_hrm_text", "make_zamba", "make_xt_looped"]
FAMILIES += ["make_xt_weight_tied", "make_torch_encoder"]


def main() -> None:
    torch.set_num_threads(1)
    for name in FAMILIES:
        t = time.process_time()
        case = getattr(rm, name)()
        sum_g = max(case.check(lpt.check_updates_sum_to_tied_gradient, loss=True).values())
        g = case.check(lpt.check_updates_match_untied_copy, loss=True, rtol=rm.EXACT)
        per_visit, n = max(g.values()), len(g)
        dense = lpt.check_sensitivity_matches_dense_jacobian
        u = max(case.check(dense, output=True, rtol=1e-6, **rm.LANCZOS).values())
        rep = case.check(lpt.check_kappa_in_range, loss=True, output=True, **rm.LANCZOS)
        kappa = dict(zip(rep.sublayers.sublayer, rep.sublayers.kappa.round(3), strict=True))
        rho = None
        if name in ROUNDS:
            rho = case.check(lpt.check_spectral_radius_matches_dense, ROUNDS[name])
        print(
            f"{name}: sum G {sum_g:.1e} | G vs untied {per_visit:.1e} over {n} visits | "
            f"U vs dense {u:.1e} | kappa {kappa} converged {rep.converged} | rho {rho} | "
            f"{time.process_time() - t:.1f} CPU-s",
            flush=True,
        )


if __name__ == "__main__":
    main()
