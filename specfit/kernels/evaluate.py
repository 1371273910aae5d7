"""The cost formula on a node set, compiled: the union of the nodes' experts against the resident
sets, the cycle time (:func:`.formula.cycle_time_s`, compiled as it is) and the expected
tokens, summed in numpy's order so that the numbers equal :class:`specfit.tree.DraftTree`'s."""

from __future__ import annotations

import numpy as np
from numba import njit

from .bitsets import ONE, ZERO, count_union, popcount, union_of_rows
from .formula import cycle_time_s

__all__ = ["OK", "BAD_EXPERT", "cycle_time", "pairwise_sum", "expected_tokens", "experts_in_range", "union_of_ids",
           "canonical_closed", "evaluate_nodes", "evaluate_ids", "evaluate_bits", "union_accounting", "count_unions",
           "TRUE_UNION", "PREDICTED_UNION", "OVERLAP", "PREDICTED_MISSES", "TRUE_MISSES"]

# status codes the Python wrappers turn into the validation errors they already word
OK, BAD_EXPERT = 0, 1

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
def union_of_ids(experts, base, nodes, n_nodes, out):
    """``out[L, words]`` = the union of the expert ids ``experts[base + v]`` over ``nodes[:n_nodes]``."""
    n_layers, k = experts.shape[1], experts.shape[2]
    words = out.shape[1]
    if words <= 2:
        # up to 128 experts: a layer's union builds up in two registers, layer by layer, instead
        # of a read-modify-write of the same word of memory per slot
        for layer in range(n_layers):
            low = ZERO
            high = ZERO
            for i in range(n_nodes):
                row = base + nodes[i]
                for s in range(k):
                    e = np.int64(experts[row, layer, s])
                    bit = ONE << np.uint64(e & 63)
                    upper = ZERO - np.uint64(e >> 6)   # all ones for ids 64..127
                    low |= bit & ~upper
                    high |= bit & upper
            out[layer, 0] = low
            if words == 2:
                out[layer, 1] = high
        return
    for layer in range(n_layers):
        for w in range(words):
            out[layer, w] = ZERO
    for i in range(n_nodes):
        row = base + nodes[i]
        for layer in range(n_layers):
            for s in range(k):
                e = np.int64(experts[row, layer, s])
                out[layer, e >> 6] |= ONE << np.uint64(e & 63)


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
def evaluate_nodes(probs, experts, cached_bits, n_experts, nodes, params, draft_levels):
    """(status, expected tokens, time_s, hits, misses) of ``nodes`` (sorted, closed, with the
    root) against the resident sets ``cached_bits[L, words]``; every expert id is range-checked,
    only the selected nodes' are read for the union."""
    if not experts_in_range(experts, n_experts):
        return BAD_EXPERT, 0.0, 0.0, 0, 0
    tokens, time_s, hits, misses = evaluate_ids(probs, experts, cached_bits, nodes, params, draft_levels)
    return OK, tokens, time_s, hits, misses


@njit(cache=True)
def evaluate_ids(probs, experts, cached_bits, nodes, params, draft_levels):
    union = np.empty(cached_bits.shape, dtype=np.uint64)
    union_of_ids(experts, 0, nodes, nodes.size, union)
    hits, misses = count_union(union, cached_bits)
    time_s = cycle_time(params[0], params[1], params[2], params[3], params[4], draft_levels, nodes.size, hits, misses)
    scratch = np.empty(max(nodes.size, 1), dtype=np.float64)
    return expected_tokens(probs, nodes, nodes.size, scratch), time_s, hits, misses


@njit(cache=True)
def evaluate_bits(probs, bits, cached_bits, nodes, n_nodes, params, draft_levels, union, scratch):
    union_of_rows(bits, 0, nodes, n_nodes, union)
    hits, misses = count_union(union, cached_bits)
    time_s = cycle_time(params[0], params[1], params[2], params[3], params[4], draft_levels, n_nodes, hits, misses)
    return expected_tokens(probs, nodes, n_nodes, scratch), time_s, hits, misses


# the rows of union_accounting's answer
TRUE_UNION, PREDICTED_UNION, OVERLAP, PREDICTED_MISSES, TRUE_MISSES = range(5)


@njit(cache=True)
def union_accounting(predicted, nodes, true, cached_bits):
    """int64 [5, L]: per layer, of a verified cycle, the sizes of the true union (``true`` [m, L, k]:
    the verified nodes' experts, in the order of ``nodes``), of the predicted one (``predicted``
    [n, L, k] rows ``nodes``), of their overlap, and the experts of each union not resident in
    ``cached_bits`` [L, words] (rows :data:`TRUE_UNION` .. :data:`TRUE_MISSES`): what a live
    cycle's row reports next to what the policy predicted, in one pass (:func:`count_unions`)."""
    n_layers, words = cached_bits.shape
    m = nodes.size
    rows = np.arange(m)
    true_bits = np.empty((n_layers, words), dtype=np.uint64)
    union_of_ids(true, 0, rows, m, true_bits)
    predicted_bits = np.empty((n_layers, words), dtype=np.uint64)
    union_of_ids(predicted, 0, nodes, m, predicted_bits)
    out = np.empty((5, n_layers), dtype=np.int64)
    count_unions(true_bits, predicted_bits, cached_bits, out)
    return out


@njit(cache=True)
def count_unions(true_bits, predicted_bits, cached_bits, out):
    """:func:`union_accounting`'s rows into ``out`` [5, L] from the unions as words (``[L, words]``
    each): the live cycle's accounting, and the replay's (:func:`specfit.kernels.replay.commit_cycle`)
    on the unions it has built."""
    n_layers, words = cached_bits.shape
    for layer in range(n_layers):
        for row in range(5):
            out[row, layer] = 0
        for w in range(words):
            t, p, c = true_bits[layer, w], predicted_bits[layer, w], cached_bits[layer, w]
            out[TRUE_UNION, layer] += popcount(t)
            out[PREDICTED_UNION, layer] += popcount(p)
            out[OVERLAP, layer] += popcount(t & p)
            out[PREDICTED_MISSES, layer] += popcount(p & ~c)
            out[TRUE_MISSES, layer] += popcount(t & ~c)
