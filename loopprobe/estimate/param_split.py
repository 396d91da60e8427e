"""N_once and N_rec of a user's model, read from its visit table (``lp.scaling.param_split``).

The iso-depth scaling law (:mod:`loopprobe.estimate.scaling`) is written in the parameters a
forward visits once (prelude, coda) and those it visits on every recurrence; this module
counts them on any ``nn.Module`` with the paper's accounting (seed 001, §3.2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd

from loopprobe.record import discover
from loopprobe.record.probe import Probe

__all__ = ["UNEMBEDDING", "ParamSplit", "param_split"]


@dataclass
class ParamSplit:
    """Parameters visited once (``n_once``) vs on every recurrence (``n_rec``; visits > 1).

    ``r``: the largest visit count (the recurrence count of a prelude/loop/coda model);
    ``table``: the visit table the split was read from; ``unused``: sublayers not visited.
    """

    n_once: int
    n_rec: int
    r: int
    table: pd.DataFrame
    unused: list


#: last name segments of an unembedding (output projection onto the vocabulary)
UNEMBEDDING = ("lm_head", "unembed", "unembedding", "embed_out")


def _unembeddings(model) -> set[str]:
    """Names of the model's unembedding modules: a last name segment in ``UNEMBEDDING`` or
    the module a Hugging Face model returns from ``get_output_embeddings()``."""
    names = {n for n, _ in model.named_modules() if n and n.split(".")[-1] in UNEMBEDDING}
    get = getattr(model, "get_output_embeddings", None)
    out = get() if callable(get) else None
    if out is not None:
        names |= {n for n, m in model.named_modules() if m is out}
    return names


def _owners(model, norms: bool, unembedding: bool = False) -> list[str]:
    import torch.nn as nn

    emb_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    unemb = set() if unembedding else _unembeddings(model)
    names = []
    for name, mod in model.named_modules():
        ps = [p for p in mod._parameters.values() if p is not None]
        if not ps or isinstance(mod, nn.Embedding) or any(id(p) in emb_ids for p in ps):
            continue
        if name in unemb:
            continue
        if not norms and "norm" in type(mod).__name__.lower():
            continue
        names.append(name)
    return names


def param_split(
    model,
    inputs: Any,
    *,
    sublayers: list | None = None,
    exclude: list | None = None,
    norms: bool = False,
    unembedding: bool = False,
    forward=None,
) -> ParamSplit:
    """Fill ``n_once``/``n_rec`` for a model from loopprobe's visit table.

    Every module that directly owns parameters is one sublayer (default; or name them with
    ``sublayers=``), except embeddings (and weights tied to them), an untied unembedding
    (``lm_head``; see ``UNEMBEDDING``) unless ``unembedding=True``, and normalisation gains
    unless ``norms=True``. That is the paper's accounting (§3.2: N_once = (l_prelude +
    l_coda) 12 d^2, N_rec = l_recur 12 d^2 + 2 d^2; no embedding, unembedding or norms).
    ``exclude``: more patterns to drop (a pattern naming only a module already left out,
    such as ``"lm_head"``, is accepted and ignored). Sublayers visited more than once are
    recurrent. The model is not changed (see :func:`loopprobe.attach`).
    """
    names = list(sublayers) if sublayers is not None else _owners(model, norms, unembedding)
    if not names:
        raise ValueError("param_split: the model has no parameter-owning module to count")
    if exclude and sublayers is None:  # patterns for modules the default already leaves out
        left_out = _unembeddings(model) if not unembedding else set()
        exclude = [p for p in exclude
                   if not any(discover.match(p, n) for n in left_out)
                   or any(discover.match(p, n) for n in names)]  # fmt: skip
    table = Probe(model, sublayers=names, exclude=exclude).visit_table(inputs, forward=forward)
    rec = table[table.visits > 1]
    once = table[table.visits == 1]
    return ParamSplit(
        n_once=int(once.parameters.sum()),
        n_rec=int(rec.parameters.sum()),
        r=int(table.visits.max()),
        table=table,
        unused=table[table.visits == 0].sublayer.tolist(),
    )
