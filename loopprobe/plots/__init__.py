"""Figures from the tidy frames that the diagnostics and :func:`loopprobe.sweep` return.

Every function takes a long-format pandas DataFrame (one row per config/visit/step, as
mup's coord check does), returns a :class:`matplotlib.figure.Figure` and never calls
``plt.show``. Without pyplot a figure is a bare ``Figure`` (no global state, no GUI:
headless, in tests and notebooks alike); when the caller had imported
``matplotlib.pyplot`` before the first loopprobe plot, it is made by ``plt.figure``
and is the current figure, so ``plt.savefig`` saves it. Either way
``fig.savefig("kappa.png")`` works. Column names are keyword arguments with the
producers' names as defaults; each docstring lists the columns it reads. Rows with
``diverged=True`` are left out of every figure.

Notation follows the papers: κ_R (visit alignment), ‖ΔF‖ (output change after one
step), β/α (update-to-residual ratio), ρ(∂T/∂h) (spectral radius of one round).

Needs matplotlib and seaborn, the ``plots`` extra (``pip install 'loopprobe[plots]'``);
the rest of loopprobe runs without them. Importing this package (or any module in it)
without them raises an ImportError that says so.
"""

try:
    from loopprobe.plots._base import CALLER_PYPLOT  # noqa: F401 - first: before seaborn loads pyplot
except ModuleNotFoundError as exc:
    if (exc.name or "").partition(".")[0] not in ("matplotlib", "seaborn"):
        raise
    raise ImportError(
        f"loopprobe.plots needs matplotlib and seaborn ({exc.name} is not installed): "
        "pip install 'loopprobe[plots]'"
    ) from exc

from loopprobe._stats import loglog_slope  # noqa: E402 - the slope the figures draw, for notebooks
from loopprobe.plots.alignment import (  # noqa: E402
    delta_f_vs_R,
    kappa_vs_R,
    predicted_slopes,
    visit_cosines,
    visit_norms,
)
from loopprobe.plots.fixedpoint import eigenvalues, fixed_point_residuals  # noqa: E402
from loopprobe.plots.growth import (  # noqa: E402
    coord_check,
    increment_growth,
    lr_transfer,
    stream_plot,
)
from loopprobe.plots.monitor import kappa_vs_step, training_watch, visit_heatmap  # noqa: E402
from loopprobe.plots.redundancy import (  # noqa: E402
    attention_sparsity,
    kv_quantization,
    lazy_update_cost,
    loop_similarity,
    token_concentration,
)

__all__ = [
    "attention_sparsity",
    "kappa_vs_step",
    "kv_quantization",
    "lazy_update_cost",
    "loop_similarity",
    "token_concentration",
    "training_watch",
    "visit_heatmap",
    "coord_check",
    "delta_f_vs_R",
    "eigenvalues",
    "fixed_point_residuals",
    "increment_growth",
    "kappa_vs_R",
    "loglog_slope",
    "lr_transfer",
    "predicted_slopes",
    "stream_plot",
    "visit_cosines",
    "visit_norms",
]
