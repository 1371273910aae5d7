"""Pricing expert-prediction uncertainty per draft node: still exact, and it shrinks the tree."""

import itertools

import numpy as np
import pytest

from specfit import CostModel, DraftTree, best_subtree
from specfit.search import evaluate, uncertainty_price_s


def closed_sets(tree):
    n = tree.n_nodes
    for bits in itertools.product((False, True), repeat=n - 1):
        nodes = [0] + [v for v, b in zip(range(1, n), bits) if b]
        if tree.is_ancestor_closed(nodes):
            yield np.array(nodes)


def small_instance(rng, min_nodes: int, least_acceptance: float):
    """A random tree of min_nodes..8 nodes over 2 layers of 6 experts (top-2), its residency and a cost."""
    n, L, E, k = int(rng.integers(min_nodes, 9)), 2, 6, 2
    parents = np.array([-1] + [int(rng.integers(0, v)) for v in range(1, n)])
    probs = np.ones(n)
    for v in range(1, n):
        probs[v] = probs[parents[v]] * rng.uniform(least_acceptance, 1.0)
    experts = np.stack([np.stack([rng.choice(E, k, replace=False) for _ in range(L)]) for _ in range(n)])
    cached = rng.random((L, E)) < 0.4
    cost = CostModel(base_s=1e-3, per_node_s=5e-5, hit_s=1e-5, miss_s=2e-4, draft_level_s=1e-4)
    return DraftTree(parents, probs), experts, cached, cost


@pytest.mark.parametrize("seed", range(40))
def test_priced_search_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    tree, experts, cached, cost = small_instance(rng, min_nodes=2, least_acceptance=0.3)
    price = float(rng.choice([0.0, 1e-4, 1e-3]))
    sel = best_subtree(tree, experts, cached, cost, draft_levels=2, draft_node_s=price)
    # the search maximises tokens per priced second: the predicted time plus the price
    def priced_ratio(s):
        e = evaluate(tree, s, experts, cached, cost, 2, draft_node_s=price)
        return e.expected_tokens / e.priced_time_s

    best = max(priced_ratio(s) for s in closed_sets(tree))
    assert sel.expected_tokens / sel.priced_time_s == pytest.approx(best, rel=1e-12)
    # the reported time stays the cost formula; the price is kept apart
    plain = evaluate(tree, sel.nodes, experts, cached, cost, 2)
    assert sel.time_s == pytest.approx(plain.time_s, rel=1e-12)
    assert sel.price_s == pytest.approx(price * (sel.n_nodes - 1), rel=1e-12)


def test_a_higher_price_never_grows_the_tree():
    rng = np.random.default_rng(7)
    n, L, E, k = 12, 4, 16, 2
    parents = np.array([-1] + [int(rng.integers(0, v)) for v in range(1, n)])
    probs = np.ones(n)
    for v in range(1, n):
        probs[v] = probs[parents[v]] * 0.8
    tree = DraftTree(parents, probs)
    experts = np.tile(rng.choice(E, k, replace=False), (n, L, 1))   # every node shares the root's experts
    cost = CostModel(base_s=1e-3, per_node_s=1e-5, hit_s=1e-5, miss_s=2e-4)
    sizes = [best_subtree(tree, experts, np.zeros((L, E), bool), cost, draft_node_s=p).n_nodes
             for p in (0.0, 1e-4, 5e-4, 2e-3, 1e-2)]
    assert sizes == sorted(sizes, reverse=True)
    assert sizes[0] == n and sizes[-1] == 1


def test_uncertainty_price():
    cost = CostModel(base_s=1e-3, per_node_s=1e-5, hit_s=1e-5, miss_s=2e-4)
    assert uncertainty_price_s(cost, n_layers=48, top_k=8, precision=1.0) == 0.0
    assert uncertainty_price_s(cost, n_layers=48, top_k=8, precision=0.75) == pytest.approx(0.25 * 48 * 8 * 1.9e-4)
    # half of each layer resident: half of the wrong slots' experts are expected to be misses
    assert uncertainty_price_s(cost, 48, 8, 0.75, resident_share=0.5) == pytest.approx(0.25 * 48 * 8 * 0.5 * 1.9e-4)
    with pytest.raises(ValueError, match="resident_share"):
        uncertainty_price_s(cost, 48, 8, 0.75, resident_share=2.0)
    with pytest.raises(ValueError, match="precision"):
        uncertainty_price_s(cost, 48, 8, 1.5)
    with pytest.raises(ValueError, match="draft_node_s"):
        best_subtree(DraftTree(np.array([-1]), np.array([1.0])), np.zeros((1, 1, 1), int), np.zeros((1, 2), bool),
                     cost, draft_node_s=-1)


def test_the_observed_price_is_the_extra_misses_per_verified_draft_node_times_a_transfer():
    """Once MIN_OBSERVED cycles were seen, a draft node's price is what verified draft nodes cost
    in misses the prediction did not foresee, each a transfer (miss - hit, a hit is paid anyway);
    before, the precision bound; nothing without predictions or with pricing off."""
    from specfit import kernels

    d = kernels.decide
    conf = np.zeros(d.N_CONF, dtype=np.int64)
    conf[d.PRICE], conf[d.MIN_OBSERVED] = d.OBSERVED, 3
    fstate = np.zeros(d.N_FSTATE)
    fstate[d.EXTRA_MISSES], fstate[d.DRAFT_NODES], fstate[d.RESIDENT_SHARE] = 2.0, 4.0, 0.25
    istate = np.zeros(d.N_ISTATE, dtype=np.int64)
    istate[d.N_OBSERVED], istate[d.SLOTS], istate[d.SLOTS_RIGHT] = 3, 10, 7
    hit_s, miss_s = 1e-4, 3e-4
    assert d.node_price(conf, fstate, istate, 4, 2, hit_s, miss_s) == pytest.approx(2.0 / 4.0 * 2e-4)
    istate[d.N_OBSERVED] = 2                      # too few cycles seen: 30 % of 4 x 2 slots wrong, 3/4 not resident
    assert d.node_price(conf, fstate, istate, 4, 2, hit_s, miss_s) == pytest.approx(0.3 * 8 * 0.75 * 2e-4)
    istate[d.SLOTS] = 0
    assert d.node_price(conf, fstate, istate, 4, 2, hit_s, miss_s) == 0.0
    conf[d.PRICE] = d.NO_PRICE
    istate[d.N_OBSERVED] = 3
    assert d.node_price(conf, fstate, istate, 4, 2, hit_s, miss_s) == 0.0


def test_the_first_level_test_weighs_the_draft_level_over_the_recent_first_levels_width():
    """k first-level nodes of path probability at most p pay only if p T0 > c + d / k: with p = 0.5,
    k = 4, T0 = 1.5 ms, d = 1 ms, c = 0: 0.75 ms > 0.25 ms, drafted; with p = 0.1 declined, and
    after RECHECK declined cycles drafted anyway."""
    from specfit import CostModel, kernels

    d = kernels.decide
    params = CostModel(base_s=1e-3, per_node_s=0.0, hit_s=0.0, miss_s=0.0, draft_level_s=1e-3).params
    fstate = np.zeros(d.N_FSTATE)
    istate = np.zeros(d.N_ISTATE, dtype=np.int64)
    istate[d.N_RECENT] = 1
    assert d.first_level_may_pay(1.5e-3, params, fstate, istate, np.array([0.5]), np.array([4]))
    assert istate[d.DECLINED] == 0
    answers = [d.first_level_may_pay(1.5e-3, params, fstate, istate, np.array([0.1]), np.array([4]))
               for _ in range(d.RECHECK + 1)]
    assert answers == [False] * d.RECHECK + [True] and istate[d.DECLINED] == 0
    fstate[d.NODE_PRICE] = 2e-3                   # a node's price above the root's time: never
    assert not d.first_level_may_pay(1.5e-3, params, fstate, istate, np.array([1.0]), np.array([4]))


@pytest.mark.parametrize("seed", range(30))
def test_priced_search_from_a_start_set_equals_brute_force(seed):
    """With a per-node price, Dinkelbach started from any closed set (e.g. the previous level's
    answer) still reaches the set of the best priced ratio: the start set's ratio, the first lam,
    must include the start's own price."""
    rng = np.random.default_rng(1000 + seed)
    tree, experts, cached, cost = small_instance(rng, min_nodes=3, least_acceptance=0.5)
    n = tree.n_nodes
    sets = list(closed_sets(tree))

    def priced_ratio(s, price):
        e = evaluate(tree, s, experts, cached, cost, 2, draft_node_s=price)
        return e.expected_tokens / e.priced_time_s

    for price in (1e-4, 5e-4, 2e-3):
        best = max(priced_ratio(s, price) for s in sets)
        for start in (sets[-1], np.arange(n)):
            sel = best_subtree(tree, experts, cached, cost, draft_levels=2, start=start, draft_node_s=price)
            assert tree.is_ancestor_closed(sel.nodes)
            assert sel.expected_tokens / sel.priced_time_s == pytest.approx(best, rel=1e-12), (price, start)


def test_a_start_set_is_judged_by_its_priced_ratio():
    # root: 1 token in 4 s (its expert resident, hits free); node 1 (p .4) needs a new expert
    # (1 s) and carries a price of 1 s. Unpriced, {0, 1} looks better: 1.4 / 5 = .28 > .25;
    # priced, it is worse: 1.4 / 6 = .233 < .25. The search must answer the root alone, with or
    # without {0, 1} as its start set
    tree = DraftTree(parents=np.array([-1, 0]), path_probs=np.array([1.0, 0.4]))
    experts = np.array([0, 1]).reshape(2, 1, 1)
    cached = np.array([[True, False]])
    cost = CostModel(base_s=4.0, per_node_s=0.0, hit_s=0.0, miss_s=1.0)
    for start in (None, [0, 1]):
        sel = best_subtree(tree, experts, cached, cost, start=start, draft_node_s=1.0)
        assert sel.nodes.tolist() == [0], start
        assert sel.expected_tokens == 1.0 and sel.time_s == 4.0 and sel.price_s == 0.0
    # without the price, {0, 1} is the optimum from either start
    for start in (None, [0, 1]):
        assert best_subtree(tree, experts, cached, cost, start=start).nodes.tolist() == [0, 1]
