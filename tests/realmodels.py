"""Tiny random-weight builds of public looped models, as their users build them.

Each ``make_*`` returns a :class:`RealModel`: the model (float64, seeded, CPU, train mode
as built, dropout off), its inputs and the ``forward=``/``output=``/``loss_fn=`` a user
passes to loopprobe (nothing else: no ``attn_implementation`` switch, no wrappers). Sizes
are tiny (d = 16, seq = 6, batch = 2) so that a dense ``jacrev`` over one sublayer's
parameters is cheap. ``untie`` names the reused modules and how often each is called: the
explicitly untied twin (``_oracles.untied_twin``) gives each call its own deep copy, and
``visit_prefixes`` maps visit r of a sublayer to the twin's copy that computed it.

Families (what is reused and how):

- HF ``AlbertModel``: one layer group ``encoder.albert_layer_groups.0`` called once per
  layer (``num_hidden_layers`` = R times) by a for-loop.
- HF ``HrmTextForCausalLM``: two stacks, ``model.L_module`` and ``model.H_module``; per
  high cycle the L stack runs ``L_cycles`` times (the leading ones under ``no_grad``), then
  the H stack once.
- HF ``ZambaForCausalLM``: every hybrid layer owns a ``shared_transf`` instance, and all of
  them hold the *same* Parameter objects (tied by ``post_init``): no module is called twice.
- ``x-transformers`` ``looped=True``: the whole ``attn_layers`` runs ``max_looped_steps``
  times; an exit gate (and, in train mode, the logits head) is applied after every step.
- ``x-transformers`` ``weight_tie_layers=True``: one attention and one feed-forward block
  executed ``depth`` times each, in the order (attn, ff) * depth.
- torch's ``nn.TransformerEncoderLayer`` looped R times by a small wrapper
  (:class:`LoopedEncoder`), plain or through ``torch.utils.checkpoint``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as Fn
from torch import nn
from torch.utils.checkpoint import checkpoint

import loopprobe as lp

VOCAB, SEQ, BATCH, D = 11, 6, 2, 16
# float64 end to end: the two sides of an exact check differ by summation order only
EXACT = 1e-12
# Operator norms by Lanczos: the default power iteration needs 250+ products on ALBERT
# (close top singular values) and misses its tolerance within 500 on HRM-Text (float32
# norms inside), where Lanczos converges in 15-25.
LANCZOS = {"method": "lanczos", "max_iter": 100}
# The HF models declare no cfg.alpha/beta: the bound step of the unchanged check runs
# with a plain residual's scales (what it measures does not matter there).
PLAIN = {"alpha": 1.0, "beta": 1.0}


@dataclass
class RealModel:
    """A model and everything a user passes to loopprobe for it."""

    model: nn.Module
    inputs: Any
    forward: Callable | None
    output: Callable | None
    loss_fn: Callable
    untie: dict[str, int] = field(default_factory=dict)  # module name -> calls
    visit_prefixes: dict[str, list[str]] = field(default_factory=dict)  # see module doc

    def F(self, out: Any) -> torch.Tensor:
        return self.output(out) if self.output is not None else out

    def probe(self) -> lp.Probe:
        return lp.attach(self.model)

    def check(
        self, check: Callable, *args: Any, loss: bool = False, output: bool = False, **kw: Any
    ) -> Any:
        """``check(model, inputs, [loss_fn,] *args, forward=, [output=,] **kw)``: a
        :mod:`loopprobe.testing` check run with what a user passes for this model."""
        head = (self.loss_fn, *args) if loss else args
        more = {"output": self.output} if output else {}
        return check(self.model, self.inputs, *head, forward=self.forward, **more, **kw)

    def increments(self, increment: Any = "auto") -> Any:
        return lp.increments(self.probe(), self.inputs, forward=self.forward, increment=increment)


def seeded_build(build: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    """Build under a forked, seeded RNG (the packages draw their init from torch's RNG)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return build().double()


def token_ids(seed: int = 1, shape: tuple[int, int] = (BATCH, SEQ)) -> torch.Tensor:
    return torch.randint(VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def lm_loss(labels: torch.Tensor, logits: Callable[[Any], torch.Tensor]) -> Callable:
    """Cross-entropy of the logits picked by ``logits(out)`` against fixed labels."""

    def loss_fn(out: Any, inputs: Any) -> torch.Tensor:
        return Fn.cross_entropy(logits(out).reshape(-1, VOCAB), labels.reshape(-1))

    return loss_fn


def regression_loss(target: torch.Tensor, pick: Callable[[Any], torch.Tensor]) -> Callable:
    def loss_fn(out: Any, inputs: Any) -> torch.Tensor:
        return 0.5 * (pick(out) - target).pow(2).sum()

    return loss_fn


def _per_call(name: str, calls: int) -> list[str]:
    return [f"{name}.copies.{k}" for k in range(calls)]


# --------------------------------------------------------------------------- Hugging Face


def make_albert(R: int = 3, seed: int = 0) -> RealModel:
    from transformers import AlbertConfig, AlbertModel

    cfg = AlbertConfig(
        vocab_size=VOCAB,
        embedding_size=8,
        hidden_size=D,
        num_hidden_layers=R,
        num_hidden_groups=1,
        inner_group_num=1,
        num_attention_heads=2,
        intermediate_size=2 * D,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = seeded_build(lambda: AlbertModel(cfg), seed)
    ids = token_ids(seed + 1)
    target = torch.randn(
        BATCH, SEQ, D, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 2)
    )

    def hidden(out: Any) -> torch.Tensor:
        return out.last_hidden_state

    group = "encoder.albert_layer_groups.0"
    return RealModel(
        model,
        ids,
        None,
        hidden,
        regression_loss(target, hidden),
        untie={group: R},
        visit_prefixes={group: _per_call(group, R)},
    )


def make_hrm_text(H: int = 2, L: int = 2, seed: int = 0) -> RealModel:
    from transformers import HrmTextConfig, HrmTextForCausalLM

    cfg = HrmTextConfig(
        vocab_size=VOCAB,
        hidden_size=D,
        intermediate_size=2 * D,
        num_hidden_layers=1,  # per stack
        num_attention_heads=2,
        head_dim=8,
        H_cycles=H,
        L_cycles=L,
        max_position_embeddings=16,
        use_cache=False,
    )
    model = seeded_build(lambda: HrmTextForCausalLM(cfg), seed)
    ids = token_ids(seed + 1)

    def logits(out: Any) -> torch.Tensor:
        return out.logits

    Lm, Hm = "model.L_module", "model.H_module"
    return RealModel(
        model,
        ids,
        None,
        logits,
        lm_loss(token_ids(seed + 2), logits),
        untie={Lm: H * L, Hm: H},
        visit_prefixes={Lm: _per_call(Lm, H * L), Hm: _per_call(Hm, H)},
    )


def make_zamba(seed: int = 0) -> RealModel:
    from transformers import ZambaConfig, ZambaForCausalLM

    cfg = ZambaConfig(
        vocab_size=VOCAB,
        hidden_size=D,
        attention_hidden_size=2 * D,
        num_hidden_layers=5,
        attn_layer_period=2,
        attn_layer_offset=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=2 * D,
        mamba_d_state=4,
        mamba_d_conv=2,
        mamba_expand=2,
        n_mamba_heads=1,
        max_position_embeddings=16,
        use_cache=False,
    )
    model = seeded_build(lambda: ZambaForCausalLM(cfg), seed)
    hybrid = [i for i, t in enumerate(model.config.layers_block_type) if t == "hybrid"]
    ids = token_ids(seed + 1)

    def logits(out: Any) -> torch.Tensor:
        return out.logits

    shared = [f"model.layers.{i}.shared_transf" for i in hybrid]
    return RealModel(
        model,
        ids,
        None,
        logits,
        lm_loss(token_ids(seed + 2), logits),
        untie={name: 1 for name in shared},
        # one sublayer (the tied parameters are named after their first instance); visit r
        # is hybrid layer r, computed by that layer's private copy in the twin
        visit_prefixes={shared[0]: [f"{name}.copies.0" for name in shared]},
    )


# --------------------------------------------------------------------------- x-transformers


def make_xt_looped(R: int = 3, seed: int = 0) -> RealModel:
    from x_transformers import Decoder, TransformerWrapper

    def build() -> nn.Module:
        layers = Decoder(dim=D, depth=1, heads=2, attn_dim_head=8, pre_and_post_norm=True)
        return TransformerWrapper(
            num_tokens=VOCAB, max_seq_len=8, attn_layers=layers, looped=True, max_looped_steps=R
        )

    model = seeded_build(build, seed)
    # train mode: the head runs after every step and once more at the end
    untie = {"attn_layers": R, "exit_gate": R, "to_logits": R + 1}
    return RealModel(
        model,
        token_ids(seed + 1),
        None,
        None,
        lm_loss(token_ids(seed + 2), lambda out: out),
        untie=untie,
        visit_prefixes={name: _per_call(name, calls) for name, calls in untie.items()},
    )


XT_TIED_BLOCKS = (
    "attn_layers.layers.0.0.0",  # pre-norm of the attention block
    "attn_layers.layers.0.1",  # attention
    "attn_layers.layers.1.0.0",  # pre-norm of the feed-forward block
    "attn_layers.layers.1.1",  # feed-forward
)


def make_xt_weight_tied(depth: int = 3, seed: int = 0) -> RealModel:
    from x_transformers import Decoder, TransformerWrapper

    def build() -> nn.Module:
        layers = Decoder(dim=D, depth=depth, heads=2, attn_dim_head=8, weight_tie_layers=True)
        return TransformerWrapper(num_tokens=VOCAB, max_seq_len=8, attn_layers=layers)

    model = seeded_build(build, seed)
    owners = [n for n in XT_TIED_BLOCKS if any(True for _ in model.get_submodule(n).parameters())]
    return RealModel(
        model,
        token_ids(seed + 1),
        None,
        None,
        lm_loss(token_ids(seed + 2), lambda out: out),
        untie={n: depth for n in owners},
        visit_prefixes={n: _per_call(n, depth) for n in owners},
    )


# --------------------------------------------------------------------------- plain torch


class LoopedEncoder(nn.Module):
    """One ``nn.TransformerEncoderLayer`` applied R times, as a researcher writes it.

    ``checkpointing``: ``None`` (plain), ``"non_reentrant"`` or ``"reentrant"``
    (``torch.utils.checkpoint`` with ``use_reentrant=False`` / ``True`` around each round).
    """

    def __init__(
        self,
        vocab: int = VOCAB,
        d: int = D,
        heads: int = 2,
        R: int = 3,
        checkpointing: str | None = None,
    ) -> None:
        super().__init__()
        if checkpointing not in (None, "non_reentrant", "reentrant"):
            raise ValueError(f"LoopedEncoder: unknown checkpointing={checkpointing!r}")
        self.R, self.checkpointing = R, checkpointing
        self.embed = nn.Embedding(vocab, d)
        self.layer = nn.TransformerEncoderLayer(
            d, heads, dim_feedforward=2 * d, dropout=0.0, batch_first=True, norm_first=True
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for _ in range(self.R):
            if self.checkpointing is None:
                h = self.layer(h)
            else:
                reentrant = self.checkpointing == "reentrant"
                h = checkpoint(self.layer, h, use_reentrant=reentrant)
        return self.head(self.norm(h))


def make_torch_encoder(R: int = 3, checkpointing: str | None = None, seed: int = 0) -> RealModel:
    """The same weights for every ``checkpointing`` (same seed, same init order)."""
    model = seeded_build(lambda: LoopedEncoder(R=R, checkpointing=checkpointing), seed)
    return RealModel(
        model,
        token_ids(seed + 1),
        None,
        None,
        lm_loss(token_ids(seed + 2), lambda out: out),
        untie={"layer": R},
        visit_prefixes={"layer": _per_call("layer", R)},
    )


BUILDERS: dict[str, Callable[..., RealModel]] = {
    "albert": make_albert,
    "hrm_text": make_hrm_text,
    "zamba": make_zamba,
    "xt_looped": make_xt_looped,
    "xt_weight_tied": make_xt_weight_tied,
    "torch_encoder": make_torch_encoder,
}
