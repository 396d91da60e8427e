"""``loopprobe redundancy``: FlashLoop's three observations per loop.

Example::

    loopprobe redundancy                          # untrained LoopedGPT (K=2, R=4, d=32)
    loopprobe redundancy --all                    # every metric, not the headline ones
    loopprobe redundancy --lazy                   # + the lazy-update simulation (KL vs f)
    loopprobe redundancy --model mypkg.models:make --inputs mypkg.data:batch --json

``--model`` names a factory returning the model; ``--inputs`` a function ``fn(model)``
returning what the model is called with (default: random token ids of ``cfg.vocab_size``).
The table has one row per (observation, tensor, metric, parameter), the mean over layers,
and one column per loop.
"""

from __future__ import annotations

import argparse

from loopprobe.cli._common import add_json_arg, add_user_model_args

# The headline rows of the compact table (observation, metric); --all prints every row.
HEADLINE = (
    ("similarity", "cos_mean"),
    ("similarity", "rel_reuse"),
    ("extrapolation", "err_reuse"),
    ("extrapolation", "err_linear"),
    ("extrapolation", "err_oracle"),
    ("concentration", "share"),
    ("concentration", "share_oracle"),
    ("concentration", "share_prev"),
    ("attention", "captured"),
    ("attention", "recall"),
    ("quantization", "ratio"),
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "redundancy",
        help="per-loop redundancy: token-change concentration, attention sparsity, KV residuals",
        description=(
            "Record every loop of a looped model by hooks and report FlashLoop's three "
            "observations per loop: adjacent-loop similarity and extrapolation of the layer "
            "output, K and V; the share of the squared change carried by the top tokens; the "
            "oracle energy of the attention-output difference captured by the previous loop's "
            "top keys; and residual vs direct low-bit quantization error of K and V. Default "
            "model: an untrained LoopedGPT (K=2, R=4, d=32)."
        ),
    )
    add_user_model_args(parser, "model", "inputs", "forward")
    parser.add_argument("--seed", type=int, default=0, help="seed of the default model/inputs")
    parser.add_argument("--batch", type=int, default=2, help="sequences in the default inputs")
    parser.add_argument("--seq-len", type=int, default=32, help="length of the default inputs")
    parser.add_argument("--group", type=int, default=64, help="quantization group size")
    parser.add_argument("--all", action="store_true", help="print every metric")
    parser.add_argument(
        "--lazy",
        action="store_true",
        help="also simulate the lazy token update (KL and saved work vs kept fraction f)",
    )
    add_json_arg(parser)
    parser.set_defaults(func=run)


def default_model(seed: int = 0):
    """The built-in LoopedGPT with its default configuration, initialised from ``seed``."""
    import torch

    from loopprobe.models import GPTConfig, LoopedGPT

    return LoopedGPT(GPTConfig(), generator=torch.Generator().manual_seed(seed))


def table(res, every: bool = False) -> str:
    """The summary as text: headline rows (or every row), values to 3 decimals."""
    import pandas as pd

    wide = res.summary()
    if not every:
        keep = [(o, m) in HEADLINE for o, _, m, _ in wide.index]
        wide = wide[keep]
    with pd.option_context("display.width", 200, "display.max_rows", 500):
        return wide.to_string(float_format=lambda v: f"{v:.3f}", na_rep="")


def run(args: argparse.Namespace) -> int:
    import torch

    from loopprobe._io import load_model, load_object, user_inputs
    from loopprobe._threads import work
    from loopprobe.cli._common import apply_threads, print_json
    from loopprobe.estimate.redundancy import redundancy

    if args.model is None:
        model = default_model(args.seed)
    else:
        model = load_model(args.model)
    if args.inputs is not None:
        inputs = user_inputs(args.inputs, model)
    else:
        cfg = getattr(model, "cfg", None)
        vocab = getattr(cfg, "vocab_size", None)
        if vocab is None:
            raise ValueError("the model has no cfg.vocab_size; pass --inputs pkg.mod:fn")
        T = min(args.seq_len, getattr(cfg, "seq_len", args.seq_len))
        gen = torch.Generator().manual_seed(args.seed)
        inputs = torch.randint(0, vocab, (args.batch, T), generator=gen)
    if isinstance(inputs, torch.Tensor):
        apply_threads(args, work(model, inputs))
    if args.forward is not None and args.model is None:
        raise ValueError("--forward only applies together with --model")
    if args.forward is not None and args.lazy:
        raise ValueError("--lazy runs the model as model(inputs); it does not take --forward")
    forward = load_object(args.forward, "--forward") if args.forward else None
    res = redundancy(model, inputs, forward=forward, group=args.group, seed=args.seed)
    lazy = None
    if args.lazy:
        from loopprobe.estimate.redundancy.lazy import lazy_update

        lazy = lazy_update(model, inputs, seed=args.seed)
    if args.json:
        out = {
            "layers": res.layers,
            "attention": res.attention,
            "converged": res.converged,
            "reason": res.reason,
            "notes": res.notes,
            "rows": res.frame.to_dict(orient="records"),
        }
        if lazy is not None:
            out["lazy"] = lazy.to_dict(orient="records")
        print_json(out)
        return 0
    print(f"layers (loops): {res.layers}")
    print(f"attention (loops): {res.attention}")
    for note in res.notes:
        print(f"note: {note}")
    if not res.converged:
        print(f"not trustworthy: {res.reason}")
    print(table(res, args.all))
    if lazy is not None:
        print("lazy token update (loops >= 3 recompute the top f tokens):")
        print(lazy.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    return 0
