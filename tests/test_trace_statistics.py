"""What `specfit traces inspect` prints (accepted lengths, acceptance by depth, reuse, popularity,
the drafter's calibration, unions by depth) and the synthetic drafter's trees, on the hand trace by
hand."""

import numpy as np
import pytest

from specfit import kernels
from specfit.traces.drafter import DrafterParams, _draft_probs, draft_tree
from specfit.traces.format import read_trace
from specfit.traces.routing import TokenSampler
from specfit.traces.stats import (acceptance_by_depth, accepted_lengths, consecutive_reuse, edge_calibration,
                                  popularity, same_token_reuse, top_quarter_share)
from specfit.traces.summary import summarise_trace

from trace_helpers import SAMPLE_QWEN3, hand_trace

# hand trace: cycle 0 accepts A and C (2 draft tokens), cycle 1 accepts one, cycle 2 none


def test_accepted_lengths_and_acceptance_by_depth_of_the_hand_trace():
    trace = hand_trace()
    assert accepted_lengths(trace).tolist() == [2, 1, 0]
    # depth 1: 2 of 3 trees reach it; depth 2: 1 of the 2 that reached depth 1
    assert acceptance_by_depth(trace) == pytest.approx({1: 2 / 3, 2: 1 / 2})


def test_summary_of_the_hand_trace_by_hand():
    s = summarise_trace(hand_trace())
    assert s["full_tree_accepted_tokens"] == pytest.approx(2.0)            # mean(2, 1, 0) + 1
    # union of the true experts per layer of the trees cut at depth 0, 1, 2, averaged over cycles:
    # cycle 0: {0} {0,1,2} {0,1,2,3}; cycle 1: {1} {1,3} {1,3}; cycle 2: {3} {3,0} {3,0}
    assert [row["union_experts_per_layer"] for row in s["by_depth"]] == pytest.approx([1, 7 / 3, 8 / 3])
    assert [row["acceptance_rate"] for row in s["by_depth"]] == pytest.approx([1.0, 2 / 3, 1 / 2])


def test_union_per_layer_of_the_roots_is_top_k_on_a_many_layer_trace():
    trace = read_trace(SAMPLE_QWEN3, weights=False)
    s = summarise_trace(trace)
    # a root routes to top_k distinct experts at every layer: its union per layer is top_k
    assert s["by_depth"][0]["union_experts_per_layer"] == pytest.approx(trace.top_k)


@pytest.mark.parametrize("seed", range(4))
def test_union_by_depth_equals_sets_of_the_known_nodes_within_each_depth(seed):
    """Against Python sets, on a synthetic trace with unknown nodes (roots among them: a cycle
    with no known node within a depth counts 0 there)."""
    import dataclasses

    from specfit.traces.summary import _union_by_depth
    from specfit.traces.synth import synthesize

    trace = synthesize("olmoe-1b-7b", "chat", 10, seed=seed, sequence_tokens=5, drafter=DrafterParams(width=3, depth=3))
    rng = np.random.default_rng(seed)
    true = trace.true_experts.copy()
    true[rng.random(trace.n_nodes) < 0.3] = -1
    trace = dataclasses.replace(trace, true_experts=true)
    max_depth = int(trace.depth.max())
    expected = np.zeros(max_depth + 1)
    for c in range(trace.n_cycles):
        rows = [v for v in range(trace.offsets[c], trace.offsets[c + 1]) if (true[v] >= 0).all()]
        for d in range(max_depth + 1):
            expected[d] += sum(len({int(true[v, layer, s]) for v in rows if trace.depth[v] <= d
                                    for s in range(trace.top_k)}) for layer in range(trace.n_layers))
    assert (true[trace.offsets[:-1]] < 0).any(axis=(1, 2)).any()          # some root unknown
    np.testing.assert_allclose(_union_by_depth(trace), expected / trace.n_cycles / trace.n_layers, rtol=1e-12)


def test_edge_calibration_bins_of_the_hand_trace():
    rows = edge_calibration(hand_trace())
    # draft probabilities exp(float32 log q) of the drafted nodes: .9, .05, .889, .5 - 1 ulp, .4 - 1 ulp;
    # accepted: A (.9), C (.889) and 12 at cycle 1 (.5)
    assert {r["bin"]: r["nodes"] for r in rows} == {"0.0-0.1": 1, "0.3-0.4": 1, "0.4-0.5": 1, "0.8-0.9": 1,
                                                     "0.9-1.0": 1}
    by_bin = {r["bin"]: r["accept_rate"] for r in rows}
    assert by_bin == {"0.0-0.1": 0.0, "0.3-0.4": 0.0, "0.4-0.5": 1.0, "0.8-0.9": 1.0, "0.9-1.0": 1.0}


def test_uniform_popularity_has_a_top_quarter_share_of_a_quarter():
    experts = np.array([[[0, 1], [4, 5]], [[2, 3], [6, 7]], [[4, 5], [0, 1]], [[6, 7], [2, 3]]])  # 4 tokens, 2 layers
    pop = popularity(experts, 8)
    assert pop.sum(axis=1) == pytest.approx([1.0, 1.0])
    assert pop == pytest.approx(np.full((2, 8), 1 / 8))
    assert top_quarter_share(pop) == pytest.approx([0.25, 0.25])


def test_consecutive_reuse_does_not_pair_tokens_across_sequences():
    experts = np.array([[[0, 1]], [[0, 1]], [[2, 3]], [[2, 3]]])     # 4 tokens, 1 layer, top-2
    assert consecutive_reuse(experts, np.array([0, 0, 1, 1])).tolist() == [1.0]
    assert consecutive_reuse(experts).tolist() == pytest.approx([2 / 3])


def test_same_token_reuse_leaves_out_adjacent_repeats():
    experts = np.array([[[0, 1]], [[2, 3]], [[0, 1]], [[4, 5]], [[4, 5]]])
    # token 7 at 0 and 2 (not adjacent, same experts); token 9 at 3 and 4 (adjacent: left out)
    tokens = np.array([7, 8, 7, 9, 9])
    assert same_token_reuse(experts, tokens).tolist() == [1.0]
    # only adjacent repeats: undefined
    assert np.isnan(same_token_reuse(experts[3:], tokens[3:])).all()


def test_drafter_tree_size_is_what_it_drafts():
    params = DrafterParams(width=3, depth=4)
    assert params.tree_nodes == 1 + 3 + 3 * 9
    rng = np.random.default_rng(0)
    tree = draft_tree(np.arange(100, 110), params, TokenSampler(1000, 1.1, np.random.default_rng(1)), rng)
    assert tree.parent.size == params.tree_nodes


@pytest.mark.parametrize("field, value", [("depth", -1), ("width", 0), ("depth_decay", 1.5)])
def test_drafter_params_out_of_range_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        DrafterParams(**{field: value})


def test_a_depth_decay_of_one_is_allowed():
    assert DrafterParams(depth_decay=1.0).depth_decay == 1.0


def test_the_first_levels_top1_probability_has_mean_top1_prob():
    params = DrafterParams(top1_prob=0.6, depth_decay=0.5, confidence_spread=50.0)
    probs = _draft_probs(params, 1, 20000, np.random.default_rng(0))
    # the top-1 is Beta with mean top1_prob at depth 1 (the decay applies from depth 2)
    assert probs[:, 0].mean() == pytest.approx(0.6, abs=0.02)
    deeper = _draft_probs(params, 2, 20000, np.random.default_rng(0))
    assert deeper[:, 0].mean() == pytest.approx(0.3, abs=0.04)


def test_the_target_may_accept_none_of_the_children():
    # an over-confident drafter: acceptance q ** 4 sums well below 1, so often no child is accepted
    params = DrafterParams(width=2, depth=1, calibration_exponent=4.0)
    rng = np.random.default_rng(0)
    sampler = TokenSampler(1000, 1.1, np.random.default_rng(1))
    accepted = [draft_tree(np.arange(100, 105), params, sampler, rng).on_path[1:].any() for _ in range(300)]
    assert 0.05 < np.mean(accepted) < 0.8


def test_the_frontier_keeps_the_earlier_node_among_equals(monkeypatch):
    import specfit.traces.drafter as drafter
    # every child at probability 1/2: all nodes of a level tie, so the frontier is the level's first w
    monkeypatch.setattr(drafter, "_draft_probs", lambda params, depth, n, rng: np.full((n, params.width), 0.5))
    params = DrafterParams(width=2, depth=3)
    tree = draft_tree(np.arange(100, 110), params, TokenSampler(1000, 1.1, np.random.default_rng(1)),
                      np.random.default_rng(0))
    # level 1: 1, 2; level 2: 3, 4 (under 1), 5, 6 (under 2); level 3 expands 3 and 4
    assert tree.parent[tree.depth == 3].tolist() == [3, 3, 4, 4]


def test_sibling_reuse_pairs_only_siblings_off_the_accepted_path():
    from specfit.traces.summary import trace_statistics
    # the hand trace's one sibling pair (A, B under the root at position 0) holds A, the accepted
    # token: no off-path pair is left, so the statistic is undefined
    assert np.isnan(trace_statistics(hand_trace())["sibling_reuse"])


def union_sizes_reference(offsets, depth, known, experts, max_depth):
    out = np.zeros(max_depth + 1)
    for c in range(offsets.size - 1):
        rows = [v for v in range(offsets[c], offsets[c + 1]) if known[v]]
        for d in range(max_depth + 1):
            out[d] += sum(len({int(experts[v, layer, s]) for v in rows if depth[v] <= d for s in range(experts.shape[2])})
                          for layer in range(experts.shape[1]))
    return out


def test_an_expert_in_the_second_bitset_word_does_not_alias_another_layers_expert():
    """100 experts: two 64-bit words per layer. Expert 67 at layer 0 and expert 3 at layer 1 are two
    experts (a one-word set would put 67's bit on layer 1's expert 3)."""
    experts = np.array([[[67], [3]]], dtype=np.int16)          # one node, 2 layers, top-1
    totals = kernels.bitsets.union_sizes_by_depth(np.array([0, 1]), np.array([0]), np.array([True]), experts, 100, 0)
    assert totals.tolist() == [2.0]


def test_union_sizes_by_depth_equal_python_sets_for_expert_counts_off_a_multiple_of_64():
    """Cycles in drafting order (depth non-decreasing, as traces are validated), some nodes unknown."""
    rng = np.random.default_rng(0)
    for n_experts in (60, 65, 100, 128, 130):
        n, layers, k = 40, 3, 4
        experts = np.stack([rng.permutation(n_experts)[:k] for _ in range(n * layers)]).reshape(n, layers, k)
        experts = experts.astype(np.int16)
        offsets = np.array([0, 7, 15, 15, 28, 40])
        depth = np.concatenate([np.r_[0, np.sort(rng.integers(1, 4, b - a - 1))] if b > a else [] for a, b in
                                zip(offsets[:-1], offsets[1:])]).astype(np.int64)
        known = rng.random(n) < 0.8
        got = kernels.bitsets.union_sizes_by_depth(offsets, depth, known, experts, n_experts, 3)
        np.testing.assert_array_equal(got, union_sizes_reference(offsets, depth, known, experts, 3))
