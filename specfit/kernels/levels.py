"""The expected next draft level, compiled: what a drafted level teaches
:class:`specfit.next_level.LevelStats` and the virtual children of
:func:`specfit.next_level.expected_level` (the rules are in :mod:`specfit.next_level`, which owns
the statistics and calls these).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from .bitsets import in_row

__all__ = ["level_summary", "virtual_children"]

PHI = 0.6180339887498949   # spreads fractional expert counts evenly over children and layers


@njit(cache=True)
def level_summary(parents, probs, nodes, experts, max_rank):
    """What the drafted level ``nodes`` (ascending ids) shows: per sibling rank (0 = the most
    probable child of its parent, ties by id) the sum and count of the conditional probabilities
    ``p / p_parent`` (ranks below ``max_rank``), the number of distinct parents, and the mean over
    nodes and layers of how many of a node's experts its parent does not route to (``experts``
    ``[nodes, L, k]``; -1 when it has no layer)."""
    n = nodes.size
    cond = np.empty(n, dtype=np.float64)
    par = np.empty(n, dtype=np.int64)
    for i in range(n):
        v = nodes[i]
        u = parents[v]
        par[i] = u
        pu = probs[u]
        cond[i] = probs[v] / max(pu, 1e-300) if pu > 0 else 0.0
    sums = np.zeros(max_rank, dtype=np.float64)
    counts = np.zeros(max_rank, dtype=np.int64)
    # rank within the parent's children: how many siblings come first (higher cond, or equal and
    # a lower id); a level holds few children per parent, so the pairwise count is cheap
    n_parents = 0
    for i in range(n):
        rank = 0
        first_child = True
        for j in range(n):
            if par[j] != par[i] or j == i:
                continue
            if j < i:
                first_child = False
            if cond[j] > cond[i] or (cond[j] == cond[i] and nodes[j] < nodes[i]):
                rank += 1
        if first_child:
            n_parents += 1
        if rank < max_rank:
            sums[rank] += cond[i]
            counts[rank] += 1
    new_mean = -1.0
    if experts.shape[1] > 0:
        n_layers, k = experts.shape[1], experts.shape[2]
        total = 0
        for i in range(n):
            v, u = nodes[i], par[i]
            for layer in range(n_layers):
                for s in range(k):
                    if not in_row(experts, u, layer, experts[v, layer, s], k):
                        total += 1
        new_mean = total / (n * n_layers)
    return sums, counts, n_parents, new_mean


@njit(cache=True)
def virtual_children(experts, parents, m, n_experts):
    """Experts ``[children, L, k]`` of virtual children of ``parents``: each keeps its parent's
    experts except for ``floor(m)`` or ``floor(m) + 1`` new ones per layer (the last slots),
    spread evenly so that they average ``m``; a new expert is a fresh id past ``n_experts``,
    unique per child and slot."""
    n_children = parents.size
    n_layers, top_k = experts.shape[1], experts.shape[2]
    base = math.floor(m)
    frac = m - base
    out = np.empty((n_children, n_layers, top_k), dtype=np.int64)
    for j in range(n_children):
        u = parents[j]
        for layer in range(n_layers):
            n_new = int(base) + (1 if ((j * n_layers + layer) * PHI) % 1.0 < frac else 0)
            for s in range(top_k):
                if s >= top_k - n_new:
                    out[j, layer, s] = n_experts + j * top_k + s
                else:
                    out[j, layer, s] = experts[u, layer, s]
    return out


@njit(cache=True)
def level_nodes(parents, d):
    """Ids (ascending) of the nodes at depth ``d`` of a tree in topological order."""
    n = parents.size
    depth = np.zeros(n, dtype=np.int64)
    count = 1 if d == 0 else 0
    for v in range(1, n):
        depth[v] = depth[parents[v]] + 1
        count += depth[v] == d
    out = np.empty(count, dtype=np.int64)
    i = 0
    for v in range(n):
        if depth[v] == d:
            out[i] = v
            i += 1
    return out


@njit(cache=True)
def stats_update(parents, probs, nodes, experts, d, acceptance, new_experts, new_is_share, seen, width, memory):
    """Learn from the drafted level ``d`` (``nodes``) of a tree: the running means of
    :class:`specfit.next_level.LevelStats`, whose arrays these are (``width`` a one-element array),
    updated in place; ``experts`` with no layer (``[0, 0, 0]``) leaves the expert counts alone."""
    if d < 1 or d >= new_experts.size or nodes.size == 0:
        return
    sums, counts, n_parents, new = level_summary(parents, probs, nodes, experts, acceptance.shape[1])
    m = memory
    for r in range(acceptance.shape[1]):
        if counts[r]:
            acceptance[d, r] = m * acceptance[d, r] + (1 - m) * (sums[r] / counts[r])
    w = nodes.size / n_parents
    width[0] = w if width[0] == 0 else m * width[0] + (1 - m) * w
    if experts.shape[1] > 0:
        prior = new_experts[d] * (experts.shape[2] if new_is_share[d] else 1)
        new_experts[d] = m * prior + (1 - m) * new if seen[d] else new
        new_is_share[d] = False
    seen[d] += 1


@njit(cache=True)
def known_depth(seen, depth):
    """``depth`` if a level that deep has been seen, else the deepest seen level above it; ``depth``
    (capped at the deepest kept) when none was seen."""
    d = min(depth, seen.size - 1)
    if seen[d] > 0:
        return d
    for j in range(d - 1, -1, -1):
        if seen[j] > 0:
            return j
    return d


@njit(cache=True)
def expected_new_experts(new_experts, new_is_share, seen, depth, top_k):
    """Experts per layer a node at ``depth`` is expected to route to and its parent not, in [0, top_k]."""
    d = known_depth(seen, depth)
    value = new_experts[d] * top_k if new_is_share[d] else new_experts[d]
    return min(max(value, 0.0), float(top_k))


@njit(cache=True)
def expected_children(parents, probs, newest, experts, acceptance, new_experts, new_is_share, seen, width, depth,
                      n_experts, frontier_width):
    """The virtual level ``depth + 1`` below the drafted level ``newest`` (ascending ids; not empty):
    ``(parents, path probabilities, experts)`` of the grown tree, the real nodes first. The
    probabilities are as given (a :class:`~specfit.tree.DraftTree` clips them once); the virtual
    nodes' experts come from :func:`virtual_children` with fresh ids from ``n_experts`` on.
    ``frontier_width`` 0: as many frontier nodes as children per node (the learned width)."""
    w = int(np.rint(width)) if width > 0 else newest.size
    w = max(1, min(w, acceptance.shape[1]))
    n_front = min(frontier_width if frontier_width > 0 else w, newest.size)
    order = np.argsort(-probs[newest], kind="mergesort")   # most probable first, ties by id
    row = known_depth(seen, depth + 1)
    n = parents.size
    n_children = n_front * w
    grown_parents = np.empty(n + n_children, dtype=np.int64)
    grown_probs = np.empty(n + n_children, dtype=np.float64)
    grown_parents[:n] = parents
    grown_probs[:n] = probs
    for i in range(n_front):
        u = newest[order[i]]
        for j in range(w):
            grown_parents[n + i * w + j] = u
            grown_probs[n + i * w + j] = min(probs[u] * acceptance[row, j], probs[u])
    top_k = experts.shape[2]
    m = expected_new_experts(new_experts, new_is_share, seen, depth + 1, top_k)
    children = virtual_children(experts, grown_parents[n:], m, n_experts)
    grown_experts = np.empty((n + n_children, experts.shape[1], top_k), dtype=np.int64)
    grown_experts[:n] = experts
    grown_experts[n:] = children
    return grown_parents, grown_probs, grown_experts


@njit(cache=True)
def optimistic_children(parents, probs, frontier, experts):
    """The optimistic virtual level below ``frontier`` (not empty): one child per node at the
    level's best conditional probability, with its parent's experts; ``(parents, probabilities,
    experts)`` of the grown tree (empty parents when that probability is 0)."""
    q = 0.0
    for v in frontier:
        if probs[parents[v]] > 0:
            q = max(q, min(probs[v] / probs[parents[v]], 1.0))
    if q <= 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64), np.zeros((0, 0, 0), dtype=np.int64)
    n, f = parents.size, frontier.size
    grown_parents = np.empty(n + f, dtype=np.int64)
    grown_probs = np.empty(n + f, dtype=np.float64)
    grown_experts = np.empty((n + f, experts.shape[1], experts.shape[2]), dtype=np.int64)
    grown_parents[:n] = parents
    grown_probs[:n] = probs
    grown_experts[:n] = experts
    for i in range(f):
        grown_parents[n + i] = frontier[i]
        grown_probs[n + i] = probs[frontier[i]] * q
        grown_experts[n + i] = experts[frontier[i]]
    return grown_parents, grown_probs, grown_experts
