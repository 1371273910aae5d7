"""The router predictor's per-layer context weight, chosen online from verified nodes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specfit.experts.predictor_base import NodeBatch
from specfit.experts.router import CONTEXT_WEIGHTS, RECENT_BONUSES, RouterPredictor

V, H, L, E, K = 64, 32, 3, 16, 4


def routers(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(V, H, generator=generator), torch.randn(L, E, H, generator=generator)


def routed(embed, router_weight, tokens, context, weights):
    """The truth of this synthetic target: layer l routes rms(e + w_l |e| c / |c|) (by hand, the
    norm included)."""
    e = embed[torch.from_numpy(tokens)]
    out = []
    for layer, w in enumerate(weights):
        x = e + w * e.norm(dim=-1, keepdim=True) / context.norm(dim=-1, keepdim=True) * context
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        out.append((x @ router_weight[layer].T).topk(K, dim=-1).indices)
    return torch.stack(out, dim=1).numpy()                                     # [n, L, k]


def nodes(rng, n):
    return rng.integers(0, V, n), torch.from_numpy(rng.standard_normal((n, H)).astype(np.float32))


def precision(predicted, true):
    return np.mean([len(set(p) & set(t)) / K for p, t in zip(predicted.reshape(-1, K), true.reshape(-1, K))])


def test_each_layer_learns_its_own_context_weight_from_verified_nodes():
    embed, router_weight = routers()
    truth = (0.0, 4.0, 1.0)
    adaptive = RouterPredictor(context_weight=0.5, embed=embed, router_weight=router_weight, top_k=K, min_nodes=48,
                               batch_nodes=32, max_nodes=200)
    fixed = RouterPredictor(context_weight=0.5, embed=embed, router_weight=router_weight, top_k=K, adapt=False)
    rng = np.random.default_rng(1)
    # before min_nodes verified nodes every layer keeps the configured weight
    tokens, context = nodes(rng, 40)
    adaptive.update(tokens, routed(embed, router_weight, tokens, context, truth), E, context=context)
    assert adaptive.layer_weights.tolist() == [0.5] * L
    # rows without a context (NaN, as the decoder records the root) teach nothing
    blank = torch.full((8, H), float("nan"))
    adaptive.update(tokens[:8], routed(embed, router_weight, tokens[:8], context[:8], truth), E, context=blank)
    assert adaptive._nodes_seen == 40
    # a few nodes wait for a full batch before they are counted
    tokens, context = nodes(rng, 20)
    adaptive.update(tokens, routed(embed, router_weight, tokens, context, truth), E, context=context)
    assert adaptive._nodes_seen == 40 and adaptive.layer_weights.tolist() == [0.5] * L
    for _ in range(4):
        tokens, context = nodes(rng, 40)
        adaptive.update(tokens, routed(embed, router_weight, tokens, context, truth), E, context=context)
    assert adaptive.layer_weights.tolist() == list(truth)
    # past max_nodes the choice is kept: nodes routed another way change nothing
    assert adaptive._nodes_seen >= 200 and not adaptive.learning
    tokens, context = nodes(rng, 100)
    adaptive.update(tokens, routed(embed, router_weight, tokens, context, (4.0, 0.0, 0.0)), E, context=context)
    assert adaptive.layer_weights.tolist() == list(truth)
    assert set(truth) <= set(CONTEXT_WEIGHTS)
    # held out: fresh nodes, predicted before any update from them
    tokens, context = nodes(rng, 200)
    true = routed(embed, router_weight, tokens, context, truth)
    batch = NodeBatch(tokens=tokens, last_known=None, context=context)
    assert precision(adaptive.predict(batch), true) == pytest.approx(1.0)
    assert precision(fixed.predict(batch), true) < 0.9
    # without a context every layer routes the embedding alone, adapted or not
    alone = NodeBatch(tokens=tokens, last_known=None)
    assert np.array_equal(adaptive.predict(alone), fixed.predict(alone))
    assert np.array_equal(np.sort(fixed.predict(alone), axis=-1),
                          np.sort(routed(embed, router_weight, tokens, torch.ones(200, H), (0.0,) * L), axis=-1))


def test_a_fixed_weight_predicts_as_the_router_would():
    embed, router_weight = routers(3)
    predictor = RouterPredictor(context_weight=2.0, embed=embed, router_weight=router_weight, top_k=K, adapt=False)
    tokens, context = nodes(np.random.default_rng(4), 100)
    predictor.update(tokens, routed(embed, router_weight, tokens, context, (0.0,) * L), E, context=context)
    assert predictor.layer_weights.tolist() == [2.0] * L               # adapt=False: nothing moves
    got = predictor.predict(NodeBatch(tokens=tokens, last_known=None, context=context))
    assert np.array_equal(np.sort(got, axis=-1), np.sort(routed(embed, router_weight, tokens, context, (2.0,) * L), axis=-1))


def test_the_compiled_selection_is_the_top_k_with_ties_to_the_lower_expert():
    """The router kernel's top-k against a sort written from the definition (descending logit,
    equal logits in ascending expert order), on rows with many ties."""
    from specfit.kernels.router import top_k_experts

    rng = np.random.default_rng(7)
    for trial in range(60):
        n, layers, experts = int(rng.integers(1, 12)), int(rng.integers(1, 5)), int(rng.integers(4, 130))
        k = int(rng.integers(1, min(experts, 8) + 1))
        logits = rng.standard_normal((n, layers * experts)).astype(np.float32)
        if trial % 2:
            logits = np.round(logits, 1)               # ties everywhere
        got = top_k_experts(logits, np.zeros((0, 0), np.float32), np.zeros(0), np.zeros(layers),
                            np.zeros((0, 0, 0), dtype=np.int64), np.zeros(layers), k)
        for i in range(n):
            for layer in range(layers):
                row = logits[i, layer * experts:(layer + 1) * experts]
                expected = sorted(range(experts), key=lambda e: (-row[e], e))[:k]
                assert got[i, layer].tolist() == expected


def routed_with_recent(embed, router_weight, tokens, context, weights, last, bonuses):
    """As :func:`routed`, with each layer's experts of ``last`` (the previous token's routing) raised
    by ``bonuses[l]`` standard deviations of the layer's logits (by hand)."""
    e = embed[torch.from_numpy(tokens)]
    out = []
    for layer, (w, b) in enumerate(zip(weights, bonuses)):
        x = e + w * e.norm(dim=-1, keepdim=True) / context.norm(dim=-1, keepdim=True) * context
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        logits = (x @ router_weight[layer].T).double()
        sd = logits.std(dim=-1, unbiased=False, keepdim=True)
        bump = torch.zeros_like(logits)
        bump.scatter_(1, torch.from_numpy(last[:, layer]), 1.0)
        out.append((logits + b * sd * bump).topk(K, dim=-1).indices)
    return torch.stack(out, dim=1).numpy()


def test_each_layer_learns_how_much_the_previous_tokens_experts_count():
    """A target whose layers reuse the previous token's experts by different amounts: the online
    choice finds each layer's bonus (and keeps the weights), and then predicts held-out nodes
    exactly; a target that never reuses them keeps no bonus."""
    embed, router_weight = routers(5)
    weights, truth = (1.0, 1.0, 1.0), (0.0, 1.5, 0.5)
    assert set(truth) <= set(RECENT_BONUSES)
    rng = np.random.default_rng(2)

    def batch(n):
        tokens, context = nodes(rng, n)
        last = np.stack([rng.permutation(E)[:K] for _ in range(n * L)]).reshape(n, L, K)
        return tokens, context, last

    adaptive = RouterPredictor(context_weight=1.0, recent_bonus=1.0, embed=embed, router_weight=router_weight,
                               top_k=K, min_nodes=48, batch_nodes=32, max_nodes=400)
    for _ in range(10):
        tokens, context, last = batch(40)
        adaptive.update(tokens, routed_with_recent(embed, router_weight, tokens, context, weights, last, truth), E,
                        last_known=last, context=context)
    assert adaptive.layer_bonuses.tolist() == list(truth) and adaptive.layer_weights.tolist() == list(weights)
    tokens, context, last = batch(200)
    true = routed_with_recent(embed, router_weight, tokens, context, weights, last, truth)
    batch_ = NodeBatch(tokens=tokens, last_known=last, context=context)
    assert precision(adaptive.predict(batch_), true) == pytest.approx(1.0)
    # the same predictor without the recent routing given: the bonus has nothing to act on
    assert precision(adaptive.predict(NodeBatch(tokens=tokens, last_known=None, context=context)), true) < 0.95
    plain = RouterPredictor(context_weight=1.0, recent_bonus=1.0, embed=embed, router_weight=router_weight, top_k=K,
                            min_nodes=48, batch_nodes=32, max_nodes=400)
    for _ in range(10):
        tokens, context, last = batch(40)
        plain.update(tokens, routed_with_recent(embed, router_weight, tokens, context, weights, last, (0.0,) * L), E,
                     last_known=last, context=context)
    assert plain.layer_bonuses.tolist() == [0.0] * L


@pytest.mark.parametrize("with_context", [True, False])
@pytest.mark.parametrize("with_last", [True, False])
def test_the_online_count_is_what_the_prediction_would_have_named_at_each_candidate(with_context, with_last):
    # kernels.router.count_right against kernels.router.top_k_experts run at each candidate: the
    # weight candidates with each layer's current bonus, the bonus candidates with each layer's
    # current weight; true slots of -1 (unknown) and last-known ids of -1 name nothing
    from specfit import kernels

    rng = np.random.default_rng(3)
    n = 40
    token_logits = rng.standard_normal((n, L * E))
    context_logits = rng.standard_normal((n, L * E)) if with_context else np.zeros((0, 0))
    scale = rng.random(n) + 0.5 if with_context else np.zeros(0)
    last = rng.integers(-1, E, (n, L, K)) if with_last else np.zeros((0, 0, 0), dtype=np.int64)
    true = rng.integers(-1, E, (n, L, K))
    layer_weight, layer_bonus = rng.choice(CONTEXT_WEIGHTS, L), rng.choice(RECENT_BONUSES, L)
    weights, bonuses = np.array(CONTEXT_WEIGHTS), np.array(RECENT_BONUSES)
    right_weight = np.zeros((weights.size, L), dtype=np.int64)
    right_bonus = np.zeros((bonuses.size, L), dtype=np.int64)
    kernels.router.count_right(token_logits, context_logits, scale, layer_weight, last, layer_bonus, weights, bonuses,
                               true, right_weight, right_bonus)

    def named(predicted):
        return np.array([sum(int(e in set(true[i, layer])) for i in range(n) for e in predicted[i, layer])
                         for layer in range(L)])

    for c, w in enumerate(weights):
        predicted = kernels.router.top_k_experts(token_logits, context_logits, scale, np.full(L, w), last,
                                                 layer_bonus, K)
        assert right_weight[c].tolist() == named(predicted).tolist()
    for c, b in enumerate(bonuses):
        predicted = kernels.router.top_k_experts(token_logits, context_logits, scale, layer_weight, last,
                                                 np.full(L, b), K)
        assert right_bonus[c].tolist() == named(predicted).tolist()
    assert right_weight.sum() > 0 and right_bonus.sum() > 0


def test_the_token_table_gives_the_predictions_of_the_products_it_replaces():
    """Every token's logits computed once (the host path's table) against the same products per
    call (no table): equal logits, scales and picks; and the compiled product against numpy's."""
    from specfit.kernels.router import host_logits, predict_host, project, token_table

    rng = np.random.default_rng(11)
    for trial in range(8):
        vocab, hidden, m = int(rng.integers(5, 40)), int(rng.integers(1, 70)), int(rng.integers(1, 11)) * L
        embed = rng.standard_normal((vocab, hidden)).astype(np.float32)
        rows = rng.standard_normal((m, hidden)).astype(np.float32)
        n = int(rng.integers(1, 20))
        tokens = rng.integers(0, vocab, n)
        context = rng.standard_normal((n, hidden)).astype(np.float32) if trial % 2 else np.zeros((0, 0), np.float32)
        out = np.empty((n, m), dtype=np.float32)
        project(embed[tokens], rows, out)
        np.testing.assert_allclose(out, embed[tokens].astype(np.float64) @ rows.T.astype(np.float64), rtol=1e-4,
                                   atol=1e-4 * np.sqrt(hidden))
        table, norms = token_table(embed, rows)
        none = (np.zeros((0, 0), np.float32), np.zeros(0))
        for a, b in zip(host_logits(embed, rows, table, norms, tokens, context),
                        host_logits(embed, rows, *none, tokens, context)):
            assert np.array_equal(a, b)
        np.testing.assert_allclose(norms, np.linalg.norm(embed.astype(np.float64), axis=1))
        weight, bonus = rng.random(L) * 2, rng.random(L)
        last = rng.integers(-1, m // L, (n, L, 3))
        args = (context, weight, last, bonus, min(K, m // L))
        assert np.array_equal(predict_host(embed, rows, table, norms, tokens, *args),
                              predict_host(embed, rows, *none, tokens, *args))


def test_a_vocabulary_too_large_for_the_table_predicts_the_same(monkeypatch):
    import specfit.experts.router as router

    embed, router_weight = routers(5)
    tokens, context = nodes(np.random.default_rng(6), 30)
    batch = NodeBatch(tokens=tokens, last_known=None, context=context)
    with_table = RouterPredictor(embed=embed, router_weight=router_weight, top_k=K, adapt=False)
    monkeypatch.setattr(router, "TOKEN_TABLE_BYTES", 0)
    without = RouterPredictor(embed=embed, router_weight=router_weight, top_k=K, adapt=False)
    assert with_table._host_weights[2].shape == (V, L * E) and without._host_weights[2].shape[0] == 0
    assert np.array_equal(with_table.predict(batch), without.predict(batch))


def test_router_predictor_counts_a_batch_as_soon_as_it_holds_batch_nodes():
    embed, router_weight = routers()
    predictor = RouterPredictor(embed=embed, router_weight=router_weight, top_k=K, min_nodes=1000,
                                batch_nodes=32, max_nodes=4000)
    tokens, context = nodes(np.random.default_rng(0), 32)
    predictor.update(tokens, routed(embed, router_weight, tokens, context, (1.0,) * L), E, context=context)
    assert predictor._nodes_seen == 32 and predictor._batch == []


def test_router_predictor_switches_weights_at_exactly_min_nodes():
    embed, router_weight = routers()
    truth = (0.0, 4.0, 1.0)
    predictor = RouterPredictor(context_weight=0.5, embed=embed, router_weight=router_weight, top_k=K, min_nodes=128,
                                batch_nodes=128, max_nodes=4000)
    tokens, context = nodes(np.random.default_rng(1), 128)
    predictor.update(tokens, routed(embed, router_weight, tokens, context, truth), E, context=context)
    assert predictor._nodes_seen == 128
    assert predictor.layer_weights.tolist() == list(truth)


def test_router_predictor_stops_learning_once_it_has_seen_max_nodes():
    embed, router_weight = routers()
    predictor = RouterPredictor(embed=embed, router_weight=router_weight, top_k=K, min_nodes=32, batch_nodes=32,
                                max_nodes=64)
    rng = np.random.default_rng(2)
    for _ in range(2):
        tokens, context = nodes(rng, 32)
        predictor.update(tokens, routed(embed, router_weight, tokens, context, (1.0,) * L), E, context=context)
    assert predictor._nodes_seen == 64
    assert not predictor.learning
    # and a further batch is not even kept
    tokens, context = nodes(rng, 32)
    predictor.update(tokens, routed(embed, router_weight, tokens, context, (1.0,) * L), E, context=context)
    assert predictor._nodes_seen == 64 and predictor._batch == []


def test_router_predictor_keeps_the_configured_weight_and_bonus_when_every_candidate_ties():
    embed, router_weight = routers()
    predictor = RouterPredictor(context_weight=0.5, recent_bonus=1.0, embed=embed, router_weight=router_weight,
                                top_k=K, min_nodes=64, batch_nodes=64, max_nodes=4000)
    tokens = np.random.default_rng(3).integers(0, V, 64)
    # a context parallel to the embedding: every candidate weight routes the same experts, and
    # without a known recent routing every bonus does too, so all candidates tie
    context = embed[torch.from_numpy(tokens)].clone()
    predictor.update(tokens, routed(embed, router_weight, tokens, context, (1.0,) * L), E, context=context)
    assert predictor._nodes_seen == 64
    assert predictor.layer_weights.tolist() == [0.5] * L
    assert predictor.layer_bonuses.tolist() == [1.0] * L
