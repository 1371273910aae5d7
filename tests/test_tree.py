"""DraftTree: structure, closure, masks, positions, renumbering, greedy acceptance, bad input."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from core_helpers import ancestors_or_self, core_settings, depths, is_closed, parents_st, probs_st
from specfit import DraftTree
from specfit.kernels.tolerances import PROB_SLACK
from specfit.runtime.acceptance import greedy_accept

#         0
#       /   \
#      1     2
#     / \     \
#    3   4     5
#    |
#    6
PARENTS = np.array([-1, 0, 0, 1, 1, 2, 3])
PROBS = np.array([1.0, 0.6, 0.3, 0.45, 0.1, 0.2, 0.4])
TOKENS = np.array([100, 7, 8, 9, 10, 11, 12])


def hand_tree(tokens=True) -> DraftTree:
    return DraftTree(parents=PARENTS, path_probs=PROBS, tokens=TOKENS if tokens else None)


# --------------------------------------------------------------------------- hand-built tree
def test_depth_children_and_levels_of_a_hand_built_tree():
    tree = hand_tree()
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert tree.n_nodes == len(tree) == 7
    assert tree.max_depth == 3
    assert [c.tolist() for c in tree.children()] == [[1, 2], [3, 4], [5], [6], [], [], []]
    assert [tree.level(d).tolist() for d in range(5)] == [[0], [1, 2], [3, 4, 5], [6], []]
    assert tree.tokens.tolist() == TOKENS.tolist()


def test_single_node_tree():
    tree = DraftTree(parents=np.array([-1]), path_probs=np.array([1.0]))
    assert tree.depth.tolist() == [0]
    assert [c.tolist() for c in tree.children()] == [[]]
    assert tree.closure([]).tolist() == [0]
    assert tree.attention_mask().tolist() == [[True]]
    assert tree.expected_tokens([0]) == 1.0


def test_closure_adds_every_ancestor_and_the_root():
    tree = hand_tree()
    assert tree.closure([6]).tolist() == [0, 1, 3, 6]
    assert tree.closure([4, 5]).tolist() == [0, 1, 2, 4, 5]
    assert tree.closure([]).tolist() == [0]
    assert tree.closure([0]).tolist() == [0]
    assert tree.closure(np.array([6, 6, 3])).tolist() == [0, 1, 3, 6]


def test_is_ancestor_closed():
    tree = hand_tree()
    assert tree.is_ancestor_closed([0])
    assert tree.is_ancestor_closed([0, 1, 3])
    assert tree.is_ancestor_closed([3, 1, 0])
    assert tree.is_ancestor_closed(list(range(7)))
    assert not tree.is_ancestor_closed([0, 3])       # parent 1 missing
    assert not tree.is_ancestor_closed([1])          # root missing
    assert not tree.is_ancestor_closed([0, 1, 6])    # grandparent chain broken at 3


def test_expected_tokens_is_one_plus_the_draft_path_probabilities():
    tree = hand_tree()
    assert tree.expected_tokens([0]) == 1.0
    assert tree.expected_tokens([0, 1, 3]) == pytest.approx(1 + 0.6 + 0.45, rel=1e-15)


def test_attention_mask_is_ancestor_or_self():
    tree = hand_tree()
    m = tree.attention_mask()
    assert m.shape == (7, 7) and m.dtype == np.bool_
    expected = np.zeros((7, 7), dtype=bool)
    rows = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 1, 4], 5: [0, 2, 5], 6: [0, 1, 3, 6]}
    for v, cols in rows.items():
        expected[v, cols] = True
    assert np.array_equal(m, expected)
    sub = tree.attention_mask([0, 2, 5])
    assert sub.tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    with pytest.raises(ValueError, match="nodes"):
        tree.attention_mask([0, 7])


def test_positions_follow_depth_from_the_prefix():
    tree = hand_tree()
    assert tree.positions(10).tolist() == [10, 11, 11, 12, 12, 12, 13]
    assert tree.positions(0, [0, 2, 5]).tolist() == [0, 1, 2]
    assert tree.positions(5, np.array([6, 4])).tolist() == [8, 7]


def test_subtree_renumbers_in_order():
    tree = hand_tree()
    sub = tree.subtree([0, 2, 5, 1, 4])
    # kept nodes in ascending order: 0, 1, 2, 4, 5 -> 0, 1, 2, 3, 4
    assert sub.parents.tolist() == [-1, 0, 0, 1, 2]
    assert sub.path_probs.tolist() == [1.0, 0.6, 0.3, 0.1, 0.2]
    assert sub.tokens.tolist() == [100, 7, 8, 10, 11]
    assert sub.depth.tolist() == [0, 1, 1, 2, 2]
    no_tokens = hand_tree(tokens=False).subtree([0, 1, 3, 6])
    assert no_tokens.tokens is None
    assert no_tokens.parents.tolist() == [-1, 0, 1, 2]


def test_subtree_of_a_set_that_is_not_closed_is_rejected():
    with pytest.raises(ValueError, match="nodes"):
        hand_tree().subtree([0, 3])
    with pytest.raises(ValueError, match="nodes"):
        hand_tree().subtree([1, 3])


def test_truncate_keeps_the_first_levels():
    tree = hand_tree()
    assert tree.truncate(0).parents.tolist() == [-1]
    assert tree.truncate(1).parents.tolist() == [-1, 0, 0]
    assert tree.truncate(2).parents.tolist() == [-1, 0, 0, 1, 1, 2]
    assert tree.truncate(5).parents.tolist() == PARENTS.tolist()


@pytest.mark.parametrize("verdict_map, nodes, path", [
    ({0: 7, 1: 9, 3: 12}, None, [0, 1, 3, 6]),           # the whole left spine accepted
    ({0: 7, 1: 9, 3: 99}, None, [0, 1, 3]),              # 6 rejected
    ({0: 7, 1: 10}, None, [0, 1, 4]),
    ({0: 8, 2: 11}, None, [0, 2, 5]),
    ({0: 8, 2: 0}, None, [0, 2]),
    ({0: 42}, None, [0]),                                 # first draft token rejected
    ({0: 7, 1: 9, 3: 12}, [0, 1, 3], [0, 1, 3]),          # 6 accepted but not verified
    ({0: 7, 1: 9, 3: 12}, [0, 1, 2, 4], [0, 1]),
    ({0: 7, 1: 9, 3: 12}, [0, 2, 5], [0]),
])
def test_accepted_path_is_the_longest_matching_path(verdict_map, nodes, path):
    verdicts = np.full(7, -1)
    for v, token in verdict_map.items():
        verdicts[v] = token
    got = hand_tree().accepted_path(verdicts, nodes)
    assert got.tolist() == path


@pytest.mark.parametrize("nodes", [None, [0, 1, 2]])
def test_among_equally_deep_accepted_ends_the_first_in_order_is_taken(nodes):
    # two children of the root with the same token 7, both accepted by the root's verdict 7:
    # the paths [0, 1] and [0, 2] are equally deep, and the first node in order wins
    tree = DraftTree(parents=[-1, 0, 0], path_probs=[1.0, 0.5, 0.5], tokens=[0, 7, 7])
    verdicts = np.array([7, 1, 2])
    assert tree.accepted_path(verdicts, nodes).tolist() == [0, 1]
    path, bonus = greedy_accept(tree, np.arange(3), verdicts)
    assert path.tolist() == [0, 1] and bonus == 1


def test_accepted_path_needs_tokens():
    with pytest.raises(ValueError, match="tokens"):
        hand_tree(tokens=False).accepted_path(np.zeros(7, dtype=np.int64))


# --------------------------------------------------------------------------- random trees vs brute force
@st.composite
def tree_case(draw):
    parents = draw(parents_st(max_nodes=14))
    probs = draw(probs_st(parents))
    return parents, probs


@core_settings(200)
@given(tree_case(), st.data())
def test_structure_matches_a_brute_force_walk(case, data):
    parents, probs = case
    n = parents.size
    tree = DraftTree(parents=parents, path_probs=probs)
    assert tree.depth.tolist() == depths(parents)
    kids = [[c for c in range(1, n) if parents[c] == v] for v in range(n)]
    assert [c.tolist() for c in tree.children()] == kids
    mask = np.zeros((n, n), dtype=bool)
    for v in range(n):
        mask[v, ancestors_or_self(parents, v)] = True
    assert np.array_equal(tree.attention_mask(), mask)
    assert tree.positions(3).tolist() == [3 + d for d in depths(parents)]
    chosen = data.draw(st.lists(st.integers(0, n - 1), max_size=n, unique=True))
    closure = sorted({u for v in chosen for u in ancestors_or_self(parents, v)} | {0})
    assert tree.closure(chosen).tolist() == closure
    assert tree.is_ancestor_closed(chosen) == is_closed(parents, chosen)
    assert tree.is_ancestor_closed(closure)
    sub_mask = tree.attention_mask(closure)
    assert np.array_equal(sub_mask, mask[np.ix_(closure, closure)])
    # with the committed tokens before the tree: all of them visible to every node, then the same
    prefix = data.draw(st.integers(0, 5))
    with_prefix = tree.attention_mask(closure, prefix_len=prefix)
    assert with_prefix.shape == (len(closure), prefix + len(closure))
    assert with_prefix[:, :prefix].all() and np.array_equal(with_prefix[:, prefix:], sub_mask)


@core_settings(150)
@given(tree_case(), st.data())
def test_subtree_matches_a_brute_force_renumbering(case, data):
    parents, probs = case
    n = parents.size
    tokens = np.arange(n) * 3 + 1
    tree = DraftTree(parents=parents, path_probs=probs, tokens=tokens)
    chosen = data.draw(st.lists(st.integers(0, n - 1), max_size=n, unique=True))
    keep = sorted({u for v in chosen for u in ancestors_or_self(parents, v)} | {0})
    new_id = {v: i for i, v in enumerate(keep)}
    sub = tree.subtree(keep)
    assert sub.parents.tolist() == [-1] + [new_id[int(parents[v])] for v in keep[1:]]
    assert sub.path_probs.tolist() == probs[keep].tolist()
    assert sub.tokens.tolist() == tokens[keep].tolist()
    assert sub.depth.tolist() == [depths(parents)[v] for v in keep]


@core_settings(200)
@given(tree_case(), st.data())
def test_accepted_path_matches_a_brute_force_walk(case, data):
    parents, _ = case
    n = parents.size
    probs = np.ones(n)
    # siblings carry distinct tokens (they are different draft candidates)
    tokens = np.zeros(n, dtype=np.int64)
    for v in range(1, n):
        tokens[v] = data.draw(st.integers(0, 3).filter(
            lambda t, v=v: t not in {int(tokens[u]) for u in range(1, v) if parents[u] == parents[v]}))
    verdicts = np.array(data.draw(st.lists(st.integers(0, 4), min_size=n, max_size=n)))
    subset = data.draw(st.none() | st.lists(st.integers(0, n - 1), max_size=n, unique=True))
    inside = set(range(n)) if subset is None else {u for v in subset for u in ancestors_or_self(parents, v)} | {0}
    tree = DraftTree(parents=parents, path_probs=probs, tokens=tokens)
    nodes = None if subset is None else sorted(inside)
    path = [0]
    while True:
        nxt = [c for c in range(1, n) if parents[c] == path[-1] and c in inside and tokens[c] == verdicts[path[-1]]]
        assert len(nxt) <= 1
        if not nxt:
            break
        path.append(nxt[0])
    assert tree.accepted_path(verdicts, nodes).tolist() == path
    # the decoder's form: verdicts known at the verified nodes only, the bonus token with the path
    rows = np.arange(n) if nodes is None else np.array(nodes, dtype=np.int64)
    got, bonus = greedy_accept(tree, rows, verdicts[rows].astype(np.int64))
    assert got.tolist() == path and bonus == verdicts[path[-1]]


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("parents", [
    [0, 0],            # parents[0] != -1: no root
    [5, 0],            # missing root
    [-1, 1],           # a node that is its own parent
    [-1, 2, 1],        # a cycle 1 -> 2 -> 1 (parent >= child index)
    [-1, 0, 3, 0],     # parent after the child
    [-1, -1],          # a second root
    [-1, 0, -2],       # negative parent
    [-1, 0, 7],        # parent out of range
    [],                # empty
    [[-1, 0]],         # not 1-D
    [-1.0, 0.0],       # not integers
])
def test_bad_parents_are_rejected_naming_parents(parents):
    parents = np.array(parents)
    probs = np.ones(max(parents.shape[-1] if parents.ndim else 1, 1))
    with pytest.raises(ValueError, match="parents"):
        DraftTree(parents=parents, path_probs=probs)


@pytest.mark.parametrize("probs", [
    [1.0, 1.5],                 # above 1
    [1.0, -0.1],                # below 0
    [1.0, float("nan")],
    [1.0, float("inf")],
    [0.9, 0.5],                 # root not 1
    [float("nan"), 0.5],
    [1.0, 0.5, 0.5],            # shape mismatch
    [1.0],
])
def test_bad_path_probs_are_rejected_naming_path_probs(probs):
    with pytest.raises(ValueError, match="path_probs"):
        DraftTree(parents=np.array([-1, 0]), path_probs=np.array(probs))


def test_path_probs_must_not_increase_along_a_path():
    with pytest.raises(ValueError, match="path_probs"):
        DraftTree(parents=np.array([-1, 0, 1]), path_probs=np.array([1.0, 0.5, 0.6]))
    with pytest.raises(ValueError, match="path_probs"):
        DraftTree(parents=np.array([-1, 0, 1, 2]), path_probs=np.array([1.0, 0.5, 0.25, 0.25 + 1e-6]))
    # siblings and cousins may be in any order
    DraftTree(parents=np.array([-1, 0, 0, 1, 2]), path_probs=np.array([1.0, 0.2, 0.9, 0.1, 0.8]))


def test_bad_tokens_are_rejected_naming_tokens():
    with pytest.raises(ValueError, match="tokens"):
        DraftTree(parents=np.array([-1, 0]), path_probs=np.array([1.0, 0.5]), tokens=np.array([1, 2, 3]))
    with pytest.raises(ValueError, match="tokens"):
        DraftTree(parents=np.array([-1, 0]), path_probs=np.array([1.0, 0.5]), tokens=np.array([1.0, 2.0]))


@pytest.mark.parametrize("call", ["closure", "expected_tokens", "is_ancestor_closed", "positions", "subtree",
                                  "attention_mask"])
@pytest.mark.parametrize("nodes", [[0, -1], [0, 9], [0, 1.5]])
def test_node_ids_out_of_the_tree_are_refused_by_every_helper(call, nodes):
    # a negative id wrapped around to the last node, a float was truncated, 9 was a bare IndexError
    tree = DraftTree(parents=[-1, 0, 0, 1], path_probs=[1.0, 0.6, 0.5, 0.25])
    args = (5, nodes) if call == "positions" else (nodes,)
    with pytest.raises(ValueError, match="nodes: expected"):
        getattr(tree, call)(*args)


def test_a_selection_of_float_ids_is_refused_not_truncated():
    from specfit.tree import check_nodes

    tree = DraftTree(parents=[-1, 0, 0, 1], path_probs=[1.0, 0.6, 0.5, 0.25])
    with pytest.raises(ValueError, match="selection: expected integer node ids"):
        check_nodes(tree, [0.0, 1.7], "selection")


def test_expected_tokens_counts_a_set():
    tree = DraftTree(parents=[-1, 0, 0, 1], path_probs=[1.0, 0.6, 0.5, 0.25])
    assert tree.expected_tokens([0, 1, 3]) == pytest.approx(1.85)
    with pytest.raises(ValueError, match="one twice"):
        tree.expected_tokens([0, 1, 1])


@pytest.mark.parametrize("call", ["closure", "expected_tokens", "is_ancestor_closed", "subtree"])
def test_node_id_equal_to_the_tree_size_is_refused(call):
    tree = DraftTree(parents=[-1, 0, 0, 1], path_probs=[1.0, 0.6, 0.5, 0.25])
    with pytest.raises(ValueError, match="nodes: expected ids in"):
        getattr(tree, call)([0, 4])


def test_rises_within_the_rounding_slack_along_a_chain_are_accepted_against_each_parents_given_value():
    # each node rises above its parent by less than the slack (as given), though node 3 is more
    # than the slack above node 2's clipped value
    given = np.array([1.0, 0.5, 0.5 + 0.9 * PROB_SLACK, 0.5 + 1.5 * PROB_SLACK])
    tree = DraftTree(parents=np.array([-1, 0, 1, 2]), path_probs=given)
    # clipped in place to each parent's value as given (kernels.tree.check_tree's contract)
    assert tree.path_probs.tolist() == [1.0, 0.5, 0.5, given[2]]
