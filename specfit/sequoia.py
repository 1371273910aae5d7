"""Sequoia's static tree (Chen et al., 2024), as a fixed baseline for the simulator.

Sequoia verifies one tree shape, chosen offline: a node is named by the sibling ranks of the path
to it (its parent's ``r``-th most probable child, by the drafter), and with *positional acceptance
rates* ``a[r]`` (how often the target accepts a parent's rank-``r`` child, the parent accepted)
the tree of ``N`` nodes that accepts the most tokens in expectation maximises the sum over its
nodes of the product of ``a`` along their paths. Every product shrinks down a path (``a <= 1``), so
the best tree is the ``N`` nodes of the infinite tree with the largest products (any ancestor of a
node scores at least as much as it does); :func:`shape` computes it best-first, and a test checks
it against Sequoia's dynamic program. The hardware-aware size (Sequoia picks the ``N`` with the
most tokens per measured second) is ``sequoia:auto``: every size is replayed and the fastest on the
trace, cache size and cost model is kept, as ``static:auto`` does.

On a drafted tree the shape is the ``N`` nodes with the largest products (:func:`node_scores`),
within the shape's depth: where the draft holds the whole shape that is the shape, and where it
lacks some of its nodes (a recorded tree keeps only the best few nodes of each level, as EAGLE
drafts) the next best nodes drafted take their places, so every cycle verifies ``N`` nodes. The
rates are fitted on a recorded trace (:func:`trace_rates`): in a replay the trace being replayed, a
hindsight the baseline is given as ``static:auto`` is given its size; live (``decode --policy
sequoia:N``) the trace given to ``--acceptance``.
"""

from __future__ import annotations

import heapq

import numpy as np

__all__ = ["sibling_ranks", "node_scores", "positional_rates", "trace_rates", "shape", "shape_depth"]


def sibling_ranks(parents: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """Each node's rank among its siblings (0: its parent's most probable child, by ``probs``;
    ties to the earlier node), -1 at roots. ``parents``: global parent ids, -1 at roots."""
    parents = np.asarray(parents, dtype=np.int64)
    order = np.lexsort((np.arange(parents.size), -np.asarray(probs, dtype=np.float64), parents))
    grouped = parents[order]
    starts = np.r_[True, grouped[1:] != grouped[:-1]] if grouped.size else np.zeros(0, dtype=bool)
    first = np.maximum.accumulate(np.where(starts, np.arange(grouped.size), 0))
    ranks = np.empty(parents.size, dtype=np.int64)
    ranks[order] = np.arange(grouped.size) - first
    ranks[parents < 0] = -1
    return ranks


def node_scores(parents: np.ndarray, depths: np.ndarray, ranks: np.ndarray, rates: np.ndarray) -> np.ndarray:
    """The product of ``rates[rank]`` along each node's path (1 at roots; a rank past the rates
    scores 0): the expected acceptance Sequoia assigns the node. ``parents``: global ids."""
    rates = np.asarray(rates, dtype=np.float64)
    parents = np.asarray(parents, dtype=np.int64)
    edge = np.zeros(parents.size)
    child = ranks >= 0
    known = child & (ranks < rates.size)
    edge[known] = rates[ranks[known]]
    scores = np.ones(parents.size)
    for d in range(1, int(depths.max(initial=0)) + 1):     # level by level: parents are final first
        at = np.flatnonzero(depths == d)
        scores[at] = scores[parents[at]] * edge[at]
    return scores


def positional_rates(ranks: np.ndarray, reached: np.ndarray, accepted: np.ndarray) -> np.ndarray:
    """Sequoia's acceptance vector: for each sibling rank, the share of the ``reached`` nodes of
    that rank (their parent accepted, its verdict known) that were ``accepted`` too. Ranks never
    reached rate 0."""
    size = int(ranks[reached].max(initial=-1)) + 1
    tried = np.bincount(ranks[reached], minlength=size)
    taken = np.bincount(ranks[reached & accepted], minlength=size)
    return np.divide(taken, tried, out=np.zeros(size), where=tried > 0)


def trace_rates(trace) -> np.ndarray:
    """Sequoia's acceptance vector on a recorded trace: sibling ranks by the drafter's path
    probabilities, over the edges whose parent lies on its cycle's accepted path with a known
    verdict (the edges the acceptance calibrator fits the chain rule on,
    :func:`specfit.experts.calibration.edge_mask`)."""
    from .experts.calibration import edge_mask

    parents = trace.parent_rows
    reached = edge_mask(trace)
    accepted = np.zeros(parents.size, dtype=bool)
    accepted[reached] = trace.token[reached] == trace.verdict[parents[reached]]
    return positional_rates(sibling_ranks(parents, trace.path_prob), reached, accepted)


def shape(rates: np.ndarray, total_nodes: int, max_depth: int) -> list[tuple[int, ...]]:
    """Sequoia's tree of ``total_nodes`` nodes (root included) and at most ``max_depth`` levels
    under ``rates``: the nodes, each as its path of sibling ranks (the root ``()``), in the order
    taken (largest product first; ties to the shallower node, then the lower ranks)."""
    rates = np.asarray(rates, dtype=np.float64)
    taken: list[tuple[int, ...]] = []
    heap = [(-1.0, 0, ())]
    while heap and len(taken) < total_nodes:
        neg, depth, path = heapq.heappop(heap)
        taken.append(path)
        if depth < max_depth:
            for r, a in enumerate(rates):
                heapq.heappush(heap, (neg * a, depth + 1, path + (r,)))
    return taken


def shape_depth(rates: np.ndarray, total_nodes: int, max_depth: int) -> int:
    """The levels Sequoia's tree of ``total_nodes`` nodes reaches (at least 1: a tree of the root
    alone is ``ar``)."""
    return max(1, max(len(path) for path in shape(rates, total_nodes, max_depth)))
