"""The inner problem of the Dinkelbach iteration, compiled: at a ratio lam, the maximum-weight
closure ``max over closed S of sum_v (p_v - lam * own_v) - lam * (the shared items S needs)``,
with the reductions that :mod:`specfit.search` describes (prune, fold, force, a tree DP when no
shared item is left, else one min cut of the merged items).

Shared items (needed first by two or more nodes) are a membership list ``(member_group[j],
member_node[j])``; every reduction step is a pass over it.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .bitsets import ONE, popcount
from .closure import closure_of_weights
from .tolerances import GAIN_EPS

__all__ = ["indices", "setup", "members", "prune", "solve"]


@njit(cache=True)
def indices(mask):
    """The positions of the True entries (ascending), as int64."""
    n = 0
    for i in range(mask.size):
        if mask[i]:
            n += 1
    out = np.empty(n, dtype=np.int64)
    j = 0
    for i in range(mask.size):
        if mask[i]:
            out[j] = i
            j += 1
    return out


@njit(cache=True)
def setup(parents, bits, cached_bits, params, draft_node_s):
    """What the closure problems share whatever lam: each node's *new* items (its experts that no
    ancestor needs; the root's are prepaid), the items that two or more nodes need first
    (``shared``), and each node's own cost: per node, its price, and its new items that no other
    node needs first."""
    n, n_layers, words = bits.shape
    anc = bits.copy()                       # experts needed by v or an ancestor of v
    new = np.zeros_like(bits)
    once = np.zeros((n_layers, words), dtype=np.uint64)
    shared = np.zeros((n_layers, words), dtype=np.uint64)
    for v in range(1, n):
        p = parents[v]
        for layer in range(n_layers):
            for w in range(words):
                fresh = bits[v, layer, w] & ~anc[p, layer, w]
                new[v, layer, w] = fresh
                anc[v, layer, w] |= anc[p, layer, w]
                shared[layer, w] |= once[layer, w] & fresh
                once[layer, w] |= fresh
    hit_s, miss_s = params[3], params[4]
    own_cost = np.full(n, params[2] + draft_node_s)
    for v in range(1, n):
        hits = 0
        misses = 0
        for layer in range(n_layers):
            for w in range(words):
                single = new[v, layer, w] & ~shared[layer, w]
                hits += popcount(single & cached_bits[layer, w])
                misses += popcount(single & ~cached_bits[layer, w])
        own_cost[v] += hit_s * hits + miss_s * misses
    return own_cost, new, shared


@njit(cache=True)
def members(alive, new, shared, cached_bits, params):
    """The shared items as a membership list ``(member_group[j], member_node[j])`` over the nodes
    still ``alive``, groups numbered in ascending item (layer, expert) order, with their costs."""
    n, n_layers, words = new.shape
    used = np.zeros((n_layers, words), dtype=np.uint64)
    n_members = 0
    for v in range(1, n):
        if alive[v]:
            for layer in range(n_layers):
                for w in range(words):
                    mine = new[v, layer, w] & shared[layer, w]
                    used[layer, w] |= mine
                    n_members += popcount(mine)
    rank = np.empty((n_layers, words), dtype=np.int64)
    n_groups = 0
    for layer in range(n_layers):
        for w in range(words):
            rank[layer, w] = n_groups
            n_groups += popcount(used[layer, w])
    group_cost = np.empty(n_groups, dtype=np.float64)
    for layer in range(n_layers):
        for w in range(words):
            word = used[layer, w]
            g = rank[layer, w]
            while word:
                low = word & (~word + ONE)
                group_cost[g] = params[3] if cached_bits[layer, w] & low else params[4]
                word ^= low
                g += 1
    member_group = np.empty(n_members, dtype=np.int64)
    member_node = np.empty(n_members, dtype=np.int64)
    j = 0
    for v in range(1, n):
        if alive[v]:
            for layer in range(n_layers):
                for w in range(words):
                    word = new[v, layer, w] & shared[layer, w]
                    while word:
                        low = word & (~word + ONE)
                        member_group[j] = rank[layer, w] + popcount(used[layer, w] & (low - ONE))
                        member_node[j] = v
                        word ^= low
                        j += 1
    return member_group, member_node, group_cost


@njit(cache=True)
def prune(parents, weight, alive, inside):
    """Drop subtrees whose optimistic value (shared items free) is not positive."""
    n = parents.size
    ub = weight.copy()
    for v in range(n - 1, 0, -1):
        if alive[v]:
            if inside[v] or ub[v] > GAIN_EPS:
                ub[parents[v]] += ub[v]
            else:
                alive[v] = False
    for v in range(1, n):
        alive[v] = alive[v] and alive[parents[v]]


@njit(cache=True)
def _force(parents, candidate, inside):
    """Take every candidate whose parent is inside, top-down; True if any was taken."""
    taken = False
    for v in range(1, parents.size):
        if not inside[v] and candidate[v] and inside[parents[v]]:
            inside[v] = True
            taken = True
    return taken


@njit(cache=True)
def _tree_dp(parents, weight, undecided, inside):
    """No shared items left: the best forest hanging from the inside nodes, exactly."""
    n = parents.size
    gain = np.empty(n, dtype=np.float64)
    for v in range(n):
        gain[v] = weight[v] if undecided[v] else 0.0
    for v in range(n - 1, 0, -1):
        if undecided[v] and gain[v] > GAIN_EPS and undecided[parents[v]]:
            gain[parents[v]] += gain[v]
    take = inside.copy()
    for v in range(1, n):
        if undecided[v]:
            take[v] = take[parents[v]] and gain[v] > GAIN_EPS
    return take


@njit(cache=True)
def _closure(parents, weight, undecided, inside, gcost, member_group, member_node, coupled):
    """Shared items still couple undecided nodes: one max-weight closure by min cut, with the
    items that have the same requirers merged into one."""
    n = parents.size
    pos = np.full(n, -1, dtype=np.int64)
    idx = indices(undecided)
    m = idx.size
    for i in range(m):
        pos[idx[i]] = i
    # the coupled groups in order of first appearance, each with its member positions (a node
    # holds an item once, and members come in ascending node order: each list is sorted)
    n_groups = gcost.size
    order_of = np.full(n_groups, -1, dtype=np.int64)
    groups = np.empty(n_groups, dtype=np.int64)
    size = np.zeros(n_groups, dtype=np.int64)
    n_coupled = 0
    for j in range(member_group.size):
        if coupled[j]:
            g = member_group[j]
            if order_of[g] < 0:
                order_of[g] = n_coupled
                groups[n_coupled] = g
                n_coupled += 1
            size[order_of[g]] += 1
    offset = np.zeros(n_coupled + 1, dtype=np.int64)
    for i in range(n_coupled):
        offset[i + 1] = offset[i] + size[i]
    members = np.empty(offset[n_coupled], dtype=np.int64)
    fill = offset[:-1].copy()
    for j in range(member_group.size):
        if coupled[j]:
            o = order_of[member_group[j]]
            members[fill[o]] = pos[member_node[j]]
            fill[o] += 1
    # merge groups with identical member lists (open addressing on a hash of the list)
    slots = 1
    while slots < 2 * n_coupled + 2:
        slots *= 2
    table = np.full(slots, -1, dtype=np.int64)       # -> merged item
    rep = np.empty(n_coupled, dtype=np.int64)         # merged item -> its first group (order index)
    merged_cost = np.zeros(n_coupled, dtype=np.float64)
    n_merged = 0
    for i in range(n_coupled):
        h = np.uint64(1469598103934665603)
        for x in range(offset[i], offset[i + 1]):
            h = (h ^ np.uint64(members[x])) * np.uint64(1099511628211)
        at = np.int64(h & np.uint64(slots - 1))
        while True:
            mi = table[at]
            if mi < 0:
                table[at] = n_merged
                rep[n_merged] = i
                merged_cost[n_merged] = gcost[groups[i]]
                n_merged += 1
                break
            r = rep[mi]
            same = offset[r + 1] - offset[r] == offset[i + 1] - offset[i]
            if same:
                for x in range(offset[i + 1] - offset[i]):
                    if members[offset[r] + x] != members[offset[i] + x]:
                        same = False
                        break
            if same:
                merged_cost[mi] += gcost[groups[i]]
                break
            at = (at + 1) & (slots - 1)
    node_w = np.empty(m + n_merged, dtype=np.float64)
    for i in range(m):
        node_w[i] = weight[idx[i]]
    for j in range(n_merged):
        node_w[m + j] = -merged_cost[j]
    n_req = 0
    for i in range(m):
        if undecided[parents[idx[i]]]:
            n_req += 1
    for j in range(n_merged):
        n_req += offset[rep[j] + 1] - offset[rep[j]]
    req_from = np.empty(n_req, dtype=np.int64)
    req_to = np.empty(n_req, dtype=np.int64)
    r = 0
    for i in range(m):
        v = idx[i]
        if undecided[parents[v]]:
            req_from[r], req_to[r] = i, pos[parents[v]]
            r += 1
    for j in range(n_merged):
        for x in range(offset[rep[j]], offset[rep[j] + 1]):
            req_from[r], req_to[r] = members[x], m + j
            r += 1
    chosen = closure_of_weights(node_w, req_from, req_to, GAIN_EPS)
    take = inside.copy()
    for i in range(m):
        if chosen[i]:
            take[idx[i]] = True
    return take


@njit(cache=True)
def solve(parents, probs, own_cost, member_group, member_node, group_cost, lam):
    """max over closed S of sum_v (p_v - lam * own_v) - lam * (the shared items S needs)."""
    n = parents.size
    n_groups = group_cost.size
    weight = np.empty(n, dtype=np.float64)
    for v in range(n):
        weight[v] = probs[v] - lam * own_cost[v]
    weight[0] = 0.0
    gcost = np.empty(n_groups, dtype=np.float64)
    for g in range(n_groups):
        gcost[g] = lam * group_cost[g]
    mg, mv = member_group, member_node
    alive = np.ones(n, dtype=np.bool_)
    inside = np.zeros(n, dtype=np.bool_)
    inside[0] = True
    live = np.ones(n_groups, dtype=np.bool_)      # groups not yet paid, folded or dropped
    n_alive = np.zeros(n_groups, dtype=np.int64)
    paid = np.zeros(n_groups, dtype=np.bool_)
    pess = np.empty(n, dtype=np.float64)
    candidate = np.empty(n, dtype=np.bool_)
    for _ in range(n + 1):
        prune(parents, weight, alive, inside)
        if n_groups == 0:
            break
        changed = False
        # groups paid by a node inside, or with no live requirer, are gone
        for g in range(n_groups):
            n_alive[g] = 0
            paid[g] = False
        for j in range(mg.size):
            if inside[mv[j]]:
                paid[mg[j]] = True
            if alive[mv[j]]:
                n_alive[mg[j]] += 1
        any_single = False
        for g in range(n_groups):
            live[g] = live[g] and not paid[g] and n_alive[g] > 0
            if live[g] and n_alive[g] == 1:
                any_single = True
        # a group with one live requirer is that node's own cost
        if any_single:
            for j in range(mg.size):
                g = mg[j]
                if live[g] and n_alive[g] == 1 and alive[mv[j]]:
                    weight[mv[j]] -= gcost[g]
            for g in range(n_groups):
                if live[g] and n_alive[g] == 1:
                    live[g] = False
            changed = True
        # force: a child of an inside node whose value stays positive when it pays every live
        # shared item alone is in every maximiser. Forcing one node only pays items for the
        # others, so values computed before the pass stay valid through it.
        for v in range(n):
            pess[v] = 0.0
        for j in range(mg.size):
            if live[mg[j]]:
                pess[mv[j]] += gcost[mg[j]]
        any_candidate = False
        for v in range(n):
            pess[v] = weight[v] - pess[v]
            candidate[v] = alive[v] and not inside[v] and pess[v] > GAIN_EPS
            any_candidate |= candidate[v]
        if any_candidate:
            changed |= _force(parents, candidate, inside)
        if not changed:
            break
    undecided = np.empty(n, dtype=np.bool_)
    for v in range(n):
        undecided[v] = alive[v] and not inside[v]
    coupled = np.zeros(mg.size, dtype=np.bool_)
    any_coupled = False
    for j in range(mg.size):
        coupled[j] = live[mg[j]] and undecided[mv[j]]
        any_coupled |= coupled[j]
    if not any_coupled:
        return _tree_dp(parents, weight, undecided, inside)
    return _closure(parents, weight, undecided, inside, gcost, mg, mv, coupled)
