"""Shared helpers: log-log slopes, running a hypothesis property, tiny float64 models.

Everything here is brute force on purpose (dense ``jacrev`` Jacobians, an explicitly untied
copy of a looped model): these are the oracles the statements are checked against.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call, jacrev, jvp

from loopprobe.models import GPTConfig, LoopedGPT

# ------------------------------------------------------------------------- numbers


def loglog_slope(x: Sequence[float], y: Sequence[float]) -> float:
    """Least-squares slope of log y against log x."""
    lx, ly = np.log(np.asarray(x, float)), np.log(np.asarray(y, float))
    return float(np.polyfit(lx, ly, 1)[0])


def band(values: Sequence[float]) -> float:
    """max / min of positive values (1 = perfectly constant)."""
    v = np.asarray(values, float)
    return float(v.max() / v.min())


def fmt(x: float, digits: int = 3) -> str:
    return f"{x:.{digits}g}"


class Tightest:
    """Keeps the largest ratio seen by a property (how close the inequality came to equality)."""

    def __init__(self) -> None:
        self.ratio = -math.inf
        self.where = ""
        self.count = 0

    def see(self, ratio: float, where: str = "") -> None:
        self.count += 1
        if ratio > self.ratio:
            self.ratio, self.where = ratio, where


def falsified(test: Callable[[], None]) -> str | None:
    """Run a ``@given`` test; None when it held on every example, else a one-line reason."""
    try:
        test()
    except Exception as exc:  # hypothesis re-raises the (first) falsifying example's error
        lines = [ln for ln in str(exc).splitlines() if ln.strip()]
        return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:140]
    return None


# ------------------------------------------------------------------- tiny models


def tiny_gpt(
    K: int,
    R: int,
    norm: str,
    *,
    p: float | None = None,
    tied: bool = True,
    d: int = 8,
    heads: int = 2,
    vocab: int = 16,
    T: int = 4,
    seed: int = 0,
    **kw,
) -> LoopedGPT:
    """A float64 LoopedGPT small enough for dense Jacobians (d = 8 by default)."""
    cfg = GPTConfig(
        vocab_size=vocab,
        seq_len=T,
        d_model=d,
        n_heads=heads,
        K=K,
        R=R,
        norm=norm,
        p=p,
        tied=tied,
        **kw,
    )
    return LoopedGPT(cfg, generator=torch.Generator().manual_seed(seed)).double()


def tokens(vocab: int, B: int, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random input tokens and random next-token targets."""
    g = torch.Generator().manual_seed(10_000 + seed)
    return torch.randint(0, vocab, (B, T), generator=g), torch.randint(
        0, vocab, (B, T), generator=g
    )


def looped_names(model: torch.nn.Module) -> list[str]:
    """Parameters of the residual branches of the looped blocks (the bound's subject)."""
    return [
        n
        for n, _ in model.named_parameters()
        if n.startswith("blocks.") and (".attn." in n or ".mlp." in n)
    ]


def cross_entropy(logits: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))


def one_sgd_step_change(
    model: LoopedGPT, idx: torch.Tensor, tgt: torch.Tensor, lr: float, first_order: bool = False
) -> dict[str, torch.Tensor]:
    """Output change of one SGD step on the looped branch parameters (F = logits).

    Returns ``F0``, the finite change ``dF`` = F(theta - lr g) - F(theta), the first-order
    change ``dF1`` = JVP along -lr g (only with ``first_order=True``), and the gradient
    ``g`` (a dict by parameter name). The model is never modified (functional_call).
    """
    params = {n: p.detach() for n, p in model.named_parameters()}
    names = looped_names(model)
    sub = {n: params[n] for n in names}

    def out(s: dict) -> torch.Tensor:
        return functional_call(model, {**params, **s}, (idx,))

    g = torch.func.grad(lambda s: cross_entropy(out(s), tgt))(sub)
    F0 = out(sub).detach()
    step = {n: -lr * g[n] for n in names}
    F1 = out({n: sub[n] + step[n] for n in names}).detach()
    res = {"F0": F0, "dF": F1 - F0, "g": g}
    if first_order:
        with warnings.catch_warnings():
            # forward-mode AD loads its decompositions with torch.jit.script on first use
            warnings.filterwarnings("ignore", message=".*torch.jit.script. is deprecated")
            res["dF1"] = jvp(out, (sub,), (step,))[1].detach()
    return res


def untied_copy(model: LoopedGPT) -> LoopedGPT:
    """The explicitly untied twin: K*R blocks, block r*K + k a copy of tied block k.

    Same forward values; its parameters separate by visit, so its gradient and Jacobian
    with respect to block r*K + k are the per-visit G_{r,k} and U_{r,k} of the tied model.
    """
    cfg = model.cfg
    if not cfg.tied:
        raise ValueError("untied_copy: the model is already untied")
    from dataclasses import replace

    twin = LoopedGPT(replace(cfg, tied=False)).double()
    state = model.state_dict()
    new = {}
    for name in twin.state_dict():
        if name.startswith("blocks."):
            _, b, rest = name.split(".", 2)
            new[name] = state[f"blocks.{int(b) % cfg.K}.{rest}"]
        else:
            new[name] = state[name]
    twin.load_state_dict(new)
    return twin


def per_visit(model: LoopedGPT, idx: torch.Tensor, tgt: torch.Tensor) -> dict:
    """Dense per-visit sensitivities U_{r,j} and updates G_{r,j} of a tied LoopedGPT.

    Brute force through :func:`untied_copy` and ``jacrev``. Physical sublayer j = (k, s),
    s in {attn, mlp}; returns ``U[j][r]`` (matrix: outputs x parameters of j),
    ``G[j][r]`` (vector), ``U_tied[j]`` and ``g_tied[j]`` from the tied model itself, the
    output ``F0`` and the output-gradient ``dLdF``.
    """
    cfg = model.cfg
    K, R = cfg.K, cfg.R
    twin = untied_copy(model)
    params = {n: p.detach() for n, p in twin.named_parameters()}
    names = looped_names(twin)
    sub = {n: params[n] for n in names}

    def out(s: dict) -> torch.Tensor:
        return functional_call(twin, {**params, **s}, (idx,)).reshape(-1)

    F0 = out(sub).detach()
    Jd = jacrev(out)(sub)
    logits = F0.reshape(*idx.shape, -1)
    dLdF = torch.func.grad(lambda z: cross_entropy(z.reshape(logits.shape), tgt))(F0)
    tparams = {n: p.detach() for n, p in model.named_parameters()}
    tnames = looped_names(model)

    def tout(s: dict) -> torch.Tensor:
        return functional_call(model, {**tparams, **s}, (idx,)).reshape(-1)

    Jt = jacrev(tout)({n: tparams[n] for n in tnames})
    U, G, U_tied, g_tied, labels = [], [], [], [], []
    for k in range(K):
        for s in ("attn", "mlp"):
            labels.append(f"blocks.{k}.{s}")
            Us = []
            for r in range(R):
                pre = f"blocks.{r * K + k}.{s}."
                Us.append(
                    torch.cat(
                        [Jd[n].reshape(F0.numel(), -1) for n in names if n.startswith(pre)], 1
                    )
                )
            pre = f"blocks.{k}.{s}."
            Ut = torch.cat([Jt[n].reshape(F0.numel(), -1) for n in tnames if n.startswith(pre)], 1)
            U.append(Us)
            G.append([Ur.t() @ dLdF for Ur in Us])
            U_tied.append(Ut)
            g_tied.append(Ut.t() @ dLdF)
    return {
        "U": U,
        "G": G,
        "U_tied": U_tied,
        "g_tied": g_tied,
        "F0": F0,
        "dLdF": dLdF,
        "labels": labels,
    }


def opnorm(A: torch.Tensor) -> float:
    """Spectral norm (top singular value) of a dense matrix."""
    return float(torch.linalg.matrix_norm(A.detach(), ord=2))


def kappa(Us: Sequence[torch.Tensor], Gs: Sequence[torch.Tensor], CU: float, CG: float) -> float:
    """Seed 002 Eq. 12 for one sublayer: ||sum U|| ||sum G|| / (R C_U C_G).

    ``CU`` and ``CG`` stand for C_U beta/alpha and C_G beta/alpha: upper bounds of every
    per-visit norm ||U_{r,j}|| and ||G_{r,j}||.
    """
    R = len(Us)
    return opnorm(sum(Us)) * float(sum(Gs).norm()) / (R * CU * CG)
