"""The expected next level (specfit/next_level.py) built by hand: statistics of drafted levels and
the virtual level they imply."""

import numpy as np
import pytest

from specfit import DraftTree
from specfit.next_level import LevelStats, expected_level

#   0 ─┬─ 1 (p .6) ─┬─ 3 (p .3)
#      │            └─ 4 (p .12)
#      └─ 2 (p .2) ─┬─ 5 (p .1)
#                   └─ 6 (p .02)
TREE = DraftTree(np.array([-1, 0, 0, 1, 1, 2, 2]), np.array([1.0, 0.6, 0.2, 0.3, 0.12, 0.1, 0.02]))


def experts_by_hand():
    """One layer, top-2: node 3 shares one expert with its parent, 4 none, 5 and 6 both."""
    e = np.array([[0, 1], [2, 3], [4, 5], [2, 9], [10, 11], [4, 5], [5, 4]])
    return e[:, None, :]


def test_level_stats_by_hand():
    stats = LevelStats(memory=0.5)
    stats.update(TREE, experts_by_hand(), 2)
    # conditional probabilities at depth 2: under 1: .5 (rank 0), .2 (rank 1); under 2: .5, .1
    assert stats.acceptance_[2, 0] == pytest.approx(0.5 * stats_prior(0) + 0.5 * 0.5)
    assert stats.acceptance_[2, 1] == pytest.approx(0.5 * stats_prior(1) + 0.5 * 0.15)
    # new experts per layer: node 3 one, node 4 two, nodes 5 and 6 none: mean 0.75 (first update)
    assert stats.new_experts(2, top_k=2) == pytest.approx(0.75)
    assert stats.width_ == pytest.approx(2.0)
    # an unseen deeper level is assumed to be like the deepest seen one
    assert stats.known_depth(3) == 2 and stats.new_experts(3, top_k=2) == pytest.approx(0.75)


def stats_prior(rank):
    return 0.5 * 0.5 ** rank


def test_expected_level_children_probabilities_and_fresh_experts():
    stats = LevelStats(memory=0.5)
    stats.acceptance_[3, :2] = [0.5, 0.25]
    stats.seen_[3] = 1
    stats.width_ = 2.0
    stats.new_experts_[3], stats._new_is_share[3] = 1.0, False      # exactly one new expert per layer
    cached = np.zeros((1, 12), dtype=bool)
    cached[0, 2] = True
    tree, experts, grown = expected_level(TREE, experts_by_hand(), cached, stats, depth=2)
    # frontier: the two most probable depth-2 nodes, 3 (.3) and 4 (.12); two children each
    assert tree.n_nodes == 7 + 4
    assert tree.parents[7:].tolist() == [3, 3, 4, 4]
    assert tree.path_probs[7:].tolist() == pytest.approx([0.15, 0.075, 0.06, 0.03])
    # each child keeps its parent's first expert and routes to one fresh id that is not resident
    assert experts[7:, 0, 0].tolist() == [2, 2, 10, 10]
    fresh = experts[7:, 0, 1]
    assert np.unique(fresh).size == 4 and (fresh >= 12).all() and not grown[0, fresh].any()
    assert grown.shape == (1, 12 + 4 * 2) and grown[0, 2] and grown[0, :12].sum() == 1


def test_fractional_new_experts_average_out():
    stats = LevelStats()
    stats.width_, stats.seen_[2] = 4.0, 1
    stats.new_experts_[2], stats._new_is_share[2] = 2.5, False
    tree = DraftTree(np.array([-1, 0, 0, 0, 0]), np.array([1.0, 0.5, 0.2, 0.1, 0.05]))
    experts = np.tile(np.arange(8)[None, None, :], (5, 6, 1))          # 6 layers, top-8
    _, grown_experts, grown = expected_level(tree, experts, np.zeros((6, 8), dtype=bool), stats, depth=1)
    new = (grown_experts[5:] >= 8).sum(axis=2)                          # [children, layers]
    assert set(np.unique(new).tolist()) <= {2, 3}
    assert new.mean() == pytest.approx(2.5, abs=0.15)


def test_level_stats_rejects_a_memory_of_zero_or_one():
    for memory in (0.0, 1.0):
        with pytest.raises(ValueError, match="memory"):
            LevelStats(memory=memory)


# the virtual level 3 takes level 3's acceptance, not level 2's: rows unlike the prior every unseen
# level holds (the test above sets level 3 to that prior, where the two rows cannot be told apart)
def test_the_virtual_level_uses_the_acceptance_of_its_own_depth():
    stats = LevelStats(memory=0.5)
    stats.acceptance_[2, :2] = [0.9, 0.05]
    stats.seen_[2] = 1
    stats.acceptance_[3, :2] = [0.6, 0.3]
    stats.seen_[3] = 1
    stats.width_ = 2.0
    tree, _, _ = expected_level(TREE, experts_by_hand(), np.zeros((1, 12), dtype=bool), stats, depth=2)
    assert tree.parents[7:].tolist() == [3, 3, 4, 4]
    assert tree.path_probs[7:].tolist() == pytest.approx([0.3 * 0.6, 0.3 * 0.3, 0.12 * 0.6, 0.12 * 0.3])


def test_the_optimistic_level_takes_the_best_conditional_probability_of_the_newest_level():
    # level 2: node 3 at 0.45 under 0.9 (conditional 0.5), node 4 at 0.19 under 0.2 (0.95): every
    # virtual child gets 0.95 (the most probable node's own 0.5 made the "optimistic" rule pessimistic)
    from specfit.next_level import optimistic_level

    tree = DraftTree(parents=np.array([-1, 0, 0, 1, 2]), path_probs=np.array([1.0, 0.9, 0.2, 0.45, 0.19]))
    grown, experts = optimistic_level(tree, np.arange(5).reshape(5, 1, 1), 2)
    np.testing.assert_array_equal(grown.parents[5:], [3, 4])
    np.testing.assert_allclose(grown.path_probs[5:], [0.45 * 0.95, 0.19 * 0.95])
    np.testing.assert_array_equal(experts[5:, 0, 0], [3, 4])       # the parents' experts
