"""Online acceptance calibration: features and outcomes by hand, reliability measures against their
definitions, and calibration that beats the drafter's own probabilities on held-out cycles."""

import numpy as np
import pytest

from specfit import DraftTree, kernels
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


def reference_features(tree: DraftTree) -> tuple[np.ndarray, np.ndarray]:
    """The features node by node, as the module docstring defines them (plain Python)."""
    eps = 3e-4
    n, p, parents = tree.n_nodes, tree.path_probs, tree.parents
    q = np.empty(n)
    q[0] = 1 - eps
    for v in range(1, n):
        u = parents[v]
        q[v] = min(max(p[v] / p[u] if p[u] > 0 else 0.0, eps), 1 - eps)

    def logit(a):
        a = min(max(a, eps), 1 - eps)
        return np.log(a) - np.log1p(-a)

    x = np.zeros((n, 8))
    for v in range(n):
        siblings = [] if v == 0 else sorted((s for s in range(1, n) if parents[s] == parents[v]),
                                            key=lambda s: (-q[s], s))
        q1 = q[siblings[0]] if siblings else 0.0
        q2 = q[siblings[1]] if len(siblings) > 1 else 0.0
        rank = siblings.index(v) if siblings else 0
        lq, d = logit(q[v]), float(tree.depth[v])
        x[v] = [1.0, lq, lq * lq / 10, d, d * lq / 4, logit(q1), q1 - q2, rank]
    return q, x


def random_tree(rng, n: int) -> DraftTree:
    parents = np.array([-1] + [int(rng.integers(0, v)) for v in range(1, n)], dtype=np.int64)
    edge = rng.choice([0.5, 0.25, 0.1], size=n) if rng.random() < 0.5 else rng.uniform(0, 1, size=n)   # ties or not
    probs = np.ones(n)
    for v in range(1, n):
        probs[v] = probs[parents[v]] * edge[v]
    return DraftTree(parents, probs, tokens=np.arange(n))


def test_edge_features_equal_the_definition_on_random_trees():
    rng = np.random.default_rng(7)
    for n in [1, 2, 3] + list(rng.integers(4, 40, size=60)):
        tree = random_tree(rng, int(n))
        q, x = edge_features(tree)
        ref_q, ref_x = reference_features(tree)
        np.testing.assert_allclose(q, ref_q, rtol=1e-12, atol=0)
        np.testing.assert_allclose(x, ref_x, rtol=1e-12, atol=1e-12)


def test_calibrated_paths_are_the_products_of_the_logistic_edges():
    rng = np.random.default_rng(8)
    model = OnlineAcceptance()
    model.coef_ = rng.normal(size=8)
    for _ in range(30):
        tree = random_tree(rng, int(rng.integers(2, 30)))
        _, x = reference_features(tree)
        edge = 1 / (1 + np.exp(-np.clip(x @ model.coef_, -30, 30)))
        edge[0] = 1.0
        path = np.ones(tree.n_nodes)
        for v in range(1, tree.n_nodes):
            path[v] = path[tree.parents[v]] * edge[v]
        np.testing.assert_allclose(model.edge_probs(tree), edge, rtol=1e-12)
        np.testing.assert_allclose(model.path_probs(tree), path, rtol=1e-12)


def penalised_loss(w, x, y, l2):
    z = x @ w
    return np.sum(np.logaddexp(0, z) - y * z) + 0.5 * l2 * np.sum((w - np.r_[0.0, 1.0, np.zeros(6)]) ** 2)


def test_the_refit_reaches_the_penalised_optimum_with_soft_labels():
    """Newton's steps against scipy's minimiser of the same loss, on 0/1 outcomes and on the soft
    ones sampling gives (a probability per edge)."""
    from scipy.optimize import minimize

    rng = np.random.default_rng(9)
    for soft in (False, True):
        model = OnlineAcceptance(min_edges=10**9, newton_steps=50, l2=1.0)
        for _ in range(80):
            tree = random_tree(rng, int(rng.integers(3, 25)))
            nodes = np.arange(1, tree.n_nodes)
            truth = np.clip(tree.path_probs[nodes] / tree.path_probs[tree.parents[nodes]], 0, 1) ** 2
            model.update(tree, nodes, truth if soft else (rng.random(nodes.size) < truth).astype(float))
        model._refit()
        best = minimize(penalised_loss, np.r_[0.0, 1.0, np.zeros(6)], args=(model._x, model._y, 1.0), method="BFGS",
                        options={"gtol": 1e-10})
        assert penalised_loss(model.coef_, model._x, model._y, 1.0) <= best.fun + 1e-7
        np.testing.assert_allclose(model.coef_, best.x, atol=1e-4)


def test_soft_outcomes_are_learned_as_the_probabilities_they_are():
    """Every edge accepted with probability 0.3 whatever its features: the calibrated edges settle
    at 0.3 (a model taught 0/1 draws would too, more slowly; one taught greedy verdicts would not)."""
    model = OnlineAcceptance(min_edges=32, refit_every=1, l2=1e-3, newton_steps=10)
    rng = np.random.default_rng(10)
    for _ in range(200):
        tree = chain_tree(float(rng.uniform(0.2, 0.95)), rng)
        model.update(tree, np.arange(1, 4), np.full(3, 0.3))
    tree = chain_tree(0.8, rng)
    np.testing.assert_allclose(model.edge_probs(tree)[1:], 0.3, atol=0.02)
    assert model.quality()["n"] == 600


def test_one_refit_step_is_newtons_step():
    rng = np.random.default_rng(11)
    model = OnlineAcceptance(min_edges=10**9, newton_steps=1, l2=1.0)
    for _ in range(40):
        tree = random_tree(rng, int(rng.integers(3, 25)))
        nodes = np.arange(1, tree.n_nodes)
        model.update(tree, nodes, (rng.random(nodes.size) < 0.4).astype(float))
    prior = np.r_[0.0, 1.0, np.zeros(6)]
    x, y = model._x, model._y
    p = 1 / (1 + np.exp(-np.clip(x @ prior, -30, 30)))
    grad = x.T @ (p - y)
    hess = (x * (p * (1 - p))[:, None]).T @ x + np.eye(8)
    newton = prior - np.linalg.solve(hess, grad)
    assert penalised_loss(newton, x, y, 1.0) < penalised_loss(prior, x, y, 1.0)     # the full step is taken
    model._refit()
    np.testing.assert_allclose(model.coef_, newton, rtol=1e-9, atol=1e-12)


def test_the_memory_keeps_the_last_edges_oldest_first_and_the_fit_sees_exactly_them():
    """Updates of every size, past the memory and over several wraps: what the refit sees is the
    concatenation of every update's edges, trimmed to the newest ``memory`` (the fit's input, in
    order: the same sums as before the ring)."""
    from specfit import kernels

    rng = np.random.default_rng(3)
    online = OnlineAcceptance(memory=50, refit_every=3, min_edges=5)
    all_x, all_y = np.zeros((0, online._x.shape[1])), np.zeros(0)
    seen = []
    original = kernels.acceptance.online_refit

    def spy(x, y, *args):
        seen.append((x.copy(), y.copy()))
        return original(x, y, *args)

    kernels.acceptance.online_refit = spy
    try:
        for step in range(40):
            n = 70 if step == 20 else int(rng.integers(2, 30))       # one update larger than the memory
            parents = np.r_[-1, [int(rng.integers(0, v)) for v in range(1, n)]]
            probs = np.ones(n)
            for v in range(1, n):
                probs[v] = probs[parents[v]] * rng.uniform(0.1, 1.0)
            tree = DraftTree(parents=parents, path_probs=probs)
            nodes = np.sort(rng.choice(np.arange(1, n), size=int(rng.integers(1, n)), replace=False))
            if step == 20:
                nodes = np.arange(1, n)
            accepted = rng.random(nodes.size)
            _, x, _, _ = online._probs(tree)
            all_x, all_y = np.concatenate([all_x, x[nodes]])[-50:], np.concatenate([all_y, accepted])[-50:]
            refits = len(seen)
            online.update(tree, nodes, accepted)
            window_x, window_y = online._window()
            np.testing.assert_array_equal(window_x, all_x)
            np.testing.assert_array_equal(window_y, all_y)
            if len(seen) > refits:
                np.testing.assert_array_equal(seen[-1][0], all_x)
                np.testing.assert_array_equal(seen[-1][1], all_y)
    finally:
        kernels.acceptance.online_refit = original
    assert online._n > 3 * 50 and len(seen) >= 10


PRIOR = np.r_[0.0, 1.0, np.zeros(6)]


def rows(lq, depth):
    """Feature rows of edges with these logits and depths (the columns online_features fills)."""
    lq, depth = np.asarray(lq, dtype=np.float64), np.asarray(depth, dtype=np.float64)
    x = np.zeros((lq.size, 8))
    x[:, 0], x[:, 1], x[:, 2], x[:, 3], x[:, 4] = 1.0, lq, lq * lq / 10, depth, depth * lq / 4
    return x


def test_the_loss_the_line_search_compares_is_the_penalised_log_likelihood():
    """_online_loss by definition (soft labels, l2 / 2 |w - prior|^2), and the z, exp(-|z|) it leaves."""
    rng = np.random.default_rng(0)
    x = rows(rng.uniform(-8, 8, 30), rng.integers(1, 6, 30))
    x[:, 5:] = rng.normal(size=(30, 3))
    y = rng.random(30)
    for l2 in (0.0, 1.0, 3.5):
        w = PRIOR + rng.normal(size=8)
        z, e = np.empty(30), np.empty(30)
        got = kernels.acceptance._online_loss(x, y, w, PRIOR, l2, z, e)
        assert got == np.float64(penalised_loss(w, x, y, l2)) or abs(got - penalised_loss(w, x, y, l2)) < 1e-9
        np.testing.assert_allclose(z, x @ w, rtol=1e-12)
        np.testing.assert_allclose(e, np.exp(-np.abs(x @ w)), rtol=1e-12)


def test_a_newton_step_that_overshoots_is_halved_until_the_loss_falls():
    """Six edges the prior gets badly wrong: the full Newton step from the prior raises the loss
    (about 6.4 to 26), so the one-step refit must halve it and still end below the prior's loss."""
    lq = [-1.7340959915494203, 6.244389632076677, -4.3654785034659245, 1.9709943149766787, -6.655754502681843,
          5.3223063624543645]
    x, y = rows(lq, [2, 3, 1, 1, 3, 3]), np.array([1.0, 1, 1, 1, 0, 1])
    p = 1 / (1 + np.exp(-(x @ PRIOR)))
    full = PRIOR - np.linalg.solve((x * (p * (1 - p))[:, None]).T @ x + np.eye(8), x.T @ (p - y))
    assert penalised_loss(full, x, y, 1.0) > penalised_loss(PRIOR, x, y, 1.0) + 10      # the full step overshoots
    w = kernels.acceptance.online_refit(x, y, PRIOR, PRIOR, 1.0, 1)
    assert penalised_loss(w, x, y, 1.0) < penalised_loss(PRIOR, x, y, 1.0) - 1.0
    # the step taken is the Newton direction, halved some times
    step = PRIOR - w
    ratio = step[:5] / (PRIOR - full)[:5]           # columns 5-7 are 0 here: neither moves
    np.testing.assert_allclose(ratio, ratio[0], rtol=1e-9)
    halvings = np.log2(1 / ratio[0])
    assert abs(halvings - round(halvings)) < 1e-9 and 1 <= round(halvings) <= 20


def chain(q):
    """The root and two children, the first of drafter probability ``q``."""
    return DraftTree(np.array([-1, 0, 0]), np.array([1.0, q, (1 - q) / 2]), tokens=np.array([0, 1, 2]))


def test_the_first_refit_comes_as_soon_as_min_edges_outcomes_are_remembered():
    """Exactly min_edges outcomes are enough, and the first fit does not wait for refit_every."""
    model = OnlineAcceptance(min_edges=6, refit_every=100)
    for i, q in enumerate([0.7, 0.6]):
        assert model.coef_ is None
        model.update(chain(q), np.array([1, 2]), np.array([1.0, 0.0]))
    assert model.coef_ is None                   # 4 outcomes
    model.update(chain(0.5), np.array([1, 2]), np.array([0.0, 1.0]))     # 6 outcomes: == min_edges
    assert model.coef_ is not None


def test_a_refit_changes_the_probabilities_of_a_tree_already_asked_about():
    """The cached probabilities of the last tree are dropped when a refit replaces coef_: a tree the
    policy calibrated before the update is calibrated again with the new weights."""
    model = OnlineAcceptance(min_edges=2, refit_every=1)
    tree = chain(0.8)
    before = model.edge_probs(tree).copy()
    model.update(tree, np.array([1, 2]), np.array([0.0, 0.0]))        # the refit learns "rejected"
    assert model.coef_ is not None
    _, _, edge, path = kernels.acceptance.online_probs(tree.parents, tree.path_probs, tree.depth, model.coef_)
    np.testing.assert_array_equal(model.edge_probs(tree), edge)
    np.testing.assert_array_equal(model.path_probs(tree), path)
    assert model.edge_probs(tree)[1] < before[1]


def test_each_refit_starts_from_the_current_weights():
    """A refit continues from coef_ (newton_steps=1: one damped Newton step from it on the window),
    not from the prior."""
    model = OnlineAcceptance(min_edges=4, refit_every=1, newton_steps=1)
    rng = np.random.default_rng(5)
    for _ in range(6):
        before = model.coef_
        model.update(chain(float(rng.uniform(0.3, 0.9))), np.array([1, 2]), rng.random(2))
        if before is not None:
            x, y = model._window()
            expected = kernels.acceptance.online_refit(x, y, before, PRIOR, model.l2, 1)
            np.testing.assert_array_equal(model.coef_, expected)
            assert not np.array_equal(expected, kernels.acceptance.online_refit(x, y, PRIOR, PRIOR, model.l2, 1))


def test_a_child_of_zero_probability_has_its_conditional_clipped_to_online_eps():
    """q = p_v / p_parent is clipped below too: a drafted node of probability 0 gets q = ONLINE_EPS
    (and, before any fit, that edge probability, so its path keeps a positive probability)."""
    eps = kernels.acceptance.ONLINE_EPS
    tree = DraftTree(np.array([-1, 0, 0, 1]), np.array([1.0, 0.9, 0.0, 1e-9]), tokens=np.array([0, 1, 2, 3]))
    q, _ = kernels.acceptance.online_features(tree.parents, tree.path_probs, tree.depth)
    assert q[2] == eps and q[3] == eps
    model = OnlineAcceptance()
    assert model.edge_probs(tree)[2] == eps
    assert model.path_probs(tree)[3] == 0.9 * eps > 0


def test_edge_probabilities_are_clipped_at_logit_30_either_way():
    """z = x . coef clipped to [-30, 30] before the logistic: an extreme model still gives every edge a
    probability in [1 / (1 + e^30), 1 / (1 + e^-30)], never 0 (a path of probability 0)."""
    tree = chain(0.7)
    model = OnlineAcceptance()
    model.coef_ = np.r_[-1000.0, np.zeros(7)]
    np.testing.assert_allclose(model.edge_probs(tree)[1:], 1 / (1 + np.exp(30.0)), rtol=1e-12)
    assert (model.path_probs(tree) > 0).all()
    model.coef_ = np.r_[1000.0, np.zeros(7)]
    np.testing.assert_allclose(model.edge_probs(tree)[1:], 1 / (1 + np.exp(-30.0)), rtol=1e-15)


def test_online_acceptance_refuses_no_penalty_and_reliability_refuses_nan():
    # without a penalty a constant feature (rank 0 in a chain) made the Newton step singular
    with pytest.raises(ValueError, match="l2"):
        OnlineAcceptance(l2=0.0)
    with pytest.raises(ValueError, match="finite probabilities"):
        reliability([0.5, float("nan")], [1.0, 0.0])
    assert reliability([0.2, 0.9], [0.0, 1.0])["brier"] == pytest.approx((0.04 + 0.01) / 2)


def test_the_prequential_scores_take_the_same_memory_however_long_the_run():
    """quality() scores every edge the model was updated with, from running sums: a list of every
    scored edge grew with the run (~350 bytes a cycle of the bundled model), and quality() took
    longer each time it was asked."""
    import pickle

    model = OnlineAcceptance(min_edges=64, refit_every=4)
    pred, raw, outcomes, sizes = [], [], [], []
    for i, (tree, verified, verdicts) in enumerate(over_confident_cycles(4, 400)):
        nodes, accepted = edge_outcomes(Observation(tree=tree, verified=verified, verdicts=verdicts))
        pred.append(model.edge_probs(tree)[nodes])
        raw.append(edge_features(tree)[0][nodes])
        outcomes.append(accepted)
        model.update(tree, nodes, accepted)
        if i in (99, 399):
            sizes.append(len(pickle.dumps(model)))
    assert sizes[1] - sizes[0] < 16          # a counter's pickled width at most; 300 cycles of a list: ~50 kB
    q = model.quality()
    y = np.concatenate(outcomes)
    for prefix, scored in (("", reliability(np.concatenate(pred), y)), ("raw_", reliability(np.concatenate(raw), y))):
        assert q[f"{prefix}n"] == scored["n"] == 1200
        assert q[f"{prefix}brier"] == pytest.approx(scored["brier"], rel=1e-12)
        assert q[f"{prefix}ece"] == pytest.approx(scored["ece"], rel=1e-12)
