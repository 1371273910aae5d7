"""The exact subtree search compiled: Dinkelbach over the inner closure problems
(:mod:`.inner`), the root bound that skips them, and the greedy baseline.

The algorithm, every reduction and the tie rule are described in :mod:`specfit.search`, which
validates the inputs and calls :func:`best_subtree`, :func:`greedy_subtree` and (for a given set)
:func:`.evaluate.evaluate_nodes`. Trees are arrays in topological order (``parents[v] < v``), so
one sweep over descending ids visits children before parents.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .bitsets import count_union, pack_rows, popcount
from .evaluate import (BAD_EXPERT, OK, canonical_closed, cycle_time, evaluate_bits, evaluate_ids, evaluate_nodes,
                       expected_tokens, experts_in_range, union_of_ids)
from .inner import indices, members, prune, setup, solve
from .tolerances import GAIN_EPS, TIE_REL

__all__ = ["OK", "BAD_EXPERT", "ROOT_TIME", "BAD_START", "better", "any_node_may_pay", "best_subtree",
           "greedy_subtree", "evaluate_nodes", "canonical_closed", "experts_in_range", "union_of_ids"]

ROOT_TIME, BAD_START = 2, 3


@njit(cache=True)
def better(a_tokens, a_priced_s, a_nodes, b_tokens, b_priced_s, b_nodes):
    """True when a beats b: a higher ratio, or (a tie within TIE_REL) the same ratio with fewer nodes."""
    lhs = a_tokens * b_priced_s
    rhs = b_tokens * a_priced_s
    if abs(lhs - rhs) > TIE_REL * max(abs(lhs), abs(rhs)):
        return lhs > rhs
    return a_nodes < b_nodes


@njit(cache=True)
def any_node_may_pay(parents, probs, experts, cached_bits, params, draft_levels, draft_node_s):
    """A cheap test before the search proper: with lam the root's ratio (a lower bound on the
    optimum) and every expert free, does any subtree still have a positive value? If not, the
    root alone is optimal and no expert set needs to be built."""
    n = parents.size
    if n == 1:
        return False
    union = np.empty(cached_bits.shape, dtype=np.uint64)
    root = np.zeros(1, dtype=np.int64)
    union_of_ids(experts, 0, root, 1, union)
    hits, misses = count_union(union, cached_bits)
    root_s = cycle_time(params[0], params[1], params[2], params[3], params[4], draft_levels, 1, hits, misses)
    if root_s <= 0:
        return True   # let the search report the degenerate cost model
    per_node = (params[2] + draft_node_s) / root_s
    gain = np.empty(n, dtype=np.float64)
    for v in range(n):
        gain[v] = probs[v] - per_node
    for v in range(n - 1, 0, -1):
        if gain[v] > GAIN_EPS:
            if parents[v] == 0:
                return True
            gain[parents[v]] += gain[v]
    return False


@njit(cache=True)
def best_subtree(parents, probs, experts, cached_bits, n_experts, params, draft_levels, draft_node_s, start, has_start):
    """(status, nodes, expected tokens, time_s, hits, misses) of the exact optimum. ``start``, when
    given, must be sorted unique node ids with the root, ancestor-closed (else BAD_START)."""
    n = parents.size
    empty = np.zeros(0, dtype=np.int64)
    if has_start and not canonical_closed(parents, start):
        return BAD_START, empty, 0.0, 0.0, 0, 0
    if not experts_in_range(experts[:1], n_experts):
        return BAD_EXPERT, empty, 0.0, 0.0, 0, 0
    # when no draft node can pay even with every expert free, the root is the answer (a start set
    # cannot beat it: ties go to the smaller set)
    if not any_node_may_pay(parents, probs, experts, cached_bits, params, draft_levels, draft_node_s):
        if not experts_in_range(experts, n_experts):
            return BAD_EXPERT, empty, 0.0, 0.0, 0, 0
        nodes = np.zeros(1, dtype=np.int64)
        tokens, time_s, hits, misses = evaluate_ids(probs, experts, cached_bits, nodes, params, draft_levels)
        if time_s <= 0:
            return ROOT_TIME, empty, 0.0, 0.0, 0, 0
        return OK, nodes, tokens, time_s, hits, misses
    bits, ok = pack_rows(experts, n_experts)
    if not ok:
        return BAD_EXPERT, empty, 0.0, 0.0, 0, 0
    union = np.empty(cached_bits.shape, dtype=np.uint64)
    scratch = np.empty(n, dtype=np.float64)
    best = np.zeros(1, dtype=np.int64)
    best_tokens, best_s, best_hits, best_misses = evaluate_bits(probs, bits, cached_bits, best, 1, params,
                                                                 draft_levels, union, scratch)
    if best_s <= 0:
        return ROOT_TIME, empty, 0.0, 0.0, 0, 0
    if has_start:
        tokens, time_s, hits, misses = evaluate_bits(probs, bits, cached_bits, start, start.size, params,
                                                      draft_levels, union, scratch)
        if better(tokens, time_s + draft_node_s * (start.size - 1), start.size, best_tokens, best_s, 1):
            best, best_tokens, best_s, best_hits, best_misses = start.copy(), tokens, time_s, hits, misses
    if n == 1:
        return OK, best, best_tokens, best_s, best_hits, best_misses
    own_cost, new, shared = setup(parents, bits, cached_bits, params, draft_node_s)
    # lam only grows from here, and with it every node's cost: a node the first inner problem's
    # prune drops is dropped by every later one, so the shared items are listed for the rest only
    lam = best_tokens / (best_s + draft_node_s * (best.size - 1))
    alive = np.ones(n, dtype=np.bool_)
    inside = np.zeros(n, dtype=np.bool_)
    inside[0] = True
    weight = np.empty(n, dtype=np.float64)
    any_alive = False
    for v in range(n):
        weight[v] = probs[v] - lam * own_cost[v]
    weight[0] = 0.0
    prune(parents, weight, alive, inside)
    for v in range(1, n):
        any_alive |= alive[v]
    if not any_alive:
        return OK, best, best_tokens, best_s, best_hits, best_misses   # the first inner problem keeps the root alone
    member_group, member_node, group_cost = members(alive, new, shared, cached_bits, params)
    for _ in range(64):   # Dinkelbach converges superlinearly; the cap is a guard, never reached in tests
        best_priced = best_s + draft_node_s * (best.size - 1)
        lam = best_tokens / best_priced
        nodes = indices(solve(parents, probs, own_cost, member_group, member_node, group_cost, lam))
        tokens, time_s, hits, misses = evaluate_bits(probs, bits, cached_bits, nodes, nodes.size, params,
                                                      draft_levels, union, scratch)
        if not better(tokens, time_s + draft_node_s * (nodes.size - 1), nodes.size, best_tokens, best_priced,
                      best.size):
            break
        best, best_tokens, best_s, best_hits, best_misses = nodes, tokens, time_s, hits, misses
    trimmed = trim_ties(parents, probs, bits, cached_bits, params, draft_node_s, best, best_tokens, best_s)
    if trimmed.size < best.size:
        tokens, time_s, hits, misses = evaluate_bits(probs, bits, cached_bits, trimmed, trimmed.size, params,
                                                      draft_levels, union, scratch)
        if better(tokens, time_s + draft_node_s * (trimmed.size - 1), trimmed.size, best_tokens,
                  best_s + draft_node_s * (best.size - 1), best.size):
            best, best_tokens, best_s, best_hits, best_misses = trimmed, tokens, time_s, hits, misses
    return OK, best, best_tokens, best_s, best_hits, best_misses


@njit(cache=True)
def trim_ties(parents, probs, bits, cached_bits, params, draft_node_s, best, tokens, time_s):
    """``best`` without the selected leaves whose removal is a tie (or better) by :func:`better`:
    the inner problem keeps a node whose gain is a hair above zero, while ratios within
    ``TIE_REL`` are ties, which go to the smaller set. A leaf's marginal time is its per-node cost,
    its price and the experts no other selected node needs (``once & ~twice`` over the selection's
    expert sets); leaves are dropped one at a time, each set checked against ``best`` itself (ties
    are not transitive: sets that each tie the one before can drift away from the optimum)."""
    n_layers, words = cached_bits.shape
    keep = best.copy()
    n = keep.size
    once = np.empty((n_layers, words), dtype=np.uint64)
    twice = np.empty((n_layers, words), dtype=np.uint64)
    priced = time_s + draft_node_s * (n - 1)
    best_tokens, best_priced, best_n = tokens, priced, n
    while n > 1:
        once[:] = 0
        twice[:] = 0
        for i in range(n):
            v = keep[i]
            for layer in range(n_layers):
                for w in range(words):
                    twice[layer, w] |= once[layer, w] & bits[v, layer, w]
                    once[layer, w] |= bits[v, layer, w]
        dropped = -1
        for i in range(n - 1, 0, -1):
            v = keep[i]
            leaf = True
            for j in range(i + 1, n):
                if parents[keep[j]] == v:
                    leaf = False
                    break
            if not leaf:
                continue
            marginal = params[2] + draft_node_s
            for layer in range(n_layers):
                for w in range(words):
                    alone = bits[v, layer, w] & once[layer, w] & ~twice[layer, w]
                    marginal += params[3] * popcount(alone & cached_bits[layer, w])
                    marginal += params[4] * popcount(alone & ~cached_bits[layer, w])
            if better(tokens - probs[v], priced - marginal, n - 1, best_tokens, best_priced, best_n):
                dropped = i
                tokens, priced = tokens - probs[v], priced - marginal
                break
        if dropped < 0:
            break
        for i in range(dropped, n - 1):
            keep[i] = keep[i + 1]
        n -= 1
    return keep[:n].copy()


@njit(cache=True)
def greedy_subtree(parents, probs, experts, cached_bits, n_experts, params, draft_levels, draft_node_s):
    """Baseline: grow from the root, each step adding the frontier node (a child of the selected
    set) that gives the best ratio, while the ratio improves. The selected set's expert union is
    kept, so a candidate costs one OR over ``L x words`` and a pass over the node ids, not a union
    of every selected node's sets."""
    n = parents.size
    empty = np.zeros(0, dtype=np.int64)
    bits, ok = pack_rows(experts, n_experts)
    if not ok:
        return BAD_EXPERT, empty, 0.0, 0.0, 0, 0
    union = np.empty(cached_bits.shape, dtype=np.uint64)
    chosen = bits[0].copy()                  # the union of the selected nodes' sets
    scratch = np.empty(n, dtype=np.float64)
    selected = np.zeros(n, dtype=np.bool_)
    selected[0] = True
    frontier = np.zeros(n, dtype=np.bool_)
    for v in range(1, n):
        frontier[v] = parents[v] == 0
    best = np.zeros(1, dtype=np.int64)
    best_tokens, best_s, best_hits, best_misses = evaluate_bits(probs, bits, cached_bits, best, 1, params,
                                                                 draft_levels, union, scratch)
    if best_s <= 0:
        return ROOT_TIME, empty, 0.0, 0.0, 0, 0
    trial = np.empty(n, dtype=np.int64)
    n_frontier = 0
    for v in range(n):
        n_frontier += frontier[v]
    while n_frontier:
        top_v = -1
        top_tokens = top_s = 0.0
        top_hits = top_misses = top_size = 0
        for v in range(1, n):
            if not frontier[v]:
                continue
            size = 0
            for u in range(n):
                if selected[u] or u == v:
                    trial[size] = u
                    size += 1
            np.bitwise_or(chosen, bits[v], union)
            hits, misses = count_union(union, cached_bits)
            time_s = cycle_time(params[0], params[1], params[2], params[3], params[4], draft_levels, size, hits, misses)
            tokens = expected_tokens(probs, trial, size, scratch)
            if top_v < 0 or better(tokens, time_s + draft_node_s * (size - 1), size,
                                   top_tokens, top_s + draft_node_s * (top_size - 1), top_size):
                top_v, top_tokens, top_s, top_hits, top_misses, top_size = v, tokens, time_s, hits, misses, size
        if not better(top_tokens, top_s + draft_node_s * (top_size - 1), top_size,
                      best_tokens, best_s + draft_node_s * (best.size - 1), best.size):
            break
        selected[top_v] = True
        np.bitwise_or(chosen, bits[top_v], chosen)
        frontier[top_v] = False
        n_frontier -= 1
        for u in range(top_v + 1, n):
            if parents[u] == top_v:
                frontier[u] = True
                n_frontier += 1
        best = indices(selected)
        best_tokens, best_s, best_hits, best_misses = top_tokens, top_s, top_hits, top_misses
    return OK, best, best_tokens, best_s, best_hits, best_misses
