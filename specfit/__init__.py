"""SpecFit: throughput-optimal speculative decoding for MoE models with offloaded experts."""

from .costmodel import CostModel
from .experts.cache import ExpertCache
from .search import Selection, best_subtree, greedy_subtree, should_continue
from .tree import DraftTree

__version__ = "0.1.0"

__all__ = ["DraftTree", "CostModel", "ExpertCache", "Selection", "best_subtree", "greedy_subtree",
           "should_continue", "__version__"]
