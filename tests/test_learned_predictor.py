"""The learned expert predictor: its features by hand, a fit that recovers which signal predicts
routing on a trace built for it, the live update path with a drafter-state probe, and its JSON."""

import numpy as np
import pytest

from specfit.experts.learned import FEATURES, LearnedPredictor
from specfit.experts.predictors import NodeBatch, predictor_from_dict, slots_right
from specfit.traces.format import Trace

L, E, K = 2, 8, 2


def routed_trace(seed: int, n_cycles: int, token_rule: bool) -> Trace:
    """Root-only cycles of one sequence. With ``token_rule`` a token t always routes to experts
    {t % E, (t + 1) % E} at both layers; otherwise each token repeats the previous token's experts."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 12, n_cycles)
    experts = np.zeros((n_cycles, L, K), dtype=np.int16)
    prev = np.array([[0, 1], [2, 3]])
    for i, t in enumerate(tokens):
        experts[i] = [[t % E, (t + 1) % E]] * L if token_rule else prev
        if not token_rule and rng.random() < 0.2:
            prev = np.stack([rng.choice(E, K, replace=False) for _ in range(L)])
    return Trace(
        meta={"model": {"name": "toy", "n_layers": L, "n_experts": E, "top_k": K, "expert_bytes": 1},
              "drafter": {"name": "none"}, "workload": "test",
              "recording": {"kind": "synthetic", "position_indexed": True, "full_verification": True},
              "provenance": {"real": [], "synthesised": ["everything"]}},
        offsets=np.arange(n_cycles + 1), sequence=np.zeros(n_cycles, dtype=np.int32),
        position=np.arange(n_cycles, dtype=np.int32), parent=np.full(n_cycles, -1, dtype=np.int16),
        depth=np.zeros(n_cycles, dtype=np.int16), token=tokens.astype(np.int32),
        draft_logprob=np.zeros(n_cycles, dtype=np.float32), path_prob=np.ones(n_cycles),
        verdict=np.r_[tokens[1:], 0].astype(np.int32), true_experts=experts)


def test_features_by_hand():
    trace = routed_trace(0, 200, token_rule=True)
    p = LearnedPredictor(prior_strength=1.0).fit(trace)
    last = np.full((1, L, K), -1)
    last[0] = [[3, 4], [5, 6]]
    x = p.features(NodeBatch(tokens=np.array([5]), last_known=last))
    n5 = p.table_._occurrences(np.array([5]))[0]
    # token 5 always went to experts 5 and 6: share 1 there, weighted by n / (n + 1)
    assert x[0, 0, [5, 6], FEATURES.index("token_share")].tolist() == [1.0, 1.0]
    assert x[0, 0, 5, FEATURES.index("token_share_weighted")] == pytest.approx(n5 / (n5 + 1))
    assert x[0, 0, 0, FEATURES.index("token_share")] == 0.0
    assert x[0, 1, [5, 6], FEATURES.index("last_known")].tolist() == [1.0, 1.0]
    assert x[0, 0, 3, FEATURES.index("last_known")] == 1.0 and x[0, 0, 5, FEATURES.index("last_known")] == 0.0
    assert x[0, 0, :, FEATURES.index("log_popularity")] == pytest.approx(np.log(p.table_.popularity_[0]))
    assert (x[..., FEATURES.index("context_probe")] == 0).all()


@pytest.mark.parametrize("token_rule", [True, False])
def test_the_fit_learns_which_signal_predicts_routing(token_rule):
    train, test = routed_trace(1, 600, token_rule), routed_trace(2, 300, token_rule)
    p = LearnedPredictor().fit(train)
    token_w = p.coef_[FEATURES.index("token_share_weighted")] + p.coef_[FEATURES.index("token_share")]
    reuse_w = p.coef_[FEATURES.index("last_known")]
    assert (token_w > reuse_w) if token_rule else (reuse_w > token_w)
    predicted = p.predict_trace(test)
    precision = slots_right(predicted[1:], test.true_experts[1:]) / predicted[1:].size
    assert precision > (0.95 if token_rule else 0.7)


def test_live_updates_fit_a_probe_of_the_drafter_state():
    # the drafter context says which expert pair a node routes to; tokens carry no signal
    rng = np.random.default_rng(3)
    p = LearnedPredictor(refit_every=10, sample=False)
    basis = rng.normal(size=(4, 16)).astype(np.float32)

    def batch(n):
        which = rng.integers(0, 4, n)
        context = basis[which] + 0.05 * rng.normal(size=(n, 16)).astype(np.float32)
        experts = np.stack([[[2 * w, 2 * w + 1]] * L for w in which])
        return rng.integers(0, 1000, n), context, experts

    for _ in range(40):
        tokens, context, experts = batch(8)
        p.update(tokens, experts, E, last_known=np.full(experts.shape, -1), context=context)
    assert p.probe_ is not None and p.coef_[FEATURES.index("context_probe")] > 0
    tokens, context, experts = batch(200)
    predicted = p.predict(NodeBatch(tokens=tokens, last_known=np.full(experts.shape, -1), context=context))
    assert slots_right(predicted, experts) / predicted.size > 0.9
    again = predictor_from_dict(p.to_dict())
    np.testing.assert_array_equal(
        again.predict(NodeBatch(tokens=tokens, last_known=np.full(experts.shape, -1), context=context)), predicted)


def test_the_fit_is_the_same_for_any_number_of_blas_threads():
    """The logistic weights do not depend on the machine's BLAS threads (they did: lbfgs stopped at
    another point with two threads, and a replay deciding with them moved by 1.2 %)."""
    from threadpoolctl import threadpool_limits

    from specfit.traces.format import read_trace
    from trace_helpers import SAMPLE_OLMOE

    trace = read_trace(SAMPLE_OLMOE)
    fits = []
    for threads in (1, 2):
        with threadpool_limits(limits=threads, user_api="blas"):
            fits.append(LearnedPredictor().fit(trace))
    np.testing.assert_array_equal(fits[0].coef_, fits[1].coef_)
    assert fits[0].intercept_ == fits[1].intercept_


def test_learned_memory_drops_the_oldest_updates():
    from specfit.experts.learned import LearnedPredictor

    p = LearnedPredictor(memory_nodes=4, refit_every=1000)
    for t in range(3):
        p.update(np.array([10 * t, 10 * t + 1]), np.zeros((2, 1, 1), dtype=np.int64), n_experts=4)
    kept = np.concatenate([b[0] for b in p._buffer])
    np.testing.assert_array_equal(kept, [10, 11, 20, 21])


def test_learned_context_probe_scores_deviations_from_the_mean_rate():
    from specfit.experts.learned import _ridge_probe

    # a context that says nothing (constant) about experts every node routes to: the probe scores
    # nothing (popularity is its own feature)
    probe = _ridge_probe(np.ones((50, 3), dtype=np.float32), np.zeros((50, 1, 1), dtype=np.int64), 4, 1.0)
    np.testing.assert_allclose(probe, 0.0, atol=1e-6)


def test_the_probe_is_fitted_live_after_the_prompts_routing_without_a_context():
    """The decoder teaches the predictor the prompt's routing (no drafter context) before any
    cycle; the probe was fitted only when every remembered entry had a context, so never."""
    rng = np.random.default_rng(0)
    weights = rng.normal(size=(16, L * E))

    def nodes(n):
        context = rng.normal(size=(n, 16)).astype(np.float32)
        experts = np.argsort(-(context @ weights).reshape(n, L, E), axis=2)[:, :, :K]
        return rng.integers(0, 50, n), experts, context

    p = LearnedPredictor(refit_every=8)
    tokens, experts, _ = nodes(40)
    p.update(tokens, experts, E)
    for _ in range(64):
        tokens, experts, context = nodes(6)
        p.update(tokens, experts, E, last_known=np.full(experts.shape, -1), context=context)
    assert p.probe_ is not None and p.coef_[FEATURES.index("context_probe")] > 0


def test_a_training_node_does_not_see_its_own_routing_in_its_tokens_share():
    """Fitted on a trace, each training node's token shares leave the node out: a token seen once
    has no share (as for a token unseen at prediction time), a token seen n times the shares of
    its n - 1 others."""
    trace = routed_trace(4, 200, token_rule=False)
    trace.token[:5] = np.arange(100, 105)              # five tokens seen once
    p = LearnedPredictor(prior_strength=1.0).fit(trace)
    true = trace.true_experts.astype(np.int64)
    own = np.zeros((true.shape[0], L, E), dtype=bool)
    np.put_along_axis(own, true, True, axis=2)
    batch = NodeBatch(tokens=trace.token, last_known=np.full(true.shape, -1))
    x, loo = p.features(batch), p.features(batch, own=own)
    share, n = p.table_.token_shares(trace.token)
    expected = (share * n[:, None, None] - own) / np.maximum(n - 1, 1)[:, None, None]
    np.testing.assert_allclose(loo[..., FEATURES.index("token_share")], expected, atol=1e-6)
    np.testing.assert_allclose(loo[..., FEATURES.index("token_share_weighted")],
                               expected * ((n - 1) / n)[:, None, None], atol=1e-6)
    once = n == 1
    assert once.any() and (loo[once][..., :2] == 0).all() and (x[once][..., 1] == own[once]).all()
    # the other features are the node's own either way
    np.testing.assert_array_equal(loo[..., 2:], x[..., 2:])


def test_an_unfitted_learned_predictor_says_so():
    from specfit.errors import SpecFitError

    with pytest.raises(SpecFitError, match="learned: not fitted"):
        LearnedPredictor().predict(NodeBatch(tokens=np.array([1]), last_known=np.full((1, L, K), -1)))
