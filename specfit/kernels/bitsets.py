"""Expert sets as bitsets: ``uint64`` words, bit ``e % 64`` of word ``e // 64`` holds expert e.

A node's experts at one layer are ``words = ceil(E / 64)`` words; the search and the replay take
unions of a few dozen nodes' sets and count how many of the union are resident, which on bitsets
is an OR, an AND and a popcount per word instead of passes over ``[layers, experts]`` masks.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import intrinsic

__all__ = ["n_words", "popcount", "lowest_bit", "pack_rows", "pack_mask", "union_of_rows", "count_union",
           "count_missing", "count_missing_row", "unpack", "slots_right", "first_bad_routing", "union_sizes_by_depth",
           "shared_slots"]

ONE = np.uint64(1)
ZERO = np.uint64(0)


@intrinsic
def _ctpop(typingctx, x):
    sig = types.uint64(types.uint64)

    def codegen(context, builder, signature, args):
        return builder.ctpop(args[0])

    return sig, codegen


@intrinsic
def _cttz(typingctx, x):
    sig = types.uint64(types.uint64)

    def codegen(context, builder, signature, args):
        return builder.cttz(args[0], context.get_constant(types.boolean, True))

    return sig, codegen


def n_words(n_experts: int) -> int:
    return (int(n_experts) + 63) // 64


@njit(cache=True)
def popcount(word):
    """Set bits of one uint64 word (the CPU's popcount instruction)."""
    return np.int64(_ctpop(word))


@njit(cache=True)
def lowest_bit(word):
    """Index of the lowest set bit of a non-zero word."""
    return np.int64(_cttz(word))


@njit(cache=True)
def pack_rows(experts, n_experts):
    """int ``[n, L, k]`` expert ids -> (uint64 ``[n, L, words]`` sets, ok). A set holds each expert
    once however often its slots repeat it; ``ok`` is False when an id lies outside
    ``[0, n_experts)`` (the sets are then incomplete)."""
    n, n_layers, k = experts.shape
    bits = np.zeros((n, n_layers, (n_experts + 63) // 64), dtype=np.uint64)
    for v in range(n):
        for layer in range(n_layers):
            for s in range(k):
                e = np.int64(experts[v, layer, s])
                if e < 0 or e >= n_experts:
                    return bits, False
                bits[v, layer, e >> 6] |= ONE << np.uint64(e & 63)
    return bits, True


@njit(cache=True)
def shared_slots(experts, i, j):
    """int ``[pairs, layers]``: how many of row ``i[p]``'s top-k slots at a layer name an expert
    that row ``j[p]`` also has there (the count behind :func:`specfit.traces.stats.set_overlap`)."""
    n_layers, k = experts.shape[1], experts.shape[2]
    out = np.zeros((i.size, n_layers), dtype=np.int64)
    for p in range(i.size):
        a, b = i[p], j[p]
        for layer in range(n_layers):
            count = 0
            for s in range(k):
                e = experts[a, layer, s]
                for t in range(k):
                    if experts[b, layer, t] == e:
                        count += 1
                        break
            out[p, layer] = count
    return out


@njit(cache=True)
def union_sizes_by_depth(offsets, depth, known, experts, n_experts, max_depth):
    """float ``[max_depth + 1]``: summed over the cycles (rows ``offsets[c]:offsets[c + 1]``), the
    size of the union over all layers of the experts of the ``known`` nodes at depth <= d (0
    where a cycle has no known node that shallow). One pass over each cycle's nodes: an expert
    counts at the depth of the first node that adds it to its layer's set, so a cycle's rows must
    be in drafting order (depth never decreasing, as :mod:`specfit.traces.validate` checks)."""
    n_layers, k = experts.shape[1], experts.shape[2]
    totals = np.zeros(max_depth + 1)
    seen = np.zeros((n_layers, (n_experts + 63) // 64), dtype=np.uint64)
    first = np.zeros(max_depth + 1, dtype=np.int64)     # experts a cycle's depth d adds
    for c in range(offsets.size - 1):
        seen[:] = ZERO
        first[:] = 0
        for v in range(offsets[c], offsets[c + 1]):
            if not known[v]:
                continue
            for layer in range(n_layers):
                for s in range(k):
                    e = np.int64(experts[v, layer, s])
                    bit = ONE << np.uint64(e & 63)
                    if seen[layer, e >> 6] & bit == ZERO:
                        seen[layer, e >> 6] |= bit
                        first[depth[v]] += 1
        running = 0
        for d in range(max_depth + 1):
            running += first[d]
            totals[d] += running
    return totals


@njit(cache=True)
def union_of_rows(bits, base, nodes, n_nodes, out):
    """``out[L, words]`` = the OR of the sets ``bits[base + v]`` (``[rows, L, words]``, e.g. a
    prepared trace's per-node sets) over ``v`` in ``nodes[:n_nodes]``: a pass over ``L x words``
    words per node, which the compiler vectorises, instead of one per expert id."""
    m = out.shape[0] * out.shape[1]
    flat = out.reshape(m)
    rows = bits.reshape(bits.shape[0], m)
    for j in range(m):
        flat[j] = ZERO
    for i in range(n_nodes):
        row = rows[base + nodes[i]]
        for j in range(m):
            flat[j] |= row[j]


@njit(cache=True)
def count_missing_row(bits, row, cached):
    """How many experts of one node's sets ``bits[row]`` (``[L, words]``) are not in the resident
    sets ``cached[L, words]`` (:func:`count_missing` on the node's packed routing)."""
    missing = 0
    for layer in range(cached.shape[0]):
        for w in range(cached.shape[1]):
            missing += popcount(bits[row, layer, w] & ~cached[layer, w])
    return missing


@njit(cache=True)
def count_union(union, cached):
    """(hits, misses) of a union ``[L, words]`` against resident sets ``cached[L, words]``."""
    hits = 0
    total = 0
    n_layers, words = union.shape
    for layer in range(n_layers):
        for w in range(words):
            u = union[layer, w]
            total += popcount(u)
            hits += popcount(u & cached[layer, w])
    return hits, total - hits


@njit(cache=True)
def in_row(experts, row, layer, expert, stop):
    """Whether ``expert`` is one of the first ``stop`` slots of ``experts[row, layer]`` (a node's
    routing at one layer): the test for a slot repeated within a layer, or shared with a parent."""
    for t in range(stop):
        if experts[row, layer, t] == expert:
            return True
    return False


@njit(cache=True)
def count_missing(experts, row, cached):
    """How many distinct experts of one node's routing ``experts[row]`` (``[L, k]``) are not in
    the resident sets ``cached[L, words]``."""
    n_layers, k = experts.shape[1], experts.shape[2]
    missing = 0
    for layer in range(n_layers):
        seen = ZERO
        for s in range(k):
            e = np.int64(experts[row, layer, s])
            bit = ONE << np.uint64(e & 63)
            word = cached[layer, e >> 6]
            if e < 64:      # ids repeat rarely and only within a layer: dedupe the first word by bits
                if seen & bit:
                    continue
                seen |= bit
            elif in_row(experts, row, layer, experts[row, layer, s], s):
                continue
            if not word & bit:
                missing += 1
    return missing


@njit(cache=True)
def first_bad_routing(experts, n_experts):
    """Over the known rows of ``experts`` (``[n, L, k]``; a row is unknown where its first id is
    negative): ``(the first row with an id outside [0, n_experts), the first row that repeats an
    expert within one layer)``, -1 where there is none; the pass stops at the first row out of
    range (a repeat is then looked for only before it). A layer's ids as bits."""
    n, n_layers, k = experts.shape
    seen = np.zeros((n_experts + 63) // 64, dtype=np.uint64)
    out_of_range = repeated = -1
    for v in range(n):
        if experts[v, 0, 0] < 0:
            continue
        if n_experts <= 128:
            # a layer's ids as two words in registers: a repeat leaves fewer bits than ids
            for layer in range(n_layers):
                low = ZERO
                high = ZERO
                bad = False
                for s in range(k):
                    e = np.int64(experts[v, layer, s])
                    bad |= (e < 0) | (e >= n_experts)
                    bit = ONE << np.uint64(e & 63)
                    upper = ZERO - np.uint64((e >> 6) & 1)
                    low |= bit & ~upper
                    high |= bit & upper
                if bad:
                    out_of_range = v
                    break
                if repeated < 0 and popcount(low) + popcount(high) < k:
                    repeated = v
            if out_of_range >= 0:
                break
            continue
        for layer in range(n_layers):
            for w in range(seen.size):
                seen[w] = ZERO
            for s in range(k):
                e = np.int64(experts[v, layer, s])
                if e < 0 or e >= n_experts:
                    if out_of_range < 0:
                        out_of_range = v
                    continue
                bit = ONE << np.uint64(e & 63)
                if seen[e >> 6] & bit:
                    if repeated < 0:
                        repeated = v
                seen[e >> 6] |= bit
        if out_of_range >= 0:
            break
    return out_of_range, repeated


@njit(cache=True)
def slots_right(predicted, true):
    """How many of the predicted ``[n, L, k]`` slots name an expert that the same node routes to
    at that layer in ``true`` ``[n, L, k_true]``."""
    right = 0
    for i in range(predicted.shape[0]):
        for layer in range(predicted.shape[1]):
            for s in range(predicted.shape[2]):
                for t in range(true.shape[2]):
                    if predicted[i, layer, s] == true[i, layer, t]:
                        right += 1
                        break
    return right


def pack_mask(mask: np.ndarray) -> np.ndarray:
    """bool ``[..., E]`` -> uint64 ``[..., words]`` (numpy; the kernels take the words)."""
    packed = np.packbits(np.asarray(mask, dtype=bool), axis=-1, bitorder="little")
    words = n_words(mask.shape[-1])
    if packed.shape[-1] != 8 * words:
        pad = np.zeros(packed.shape[:-1] + (8 * words - packed.shape[-1],), dtype=np.uint8)
        packed = np.concatenate([packed, pad], axis=-1)
    return np.ascontiguousarray(packed).view("<u8").astype(np.uint64, copy=False)


def unpack(bits: np.ndarray, n_experts: int) -> np.ndarray:
    """uint64 ``[..., words]`` -> bool ``[..., n_experts]`` (numpy; no compilation needed)."""
    as_bytes = np.ascontiguousarray(bits, dtype="<u8").view(np.uint8)
    return np.unpackbits(as_bytes, axis=-1, count=n_experts, bitorder="little").view(bool)
