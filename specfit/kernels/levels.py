"""The expected next draft level, compiled: what a drafted level teaches
:class:`specfit.next_level.LevelStats` and the virtual children of
:func:`specfit.next_level.expected_level` (the rules are in :mod:`specfit.next_level`, which owns
the statistics and calls these).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

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
                    e = experts[v, layer, s]
                    shared = False
                    for t in range(k):
                        if experts[u, layer, t] == e:
                            shared = True
                            break
                    if not shared:
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
