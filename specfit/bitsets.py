"""Expert sets as bitsets: ``[..., layers, words]`` uint64, bit ``e % 64`` of word ``e // 64``.

The search and the simulator take unions of a few dozen nodes' expert sets and count how many of
the union are resident; on bitsets that is an OR-reduce, an AND and a popcount over a few kB,
instead of passes over dense ``[nodes, layers * experts]`` masks.
"""

from __future__ import annotations

import numpy as np

__all__ = ["n_words", "pack_mask", "pack_experts", "popcount"]


def n_words(n_experts: int) -> int:
    return (int(n_experts) + 63) // 64


def pack_mask(mask: np.ndarray) -> np.ndarray:
    """bool ``[..., E]`` -> uint64 ``[..., words]``."""
    mask = np.asarray(mask, dtype=bool)
    words = n_words(mask.shape[-1])
    pad = words * 64 - mask.shape[-1]
    if pad:
        mask = np.concatenate([mask, np.zeros(mask.shape[:-1] + (pad,), dtype=bool)], axis=-1)
    packed = np.packbits(mask, axis=-1, bitorder="little")
    return np.ascontiguousarray(packed).view("<u8").astype(np.uint64, copy=False)


def pack_experts(experts: np.ndarray, n_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """int ``[..., k]`` expert ids -> (uint64 ``[..., words]`` sets, bool ``[..., k]`` marking
    slots that repeat an earlier slot's expert of the same set; a set holds each expert once)."""
    experts = np.asarray(experts, dtype=np.int64)
    lead, k = experts.shape[:-1], experts.shape[-1]
    rows = int(np.prod(lead))
    width = n_words(n_experts) * 64
    dense = np.zeros(rows * width, dtype=bool)
    dense[((np.arange(rows) * width)[:, None] + experts.reshape(rows, k)).ravel()] = True
    bits = np.packbits(dense.reshape(rows, width), axis=-1, bitorder="little").view("<u8")
    bits = bits.astype(np.uint64, copy=False).reshape(lead + (width // 64,))
    repeated = np.zeros(experts.shape, dtype=bool)
    if popcount(bits) != experts.size:  # some set lists an expert twice
        order = np.argsort(experts, axis=-1, kind="stable")
        srt = np.take_along_axis(experts, order, axis=-1)
        dup_sorted = np.zeros(experts.shape, dtype=bool)
        dup_sorted[..., 1:] = srt[..., 1:] == srt[..., :-1]
        np.put_along_axis(repeated, order, dup_sorted, axis=-1)
    return bits, repeated


def popcount(bits: np.ndarray) -> int:
    """Number of set bits in ``bits``."""
    return int(np.bitwise_count(bits).sum())
