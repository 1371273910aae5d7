"""The importer's generative routing model: what its most likely experts are, against its draws."""

import numpy as np

from specfit.experts.predictors import slots_right
from specfit.traces.routing import RoutingModel, zipf_popularity

L, E, K, VOCAB = 3, 16, 4, 50


def model(token_prob: float) -> RoutingModel:
    rng = np.random.default_rng(7)
    m = RoutingModel(zipf_popularity(L, E, 1.0, rng), 0.0, token_prob, 0.0, K, VOCAB, seed=3)
    m.token_prob_ = np.full(L, token_prob)          # the slot shares, as calibrate() would set them
    m.popularity_power_ = np.full(L, 1.5)
    return m


def draws(m: RoutingModel, tokens: np.ndarray, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(11)
    return [m.route(tokens, None, np.zeros(L), rng) for _ in range(n)]


def test_every_slot_the_tokens_own_makes_the_likely_experts_the_routing():
    m = model(1.0)
    tokens = np.arange(VOCAB)
    likely = m.likely_experts(tokens)
    assert np.array_equal(likely, m.preferences(tokens))
    for routed in draws(m, tokens, 3):
        assert np.array_equal(np.sort(routed, axis=2), np.sort(likely, axis=2))


def test_the_likely_experts_keep_the_certain_slots_and_fill_the_rest_with_the_popular():
    """Half the slots the token's own: its first two preferences are in every draw and in the
    likely experts; the other two are the most popular experts past them, which the draws hit
    more often than the token's third and fourth preferences (never its own slots here)."""
    m = model(0.5)
    tokens = np.arange(VOCAB)
    likely, prefs = m.likely_experts(tokens), m.preferences(tokens)
    assert np.array_equal(np.sort(likely[:, :, :2], axis=2), np.sort(prefs[:, :, :2], axis=2))
    samples = draws(m, tokens, 40)
    for routed in samples:
        assert all(np.isin(prefs[i, layer, :2], routed[i, layer]).all() for i in range(VOCAB) for layer in range(L))
    right = sum(slots_right(likely, routed) for routed in samples)
    naive = sum(slots_right(prefs, routed) for routed in samples)
    assert right > naive


def test_a_slot_owned_by_chance_ranks_between_the_certain_ones_and_the_popular():
    m = model(0.6)                                      # 2.4 of 4 slots: the third preference's chance is 0.4
    tokens = np.arange(VOCAB)
    likely, prefs = m.likely_experts(tokens), m.preferences(tokens)
    assert np.array_equal(likely[:, :, :3], prefs[:, :, :3])
