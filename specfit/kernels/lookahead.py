"""The draft's look-ahead for the expert cache, compiled: the near-future weight of each drafted
node, the per-expert sums behind ``keep``, and the need priority of a prefetch (the rules are in
:mod:`specfit.experts.lookahead` and :mod:`specfit.experts.prefetch`, which call these and keep the
vectorised float functions, ``log1p`` / ``expm1``, in numpy)."""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from .bitsets import in_row

__all__ = ["next_token_weights", "add_per_expert", "need_priority"]


@njit(cache=True)
def next_token_weights(parents, probs, selected, decay):
    """float [n]: each node's weight as a near-future token after verifying ``selected`` (see
    :func:`specfit.experts.lookahead.next_token_weights`)."""
    n = parents.size
    sel = np.zeros(n, dtype=np.bool_)
    for v in selected:
        sel[v] = True
    # P(v is the last accepted node) for every selected v: p_v minus its selected children's
    last = np.zeros(n)
    for v in range(n):
        if sel[v]:
            last[v] = probs[v]
    for v in range(n):
        if sel[v] and parents[v] >= 0:
            last[parents[v]] -= probs[v]
    for v in range(n):
        last[v] = max(last[v], 0.0)
    weight = np.zeros(n)
    anchor = np.full(n, -1, dtype=np.int64)     # the selected node an unselected node hangs from
    below = np.zeros(n, dtype=np.int64)         # its depth below that node
    for v in range(1, n):                       # parents precede children
        u = parents[v]
        if sel[v]:
            continue
        if sel[u]:
            anchor[v], below[v] = u, 1
        elif anchor[u] >= 0:
            anchor[v], below[v] = anchor[u], below[u] + 1
        a = anchor[v]
        if a >= 0 and probs[a] > 0:
            weight[v] = last[a] * min(probs[v] / probs[a], 1.0) * math.pow(decay, below[v] - 1)
    return weight


@njit(cache=True)
def add_per_expert(experts, nodes, values, n_experts):
    """float [L * E]: per (layer, expert) item the sum of ``values[i]`` over ``nodes[i]`` predicted
    to route to it (``experts[node, L, k]``; a slot repeated within a layer counts once), added in
    node order."""
    n_layers, top_k = experts.shape[1], experts.shape[2]
    acc = np.zeros(n_layers * n_experts)
    for i in range(nodes.size):
        v = nodes[i]
        for layer in range(n_layers):
            for s in range(top_k):
                e = experts[v, layer, s]
                if not 0 <= e < n_experts:
                    raise ValueError("experts: an expert id is out of range")
                if not in_row(experts, v, layer, e, s):
                    acc[layer * n_experts + e] += values[i]
    return acc


@njit(cache=True)
def need_priority(probs, experts, n_experts):
    """float [L, E]: for each expert, the largest path probability of a node predicted to route to
    it (``experts[n, L, k]``, the first n nodes of the tree)."""
    n, n_layers, top_k = experts.shape
    out = np.zeros((n_layers, n_experts))
    for v in range(n):
        for layer in range(n_layers):
            for s in range(top_k):
                e = experts[v, layer, s]
                if not 0 <= e < n_experts:
                    raise ValueError("experts: an expert id is out of range")
                out[layer, e] = max(out[layer, e], probs[v])
    return out
