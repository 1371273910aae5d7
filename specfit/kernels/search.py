"""The exact subtree search compiled: Dinkelbach over a maximum-weight closure with its
reductions, the greedy baseline, and the cost formula on a node set.

The algorithm, every reduction and the tie rule are described in :mod:`specfit.search`, which
validates the inputs and calls :func:`best_subtree`, :func:`greedy_subtree` and
:func:`evaluate_nodes`. Trees are arrays in topological order (``parents[v] < v``), so one sweep
over descending ids visits children before parents.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..costmodel import cycle_time_s
from .bitsets import ONE, ZERO, count_union, pack_rows, popcount, union_rows
from .closure import closure_of_weights
from .tolerances import GAIN_EPS, TIE_REL

__all__ = ["OK", "BAD_EXPERT", "ROOT_TIME", "BAD_START", "canonical_closed", "pairwise_sum", "better", "cycle_time",
           "evaluate_nodes", "best_subtree", "greedy_subtree", "any_node_may_pay"]

# status codes the Python wrappers turn into the validation errors they already word
OK, BAD_EXPERT, ROOT_TIME, BAD_START = 0, 1, 2, 3

cycle_time = njit(cache=True)(cycle_time_s)


@njit(cache=True)
def pairwise_sum(values, n):
    """Sum of ``values[:n]`` in numpy's pairwise order, so a compiled total equals the numpy one
    bit for bit (``DraftTree.expected_tokens`` sums with numpy)."""
    return _pairwise(values, 0, n)


@njit(cache=True)
def _block(a, lo, n):
    """numpy's leaf: a plain loop below 8 values, else eight interleaved partial sums."""
    if n < 8:
        res = 0.0
        for i in range(lo, lo + n):
            res += a[i]
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = 8
    while i < n - n % 8:
        r0 += a[lo + i]
        r1 += a[lo + i + 1]
        r2 += a[lo + i + 2]
        r3 += a[lo + i + 3]
        r4 += a[lo + i + 4]
        r5 += a[lo + i + 5]
        r6 += a[lo + i + 6]
        r7 += a[lo + i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


@njit(cache=True)
def _pairwise(a, lo, n):
    """numpy's recursion (halves rounded to multiples of 8, leaves of at most 128 values) with
    an explicit stack: numba's on-disk cache does not reload recursive functions safely."""
    if n <= 128:
        return _block(a, lo, n)
    frame_lo = np.empty(64, dtype=np.int64)
    frame_n = np.empty(64, dtype=np.int64)
    stage = np.zeros(64, dtype=np.int64)
    left = np.empty(64, dtype=np.float64)
    frame_lo[0], frame_n[0], stage[0] = lo, n, 0
    top = 1
    ret = 0.0
    while top:
        i = top - 1
        size = frame_n[i]
        if size <= 128:
            ret = _block(a, frame_lo[i], size)
            top -= 1
            continue
        half = size // 2
        half -= half % 8
        if stage[i] == 0:
            stage[i] = 1
            frame_lo[top], frame_n[top], stage[top] = frame_lo[i], half, 0
            top += 1
        elif stage[i] == 1:
            left[i] = ret
            stage[i] = 2
            frame_lo[top], frame_n[top], stage[top] = frame_lo[i] + half, size - half, 0
            top += 1
        else:
            ret = left[i] + ret
            top -= 1
    return ret


@njit(cache=True)
def better(a_tokens, a_priced_s, a_nodes, b_tokens, b_priced_s, b_nodes):
    """True when a beats b: a higher ratio, or (a tie within TIE_REL) the same ratio with fewer nodes."""
    lhs = a_tokens * b_priced_s
    rhs = b_tokens * a_priced_s
    if abs(lhs - rhs) > TIE_REL * max(abs(lhs), abs(rhs)):
        return lhs > rhs
    return a_nodes < b_nodes


@njit(cache=True)
def expected_tokens(probs, nodes, n_nodes, scratch):
    """1 + the path probabilities of ``nodes[1:n_nodes]`` (sorted, root first)."""
    for i in range(1, n_nodes):
        scratch[i - 1] = probs[nodes[i]]
    return 1.0 + pairwise_sum(scratch, n_nodes - 1)


@njit(cache=True)
def experts_in_range(experts, n_experts):
    n, n_layers, k = experts.shape
    for v in range(n):
        for layer in range(n_layers):
            for s in range(k):
                if experts[v, layer, s] < 0 or experts[v, layer, s] >= n_experts:
                    return False
    return True


@njit(cache=True)
def _indices(mask):
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
def union_of_ids(experts, base, nodes, n_nodes, out):
    """``out[L, words]`` = the union of the expert ids ``experts[base + v]`` over ``nodes[:n_nodes]``."""
    n_layers, k = experts.shape[1], experts.shape[2]
    for layer in range(n_layers):
        for w in range(out.shape[1]):
            out[layer, w] = ZERO
    for i in range(n_nodes):
        row = base + nodes[i]
        for layer in range(n_layers):
            for s in range(k):
                e = np.int64(experts[row, layer, s])
                out[layer, e >> 6] |= ONE << np.uint64(e & 63)


@njit(cache=True)
def evaluate_nodes(probs, experts, cached_bits, n_experts, nodes, params, draft_levels):
    """(status, expected tokens, time_s, hits, misses) of ``nodes`` (sorted, closed, with the
    root) against the resident sets ``cached_bits[L, words]``; every expert id is range-checked,
    only the selected nodes' are read for the union."""
    if not experts_in_range(experts, n_experts):
        return BAD_EXPERT, 0.0, 0.0, 0, 0
    tokens, time_s, hits, misses = _evaluate_ids(probs, experts, cached_bits, nodes, params, draft_levels)
    return OK, tokens, time_s, hits, misses


@njit(cache=True)
def _evaluate_ids(probs, experts, cached_bits, nodes, params, draft_levels):
    union = np.empty(cached_bits.shape, dtype=np.uint64)
    union_of_ids(experts, 0, nodes, nodes.size, union)
    hits, misses = count_union(union, cached_bits)
    time_s = cycle_time(params[0], params[1], params[2], params[3], params[4], draft_levels, nodes.size, hits, misses)
    scratch = np.empty(max(nodes.size, 1), dtype=np.float64)
    return expected_tokens(probs, nodes, nodes.size, scratch), time_s, hits, misses


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
def _evaluate_bits(probs, bits, cached_bits, nodes, n_nodes, params, draft_levels, union, scratch):
    union_rows(bits, nodes, n_nodes, union)
    hits, misses = count_union(union, cached_bits)
    time_s = cycle_time(params[0], params[1], params[2], params[3], params[4], draft_levels, n_nodes, hits, misses)
    return expected_tokens(probs, nodes, n_nodes, scratch), time_s, hits, misses


# --------------------------------------------------------------------------- the inner problem
@njit(cache=True)
def _inner_setup(parents, bits, cached_bits, params, draft_node_s):
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
def _members(alive, new, shared, cached_bits, params):
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
def _prune(parents, weight, alive, inside):
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
    idx = _indices(undecided)
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
def _solve(parents, probs, own_cost, member_group, member_node, group_cost, lam):
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
        _prune(parents, weight, alive, inside)
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


# --------------------------------------------------------------------------- the searches
@njit(cache=True)
def canonical_closed(parents, nodes):
    """``nodes`` are sorted unique ids of the tree, start with the root and are ancestor-closed."""
    n = parents.size
    if nodes.size == 0 or nodes[0] != 0 or nodes[nodes.size - 1] >= n:
        return False
    member = np.zeros(n, dtype=np.bool_)
    member[0] = True
    for i in range(1, nodes.size):
        v = nodes[i]
        if v <= nodes[i - 1] or not member[parents[v]]:   # parents precede children in sorted ids
            return False
        member[v] = True
    return True


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
        tokens, time_s, hits, misses = _evaluate_ids(probs, experts, cached_bits, nodes, params, draft_levels)
        if time_s <= 0:
            return ROOT_TIME, empty, 0.0, 0.0, 0, 0
        return OK, nodes, tokens, time_s, hits, misses
    bits, ok = pack_rows(experts, n_experts)
    if not ok:
        return BAD_EXPERT, empty, 0.0, 0.0, 0, 0
    union = np.empty(cached_bits.shape, dtype=np.uint64)
    scratch = np.empty(n, dtype=np.float64)
    best = np.zeros(1, dtype=np.int64)
    best_tokens, best_s, best_hits, best_misses = _evaluate_bits(probs, bits, cached_bits, best, 1, params,
                                                                 draft_levels, union, scratch)
    if best_s <= 0:
        return ROOT_TIME, empty, 0.0, 0.0, 0, 0
    if has_start:
        tokens, time_s, hits, misses = _evaluate_bits(probs, bits, cached_bits, start, start.size, params,
                                                      draft_levels, union, scratch)
        if better(tokens, time_s + draft_node_s * (start.size - 1), start.size, best_tokens, best_s, 1):
            best, best_tokens, best_s, best_hits, best_misses = start.copy(), tokens, time_s, hits, misses
    if n == 1:
        return OK, best, best_tokens, best_s, best_hits, best_misses
    own_cost, new, shared = _inner_setup(parents, bits, cached_bits, params, draft_node_s)
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
    _prune(parents, weight, alive, inside)
    for v in range(1, n):
        any_alive |= alive[v]
    if not any_alive:
        return OK, best, best_tokens, best_s, best_hits, best_misses   # the first inner problem keeps the root alone
    member_group, member_node, group_cost = _members(alive, new, shared, cached_bits, params)
    for _ in range(64):   # Dinkelbach converges superlinearly; the cap is a guard, never reached in tests
        best_priced = best_s + draft_node_s * (best.size - 1)
        lam = best_tokens / best_priced
        nodes = _indices(_solve(parents, probs, own_cost, member_group, member_node, group_cost, lam))
        tokens, time_s, hits, misses = _evaluate_bits(probs, bits, cached_bits, nodes, nodes.size, params,
                                                      draft_levels, union, scratch)
        if not better(tokens, time_s + draft_node_s * (nodes.size - 1), nodes.size, best_tokens, best_priced,
                      best.size):
            break
        best, best_tokens, best_s, best_hits, best_misses = nodes, tokens, time_s, hits, misses
    return OK, best, best_tokens, best_s, best_hits, best_misses


@njit(cache=True)
def greedy_subtree(parents, probs, experts, cached_bits, n_experts, params, draft_levels, draft_node_s):
    """Baseline: grow from the root, each step adding the frontier node (a child of the selected
    set) that gives the best ratio, while the ratio improves."""
    n = parents.size
    empty = np.zeros(0, dtype=np.int64)
    bits, ok = pack_rows(experts, n_experts)
    if not ok:
        return BAD_EXPERT, empty, 0.0, 0.0, 0, 0
    union = np.empty(cached_bits.shape, dtype=np.uint64)
    scratch = np.empty(n, dtype=np.float64)
    selected = np.zeros(n, dtype=np.bool_)
    selected[0] = True
    frontier = np.zeros(n, dtype=np.bool_)
    for v in range(1, n):
        frontier[v] = parents[v] == 0
    best = np.zeros(1, dtype=np.int64)
    best_tokens, best_s, best_hits, best_misses = _evaluate_bits(probs, bits, cached_bits, best, 1, params,
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
            tokens, time_s, hits, misses = _evaluate_bits(probs, bits, cached_bits, trial, size, params,
                                                          draft_levels, union, scratch)
            if top_v < 0 or better(tokens, time_s + draft_node_s * (size - 1), size,
                                   top_tokens, top_s + draft_node_s * (top_size - 1), top_size):
                top_v, top_tokens, top_s, top_hits, top_misses, top_size = v, tokens, time_s, hits, misses, size
        if not better(top_tokens, top_s + draft_node_s * (top_size - 1), top_size,
                      best_tokens, best_s + draft_node_s * (best.size - 1), best.size):
            break
        selected[top_v] = True
        frontier[top_v] = False
        n_frontier -= 1
        for u in range(top_v + 1, n):
            if parents[u] == top_v:
                frontier[u] = True
                n_frontier += 1
        best = _indices(selected)
        best_tokens, best_s, best_hits, best_misses = top_tokens, top_s, top_hits, top_misses
    return OK, best, best_tokens, best_s, best_hits, best_misses
