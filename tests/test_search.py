"""The exact subtree search against brute force, the greedy baseline, the stopping rule, the
maximum-weight closure, large-tree sanity and bad input."""

from __future__ import annotations

import math
import re
import time

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from core_helpers import (
    TIE_REL,
    Case,
    Costs,
    RefProblem,
    brute_force_closure,
    core_settings,
    is_closed,
    mirrored_case,
    root_time_positive,
    search_case_st,
)
from specfit import CostModel, DraftTree, Selection, best_subtree, greedy_subtree, kernels, should_continue
from specfit.search import max_weight_closure


# --------------------------------------------------------------------------- helpers
def assert_selection_matches_formula(sel: Selection, case: Case, ref: RefProblem | None = None) -> None:
    """The returned set is well formed and every reported number equals the issue's formula."""
    ref = ref or case.ref()
    nodes = np.asarray(sel.nodes)
    assert np.issubdtype(nodes.dtype, np.integer)
    assert nodes.ndim == 1 and nodes.size >= 1
    assert nodes[0] == 0, "the selection must contain the root"
    assert np.all(np.diff(nodes) > 0), f"nodes must be sorted and unique, got {nodes}"
    assert nodes[-1] < case.n
    assert is_closed(case.parents, nodes), f"not ancestor-closed: {nodes} with parents {case.parents}"
    expected, time_s, hits, misses = ref.evaluate(nodes)
    assert (sel.hits, sel.misses) == (hits, misses)
    assert math.isclose(sel.expected_tokens, expected, rel_tol=1e-13, abs_tol=0)
    assert math.isclose(sel.time_s, time_s, rel_tol=TIE_REL, abs_tol=1e-300)
    assert math.isclose(sel.throughput, sel.expected_tokens / sel.time_s, rel_tol=1e-15)


def check_against_brute_force(case: Case) -> None:
    ref = case.ref()
    best_ratio, smallest, ties, sets = ref.brute_force()
    sel = best_subtree(case.tree, case.experts, case.cached, case.cost, draft_levels=case.draft_levels)
    assert_selection_matches_formula(sel, case, ref)
    got = ref.ratio(sel.nodes)
    example = sorted(ties, key=len)[0]
    # a set whose ratio sits right at the 1e-12 tie boundary may count as a tie or not: when one
    # exists, judge with a margin (optimal to 2e-12, no smaller set within 0.5e-12); otherwise the
    # answer must be exactly the brute force's smallest tie
    gap = [(best_ratio - a / t) / best_ratio for _, a, t, _, _ in sets]
    if any(0.5 * TIE_REL <= g <= 2 * TIE_REL for g in gap):
        assert got >= best_ratio * (1 - 2 * TIE_REL), (
            f"not optimal: ratio {got!r} for {sel.nodes.tolist()}, brute force reaches {best_ratio!r}")
        strict = min(len(s[0]) for s, g in zip(sets, gap) if g < 0.5 * TIE_REL)
        assert sel.nodes.size <= strict
    else:
        assert got >= best_ratio * (1 - TIE_REL), (
            f"not optimal: ratio {got!r} for {sel.nodes.tolist()}, brute force reaches {best_ratio!r} "
            f"with {example}")
        assert tuple(int(v) for v in sel.nodes) in ties
        assert sel.nodes.size == smallest, (
            f"ties go to the smallest set: got {sel.nodes.tolist()}, but {example} has the same ratio "
            f"with {smallest} nodes")
    # the greedy baseline never beats the exact search and is itself a well-formed closed set
    greedy = greedy_subtree(case.tree, case.experts, case.cached, case.cost, draft_levels=case.draft_levels)
    assert_selection_matches_formula(greedy, case, ref)
    assert ref.ratio(greedy.nodes) <= got * (1 + 2 * TIE_REL)  # margin: the tie boundary


# --------------------------------------------------------------------------- exact search vs brute force
@core_settings(700)
@given(search_case_st())
def test_best_subtree_equals_brute_force_on_random_small_trees(case):
    assume(root_time_positive(case))
    check_against_brute_force(case)


@core_settings(300)
@given(search_case_st(max_experts=4))
def test_best_subtree_equals_brute_force_with_few_experts(case):
    # four experts or fewer: almost every pair of nodes shares experts
    assume(root_time_positive(case))
    check_against_brute_force(case)


@core_settings(250)
@given(st.sampled_from(("identical", "pool", "siblings")).flatmap(
    lambda kind: search_case_st(expert_kind=kind, cost_kind="real")))
def test_best_subtree_equals_brute_force_with_heavily_shared_experts(case):
    assume(root_time_positive(case))
    check_against_brute_force(case)


@core_settings(400)
@given(search_case_st(prob_kind=None, cost_kind="dyadic"))
def test_best_subtree_exact_ties_resolve_to_the_smallest_set(case):
    # dyadic probabilities and costs: sums and cross products are exact, so equal ratios are common
    assume(root_time_positive(case))
    check_against_brute_force(case)


@core_settings(250)
@given(search_case_st(prob_kind="near_tie", cost_kind="dyadic"))
def test_best_subtree_near_ties_pick_the_strictly_better_set(case):
    assume(root_time_positive(case))
    check_against_brute_force(case)


@core_settings(250)
@given(st.sampled_from((("miss_s",), ("hit_s",), ("per_node_s",), ("hit_s", "miss_s"),
                        ("per_node_s", "hit_s"), ("draft_level_s", "base_s"), ("base_s", "hit_s")))
       .flatmap(lambda zero: search_case_st(zero=zero)))
def test_best_subtree_equals_brute_force_with_zero_cost_terms(case):
    assume(root_time_positive(case))
    check_against_brute_force(case)


@core_settings(100)
@given(search_case_st(max_nodes=4, max_layers=2, max_experts=3))
def test_best_subtree_equals_brute_force_on_tiny_trees(case):
    assume(root_time_positive(case))
    check_against_brute_force(case)


@core_settings(200)
@given(search_case_st(max_experts=8), st.sampled_from((63, 64, 65, 127, 128, 129, 200)), st.data())
def test_best_subtree_with_expert_ids_across_word_boundaries(case, n_experts, data):
    # the same structure, with expert ids moved to both sides of 64-bit word boundaries
    assume(root_time_positive(case))
    small = case.cached.shape[1]
    boundary = {*range(8), 62, 63, 64, 65, 126, 127, 128, 129, n_experts - 1}
    pool = sorted(b for b in boundary if b < n_experts)
    mapping = np.array(data.draw(st.permutations(pool))[:small])
    cached = np.array(data.draw(st.lists(st.booleans(), min_size=n_experts, max_size=n_experts)))
    cached = np.broadcast_to(cached, (case.cached.shape[0], n_experts)).copy()
    cached[:, mapping] = case.cached
    check_against_brute_force(Case(case.parents, case.probs, mapping[case.experts], cached, case.costs,
                                   case.draft_levels))


@core_settings(150)
@given(search_case_st(), st.data())
def test_best_subtree_answer_does_not_depend_on_the_start_set(case, data):
    assume(root_time_positive(case))
    chosen = data.draw(st.lists(st.integers(0, case.n - 1), max_size=case.n, unique=True))
    start = {0}
    for v in chosen:
        while v not in start:
            start.add(v)
            v = int(case.parents[v])
    plain = best_subtree(case.tree, case.experts, case.cached, case.cost, case.draft_levels)
    warm = best_subtree(case.tree, case.experts, case.cached, case.cost, case.draft_levels, start=sorted(start))
    assert warm.nodes.tolist() == plain.nodes.tolist()
    assert_selection_matches_formula(warm, case)


def test_ties_are_trimmed_against_the_optimum_not_the_set_before():
    """Leaves that each tie the set before them must not drift out of a tie with the optimum (ties
    are not transitive): three free draft nodes worth 0.6e-12, 0.6e-12 and 1e-13 tokens. The best
    ratio is all four nodes; {0, 1} is within 1e-12 of it and smallest; {0} is 1.3e-12 below."""
    tree = DraftTree(parents=np.array([-1, 0, 0, 0]), path_probs=np.array([1.0, 0.6e-12, 0.6e-12, 1e-13]))
    experts, cached = np.zeros((4, 1, 1), dtype=np.int64), np.ones((1, 1), dtype=bool)
    cost = CostModel(base_s=1.0, per_node_s=0.0, hit_s=0.0, miss_s=0.0)
    best = 1.0 + 0.6e-12 + 0.6e-12 + 1e-13
    got = best_subtree(tree, experts, cached, cost)
    assert got.nodes.size == 2 and best - got.expected_tokens < TIE_REL * best      # a tie, the smallest
    assert best - 1.0 > TIE_REL * best                                            # the root alone is none


def test_best_subtree_rejects_a_start_set_that_is_not_closed():
    tree, experts, cached, cost = _valid()
    with pytest.raises(ValueError, match="start"):
        best_subtree(tree, experts, cached, cost, 2, start=[0, 3])


def test_best_subtree_on_a_hand_worked_example():
    # L = 1, E = 4, k = 1; expert 0 resident; worked by hand:
    # {0}: 1/1; {0,1}: 1.5/1.5; {0,2}: 1.25/1.5; {0,1,2}: 1.75/1.5; {0,1,3}: 2/2; {0,1,2,3}: 2.25/2
    tree = DraftTree(parents=np.array([-1, 0, 0, 1]), path_probs=np.array([1.0, 0.5, 0.25, 0.5]))
    experts = np.array([0, 1, 1, 2]).reshape(4, 1, 1)
    cached = np.array([[True, False, False, False]])
    cost = CostModel(base_s=1.0, per_node_s=0.0, hit_s=0.0, miss_s=0.5, draft_level_s=0.0)
    sel = best_subtree(tree, experts, cached, cost, draft_levels=0)
    assert sel.nodes.tolist() == [0, 1, 2]
    assert sel.expected_tokens == 1.75 and sel.time_s == 1.5
    assert (sel.hits, sel.misses) == (1, 1)
    # draft cost shifts the balance: with 2 levels at 0.25 each, {0,1,2,3} (2.25/2.5 = 0.9) beats
    # {0,1,2} (1.75/2 = 0.875)
    sel = best_subtree(tree, experts, cached, cost.replace(draft_level_s=0.25), draft_levels=2)
    assert sel.nodes.tolist() == [0, 1, 2, 3]
    assert sel.time_s == 2.5 and (sel.hits, sel.misses) == (1, 2)


def test_best_subtree_many_tiny_gains_add_up_beyond_the_tie_tolerance():
    # ten free draft nodes of path probability 1e-12 each: all of them together raise the ratio by
    # 1e-11 relative, ten times the tie tolerance, so the root alone is not optimal
    for parents in (np.array([-1] + [0] * 10), np.arange(-1, 10)):
        tree = DraftTree(parents=parents, path_probs=np.array([1.0] + [1e-12] * 10))
        sel = best_subtree(tree, np.zeros((11, 1, 1), dtype=np.int64), np.zeros((1, 1), dtype=bool),
                           CostModel(base_s=1.0, per_node_s=0.0, hit_s=0.0, miss_s=0.0))
        assert sel.nodes.tolist() == list(range(11))
        assert sel.throughput == pytest.approx(1 + 1e-11, rel=1e-15)


def test_best_subtree_prefers_the_root_alone_on_an_exact_tie():
    # every draft node pays exactly its share: the ratio is 1 for every closed set
    tree = DraftTree(parents=np.array([-1, 0, 1]), path_probs=np.array([1.0, 0.5, 0.5]))
    experts = np.array([0, 1, 2]).reshape(3, 1, 1)
    cached = np.zeros((1, 3), dtype=bool)
    cost = CostModel(base_s=0.5, per_node_s=0.0, hit_s=0.0, miss_s=0.5)
    sel = best_subtree(tree, experts, cached, cost)
    assert sel.nodes.tolist() == [0]


def test_best_subtree_sibling_sharing_an_expert_is_nearly_free():
    # node 2 needs the same expert as its sibling 1: together they beat either alone
    tree = DraftTree(parents=np.array([-1, 0, 0]), path_probs=np.array([1.0, 0.4, 0.4]))
    experts = np.array([0, 1, 1]).reshape(3, 1, 1)
    cached = np.array([[True, False]])
    cost = CostModel(base_s=1.0, per_node_s=0.0, hit_s=0.0, miss_s=0.5)
    # {0}: 1; {0,1}: 1.4/1.5; {0,1,2}: 1.8/1.5 = 1.2
    sel = best_subtree(tree, experts, cached, cost)
    assert sel.nodes.tolist() == [0, 1, 2]


def test_best_subtree_zero_probability_nodes_are_never_selected():
    tree = DraftTree(parents=np.array([-1, 0, 1]), path_probs=np.array([1.0, 0.0, 0.0]))
    experts = np.zeros((3, 2, 2), dtype=np.int64)
    cached = np.ones((2, 1), dtype=bool)
    cost = CostModel(base_s=1.0, per_node_s=0.0, hit_s=0.0, miss_s=0.0)
    assert best_subtree(tree, experts, cached, cost).nodes.tolist() == [0]


def test_best_subtree_single_node_tree_is_the_root():
    tree = DraftTree(parents=np.array([-1]), path_probs=np.array([1.0]))
    experts = np.array([[[1, 2]]])
    cached = np.array([[False, True, False]])
    cost = CostModel(base_s=1e-3, per_node_s=1e-4, hit_s=1e-5, miss_s=1e-4, draft_level_s=2e-4)
    sel = best_subtree(tree, experts, cached, cost, draft_levels=2)
    assert sel.nodes.tolist() == [0]
    assert (sel.hits, sel.misses) == (1, 1)
    assert sel.time_s == pytest.approx(2 * 2e-4 + 1e-3 + 1e-4 + 1e-5 + 1e-4, rel=1e-15)


def test_best_subtree_with_zero_layers_or_zero_top_k():
    tree = DraftTree(parents=np.array([-1, 0, 0]), path_probs=np.array([1.0, 0.75, 0.25]))
    cost = CostModel(base_s=1.0, per_node_s=0.5, hit_s=0.0, miss_s=1.0)
    # only node costs: {0}: 1/1.5; {0,1}: 1.75/2; {0,1,2}: 2/2.5
    for experts, cached in ((np.zeros((3, 0, 2), dtype=np.int64), np.zeros((0, 4), dtype=bool)),
                            (np.zeros((3, 2, 0), dtype=np.int64), np.zeros((2, 4), dtype=bool))):
        sel = best_subtree(tree, experts, cached, cost)
        assert sel.nodes.tolist() == [0, 1]
        assert (sel.hits, sel.misses) == (0, 0)


def test_best_subtree_when_the_root_costs_nothing_rejects_the_cost_model():
    # valid (non-negative) costs under which verifying the root alone takes zero time (nothing to
    # divide by): one ValueError naming the cost model, from the search with or without a start set
    tree = DraftTree(parents=np.array([-1, 0]), path_probs=np.array([1.0, 0.5]))
    experts = np.zeros((2, 1, 1), dtype=np.int64)
    cached = np.ones((1, 2), dtype=bool)
    for cost in (CostModel(base_s=0.0, per_node_s=0.0, hit_s=0.0, miss_s=0.0),
                 CostModel(base_s=0.0, per_node_s=0.0, hit_s=0.0, miss_s=1.0)):
        for start in (None, [0, 1]):
            with pytest.raises(ValueError, match="cost: verifying the root alone is predicted to take 0 s"):
                best_subtree(tree, experts, cached, cost, start=start)
        with pytest.raises(ValueError, match="cost: verifying the root alone"):
            greedy_subtree(tree, experts, cached, cost)


# --------------------------------------------------------------------------- greedy baseline
@core_settings(200)
@given(search_case_st(max_nodes=16))
def test_greedy_never_beats_exact_and_is_closed(case):
    assume(root_time_positive(case))
    ref = case.ref()
    exact = best_subtree(case.tree, case.experts, case.cached, case.cost, case.draft_levels)
    greedy = greedy_subtree(case.tree, case.experts, case.cached, case.cost, case.draft_levels)
    assert_selection_matches_formula(exact, case, ref)
    assert_selection_matches_formula(greedy, case, ref)
    assert ref.ratio(greedy.nodes) <= ref.ratio(exact.nodes) * (1 + TIE_REL)


def tie_rule_beats(lhs: float, rhs: float, a_nodes: int, b_nodes: int) -> bool:
    """The searches' comparison of a against b, given ``lhs`` / ``rhs`` (their ratios, or the cross
    products of their tokens and times): the higher wins, and within TIE_REL the smaller set."""
    if abs(lhs - rhs) > TIE_REL * max(abs(lhs), abs(rhs)):
        return lhs > rhs
    return a_nodes < b_nodes


def greedy_reference(ref: RefProblem, draft_node_s: float = 0.0) -> list[int]:
    """The greedy rule in plain Python: from the root, add the frontier node (lowest id first among
    equals) whose set has the best priced ratio, while that beats the current set; a tie within
    TIE_REL goes to the smaller set, as in the search."""
    def priced(nodes):
        tokens, time_s, _, _ = ref.evaluate(nodes)
        return tokens, time_s + draft_node_s * (len(nodes) - 1), len(nodes)

    def beats(a, b):
        return tie_rule_beats(a[0] * b[1], b[0] * a[1], a[2], b[2])

    chosen, current = [0], priced([0])
    while True:
        frontier = [v for v in range(1, len(ref.parents)) if v not in chosen and ref.parents[v] in chosen]
        if not frontier:
            return chosen
        top = None
        for v in frontier:
            trial = (v, priced(chosen + [v]))
            if top is None or beats(trial[1], top[1]):
                top = trial
        if not beats(top[1], current):
            return chosen
        chosen, current = sorted(chosen + [top[0]]), top[1]


@core_settings(200)
@given(search_case_st(max_nodes=24), st.sampled_from([0.0, 1e-5, 1e-3]))
def test_greedy_follows_its_rule_step_by_step(case, draft_node_s):
    assume(root_time_positive(case))
    greedy = greedy_subtree(case.tree, case.experts, case.cached, case.cost, case.draft_levels, draft_node_s)
    assert greedy.nodes.tolist() == greedy_reference(case.ref(), draft_node_s)


@pytest.mark.parametrize("seed", range(3))
def test_greedy_follows_its_rule_on_eagle_shaped_trees(seed):
    case = eagle_like_case(64, 500 + seed, LARGE_COSTS["mid"], n_layers=8, n_experts=32, top_k=4)
    greedy = greedy_subtree(case.tree, case.experts, case.cached, case.cost, case.draft_levels)
    expected = greedy_reference(case.ref())
    assert len(expected) > 3                  # the rule took several steps on these trees
    assert greedy.nodes.tolist() == expected


def test_greedy_misses_a_pair_that_only_pays_off_together():
    # node 1 alone lowers the ratio (a new expert), so greedy stops; with its child 2 it pays off
    tree = DraftTree(parents=np.array([-1, 0, 1]), path_probs=np.array([1.0, 1.0, 1.0]))
    experts = np.array([0, 1, 1]).reshape(3, 1, 1)
    cached = np.array([[True, False]])
    cost = CostModel(base_s=1.0, per_node_s=0.0, hit_s=0.0, miss_s=1.5)
    # {0}: 1; {0,1}: 2/2.5; {0,1,2}: 3/2.5
    assert greedy_subtree(tree, experts, cached, cost).nodes.tolist() == [0]
    assert best_subtree(tree, experts, cached, cost).nodes.tolist() == [0, 1, 2]


# --------------------------------------------------------------------------- stopping rule
def _sel(nodes, expected, time_s, levels=1):
    return Selection(nodes=np.asarray(nodes, dtype=np.int64), expected_tokens=expected, time_s=time_s,
                     hits=0, misses=0, draft_levels=levels)


def test_should_continue_semantics():
    prev = _sel([0, 1], 1.5, 1.0)
    assert should_continue(None, prev) is True
    assert should_continue(prev, _sel([0, 1, 2], 1.75, 1.0)) is True      # strictly better ratio
    assert should_continue(prev, _sel([0, 1, 2], 1.5, 1.25)) is False     # worse
    assert should_continue(prev, _sel([0, 1, 2], 3.0, 2.0)) is False      # tie, larger
    assert should_continue(prev, _sel([0, 2], 1.5, 1.0)) is False         # tie, same size
    assert should_continue(prev, _sel([0], 0.75, 0.5)) is True            # tie, smaller
    # within 1e-12 relative is a tie; 1e-9 is not
    assert should_continue(prev, _sel([0, 1, 2], 1.5 * (1 + 1e-14), 1.0)) is False
    assert should_continue(prev, _sel([0, 1, 2], 1.5 * (1 + 1e-9), 1.0)) is True
    assert should_continue(prev, _sel([0, 1, 2], 1.5 * (1 - 1e-9), 1.0)) is False


@core_settings(200)
@given(search_case_st(tree_shape="level_order", max_nodes=10))
def test_should_continue_matches_brute_force_level_by_level(case):
    # level-ordered trees: the first d levels are a prefix of the node ids
    assume(root_time_positive(Case(case.parents[:1], case.probs[:1], case.experts[:1], case.cached,
                                   case.costs, 0)))
    depth = np.zeros(case.n, dtype=np.int64)
    for v in range(1, case.n):
        depth[v] = depth[case.parents[v]] + 1
    previous, prev_ref = None, None
    for d in range(int(depth.max()) + 1):
        m = int(np.count_nonzero(depth <= d))
        sub = Case(case.parents[:m], case.probs[:m], case.experts[:m], case.cached, case.costs, d)
        ref = sub.ref()
        current = best_subtree(sub.tree, sub.experts, sub.cached, sub.cost, draft_levels=d)
        best_ratio, smallest, _, _ = ref.brute_force()
        if previous is not None:
            expect = tie_rule_beats(best_ratio, prev_ref[0], smallest, prev_ref[1])
            assert should_continue(previous, current) is expect, (d, best_ratio, prev_ref[0])
        previous, prev_ref = current, (best_ratio, smallest)


# --------------------------------------------------------------------------- maximum-weight closure
@st.composite
def closure_problem_st(draw, weights=None):
    m = draw(st.integers(1, 10))
    w = draw(st.lists(weights if weights is not None else st.integers(-5, 5), min_size=m, max_size=m))
    pairs = st.tuples(st.integers(0, m - 1), st.integers(0, m - 1))
    requires = draw(st.lists(pairs, max_size=2 * m))
    return w, requires


@core_settings(300)
@given(closure_problem_st())
def test_max_weight_closure_equals_brute_force_with_integer_weights(problem):
    weights, requires = problem
    got = np.asarray(max_weight_closure(np.array(weights, dtype=np.float64), requires))
    assert got.dtype == np.bool_ and got.shape == (len(weights),)
    assert np.array_equal(got, brute_force_closure(weights, requires)), (weights, requires, got)


@core_settings(150)
@given(closure_problem_st(weights=st.floats(-1.0, 1.0).filter(lambda x: x == 0.0 or abs(x) > 1e-6)))
def test_max_weight_closure_equals_brute_force_with_float_weights(problem):
    weights, requires = problem
    m = len(weights)
    closed = [mask for mask in range(1 << m)
              if not any((mask >> u) & 1 and not (mask >> v) & 1 for u, v in requires)]
    value = {mask: math.fsum(weights[i] for i in range(m) if (mask >> i) & 1) for mask in closed}
    best = max(value.values())
    # only judge the exact set when no other closed set is within rounding of the best
    assume(sum(1 for x in value.values() if x >= best - 1e-9) == 1
           or all(x == best for x in value.values() if x >= best - 1e-9))
    expected = brute_force_closure(weights, requires)
    got = np.asarray(max_weight_closure(np.array(weights, dtype=np.float64), requires))
    assert np.array_equal(got, expected), (weights, requires, got)


@pytest.mark.parametrize("weights, requires, message", [
    (np.ones((2, 2)), [], "weights: expected a 1-D array"),
    (["a", 1.0], [], "weights: expected a 1-D array"),
    ([1.0, np.inf], [], "weights: expected finite numbers, got inf at index 1"),
    ([1.0, -1.0], [(0.9, 1.7)], "requires: expected pairs of integer indices"),     # was read as (0, 1)
    ([1.0, -1.0], [(0, 1), (1,)], "requires: expected pairs of integer indices"),
])
def test_max_weight_closure_names_its_bad_input(weights, requires, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        max_weight_closure(weights, requires)


def test_max_weight_closure_hand_examples():
    # 0 (+3) needs 2 (-2); 1 (+1) needs 2: take all three (+2)
    assert max_weight_closure(np.array([3.0, 1.0, -2.0]), [(0, 2), (1, 2)]).tolist() == [True, True, True]
    # zero-gain project: left out (minimal closure)
    assert max_weight_closure(np.array([2.0, -2.0]), [(0, 1)]).tolist() == [False, False]
    # a cycle of requirements acts as one block
    assert max_weight_closure(np.array([2.0, -1.0, -0.5]), [(0, 1), (1, 2), (2, 0)]).tolist() == [True] * 3
    assert max_weight_closure(np.array([0.0, 0.0]), []).tolist() == [False, False]


# --------------------------------------------------------------------------- larger trees
def eagle_like_case(n: int, seed: int, costs: Costs, n_layers=48, n_experts=128, top_k=8, draft_levels=None):
    """A level-by-level top-k style tree with skewed, partly inherited routing."""
    rng = np.random.default_rng(seed)
    parents = [-1]
    probs = [1.0]
    frontier = [0]
    while len(parents) < n:
        nxt = []
        for u in frontier:
            for rank in range(int(rng.integers(1, 5))):
                if len(parents) == n:
                    break
                q = rng.uniform(0.2, 0.95) / (1 + rank)
                parents.append(u)
                probs.append(probs[u] * q)
                nxt.append(len(parents) - 1)
        frontier = nxt or [int(rng.integers(0, len(parents)))]
    parents = np.array(parents, dtype=np.int64)
    probs = np.array(probs)
    popularity = rng.dirichlet(np.full(n_experts, 0.3), size=n_layers)
    experts = np.zeros((n, n_layers, top_k), dtype=np.int64)
    for v in range(n):
        for layer in range(n_layers):
            if v and rng.random() < 0.5:
                row = experts[parents[v], layer].copy()
                for slot in rng.choice(top_k, size=int(rng.integers(1, 4)), replace=False):
                    candidates = np.setdiff1d(np.arange(n_experts), row)
                    row[slot] = rng.choice(candidates)
                experts[v, layer] = row
            else:
                experts[v, layer] = rng.choice(n_experts, size=top_k, replace=False, p=popularity[layer])
    cached = rng.random((n_layers, n_experts)) < 0.25
    cached[np.arange(n_layers)[:, None], experts[0]] |= rng.random((n_layers, top_k)) < 0.8
    depth = np.zeros(n, dtype=np.int64)
    for v in range(1, n):
        depth[v] = depth[parents[v]] + 1
    levels = int(depth.max()) if draft_levels is None else draft_levels
    return Case(parents, probs, experts, cached, costs, levels)


LARGE_COSTS = {
    "pcie": Costs(base_s=3e-3, per_node_s=4e-5, hit_s=1.5e-5, miss_s=2e-4, draft_level_s=8e-4),
    "mid": Costs(base_s=3e-3, per_node_s=4e-5, hit_s=1e-6, miss_s=4e-6, draft_level_s=8e-4),
    "fast": Costs(base_s=3e-3, per_node_s=2e-5, hit_s=1e-7, miss_s=5e-7, draft_level_s=2e-4),
    "free_experts": Costs(base_s=3e-3, per_node_s=1e-4, hit_s=0.0, miss_s=0.0, draft_level_s=0.0),
}


class _Counts:
    """Fast (numpy) union counts for local-move checks on large trees."""

    def __init__(self, case: Case):
        n, n_layers, _ = case.experts.shape
        n_experts = case.cached.shape[1]
        self.case = case
        self.items = case.experts + (np.arange(n_layers) * n_experts)[None, :, None]
        self.items = self.items.reshape(n, -1)
        self.cached = case.cached.ravel()
        self.n_items = n_layers * n_experts

    def ratio(self, nodes) -> float:
        nodes = np.asarray(sorted(set(int(v) for v in nodes) | {0}))
        union = np.zeros(self.n_items, dtype=bool)
        union[self.items[nodes].ravel()] = True
        hits = int(np.count_nonzero(union & self.cached))
        misses = int(np.count_nonzero(union)) - hits
        c = self.case.costs
        t = (c.draft_level_s * self.case.draft_levels + c.base_s + c.per_node_s * nodes.size
             + c.hit_s * hits + c.miss_s * misses)
        return (1.0 + math.fsum(self.case.probs[nodes[1:]])) / t


def lp_optimum(case: Case, lower_bound: float):
    """The exact optimum ratio by the Charnes-Cooper LP of the closure relaxation (its constraint
    matrix is totally unimodular, so the relaxation is tight), plus threshold-rounded sets.

    Nodes that cannot be in an optimal set are left out first: a leaf v of an optimal set S*
    satisfies p_v >= lambda* * (T(S*) - T(S* - v)) >= lambda * (per_node_s + cost of the items no
    other node routes to), for any achievable ratio lambda <= lambda*, and every node of S* has
    such a leaf at or below it with a path probability no larger than its own.
    """
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    c = case.costs
    n, n_layers, _ = case.experts.shape
    n_experts = case.cached.shape[1]
    items = (case.experts + (np.arange(n_layers) * n_experts)[None, :, None]).reshape(n, -1)
    w_item = np.where(case.cached.ravel(), c.hit_s, c.miss_s)
    item_sets = [set(row.tolist()) for row in items]
    users = np.zeros(n_layers * n_experts, dtype=np.int64)
    for s_ in item_sets:
        users[list(s_)] += 1
    unique_cost = np.array([sum(w_item[i] for i in s_ if users[i] == 1) for s_ in item_sets])
    good = case.probs >= lower_bound * (c.per_node_s + unique_cost) * (1 - 1e-9)
    keep = good.copy()
    keep[0] = True
    for v in range(n - 1, 0, -1):          # a node stays when some node at or below it is good
        if keep[v]:
            keep[int(case.parents[v])] = True
    nodes = [v for v in range(1, n) if keep[v]]
    col = {0: 0, **{v: j + 1 for j, v in enumerate(nodes)}}  # columns: s, z_v (kept), u_items
    root_items = item_sets[0]
    item_col: dict[int, int] = {}
    rows, cols, vals = [], [], []
    r = 0
    for v in nodes:
        p = int(case.parents[v])
        rows += [r, r]                      # z_v - z_parent <= 0 (z_0 is s)
        cols += [col[v], col[p]]
        vals += [1.0, -1.0]
        r += 1
        # z_v - u_i <= 0 for items new below the parent (the parent's own constraints cover the rest)
        for i in item_sets[v] - root_items - (item_sets[p] if p else set()):
            j = item_col.setdefault(i, len(nodes) + 1 + len(item_col))
            rows += [r, r]
            cols += [col[v], j]
            vals += [1.0, -1.0]
            r += 1
    n_cols = len(nodes) + 1 + len(item_col)
    c0 = c.draft_level_s * case.draft_levels + c.base_s + c.per_node_s + float(w_item[list(root_items)].sum())
    a_eq = np.zeros((1, n_cols))
    a_eq[0, 0] = c0
    a_eq[0, 1:len(nodes) + 1] = c.per_node_s
    for i, j in item_col.items():
        a_eq[0, j] = w_item[i]
    objective = np.zeros(n_cols)
    objective[0] = -1.0
    objective[1:len(nodes) + 1] = -case.probs[nodes]
    a_ub = coo_matrix((vals, (rows, cols)), shape=(max(r, 1), n_cols)).tocsr() if r else None
    res = linprog(objective, A_ub=a_ub, b_ub=np.zeros(r) if r else None, A_eq=a_eq, b_eq=[1.0],
                  bounds=(0, None), method="highs-ipm")
    assert res.status == 0, res.message
    x = res.x[1:len(nodes) + 1] / res.x[0]
    rounded = [[0] + [v for v, xv in zip(nodes, x) if xv >= theta] for theta in (1e-6, 0.5, 1 - 1e-6)]
    return -res.fun, rounded, keep


def timed_solve(case) -> tuple[Selection, float]:
    """(the search's answer, its seconds), after a small solve that compiles (or loads) the kernels:
    the bound below is on the solve, which must never take seconds, not on numba's first call."""
    small = eagle_like_case(8, 0, next(iter(LARGE_COSTS.values())))
    best_subtree(small.tree, small.experts, small.cached, small.cost, draft_levels=small.draft_levels)
    start = time.perf_counter()
    sel = best_subtree(case.tree, case.experts, case.cached, case.cost, draft_levels=case.draft_levels)
    return sel, time.perf_counter() - start


@pytest.mark.parametrize("n", [64, 256])
@pytest.mark.parametrize("cost_name", list(LARGE_COSTS))
def test_best_subtree_on_large_trees_is_closed_consistent_and_beats_simple_candidates(n, cost_name):
    seeds = (0, 1) if n == 64 else (7,)
    for seed in seeds:
        case = eagle_like_case(n, seed + 100 * n, LARGE_COSTS[cost_name])
        ref = case.ref()
        sel, elapsed = timed_solve(case)
        assert elapsed < 10.0, f"a {n}-node solve took {elapsed:.1f} s"
        assert_selection_matches_formula(sel, case, ref)
        counts = _Counts(case)
        got = counts.ratio(sel.nodes)
        floor = got * (1 + TIE_REL)
        greedy = greedy_subtree(case.tree, case.experts, case.cached, case.cost, case.draft_levels)
        assert counts.ratio(greedy.nodes) <= floor
        for v in range(n):  # every root-to-node path
            path = [v]
            while path[-1] != 0:
                path.append(int(case.parents[path[-1]]))
            assert counts.ratio(path) <= floor, f"path to {v} beats the search"
        # local optimality: no single frontier node added, no single leaf removed, does better or ties
        chosen = set(sel.nodes.tolist())
        for v in range(1, n):
            if v not in chosen and int(case.parents[v]) in chosen:
                assert counts.ratio(chosen | {v}) <= floor, f"adding {v} improves"
        has_child = {int(case.parents[v]) for v in chosen if v}
        for v in chosen - has_child - {0}:
            assert counts.ratio(chosen - {v}) < got * (1 - TIE_REL), f"removing leaf {v} does not lose"
        # the LP relaxation is tight: its value is the optimum
        lower = max(counts.ratio(greedy.nodes), counts.ratio([0]))
        lp_value, rounded, possible = lp_optimum(case, lower)
        assert got >= lp_value * (1 - 1e-9), f"LP reaches {lp_value}, the search {got}"
        for nodes in rounded:
            assert counts.ratio(nodes) <= floor
        # the smallest optimal set has only nodes that can be in an optimal set
        assert possible[sel.nodes].all()


@core_settings(150)
@given(st.integers(1, 5), st.integers(1, 4), st.integers(0, 2), st.floats(0.005, 0.2), st.floats(0.5, 1.0))
def test_best_subtree_equals_brute_force_on_mirrored_cousins(depth, shared, unique, miss_s, decay):
    case = mirrored_case(depth, shared, unique, miss_s, decay, n_layers=2, n_experts=40)
    check_against_brute_force(case)


@pytest.mark.parametrize("shared, unique, miss_s, decay", [(4, 0, 0.02, 0.99), (3, 1, 0.01, 0.995)])
def test_best_subtree_on_255_node_mirrored_cousins_matches_the_lp_optimum(shared, unique, miss_s, decay):
    case = mirrored_case(127, shared, unique, miss_s, decay)
    sel, elapsed = timed_solve(case)
    assert elapsed < 10.0, f"a 255-node solve took {elapsed:.1f} s"
    assert_selection_matches_formula(sel, case)
    counts = _Counts(case)
    got = counts.ratio(sel.nodes)
    greedy = greedy_subtree(case.tree, case.experts, case.cached, case.cost)
    assert counts.ratio(greedy.nodes) <= got * (1 + TIE_REL)
    lp_value, rounded, _ = lp_optimum(case, max(counts.ratio(greedy.nodes), counts.ratio([0])))
    assert got >= lp_value * (1 - 1e-9), f"LP reaches {lp_value}, the search {got}"
    for nodes in rounded:
        assert counts.ratio(nodes) <= got * (1 + TIE_REL)


def test_best_subtree_on_a_deep_chain():
    # 256 levels: long augmenting paths and a deep tree DP
    n = 256
    parents = np.arange(-1, n - 1, dtype=np.int64)
    probs = 0.97 ** np.arange(n)
    rng = np.random.default_rng(3)
    experts = rng.integers(0, 16, size=(n, 4, 2))
    experts[1::3] = experts[0]          # every third node reuses the root's experts
    cached = rng.random((4, 16)) < 0.3
    case = Case(parents, probs, experts, cached, Costs(1.0, 0.01, 0.001, 0.05, 0.0), 0)
    sel = best_subtree(case.tree, case.experts, case.cached, case.cost)
    assert_selection_matches_formula(sel, case)
    counts = _Counts(case)
    got = counts.ratio(sel.nodes)
    for m in range(1, n + 1):  # the closed sets of a chain are its prefixes: brute force
        assert counts.ratio(range(m)) <= got * (1 + TIE_REL)
    best_m = max(range(1, n + 1), key=lambda m: (counts.ratio(range(m)), -m))
    assert sel.nodes.size <= best_m or counts.ratio(range(best_m)) < got * (1 + TIE_REL)


# --------------------------------------------------------------------------- bad input
def _valid():
    tree = DraftTree(parents=np.array([-1, 0, 0, 1]), path_probs=np.array([1.0, 0.6, 0.3, 0.45]))
    experts = np.zeros((4, 2, 2), dtype=np.int64)
    experts[:, :, 1] = 1
    cached = np.zeros((2, 3), dtype=bool)
    cost = CostModel(base_s=3e-3, per_node_s=4e-5, hit_s=1.5e-5, miss_s=2e-4, draft_level_s=8e-4)
    return tree, experts, cached, cost


@pytest.mark.parametrize("fn", [best_subtree, greedy_subtree])
@pytest.mark.parametrize("change, name", [
    (lambda a: {**a, "experts": a["experts"][:3]}, "experts"),                     # node count
    (lambda a: {**a, "experts": a["experts"][:, :1]}, "experts"),                  # layer count
    (lambda a: {**a, "experts": a["experts"][:, :, 0]}, "experts"),                # 2-D
    (lambda a: {**a, "experts": a["experts"].astype(np.float64)}, "experts"),      # not integers
    (lambda a: {**a, "experts": a["experts"] + 2}, "experts"),                     # id 3 >= E
    (lambda a: {**a, "experts": a["experts"] - 1}, "experts"),                     # id -1
    (lambda a: {**a, "cached": a["cached"].astype(np.int64)}, "cached"),           # not bool
    (lambda a: {**a, "cached": a["cached"][0]}, "cached"),                         # 1-D
    (lambda a: {**a, "cached": np.zeros((3, 3), dtype=bool)}, "experts|cached"),   # layers differ
    (lambda a: {**a, "cost": {"base_s": 1.0}}, "cost"),
    (lambda a: {**a, "tree": np.array([-1, 0, 0, 1])}, "tree"),
    (lambda a: {**a, "draft_levels": -1}, "draft_levels"),
    (lambda a: {**a, "draft_levels": 1.5}, "draft_levels"),
    (lambda a: {**a, "draft_levels": float("nan")}, "draft_levels"),
    (lambda a: {**a, "draft_levels": float("inf")}, "draft_levels"),
])
def test_search_rejects_bad_input_naming_the_argument(fn, change, name):
    tree, experts, cached, cost = _valid()
    args = change({"tree": tree, "experts": experts, "cached": cached, "cost": cost, "draft_levels": 2})
    with pytest.raises(ValueError, match=name):
        fn(**args)


@pytest.mark.parametrize("field", ["base_s", "per_node_s", "hit_s", "miss_s", "draft_level_s"])
@pytest.mark.parametrize("value", [-1e-6, float("nan"), float("-inf")])
def test_negative_or_nan_costs_are_rejected_naming_the_field(field, value):
    params = dict(base_s=3e-3, per_node_s=4e-5, hit_s=1.5e-5, miss_s=2e-4, draft_level_s=8e-4)
    params[field] = value
    with pytest.raises(ValueError, match=field):
        CostModel(**params)


def test_a_read_only_view_of_a_changing_residency_is_searched_as_it_is_now():
    # only a residency the cache registered (ExpertCache.resident(read_only=True)) is packed once;
    # a caller's read-only view of an array it then changes is read afresh at every search
    from specfit import ExpertCache

    tree = DraftTree(parents=[-1, 0, 0], path_probs=[1.0, 0.6, 0.3])
    experts = np.array([[[0, 1]], [[2, 3]], [[4, 5]]])
    cost = CostModel(base_s=1e-3, per_node_s=1e-4, hit_s=1e-5, miss_s=1e-3)
    base = np.zeros((1, 8), dtype=bool)
    view = base.view()
    view.flags.writeable = False
    assert best_subtree(tree, experts, view, cost).hits == 0
    base[:] = True
    assert best_subtree(tree, experts, view, cost).hits == best_subtree(tree, experts, base.copy(), cost).hits > 0
    cache = ExpertCache(1, 8, capacity=8)
    cache.admit(np.array([[True] * 6 + [False] * 2]))
    resident = cache.resident(read_only=True)
    assert not resident.flags.writeable
    assert best_subtree(tree, experts, resident, cost).hits == best_subtree(tree, experts, base.copy(), cost).hits


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_max_weight_closure_refuses_weights_that_are_not_finite(bad):
    with pytest.raises(ValueError, match="weights: expected finite numbers, got .* at index 1"):
        max_weight_closure(np.array([1.0, bad]), [])


def test_a_registered_residency_is_packed_once_per_thread_and_never_traded_between_threads():
    """Two decoders in two threads each register their cycle's residency: each thread's searches
    get the words of its own (packed once), whatever the other registered meanwhile."""
    import threading

    from specfit.search import packed, remember_packed

    rng = np.random.default_rng(0)
    mine = remember_packed(rng.random((4, 70)) < 0.5)
    words = packed(mine)
    seen = {}

    def other():
        theirs = remember_packed(rng.random((4, 70)) < 0.5)
        seen["theirs"] = (packed(theirs), kernels.bitsets.pack_mask(theirs))

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    np.testing.assert_array_equal(seen["theirs"][0], seen["theirs"][1])
    assert packed(mine) is words                     # still this thread's, packed once
    np.testing.assert_array_equal(words, kernels.bitsets.pack_mask(mine))


def test_a_remembered_residency_made_writable_again_is_packed_afresh():
    from specfit import kernels
    from specfit.search import packed, remember_packed

    cached = np.zeros((2, 70), dtype=bool)
    remember_packed(cached)
    packed(cached)                               # packed once, remembered
    cached.flags.writeable = True                # a writable array can change under the cache
    cached[1, 65] = True
    np.testing.assert_array_equal(packed(cached), kernels.bitsets.pack_mask(cached))


def test_closure_requirement_naming_one_past_the_last_weight_is_refused():
    from specfit.search import max_weight_closure

    # index 2 of two weights would name the kernel's source vertex
    with pytest.raises(ValueError, match="requires: expected pairs of integer indices into 2 weights"):
        max_weight_closure(np.array([1.0, -1.0]), [(0, 2)])


def test_max_weight_closure_a_rounding_gain_at_large_weights_is_a_tie():
    # a project worth fl(a + b) that needs two costs a and b: zero gain in reals, but the flow's
    # residual (c - a) - b is 1.5e-11, a rounding of numbers near 2e5, far below GAIN_EPS times
    # the weights' magnitude: a tie, so the minimal closure (nothing) is the answer
    a, b = 104097.35239361947, 101652.7635528529
    c = a + b
    assert (c - a) - b > 1e-12           # the float residual the cut has to treat as saturated
    got = max_weight_closure(np.array([c, -a, -b]), [(0, 1), (0, 2)])
    assert got.tolist() == [False, False, False]
    # scaled down to where rounding is below GAIN_EPS itself, the same answer
    got = max_weight_closure(np.array([c, -a, -b]) * 1e-6, [(0, 1), (0, 2)])
    assert got.tolist() == [False, False, False]
    # a real gain at that scale (one unit) is taken
    got = max_weight_closure(np.array([c + 1.0, -a, -b]), [(0, 1), (0, 2)])
    assert got.tolist() == [True, True, True]


def test_greedy_grows_along_a_chain_to_every_node_that_pays():
    # a chain 0 -> 1 -> 2 sharing the root's resident expert (hits and misses free): each node
    # costs 0.1 s; {0}: 1/1.1, {0,1}: 1.9/1.2, {0,1,2}: 2.7/1.3, so greedy adds 1, then its child 2
    tree = DraftTree(parents=np.array([-1, 0, 1]), path_probs=np.array([1.0, 0.9, 0.8]))
    experts = np.zeros((3, 1, 1), dtype=np.int64)
    cached = np.array([[True, False]])
    cost = CostModel(base_s=1.0, per_node_s=0.1, hit_s=0.0, miss_s=0.0)
    greedy = greedy_subtree(tree, experts, cached, cost)
    assert greedy.nodes.tolist() == [0, 1, 2]
    assert greedy.expected_tokens == 2.7 and greedy.time_s == 1.3
    # the same on a deeper chain reached through a branch: 0 -> 1 -> 3 -> 4 and a poor sibling 2
    tree = DraftTree(parents=np.array([-1, 0, 0, 1, 3]), path_probs=np.array([1.0, 0.9, 0.01, 0.8, 0.7]))
    greedy = greedy_subtree(tree, np.zeros((5, 1, 1), dtype=np.int64), cached, cost)
    assert greedy.nodes.tolist() == [0, 1, 3, 4]


def test_a_node_sharing_the_roots_resident_expert_pays_for_its_node_cost_alone():
    # the root's expert is resident (a hit, 0.5 s) and node 1 needs the same one: adding it costs
    # only the per-node 0.1 s. {0}: 1 / 1.6 = 0.625; {0,1}: 1.2 / 1.7 = 0.706: node 1 pays
    tree = DraftTree(parents=np.array([-1, 0]), path_probs=np.array([1.0, 0.2]))
    experts = np.zeros((2, 1, 1), dtype=np.int64)
    cached = np.array([[True, False]])
    cost = CostModel(base_s=1.0, per_node_s=0.1, hit_s=0.5, miss_s=1.0)
    sel = best_subtree(tree, experts, cached, cost)
    assert sel.nodes.tolist() == [0, 1]
    assert (sel.hits, sel.misses) == (1, 0)
    assert abs(sel.time_s - 1.7) < 1e-12 and abs(sel.expected_tokens - 1.2) < 1e-12


def test_an_expert_id_equal_to_the_number_of_experts_is_refused():
    # ids run 0 .. E - 1; E itself is one past the last (a bit no residency word holds)

    from specfit.search import evaluate

    tree = DraftTree(parents=np.array([-1, 0]), path_probs=np.array([1.0, 0.01]))
    cached = np.zeros((1, 4), dtype=bool)
    cost = CostModel(base_s=1.0, per_node_s=0.1, hit_s=0.0, miss_s=0.5)
    for experts in (np.array([[[4]], [[0]]]), np.array([[[0]], [[4]]])):
        with pytest.raises(ValueError, match="experts"):
            evaluate(tree, [0, 1], experts, cached, cost)
        with pytest.raises(ValueError, match="experts"):
            best_subtree(tree, experts, cached, cost)    # node 1 cannot pay: the root-alone path


def test_a_selection_naming_the_tree_size_or_a_node_twice_is_checked_before_the_formula():
    # ids 0 .. n - 1: n is refused naming the argument; a repeated id is deduplicated, so the node
    # is counted once (tokens 1 + 0.6; time 1 + 2 x 0.1 + hit 0.01 + miss 0.5 = 1.71)

    from specfit.search import evaluate

    tree = DraftTree(parents=np.array([-1, 0, 0, 1]), path_probs=np.array([1.0, 0.6, 0.5, 0.25]))
    experts = np.array([0, 1, 2, 3]).reshape(4, 1, 1)
    cached = np.array([[True, False, False, False]])
    cost = CostModel(base_s=1.0, per_node_s=0.1, hit_s=0.01, miss_s=0.5)
    for nodes in ([0, 4], np.array([0, 4]), np.array([0, 1, 4]), np.array([0, 1, 3, 4])):
        with pytest.raises(ValueError, match="node 4 is out of range"):
            evaluate(tree, nodes, experts, cached, cost)
        with pytest.raises(ValueError, match="start: node 4 is out of range"):
            best_subtree(tree, experts, cached, cost, start=nodes)
    for nodes in ([0, 1, 1], np.array([0, 1, 1])):
        sel = evaluate(tree, nodes, experts, cached, cost)
        assert sel.nodes.tolist() == [0, 1]
        assert sel.expected_tokens == 1.6 and (sel.hits, sel.misses) == (1, 1)
        assert abs(sel.time_s - 1.71) < 1e-12


def test_ties_are_trimmed_when_the_leaves_share_a_resident_expert_with_the_root():
    """As test_ties_are_trimmed_against_the_optimum_not_the_set_before, with every node needing the
    root's resident expert at a hit cost of 0.5 s: a leaf's removal saves no expert time (the
    root still reads it), so the trim weighs each leaf's tokens against nothing but its node time
    (zero) and ends at the same smallest tie, {0, 1} (time 1.5 s for every set)."""
    tree = DraftTree(parents=np.array([-1, 0, 0, 0]), path_probs=np.array([1.0, 0.6e-12, 0.6e-12, 1e-13]))
    experts, cached = np.zeros((4, 1, 1), dtype=np.int64), np.ones((1, 1), dtype=bool)
    cost = CostModel(base_s=1.0, per_node_s=0.0, hit_s=0.5, miss_s=0.0)
    best = 1.0 + 0.6e-12 + 0.6e-12 + 1e-13
    got = best_subtree(tree, experts, cached, cost)
    assert got.nodes.tolist() == [0, 1]
    assert got.time_s == 1.5 and (got.hits, got.misses) == (1, 0)
    assert best - got.expected_tokens < 1e-12 * best


def test_the_tie_trim_never_drops_a_node_whose_child_stays():
    # chain 0 -> 1 -> 2; node 1 needs a new expert (0.5 s), node 2 the root's resident one.
    # {0}: 1 / 1; {0,1}: 1.5 / 1.5; {0,1,2}: 2 / 1.5 = 1.33, the optimum. Without node 1, {0, 2}
    # would read 1.5 / 1, but it is not ancestor-closed: node 1 is no leaf while 2 is selected
    tree = DraftTree(parents=np.array([-1, 0, 1]), path_probs=np.array([1.0, 0.5, 0.5]))
    experts = np.array([0, 1, 0]).reshape(3, 1, 1)
    cached = np.array([[True, False]])
    cost = CostModel(base_s=1.0, per_node_s=0.0, hit_s=0.0, miss_s=0.5)
    sel = best_subtree(tree, experts, cached, cost)
    assert sel.nodes.tolist() == [0, 1, 2]
    assert sel.expected_tokens == 2.0 and sel.time_s == 1.5 and (sel.hits, sel.misses) == (1, 1)


def test_ties_are_trimmed_when_each_leaf_reads_its_own_resident_expert():
    """As test_ties_are_trimmed_against_the_optimum_not_the_set_before, with each node reading its
    own expert, all resident: hits are free and a miss would cost 0.5 s, so removing a leaf saves
    its hit (nothing), not a miss, and the trim ends at the same smallest tie, {0, 1}."""
    tree = DraftTree(parents=np.array([-1, 0, 0, 0]), path_probs=np.array([1.0, 0.6e-12, 0.6e-12, 1e-13]))
    experts, cached = np.arange(4).reshape(4, 1, 1), np.ones((1, 4), dtype=bool)
    cost = CostModel(base_s=1.0, per_node_s=0.0, hit_s=0.0, miss_s=0.5)
    best = 1.0 + 0.6e-12 + 0.6e-12 + 1e-13
    got = best_subtree(tree, experts, cached, cost)
    assert got.nodes.tolist() == [0, 1]
    assert got.time_s == 1.0 and (got.hits, got.misses) == (2, 0)
    assert best - got.expected_tokens < 1e-12 * best


def test_max_weight_closure_a_project_worth_the_float_sum_of_many_costs_is_a_tie():
    """A project worth the float sum of its k costs (k = 50 .. 300, each 1e4 .. 1e5) gains nothing
    but rounding: far less than GAIN_EPS times the largest weight, so by the documented rule it
    counts as none and the minimal closure, nothing, is the answer, whatever residual the
    augmenting paths leave after hundreds of float subtractions."""
    from specfit.kernels.tolerances import GAIN_EPS

    rng = np.random.default_rng(0)
    for _ in range(300):
        k = int(rng.integers(50, 300))
        costs = rng.uniform(1e4, 1e5, k)
        weights = np.r_[float(np.sum(costs)), -costs]
        assert abs(math.fsum(weights)) < GAIN_EPS * np.abs(weights).max()
        got = max_weight_closure(weights, [(0, i) for i in range(1, k + 1)])
        assert not got.any(), k
