"""Belady's offline optimum against a dynamic program over every residency set, and against the
online cache policies it must never lose to."""

from itertools import combinations

import numpy as np
import pytest

from specfit.experts.belady import belady_counts
from specfit.experts.cache import EVICTION_POLICIES, ExpertCache


def fewest_misses(requests: list[set], capacity: int, start: frozenset = frozenset(), counted=None) -> int:
    """Minimum total misses over every choice of what stays resident after each cycle (any
    ``capacity`` items of what was resident or needed), by dynamic programming over the sets;
    the requests not ``counted`` are served without their misses counted."""
    best = {start: 0}
    for t, need in enumerate(requests):
        nxt: dict[frozenset, int] = {}
        for held, cost in best.items():
            cost += len(need - held) if counted is None or counted[t] else 0
            pool = sorted(held | need)
            for size in range(min(capacity, len(pool)) + 1):
                for keep in combinations(pool, size):
                    key = frozenset(keep)
                    if cost < nxt.get(key, 1 << 30):
                        nxt[key] = cost
        best = nxt
    return min(best.values())


def random_unions(rng, cycles, n_layers, n_experts, max_size):
    unions = []
    for _ in range(cycles):
        items = []
        for layer in range(n_layers):
            size = int(rng.integers(0, max_size + 1))
            items.extend(layer * n_experts + rng.choice(n_experts, size, replace=False))
        unions.append(np.array(sorted(items), dtype=np.int64))
    return unions


@pytest.mark.parametrize("seed", range(12))
def test_one_layer_equals_the_dynamic_program(seed):
    rng = np.random.default_rng(seed)
    E, C = 5, int(rng.integers(1, 4))
    unions = random_unions(rng, 7, 1, E, 3)
    hits, misses = belady_counts(unions, 1, E, C)
    assert int(misses.sum()) == fewest_misses([set(u.tolist()) for u in unions], C)
    assert (hits + misses).tolist() == [u.size for u in unions]


@pytest.mark.parametrize("seed", range(6))
def test_per_layer_is_the_sum_of_independent_layers(seed):
    rng = np.random.default_rng(100 + seed)
    L, E, C = 3, 4, 2
    unions = random_unions(rng, 6, L, E, 3)
    _, misses = belady_counts(unions, L, E, C)
    total = 0
    for layer in range(L):
        reqs = [{i - layer * E for i in u.tolist() if layer * E <= i < (layer + 1) * E} for u in unions]
        total += fewest_misses(reqs, C)
    assert int(misses.sum()) == total


@pytest.mark.parametrize("seed", range(6))
def test_global_mode_equals_the_dynamic_program_over_all_items(seed):
    rng = np.random.default_rng(200 + seed)
    L, E, C = 2, 3, 3
    unions = random_unions(rng, 6, L, E, 2)
    _, misses = belady_counts(unions, L, E, C, mode="global")
    assert int(misses.sum()) == fewest_misses([set(u.tolist()) for u in unions], C)


def test_a_warm_start_is_honoured():
    unions = [np.array([0, 1]), np.array([0, 2])]
    resident = np.array([[True, True, False]])
    hits, misses = belady_counts(unions, 1, 3, 2, resident=resident)
    assert hits.tolist() == [2, 1] and misses.tolist() == [0, 1]
    assert int(misses.sum()) == fewest_misses([{0, 1}, {0, 2}], 2, start=frozenset({0, 1}))


def test_no_capacity_misses_everything():
    unions = [np.array([0, 1]), np.array([0, 1])]
    hits, misses = belady_counts(unions, 1, 4, 0)
    assert hits.tolist() == [0, 0] and misses.tolist() == [2, 2]


@pytest.mark.parametrize("seed", range(24))
def test_requests_served_but_not_counted_equal_the_dynamic_program(seed):
    # a prompt's pass: its experts are admitted (the cache plans for them) and not charged
    rng = np.random.default_rng(100 + seed)
    E, C = 5, int(rng.integers(1, 4))
    unions = random_unions(rng, 8, 1, E, 3)
    counted = rng.random(8) > 0.3
    hits, misses = belady_counts(unions, 1, E, C, counted=counted)
    assert misses.size == counted.sum()
    assert int(misses.sum()) == fewest_misses([set(u.tolist()) for u in unions], C, counted=counted)
    assert (hits + misses).tolist() == [u.size for u, c in zip(unions, counted) if c]


@pytest.mark.parametrize("passes", [{"prefill_experts": [[[0, 1, 3]]]},
                                    {"prefill_experts": [[[3]], [[0, 1]]], "prefill_pass_counts": [2]}])
@pytest.mark.parametrize("cache_experts", [1, 2, 3, 4])
def test_the_ceiling_of_a_replay_serves_its_prompt_passes_too(cache_experts, passes):
    """A recorded trace's prompt passes (one, or one per chunk) are admitted before its sequence's
    first cycle; the ceiling counted from an empty cache on the cycles alone was above LRU's own
    misses (3 against 0-2)."""
    from trace_helpers import hand_trace

    from specfit.calibrate.presets import SHAPES, preset_profile
    from specfit.experts.belady import belady_of_log
    from specfit.policies import make_policy
    from specfit.simulate.replay import prepare, replay

    trace = hand_trace()
    trace.meta["recording"].update(prefill_sequences=[0], **passes)
    prep = prepare("hand+prefill", trace, trace.true_experts)
    assert prep.has_prefill.all()
    cost = preset_profile("gh200", SHAPES["qwen3-30b-a3b"]).cost
    log = replay(prep, make_policy("ar"), ExpertCache(1, 4, cache_experts), cost, record_unions=True)
    hits, misses = belady_of_log(log, 1, 4, cache_experts)
    assert misses.size == len(log) and (hits + misses).tolist() == log.columns["union_size"].tolist()
    assert int(misses.sum()) <= int(log.columns["misses"].sum())
    assert int(belady_counts(log.unions, 1, 4, cache_experts)[1].sum()) == 3     # the prompt's pass left out


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
@pytest.mark.parametrize("mode", ["per_layer", "global"])
def test_never_more_misses_than_an_online_cache(policy, mode):
    rng = np.random.default_rng(7)
    L, E = 3, 12
    C = 5 if mode == "per_layer" else 14
    unions = random_unions(rng, 60, L, E, 6)
    cache = ExpertCache(L, E, C, mode=mode, policy=policy)
    online = 0
    for items in unions:
        mask = np.zeros(L * E, dtype=bool)
        mask[items] = True
        online += cache.admit(mask.reshape(L, E)).total_misses
    _, misses = belady_counts(unions, L, E, C, mode=mode)
    assert int(misses.sum()) <= online


@pytest.mark.parametrize("mode", ["per_layer", "global"])
def test_a_warm_start_one_expert_over_the_capacity_is_refused(mode):
    resident = np.array([[True, True, True, False]])          # 3 resident, capacity 2
    with pytest.raises(ValueError, match="capacity"):
        belady_counts([np.array([0])], 1, 4, 2, mode=mode, resident=resident)


def test_a_warm_start_at_the_capacity_is_accepted():
    resident = np.array([[True, True, False, False]])
    hits, misses = belady_counts([np.array([0, 2])], 1, 4, 2, resident=resident)
    assert hits.tolist() == [1] and misses.tolist() == [1]
