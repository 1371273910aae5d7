"""Sequoia's static tree (Chen et al., 2024), as a fixed baseline.

Sequoia verifies one tree shape, chosen offline: a node is named by the sibling ranks of the path
to it (its parent's ``r``-th most probable child, by the drafter), and with *positional acceptance
rates* ``a[r]`` (how often the target accepts a parent's rank-``r`` child, the parent accepted)
the tree of ``N`` nodes that accepts the most tokens in expectation maximises the sum over its
nodes of the product of ``a`` along their paths. :func:`shape` finds it with Sequoia's dynamic
program, whose trees give a node with ``b`` children the ranks ``0 .. b - 1`` (no rank is skipped);
among trees of equal value it keeps the shallowest. Where the rates fall with the rank (as
greedy verdicts make them, up to noise in the rarely reached ranks) the tree is the ``N`` rank paths
with the largest products. The hardware-aware choice (Sequoia picks the size and depth with the
fewest measured seconds per token) is ``sequoia:auto`` for the size, every size replayed and the
fastest on the trace, cache size and cost model kept as ``static:auto`` does; the depth is the one
the tree reaches, at most ``--max-levels`` (``sequoia:N:D`` bounds it at D).

On a drafted tree (:func:`node_scores`) the policy verifies the shape's nodes the draft holds and,
where it lacks some (a recorded or live tree keeps only the best few nodes of each level, as EAGLE
drafts), the drafted nodes with the largest products in their places, within the shape's depth: as
many nodes as the shape has (N, or fewer where the rates' ranks cannot hold N within the depth)
where the draft holds that many. The rates are fitted on a recorded trace
(:func:`trace_rates`): in a replay the trace being replayed, a hindsight the baseline is given as
``static:auto`` is given its size; live (``decode --policy sequoia:N``) the trace given to
``--acceptance``.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

__all__ = ["sibling_ranks", "node_scores", "positional_rates", "trace_rates", "shape", "shape_depth", "tree_depth"]


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


def node_scores(parents: np.ndarray, depths: np.ndarray, ranks: np.ndarray, rates: np.ndarray,
                tree: list[tuple[int, ...]] | None = None) -> np.ndarray:
    """Each node's product of ``rates[rank]`` along its path (1 at roots; a rank past the rates
    scores 0): the expected acceptance Sequoia assigns it; plus 1 where the node's path of ranks
    is in ``tree`` (a :func:`shape`), so that a rerank takes the shape's nodes first and the largest
    products after them. ``parents``: global ids, -1 at roots."""
    rates = np.asarray(rates, dtype=np.float64)
    parents = np.asarray(parents, dtype=np.int64)
    edge = np.zeros(parents.size)
    child = ranks >= 0
    known = child & (ranks < rates.size)
    edge[known] = rates[ranks[known]]
    scores = np.ones(parents.size)
    # the shape as a trie: member[v] is the node's row in ``tree`` (-1: not in it)
    rows = {path: i for i, path in enumerate(tree or [()])}
    kids = np.full((len(rows), max(rates.size, 1)), -1, dtype=np.int64)
    for path, i in rows.items():
        if path:
            kids[rows[path[:-1]], path[-1]] = i
    member = np.where(child, -1, rows[()])
    for d in range(1, int(depths.max(initial=0)) + 1):     # level by level: parents are final first
        at = np.flatnonzero(depths == d)
        scores[at] = scores[parents[at]] * edge[at]
        up = member[parents[at]]
        inside = (up >= 0) & known[at]
        member[at[inside]] = kids[up[inside], ranks[at[inside]]]
    return scores + (member >= 0) if tree is not None else scores


def positional_rates(ranks: np.ndarray, reached: np.ndarray, accepted: np.ndarray) -> np.ndarray:
    """Sequoia's acceptance vector: for each sibling rank, the share of the ``reached`` nodes of
    that rank (their parent accepted, its verdict known) that were ``accepted`` too. Ranks never
    reached rate 0."""
    size = int(ranks[reached].max(initial=-1)) + 1
    tried = np.bincount(ranks[reached], minlength=size)
    taken = np.bincount(ranks[reached & accepted], minlength=size)
    return np.divide(taken, tried, out=np.zeros(size), where=tried > 0)


def trace_rates(trace, ranks: np.ndarray | None = None) -> np.ndarray:
    """Sequoia's acceptance vector on a recorded trace: sibling ranks by the drafter's path
    probabilities (``ranks``, when the caller has them), over the edges whose parent lies on its
    cycle's accepted path with a known verdict (the edges the acceptance calibrator fits the chain
    rule on, :func:`specfit.experts.calibration.edge_mask`)."""
    from .experts.calibration import edge_mask

    parents = trace.parent_rows
    reached = edge_mask(trace)
    accepted = np.zeros(parents.size, dtype=bool)
    accepted[reached] = trace.token[reached] == trace.verdict[parents[reached]]
    if ranks is None:
        ranks = sibling_ranks(parents, trace.path_prob)
    return positional_rates(ranks, reached, accepted)


# values this close are one value: of two such trees the shallower is kept
_TIE = 1e-12


def _better(value: float, height: int, best: tuple[float, int] | None) -> bool:
    return best is None or value > best[0] + _TIE or (value >= best[0] - _TIE and height < best[1])


@lru_cache(maxsize=256)
def _program(rates: tuple[float, ...], total_nodes: int, max_depth: int) -> tuple[dict, dict]:
    """Sequoia's dynamic program: ``tree[d, n]`` = (value, height) of the best tree of ``n`` nodes
    at most ``d`` levels deep; ``forest[d, r, m]`` = (value, height, nodes of rank r's subtree) of
    the best ``m`` nodes under one parent as the subtrees of its children of ranks ``r, r + 1, ...``
    (no rank skipped), each at most ``d`` levels deep."""
    k = len(rates)
    tree: dict = {(d, 1): (1.0, 0) for d in range(max_depth + 1)}
    forest: dict = {}
    for d in range(max_depth):             # forests of subtrees d levels deep make trees of d + 1
        for r in range(k, -1, -1):
            forest[d, r, 0] = (0.0, -1, 0)
            for m in range(1, total_nodes):
                best = None
                if r < k:
                    for j in range(m, 0, -1):              # more nodes under the lower rank first
                        sub, rest = tree.get((d, j)), forest.get((d, r + 1, m - j))
                        if sub is None or rest is None:
                            continue
                        value, height = rates[r] * sub[0] + rest[0], max(sub[1], rest[1])
                        if _better(value, height, best):
                            best = (value, height, j)
                if best is not None:
                    forest[d, r, m] = best
        for n in range(2, total_nodes + 1):
            below = forest.get((d, 0, n - 1))
            if below is not None:
                tree[d + 1, n] = (1.0 + below[0], below[1] + 1)
    return tree, forest


def shape(rates: np.ndarray, total_nodes: int, max_depth: int) -> list[tuple[int, ...]]:
    """Sequoia's tree of ``total_nodes`` nodes (root included; fewer where ``max_depth`` levels of
    ``len(rates)`` children hold fewer) under ``rates``: its nodes, each as its path of sibling
    ranks (the root ``()``), by product (largest first; ties to the shallower node, then the lower
    ranks)."""
    rates = tuple(float(a) for a in np.asarray(rates, dtype=np.float64))
    depth, k = max(0, int(max_depth)), len(rates)
    room = sum(k ** d for d in range(depth + 1)) if k > 1 else depth + 1 if k == 1 else 1
    n = max(1, min(int(total_nodes), room))
    tree, forest = _program(rates, n, depth)

    def build(path: tuple[int, ...], d: int, m: int, r: int, out: list) -> None:
        """The subtrees of ``path``'s children of ranks r, ... holding ``m`` nodes, ``d`` levels deep."""
        if m == 0:
            return
        j = forest[d, r, m][2]
        child = path + (r,)
        out.append(child)
        build(child, d - 1, j - 1, 0, out)
        build(path, d, m - j, r + 1, out)

    paths = [()]
    if n > 1:
        build((), depth - 1, n - 1, 0, paths)

    def product(path):
        value = 1.0
        for r in path:
            value *= rates[r]
        return value
    return sorted(paths, key=lambda p: (-product(p), len(p), p))


def tree_depth(tree: list[tuple[int, ...]]) -> int:
    """The levels a :func:`shape` reaches (at least 1: a tree of the root alone is ``ar``)."""
    return max(1, max(len(path) for path in tree))


def shape_depth(rates: np.ndarray, total_nodes: int, max_depth: int) -> int:
    """The levels Sequoia's tree of ``total_nodes`` nodes reaches (at least 1)."""
    return tree_depth(shape(rates, total_nodes, max_depth))
