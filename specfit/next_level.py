"""The expected next draft level: what SpecFit's stopping rule weighs before it drafts one more.

A level can fail to pay while the one after it would (a confident chain whose first steps alone do
not cover their draft cost), so the stopping rule looks one level ahead. It cannot see the next
level's tokens, but it has seen every level it drafted before. :class:`LevelStats` keeps, from the
trees a policy has been shown (no verdicts needed), per depth and sibling rank the mean conditional
probability ``p_child / p_parent`` and the mean number of experts per layer that a node is
predicted to route to and its parent is not, and how many children an expanded node gets.

:func:`expected_level` builds the virtual level from them: each node of the frontier the drafter
would expand next (the newest level's most probable ``width`` nodes) gets ``width`` children with
path probability ``p_parent * a(depth, rank)`` that route to the parent's experts except for
``m(depth)`` new experts per layer, which no one else shares and nothing has resident (fresh ids
past the real ones, so every one is a miss). The search on the tree with the virtual level,
charged one more draft level, is the next level's expected value; an optimistic variant (no new
experts, the child the newest level's best conditional probability) is kept for comparison.
"""

from __future__ import annotations

import numpy as np

from . import kernels
from .tree import DraftTree

__all__ = ["LevelStats", "expected_level", "optimistic_level"]

_NO_EXPERTS = np.zeros((0, 0, 0), dtype=np.int64)   # a tree drafted without expert predictions


class LevelStats:
    """Running means (exponential, ``memory`` per update) of drafted levels.

    ``acceptance_[depth, rank]``: conditional probability of a rank-``rank`` child (0 = the most
    probable of its siblings) at ``depth``; ``new_experts_[depth]``: predicted experts per layer not
    shared with the parent; ``width_``: children per expanded node. Unseen entries hold the prior
    (``prior_acceptance`` for rank 0, halving per rank; ``prior_new_experts``). The arrays are the
    state the compiled rules (:mod:`specfit.kernels.levels`) update in place, here and inside
    :mod:`specfit.kernels.decide`.
    """

    def __init__(self, max_depth: int = 16, max_rank: int = 16, memory: float = 0.95, prior_acceptance: float = 0.5,
                 prior_new_experts: float = 0.5):
        if not 0 < memory < 1:
            raise ValueError(f"memory: expected a share in (0, 1), got {memory}")
        self.memory = float(memory)
        self.acceptance_ = np.tile(prior_acceptance * 0.5 ** np.arange(max_rank), (max_depth + 2, 1))
        self.new_experts_ = np.full(max_depth + 2, float(prior_new_experts))   # a share of top_k until seen
        self._new_is_share = np.ones(max_depth + 2, dtype=bool)
        self._width = np.zeros(1)
        self.seen_ = np.zeros(max_depth + 2, dtype=np.int64)

    @property
    def width_(self) -> float:
        return float(self._width[0])

    @width_.setter
    def width_(self, value: float) -> None:
        self._width[0] = value

    @property
    def arrays(self) -> tuple:
        """``(acceptance, new_experts, new_is_share, seen, width)`` as the kernels take them."""
        return self.acceptance_, self.new_experts_, self._new_is_share, self.seen_, self._width

    def update(self, tree: DraftTree, experts: np.ndarray, depth: int) -> None:
        """Learn from the nodes of ``tree`` at ``depth`` (just drafted) and their predicted experts."""
        has_experts = experts.ndim == 3 and experts.shape[1] > 0
        kernels.levels.stats_update(
            np.array(tree.parents), np.array(tree.path_probs), tree.level(depth),
            np.ascontiguousarray(experts, dtype=np.int64) if has_experts else _NO_EXPERTS, int(depth), *self.arrays,
            self.memory)

    def known_depth(self, depth: int) -> int:
        """``depth`` if a level that deep has been seen, else the deepest seen level above it (the
        next level is assumed to be like the last one); ``depth`` itself when none was seen."""
        return int(kernels.levels.known_depth(self.seen_, int(depth)))

    def new_experts(self, depth: int, top_k: int) -> float:
        return float(kernels.levels.expected_new_experts(self.new_experts_, self._new_is_share, self.seen_, int(depth),
                                                         int(top_k)))


def expected_level(tree: DraftTree, experts: np.ndarray, cached: np.ndarray, stats: LevelStats, depth: int,
                   frontier_width: int | None = None):
    """(tree, experts, cached) with the expected level ``depth + 1`` appended (see the module
    docstring); ``cached`` grows by the fresh expert ids the virtual nodes route to. None when
    there is nothing to expand."""
    newest = tree.level(depth)
    if newest.size == 0:
        return None
    n_experts = cached.shape[1]
    parents, probs, grown_experts = kernels.levels.expected_children(
        np.array(tree.parents), np.array(tree.path_probs), newest, np.ascontiguousarray(experts, dtype=np.int64),
        stats.acceptance_, stats.new_experts_, stats._new_is_share, stats.seen_, stats.width_, int(depth), n_experts,
        int(frontier_width or 0))
    n_children = parents.size - tree.n_nodes
    grown = np.zeros((cached.shape[0], n_experts + n_children * experts.shape[2]), dtype=bool)
    grown[:, :n_experts] = cached
    return DraftTree(parents=parents, path_probs=probs), grown_experts, grown


def optimistic_level(tree: DraftTree, experts: np.ndarray, depth: int):
    """(tree, experts) with one child per node of level ``depth``, at the newest level's best
    conditional probability and with its parent's experts: the rule before expected_level."""
    frontier = tree.level(depth)
    if frontier.size == 0:
        return None
    parents, probs, grown_experts = kernels.levels.optimistic_children(
        np.array(tree.parents), np.array(tree.path_probs), frontier, np.ascontiguousarray(experts, dtype=np.int64))
    if parents.size == 0:
        return None
    return DraftTree(parents=parents, path_probs=probs), grown_experts
