"""SpecFit's decisions compiled: the price per draft node, the level-0 test, the per-level stopping
rule with its look-ahead, the final selection, and what a verified cycle teaches the price.

The rules are those documented in :mod:`specfit.specfit_policy`, whose
:class:`~specfit.specfit_policy.SpecFitPolicy` holds the state in the arrays these update in place
and calls :func:`decide_level` once per drafted level (the live decoder's case), while the replay
(:mod:`.replay`) runs the same level loop over a whole cycle (``decide_cycle`` there, with the
prefetch lever between levels) and :func:`observe_cycle` without leaving compiled code. One
implementation serves both drivers.

State (arrays owned by the policy):

* ``conf`` int64: :data:`MAX_LEVELS`, :data:`LOOKAHEAD` (:data:`NONE` / :data:`EXPECTED` /
  :data:`OPTIMISTIC`), :data:`FIRST_LEVEL_TEST`, :data:`PRICE` (:data:`NO_PRICE` /
  :data:`PRECISION` / :data:`OBSERVED`), :data:`MIN_OBSERVED`;
* ``fstate`` float64: :data:`EXTRA_MISSES` and :data:`DRAFT_NODES` (exponential sums of the misses
  verified draft nodes had beyond their prediction, and of those nodes), :data:`RESIDENT_SHARE`,
  :data:`NODE_PRICE` (this cycle's price per draft node, s), :data:`STATS_MEMORY`;
* ``istate`` int64: :data:`N_OBSERVED`, :data:`SLOTS`, :data:`SLOTS_RIGHT`, :data:`DECLINED` (cycles in
  a row the level-0 test declined), :data:`N_RECENT` and :data:`RECENT_NEXT` (a ring of the best
  path probability ``recent_p`` and width ``recent_w`` of recently drafted first levels);
* the :class:`~specfit.next_level.LevelStats` arrays (``acceptance``, ``new_experts``,
  ``new_is_share``, ``seen``, ``width``).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .levels import expected_children, level_nodes, optimistic_children, stats_update
from .search import OK, best_subtree, better
from .tolerances import PROB_SLACK
from .tree import check_tree

__all__ = ["node_price", "precision_price", "first_level_may_pay", "next_level_may_pay", "decide_level", "select_level", "observe_cycle"]

MAX_LEVELS, LOOKAHEAD, FIRST_LEVEL_TEST, PRICE, MIN_OBSERVED = range(5)
NONE, EXPECTED, OPTIMISTIC = 0, 1, 2
NO_PRICE, PRECISION, OBSERVED = 0, 1, 2
EXTRA_MISSES, DRAFT_NODES, RESIDENT_SHARE, NODE_PRICE, STATS_MEMORY = range(5)
N_OBSERVED, SLOTS, SLOTS_RIGHT, DECLINED, N_RECENT, RECENT_NEXT = range(6)
N_CONF, N_FSTATE, N_ISTATE = 5, 5, 6
PRICE_MEMORY = 0.99      # observed prices forget at this rate per cycle that verified draft nodes
RECHECK = 16             # the level-0 test drafts anyway after this many declined cycles


@njit(cache=True)
def node_price(conf, fstate, istate, n_layers, top_k, hit_s, miss_s):
    """The cycle's price per draft node (s): the observed extra misses per verified draft node
    once ``MIN_OBSERVED`` were seen, else the precision bound
    (:func:`specfit.search.uncertainty_price_s`), 0 without predictions or with no price."""
    mode = conf[PRICE]
    transfer_s = max(miss_s - hit_s, 0.0)
    if mode == NO_PRICE:
        return 0.0
    if mode == OBSERVED and istate[N_OBSERVED] >= conf[MIN_OBSERVED] and fstate[DRAFT_NODES] > 0:
        return max(fstate[EXTRA_MISSES] / fstate[DRAFT_NODES], 0.0) * transfer_s
    if istate[SLOTS] == 0:
        return 0.0
    return precision_price(istate[SLOTS_RIGHT] / istate[SLOTS], n_layers, top_k, fstate[RESIDENT_SHARE], transfer_s)


@njit(cache=True)
def precision_price(precision, n_layers, top_k, resident_share, transfer_s):
    """Expected extra seconds per draft node when a share ``1 - precision`` of its predicted
    experts is wrong (:func:`specfit.search.uncertainty_price_s`, which validates and calls this)."""
    return (1.0 - precision) * n_layers * top_k * (1.0 - resident_share) * transfer_s


@njit(cache=True)
def first_level_may_pay(root_s, params, fstate, istate, recent_p, recent_w):
    """Whether drafting level 1 can beat verifying the root alone (``root_s`` its time).

    k first-level nodes with path probability at most p add at most k p tokens and cost at least
    d + k c (d: a draft level, c: per node plus its price), so they pay only if p T0 > c + d / k,
    T0 the root's cycle time. With p = 1 this is a bound that holds for any drafter; with p and k
    from recently drafted first levels it stops a drafter that has been useless, and every
    ``RECHECK``-th declined cycle drafts anyway to notice when it improves."""
    c = params[2] + fstate[NODE_PRICE]
    if root_s <= c:
        return False
    n_recent = istate[N_RECENT]
    if n_recent and istate[DECLINED] < RECHECK:
        p = recent_p[0]
        k = recent_w[0]
        for i in range(1, n_recent):
            p = max(p, recent_p[i])
            k = max(k, recent_w[i])
        if p * root_s <= c + params[0] / k:
            istate[DECLINED] += 1
            return False
    istate[DECLINED] = 0
    return True


@njit(cache=True)
def next_level_may_pay(parents, probs, experts, cached_bits, n_experts, params, d, conf, price, acceptance,
                       new_experts, new_is_share, seen, width, cur_nodes, cur_tokens, cur_s):
    """Whether the best subtree with one more (virtual) level, charged that level, beats the
    current best (``cur_*``; the look-ahead of :mod:`specfit.next_level`)."""
    newest = level_nodes(parents, d)
    if newest.size == 0:
        return False
    cur_priced = cur_s + price * (cur_nodes.size - 1)
    if conf[LOOKAHEAD] == EXPECTED:
        top_k = experts.shape[2]
        g_parents, g_probs, g_experts = expected_children(parents, probs, newest, experts, acceptance, new_experts,
                                                          new_is_share, seen, width[0], d, n_experts, 0)
        check_tree(g_parents, g_probs, PROB_SLACK)   # clipped as a DraftTree clips
        n_grown = n_experts + (g_parents.size - parents.size) * top_k
        # a bound that saves the search. A subtree S of the grown tree is its drafted part S_r,
        # whose ratio is at most the current best's R = A / T, and virtual nodes V: A(S) =
        # A(S_r) + sum p_v, and T(S) = T(S_r) + d + sum c_v, where d is the level's draft time and
        # c_v at least a node's time and price plus its fresh experts' misses (a virtual child
        # keeps its parent's other experts, which S holds already). So A(S) / T(S) <= R whenever
        # sum over V of (p_v - R c_v) <= R d, for every V when it holds for the v with p_v > R c_v
        node_s = params[2] + price
        gain = 0.0           # in units of the current best's priced time: sum of (p_v T - A c_v) > 0
        for v in range(parents.size, g_parents.size):
            fresh = 0
            for layer in range(g_experts.shape[1]):
                for slot in range(top_k):
                    fresh += g_experts[v, layer, slot] >= n_experts
            gain += max(g_probs[v] * cur_priced - cur_tokens * (node_s + fresh * params[4]), 0.0)
        if gain <= cur_tokens * params[0]:
            return False
    else:
        g_parents, g_probs, g_experts = optimistic_children(parents, probs, newest, experts)
        if g_parents.size == 0:
            return False
        check_tree(g_parents, g_probs, PROB_SLACK)   # clipped as a DraftTree clips
        n_grown = n_experts
    grown_bits = np.zeros((cached_bits.shape[0], (n_grown + 63) // 64), dtype=np.uint64)
    grown_bits[:, :cached_bits.shape[1]] = cached_bits
    status, nodes, tokens, time_s, _, _ = best_subtree(g_parents, g_probs, g_experts, grown_bits, n_grown, params,
                                                       d + 1, price, cur_nodes, True)
    return status == OK and better(tokens, time_s + price * (nodes.size - 1), nodes.size, cur_tokens, cur_priced,
                                   cur_nodes.size)


@njit(cache=True)
def decide_level(parents, probs, experts, cached_bits, n_experts, params, d, conf, fstate, istate, recent_p,
                 recent_w, acceptance, new_experts, new_is_share, seen, width, prev_nodes, prev_tokens, prev_s):
    """After drafting level ``d`` of the tree (``d`` below ``MAX_LEVELS``): the best subtree and
    whether to draft another level. ``prev_*`` is the best of level ``d - 1`` (``prev_nodes``
    empty: none; a warm start for the search); ``fstate[NODE_PRICE]`` must hold the cycle's price.
    Returns ``(status, go_on, nodes, tokens, time_s, hits, misses)``; a status other than OK is the
    search's error (and go_on False)."""
    price = fstate[NODE_PRICE]
    if d == 0:
        status, nodes, tokens, time_s, hits, misses = best_subtree(parents, probs, experts, cached_bits, n_experts,
                                                                   params, 0, price, np.zeros(0, dtype=np.int64), False)
        if status != OK:
            return status, False, nodes, tokens, time_s, hits, misses
        if conf[FIRST_LEVEL_TEST]:
            go = first_level_may_pay(time_s, params, fstate, istate, recent_p, recent_w)
        else:
            go = time_s > 0
        return status, go, nodes, tokens, time_s, hits, misses
    if d == 1:
        first = level_nodes(parents, 1)
        if first.size:
            best_p = probs[first[0]]
            for v in first:
                best_p = max(best_p, probs[v])
            i = istate[RECENT_NEXT]
            recent_p[i], recent_w[i] = best_p, first.size
            istate[RECENT_NEXT] = (i + 1) % recent_p.size
            istate[N_RECENT] = min(istate[N_RECENT] + 1, recent_p.size)
    stats_update(parents, probs, level_nodes(parents, d), experts, d, acceptance, new_experts, new_is_share, seen,
                 width, fstate[STATS_MEMORY])
    has_prev = prev_nodes.size > 0
    status, nodes, tokens, time_s, hits, misses = best_subtree(parents, probs, experts, cached_bits, n_experts, params,
                                                               d, price, prev_nodes, has_prev)
    if status != OK:
        return status, False, nodes, tokens, time_s, hits, misses
    go = not has_prev or better(tokens, time_s + price * (nodes.size - 1), nodes.size, prev_tokens,
                                prev_s + price * (prev_nodes.size - 1), prev_nodes.size)
    if not go and conf[LOOKAHEAD] != NONE:
        go = next_level_may_pay(parents, probs, experts, cached_bits, n_experts, params, d, conf, price, acceptance,
                                new_experts, new_is_share, seen, width, nodes, tokens, time_s)
    return status, go, nodes, tokens, time_s, hits, misses


@njit(cache=True)
def select_level(parents, probs, experts, cached_bits, n_experts, params, d, fstate, prev_nodes):
    """The best subtree at ``d`` drafted levels when :func:`decide_level` did not search there
    (the tree ended, or ``MAX_LEVELS``): the search warm-started from the previous best."""
    return best_subtree(parents, probs, experts, cached_bits, n_experts, params, d, fstate[NODE_PRICE], prev_nodes,
                        prev_nodes.size > 0)


@njit(cache=True)
def observe_cycle(fstate, istate, n_verified, misses, root_misses, predicted_misses, root_predicted_misses):
    """What a verified cycle teaches the observed price: the misses its draft nodes had beyond
    their predicted ones (the root's own errors are paid by every candidate alike, so they are left
    out), when it verified a draft node."""
    if n_verified <= 1:
        return
    extra = (misses - root_misses) - (predicted_misses - root_predicted_misses)
    fstate[EXTRA_MISSES] = PRICE_MEMORY * fstate[EXTRA_MISSES] + extra
    fstate[DRAFT_NODES] = PRICE_MEMORY * fstate[DRAFT_NODES] + (n_verified - 1)
    istate[N_OBSERVED] += n_verified - 1
