"""The cache's look-ahead: eviction ordered by ``keep`` priorities, and prefetch, against a plain
OrderedDict reference written from the rules in ``specfit/experts/cache.py``; and the draft's
look-ahead weights (``specfit/experts/lookahead.py``) on a hand-built tree."""

from __future__ import annotations

import numpy as np
import pytest

from core_helpers import RefLRUCache
from specfit import CostModel, DraftTree, ExpertCache
from specfit.experts.lookahead import DraftLookahead, next_token_weights
from specfit.experts.prefetch import DraftPrefetch


class RefKeepCache(RefLRUCache):
    """LRU whose victims are the evictable experts in ascending keep, least recent first among
    equal keeps, and whose misses take slots in descending keep; prefetch takes free slots, then
    the cheapest victims it outranks."""

    def _admit_ordered(self, union, keep):
        L = self.n_layers
        out = {k: np.zeros(L, dtype=np.int64) for k in ("hits", "misses", "evictions", "streamed")}
        for layer in range(L):
            od = self._dict(layer)
            wanted = np.flatnonzero(union[layer]).tolist()
            want = wanted if self.mode == "per_layer" else [(layer, e) for e in wanted]
            want_set = set(want)
            hits = [k for k in want if k in od]
            prio = (lambda x, layer=layer: keep[layer, x]) if self.mode == "per_layer" else (lambda x: keep[x])
            misses = [k for k in want if k not in od]
            for k in hits:
                od.move_to_end(k)
            # the misses that stay: descending keep (ascending id among equals), as many as fit once
            # every expert outside the union could be evicted; they arrive in ascending id
            room = self.capacity - len(hits)
            stay = sorted(sorted(misses, key=lambda k: -prio(k))[:max(room, 0)])
            out["streamed"][layer] += len(misses) - len(stay)
            victims = iter(sorted([x for x in od if x not in want_set], key=prio))
            for k in stay:
                if len(od) >= self.capacity:
                    victim = next(victims)
                    del od[victim]
                    out["evictions"][layer if self.mode == "per_layer" else victim[0]] += 1
                od[k] = True
            out["hits"][layer], out["misses"][layer] = len(hits), len(misses)
        return out

    def prefetch(self, mask, keep):
        copied = np.zeros_like(mask)
        for layer in range(self.n_layers):     # per-layer mode only
            od = self._dict(layer)
            ids = np.flatnonzero(mask[layer]).tolist()
            resident_wanted = [e for e in ids if e in od]
            cand = sorted([e for e in ids if e not in od], key=lambda e: (-keep[layer, e], e))
            victims = sorted([x for x in od if x not in set(ids)], key=lambda x: keep[layer, x])
            free = self.capacity - len(od)
            take, evict = [], []
            for i, e in enumerate(cand):
                if i < free:
                    take.append(e)
                elif i - free < len(victims) and keep[layer, e] > keep[layer, victims[i - free]]:
                    take.append(e)
                    evict.append(victims[i - free])
                else:
                    break
            for x in evict:
                del od[x]
            for e in resident_wanted:
                od.move_to_end(e)
            for e in sorted(take):
                od[e] = True
                copied[layer, e] = True
        return copied


def random_steps(seed, L, E, steps):
    rng = np.random.default_rng(seed)
    pop = rng.dirichlet(np.full(E, 0.6), size=L)
    out = []
    for _ in range(steps):
        u = np.zeros((L, E), dtype=bool)
        for layer in range(L):
            u[layer, rng.choice(E, size=int(rng.integers(0, E // 2 + 1)), replace=False, p=pop[layer])] = True
        keep = np.round(rng.random((L, E)) * 3) / 3 * (rng.random((L, E)) < 0.5)   # ties and zeros
        out.append((u, keep))
    return out


@pytest.mark.parametrize("mode", ["per_layer", "global"])
@pytest.mark.parametrize("seed", range(8))
def test_keep_orders_victims_before_recency(mode, seed):
    L, E = 3, 8
    capacity = 3 if mode == "per_layer" else 7
    cache = ExpertCache(L, E, capacity, mode=mode)
    ref = RefKeepCache(L, E, capacity, mode=mode)
    for step, (union, keep) in enumerate(random_steps(seed, L, E, 30)):
        got = cache.admit(union, keep=keep)
        want = ref._admit_ordered(union, keep)
        for key in ("hits", "misses", "evictions", "streamed"):
            assert getattr(got, key).tolist() == want[key].tolist(), f"step {step}: {key}"
        assert np.array_equal(cache.resident(), ref.resident()), f"step {step}: resident"


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo", "moe-infinity"])
def test_zero_keep_is_the_plain_policy(policy):
    L, E = 2, 10
    a, b = ExpertCache(L, E, 4, policy=policy), ExpertCache(L, E, 4, policy=policy)
    for union, _ in random_steps(3, L, E, 40):
        ra, rb = a.admit(union), b.admit(union, keep=np.zeros((L, E)))
        assert ra.misses.tolist() == rb.misses.tolist()
        assert np.array_equal(a.resident(), b.resident())


@pytest.mark.parametrize("seed", range(8))
def test_prefetch_matches_the_reference(seed):
    L, E, C = 2, 9, 4
    cache, ref = ExpertCache(L, E, C), RefKeepCache(L, E, C)
    rng = np.random.default_rng(50 + seed)
    for step, (union, keep) in enumerate(random_steps(seed, L, E, 30)):
        mask = rng.random((L, E)) < 0.25
        copied = cache.prefetch(mask, keep).admitted_mask
        assert np.array_equal(copied, ref.prefetch(mask, keep)), f"step {step}: prefetched"
        assert np.array_equal(cache.resident(), ref.resident()), f"step {step}: resident after prefetch"
        got, want = cache.admit(union, keep=keep), ref._admit_ordered(union, keep)
        assert got.misses.tolist() == want["misses"].tolist(), f"step {step}: misses"


def test_a_global_prefetch_keeps_the_resident_experts_of_its_own_mask():
    # (0,0) and (1,1) fill a global cache of 2; the mask wants (0,0) kept and (1,0) brought: the
    # slot is (1,1)'s, whatever the keeps say ((0,0)'s 0.1 is below (1,1)'s 0.2)
    cache = ExpertCache(2, 2, 2, mode="global")
    cache.warm(np.array([[True, False], [False, True]]))
    result = cache.prefetch(np.array([[True, False], [True, False]]), np.array([[0.1, 0.0], [0.9, 0.2]]))
    assert np.argwhere(result.evicted_mask).tolist() == [[1, 1]]
    assert np.argwhere(cache.resident()).tolist() == [[0, 0], [1, 0]]


@pytest.mark.parametrize("seed", range(6))
def test_a_global_prefetch_never_evicts_an_expert_of_its_mask_while_another_can_go(seed):
    L, E, C = 3, 6, 5
    cache = ExpertCache(L, E, C, mode="global")
    rng = np.random.default_rng(seed)
    for step, (union, keep) in enumerate(random_steps(seed, L, E, 30)):
        mask = rng.random((L, E)) < 0.3
        before = cache.resident()
        result = cache.prefetch(mask, keep if step % 2 else None)
        if (before & ~mask).sum() >= result.admitted_mask.sum():   # enough others to take the slots from
            assert not (result.evicted_mask & mask & before).any(), f"step {step}"
        cache.admit(union, keep=keep)


def test_prefetched_experts_are_hits_and_not_counted_as_misses():
    cache = ExpertCache(1, 6, 2)
    mask = np.zeros((1, 6), dtype=bool)
    mask[0, [1, 4]] = True
    copied = cache.prefetch(mask, np.ones((1, 6))).admitted_mask
    assert copied[0].nonzero()[0].tolist() == [1, 4]
    assert cache.prefetched.tolist() == [2] and cache.misses.tolist() == [0] and cache.hits.tolist() == [0]
    result = cache.admit(mask)
    assert result.hits.tolist() == [2] and result.misses.tolist() == [0]


def test_prefetch_never_displaces_a_more_valuable_expert():
    cache = ExpertCache(1, 6, 2)
    first = np.zeros((1, 6), dtype=bool)
    first[0, [0, 1]] = True
    cache.admit(first)
    keep = np.zeros((1, 6))
    keep[0, 0], keep[0, 1], keep[0, 5] = 0.9, 0.2, 0.5
    mask = np.zeros((1, 6), dtype=bool)
    mask[0, 5] = True
    copied = cache.prefetch(mask, keep).admitted_mask
    # 5 (0.5) takes the slot of 1 (0.2), never that of 0 (0.9)
    assert copied[0, 5] and cache.resident()[0].nonzero()[0].tolist() == [0, 5]
    keep[0, 3] = 0.1
    mask[0] = False
    mask[0, 3] = True
    assert not cache.prefetch(mask, keep).admitted_mask.any()


def test_no_capacity_prefetches_nothing():
    cache = ExpertCache(2, 4, 0)
    assert not cache.prefetch(np.ones((2, 4), dtype=bool)).admitted_mask.any()
    assert cache.prefetched.tolist() == [0, 0]


# --------------------------------------------------------------------------- draft look-ahead
#   0 ─┬─ 1 (p .6) ─┬─ 3 (p .42) ── 5 (p .21)
#      │            └─ 4 (p .12)
#      └─ 2 (p .3)
TREE = DraftTree(np.array([-1, 0, 0, 1, 1, 3]), np.array([1.0, 0.6, 0.3, 0.42, 0.12, 0.21]))


def test_next_token_weights_by_hand():
    # selected {0, 1}: 0 is the last accepted with 1 - .6 = .4, node 1 with .6
    w = next_token_weights(TREE, [0, 1], decay=0.5)
    assert w[0] == 0 and w[1] == 0
    assert w[2] == pytest.approx(0.4 * 0.3)          # child of 0 not selected
    assert w[3] == pytest.approx(0.6 * 0.42 / 0.6)   # children of 1
    assert w[4] == pytest.approx(0.6 * 0.12 / 0.6)
    assert w[5] == pytest.approx(0.6 * 0.21 / 0.6 * 0.5)   # one level further: decayed
    # the root alone: its children are next with their own probability
    assert next_token_weights(TREE, [0], decay=1.0)[[1, 2]].tolist() == pytest.approx([0.6, 0.3])


def test_keep_is_the_probability_that_some_near_node_needs_the_expert():
    experts = np.zeros((6, 1, 1), dtype=np.int64)
    experts[:, 0, 0] = [0, 1, 2, 2, 3, 4]
    keep = DraftLookahead(decay=1.0, min_weight=0.0).keep(TREE, experts, [0, 1], n_experts=5)
    w = next_token_weights(TREE, [0, 1], decay=1.0)
    assert keep[0, 2] == pytest.approx(1 - (1 - w[2]) * (1 - w[3]))   # nodes 2 and 3 share expert 2
    assert keep[0, 3] == pytest.approx(w[4]) and keep[0, 4] == pytest.approx(w[5])
    assert keep[0, 0] == 0 and keep[0, 1] == 0                       # the selected nodes' own


# ------------------------------------------------------------------ prefetch into drafted levels' link time
def _fan(probs: list[float], n_experts: int = 16) -> tuple[DraftTree, np.ndarray]:
    """A root with one child per path probability, node v routed (1 layer, top-1) to expert v."""
    n = len(probs) + 1
    tree = DraftTree(parents=np.r_[-1, np.zeros(n - 1, dtype=np.int64)], path_probs=np.r_[1.0, probs],
                     tokens=np.arange(n))
    return tree, np.arange(n, dtype=np.int64).reshape(n, 1, 1)


def test_a_drafted_level_carries_its_link_time_in_experts_and_the_fraction_over_to_the_next():
    """efficiency x draft_level_s / transfer_s experts a level, transfer = miss - hit: 1.0 s of
    drafting over 0.4 s a transfer carries 2.5 experts, so 2, then 3 (2.5 + the 0.5 left), the most
    needed first; a new cycle starts without the fraction."""
    from specfit import CostModel
    from specfit.experts.prefetch import DraftPrefetch

    cost = CostModel(base_s=0.0, per_node_s=0.0, hit_s=0.2, miss_s=0.6, draft_level_s=1.0)
    tree, experts = _fan([0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    cached = np.zeros((1, 16), dtype=bool)
    prefetch = DraftPrefetch(efficiency=1.0)
    first, _ = prefetch.plan(tree, experts, cached, cost)
    assert np.flatnonzero(first[0]).tolist() == [0, 1]                # the root's (need 1), then 0.9's
    cached |= first
    second, _ = prefetch.plan(tree, experts, cached, cost)
    assert np.flatnonzero(second[0]).tolist() == [2, 3, 4]            # 0.5 carried: 3 this level
    prefetch.begin_cycle()
    third, _ = prefetch.plan(tree, experts, np.zeros((1, 16), dtype=bool), cost)
    assert int(third.sum()) == 2
    half = DraftPrefetch(efficiency=0.5).plan(tree, experts, np.zeros((1, 16), dtype=bool), cost)[0]
    assert int(half.sum()) == 1                                       # 1.25 experts


def test_prefetch_takes_experts_needed_with_at_least_min_need_and_none_below():
    from specfit import CostModel
    from specfit.experts.prefetch import DraftPrefetch

    cost = CostModel(base_s=0.0, per_node_s=0.0, hit_s=0.0, miss_s=0.1, draft_level_s=10.0)   # room for 100
    tree, experts = _fan([0.3, 0.29, 0.5])
    mask, priority = DraftPrefetch(efficiency=1.0, min_need=0.3).plan(tree, experts, np.zeros((1, 16), dtype=bool), cost)
    assert np.flatnonzero(mask[0]).tolist() == [0, 1, 3]              # needs 1, 0.3 and 0.5; not 0.29
    np.testing.assert_allclose(priority[0, :4], [1.0, 0.3, 0.29, 0.5])


def test_a_learned_prefetch_efficiency_is_the_share_of_copy_time_no_pass_waited_for():
    from specfit.experts.prefetch import DraftPrefetch

    learned = DraftPrefetch(efficiency=None, prior_efficiency=0.5)
    assert learned.efficiency_ == 0.5
    learned.observe(1.0, 0.25)
    assert learned.efficiency_ == pytest.approx(0.75)
    learned.observe(1.0, 0.0)                                          # over both cycles: 1 - 0.25 / 2
    assert learned.efficiency_ == pytest.approx(0.875)
    fixed = DraftPrefetch(efficiency=0.4)
    fixed.observe(1.0, 1.0)
    assert fixed.efficiency_ == 0.4


def test_usage_is_an_exponential_average_of_the_unions():
    from specfit.experts.lookahead import DraftLookahead

    la = DraftLookahead(usage_memory=0.9)
    union = np.array([[True, False]])
    la.observe(union)
    np.testing.assert_allclose(la.usage_, [[0.1, 0.0]])
    la.observe(union)
    np.testing.assert_allclose(la.usage_, [[0.19, 0.0]])


def test_a_new_cycle_drops_the_fraction_carried_from_the_last_level():
    # 1.0 s of drafting over 0.4 s a transfer carries 2.5 experts: the first level takes 2 and
    # carries 0.5; a new cycle must start from 0, so its first level takes 2 again, not 3
    cost = CostModel(base_s=0.0, per_node_s=0.0, hit_s=0.2, miss_s=0.6, draft_level_s=1.0)
    tree, experts = _fan([0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    prefetch = DraftPrefetch(efficiency=1.0)
    first, _ = prefetch.plan(tree, experts, np.zeros((1, 16), dtype=bool), cost)
    assert int(first.sum()) == 2
    prefetch.begin_cycle()
    again, _ = prefetch.plan(tree, experts, np.zeros((1, 16), dtype=bool), cost)
    assert int(again.sum()) == 2


def test_the_priority_is_the_larger_of_this_cycles_need_and_keep():
    cost = CostModel(base_s=0.0, per_node_s=0.0, hit_s=0.0, miss_s=0.1, draft_level_s=10.0)
    tree, experts = _fan([0.3, 0.5])                  # needs: expert 0: 1, 1: 0.3, 2: 0.5, others 0
    keep = np.zeros((1, 16))
    keep[0, :4] = [0.2, 0.9, 0.1, 0.7]
    _, priority = DraftPrefetch(efficiency=1.0, min_need=0.3).plan(tree, experts, np.zeros((1, 16), dtype=bool),
                                                                   cost, keep=keep)
    np.testing.assert_allclose(priority[0, :5], [1.0, 0.9, 0.5, 0.7, 0.0])


@pytest.mark.parametrize("field", ["efficiency", "prior_efficiency"])
@pytest.mark.parametrize("value", [1.5, -0.1])
def test_an_efficiency_outside_zero_to_one_is_refused(field, value):
    with pytest.raises(ValueError, match=field):
        DraftPrefetch(**{field: value})


def test_the_need_of_an_expert_is_the_largest_path_probability_among_the_nodes_routed_to_it():
    from specfit.experts.prefetch import need_priority

    # root (1.0) -> a (0.6), root -> b (0.3); a and b both route to expert 2 (b last), the root to 0
    tree = DraftTree(parents=np.array([-1, 0, 0]), path_probs=np.array([1.0, 0.6, 0.3]), tokens=np.arange(3))
    experts = np.array([[[0]], [[2]], [[2]]], dtype=np.int64)
    need = need_priority(tree, experts, 4)
    np.testing.assert_allclose(need, [[1.0, 0.0, 0.6, 0.0]])


def test_a_slot_repeated_within_a_layer_adds_a_nodes_value_once():
    from specfit import kernels

    experts = np.array([[[2, 2], [1, 3]], [[2, 0], [3, 3]]], dtype=np.int64)    # 2 nodes, 2 layers, top-2
    acc = kernels.lookahead.add_per_expert(experts, np.array([0, 1]), np.array([0.5, 0.25]), 4)
    want = np.zeros((2, 4))
    want[0, 2] = 0.5 + 0.25
    want[0, 0] = 0.25
    want[1, 1] = 0.5
    want[1, 3] = 0.5 + 0.25
    np.testing.assert_allclose(acc.reshape(2, 4), want)
