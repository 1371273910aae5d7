"""Sequoia's static tree (``specfit/sequoia.py``, ``sequoia:N`` / ``sequoia:auto``): the tree
against Sequoia's dynamic program, the ranks, scores and rates against hand-computed values, the
policy on a tree that holds its whole shape, and the simulator's tuned family. The replay of
``sequoia:N`` against a plain-Python reference is in ``test_replay_reference.py``."""

from __future__ import annotations

import functools
import math
import re

import numpy as np
import pytest

from specfit import CostModel
from specfit.calibrate.presets import SHAPES, preset_profile
from specfit.policies import MAX_TREE_NODES, STATIC_AUTO_SIZES, CycleView, SequoiaPolicy, TunedPolicy, make_policy
from specfit.sequoia import node_scores, positional_rates, shape, shape_depth, sibling_ranks, trace_rates
from specfit.simulate.replay import prepare
from specfit.simulate.sweep import Scenario, run_sweep
from specfit.traces.format import read_trace
from specfit.tree import DraftTree

from trace_helpers import SAMPLE_OLMOE


def sequoia_dp(rates, total: int, max_depth: int) -> float:
    """Sequoia's dynamic program (Chen et al., 2024, section 3.1): the most accepted tokens in
    expectation of a tree of ``total`` nodes (root included, counted 1) at most ``max_depth``
    levels deep, children ranked 0 .. k - 1, the rank-r child of an accepted node accepted with
    probability ``rates[r]``; -inf where no such tree exists."""
    k = len(rates)

    @functools.lru_cache(maxsize=None)
    def tree(n: int, d: int) -> float:
        if n == 1:
            return 1.0
        return -math.inf if d == 0 else 1.0 + children(n - 1, d - 1, 0)

    @functools.lru_cache(maxsize=None)
    def children(m: int, d: int, r: int) -> float:
        """The best split of ``m`` nodes among the subtrees of ranks r, r + 1, ... (each ``d``
        deep): a node's children hold the ranks 0 .. b - 1, none skipped."""
        if m == 0:
            return 0.0
        if r == k:
            return -math.inf
        best = -math.inf
        for j in range(1, m + 1):
            best = max(best, rates[r] * tree(j, d) + children(m - j, d, r + 1))
        return best

    return tree(total, max_depth)


def value(rates, paths) -> float:
    return math.fsum(math.prod(rates[r] for r in p) for p in paths)


@pytest.mark.parametrize("seed", range(6))
def test_the_tree_is_sequoias_optimum(seed):
    """The tree accepts as many tokens in expectation as this separate implementation of Sequoia's
    dynamic program finds, at every size and depth bound, for falling and rising rates, and is a
    tree of Sequoia's kind (no rank skipped)."""
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, 4))
    rates = rng.uniform(0.0, 1.0, k)
    if seed % 2:
        rates = np.sort(rates)[::-1]
    for depth in range(1, 5):
        capacity = sum(k ** d for d in range(depth + 1))
        for n in range(1, min(capacity, 16) + 1):
            paths = shape(rates, n, depth)
            assert len(paths) == n and len(set(paths)) == n and max(map(len, paths)) <= depth
            assert all(p[:-1] in paths for p in paths if p)            # a tree: every parent is in it
            assert all(p[:-1] + (p[-1] - 1,) in paths for p in paths if p and p[-1])   # no rank skipped
            assert value(rates, paths) == pytest.approx(sequoia_dp(tuple(rates), n, depth), rel=1e-12, abs=1e-12)


def test_the_tree_of_a_known_vector():
    # rates .8, .5: the root, 0 (.8), 00 (.64), 000 (.512), 1 (.5), 0000 (.4096), then 01 and 10
    # tie (.4): the lower ranks first
    assert shape([0.8, 0.5], 7, 8) == [(), (0,), (0, 0), (0, 0, 0), (1,), (0, 0, 0, 0), (0, 1)]
    assert shape_depth([0.8, 0.5], 4, 8) == 3
    assert shape_depth([0.8, 0.5], 4, 2) == 2                 # bounded: (), 0, 00, then 1 rather than 000
    assert shape([0.8, 0.5], 4, 2) == [(), (0,), (0, 0), (1,)]
    # rates that rise with the rank: rank 1 only beside rank 0, as Sequoia's trees have it
    assert shape([0.2, 0.6], 2, 4) == [(), (0,)]
    assert shape([0.2, 0.6], 3, 4) == [(), (1,), (0,)]
    # nothing accepted: every node scores 0, and the shallower go first
    assert shape([0.0, 0.0], 5, 8) == [(), (0,), (1,), (0, 0), (0, 1)]
    assert shape_depth([0.0, 0.0], 3, 8) == 1


def test_ranks_scores_and_rates_by_hand():
    #   0 ─ 1 (p .2) ─ 4 (p .1)
    #     ├ 2 (p .5) ─ 5 (p .3), 6 (p .3)     (5 and 6 tie: the earlier ranks first)
    #     └ 3 (p .2)                          (1 and 3 tie)
    #   7 ─ 8 (p .9)                          (a second tree, rows 7-8)
    parents = np.array([-1, 0, 0, 0, 1, 2, 2, -1, 7])
    probs = np.array([1.0, 0.2, 0.5, 0.2, 0.1, 0.3, 0.3, 1.0, 0.9])
    depths = np.array([0, 1, 1, 1, 2, 2, 2, 0, 1])
    ranks = sibling_ranks(parents, probs)
    assert ranks.tolist() == [-1, 1, 0, 2, 0, 0, 1, -1, 0]
    scores = node_scores(parents, depths, ranks, np.array([0.5, 0.25]))      # rank 2 has no rate: 0
    np.testing.assert_allclose(scores, [1, 0.25, 0.5, 0, 0.125, 0.25, 0.125, 1, 0.5])
    # accepted paths: 0 -> 2 -> 6 and 7 alone; reached: the root's children (rank 0, 1, 2), 2's
    # children (rank 0, 1) and 8 (rank 0); accepted: 2 (rank 0), 6 (rank 1)
    reached, accepted = np.zeros(9, dtype=bool), np.zeros(9, dtype=bool)
    reached[[1, 2, 3, 5, 6, 8]] = True
    accepted[[2, 6]] = True
    np.testing.assert_allclose(positional_rates(ranks, reached, accepted), [1 / 3, 1 / 2, 0.0])
    # 4 (rank 0) is not reached: its parent 1 was rejected, and it counts nowhere
    accepted[4] = True
    np.testing.assert_allclose(positional_rates(ranks, reached, accepted), [1 / 3, 1 / 2, 0.0])


def full_tree(k: int, depth: int, rng) -> DraftTree:
    parents, level = [-1], [0]
    for _ in range(depth):
        nxt = []
        for p in level:
            for _ in range(k):
                parents.append(p)
                nxt.append(len(parents) - 1)
        level = nxt
    probs = np.r_[1.0, rng.uniform(0.01, 0.99, len(parents) - 1)]
    for v in range(1, len(parents)):           # path probabilities: a product down the path
        probs[v] *= probs[parents[v]]
    return DraftTree(np.array(parents), probs)


def rank_paths(tree: DraftTree, ranks: np.ndarray, nodes) -> set[tuple[int, ...]]:
    out = set()
    for v in nodes:
        path = []
        while v > 0:
            path.append(int(ranks[v]))
            v = int(tree.parents[v])
        out.add(tuple(reversed(path)))
    return out


@pytest.mark.parametrize("rates", [[0.7, 0.35, 0.1], [0.3, 0.6, 0.05]])
@pytest.mark.parametrize("total", [2, 5, 9, 14, 24])
def test_on_a_tree_that_holds_its_shape_the_policy_verifies_the_shape(total, rates):
    """Where the draft holds Sequoia's whole tree, the policy verifies a tree of the same rank
    paths (up to paths whose products tie, e.g. 0-1 and 1-0): the same products, the same value,
    also where the rates rise with the rank and the largest products are not Sequoia's tree."""
    rng = np.random.default_rng(total)
    tree = full_tree(3, 6, rng)
    drafter = rng.uniform(0.01, 1.0, tree.n_nodes)
    rates = np.array(rates)
    wanted = shape(rates, total, total - 1)
    assert max(map(len, wanted)) <= 6                            # the draft holds it
    policy = SequoiaPolicy(total, 8, rates=rates)
    assert policy.max_levels == max(1, max(map(len, wanted)))
    view = CycleView(tree, np.zeros((tree.n_nodes, 1, 1), dtype=np.int64), np.zeros((1, 1), dtype=bool),
                     CostModel(base_s=1.0, per_node_s=0.0, hit_s=0.0, miss_s=0.0, draft_level_s=0.0), 6,
                     drafter_probs=drafter)
    sel = policy.select(view)
    got = rank_paths(tree, sibling_ranks(tree.parents, drafter), sel.nodes)
    assert len(got) == total and all(p[:-1] in got for p in got if p)
    products = lambda paths: sorted(math.prod(rates[r] for r in p) for p in paths)      # noqa: E731
    np.testing.assert_allclose(products(got), products(wanted), rtol=1e-12)
    assert value(rates, got) == pytest.approx(sequoia_dp(tuple(rates), total, total - 1), rel=1e-12)


def test_bad_rates_and_missing_rates_are_clear_errors():
    with pytest.raises(ValueError, match=r"sequoia:4.*acceptance rate in \[0, 1\]"):
        SequoiaPolicy(4, 8, rates=np.array([0.5, np.nan]))
    with pytest.raises(ValueError, match=r"sequoia:4.*acceptance rate in \[0, 1\]"):
        SequoiaPolicy(4, 8, rates=np.array([1.5]))
    with pytest.raises(ValueError, match=r"sequoia:4.*acceptance rate in \[0, 1\]"):
        SequoiaPolicy(4, 8, rates=np.array([0.5, -0.1]))
    with pytest.raises(ValueError, match=r"sequoia:4.*one acceptance rate in \[0, 1\] per sibling rank"):
        SequoiaPolicy(4, 8, rates=np.array([[0.5, 0.2]]))
    tree = DraftTree(np.array([-1, 0]), np.array([1.0, 0.5]))
    view = CycleView(tree, np.zeros((2, 1, 1), dtype=np.int64), np.zeros((1, 1), dtype=bool),
                     CostModel(base_s=1.0, per_node_s=0.0, hit_s=0.0, miss_s=0.0, draft_level_s=0.0), 1)
    with pytest.raises(ValueError, match="'sequoia:4': no positional acceptance rates"):
        SequoiaPolicy(4, 8).select(view)
    with pytest.raises(ValueError, match=r"expected N >= 2 nodes \(root included\), got N=1 \(a tree"):
        make_policy("sequoia:1:5")
    # a size no pass verifies is refused at once (Sequoia's tree program once ran without end on it)
    for spec in ("sequoia:99999999999999999999", "static:1025", "eagle3:60:2000", "chain:5000"):
        with pytest.raises(ValueError, match=f"'{spec}': expected parameters of at most {MAX_TREE_NODES}"):
            make_policy(spec)
    assert make_policy(f"static:{MAX_TREE_NODES}").total_nodes == MAX_TREE_NODES


def test_the_tuned_family_replays_every_size_and_keeps_the_fastest():
    auto = make_policy("sequoia:auto+cache", 8)
    assert isinstance(auto, TunedPolicy) and auto.simulator_only
    cands = auto.candidates(10)
    # every size: a Sequoia tree larger than the trace's trees drafts deeper, not whole trees
    assert [c.name for c in cands] == [f"sequoia:{n}+cache" for n in STATIC_AUTO_SIZES]
    assert [c.name for c in make_policy("static:auto+cache", 8).candidates(10)] == [
        f"static:{n}+cache" for n in (2, 3, 4, 6, 8, 12)]
    assert all(type(c) is SequoiaPolicy and c.cache_advisor is not None for c in cands)
    prep = prepare("olmoe", trace := read_trace(SAMPLE_OLMOE), trace.true_experts)
    cost = preset_profile("gh200", SHAPES["olmoe-1b-7b"]).cost
    sizes = [c.name for c in make_policy("sequoia:auto").candidates(prep.max_nodes)]
    _, summary = run_sweep([prep], ["sequoia:auto", *sizes], [16], [Scenario("g", cost)])
    rate = summary.set_index("policy")["tokens_per_s"]
    chosen = summary.set_index("policy").loc["sequoia:auto", "static_n"]
    assert rate["sequoia:auto"] == rate[sizes].max() == rate[f"sequoia:{chosen}"]
    # the rates come from the trace's own verdicts: the drafter's top child is accepted most often
    rates = prep.positional_rates()
    assert rates.size >= 2 and np.all(np.diff(rates) <= 0) and 0 < rates[0] < 1


@pytest.mark.parametrize("spec", ["sequoia:auto", "static:auto+cache"])
def test_a_tuned_family_replayed_alone_is_refused(spec):
    """A tuned family is its candidates, each replayed (``run_sweep``); replayed alone it ran a
    plain rerank of its first size (``sequoia:auto``: ``static:2``'s tokens/s, not ``sequoia:2``'s)
    under its own name."""
    from specfit.experts.cache import ExpertCache
    from specfit.simulate.replay import replay

    prep = prepare("olmoe", trace := read_trace(SAMPLE_OLMOE), trace.true_experts)
    cost = preset_profile("gh200", SHAPES["olmoe-1b-7b"]).cost
    with pytest.raises(ValueError, match=f"policy '{re.escape(spec)}': a tuned family.*run_sweep"):
        replay(prep, make_policy(spec), ExpertCache(trace.n_layers, trace.n_experts, 16), cost)


def test_rates_of_a_recorded_trace_by_hand():
    """``hand_trace``: rank 0 is tried at A, C, and the roots' children of positions 1 and 2 and
    accepted at the first three; rank 1 (B) is rejected. A child of a node whose verdict is unknown
    (a recording of a policy that did not verify it) counts nowhere."""
    from trace_helpers import hand_trace

    trace = hand_trace()
    np.testing.assert_allclose(trace_rates(trace), [0.75, 0.0])
    trace.verdict[1] = -1                          # A unverified: C's outcome is unknown
    np.testing.assert_allclose(trace_rates(trace), [2 / 3, 0.0])


def test_the_depth_cap_a_rank_never_reached_and_no_rate_at_all():
    # --max-levels caps the tree's depth: rates .8, .5 make sequoia:16 deeper than 2 levels
    assert shape_depth([0.8, 0.5], 16, 8) > 2
    assert make_policy("sequoia:16", 2).max_levels == 2
    policy = make_policy("sequoia:16", 2)
    policy.fit(np.array([0.8, 0.5]))
    assert policy.max_levels == 2
    # a rank reached nowhere (ranks given by hand: 0 and 2) rates 0, as the docstring says
    np.testing.assert_allclose(positional_rates(np.array([0, 2, 2]), np.ones(3, dtype=bool),
                                                np.array([True, False, True])), [1.0, 0.0, 0.5])
    # no edge reached (a trace of roots alone): the tree is the root, and the policy drafts one level
    assert shape(np.zeros(0), 4, 8) == [()]
    assert shape_depth(np.zeros(0), 4, 8) == 1 and SequoiaPolicy(4, 8, rates=np.zeros(0)).max_levels == 1


def test_rates_given_are_kept_by_a_replay_of_another_trace():
    """A policy given its rates (live: fitted on --acceptance) replays with them, not the trace's:
    rate 1 at rank 0 alone makes sequoia:4 a chain of 3 levels, where the sample's rates make it 2."""
    from specfit.experts.cache import ExpertCache
    from specfit.simulate.replay import replay

    prep = prepare("olmoe", trace := read_trace(SAMPLE_OLMOE), trace.true_experts)
    assert shape_depth(prep.positional_rates(), 4, 3) == 2
    policy = SequoiaPolicy(4, 8, rates=np.array([1.0]))
    cache = ExpertCache(trace.n_layers, trace.n_experts, 8, expert_bytes=trace.expert_bytes)
    log = replay(prep, policy, cache, preset_profile("gh200", SHAPES["olmoe-1b-7b"]).cost)
    assert policy.rates.tolist() == [1.0] and policy.max_levels == 3
    assert log.columns["draft_levels"].max() == 3


def test_decode_says_the_tree_its_acceptance_rates_give():
    """``decode --policy sequoia:N --acceptance TRACE``: each sequoia:N gets the rates and the note
    names the depth of its tree under them (.8, .5: 6 nodes reach 4 levels, under a cap of 8)."""
    from types import SimpleNamespace

    from specfit.runtime.decode_job import _fit_sequoia

    policies, notes = [make_policy("ar"), make_policy("sequoia:6", 8)], []
    _fit_sequoia(SimpleNamespace(acceptance_trace="first.parquet", temperature=0.0), policies, np.array([0.8, 0.5]),
                 notes)
    assert policies[1].rates.tolist() == [0.8, 0.5] and policies[1].max_levels == 4
    assert notes == ["note: sequoia:6: positional acceptance rates 0.800, 0.500 (sibling rank 0, 1, ...; fitted on "
                     "--acceptance first.parquet): a tree of 6 nodes, 4 levels"]
    # sampling: the rates are greedy verdicts', and the note says what that means
    notes = []
    _fit_sequoia(SimpleNamespace(acceptance_trace="t.parquet", temperature=0.7), [make_policy("sequoia:6", 8)],
                 np.array([0.8, 0.5]), notes)
    assert notes[0].endswith("4 levels; greedy verdicts, which overstate what sampling (--temperature 0.7) accepts")


def test_sequoia_n_d_bounds_the_trees_depth_as_sequoia_does():
    """``sequoia:N:D``: Sequoia's tree of N nodes at most D levels deep (whatever the run's cap,
    as ``eagle3:N:D`` keeps its own depth); D < 1 is refused."""
    rates = np.array([0.8, 0.3])
    free, bounded = make_policy("sequoia:16", 8), make_policy("sequoia:16:2+cache", 8)
    free.fit(rates)
    bounded.fit(rates)
    assert free.max_levels == shape_depth(rates, 16, 8) > 2
    assert bounded.name == "sequoia:16:2+cache" and bounded.max_levels == 2
    assert bounded.tree == shape(rates, 16, 2) and len(bounded.tree) == 7      # 1 + 2 + 4: all two levels hold
    assert make_policy("sequoia:8:12", 4).depth_cap == 7                      # at most N - 1 all the same
    with pytest.raises(ValueError, match="'sequoia:8:0': expected D >= 1 draft levels"):
        make_policy("sequoia:8:0")


def test_rates_of_few_ranks_make_a_smaller_tree_which_no_node_of_value_0_fills():
    """One rank (an --acceptance trace a chain recorded) and 3 levels hold a chain of 4 nodes:
    ``sequoia:16`` verifies those 4, not 12 more drafted nodes that Sequoia values at 0."""
    rng = np.random.default_rng(3)
    tree = full_tree(3, 3, rng)
    policy = SequoiaPolicy(16, 3, rates=np.array([0.6]))
    assert policy.tree == [(), (0,), (0, 0), (0, 0, 0)] and policy.verified_nodes == 4 and policy.max_levels == 3
    view = CycleView(tree, np.zeros((tree.n_nodes, 1, 1), dtype=np.int64), np.zeros((1, 1), dtype=bool),
                     CostModel(base_s=1.0, per_node_s=0.0, hit_s=0.0, miss_s=0.0, draft_level_s=0.0), 3,
                     drafter_probs=rng.uniform(0.01, 1.0, tree.n_nodes))
    sel = policy.select(view)
    ranks = sibling_ranks(tree.parents, view.drafter_probs)
    assert rank_paths(tree, ranks, sel.nodes) == set(policy.tree)
