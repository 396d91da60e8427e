"""Drivers that build and train models to test a claim of the seeds (``lp.experiments``).

:func:`coord_check` and :func:`lr_transfer` take any model family; the ``reference_*``
functions run them (and the growth sweep) on the reference :class:`~loopprobe.models.LoopedGPT`;
:func:`recall_study` trains the recall / outer-norm variants for fixed-point reachability;
:func:`record_training` trains a model while recording :func:`loopprobe.instability`;
:func:`watch_training` trains the reference model per scheme with :class:`loopprobe.Monitor` on.
Results are cached per configuration by :func:`loopprobe.sweep` where a ``cache_dir`` is given.

The pre-registered studies built on these drivers (their designs, analyses, criteria and
committed cells) live beside the package in the repository's ``studies/`` tree, not here.
"""

from loopprobe.estimate.instability import InstabilityRecorder, record_training
from loopprobe.experiments.coordcheck import CoordCheck, coord_check
from loopprobe.experiments.coordcheck_reference import reference_coord_check
from loopprobe.experiments.growth import reference_growth
from loopprobe.experiments.lrtransfer import LRTransfer, lr_transfer, reference_lr_transfer
from loopprobe.experiments.recall import recall_study
from loopprobe.experiments.watch import watch_training

__all__ = [
    "CoordCheck",
    "InstabilityRecorder",
    "LRTransfer",
    "coord_check",
    "lr_transfer",
    "recall_study",
    "record_training",
    "reference_coord_check",
    "reference_growth",
    "reference_lr_transfer",
    "watch_training",
]
