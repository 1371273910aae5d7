"""The router predictor's online choice of its context weight and bonus: its node thresholds and ties."""

from __future__ import annotations

import numpy as np
import torch

from specfit.experts.router import RouterPredictor

V, H, L, E, K = 64, 32, 3, 16, 4


def _routers(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(V, H, generator=generator), torch.randn(L, E, H, generator=generator)


def _routed(embed, router_weight, tokens, context, weights):
    e = embed[torch.from_numpy(tokens)]
    out = []
    for layer, w in enumerate(weights):
        x = e + w * e.norm(dim=-1, keepdim=True) / context.norm(dim=-1, keepdim=True) * context
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        out.append((x @ router_weight[layer].T).topk(K, dim=-1).indices)
    return torch.stack(out, dim=1).numpy()


def _nodes(rng, n):
    return rng.integers(0, V, n), torch.from_numpy(rng.standard_normal((n, H)).astype(np.float32))


def test_router_predictor_counts_a_batch_as_soon_as_it_holds_batch_nodes():
    embed, router_weight = _routers()
    predictor = RouterPredictor(embed=embed, router_weight=router_weight, top_k=K, min_nodes=1000,
                                batch_nodes=32, max_nodes=4000)
    tokens, context = _nodes(np.random.default_rng(0), 32)
    predictor.update(tokens, _routed(embed, router_weight, tokens, context, (1.0,) * L), E, context=context)
    assert predictor._nodes_seen == 32 and predictor._batch == []


def test_router_predictor_switches_weights_at_exactly_min_nodes():
    embed, router_weight = _routers()
    truth = (0.0, 4.0, 1.0)
    predictor = RouterPredictor(context_weight=0.5, embed=embed, router_weight=router_weight, top_k=K, min_nodes=128,
                                batch_nodes=128, max_nodes=4000)
    tokens, context = _nodes(np.random.default_rng(1), 128)
    predictor.update(tokens, _routed(embed, router_weight, tokens, context, truth), E, context=context)
    assert predictor._nodes_seen == 128
    assert predictor.layer_weights.tolist() == list(truth)


def test_router_predictor_stops_learning_once_it_has_seen_max_nodes():
    embed, router_weight = _routers()
    predictor = RouterPredictor(embed=embed, router_weight=router_weight, top_k=K, min_nodes=32, batch_nodes=32,
                                max_nodes=64)
    rng = np.random.default_rng(2)
    for _ in range(2):
        tokens, context = _nodes(rng, 32)
        predictor.update(tokens, _routed(embed, router_weight, tokens, context, (1.0,) * L), E, context=context)
    assert predictor._nodes_seen == 64
    assert not predictor.learning
    # and a further batch is not even kept
    tokens, context = _nodes(rng, 32)
    predictor.update(tokens, _routed(embed, router_weight, tokens, context, (1.0,) * L), E, context=context)
    assert predictor._nodes_seen == 64 and predictor._batch == []


def test_router_predictor_keeps_the_configured_weight_and_bonus_when_every_candidate_ties():
    embed, router_weight = _routers()
    predictor = RouterPredictor(context_weight=0.5, recent_bonus=1.0, embed=embed, router_weight=router_weight,
                                top_k=K, min_nodes=64, batch_nodes=64, max_nodes=4000)
    tokens = np.random.default_rng(3).integers(0, V, 64)
    # a context parallel to the embedding: every candidate weight routes the same experts, and
    # without a known recent routing every bonus does too, so all candidates tie
    context = embed[torch.from_numpy(tokens)].clone()
    predictor.update(tokens, _routed(embed, router_weight, tokens, context, (1.0,) * L), E, context=context)
    assert predictor._nodes_seen == 64
    assert predictor.layer_weights.tolist() == [0.5] * L
    assert predictor.layer_bonuses.tolist() == [1.0] * L
