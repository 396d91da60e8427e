"""Small, readable reference looped models (see docs/models-api.md)."""

from loopprobe.models.flt import FullyLoopedGPT
from loopprobe.models.gpt import GPTConfig, LoopedGPT
from loopprobe.models.hierarchical import HierarchicalLoop, HRMConfig
from loopprobe.models.layers import Block, Branch, RMSNorm
from loopprobe.models.linear import LinearLoop, LinearLoopConfig

__all__ = [
    "Block",
    "Branch",
    "FullyLoopedGPT",
    "GPTConfig",
    "HRMConfig",
    "HierarchicalLoop",
    "LinearLoop",
    "LinearLoopConfig",
    "LoopedGPT",
    "RMSNorm",
]
