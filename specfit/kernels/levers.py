"""The replay's levers compiled: the draft's look-ahead ``keep`` priorities, the prefetch into a
drafted level's link time, and the advisor's record of each expert's recent use. The rules are
those of :class:`specfit.experts.lookahead.DraftLookahead` (whose ``keep`` is
:func:`keep_priorities`) and :class:`specfit.experts.prefetch.DraftPrefetch` (whose ``plan`` is
:func:`plan_level`), with :func:`.cache.prefetch_items` (``ExpertCache.prefetch``) for the copies:
the live decoder and the replay's Python loop reach them through those objects, the compiled
replay (:mod:`.replay`) calls them on the same arrays, and a test checks the two loops give the
same columns, cache state and advisor state.

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
from .cache import prefetch_items
from .lookahead import add_per_expert, need_priority, next_token_weights

__all__ = ["ADVISOR", "USE_DRAFT", "PREFETCH", "USAGE_SEEN", "DECAY", "MIN_WEIGHT", "USAGE_WEIGHT", "USAGE_MEMORY",
           "EFFICIENCY", "MIN_NEED", "CARRY", "N_LCONF", "N_LF", "EVERYWHERE", "keep_priorities",
           "plan_level", "prefetch_level", "observe_union"]

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
def plan_level(probs, experts, n_experts, cached, lf, params):
    """:meth:`DraftPrefetch.plan` without the priorities: ``(need [L, E], mask [L, E])``, each
    expert's need (the largest path probability of a node predicted to route to it) and the
    non-resident experts (``cached``: words) to copy while the next level is drafted, the most
    needed first (among equals the earlier layer, needed first in the pass), as many as the
    level's budget (:func:`_budget`, its carry in ``lf``) and at least ``MIN_NEED``."""
    n_layers = experts.shape[1]
    need = need_priority(probs, experts, n_experts)
    mask = np.zeros((n_layers, n_experts), dtype=np.bool_)
    budget = _budget(lf, params)
    if budget == 0:
        return need, mask
    n_cand = 0
    cand = np.empty(n_layers * n_experts, dtype=np.int64)
    for layer in range(n_layers):
        for e in range(n_experts):
            if need[layer, e] >= lf[MIN_NEED] and not (cached[layer, e >> 6] >> np.uint64(e & 63)) & ONE:
                cand[n_cand] = layer * n_experts + e
                n_cand += 1
    # the budget's first candidates in (-need, item) order, picked one by one (a budget is a few)
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
    return need, mask


@njit(cache=True)
def prefetch_level(parents, probs, experts, n_experts, lconf, lf, usage, params, bits, score, count, slots, n_used,
                   clock, counters, config, cached, layer_prefetched):
    """Before a level is drafted on the tree so far: :func:`plan_level`, the priorities (the
    need, or the advisor's keep of the tree with the root selected where higher, computed only
    where the cache reads them) and :func:`.cache.prefetch_items` of the plan, as the live
    decoder runs :meth:`DraftPrefetch.plan` and :meth:`ExpertCache.prefetch`. ``cached`` (the
    residency the policy decides with, as words) is refreshed after a copy; ``layer_prefetched[L]``
    counts the copies. Returns the number of experts copied."""
    n_layers = experts.shape[1]
    need, mask = plan_level(probs, experts, n_experts, cached, lf, params)
    if config[3] == 0 or not mask.any():
        return 0
    words = bits.shape[1]
    priority = need.copy()
    if lconf[ADVISOR]:
        read = bits.copy()           # the items the priorities are read at: resident or wanted
        for layer in range(n_layers):
            for e in range(n_experts):
                if mask[layer, e]:
                    read[layer, e >> 6] |= ONE << np.uint64(e & 63)
        keep = keep_priorities(parents, probs, experts, _ROOT, n_experts, lconf, lf, usage, read)
        for layer in range(n_layers):
            for e in range(n_experts):
                priority[layer, e] = max(need[layer, e], keep[layer, e])
    counts = np.zeros((4, n_layers), dtype=np.int64)
    admitted = np.zeros((n_layers, words), dtype=np.uint64)
    evicted = np.zeros((n_layers, words), dtype=np.uint64)
    copied = prefetch_items(mask, bits, score, count, slots, n_used, clock, counters, config, priority, counts,
                            admitted, evicted)
    for layer in range(n_layers):
        for w in range(words):
            layer_prefetched[layer] += popcount(admitted[layer, w])
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
