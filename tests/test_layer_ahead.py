"""The layer-ahead prefetch's ceiling: hand-computed windows, an event-by-event reference, the
ceiling property, the transition ranker's counts, and the recharge against the replay's own."""

import numpy as np
import pytest

from specfit import CostModel, ExpertCache
from specfit.calibrate.presets import SHAPES, preset_profile
from specfit.experts.layer_ahead import TransitionRanker, layer_ahead
from specfit.policies import Observation, make_policy
from specfit.simulate.replay import prepare, replay
from specfit.traces.format import read_trace

from bench_helpers import bench_module
from test_belady import random_unions
from trace_helpers import SAMPLE_OLMOE

# two layers: a window of 0.1 s + 0.01 s per expert of the union; a copy takes 0.05 s
COST = CostModel(base_s=0.2, per_node_s=0.0, hit_s=0.01, miss_s=0.06, draft_level_s=0.0)


def _fixed(order, p=1.0):
    """A ranker that offers the same candidates (layer 1 of 2) every cycle, each needed with
    probability ``p``."""
    return lambda cycle, union: (np.array([order], dtype=np.int64), np.full((1, len(order)), p))


def test_hand_computed_windows_with_no_cache():
    # layer 0 needs {0, 1}, layer 1 needs {1, 2, 3}: layer 0 computes 0.1 + 2 x 0.01 = 0.12 s
    unions = [np.array([0, 1, 4 + 1, 4 + 2, 4 + 3])]
    perfect = layer_ahead(unions, np.array([2]), np.array([0]), 2, 4, 0, COST)
    assert perfect.misses[0] == 5 and perfect.hits[0] == 0
    assert perfect.time_s[0] == pytest.approx(0.2 + 5 * 0.06)
    # three misses (0.15 s of copies) in a 0.12 s window
    assert perfect.hidden_s[0] == pytest.approx(0.12)
    assert perfect.copies[0] == 3 and perfect.useful[0] == 3
    # ranked 3, 0, 2, 1: the copy of 3 is whole in the window (0.05), 0 is wasted (0.05-0.10),
    # 2 has 0.02 s of its copy inside the window, 1 is not started
    ranked = layer_ahead(unions, np.array([2]), np.array([0]), 2, 4, 0, COST, rank=_fixed([3, 0, 2, 1]))
    assert ranked.hidden_s[0] == pytest.approx(0.05 + 0.02)
    assert ranked.copies[0] == 3 and ranked.useful[0] == 2
    assert ranked.precision == pytest.approx(2 / 3)
    # ranked 3, 2, 0, 1: 3 and 2 hide 0.05 each; the copy of 0, wasted, runs 0.03 s past the window
    wasted = layer_ahead(unions, np.array([2]), np.array([0]), 2, 4, 0, COST, rank=_fixed([3, 2, 0, 1]))
    assert wasted.hidden_s[0] == pytest.approx(0.05 + 0.05 - 0.03)
    np.testing.assert_allclose(ranked.time_with_overlap_s, ranked.time_s - ranked.hidden_s)
    # at even odds the copy that would run 0.03 s past the window for 0.02 s inside is not started
    for order, hidden, copies in (([3, 0, 2, 1], 0.05, 2), ([3, 2, 0, 1], 0.10, 2)):
        even = layer_ahead(unions, np.array([2]), np.array([0]), 2, 4, 0, COST, rank=_fixed(order, 0.5))
        assert even.hidden_s[0] == pytest.approx(hidden) and even.copies[0] == copies


def test_the_ceiling_counts_as_useful_only_the_copies_it_started():
    """Three layers, all missing: 12, 4 and 4 experts. The windows before layers 1 and 2 hold 3
    and 1 copies: 4 started, all useful (the slots run to the widest window, which once counted
    layer 2's unstarted misses as useful: precision 1.5)."""
    E = 16
    unions = [np.array(list(range(12)) + [E + e for e in range(4)] + [2 * E + e for e in range(4)])]
    cost = CostModel(base_s=0.0, per_node_s=0.0, hit_s=0.25, miss_s=1.25, draft_level_s=0.0)
    out = layer_ahead(unions, np.array([1]), np.array([1]), 3, E, 16, cost)
    assert out.copies[0] == 4 and out.useful[0] == 4 and out.precision == 1.0
    assert out.hidden_s[0] == pytest.approx(4.0)


def test_no_window_hides_nothing():
    free = CostModel(base_s=0.0, per_node_s=0.0, hit_s=0.0, miss_s=0.05, draft_level_s=0.0)
    for rank in (None, _fixed([3, 0, 2, 1])):
        out = layer_ahead([np.array([0, 4 + 3])], np.array([1]), np.array([0]), 2, 4, 0, free, rank=rank)
        assert out.hidden_s[0] == 0 and out.copies[0] == 0 and out.time_s[0] == pytest.approx(0.1)


def test_resident_candidates_need_no_copy():
    # the first cycle leaves {0, 1} resident at layer 0 and {1, 2} at layer 1 (two slots a layer)
    unions = [np.array([0, 1, 4 + 1, 4 + 2]), np.array([0, 1, 4 + 1, 4 + 2, 4 + 3])]
    nodes, levels = np.array([1, 1]), np.array([0, 0])
    ranked = layer_ahead(unions, nodes, levels, 2, 4, 2, COST, rank=_fixed([1, 3, 0, 2]))
    assert list(ranked.misses) == [4, 1] and list(ranked.hits) == [0, 4]
    # cycle 2: 1 and 2 are resident and skipped; 3 is copied first (useful), then 0 (not)
    assert ranked.hidden_s[1] == pytest.approx(0.05)
    assert ranked.copies[1] == 2 and ranked.useful[1] == 1
    perfect = layer_ahead(unions, nodes, levels, 2, 4, 2, COST)
    assert perfect.hidden_s[1] == pytest.approx(0.05)


def _events(unions, nodes, n_layers, n_experts, capacity, cost, rank, mode="per_layer"):
    """Reference: each layer's window walked copy by copy, the link's clock carried from window to
    window, the cache admitting layer by layer (a global cache's earlier layers may evict a later
    one's experts before its window)."""
    transfer = cost.miss_s - cost.hit_s
    cache = ExpertCache(n_layers, n_experts, capacity, mode=mode)
    hidden = []
    for t, items in enumerate(unions):
        need = np.zeros((n_layers, n_experts), dtype=bool)
        need.flat[items] = True
        resident = cache.resident()
        cache.admit_layer(0, np.flatnonzero(need[0]))
        total, busy = 0.0, 0.0             # busy: the link's time still taken as the window opens
        for layer in range(n_layers - 1):
            if mode == "global":
                resident = cache.resident()                  # layers 0 .. layer admitted
            window = cost.base_s / n_layers + cost.per_node_s * nodes[t] / n_layers + need[layer].sum() * cost.hit_s
            if rank is None:
                candidates = [(e, 1.0) for e in range(n_experts) if need[layer + 1, e] and not resident[layer + 1, e]]
            else:
                ids, p = rank(t, need)
                candidates = [(e, q) for e, q in zip(ids[layer], p[layer]) if e >= 0 and not resident[layer + 1, e]]
            clock, copied, last_needed = busy, set(), False
            for e, q in candidates:
                if clock >= window:
                    break
                if clock + transfer > window and q * (window - clock) < (1 - q) * (clock + transfer - window):
                    break                                 # the last copy does not pay
                copied.add(e)
                last_needed = bool(need[layer + 1, e])
                if last_needed:
                    total += min(transfer, window - clock)
                clock += transfer
            # the link past the window's close, unless a needed copy runs on (its rest is that
            # layer's own transfer): it delays the next layer's copies, or takes from its window
            spill = 0.0 if (copied and last_needed) else max(clock - window, 0.0)
            if any(need[layer + 1, e] and not resident[layer + 1, e] and e not in copied for e in range(n_experts)):
                total -= spill
                busy = 0.0
            else:
                busy = spill
            cache.admit_layer(layer + 1, np.flatnonzero(need[layer + 1]))
        hidden.append(total)
    return np.array(hidden)


@pytest.mark.parametrize("mode", ["per_layer", "global"])
@pytest.mark.parametrize("seed", range(6))
def test_windows_equal_the_event_walk_and_no_ranker_beats_the_true_misses(seed, mode):
    rng = np.random.default_rng(seed)
    n_layers, n_experts = 3, 6
    capacity = int(rng.integers(0, 4)) * (n_layers if mode == "global" else 1)
    unions = random_unions(rng, 12, n_layers, n_experts, 4)
    nodes = rng.integers(1, 6, len(unions))
    cost = CostModel(base_s=0.03, per_node_s=0.004, hit_s=0.002, miss_s=0.002 + float(rng.uniform(0.003, 0.03)),
                     draft_level_s=0.0)
    orders = rng.permuted(np.tile(np.arange(n_experts), (len(unions), n_layers - 1, 1)), axis=2)
    orders[rng.random(orders.shape) < 0.2] = -1            # some rows offer fewer candidates

    chances = rng.random(orders.shape)

    def rank(cycle, union):
        return orders[cycle], chances[cycle]

    perfect = layer_ahead(unions, nodes, np.zeros(len(unions)), n_layers, n_experts, capacity, cost, mode=mode)
    ranked = layer_ahead(unions, nodes, np.zeros(len(unions)), n_layers, n_experts, capacity, cost, rank=rank,
                         mode=mode)
    for out, ranker in ((perfect, None), (ranked, rank)):
        np.testing.assert_allclose(out.hidden_s, _events(unions, nodes, n_layers, n_experts, capacity, cost, ranker,
                                                         mode), atol=1e-15)
    assert (ranked.hidden_s <= perfect.hidden_s + 1e-12).all()
    assert (perfect.hidden_s >= 0).all() and (perfect.hidden_s <= cost.miss_s * perfect.misses).all()
    np.testing.assert_array_equal(perfect.misses, ranked.misses)


def test_a_global_cache_charges_what_an_earlier_layer_evicted_in_the_same_cycle():
    """Two layers share two LRU slots. Cycle 2 needs (0, 1) and (1, 0): layer 0's miss evicts
    (1, 0), the least recent, which layer 1 then misses; the windows count that miss (they once
    took the cycle's start, where (1, 0) was resident, and hid nothing)."""
    E = 2
    unions = [np.array([E + 0]), np.array([0]), np.array([1, E + 0])]
    nodes, levels = np.ones(3, dtype=np.int64), np.zeros(3, dtype=np.int64)
    out = layer_ahead(unions, nodes, levels, 2, E, 2, COST, mode="global")
    np.testing.assert_array_equal(out.misses, [1, 1, 2])
    # layer 0 computes 0.1 + 0.01 s, long enough for the 0.05 s copy of (1, 0)
    assert out.copies[2] == 1 and out.useful[2] == 1 and out.hidden_s[2] == pytest.approx(0.05)
    # ranked (1, 0), (1, 1): both copied inside the window, the first needed
    ranked = layer_ahead(unions, nodes, levels, 2, E, 2, COST, mode="global", rank=_fixed([0, 1]))
    assert ranked.copies[2] == 2 and ranked.useful[2] == 1 and ranked.hidden_s[2] == pytest.approx(0.05)


def test_a_candidate_an_earlier_layer_evicted_must_be_copied_again():
    """Two layers share two LRU slots. Cycle 3 needs (0, 1) and (1, 0): layer 0's miss evicts
    (1, 1), the least recent, before layer 0's window, so a prefetcher ranking (1, 1) first copies
    it (wasted) and (1, 0) only after it. The windows once took (1, 1) as resident, as at the
    cycle's start, skipped it for free and hid (1, 0)'s whole copy."""
    E = 2
    unions = [np.array([E + 1]), np.array([0]), np.array([1, E + 0])]
    nodes, levels = np.ones(3, dtype=np.int64), np.zeros(3, dtype=np.int64)
    # a window of 0.05 + 0.01 s; a copy takes 0.05 s
    cost = CostModel(base_s=0.1, per_node_s=0.0, hit_s=0.01, miss_s=0.06, draft_level_s=0.0)
    out = layer_ahead(unions, nodes, levels, 2, E, 2, cost, mode="global", rank=_fixed([1, 0]))
    np.testing.assert_array_equal(out.misses, [1, 1, 2])
    # (1, 1) in 0 - 0.05 s, wasted; (1, 0) started at 0.05 s, 0.01 s of it inside the window
    assert out.copies[2] == 2 and out.useful[2] == 1 and out.hidden_s[2] == pytest.approx(0.01)
    # per layer, (1, 1) stays resident and is skipped: (1, 0)'s copy fills the window
    per_layer = layer_ahead(unions, nodes, levels, 2, E, 1, cost, rank=_fixed([1, 0]))
    assert per_layer.copies[2] == 1 and per_layer.hidden_s[2] == pytest.approx(0.05)


def test_a_wasted_copys_overrun_delays_only_copies_the_next_layer_has_left():
    """Layer 0 needs {0} (a window of 0.11 s), ranked 3, 0, 2 at p = 1: the third copy, wasted,
    runs 0.04 s past the window. Layer 1 needing nothing, or only the copied 0, is not delayed;
    needing 1 as well, which no copy took, its copy starts 0.04 s late."""
    for layer1, hidden in (([], 0.0), ([0], 0.05), ([0, 1], 0.05 - 0.04)):
        unions = [np.array([0] + [4 + e for e in layer1])]
        out = layer_ahead(unions, np.array([1]), np.array([0]), 2, 4, 0, COST, rank=_fixed([3, 0, 2]))
        assert out.copies[0] == 3 and out.hidden_s[0] == pytest.approx(hidden), layer1


def test_a_wasted_overrun_the_next_layer_does_not_wait_for_takes_from_its_window():
    """Three layers, windows of 0.11 s, a copy 0.05 s, every candidate copied (p = 1). Window 0
    copies 1 (needed) and 3, 2 (wasted; 2 runs 0.04 s past the close); layer 1 has nothing left to
    copy, so it computes at once while the link finishes 2: window 1's copies of 1 and 2 (both
    needed by layer 2) start 0.04 s late, the second 0.02 s inside (0.05 with the link free, as
    the windows once took it)."""
    unions = [np.array([0, 4 + 1, 2 * 4 + 1, 2 * 4 + 2])]
    cost = CostModel(base_s=0.3, per_node_s=0.0, hit_s=0.01, miss_s=0.06, draft_level_s=0.0)
    ranker = lambda cycle, union: (np.array([[1, 3, 2, 0], [1, 2, 0, 3]]), np.ones((2, 4)))   # noqa: E731
    out = layer_ahead(unions, np.array([1]), np.array([0]), 3, 4, 0, cost, rank=ranker)
    assert out.hidden_s[0] == pytest.approx(0.05 + 0.05 + 0.02)
    np.testing.assert_allclose(out.hidden_s, _events(unions, np.array([1]), 3, 4, 0, cost, ranker))


def test_a_near_free_copy_asks_for_no_more_slots_than_a_layer_has_experts():
    """A copy of 1e-15 s in windows of ~0.1 s: every miss hidden, no layer copying more than its
    experts (the slots once ran to window / copy time: 1e14 of them)."""
    cost = CostModel(base_s=0.2, per_node_s=0.0, hit_s=1e-6, miss_s=1e-6 + 1e-15, draft_level_s=0.0)
    unions = [np.array([0, 1, 4 + 1, 4 + 2, 4 + 3])]
    out = layer_ahead(unions, np.array([1]), np.array([0]), 2, 4, 0, cost)
    assert out.copies[0] == 3 and out.useful[0] == 3 and out.hidden_s[0] == pytest.approx(3e-15)
    ranked = layer_ahead(unions, np.array([1]), np.array([0]), 2, 4, 0, cost, rank=_fixed([3, 0, 2, 1]))
    assert ranked.copies[0] == 4 and ranked.useful[0] == 3


def test_transition_ranker_counts_and_order():
    # three positions of a 2-layer, 4-expert model, one expert a layer: 0 -> 2, 0 -> 3, 1 -> 3
    experts = np.array([[[0], [2]], [[0], [3]], [[1], [3]]])
    ranker = TransitionRanker(experts, 4)
    np.testing.assert_allclose(ranker.conditional[0, 0], [0, 0, 0.5, 0.5])
    np.testing.assert_allclose(ranker.conditional[0, 1], [0, 0, 0, 1.0])
    union = np.zeros((2, 4), dtype=bool)
    union[0, [0, 1]] = True
    # 3: 0.5 + 1, 2: 0.5, then nothing: 0 and 1 never followed
    ids, chance = ranker.rank(0, union)
    np.testing.assert_array_equal(ids, [[3, 2, -1, -1]])
    # one token: the mean of the conditionals over the union's two experts; two: either of them
    np.testing.assert_allclose(chance[0, :2], [0.75, 0.25])
    np.testing.assert_allclose(ranker.rank(0, union, nodes=2)[1][0, :2], [1 - 0.25 ** 2, 1 - 0.75 ** 2])
    union[0] = [False, False, True, False]                  # an expert never seen at layer 0
    np.testing.assert_array_equal(ranker.rank(0, union)[0], [[-1, -1, -1, -1]])


def test_the_recharge_keeps_the_replays_cache_and_time():
    """On the shipped OLMoE trace, `ar`'s and `chain:2`'s recorded unions recounted on the same
    per-layer LRU cache give the replay's hits, misses and charged time; the true misses hide at
    least what the transition ranker does."""
    trace = read_trace(SAMPLE_OLMOE)
    prep = prepare("oracle", trace, trace.true_experts)
    cost = preset_profile("gh200", SHAPES.get(trace.model["name"])).cost
    roots = trace.true_experts[trace.offsets[:-1]]
    ranker = TransitionRanker(roots, trace.n_experts)
    for spec in ("ar", "chain:2"):
        policy = make_policy(spec)
        policy.observe(Observation(predicted_slots=0, predicted_slots_right=0, resident_share=0.25))
        log = replay(prep, policy, ExpertCache(trace.n_layers, trace.n_experts, 16), cost, record_unions=True)
        c = log.columns
        args = (log.unions, c["nodes_verified"], c["draft_levels"], trace.n_layers, trace.n_experts, 16, cost)
        perfect, ranked = layer_ahead(*args), layer_ahead(*args, rank=ranker.rank)
        np.testing.assert_array_equal(perfect.hits, c["hits"])
        np.testing.assert_array_equal(perfect.misses, c["misses"])
        np.testing.assert_allclose(perfect.time_s, c["charged_time_s"], rtol=1e-12)
        assert (ranked.hidden_s <= perfect.hidden_s + 1e-12).all()
        assert perfect.hidden_s.sum() > ranked.hidden_s.sum() > 0


def test_the_benchmark_reports_both_prefetchers_for_every_policy(capsys):
    """benchmarks/bench_layer_ahead.py on the shipped OLMoE trace, one setting: a row with every
    policy, the transition prefetcher never above the ceiling, and the summary table."""
    bench = bench_module("bench_layer_ahead")
    rows = bench.main(["--traces", "olmoe-sample", "--profiles", "gh200", "--caches", "0.25"])
    assert [(r["trace"], r["profile"], r["cache"]) for r in rows] == [("olmoe-sample", "gh200", 16)]
    for label in ("ar", "chain:1", "specfit", "specfit learned"):
        r = rows[0][label]
        assert r["tokens_per_s"] > 0 and 0 < r["transfer_share"] < 1
        assert r["perfect"] >= r["transition"] and r["perfect"] > r["tokens_per_s"]
    assert "| specfit / best fixed, both +LA ceiling |" in capsys.readouterr().out


def test_the_benchmarks_pregate_table_on_the_bundled_model(capsys):
    """bench_layer_ahead.py --pregate's measurement, a short run: a row per predicted layer, both
    predictors' slot precision above chance (top-4 of 16)."""
    bench = bench_module("bench_layer_ahead")
    rows = bench.pregate_on_bundled_model(max_new_tokens=8)
    assert [r["layer"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert 4 / 16 < r["pregate"] <= 1 and 4 / 16 < r["transition"] <= 1
    assert "pre-gate" in capsys.readouterr().out
