"""Expert sets as bitsets: ``uint64`` words, bit ``e % 64`` of word ``e // 64`` holds expert e.

A node's experts at one layer are ``words = ceil(E / 64)`` words; the search and the replay take
unions of a few dozen nodes' sets and count how many of the union are resident, which on bitsets
is an OR, an AND and a popcount per word instead of passes over ``[layers, experts]`` masks.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import intrinsic

__all__ = ["n_words", "popcount", "lowest_bit", "pack_rows", "pack_mask", "pack_ids", "union_rows",
           "count_union", "unpack"]

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


@njit(cache=True)
def n_words(n_experts):
    return (n_experts + 63) // 64


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
    bits = np.zeros((n, n_layers, n_words(n_experts)), dtype=np.uint64)
    for v in range(n):
        for layer in range(n_layers):
            for s in range(k):
                e = np.int64(experts[v, layer, s])
                if e < 0 or e >= n_experts:
                    return bits, False
                bits[v, layer, e >> 6] |= ONE << np.uint64(e & 63)
    return bits, True


# multiplying eight 0/1 bytes (one uint64, little-endian) by this gathers their low bits into
# the top byte, byte i at bit 56 + i; every other partial product falls outside that byte
_GATHER = np.uint64(0x0102040810204080)


@njit(cache=True)
def pack_mask(mask):
    """bool ``[L, E]`` (C order) -> uint64 ``[L, words]``."""
    n_layers, n_experts = mask.shape
    out = np.zeros((n_layers, n_words(n_experts)), dtype=np.uint64)
    if n_experts % 8 == 0:
        octets = mask.reshape(-1).view(np.uint8).view(np.uint64).reshape(n_layers, n_experts // 8)
        for layer in range(n_layers):
            for i in range(n_experts // 8):
                byte = (octets[layer, i] * _GATHER) >> np.uint64(56)
                out[layer, i >> 3] |= byte << np.uint64((i & 7) * 8)
        return out
    for layer in range(n_layers):
        for e in range(n_experts):
            if mask[layer, e]:
                out[layer, e >> 6] |= ONE << np.uint64(e & 63)
    return out


@njit(cache=True)
def pack_ids(ids, words, out):
    """Set the bits of ``ids`` (one layer's expert ids) in ``out[words]``, cleared first; False
    when an id is negative or beyond the words."""
    out[:] = ZERO
    for i in range(ids.size):
        e = np.int64(ids[i])
        if e < 0 or e >= 64 * words:
            return False
        out[e >> 6] |= ONE << np.uint64(e & 63)
    return True


@njit(cache=True)
def union_rows(bits, nodes, n_nodes, out):
    """``out[L, words]`` = the OR of ``bits[v]`` over the first ``n_nodes`` of ``nodes``."""
    out[:] = ZERO
    n_layers, words = out.shape
    for i in range(n_nodes):
        v = nodes[i]
        for layer in range(n_layers):
            for w in range(words):
                out[layer, w] |= bits[v, layer, w]


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


def unpack(bits: np.ndarray, n_experts: int) -> np.ndarray:
    """uint64 ``[..., words]`` -> bool ``[..., n_experts]`` (numpy; no compilation needed)."""
    as_bytes = np.ascontiguousarray(bits, dtype="<u8").view(np.uint8)
    return np.unpackbits(as_bytes, axis=-1, count=n_experts, bitorder="little").view(bool)
