"""ExpertCache against a straightforward LRU reference (OrderedDicts) on random unions and on real
OLMoE routing, ``admit_layer`` against the same reference and against ``admit`` of a one-row union,
plus capacity edge cases, lfu / fifo / moe-infinity basics and bad input."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from core_helpers import RefCache, RefLRUCache, core_settings, find_shared_data
from specfit import ExpertCache
from specfit.experts.cache import EVICTION_POLICIES

ROUTING = "olmoe-1b-7b-routing-general-coding.npz"


def assert_step_matches(result, expected: dict, cache: ExpertCache, ref: RefLRUCache, step) -> None:
    for key in ("hits", "misses", "evictions", "streamed"):
        got = np.asarray(getattr(result, key))
        assert got.tolist() == expected[key].tolist(), f"step {step}: per-layer {key}"
    for key in ("hit", "admitted", "evicted", "streamed"):
        got = np.asarray(getattr(result, f"{key}_mask"))
        assert np.array_equal(got, expected[f"{key}_mask"]), f"step {step}: {key}_mask"
    resident = cache.resident()
    assert resident.dtype == np.bool_
    assert np.array_equal(resident, ref.resident()), (
        f"step {step}: resident differs in layers {np.flatnonzero((resident != ref.resident()).any(axis=1))}")


def replay(cache: ExpertCache, ref: RefLRUCache, unions) -> None:
    totals = {k: np.zeros(cache.n_layers, dtype=np.int64) for k in ("hits", "misses", "evictions", "streamed")}
    for step, union in enumerate(unions):
        result = cache.admit(union)
        expected = ref.admit(union)
        assert_step_matches(result, expected, cache, ref, step)
        for k in totals:
            totals[k] += expected[k]
    for k, v in totals.items():  # the cache's running per-layer counters
        assert np.asarray(getattr(cache, k)).tolist() == v.tolist(), f"cumulative {k}"


def random_unions(seed: int, n_layers: int, n_experts: int, steps: int, max_size: int) -> list[np.ndarray]:
    """Unions with locality: a skewed popularity per layer, so experts recur and hits happen."""
    rng = np.random.default_rng(seed)
    pop = rng.dirichlet(np.full(n_experts, 0.5), size=n_layers)
    unions = []
    for _ in range(steps):
        u = np.zeros((n_layers, n_experts), dtype=bool)
        for layer in range(n_layers):
            size = int(rng.integers(0, min(max_size, n_experts) + 1))
            nonzero = int(np.count_nonzero(pop[layer]))
            u[layer, rng.choice(n_experts, size=min(size, nonzero), replace=False, p=pop[layer])] = True
        unions.append(u)
    return unions


# --------------------------------------------------------------------------- random unions
@core_settings(100)
@given(st.sampled_from(["per_layer", "global"]), st.sampled_from(EVICTION_POLICIES), st.booleans(),
       st.integers(1, 4), st.integers(1, 130), st.data())
def test_the_replays_admit_of_all_layers_in_one_call_equals_admit(mode, policy, with_keep, n_layers, n_experts, data):
    # the replay admits a cycle's layers in one compiled call (kernels.cache.admit_cycle); the
    # cache's admit calls the same rule once per layer and reports each layer: both must leave the
    # same state (residency, scores, slots, counters) and count the same hits and misses
    from specfit import kernels

    limit = n_experts if mode == "per_layer" else n_layers * n_experts
    capacity = data.draw(st.integers(0, limit + 2), label="capacity")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    steps = data.draw(st.integers(1, 20), label="steps")
    max_size = data.draw(st.integers(1, n_experts), label="max_size")
    rng = np.random.default_rng(seed)
    one = ExpertCache(n_layers, n_experts, capacity, mode=mode, policy=policy)
    per_layer = ExpertCache(n_layers, n_experts, capacity, mode=mode, policy=policy)
    words = (n_experts + 63) // 64
    admitted = np.empty((n_layers, words), dtype=np.uint64)
    cand = [np.empty(max(capacity, 1), dtype=np.int64) for _ in range(2)]
    evicted = np.empty(n_layers * max(capacity, 1), dtype=np.int64)
    for step, union in enumerate(random_unions(seed, n_layers, n_experts, steps, max_size)):
        keep = rng.integers(0, 4, size=union.shape).astype(float) if with_keep else None   # ties happen
        hits, misses = kernels.cache.admit_cycle(kernels.bitsets.pack_mask(union), *one.kernel_state(),
                                                 one.kernel_keep(keep), admitted, evicted, *cand)
        result = per_layer.admit(union, keep=keep)
        if step % 7 == 6:        # a new request's decoding
            one.begin_decode()
            per_layer.begin_decode()
        assert (hits, misses) == (int(result.hits.sum()), int(result.misses.sum())), step
        for a, b in zip(one.kernel_state(), per_layer.kernel_state()):
            assert np.array_equal(a, b), step


@core_settings(200)
@given(st.integers(1, 4), st.integers(1, 10), st.data())
def test_per_layer_lru_matches_the_reference_on_random_unions(n_layers, n_experts, data):
    capacity = data.draw(st.integers(0, n_experts + 2), label="capacity")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    steps = data.draw(st.integers(1, 25), label="steps")
    max_size = data.draw(st.integers(1, n_experts), label="max_size")
    unions = random_unions(seed, n_layers, n_experts, steps, max_size)
    cache = ExpertCache(n_layers, n_experts, capacity)
    replay(cache, RefLRUCache(n_layers, n_experts, capacity), unions)


@core_settings(200)
@given(st.integers(1, 4), st.integers(1, 8), st.data())
def test_global_lru_matches_the_reference_on_random_unions(n_layers, n_experts, data):
    capacity = data.draw(st.integers(0, n_layers * n_experts + 2), label="capacity")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    steps = data.draw(st.integers(1, 25), label="steps")
    max_size = data.draw(st.integers(1, n_experts), label="max_size")
    unions = random_unions(seed, n_layers, n_experts, steps, max_size)
    cache = ExpertCache(n_layers, n_experts, capacity, mode="global")
    replay(cache, RefLRUCache(n_layers, n_experts, capacity, mode="global"), unions)


@core_settings(200)
@given(st.sampled_from(["per_layer", "global"]), st.sampled_from(EVICTION_POLICIES), st.integers(1, 4),
       st.integers(1, 10), st.data())
def test_every_policy_matches_the_score_reference_on_random_unions(mode, policy, n_layers, n_experts, data):
    # RefCache scores residents with explicit tuples: lru the last touch, lfu (touches since
    # admission, last touch), fifo the admission, moe-infinity (fetches since the request's decoding
    # began, layer, expert); the victim is the smallest outside the union
    limit = n_experts if mode == "per_layer" else n_layers * n_experts
    capacity = data.draw(st.integers(0, limit + 2), label="capacity")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    steps = data.draw(st.integers(1, 25), label="steps")
    max_size = data.draw(st.integers(1, n_experts), label="max_size")
    cache = ExpertCache(n_layers, n_experts, capacity, mode=mode, policy=policy)
    ref = RefCache(n_layers, n_experts, capacity, mode=mode, policy=policy)
    requests = set(data.draw(st.lists(st.integers(0, steps - 1), max_size=3), label="requests"))
    for step, union in enumerate(random_unions(seed, n_layers, n_experts, steps, max_size)):
        if step in requests:     # a new request's decoding begins
            cache.begin_decode()
            ref.begin_decode()
        result = cache.admit(union)
        for layer in range(n_layers):
            hits, misses = ref.admit_ids(layer, np.flatnonzero(union[layer]).tolist())
            assert (int(result.hits[layer]), int(result.misses[layer])) == (hits, misses), step
        assert np.array_equal(cache.resident(), ref.resident()), step
    for k in ("hits", "misses", "evictions", "streamed"):
        assert getattr(cache, k).tolist() == ref.totals[k], k


def test_per_layer_lru_hand_example():
    # one layer, 3 slots
    cache = ExpertCache(1, 8, 3)
    r = cache.admit(np.isin(np.arange(8), [5, 1])[None])
    assert (r.hits.tolist(), r.misses.tolist(), r.evictions.tolist()) == ([0], [2], [0])
    cache.admit(np.isin(np.arange(8), [2])[None])          # order (old -> new): 1, 5, 2
    cache.admit(np.isin(np.arange(8), [1])[None])          # hit: 5, 2, 1
    r = cache.admit(np.isin(np.arange(8), [1, 6])[None])   # 6 evicts 5: 2, 1, 6
    assert r.evicted_mask[0].nonzero()[0].tolist() == [5]
    assert (r.hits.tolist(), r.misses.tolist(), r.evictions.tolist(), r.streamed.tolist()) == ([1], [1], [1], [0])
    # union of 5 > 3 slots: hits 1, 6 stay; misses 0, 3, 4 in ascending id: 0 takes 2's slot,
    # 3 and 4 are streamed
    r = cache.admit(np.isin(np.arange(8), [0, 1, 3, 4, 6])[None])
    assert r.admitted_mask[0].nonzero()[0].tolist() == [0]
    assert r.streamed_mask[0].nonzero()[0].tolist() == [3, 4]
    assert (r.hits.tolist(), r.misses.tolist(), r.evictions.tolist(), r.streamed.tolist()) == ([2], [3], [1], [2])
    assert cache.resident()[0].nonzero()[0].tolist() == [0, 1, 6]


def test_hits_are_touched_before_admitted_misses():
    # in one admit: hit 3 is older than admitted miss 0, so 3 goes first
    cache = ExpertCache(1, 6, 2)
    cache.admit(np.isin(np.arange(6), [3])[None])
    cache.admit(np.isin(np.arange(6), [0, 3])[None])
    r = cache.admit(np.isin(np.arange(6), [5])[None])
    assert r.evicted_mask[0].nonzero()[0].tolist() == [3]
    # within one group, ascending id: 1 before 4
    cache = ExpertCache(1, 6, 2)
    cache.admit(np.isin(np.arange(6), [4, 1])[None])
    r = cache.admit(np.isin(np.arange(6), [2])[None])
    assert r.evicted_mask[0].nonzero()[0].tolist() == [1]


# --------------------------------------------------------------------------- admit_layer
def layer_steps(seed: int, n_layers: int, n_experts: int, steps: int, max_size: int):
    """(layer, ids) steps: a layer-by-layer forward pass repeated, each layer's union random."""
    rng = np.random.default_rng(seed)
    out = []
    for union in random_unions(seed, n_layers, n_experts, steps, max_size):
        for layer in range(n_layers):
            ids = np.flatnonzero(union[layer])
            out.append((layer, rng.permutation(ids) if rng.random() < 0.3 else ids))   # any order is a set
    return out


def one_row(n_layers, n_experts, layer, ids):
    union = np.zeros((n_layers, n_experts), dtype=bool)
    union[layer, ids] = True
    return union


@core_settings(150)
@given(st.sampled_from(["per_layer", "global"]), st.integers(1, 4), st.integers(1, 10), st.data())
def test_admit_layer_matches_the_reference_lru(mode, n_layers, n_experts, data):
    limit = n_experts if mode == "per_layer" else n_layers * n_experts
    capacity = data.draw(st.integers(0, limit + 2), label="capacity")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    cache = ExpertCache(n_layers, n_experts, capacity, mode=mode)
    ref = RefLRUCache(n_layers, n_experts, capacity, mode=mode)
    totals = {k: np.zeros(n_layers, dtype=np.int64) for k in ("hits", "misses", "evictions", "streamed")}
    for step, (layer, ids) in enumerate(layer_steps(seed, n_layers, n_experts, 12, n_experts)):
        got = cache.admit_layer(layer, ids)
        want = ref.admit(one_row(n_layers, n_experts, layer, ids))
        assert got.hit_ids.tolist() == np.flatnonzero(want["hit_mask"][layer]).tolist(), step
        assert got.admitted_ids.tolist() == np.flatnonzero(want["admitted_mask"][layer]).tolist(), step
        assert got.streamed_ids.tolist() == np.flatnonzero(want["streamed_mask"][layer]).tolist(), step
        assert got.evicted.tolist() == np.argwhere(want["evicted_mask"]).tolist(), step
        for arr in (got.hit_ids, got.admitted_ids, got.streamed_ids, got.evicted):
            assert arr.dtype == np.int64
        assert got.evicted.shape == (got.evictions, 2)
        assert (got.hits, got.misses, got.evictions, got.streamed) == (
            int(want["hits"][layer]), int(want["misses"][layer]), int(want["evictions"].sum()),
            int(want["streamed"][layer]))
        assert np.array_equal(cache.resident(), ref.resident()), step
        for k in totals:
            totals[k] += want[k]
    for k, v in totals.items():
        assert getattr(cache, k).tolist() == v.tolist(), f"cumulative {k}"


def test_admit_layer_leaves_other_layers_alone_in_per_layer_mode():
    cache = ExpertCache(3, 6, 2)
    cache.admit(np.array([[1, 1, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1]], dtype=bool))
    before = cache.resident()
    r = cache.admit_layer(1, np.array([5, 0]))
    after = cache.resident()
    assert np.array_equal(after[[0, 2]], before[[0, 2]])
    assert r.admitted_ids.tolist() == [0, 5] and r.evicted.tolist() == [[1, 2], [1, 3]]
    assert cache.hits.tolist() == [0, 0, 0] and cache.misses.tolist() == [2, 4, 2]


@pytest.mark.parametrize("layer, ids, name", [
    (3, [0], "layer"), (-1, [0], "layer"), (1.0, [0], "layer"), (True, [0], "layer"),
    (0, [6], "expert_ids"), (0, [-1], "expert_ids"), (0, [[0]], "expert_ids"), (0, [0.5], "expert_ids"),
])
def test_admit_layer_rejects_bad_input_naming_it(layer, ids, name):
    cache = ExpertCache(3, 6, 2)
    with pytest.raises(ValueError, match=name):
        cache.admit_layer(layer, np.array(ids))
    assert not cache.resident().any() and cache.misses.sum() == 0


# --------------------------------------------------------------------------- real routing
def load_routing():
    path = find_shared_data(ROUTING)
    if path is None:
        pytest.skip(f"{ROUTING} not found in ../shared/data (relative to the repository); "
                    "the real-routing cache check needs it")
    with np.load(path) as data:
        return np.asarray(data["expert_ids"][:2000], dtype=np.int64)


def routing_unions(expert_ids: np.ndarray, tokens_per_cycle: int, n_experts: int = 64):
    n_tokens, n_layers, _ = expert_ids.shape
    unions = []
    for start in range(0, n_tokens, tokens_per_cycle):
        u = np.zeros((n_layers, n_experts), dtype=bool)
        block = expert_ids[start:start + tokens_per_cycle]
        u[np.broadcast_to(np.arange(n_layers)[None, :, None], block.shape), block] = True
        unions.append(u)
    return unions


@pytest.fixture(scope="module")
def routing():
    return load_routing()


@pytest.mark.parametrize("tokens_per_cycle", [1, 4])
@pytest.mark.parametrize("capacity", [0, 8, 16, 32, 64])
def test_per_layer_lru_matches_the_reference_on_real_routing(routing, capacity, tokens_per_cycle):
    assert routing.shape[1:] == (16, 8) and routing.max() < 64
    unions = routing_unions(routing, tokens_per_cycle)
    cache = ExpertCache(16, 64, capacity)
    ref = RefLRUCache(16, 64, capacity)
    replay(cache, ref, unions)
    if capacity == 0:
        assert cache.hits.sum() == 0
    if capacity == 64:
        assert cache.evictions.sum() == 0 and cache.streamed.sum() == 0


@pytest.mark.parametrize("capacity", [0, 100, 256, 1024])
def test_global_lru_matches_the_reference_on_real_routing(routing, capacity):
    unions = routing_unions(routing[:600], 2)
    replay(ExpertCache(16, 64, capacity, mode="global"), RefLRUCache(16, 64, capacity, mode="global"), unions)


# --------------------------------------------------------------------------- capacity edge cases
@pytest.mark.parametrize("mode", ["per_layer", "global"])
@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_capacity_zero_streams_everything(mode, policy):
    cache = ExpertCache(3, 6, 0, mode=mode, policy=policy, expert_bytes=10)
    for union in random_unions(1, 3, 6, 20, 6):
        r = cache.admit(union)
        assert r.hits.tolist() == [0, 0, 0]
        assert r.misses.tolist() == union.sum(axis=1).tolist()
        assert r.streamed.tolist() == union.sum(axis=1).tolist()
        assert r.evictions.tolist() == [0, 0, 0]
        assert not r.admitted_mask.any() and np.array_equal(r.streamed_mask, union)
        assert not cache.resident().any()
    assert cache.bytes_h2d == int(cache.misses.sum()) * 10
    assert cache.hit_rate == 0.0


@pytest.mark.parametrize("mode, capacity", [("per_layer", 6), ("per_layer", 100), ("global", 18), ("global", 500)])
@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_capacity_of_everything_never_evicts(mode, capacity, policy):
    cache = ExpertCache(3, 6, capacity, mode=mode, policy=policy)
    seen = np.zeros((3, 6), dtype=bool)
    for union in random_unions(2, 3, 6, 30, 4):
        r = cache.admit(union)
        assert r.evictions.tolist() == [0, 0, 0] and r.streamed.tolist() == [0, 0, 0]
        assert np.array_equal(r.hit_mask, union & seen)
        assert np.array_equal(r.admitted_mask, union & ~seen)
        seen |= union
        assert np.array_equal(cache.resident(), seen)


def test_counters_bytes_and_hit_rate():
    cache = ExpertCache(2, 4, 2, expert_bytes=1000)
    assert np.isnan(cache.hit_rate) and cache.bytes_h2d == 0       # no lookup yet: no rate
    u = np.array([[True, True, False, False], [True, False, False, False]])
    cache.admit(u)          # 3 misses
    cache.admit(u)          # 3 hits
    assert cache.hits.tolist() == [2, 1] and cache.misses.tolist() == [2, 1]
    assert cache.bytes_h2d == 3000
    assert cache.hit_rate == 0.5
    cache.reset()
    assert not cache.resident().any() and cache.misses.sum() == 0


def test_warm_marks_resident_without_counting():
    cache = ExpertCache(2, 4, 2)
    warm = np.array([[True, False, True, False], [False, True, False, False]])
    cache.warm(warm)
    assert np.array_equal(cache.resident(), warm)
    assert cache.hits.sum() == cache.misses.sum() == cache.evictions.sum() == 0
    r = cache.admit(warm)
    assert r.hits.tolist() == [2, 1] and r.misses.tolist() == [0, 0]


@pytest.mark.parametrize("mode, capacity, kept", [
    ("per_layer", 2, [[0, 1], [0, 1]]),
    ("global", 2, [[0, 1], []]),
    ("global", 4, [[0, 1, 2], [0]]),
])
def test_warm_beyond_capacity_keeps_the_first_in_ascending_layer_expert_order(mode, capacity, kept):
    # ExpertCache.warm: "the ones that fit are kept in ascending (layer, expert) order"
    cache = ExpertCache(2, 3, capacity, mode=mode)
    cache.warm(np.ones((2, 3), dtype=bool))
    assert [row.nonzero()[0].tolist() for row in cache.resident()] == kept


def test_resident_is_a_copy():
    cache = ExpertCache(1, 3, 2)
    cache.resident()[0, 0] = True
    assert not cache.resident().any()


# --------------------------------------------------------------------------- lfu, fifo, moe-infinity
def one_hot(ids, n_experts=6):
    return np.isin(np.arange(n_experts), ids)[None]


def test_fifo_evicts_the_oldest_admission_even_if_recently_hit():
    fifo = ExpertCache(1, 6, 2, policy="fifo")
    lru = ExpertCache(1, 6, 2, policy="lru")
    for cache in (fifo, lru):
        cache.admit(one_hot([0]))
        cache.admit(one_hot([1]))
        cache.admit(one_hot([0]))      # a hit: refreshes 0 under lru only
    assert fifo.admit(one_hot([2])).evicted_mask[0].nonzero()[0].tolist() == [0]
    assert lru.admit(one_hot([2])).evicted_mask[0].nonzero()[0].tolist() == [1]


def test_lfu_evicts_the_least_used_then_the_least_recent():
    lfu = ExpertCache(1, 6, 2, policy="lfu")
    lfu.admit(one_hot([0]))
    lfu.admit(one_hot([0]))            # 0 used twice
    lfu.admit(one_hot([1]))            # 1 used once, more recent
    assert lfu.admit(one_hot([2])).evicted_mask[0].nonzero()[0].tolist() == [1]
    # equal counts: the least recent goes
    lfu = ExpertCache(1, 6, 2, policy="lfu")
    lfu.admit(one_hot([3]))
    lfu.admit(one_hot([4]))
    assert lfu.admit(one_hot([5])).evicted_mask[0].nonzero()[0].tolist() == [3]


def test_moe_infinity_counts_fetches_across_evictions_until_a_request_begins_decoding():
    # lfu counts the uses since an expert was admitted; MoE-Infinity's dispatcher counts the
    # expert's fetches from the host since the request's decoding began (a hit runs uncounted),
    # kept when it is evicted and comes back
    caches = {p: ExpertCache(1, 6, 2, policy=p) for p in ("lfu", "moe-infinity")}
    for cache in caches.values():
        for ids in ([0], [0], [0], [1, 2], [1], [0], [3]):
            cache.admit(one_hot(ids))
    # [1, 2] evicts 0 under both. [0] comes back: lfu evicts 2 (1 use against 1's 2), moe-infinity
    # 1 (both fetched once: the lower id). For [3], lfu sees 0 with 1 use since its return and 1
    # with 2: 0 goes; moe-infinity sees 0 fetched twice in the request and 2 once: 2 goes
    assert caches["lfu"].resident()[0].nonzero()[0].tolist() == [1, 3]
    assert caches["moe-infinity"].resident()[0].nonzero()[0].tolist() == [0, 3]
    # a request's decoding begins: every count is 0, ties go to the lowest expert id
    caches["moe-infinity"].begin_decode()
    assert caches["moe-infinity"].admit(one_hot([5])).evicted_mask[0].nonzero()[0].tolist() == [0]
    caches["lfu"].begin_decode()      # the other policies keep their state: 3 (1 use) goes
    assert caches["lfu"].admit(one_hot([5])).evicted_mask[0].nonzero()[0].tolist() == [3]


def test_moe_infinity_does_not_count_hits():
    # 0 is fetched once and hit three times, 1 fetched once: equal counts, the lower id goes
    # (lfu, counting the hits, evicts 1)
    for policy, victim in (("moe-infinity", 0), ("lfu", 1)):
        cache = ExpertCache(1, 6, 2, policy=policy)
        for ids in ([0], [0], [0], [0], [1]):
            cache.admit(one_hot(ids))
        assert cache.admit(one_hot([2])).evicted_mask[0].nonzero()[0].tolist() == [victim], policy


def test_moe_infinity_warm_experts_count_one_fetch_each():
    # warm marks experts as touched once: under moe-infinity a warm expert fetched once with a
    # larger id outlasts an admitted one fetched once with a smaller id
    cache = ExpertCache(1, 6, 2, policy="moe-infinity")
    cache.warm(one_hot([1]))
    cache.admit(one_hot([0]))
    assert cache.admit(one_hot([2])).evicted_mask[0].nonzero()[0].tolist() == [0]


def find_expert_evict(cached: set, counts: dict, protected: set):
    """MoE-Infinity's ``ExpertDispatcher::FindExpertEvict`` transcribed: the cached keys
    ``(layer << 32) + expert`` in ascending order (our tie rule: MoE-Infinity scans a
    ``std::unordered_set``, in its library's order), the first with a count below every earlier
    one (``<``), skipping the keys the current call holds (the layer's union here)."""
    best, low = None, None
    for key in sorted(cached):
        if key in protected:
            continue
        if low is None or counts.get(key, 0) < low:
            best, low = key, counts.get(key, 0)
    return best


@core_settings(100)
@given(st.integers(1, 4), st.integers(2, 9), st.data())
def test_moe_infinity_global_mode_matches_the_dispatchers_victim_search(n_layers, n_experts, data):
    # the dispatcher's decode path: for each expert a layer runs (ascending id), a resident one
    # runs at once, uncounted; a miss takes a free byte range or evicts FindExpertEvict's choice,
    # and its fetch counts one; with nothing evictable it runs without staying (our streamed
    # miss), its fetch still counted. Its prompt path (a pass of more than one token): a miss
    # with no free range runs in the one extra slot and goes back, evicting nothing
    capacity = data.draw(st.integers(0, n_layers * n_experts), label="capacity")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    cache = ExpertCache(n_layers, n_experts, capacity, mode="global", policy="moe-infinity")
    cached, counts = set(), {}
    for step, union in enumerate(random_unions(seed, n_layers, n_experts, 25, n_experts)):
        if step % 9 == 7:
            cache.begin_prompt()                   # steps 7 and 8 of 9: a request's prompt passes
        if step % 9 == 0:
            cache.begin_decode()
            counts = {}                            # ClearExpertCacheCounts at the first token
        prompt = step % 9 in (7, 8)
        result = cache.admit(union)
        evicted = []
        for layer in range(n_layers):
            keys = [(layer << 32) + int(e) for e in np.flatnonzero(union[layer])]
            for key in keys:
                if key in cached:
                    continue
                if len(cached) >= capacity and not prompt:
                    victim = find_expert_evict(cached, counts, set(keys))
                    if victim is not None:
                        cached.discard(victim)
                        evicted.append(victim)
                if len(cached) < capacity:
                    cached.add(key)
                counts[key] = counts.get(key, 0) + 1
        got = [(int(layer) << 32) + int(e) for layer, e in zip(*np.nonzero(result.evicted_mask))]
        # an expert admitted at one layer may be evicted again at a later one: the mask holds it once
        assert sorted(got) == sorted(set(evicted)) and int(result.evictions.sum()) == len(evicted), step
        expected = np.zeros((n_layers, n_experts), dtype=bool)
        for key in cached:
            expected[key >> 32, key & 0xFFFFFFFF] = True
        assert np.array_equal(cache.resident(), expected), step


@pytest.mark.parametrize("mode", ["per_layer", "global"])
def test_moe_infinitys_prompt_passes_evict_nothing_and_other_rules_evict_as_always(mode):
    """Between begin_prompt and begin_decode a moe-infinity cache admits a miss only into a free
    slot and streams the rest (MoE-Infinity's one extra slot for a prompt's miss, sent back after);
    decoding evicts again, and so does a reset cache. LRU's prompt passes evict as always."""
    for policy in ("moe-infinity", "lru"):
        cache = ExpertCache(1, 6, 3, mode=mode, policy=policy)
        cache.admit(one_hot([0, 1]))
        cache.begin_prompt()
        result = cache.admit(one_hot([2, 3, 4]))
        if policy == "moe-infinity":
            assert result.admitted_mask[0].nonzero()[0].tolist() == [2] and not result.evicted_mask.any()
            assert result.streamed_mask[0].nonzero()[0].tolist() == [3, 4]
            assert cache.resident()[0].nonzero()[0].tolist() == [0, 1, 2]
            assert cache.admit_layer(0, np.array([5])).evictions == 0        # layer by layer, as live
        else:
            assert cache.resident()[0].nonzero()[0].tolist() == [2, 3, 4] and result.evictions.sum() == 2
        cache.begin_decode()
        assert cache.admit(one_hot([5])).evictions.sum() == 1, policy
        cache.begin_prompt()
        cache.reset()                                                         # decoding again
        cache.admit(one_hot([0, 1, 2]))
        assert cache.admit(one_hot([3])).evictions.sum() == 1, policy


def test_a_count_of_millions_keeps_its_expert_hot_rather_than_overflowing():
    """lfu's and moe-infinity's scores put the count above 2^40: a count past 2^23 (a long run's
    hot expert) once overflowed int64 into a negative score, and that expert went first."""
    from specfit import kernels

    cache = ExpertCache(1, 6, 2, policy="lfu")
    cache.admit(one_hot([0]))
    cache._count[0, 0] = 2**23 + 5          # used millions of times since its admission
    cache.admit(one_hot([0]))                # a hit: its score is recomputed from the count
    cache.admit(one_hot([1]))
    assert cache.admit(one_hot([2])).evicted_mask[0].nonzero()[0].tolist() == [1]
    for count in (2**22, 2**23, 2**40):
        assert kernels.cache._request_score(count, 0, 3, 6) > kernels.cache._request_score(1, 0, 3, 6) > 0


def test_a_prefetch_levers_copy_is_not_counted_under_moe_infinity():
    cache = ExpertCache(1, 6, 2, policy="moe-infinity")
    cache.admit(one_hot([0]))          # 0: fetched once
    cache.prefetch(one_hot([1]))       # 1 copied ahead by the lever, not counted
    cache.prefetch(one_hot([1]))
    cache.prefetch(one_hot([1]))
    # 1 has no fetch counted: it goes before 0 (counting the copy would tie them, and 0, the
    # lower id, would go)
    assert cache.admit(one_hot([2])).evicted_mask[0].nonzero()[0].tolist() == [1]


@pytest.mark.parametrize("policy", ["lfu", "fifo", "moe-infinity"])
def test_other_policies_keep_the_same_counts_and_union_rules(policy):
    # whatever the victim order, the counts, the union protection and the capacity bound hold
    cache = ExpertCache(3, 8, 3, policy=policy)
    previous = np.zeros((3, 8), dtype=bool)
    for union in random_unions(5, 3, 8, 40, 5):
        r = cache.admit(union)
        resident = cache.resident()
        assert np.array_equal(r.hit_mask, union & previous)
        assert np.array_equal(r.hit_mask | r.admitted_mask | r.streamed_mask, union)
        assert not (r.evicted_mask & union).any()
        assert (resident.sum(axis=1) <= 3).all()
        keep = np.minimum(union.sum(axis=1), 3)
        assert ((resident & union).sum(axis=1) == keep).all()
        assert r.evictions.tolist() == r.evicted_mask.sum(axis=1).tolist()
        previous = resident


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs, name", [
    (dict(n_layers=0, n_experts=4, capacity=2), "n_layers"),
    (dict(n_layers=2, n_experts=0, capacity=2), "n_experts"),
    (dict(n_layers=2, n_experts=4, capacity=-1), "capacity"),
    (dict(n_layers=2, n_experts=4, capacity=2, mode="shared"), "mode"),
    (dict(n_layers=2, n_experts=4, capacity=2, policy="random"), "policy"),
])
def test_constructor_rejects_bad_arguments_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ExpertCache(**kwargs)


@pytest.mark.parametrize("union", [
    np.zeros((2, 3), dtype=bool),       # wrong number of experts
    np.zeros((3, 4), dtype=bool),       # wrong number of layers
    np.zeros(8, dtype=bool),
    np.zeros((2, 4), dtype=np.int64),   # not bool
])
def test_admit_rejects_a_bad_union_naming_it(union):
    cache = ExpertCache(2, 4, 2)
    with pytest.raises(ValueError, match="union"):
        cache.admit(union)
    assert not cache.resident().any()


def test_warm_rejects_a_bad_shape():
    with pytest.raises(ValueError, match="resident"):
        ExpertCache(2, 4, 2).warm(np.zeros((4, 2), dtype=bool))


def test_staging_buffers_only_where_an_expert_may_stream():
    from specfit.experts.cache import ExpertCache

    assert ExpertCache.staging_buffers(7, 8) == 2
    assert ExpertCache.staging_buffers(8, 8) == 0
    # a moe-infinity prompt pass evicts nothing: a miss with no free slot streams, unless every
    # expert has a slot (8 a layer; 3 layers x 8 in global mode)
    assert ExpertCache.staging_buffers(64, 8, "moe-infinity", limit=3 * 8) == 0
    assert ExpertCache.staging_buffers(16, 8, "moe-infinity", limit=3 * 8) == 2
    assert ExpertCache.staging_buffers(8, 8, "moe-infinity", limit=8) == 0


def test_negative_keep_priorities_are_refused():
    from specfit.experts.cache import ExpertCache

    cache = ExpertCache(1, 4, 2)
    with pytest.raises(ValueError, match="keep: expected finite non-negative"):
        cache.admit(np.array([[True, False, False, False]]), keep=-np.ones((1, 4)))
