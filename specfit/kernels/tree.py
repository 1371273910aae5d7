"""Draft trees compiled: validation, depths and probability clipping in one pass (the checks
:class:`specfit.tree.DraftTree` makes, which words the error when this reports one), greedy
acceptance (the accepted path), the tree attention mask of a verification pass, and the live
drafter's per-level work (:class:`specfit.runtime.drafting.TreeDraft`): a level's nodes appended
with their frontier, and the attention mask of a frontier's drafter call."""

from __future__ import annotations

import math

import numpy as np
from numba import njit

__all__ = ["check_tree", "accepted_path", "greedy_path", "tree_mask", "add_level", "frontier_mask"]


@njit(cache=True)
def check_tree(parents, probs, slack):
    """(ok, depths) of a tree given as int64 ``parents`` (root -1, ``0 <= parents[v] < v``) and
    float64 ``probs`` (finite, in [0, 1], the root's 1, never above the parent's by more than
    ``slack``), ``ok`` False when any of these fails; ``probs`` is clipped in place to each parent's
    value as given."""
    n = parents.size
    depth = np.zeros(n, dtype=np.int64)
    given = probs.copy()
    ok = parents[0] == -1 and probs[0] == 1.0
    for v in range(n):
        p = given[v]
        if not (np.isfinite(p) and 0.0 <= p <= 1.0):
            ok = False
    for v in range(1, n):
        u = parents[v]
        if u < 0 or u >= v:
            return False, depth
        if given[v] > given[u] + slack:
            ok = False
        probs[v] = min(given[v], given[u])
        depth[v] = depth[u] + 1
    return ok, depth


@njit(cache=True)
def accepted_path(parents, depth, tokens, verdicts, base, n, inside, ok, out):
    """Greedy acceptance among the first ``n`` nodes of the tree at rows ``base:`` (and, when
    ``inside`` is not empty, only the nodes it marks): the longest root path on which every node's
    token equals the target's verdict at its parent; among equally deep ends the first in order.
    Writes the path, root first, into ``out``; returns its length. ``ok`` is scratch of n."""
    ok[0] = True
    last = 0
    for v in range(1, n):
        p = parents[base + v]
        ok[v] = (inside.size == 0 or inside[v]) and ok[p] and tokens[base + v] == verdicts[base + p]
        if ok[v] and depth[base + v] > depth[base + last]:
            last = v
    size = depth[base + last] + 1
    v = last
    for i in range(size - 1, -1, -1):
        out[i] = v
        v = parents[base + v]
    return size


@njit(cache=True)
def greedy_path(parents, depth, tokens, nodes, verdicts):
    """(path, bonus) of greedy acceptance when the target's verdicts ``verdicts[i]`` are known at
    ``nodes[i]`` only (the verified nodes, with the root): :func:`accepted_path` among them, then
    the verdict at the path's last node."""
    n = parents.size
    full = np.full(n, -1, dtype=np.int64)
    inside = np.zeros(n, dtype=np.bool_)
    for i in range(nodes.size):
        full[nodes[i]] = verdicts[i]
        inside[nodes[i]] = True
    out = np.empty(n, dtype=np.int64)
    size = accepted_path(parents, depth, tokens, full, 0, n, inside, np.empty(n, dtype=np.bool_), out)
    return out[:size], full[out[size - 1]]


@njit(cache=True)
def tree_mask(parents, nodes, prefix):
    """(ok, bool [m, prefix + m]) for the ``m`` ``nodes`` of a tree given by ``parents``: row i
    sees the ``prefix`` committed columns and, among the nodes, itself and its ancestors (column
    ``prefix + j`` for ``nodes[j]``); ``ok`` False (and no mask) when a node id is out of range."""
    m = nodes.size
    column = np.full(parents.size, -1, dtype=np.int64)
    for j in range(m):
        if nodes[j] < 0 or nodes[j] >= parents.size:
            return False, np.zeros((0, 0), dtype=np.bool_)
        column[nodes[j]] = j
    mask = np.zeros((m, prefix + m), dtype=np.bool_)
    for i in range(m):
        mask[i, :prefix] = True
        v = nodes[i]
        while v >= 0:
            if column[v] >= 0:
                mask[i, prefix + column[v]] = True
            v = parents[v]
    return True, mask


@njit(cache=True)
def add_level(expanded, edge_lp, draft_ids, target_ids, top_k, first, tokens, parents, depth, cum_logprob, path_prob,
              raw):
    """Append one drafted level in place at rows ``first ..``: ``width = draft_ids.size // expanded.size``
    children per ``expanded`` node, in the drafter's order (each node's top child first), with
    their drafter log-probabilities ``edge_lp`` given the parent and their draft-vocabulary ids
    ``draft_ids`` (``target_ids`` maps them to the target's). With ``raw`` a node's path
    probability is ``exp`` of its cumulative log-probability; otherwise the caller calibrates it.

    Returns ``(ok, frontier)``: ``ok`` False when a log-probability is NaN; ``frontier`` the
    ``top_k`` new nodes with the best cumulative log-probability (ties: the earlier node), in node
    order."""
    m = draft_ids.size
    width = m // expanded.size
    ok = True
    for i in range(m):
        v, u = first + i, expanded[i // width]
        lp = edge_lp[i]
        if math.isnan(lp):
            ok = False
        tokens[v] = target_ids[draft_ids[i]]
        parents[v] = u
        depth[v] = depth[u] + 1
        cum_logprob[v] = cum_logprob[u] + lp
        if raw:
            path_prob[v] = math.exp(cum_logprob[v])
    order = np.argsort(-cum_logprob[first:first + m], kind="mergesort")      # stable: ties keep node order
    frontier = np.sort(order[:min(top_k, m)]) + first
    return ok, frontier


@njit(cache=True)
def frontier_mask(frontier, parents, slot, committed, cache_len):
    """bool [f, cache_len + f]: the attention mask of one drafter call over the ``f`` ``frontier``
    nodes, whose entries go to the slots after ``cache_len``: row i sees the ``committed`` entries,
    its ancestors' entries (``slot`` of each non-root ancestor) and itself. Records each frontier
    node's slot in ``slot``."""
    f = frontier.size
    mask = np.zeros((f, cache_len + f), dtype=np.bool_)
    for i in range(f):
        mask[i, :committed] = True
        mask[i, cache_len + i] = True
        u = parents[frontier[i]]
        while u > 0:
            mask[i, slot[u]] = True
            u = parents[u]
    for i in range(f):
        slot[frontier[i]] = cache_len + i
    return mask
