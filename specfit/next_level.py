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

from .tree import DraftTree

__all__ = ["LevelStats", "expected_level", "optimistic_level"]

_NO_EXPERTS = np.zeros((0, 0, 0), dtype=np.int64)   # a tree drafted without expert predictions


class LevelStats:
    """Running means (exponential, ``memory`` per update) of drafted levels.

    ``acceptance_[depth, rank]``: conditional probability of a rank-``rank`` child (0 = the most
    probable of its siblings) at ``depth``; ``new_experts_[depth]``: predicted experts per layer not
    shared with the parent; ``width_``: children per expanded node. Unseen entries hold the prior
    (``prior_acceptance`` for rank 0, halving per rank; ``prior_new_experts``).
    """

    def __init__(self, max_depth: int = 16, max_rank: int = 16, memory: float = 0.95, prior_acceptance: float = 0.5,
                 prior_new_experts: float = 0.5):
        if not 0 < memory < 1:
            raise ValueError(f"memory: expected a share in (0, 1), got {memory}")
        self.memory = float(memory)
        self.acceptance_ = np.tile(prior_acceptance * 0.5 ** np.arange(max_rank), (max_depth + 2, 1))
        self.new_experts_ = np.full(max_depth + 2, float(prior_new_experts))   # a share of top_k until seen
        self._new_is_share = np.ones(max_depth + 2, dtype=bool)
        self.width_ = 0.0
        self.seen_ = np.zeros(max_depth + 2, dtype=np.int64)

    def update(self, tree: DraftTree, experts: np.ndarray, depth: int) -> None:
        """Learn from the nodes of ``tree`` at ``depth`` (just drafted) and their predicted experts."""
        if depth < 1 or depth >= self.new_experts_.size:
            return
        nodes = tree.level(depth)
        if nodes.size == 0:
            return
        from . import kernels

        has_experts = experts.ndim == 3 and experts.shape[1] > 0
        sums, counts, n_parents, new = kernels.levels.level_summary(
            tree.parents, tree.path_probs, nodes, np.ascontiguousarray(experts, dtype=np.int64) if has_experts
            else _NO_EXPERTS, self.acceptance_.shape[1])
        m = self.memory
        for r in np.flatnonzero(counts):
            self.acceptance_[depth, r] = m * self.acceptance_[depth, r] + (1 - m) * (sums[r] / counts[r])
        width = nodes.size / n_parents
        self.width_ = width if self.width_ == 0 else m * self.width_ + (1 - m) * width
        if has_experts:
            prior = self.new_experts_[depth] * (experts.shape[2] if self._new_is_share[depth] else 1)
            self.new_experts_[depth] = m * prior + (1 - m) * new if self.seen_[depth] else new
            self._new_is_share[depth] = False
        self.seen_[depth] += 1

    def known_depth(self, depth: int) -> int:
        """``depth`` if a level that deep has been seen, else the deepest seen level above it (the
        next level is assumed to be like the last one); ``depth`` itself when none was seen."""
        d = min(depth, self.seen_.size - 1)
        seen = np.flatnonzero(self.seen_[: d + 1] > 0)
        return d if self.seen_[d] or seen.size == 0 else int(seen[-1])

    def new_experts(self, depth: int, top_k: int) -> float:
        d = self.known_depth(depth)
        value = self.new_experts_[d] * top_k if self._new_is_share[d] else self.new_experts_[d]
        return float(np.clip(value, 0.0, top_k))


def expected_level(tree: DraftTree, experts: np.ndarray, cached: np.ndarray, stats: LevelStats, depth: int,
                   frontier_width: int | None = None):
    """(tree, experts, cached) with the expected level ``depth + 1`` appended (see the module
    docstring); ``cached`` grows by the fresh expert ids the virtual nodes route to. None when
    there is nothing to expand."""
    newest = tree.level(depth)
    if newest.size == 0:
        return None
    width = int(round(stats.width_)) if stats.width_ > 0 else int(newest.size)
    width = max(1, min(width, stats.acceptance_.shape[1]))
    n_front = frontier_width or width
    p = tree.path_probs
    frontier = newest[np.lexsort((newest, -p[newest]))][:n_front]
    cond = stats.acceptance_[stats.known_depth(depth + 1), :width]
    parents = np.repeat(frontier, width)
    probs = p[parents] * np.tile(cond, frontier.size)
    top_k = experts.shape[2]
    n_experts = cached.shape[1]
    from . import kernels

    child_experts = kernels.levels.virtual_children(np.ascontiguousarray(experts, dtype=np.int64), parents,
                                                    stats.new_experts(depth + 1, top_k), n_experts)
    n_children = parents.size
    virtual = DraftTree(parents=np.concatenate([tree.parents, parents]),
                        path_probs=np.concatenate([p, np.minimum(probs, p[parents])]))
    grown = np.zeros((cached.shape[0], n_experts + n_children * top_k), dtype=bool)
    grown[:, :n_experts] = cached
    return virtual, np.concatenate([experts, child_experts]), grown


def optimistic_level(tree: DraftTree, experts: np.ndarray, depth: int):
    """(tree, experts) with one child per node of level ``depth``, at the newest level's best
    conditional probability and with its parent's experts: the rule before expected_level."""
    frontier = tree.level(depth)
    if frontier.size == 0:
        return None
    top = frontier[np.argmax(tree.path_probs[frontier])]
    parent_p = tree.path_probs[tree.parents[top]]
    q = min(float(tree.path_probs[top] / parent_p), 1.0) if parent_p > 0 else 0.0
    if q <= 0:
        return None
    virtual = DraftTree(parents=np.concatenate([tree.parents, frontier]),
                        path_probs=np.concatenate([tree.path_probs, tree.path_probs[frontier] * q]))
    return virtual, np.concatenate([experts, experts[frontier]])
