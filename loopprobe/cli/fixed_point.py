"""``loopprobe fixed-point``: reachability, geometry and input-dependence of one round.

Example::

    loopprobe fixed-point                        # default LoopedGPT: K=1, recall=add, outer norm
    loopprobe fixed-point --method anderson --json
    loopprobe fixed-point --model mypkg.models:make --inputs mypkg.data:batch --json

``--model`` names a factory returning a model with ``embed(idx)`` and ``step(h, x)`` (and
``cfg.R`` for the unrolled comparison); ``--inputs`` names a function ``fn(model)``
returning the token ids. Any other looped model: ``--step pkg.mod:fn`` with
``fn(model, inputs) -> lp.RoundMap`` (called like ``lp.round_map``; e.g.
``return lp.replay_round(model, inputs, "block")``). Reference: docs/definitions.md §4.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from loopprobe._io import load_model, load_object, user_inputs
from loopprobe.cli._common import add_json_arg, add_user_model_args, apply_threads, print_json

if TYPE_CHECKING:
    from collections.abc import Callable

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
    add_user_model_args(
        parser, "model", "inputs", "step",
        helps={
            "model": "factory returning a model with embed(idx) and step(h, x) (and cfg.R for "
            "the unrolled comparison), or any model together with --step",
            "inputs": "fn(model) -> token ids (or what --step's function takes)",
        },
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seed of the default model/inputs")
    parser.add_argument("--seq-len", type=int, default=16, help="length of the default inputs")
    parser.add_argument("--method", choices=["picard", "anderson"], default="picard",
                        help="plain iteration (as the model runs) or Anderson")  # fmt: skip
    parser.add_argument("--tol", type=float, default=1e-6, help="residual tolerance")
    parser.add_argument("--max-iter", type=int, default=200, help="most fixed-point updates")
    parser.add_argument("--k", type=int, default=6, help="eigenvalues of dT/dh to report")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float64",
                        help="cast the model (default float64)")  # fmt: skip
    add_json_arg(parser)
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
    idx: Any,
    *,
    method: str = "picard",
    tol: float = 1e-6,
    max_iter: int = 200,
    k: int = 6,
    seed: int = 0,
    step: Callable | None = None,
) -> dict:
    """All fixed-point diagnostics of ``model`` at ``idx`` as one flat dict (the runner of
    the report's fixed-point section); input-dependence only where the fixed point was
    reached (``None`` otherwise)."""
    from loopprobe.report.sections_fixedpoint import probe_round, round_map_of

    rm = round_map_of(model, idx, step)
    p = probe_round(rm, methods=(method,), tol=tol, max_iter=max_iter, k=k, seed=seed)
    fp, sr, jn, dep, rr = p["fp"], p["sr"], p["jn"], p["dep"], p["rr"]
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
        "input_dependence": dep.value if dep else None,
        "input_dependence_unrolled": dep.unrolled.value if dep and dep.unrolled else None,
        "input_dependence_gap": dep.gap if dep else None,
        "input_dependence_converged": dep.converged if dep else False,
        "input_dependence_reason": dep.reason if dep else "the fixed point was not reached",
        "rounds": rm.rounds,
    }
    if rr is not None:
        out["rounds_residual"] = rr.residual
        out["rounds_distance"] = rr.distance
    out["residuals"] = fp.residuals
    return out


def run(args: argparse.Namespace) -> int:
    import torch

    from loopprobe._threads import work

    model = default_model(args.seed) if args.model is None else load_model(args.model)
    model = model.to(getattr(torch, args.dtype))
    if args.step is not None and args.model is None:
        raise ValueError("--step only applies together with --model")
    step = load_object(args.step, "--step") if args.step else None
    if args.inputs is not None:
        idx = user_inputs(args.inputs, model)
    else:
        vocab = getattr(getattr(model, "cfg", None), "vocab_size", None)
        if vocab is None:
            raise ValueError("the model has no cfg.vocab_size; pass --inputs pkg.mod:fn")
        gen = torch.Generator().manual_seed(args.seed)
        idx = torch.randint(0, vocab, (1, args.seq_len), generator=gen)
    if isinstance(idx, torch.Tensor):
        apply_threads(args, work(model, idx))
    out = report(model, idx, method=args.method, tol=args.tol, max_iter=args.max_iter,
                 k=args.k, seed=args.seed, step=step)  # fmt: skip
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
