"""Tree speculative sampling compiled: the walk over a verified tree.

The rule and its proof are :mod:`specfit.runtime.acceptance`'s. At a node on the path, with the
target's distribution there ``p = softmax(logits / temperature)`` (float64), the verified
children are tried in the drafter's order (path probability descending, ties: the earlier node):
child token ``x`` is accepted with probability ``p(x) / (1 - S)``, ``S`` the mass of the tokens
rejected there before it (a rejection removes its token from ``p``, and what is left is
renormalised). When none is accepted the bonus token is drawn from what is left, as
``rng.choice(V, p=...)`` draws (cumulative sums normalised by the last, the first bin above one
uniform number). Each step also records what it revealed for learning: ``p`` at every drafted
child of the node, verified or not, before any rejection (the chance the walk accepts it there).

The uniform numbers come from the caller's ``numpy.random.Generator`` (numba draws from its bit
generator in place, as ``rng.random()`` does): one per tried child, then one for the bonus, in the
walk's order. The walk reads a row of logits only when it reaches its node, and stops to ask for
one it does not have (``have``), before drawing anything there: logits on a device are copied to
the host a visited row at a time, and the walk resumes where it stopped.

A row whose largest logit is ``+inf`` (an overflow) is the softmax's limit: its mass shared by the
``+inf`` tokens. A row with a NaN, or with no logit above ``-inf``, has no distribution: the walk
stops there (``BAD_ROW``) before drawing anything.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["walk", "DONE", "NEED_ROW", "BAD_TOKEN", "BAD_ROW"]

DONE, NEED_ROW, BAD_TOKEN, BAD_ROW = 0, 1, 2, 3


@njit(cache=True)
def walk(logits, have, row_of, temperature, parents, path_probs, tokens, rng, path, size, edge_nodes, edge_probs,
         n_edges):
    """Walk on from ``path[:size]`` (the root alone to start): ``(status, size, n_edges, bonus)``.

    ``logits`` float [rows, V] on the host, row ``row_of[v]`` node ``v``'s (-1: not verified, not
    tried), ``have[r]`` whether row ``r`` is filled in. ``path`` and the edges (``edge_nodes``,
    ``edge_probs``, filled up to ``n_edges``; path order, each node's children ascending) are
    written in place. ``status``: ``DONE`` with the bonus token; ``NEED_ROW`` when the node at
    ``path[size - 1]`` needs its row (fill it, set ``have``, call again with the returned sizes);
    ``BAD_TOKEN`` when a drafted child's token is not in ``[0, V)``; ``BAD_ROW`` when the node's row
    has no distribution (a NaN, or every logit ``-inf``). ``parents`` is topological."""
    n = parents.size
    vocab = logits.shape[1]
    e = np.empty(vocab)
    order = np.empty(n, dtype=np.int64)
    while True:
        node = path[size - 1]
        row = row_of[node]
        if not have[row]:
            return NEED_ROW, size, n_edges, -1
        # the distribution at the node, unnormalised (e / total is p)
        top, top_token = np.float64(logits[row, 0]), 0
        for i in range(1, vocab):
            if logits[row, i] > top:
                top, top_token = np.float64(logits[row, i]), i
        total = 0.0
        if top == np.inf:         # an overflowed logit: the limit of the softmax, a point mass
            for i in range(vocab):
                e[i] = 1.0 if logits[row, i] == np.inf else 0.0
                total += e[i]
        else:
            for i in range(vocab):
                e[i] = np.exp((np.float64(logits[row, i]) - top) / temperature)
                total += e[i]
        if not total > 0.0:       # NaN: a NaN logit, or every logit -inf
            return BAD_ROW, size, n_edges, -1
        # its children: every one an edge; the verified ones in the drafter's order
        m = 0
        for v in range(node + 1, n):
            if parents[v] != node:
                continue
            if tokens[v] < 0 or tokens[v] >= vocab:
                return BAD_TOKEN, size, n_edges, -1
            edge_nodes[n_edges] = v
            edge_probs[n_edges] = e[tokens[v]] / total
            n_edges += 1
            if row_of[v] < 0:
                continue
            t = m
            while t > 0 and path_probs[order[t - 1]] < path_probs[v]:
                order[t] = order[t - 1]
                t -= 1
            order[t] = v
            m += 1
        accepted = -1
        left = 1.0            # the share of p that no rejection has removed
        for i in range(m):
            child = order[i]
            token = tokens[child]
            p = e[token] / total          # 0 for a token rejected here already
            # left - p == 0: the token holds all the mass that is left, up to rounding; it cannot be rejected
            if rng.random() * left < p or left - p <= 0.0:
                accepted = child
                break
            e[token] = 0.0
            left -= p
        if accepted >= 0:
            path[size] = accepted
            size += 1
            continue
        # the bonus: from what is left of p
        acc = 0.0
        for i in range(vocab):
            acc += e[i]
            e[i] = acc
        u = rng.random()
        if not acc > 0.0:     # the rejected tokens held all the mass, up to rounding: the likeliest token
            return DONE, size, n_edges, top_token
        for i in range(vocab):
            if e[i] / acc > u:
                return DONE, size, n_edges, i
        return DONE, size, n_edges, vocab - 1
