"""SpecFit: throughput-optimal speculative decoding for MoE models with offloaded experts."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# The public names are imported on first use (PEP 562), so that importing the package, as the
# ``specfit`` command does before anything else, costs nothing and a Ctrl-C while the command
# starts lands where the command can say so in one line (``specfit/__main__.py``).
_EXPORTS = {
    "DraftTree": ".tree",
    "CostModel": ".costmodel",
    "ExpertCache": ".experts.cache",
    "Selection": ".search",
    "best_subtree": ".search",
    "greedy_subtree": ".search",
    "should_continue": ".search",
}

__all__ = ["DraftTree", "CostModel", "ExpertCache", "Selection", "best_subtree", "greedy_subtree", "should_continue",
           "__version__"]

if TYPE_CHECKING:
    from .costmodel import CostModel
    from .experts.cache import ExpertCache
    from .search import Selection, best_subtree, greedy_subtree, should_continue
    from .tree import DraftTree


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'specfit' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
