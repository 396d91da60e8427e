"""``loopprobe fixed-point``: reachability, geometry and input-dependence of one round.

Example::

    loopprobe fixed-point                        # default LoopedGPT: K=1, recall=add, outer norm
    loopprobe fixed-point --method anderson --json
    loopprobe fixed-point --model mypkg.models:make --inputs mypkg.data:batch --json

``--model`` names a factory returning a model with ``embed(idx)`` and ``step(h, x)`` (and
``cfg.R`` for the unrolled comparison); ``--inputs`` names a function ``fn(model)``
returning the token ids. Reference: docs/definitions.md §4.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from loopprobe._io import call_user, load_model, load_object
from loopprobe.cli._common import apply_threads, print_json

if TYPE_CHECKING:
    import torch


DTYPES = ("float64", "float32")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "fixed-point",
        help="fixed point of one round: residuals, spectral radius, ||dh*/dx||",
        description=(
            "Iterate one round h <- T(h; x) to a fixed point (Picard or Anderson), then at the "
            "reached state report the spectral radius and operator norm of dT/dh (Arnoldi and "
            "power iteration on JVPs) and ||dh*/dx|| by implicit differentiation next to the "
            "unrolled R rounds. Default model: an untrained LoopedGPT with K=1, recall='add', "
            "outer_norm=True."
        ),
    )
    parser.add_argument("--model", default=None, help="pkg.mod:factory returning the model")
    parser.add_argument("--inputs", default=None, help="pkg.mod:fn, fn(model) -> token ids")
    parser.add_argument("--seed", type=int, default=0, help="seed of the default model/inputs")
    parser.add_argument("--seq-len", type=int, default=16, help="length of the default inputs")
    parser.add_argument("--method", choices=["picard", "anderson"], default="picard")
    parser.add_argument("--tol", type=float, default=1e-6, help="residual tolerance")
    parser.add_argument("--max-iter", type=int, default=200, help="most fixed-point updates")
    parser.add_argument("--k", type=int, default=6, help="eigenvalues of dT/dh to report")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float64")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def default_model(seed: int = 0) -> torch.nn.Module:
    """The reference LoopedGPT of the study: one block, additive recall, outer RMSNorm."""
    import torch

    from loopprobe.models import GPTConfig, LoopedGPT

    cfg = GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_heads=4, K=1, R=8,
                    recall="add", outer_norm=True)  # fmt: skip
    return LoopedGPT(cfg, generator=torch.Generator().manual_seed(seed))


def report(
    model: torch.nn.Module,
    idx: torch.Tensor,
    *,
    method: str = "picard",
    tol: float = 1e-6,
    max_iter: int = 200,
    k: int = 6,
    seed: int = 0,
) -> dict:
    """All fixed-point diagnostics of ``model`` at ``idx`` as one flat dict."""
    import torch

    from loopprobe.differentiate.roundmap import round_map
    from loopprobe.estimate.fixedpoint import (
        fixed_point,
        jacobian_norm,
        round_residuals,
        spectral_radius,
    )
    from loopprobe.estimate.implicit import input_dependence

    rm = round_map(model, idx)
    fp = fixed_point(rm.T, rm.h0, tol=tol, max_iter=max_iter, method=method)
    gen = torch.Generator().manual_seed(seed)
    sr = spectral_radius(rm.T, fp.h, k=k, generator=gen)
    jn = jacobian_norm(rm.T, fp.h, generator=gen)
    dep = input_dependence(rm.step, fp.h, rm.x, rounds=rm.rounds, generator=gen)
    out = {
        "state_shape": list(fp.h.shape),
        "dtype": str(fp.h.dtype).removeprefix("torch."),
        "converged": fp.converged,
        "iterations": fp.iterations,
        "residual": fp.residual,
        "rate": fp.rate,
        "reason": fp.reason,
        "method": fp.method,
        "spectral_radius": sr.value,
        "spectral_radius_converged": sr.converged,
        "spectral_radius_reason": sr.reason,
        "eigenvalues": [[float(e.real), float(e.imag)] for e in sr.eigenvalues],
        "jacobian_norm": jn.value,
        "jacobian_norm_converged": jn.converged,
        "input_dependence": dep.value,
        "input_dependence_unrolled": dep.unrolled.value if dep.unrolled else None,
        "input_dependence_gap": dep.gap,
        "input_dependence_converged": dep.converged,
        "input_dependence_reason": dep.reason,
        "rounds": rm.rounds,
    }
    if rm.rounds is not None:
        rr = round_residuals(rm.T, rm.h0, rm.rounds, h_star=fp.h if fp.converged else None)
        out["rounds_residual"] = rr.residual
        out["rounds_distance"] = rr.distance
    out["residuals"] = fp.residuals
    return out


def run(args: argparse.Namespace) -> int:
    import torch

    from loopprobe._threads import work

    if args.model is None:
        model = default_model(args.seed)
    else:
        model = load_model(args.model)
    model = model.to(getattr(torch, args.dtype))
    if args.inputs is not None:
        idx = call_user(load_object(args.inputs, "--inputs"), "--inputs", args.inputs, model)
    else:
        vocab = getattr(getattr(model, "cfg", None), "vocab_size", None)
        if vocab is None:
            raise ValueError("the model has no cfg.vocab_size; pass --inputs pkg.mod:fn")
        gen = torch.Generator().manual_seed(args.seed)
        idx = torch.randint(0, vocab, (1, args.seq_len), generator=gen)
    apply_threads(args, work(model, idx))
    out = report(model, idx, method=args.method, tol=args.tol, max_iter=args.max_iter,
                 k=args.k, seed=args.seed)  # fmt: skip
    if args.json:
        print_json(out)
        return 0
    for key, value in out.items():
        if key == "residuals":
            value = f"{len(value)} values, last {value[-1]:.3g}" if value else "none"
        elif key == "eigenvalues":
            value = ", ".join(f"{complex(re, im):.4g}" for re, im in value)
        elif isinstance(value, float):
            value = f"{value:.6g}"
        print(f"{key:>28}  {value}")
    return 0
