"""Plots of :func:`loopprobe.redundancy` frames (matplotlib/seaborn imported inside each function).

Each function takes the tidy frame (``res.to_frame()``, or a concatenation with an extra
column such as ``model``), draws on ``ax`` (a new figure when ``None``, made as every
loopprobe figure is: see :mod:`loopprobe.plots`) and returns the axes (``ax.figure``).

Example::

    res = lp.redundancy(model, idx)
    df = res.to_frame()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    token_concentration(df, ax=axes[0]); kv_quantization(df, ax=axes[1])
    attention_sparsity(df, ax=axes[2]); fig.savefig("redundancy.png")
"""

from __future__ import annotations

from typing import Any

import pandas as pd


def _axes(ax: Any) -> Any:
    if ax is not None:
        return ax
    from loopprobe.plots._base import new_figure  # pyplot's current figure for pyplot users

    return new_figure(size=(4.5, 3.5))[1][0, 0]


def _rows(df: pd.DataFrame, observation: str, call: str, **equal: Any) -> pd.DataFrame:
    rows = df[df.observation == observation]
    for col, val in equal.items():
        rows = rows[rows[col] == val]
    if rows.empty:
        raise ValueError(
            f"{call}: the frame has no {observation!r} rows"
            + (f" with {equal}" if equal else "")
            + "; pass res.to_frame() of lp.redundancy (attention/quantization need K/V capture)"
        )
    return rows


def token_concentration(
    df: pd.DataFrame, *, metric: str = "share", hue: str = "param", ax: Any = None
) -> Any:
    """Share of the squared change in the top fraction f of tokens vs loop (dotted: f, the
    share of a uniform change). ``metric``: ``share`` or ``share_oracle``."""
    import seaborn as sns

    rows = _rows(df, "concentration", "token_concentration", metric=metric)
    rows = rows.rename(columns={"param": "f"})
    ax = _axes(ax)
    hue = "f" if hue == "param" else hue
    sns.lineplot(rows, x="loop", y="value", hue=hue, marker="o", ax=ax, palette="viridis")
    for f in sorted(rows["f"].unique()):
        ax.axhline(f, ls=":", lw=0.8, color="grey")
    ax.set(ylabel="share of squared change", title="token-change concentration", ylim=(0, 1.02))
    return ax


def kv_quantization(df: pd.DataFrame, *, ax: Any = None) -> Any:
    """Residual / direct quantization error of K and V vs loop, one line per (tensor, bits)."""
    import seaborn as sns

    rows = _rows(df, "quantization", "kv_quantization", metric="ratio").copy()
    rows["bits"] = rows["param"].astype(int).astype(str) + " bit"
    ax = _axes(ax)
    sns.lineplot(rows, x="loop", y="value", hue="tensor", style="bits", marker="o", ax=ax)
    ax.axhline(1.0, ls=":", color="grey")
    ax.set(ylabel="error residual / direct", title="KV-residual quantization")
    return ax


def attention_sparsity(df: pd.DataFrame, *, metric: str = "captured", ax: Any = None) -> Any:
    """Oracle energy captured (or recall) by the previous loop's top keys vs kept fraction."""
    import seaborn as sns

    rows = _rows(df, "attention", "attention_sparsity", metric=metric).rename(
        columns={"param": "k"}
    )
    ax = _axes(ax)
    sns.lineplot(rows, x="k", y="value", hue="loop", marker="o", ax=ax, palette="viridis")
    ax.plot([0, 1], [0, 1], ls=":", color="grey")
    ax.set(xlabel="kept key fraction", ylabel=metric, title="attention-difference sparsity")
    return ax


def loop_similarity(df: pd.DataFrame, *, metric: str = "rel_reuse", ax: Any = None) -> Any:
    """An adjacent-loop similarity metric vs loop, one line per tensor (output, K, V)."""
    import seaborn as sns

    rows = _rows(df, "similarity", "loop_similarity", metric=metric)
    ax = _axes(ax)
    sns.lineplot(rows, x="loop", y="value", hue="tensor", marker="o", ax=ax)
    ax.set(ylabel=metric, title="adjacent-loop similarity")
    return ax


def lazy_update_cost(
    df: pd.DataFrame, *, y: str = "kl", hue: str | None = None, ax: Any = None
) -> Any:
    """Output change (``kl``, ``rel_change`` or ``loss_change``) vs the work saved, one point
    per kept fraction f, from :func:`loopprobe.estimate.redundancy.lazy.lazy_update`'s frame."""
    import seaborn as sns

    if df.empty or y not in df or "saved" not in df:
        raise ValueError(
            f"lazy_update_cost: the frame needs the columns 'saved' and {y!r}; "
            "pass lazy_update's frame"
        )
    ax = _axes(ax)
    sns.lineplot(df, x="saved", y=y, hue=hue, marker="o", ax=ax)
    for row in df.itertuples():
        ax.annotate(f"f={row.f:g}", (row.saved, getattr(row, y)), fontsize=7)
    ax.set(xlabel="token-layer updates saved", ylabel=y, title="lazy token update")
    return ax
