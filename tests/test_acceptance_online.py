"""Online acceptance calibration: features and outcomes by hand, reliability measures against their
definitions, and calibration that beats the drafter's own probabilities on held-out cycles."""

import numpy as np
import pytest

from specfit import DraftTree
from specfit.experts.acceptance_online import OnlineAcceptance, edge_features, reliability
from specfit.policy_base import Observation, edge_outcomes

#   0 ─┬─ 1 (p .6) ─┬─ 3 (p .3)
#      │            └─ 4 (p .12)
#      └─ 2 (p .2)
TREE = DraftTree(np.array([-1, 0, 0, 1, 1]), np.array([1.0, 0.6, 0.2, 0.3, 0.12]), tokens=np.array([5, 6, 7, 8, 9]))


def test_edge_features_by_hand():
    q, x = edge_features(TREE)
    assert q[1:].tolist() == pytest.approx([0.6, 0.2, 0.5, 0.2])
    # columns: 1, logit q, logit^2 q / 10, depth, depth logit q / 4, logit q1, q1 - q2, rank
    logit = np.log(q / (1 - q))
    assert x[1:, 1] == pytest.approx(logit[1:])
    assert x[1:, 3].tolist() == [1, 1, 2, 2]
    assert x[[1, 2], 5] == pytest.approx([np.log(0.6 / 0.4)] * 2)          # siblings of the root's children
    assert x[[3, 4], 5] == pytest.approx([0.0, 0.0], abs=1e-9)             # q1 = .5 under node 1
    assert x[1:, 6] == pytest.approx([0.4, 0.4, 0.3, 0.3])
    assert x[1:, 7].tolist() == [0, 1, 0, 1]


def test_edge_outcomes_are_the_children_of_nodes_on_the_accepted_path():
    # verified {0, 1}: the target says 6 after the root (node 1 accepted, 2 not) and 9 after 1
    obs = Observation(tree=TREE, verified=np.array([0, 1]), verdicts=np.array([6, 9]))
    nodes, accepted = edge_outcomes(obs)
    assert nodes.tolist() == [1, 2, 3, 4]
    assert accepted.tolist() == [1, 0, 0, 1]
    nodes, _ = edge_outcomes(Observation(tree=TREE, verified=np.array([0]), verdicts=np.array([7])))
    assert nodes.tolist() == [1, 2]
    # the target says 7 after the root: node 1 is rejected, so the verdict at it (9) says nothing
    # the chain rule multiplies, and its children are left out
    nodes, accepted = edge_outcomes(Observation(tree=TREE, verified=np.array([0, 1]), verdicts=np.array([7, 9])))
    assert nodes.tolist() == [1, 2] and accepted.tolist() == [0, 1]


def test_reliability_by_definition():
    p = np.array([0.05, 0.15, 0.12, 0.95, 0.5])
    y = np.array([0, 1, 0, 1, 1])
    out = reliability(p, y, bins=10)
    assert out["brier"] == pytest.approx(np.mean((p - y) ** 2))
    # bins: [0, .1): .05 vs 0; [.1, .2): (.15 + .12) vs 1 over 2; [.5, .6): .5 vs 1; [.9, 1]: .95 vs 1
    ece = (abs(0.05 - 0) + abs(0.27 - 1) + abs(0.5 - 1) + abs(0.95 - 1)) / 5
    assert out["ece"] == pytest.approx(ece)
    assert out["n"] == 5


def chain_tree(q: np.ndarray, rng) -> DraftTree:
    """A root with three children (the drafter's top-3, probabilities q, q2, q3)."""
    rest = (1 - q) * np.sort(rng.dirichlet([1, 1, 1]))[::-1][:2]
    return DraftTree(np.array([-1, 0, 0, 0]), np.array([1.0, q, rest[0], rest[1]]), tokens=np.array([0, 1, 2, 3]))


def over_confident_cycles(seed: int, n: int):
    """Trees whose edges are accepted with probability q ** 2.5 (an over-confident drafter)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tree = chain_tree(float(rng.uniform(0.2, 0.95)), rng)
        q = tree.path_probs[1:]
        u = rng.random()
        accept = np.cumsum(q ** 2.5)
        chosen = int(np.searchsorted(accept, u))          # 3 = none accepted
        verdict = tree.tokens[1 + chosen] if chosen < 3 else 99
        out.append((tree, np.array([0]), np.array([verdict])))
    return out


def test_before_enough_outcomes_it_returns_the_trees_own_probabilities():
    model = OnlineAcceptance(min_edges=1000)
    for tree, verified, verdicts in over_confident_cycles(0, 20):
        nodes, accepted = edge_outcomes(Observation(tree=tree, verified=verified, verdicts=verdicts))
        model.update(tree, nodes, accepted)
    assert model.coef_ is None
    np.testing.assert_allclose(model.path_probs(TREE), TREE.path_probs)


def test_online_calibration_beats_the_drafter_on_held_out_cycles():
    model = OnlineAcceptance(min_edges=64, refit_every=4)
    for tree, verified, verdicts in over_confident_cycles(1, 600):
        nodes, accepted = edge_outcomes(Observation(tree=tree, verified=verified, verdicts=verdicts))
        model.update(tree, nodes, accepted)
    # prequential: each cycle was scored before the model learned from it
    q = model.quality()
    assert q["n"] == 1800
    assert q["brier"] < q["raw_brier"] and q["ece"] < 0.5 * q["raw_ece"]
    # fresh cycles the model never saw
    pred, raw, y = [], [], []
    for tree, verified, verdicts in over_confident_cycles(2, 400):
        nodes, accepted = edge_outcomes(Observation(tree=tree, verified=verified, verdicts=verdicts))
        pred.append(model.edge_probs(tree)[nodes])
        raw.append(tree.path_probs[nodes])
        y.append(accepted)
    held, own = reliability(np.concatenate(pred), np.concatenate(y)), reliability(np.concatenate(raw), np.concatenate(y))
    assert held["brier"] < own["brier"] and held["ece"] < 0.5 * own["ece"]


def test_calibrated_path_probabilities_never_rise_along_a_path():
    model = OnlineAcceptance(min_edges=8)
    for tree, verified, verdicts in over_confident_cycles(3, 50):
        nodes, accepted = edge_outcomes(Observation(tree=tree, verified=verified, verdicts=verdicts))
        model.update(tree, nodes, accepted)
    out = model.calibrated(TREE)
    assert (out.path_probs[1:] <= out.path_probs[out.parents[1:]] + 1e-12).all()
    assert out.path_probs[0] == 1.0
    again = OnlineAcceptance.from_dict(model.to_dict())
    np.testing.assert_allclose(again.path_probs(TREE), model.path_probs(TREE))


def test_reliability_puts_a_probability_of_one_in_the_last_bin():
    from specfit.experts.acceptance_online import reliability

    # bins [0.9, 1.0]: predicted 1.95 in total, observed 1 -> ECE 0.95 / 2
    assert reliability([1.0, 0.95], [0, 1])["ece"] == pytest.approx(0.475)
