"""The replay's levers compiled: the draft's look-ahead ``keep`` priorities, the prefetch into a
drafted level's link time, and the advisor's record of each expert's recent use. The rules are
those of :class:`specfit.experts.lookahead.DraftLookahead` (whose ``keep`` is
:func:`keep_priorities`), :class:`specfit.experts.prefetch.DraftPrefetch` and
:meth:`specfit.experts.cache.ExpertCache.prefetch`, which the live decoder and the replay's Python
loop call; the compiled replay (:mod:`.replay`) calls these on the same arrays instead, and a test
checks the two loops give the same columns, cache state and advisor state.

State (arrays the replay passes, built by :func:`specfit.simulate.replay.lever_state`):

* ``lconf`` int64: :data:`ADVISOR` (a cache advisor is on), :data:`USE_DRAFT` (its keep reads the
  draft), :data:`PREFETCH` (a prefetcher is on), :data:`USAGE_SEEN` (the advisor has observed a
  union: its use record counts);
* ``lf`` float64: the advisor's :data:`DECAY`, :data:`MIN_WEIGHT`, :data:`USAGE_WEIGHT`,
  :data:`USAGE_MEMORY`; the prefetcher's :data:`EFFICIENCY`, :data:`MIN_NEED` and the
  :data:`CARRY` of a level's fractional budget within a cycle;
* ``usage`` float64 ``[L, E]``: the advisor's exponential average of each expert's use per cycle.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from .bitsets import ONE, popcount
from .cache import MISSES, HITS, STREAMED, admit_row, worth_a_slot
from .lookahead import add_per_expert, need_priority, next_token_weights

__all__ = ["ADVISOR", "USE_DRAFT", "PREFETCH", "USAGE_SEEN", "DECAY", "MIN_WEIGHT", "USAGE_WEIGHT", "USAGE_MEMORY",
           "EFFICIENCY", "MIN_NEED", "CARRY", "N_LCONF", "N_LF", "EVERYWHERE", "keep_priorities",
           "prefetch_level", "observe_union"]

ADVISOR, USE_DRAFT, PREFETCH, USAGE_SEEN = range(4)
DECAY, MIN_WEIGHT, USAGE_WEIGHT, USAGE_MEMORY, EFFICIENCY, MIN_NEED, CARRY = range(7)
N_LCONF, N_LF = 4, 7
_ROOT = np.zeros(1, dtype=np.int64)
EVERYWHERE = np.zeros((0, 0), dtype=np.uint64)    # ``where`` for every item


@njit(cache=True)
def _at(where, layer, e):
    """Whether item (layer, e) is in ``where`` (words ``[L, words]``; no rows: every item)."""
    return where.shape[0] == 0 or ((where[layer, e >> 6] >> np.uint64(e & 63)) & ONE) != 0


@njit(cache=True)
def keep_priorities(parents, probs, experts, selected, n_experts, lconf, lf, usage, where):
    """float ``[L, E]``: :meth:`DraftLookahead.keep` of the tree (``parents``, path ``probs``, the
    predicted ``experts`` of its nodes) after verifying ``selected``, at the items of ``where``
    (the ones the cache will read: the resident experts and those it may admit; 0 elsewhere)."""
    n, n_layers = experts.shape[0], experts.shape[1]
    use_draft = lconf[USE_DRAFT] != 0
    draft = np.zeros((n_layers, n_experts))
    if use_draft and n > 1:
        weight = next_token_weights(parents, probs, selected, lf[DECAY])
        floor = max(lf[MIN_WEIGHT], 1e-12)
        count = 0
        for v in range(n):
            count += weight[v] >= floor
        if count:
            nodes = np.empty(count, dtype=np.int64)
            log_miss = np.empty(count)
            j = 0
            for v in range(n):
                if weight[v] >= floor:
                    nodes[j] = v
                    log_miss[j] = math.log1p(-min(weight[v], 1 - 1e-12))
                    j += 1
            acc = add_per_expert(experts, nodes, log_miss, n_experts)
            for layer in range(n_layers):
                for e in range(n_experts):
                    # (numpy's -expm1(0) is -0.0: the same keep)
                    if acc[layer * n_experts + e] != 0 and _at(where, layer, e):
                        draft[layer, e] = -math.expm1(acc[layer * n_experts + e])
    if lf[USAGE_WEIGHT] == 0 or lconf[USAGE_SEEN] == 0:
        return draft
    out = np.zeros((n_layers, n_experts))
    for layer in range(n_layers):
        for e in range(n_experts):
            if not _at(where, layer, e):
                continue
            u = lf[USAGE_WEIGHT] * usage[layer, e]
            out[layer, e] = 1 - (1 - draft[layer, e]) * (1 - u) if use_draft else u
    return out


@njit(cache=True)
def _budget(lf, params):
    """:meth:`DraftPrefetch.budget`: experts one drafted level carries (``params``: the cost
    model's, draft level first, hit and miss last); the fraction left carries over."""
    transfer_s = max(params[4] - params[3], 0.0)
    if transfer_s <= 0 or lf[EFFICIENCY] <= 0:
        return 0
    total = lf[CARRY] + lf[EFFICIENCY] * params[0] / transfer_s
    n = int(math.floor(total + 1e-9))
    lf[CARRY] = total - n
    return n


@njit(cache=True)
def prefetch_level(parents, probs, experts, n_experts, lconf, lf, usage, params, bits, score, count, slots, n_used,
                   clock, counters, config, cached, layer_prefetched):
    """Before a level is drafted on the tree so far: :meth:`DraftPrefetch.plan` (with the
    advisor's keep of the tree, the root selected, computed only where the cache reads it) and
    :meth:`ExpertCache.prefetch` of the plan.
    ``cached`` (the residency the policy decides with, as words) is refreshed after a copy;
    ``layer_prefetched[L]`` counts the copies. Returns the number of experts copied."""
    n_layers = experts.shape[1]
    need = need_priority(probs, experts, n_experts)
    budget = _budget(lf, params)
    if budget == 0:
        return 0
    # the most needed first; among equals the earlier layer (needed first in the pass)
    n_cand = 0
    cand = np.empty(n_layers * n_experts, dtype=np.int64)
    for layer in range(n_layers):
        for e in range(n_experts):
            if need[layer, e] >= lf[MIN_NEED] and not (cached[layer, e >> 6] >> np.uint64(e & 63)) & ONE:
                cand[n_cand] = layer * n_experts + e
                n_cand += 1
    if n_cand == 0 or config[3] == 0:
        return 0
    # the budget's first candidates in (-need, item) order, picked one by one (a budget is a few)
    mask = np.zeros((n_layers, n_experts), dtype=np.bool_)
    flat = need.ravel()
    for _ in range(min(budget, n_cand)):
        best = -1
        for i in range(n_cand):
            c = cand[i]
            if c >= 0 and (best < 0 or flat[c] > flat[cand[best]]):
                best = i
        c = cand[best]
        mask[c // n_experts, c % n_experts] = True
        cand[best] = -1
    # ExpertCache.prefetch: the wanted experts that outrank the slot each would take, copied
    words = bits.shape[1]
    resident = np.zeros((n_layers, n_experts), dtype=np.bool_)
    want = np.zeros((n_layers, n_experts), dtype=np.bool_)
    read = bits.copy()           # the items the priorities are read at: resident or wanted
    for layer in range(n_layers):
        for e in range(n_experts):
            resident[layer, e] = (bits[layer, e >> 6] >> np.uint64(e & 63)) & ONE
            want[layer, e] = mask[layer, e] and not resident[layer, e]
            if mask[layer, e]:
                read[layer, e >> 6] |= ONE << np.uint64(e & 63)
    # DraftPrefetch.plan's priority: this cycle's need, or the advisor's keep (the root selected)
    # where higher
    priority = need.copy()
    if lconf[ADVISOR]:
        keep = keep_priorities(parents, probs, experts, _ROOT, n_experts, lconf, lf, usage, read)
        for layer in range(n_layers):
            for e in range(n_experts):
                priority[layer, e] = max(need[layer, e], keep[layer, e])
    worth = worth_a_slot(want, mask, resident, priority, config[3], config[0] == 0)
    union = np.zeros((n_layers, words), dtype=np.uint64)
    for layer in range(n_layers):
        for e in range(n_experts):
            if (want[layer, e] and worth[layer, e]) or (mask[layer, e] and resident[layer, e]):
                union[layer, e >> 6] |= ONE << np.uint64(e & 63)
    kept = np.empty((3, n_layers), dtype=np.int64)     # a prefetch is no hit, miss or stream
    for layer in range(n_layers):
        kept[0, layer], kept[1, layer], kept[2, layer] = counters[HITS, layer], counters[MISSES, layer], \
            counters[STREAMED, layer]
    capacity = max(config[3], 1)
    evicted = np.empty(capacity, dtype=np.int64)
    cand_score = np.empty(capacity, dtype=np.int64)
    cand_slot = np.empty(capacity, dtype=np.int64)
    admitted = np.empty(words, dtype=np.uint64)
    clock[0] += 1
    copied = 0
    for layer in range(n_layers):
        admit_row(layer, union[layer], bits, score, count, slots, n_used, clock, counters, config, priority, admitted,
                  evicted, 0, cand_score, cand_slot)
        n = 0
        for w in range(words):
            n += popcount(admitted[w])
        layer_prefetched[layer] += n
        copied += n
    for layer in range(n_layers):
        counters[HITS, layer], counters[MISSES, layer], counters[STREAMED, layer] = kept[0, layer], kept[1, layer], \
            kept[2, layer]
    for layer in range(n_layers):
        for w in range(words):
            cached[layer, w] = bits[layer, w]
    return copied


@njit(cache=True)
def observe_union(union, n_experts, lconf, lf, usage):
    """:meth:`DraftLookahead.observe` of a cycle's true union (words ``[L, words]``)."""
    if not lconf[ADVISOR]:
        return
    memory = lf[USAGE_MEMORY]
    for layer in range(usage.shape[0]):
        for e in range(n_experts):
            used = 1.0 if (union[layer, e >> 6] >> np.uint64(e & 63)) & ONE else 0.0
            usage[layer, e] *= memory
            usage[layer, e] += (1 - memory) * used
    lconf[USAGE_SEEN] = 1
