"""Maximum-weight closure as one s-t minimum cut: Dinic's max-flow on float capacities.

The answer is the *minimal* maximum-weight closed set: the vertices the source reaches in the
residual graph of a maximum flow (the same set for every maximum flow), with capacities at most
``eps`` counted as saturated.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .tolerances import FLOW_REL

__all__ = ["min_cut_source_side", "closure_of_weights"]


@njit(cache=True)
def min_cut_source_side(n_vertices, source, sink, edge_from, edge_to, edge_cap, eps):
    """bool ``[n_vertices]``: what ``source`` reaches in the residual graph after a maximum flow
    over the directed edges ``edge_from[i] -> edge_to[i]`` of capacity ``edge_cap[i]`` (inf allowed)."""
    m = edge_from.size
    # arcs 2i (forward) and 2i + 1 (its reverse), grouped by tail in CSR order
    head = np.empty(2 * m, dtype=np.int64)
    tail = np.empty(2 * m, dtype=np.int64)
    cap = np.empty(2 * m, dtype=np.float64)
    degree = np.zeros(n_vertices + 1, dtype=np.int64)
    for i in range(m):
        u, v = edge_from[i], edge_to[i]
        tail[2 * i], head[2 * i], cap[2 * i] = u, v, edge_cap[i]
        tail[2 * i + 1], head[2 * i + 1], cap[2 * i + 1] = v, u, 0.0
        degree[u + 1] += 1
        degree[v + 1] += 1
    start = np.empty(n_vertices + 1, dtype=np.int64)
    total = 0
    for u in range(n_vertices + 1):
        total += degree[u]
        start[u] = total
    fill = start[:-1].copy()
    arcs = np.empty(2 * m, dtype=np.int64)
    for a in range(2 * m):
        arcs[fill[tail[a]]] = a
        fill[tail[a]] += 1

    level = np.empty(n_vertices, dtype=np.int64)
    queue = np.empty(n_vertices, dtype=np.int64)
    current = np.empty(n_vertices, dtype=np.int64)
    path = np.empty(n_vertices, dtype=np.int64)
    while True:
        # breadth-first levels over arcs with residual capacity
        for u in range(n_vertices):
            level[u] = -1
        level[source] = 0
        queue[0] = source
        q_head, q_tail = 0, 1
        while q_head < q_tail:
            u = queue[q_head]
            q_head += 1
            for i in range(start[u], start[u + 1]):
                a = arcs[i]
                v = head[a]
                if level[v] < 0 and cap[a] > eps:
                    level[v] = level[u] + 1
                    queue[q_tail] = v
                    q_tail += 1
        if level[sink] < 0:
            break
        # blocking flow: depth-first along level-increasing arcs, each vertex resuming at its
        # current arc; a dead end is retreated from and never entered again in this phase
        for u in range(n_vertices):
            current[u] = start[u]
        depth = 0
        u = source
        while True:
            if u == sink:
                bottleneck = cap[path[0]]
                for i in range(1, depth):
                    if cap[path[i]] < bottleneck:
                        bottleneck = cap[path[i]]
                for i in range(depth):
                    cap[path[i]] -= bottleneck
                    cap[path[i] ^ 1] += bottleneck
                depth = 0
                u = source
                continue
            advanced = False
            while current[u] < start[u + 1]:
                a = arcs[current[u]]
                v = head[a]
                if cap[a] > eps and level[v] == level[u] + 1:
                    path[depth] = a
                    depth += 1
                    u = v
                    advanced = True
                    break
                current[u] += 1
            if advanced:
                continue
            if u == source:
                break
            level[u] = -1
            depth -= 1
            u = tail[path[depth]]
            current[u] += 1

    # the loop ends right after a breadth-first pass that did not reach the sink: its levels mark
    # the source side of the minimum cut
    return level >= 0


@njit(cache=True)
def closure_of_weights(weights, req_from, req_to, gain_eps):
    """The minimal maximum-weight closed set of ``weights`` (bool mask), where ``req_from[i]``
    can only be chosen together with ``req_to[i]``; a gain below ``gain_eps`` plus ``FLOW_REL``
    times the weights' total magnitude counts as none."""
    m = weights.size
    n_pos = 0
    scale = 0.0
    for i in range(m):
        scale += abs(weights[i])
        if weights[i] != 0.0:
            n_pos += 1
    if scale == 0.0:
        scale = 1.0
    n_edges = n_pos + req_from.size
    edge_from = np.empty(n_edges, dtype=np.int64)
    edge_to = np.empty(n_edges, dtype=np.int64)
    edge_cap = np.empty(n_edges, dtype=np.float64)
    source, sink = m, m + 1
    j = 0
    for i in range(m):
        w = weights[i]
        if w > 0:
            edge_from[j], edge_to[j], edge_cap[j] = source, i, w
            j += 1
        elif w < 0:
            edge_from[j], edge_to[j], edge_cap[j] = i, sink, -w
            j += 1
    for i in range(req_from.size):
        edge_from[j], edge_to[j], edge_cap[j] = req_from[i], req_to[i], np.inf
        j += 1
    seen = min_cut_source_side(m + 2, source, sink, edge_from, edge_to, edge_cap, scale * FLOW_REL + gain_eps)
    return seen[:m].copy()
