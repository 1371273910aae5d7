"""The expert cache's admit and eviction, compiled; the rules are those of
:mod:`specfit.experts.cache`, which owns the state and calls these.

State (arrays the kernels update in place):

- ``bits`` uint64 ``[L, words]``: resident experts per layer;
- ``score`` / ``count`` int64 ``[L, E]``: eviction key (smallest goes first) and touches (lfu:
  uses since admission; moe-infinity: fetches since the request's decoding began, kept across
  evictions);
- ``slots`` int64 ``[rows, C]``: what each slot holds, -1 when free; per-layer mode one row per
  layer holding expert ids, global mode one row holding items ``layer * E + expert``; victims are
  looked for among a layer's (or the cache's) C slots, never over ``[L, E]``;
- ``n_used`` int64 ``[rows]``: occupied slots per row;
- ``clock`` int64 ``[1]``: advanced once per admit call;
- ``counters`` int64 ``[4, L]``: running hits, misses, evictions, streamed per layer;
- ``config`` int64 ``[5]``: global mode (0/1), eviction policy (:data:`LRU`, :data:`LFU`,
  :data:`FIFO`, :data:`REQUEST_LFU`), E, C, and the request's phase (:data:`PROMPT` from
  :func:`begin_prompt`, :data:`DECODING` from :func:`begin_decode` and at the start): under
  :data:`REQUEST_LFU` a prompt pass evicts nothing, its misses taking only free slots and the rest
  streamed (MoE-Infinity's dispatcher runs a prompt pass's miss in one extra slot and sends it
  back, "such that cache is not polluted").

Every admit also takes ``keep``, float64 ``[L, E]`` look-ahead priorities (the rules of
:mod:`specfit.experts.cache`: victims by ascending ``(keep, score)``, the misses that find a slot
by descending ``keep``), or an empty ``[0, 0]`` array for the plain policy (:data:`NO_KEEP`).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .bitsets import ONE, ZERO, lowest_bit, popcount

__all__ = ["LRU", "LFU", "FIFO", "REQUEST_LFU", "PROMPT", "DECODING", "NO_KEEP", "begin_prompt", "begin_decode", "admit_rows", "admit_union",
           "admit_layer_ids", "admit_cycle", "worth_a_slot", "prefetch_items"]

LRU, LFU, FIFO, REQUEST_LFU = 0, 1, 2, 3
HITS, MISSES, EVICTIONS, STREAMED = 0, 1, 2, 3
PROMPT, DECODING = 0, 1         # config[4]: the request's phase
# lfu orders by touch count first, recency (the touch key modulo SPAN) second; REQUEST_LFU
# (moe-infinity) by touch count first, the item ``layer * E + expert`` second
SPAN = np.int64(1) << np.int64(40)
# the count a score holds at most (count x SPAN stays below 2^62): an expert used or fetched more
# often ties with the others there, and recency (lfu) or the item (moe-infinity) decides; without
# the cap a long run's count overflowed into a negative score, the hottest expert going first
COUNT_CAP = (np.int64(1) << np.int64(22)) - np.int64(1)
NO_KEEP = np.zeros((0, 0), dtype=np.float64)    # ``keep`` when the cache's own policy decides alone


@njit(cache=True)
def _request_score(count, layer, e, n_experts):
    """:data:`REQUEST_LFU`'s eviction key: the count first (at most :data:`COUNT_CAP`), the item
    ``layer * E + e`` second."""
    return min(count, COUNT_CAP) * SPAN + layer * n_experts + e


@njit(cache=True)
def _touch(score, count, layer, e, key, admitted, policy, n_experts):
    if policy == REQUEST_LFU:
        # MoE-Infinity's count: the expert's fetches from the host since the request's decoding
        # began, kept across evictions; a hit runs without being counted
        if admitted:
            count[layer, e] += 1
            score[layer, e] = _request_score(count[layer, e], layer, e, n_experts)
        return
    if admitted:
        count[layer, e] = 0
    count[layer, e] += 1
    if policy == LRU:
        score[layer, e] = key
    elif policy == FIFO:
        if admitted:
            score[layer, e] = key
    else:
        score[layer, e] = min(count[layer, e], COUNT_CAP) * SPAN + key % SPAN


@njit(cache=True)
def begin_prompt(config):
    """A request's prompt passes begin: under :data:`REQUEST_LFU` they evict nothing (the module
    docstring) until :func:`begin_decode`; the other policies admit as always."""
    config[4] = PROMPT


@njit(cache=True)
def begin_decode(score, count, config):
    """A request's decoding begins: :data:`REQUEST_LFU` forgets every count (MoE-Infinity clears
    them when a request's first token is out) and evicts again; the other policies keep their
    state."""
    config[4] = DECODING
    if config[1] != REQUEST_LFU:
        return
    n_layers, n_experts = count.shape
    for layer in range(n_layers):
        for e in range(n_experts):
            count[layer, e] = 0
            score[layer, e] = _request_score(0, layer, e, n_experts)


@njit(cache=True)
def _protected(e, n_experts, union, layer):
    """A held item ``e`` slots past the layer's first (its expert id when ``0 <= e < E``) is in the
    layer's union, which no eviction of the layer may take."""
    return 0 <= e < n_experts and (union[layer, e >> 6] >> np.uint64(e & 63)) & ONE != 0


@njit(cache=True)
def _lowest_first(slots, row, flat_score, to_flat, first, n_experts, union, layer, cand_score, cand_slot, n_evict):
    """The plain eviction's victims: the ``n_evict`` slots of ``slots[row]`` whose items, outside
    the layer's union, have the lowest scores (unique, so the set is exact), into the front of
    ``cand_score`` / ``cand_slot``, in one pass over the slots that keeps the lowest so far sorted
    there. A held item's score is read flat (``flat_score[held + to_flat]``) and its layer told by
    its range (``first`` is the layer's first item in a slot): no division per slot, whose cost a
    global cache (every layer's slots) pays per layer; an item scoring above the kept ones is
    passed before its union bit is read."""
    m = 0
    for s in range(slots.shape[1]):
        held = slots[row, s]
        if held < 0:
            continue
        key = flat_score[held + to_flat]
        if m == n_evict and key >= cand_score[m - 1]:
            continue
        if _protected(held - first, n_experts, union, layer):
            continue
        if m == n_evict:
            m -= 1       # the largest kept so far leaves
        j = m
        while j > 0 and cand_score[j - 1] > key:
            cand_score[j] = cand_score[j - 1]
            cand_slot[j] = cand_slot[j - 1]
            j -= 1
        cand_score[j] = key
        cand_slot[j] = s
        m += 1


@njit(cache=True)
def _lowest_keep_first(slots, row, flat_score, flat_keep, to_flat, first, n_experts, union, layer, cand_score,
                       cand_slot, n_evict):
    """The look-ahead eviction's victims: the ``n_evict`` slots of ``slots[row]`` whose items,
    outside the layer's union, are the lowest by (keep, score) (scores are unique, so the order
    is total and the set exact), into the front of ``cand_score`` / ``cand_slot``, in one pass
    over the slots as :func:`_lowest_first` does (C x ``n_evict`` steps; a global cache's C is
    every layer's slots), keeps and scores read flat; the kept ones' keeps are looked up, not
    copied (nothing in the admit allocates)."""
    m = 0
    for s in range(slots.shape[1]):
        held = slots[row, s]
        if held < 0:
            continue
        score, key = flat_score[held + to_flat], flat_keep[held + to_flat]
        if m == n_evict:
            last = flat_keep[slots[row, cand_slot[m - 1]] + to_flat]
            if not (key < last or (key == last and score < cand_score[m - 1])):
                continue
        if _protected(held - first, n_experts, union, layer):
            continue
        if m == n_evict:
            m -= 1       # the largest kept so far leaves
        j = m
        while j > 0:
            other = flat_keep[slots[row, cand_slot[j - 1]] + to_flat]
            if not (other > key or (other == key and cand_score[j - 1] > score)):
                break
            cand_score[j], cand_slot[j] = cand_score[j - 1], cand_slot[j - 1]
            j -= 1
        cand_score[j], cand_slot[j] = score, s
        m += 1


@njit(cache=True)
def _most_kept(keep, layer, union, bits, n_admit, take):
    """The ``n_admit`` misses of ``union[layer]`` with the highest ``keep`` (ties: ascending id),
    as words in ``take[layer]``: the best remaining miss ``n_admit`` times (a layer has few
    misses)."""
    words = union.shape[1]
    for w in range(words):
        take[layer, w] = ZERO
    for _ in range(n_admit):
        best = -1
        best_keep = 0.0
        for w in range(words):
            word = union[layer, w] & ~bits[layer, w] & ~take[layer, w]
            while word:
                e = w * 64 + lowest_bit(word)
                word &= word - ONE
                if best < 0 or keep[layer, e] > best_keep:
                    best, best_keep = e, keep[layer, e]
        take[layer, best >> 6] |= ONE << np.uint64(best & 63)


@njit(cache=True)
def admit_rows(lo, hi, union, bits, score, count, slots, n_used, clock, counters, config, keep, admitted, evicted,
               cand_score, cand_slot):
    """Make layers ``lo .. hi - 1`` of ``union`` (``[L, words]``) resident as far as capacity
    allows, layer ``lo`` first.

    Writes each layer's admitted experts into ``admitted[layer]`` and the evicted items
    (``layer * E + expert``) into ``evicted`` (room for ``(hi - lo) x C``); returns the ``(hits,
    misses, admitted, evicted)`` counts over the layers. ``cand_score`` / ``cand_slot`` are
    scratch of C entries. The caller advances ``clock`` once per admit call. (The layers are a
    loop here rather than a call each: numba counts references to a call's array arguments, which
    costs more than a layer's admit.)
    """
    global_mode, policy, n_experts, capacity = config[0] != 0, config[1], config[2], config[3]
    n_layers, words = bits.shape
    flat_score = score.reshape(-1)       # a view: ``score`` is C-contiguous [L, E]
    flat_keep = np.ascontiguousarray(keep).reshape(-1)     # read only here: a copy would do too
    total_hit = total_miss = total_admit = n_evicted = 0
    for layer in range(lo, hi):
        n_hit = 0
        n_miss = 0
        for w in range(words):
            n_hit += popcount(union[layer, w] & bits[layer, w])
            n_miss += popcount(union[layer, w] & ~bits[layer, w])
        row = 0 if global_mode else layer
        free = capacity - n_used[row]
        if global_mode:
            # every resident expert outside this layer's union may go
            n_admit = min(n_miss, free + n_used[row] - n_hit)
        else:
            n_admit = min(n_miss, capacity - n_hit)
        if policy == REQUEST_LFU and config[4] == PROMPT:
            n_admit = min(n_admit, free)        # a prompt pass evicts nothing
        n_evict = max(0, n_admit - free)
        if n_evict > 0:
            # the victims: the lowest scores, or with look-ahead the lowest (keep, score); a held
            # item's score is read flat (its index ``layer * E + expert``) and its layer told by
            # its range, without a division per slot
            first = layer * n_experts if global_mode else 0        # this layer's first item in a slot
            to_flat = 0 if global_mode else layer * n_experts      # a slot's item -> flat index
            if keep.shape[0] == 0:
                _lowest_first(slots, row, flat_score, to_flat, first, n_experts, union, layer, cand_score, cand_slot,
                              n_evict)
            else:
                _lowest_keep_first(slots, row, flat_score, flat_keep, to_flat, first, n_experts, union, layer,
                                   cand_score, cand_slot, n_evict)
        # the victims' order does not matter: the freed slots are refilled in slot order
        for i in range(n_evict):
            s = cand_slot[i]
            held = slots[row, s]
            owner, e = (held // n_experts, held % n_experts) if global_mode else (layer, held)
            bits[owner, e >> 6] &= ~(ONE << np.uint64(e & 63))
            slots[row, s] = -1
            counters[EVICTIONS, owner] += 1
            evicted[n_evicted + i] = owner * n_experts + e
        n_used[row] -= n_evict
        # misses in ascending id take the free slots in slot order; the rest are streamed
        layer_term = layer if global_mode else 0
        base = clock[0] * (n_layers + 1) + layer_term
        hit_key = (base * 2) * n_experts
        miss_key = (base * 2 + 1) * n_experts
        placed = 0
        next_slot = 0
        # with look-ahead, the misses that stay when not all fit are those it values most (written
        # into ``admitted[layer]``, which each word reads before it clears it)
        limited = keep.shape[0] > 0 and n_admit < n_miss
        if limited:
            _most_kept(keep, layer, union, bits, n_admit, admitted)
        for w in range(words):
            miss_word = union[layer, w] & ~bits[layer, w]
            if limited:
                miss_word &= admitted[layer, w]
            admitted[layer, w] = ZERO
            hit_word = union[layer, w] & bits[layer, w]
            while hit_word:
                e = w * 64 + lowest_bit(hit_word)
                hit_word &= hit_word - ONE
                _touch(score, count, layer, e, hit_key + e, False, policy, n_experts)
            while miss_word and placed < n_admit:
                e = w * 64 + lowest_bit(miss_word)
                miss_word &= miss_word - ONE
                while slots[row, next_slot] >= 0:
                    next_slot += 1
                slots[row, next_slot] = layer * n_experts + e if global_mode else e
                admitted[layer, w] |= ONE << np.uint64(e & 63)
                _touch(score, count, layer, e, miss_key + e, True, policy, n_experts)
                placed += 1
            bits[layer, w] |= admitted[layer, w]
            if policy == REQUEST_LFU:
                # a streamed miss is fetched too (MoE-Infinity counts every expert its fetch thread loads)
                streamed_word = union[layer, w] & ~bits[layer, w]
                while streamed_word:
                    e = w * 64 + lowest_bit(streamed_word)
                    streamed_word &= streamed_word - ONE
                    _touch(score, count, layer, e, 0, True, policy, n_experts)
        n_used[row] += n_admit
        counters[HITS, layer] += n_hit
        counters[MISSES, layer] += n_miss
        counters[STREAMED, layer] += n_miss - n_admit
        total_hit += n_hit
        total_miss += n_miss
        total_admit += n_admit
        n_evicted += n_evict
    return total_hit, total_miss, total_admit, n_evicted


@njit(cache=True)
def admit_union(union, bits, score, count, slots, n_used, clock, counters, config, keep, out_counts, hit_bits,
                admitted_bits, evicted_bits, streamed_bits, before_bits):
    """``admit`` of a whole cycle's union ``[L, words]``, layer 0 first, with per-layer counts
    (``out_counts[4, L]``), the hit / admitted / evicted / streamed sets as words, and each layer's
    residency as its admission began (``before_bits``: after the earlier layers', which in global
    mode may have evicted its experts)."""
    n_layers, words = bits.shape
    n_experts = config[2]
    clock[0] += 1
    evicted = np.empty(max(config[3], 1), dtype=np.int64)
    cand_score = np.empty(max(config[3], 1), dtype=np.int64)
    cand_slot = np.empty(max(config[3], 1), dtype=np.int64)
    for i in range(4):
        for layer in range(n_layers):
            out_counts[i, layer] = 0
    for layer in range(n_layers):
        for w in range(words):
            evicted_bits[layer, w] = ZERO
    for layer in range(n_layers):
        before = before_bits[layer]
        for w in range(words):
            before[w] = bits[layer, w]
        n_hit, n_miss, n_admit, n_evict = admit_rows(layer, layer + 1, union, bits, score, count, slots, n_used, clock,
                                                     counters, config, keep, admitted_bits, evicted, cand_score,
                                                     cand_slot)
        for i in range(n_evict):
            owner, e = evicted[i] // n_experts, evicted[i] % n_experts
            evicted_bits[owner, e >> 6] |= ONE << np.uint64(e & 63)
            out_counts[EVICTIONS, owner] += 1
        for w in range(words):
            hit_bits[layer, w] = union[layer, w] & before[w]
            streamed_bits[layer, w] = union[layer, w] & ~before[w] & ~admitted_bits[layer, w]
        out_counts[HITS, layer] = n_hit
        out_counts[MISSES, layer] = n_miss
        out_counts[STREAMED, layer] = n_miss - n_admit


@njit(cache=True)
def _ids_of(words, out):
    n = 0
    for w in range(words.size):
        word = words[w]
        while word:
            out[n] = w * 64 + lowest_bit(word)
            word &= word - ONE
            n += 1
    return out[:n].copy()


@njit(cache=True)
def admit_layer_ids(layer, ids, bits, score, count, slots, n_used, clock, counters, config, keep):
    """``admit_layer``: one layer's union as expert ids. Returns ``(ok, hit_ids, admitted_ids,
    streamed_ids, evicted items ascending)``; ``ok`` is False (and nothing changes) when an id
    lies outside ``[0, E)``."""
    words = bits.shape[1]
    n_experts = config[2]
    empty = np.zeros(0, dtype=np.int64)
    union = np.zeros(bits.shape, dtype=np.uint64)
    for i in range(ids.size):
        e = np.int64(ids[i])
        if e < 0 or e >= n_experts:
            return False, empty, empty, empty, empty
        union[layer, e >> 6] |= ONE << np.uint64(e & 63)
    clock[0] += 1
    before = bits[layer].copy()
    admitted = np.empty(bits.shape, dtype=np.uint64)
    evicted = np.empty(max(config[3], 1), dtype=np.int64)
    cand_score = np.empty(max(config[3], 1), dtype=np.int64)
    cand_slot = np.empty(max(config[3], 1), dtype=np.int64)
    _, _, _, n_evict = admit_rows(layer, layer + 1, union, bits, score, count, slots, n_used, clock, counters, config,
                                  keep, admitted, evicted, cand_score, cand_slot)
    scratch = np.empty(words * 64, dtype=np.int64)
    hits = np.empty(words, dtype=np.uint64)
    streamed = np.empty(words, dtype=np.uint64)
    for w in range(words):
        hits[w] = union[layer, w] & before[w]
        streamed[w] = union[layer, w] & ~before[w] & ~admitted[layer, w]
    return True, _ids_of(hits, scratch), _ids_of(admitted[layer], scratch), _ids_of(streamed, scratch), \
        np.sort(evicted[:n_evict])


@njit(cache=True)
def admit_cycle(union, bits, score, count, slots, n_used, clock, counters, config, keep, admitted, evicted, cand_score,
                cand_slot):
    """The replay's admit: a cycle's union ``[L, words]``; returns the (hits, misses) totals.
    ``admitted`` (``[L, words]``), ``evicted`` (L x C entries), ``cand_score`` and ``cand_slot`` (C
    entries) are scratch."""
    clock[0] += 1
    hits, misses, _, _ = admit_rows(0, bits.shape[0], union, bits, score, count, slots, n_used, clock, counters, config,
                                    keep, admitted, evicted, cand_score, cand_slot)
    return hits, misses


@njit(cache=True)
def worth_a_slot(want, mask, resident, keep, capacity, per_layer):
    """bool ``[L, E]``: the ``want``ed experts (not resident) whose ``keep`` beats the keep of the
    slot each would take in a prefetch: per layer (``per_layer``) or over the whole cache, the
    most valuable wanted expert first takes a free slot, and beyond the free slots the i-th most
    valuable takes the i-th cheapest victim (resident and outside ``mask``) if it outranks it.
    Ties of keep keep the (layer, expert) order."""
    n_layers, n_experts = want.shape
    out = np.zeros(n_layers * n_experts, dtype=np.bool_)
    w, m, res, k = want.ravel(), mask.ravel(), resident.ravel(), keep.ravel()
    width = n_experts if per_layer else n_layers * n_experts
    for lo in range(0, n_layers * n_experts, width):
        used = 0
        n_cand = 0
        n_victims = 0
        for i in range(lo, lo + width):
            used += res[i]
            n_cand += w[i]
            n_victims += res[i] and not m[i]
        if n_cand == 0:
            continue
        cand = np.empty(n_cand, dtype=np.int64)
        victims = np.empty(n_victims, dtype=np.float64)
        a = b = 0
        for i in range(lo, lo + width):
            if w[i]:
                cand[a] = i
                a += 1
            if res[i] and not m[i]:
                victims[b] = k[i]
                b += 1
        neg = np.empty(n_cand, dtype=np.float64)
        for j in range(n_cand):
            neg[j] = -k[cand[j]]
        order = np.argsort(neg, kind="mergesort")          # most valuable first, stable
        victims = np.sort(victims)                          # cheapest slot first
        free = capacity - used
        n = min(n_cand, free + n_victims)
        for j in range(n):
            c = cand[order[j]]
            if j < free or k[c] > victims[j - free]:
                out[c] = True
    return out.reshape((n_layers, n_experts))


@njit(cache=True)
def prefetch_items(mask, bits, score, count, slots, n_used, clock, counters, config, keep, out_counts, admitted_bits,
                   evicted_bits):
    """``ExpertCache.prefetch``: copy the experts of ``mask`` (bool ``[L, E]``) that are not
    resident, as far as slots allow and (with ``keep``) only those that outrank the slot each
    would take (:func:`worth_a_slot`); the resident ones in ``mask`` count as touched. No hit,
    miss or stream is counted. Writes the admit's per-layer counts (``out_counts[4, L]``) and the
    admitted and evicted experts as words; returns the number of experts copied."""
    n_layers, n_experts = mask.shape
    words = bits.shape[1]
    if config[3] == 0:
        return 0
    resident = np.zeros((n_layers, n_experts), dtype=np.bool_)
    want = np.zeros((n_layers, n_experts), dtype=np.bool_)
    for layer in range(n_layers):
        for e in range(n_experts):
            resident[layer, e] = (bits[layer, e >> 6] >> np.uint64(e & 63)) & ONE
            want[layer, e] = mask[layer, e] and not resident[layer, e]
    # an expert only displaces experts it outranks (with ``keep``: the cheapest victim set is the
    # lowest keeps; without, any expert outside the mask), and no more of them than the slots free and
    # held outside the mask
    worth = worth_a_slot(want, mask, resident, keep if keep.shape[0] > 0 else want.astype(np.float64), config[3],
                         config[0] == 0)
    for layer in range(n_layers):
        for e in range(n_experts):
            want[layer, e] = want[layer, e] and worth[layer, e]
    union = np.zeros((n_layers, words), dtype=np.uint64)
    # every expert of the mask (resident, or admitted by this call) is the last victim of the others'
    # admission: the admit protects only the layer it admits, and in global mode a later layer's slot
    # is taken from any layer, an expert admitted a layer earlier included
    victim_keep = np.zeros((n_layers, n_experts)) if keep.shape[0] == 0 else keep.copy()
    for layer in range(n_layers):
        for e in range(n_experts):
            if want[layer, e] or (mask[layer, e] and resident[layer, e]):
                union[layer, e >> 6] |= ONE << np.uint64(e & 63)
            if mask[layer, e]:
                victim_keep[layer, e] = np.inf
    kept = np.empty((3, n_layers), dtype=np.int64)
    for layer in range(n_layers):
        kept[0, layer], kept[1, layer], kept[2, layer] = counters[HITS, layer], counters[MISSES, layer], \
            counters[STREAMED, layer]
    scratch = np.empty((3, n_layers, words), dtype=np.uint64)
    uses = count.copy() if config[1] == REQUEST_LFU else count[:0]
    admit_union(union, bits, score, count, slots, n_used, clock, counters, config, victim_keep, out_counts, scratch[0],
                admitted_bits, evicted_bits, scratch[1], scratch[2])
    if config[1] == REQUEST_LFU:
        # a lever's copy is not counted: the counts (and so the order of victims) stay the demand
        # fetches
        for layer in range(n_layers):
            for e in range(n_experts):
                count[layer, e] = uses[layer, e]
                score[layer, e] = _request_score(uses[layer, e], layer, e, n_experts)
    for layer in range(n_layers):
        counters[HITS, layer], counters[MISSES, layer], counters[STREAMED, layer] = kept[0, layer], kept[1, layer], \
            kept[2, layer]
    copied = 0
    for layer in range(n_layers):
        for w in range(words):
            copied += popcount(admitted_bits[layer, w])
    return copied
