"""The importer's routing model (:class:`specfit.traces.routing.RoutingModel`): how it fills a node's top-k slots."""

from __future__ import annotations

import numpy as np
import pytest

from specfit.traces.routing import RoutingModel, TokenSampler, zipf_popularity

L, E, K, VOCAB = 3, 16, 4, 50


def _model(token_prob: float, consecutive=0.0, sibling=0.0) -> RoutingModel:
    rng = np.random.default_rng(7)
    m = RoutingModel(zipf_popularity(L, E, 1.0, rng), consecutive, token_prob, sibling, K, VOCAB, seed=3)
    m.token_prob_ = np.full(L, token_prob)
    m.popularity_power_ = np.full(L, 1.5)
    return m


def test_routing_model_accepts_top_k_equal_to_the_number_of_experts():
    pop = zipf_popularity(2, 4, 1.0, np.random.default_rng(0))
    m = RoutingModel(pop, 0.3, 0.3, 0.3, 4, 10)
    routed = m.route(np.arange(10), None, np.zeros(2), np.random.default_rng(1))
    assert np.array_equal(np.sort(routed, axis=2), np.broadcast_to(np.arange(4), routed.shape))


def test_routing_model_routes_a_tokens_own_slots_in_preference_order():
    m = _model(1.0)
    tokens = np.arange(VOCAB)
    routed = m.route(tokens, None, np.zeros(L), np.random.default_rng(11))
    assert np.array_equal(routed, m.preferences(tokens))         # unsorted: most preferred first


def test_routing_model_anchor_slots_take_only_the_slots_the_token_leaves():
    """Half the slots the token's own, anchor probability 1: the anchor gets the other two slots
    only. With the anchor set the token's own four preferences, an anchor slot that lands on one of
    the token's first two preferences is lost to the popularity draw, so some draws hold experts
    outside the preference list."""
    m = _model(0.5)
    tokens = np.arange(VOCAB)
    prefs = m.preferences(tokens)
    anchor = prefs[:, :, ::-1].copy()
    rng = np.random.default_rng(5)
    outside = 0
    for _ in range(10):
        routed = m.route(tokens, anchor, np.ones(L), rng)
        outside += sum(int((~np.isin(routed[i, layer], prefs[i, layer])).sum())
                       for i in range(VOCAB) for layer in range(L))
    assert outside > 0.2 * 10 * VOCAB * L


def test_routing_model_calibration_keeps_sibling_and_token_slots_within_top_k():
    rng = np.random.default_rng(0)
    m = RoutingModel(zipf_popularity(L, E, 1.0, rng), 0.2, 0.7, 0.9, K, 200, seed=1)
    m.calibrate(TokenSampler(200, 1.0, rng), rng, pilot_tokens=256, rounds=6)
    assert np.all(m.sibling_prob_ <= 1 - m.token_prob_ + 1e-12)
    assert np.all(m.token_prob_ <= 1 - m.consecutive_prob_ + 1e-12)


def test_top_one_routing_takes_its_anchor_slot():
    """With one expert per layer the anchor count was rounded with a uniform top-1 does not have:
    no expert ever came from the previous token (reuse at chance, 0.07, with every slot asked to)."""
    from specfit.traces.stats import consecutive_reuse

    pop = np.full((2, 16), 1 / 16)
    for k in (1, 2):
        m = RoutingModel(pop, 1.0, 0.0, 0.0, top_k=k, vocab_size=100, seed=0)
        m.token_prob_[:], m.consecutive_prob_[:] = 0.0, 1.0      # every slot the previous token's
        rng = np.random.default_rng(0)
        routed = m.sequences(rng.integers(0, 100, size=(4, 50)), rng).reshape(-1, 2, k)
        np.testing.assert_array_equal(consecutive_reuse(routed, np.repeat(np.arange(4), 50)), [1.0, 1.0])


def test_distinct_tokens_of_a_steep_sampler_come_without_hanging_and_a_too_small_vocabulary_is_refused():
    from specfit.errors import SpecFitError
    from specfit.traces.routing import TokenSampler

    rng = np.random.default_rng(0)
    steep = TokenSampler(50_000, 8.0, rng)          # rank 5 drawn once in ~400k: the draws alone took minutes
    got = steep.distinct_from([int(steep.ids[0])], 5, rng)
    assert len(set(got.tolist())) == 5 and int(steep.ids[0]) not in got
    # more than the ~100 tokens whose mass the cdf still resolves
    assert len(set(steep.distinct_from([], 300, rng).tolist())) == 300
    with pytest.raises(SpecFitError, match="5 distinct tokens asked besides 0, but the vocabulary has 4"):
        TokenSampler(4, 1.0, rng).distinct_from([], 5, rng)


def test_routing_model_calibration_needs_a_round():
    """The pilot is measured within a round: with ``rounds=0`` the calibration ended in an
    UnboundLocalError (its statistics were read after a loop that never ran)."""
    rng = np.random.default_rng(0)
    m = RoutingModel(zipf_popularity(L, E, 1.0, rng), 0.2, 0.7, 0.9, K, 200, seed=1)
    with pytest.raises(ValueError, match="rounds: expected at least 1, got 0"):
        m.calibrate(TokenSampler(200, 1.0, rng), rng, pilot_tokens=256, rounds=0)
