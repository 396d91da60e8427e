"""Iterations to converge of the operator-norm methods on the reference model (issue 11.2).

Per scheme (DeepLoop, DeepNorm): LoopedGPT K=2, R=4, d 16, seq 16, batch 4, float64, one
thread; ``visit_alignment`` with power iteration and with Lanczos (the default), both with
``max_iter=100`` and the default tolerance (1e-10 in float64). Prints, per method, whether
every estimate converged, the max and mean iterations over the 20 operators, the CPU time
and kappa_R.

    .venv/bin/python benchmarks/bench_convergence.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

import loopprobe as lp


def main() -> None:
    torch.set_num_threads(1)
    idx, tg = lp.tasks.random_tokens(4, 16, 64, generator=torch.Generator().manual_seed(0))

    def loss(out: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), tg.flatten())

    print("scheme    method   converged  iters max  iters mean  CPU-s  kappa_R")
    for norm in ("deeploop", "deepnorm"):
        cfg = lp.models.GPTConfig(K=2, R=4, norm=norm, d_model=16, n_heads=2, seq_len=16)
        model = lp.models.LoopedGPT(cfg, generator=torch.Generator().manual_seed(0)).double()
        for method in ("power", "lanczos"):
            t = time.process_time()
            rep = lp.visit_alignment(lp.attach(model), idx, loss, method=method, max_iter=100)
            cpu = time.process_time() - t
            it = rep.visits.iterations
            print(
                f"{norm:9s} {method:8s} {str(rep.converged):9s}  {it.max():9d}  "
                f"{it.mean():10.1f}  {cpu:5.1f}  {rep.kappa:.6f}"
            )


if __name__ == "__main__":
    main()
