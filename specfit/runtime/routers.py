"""Routers: which experts a token goes to at an MoE layer, and with what weights.

Every family scores experts with a softmax over ``x @ W_gate.T`` in float32 and keeps the top-k;
they differ in what happens around that (the exact ``transformers`` operations, so weights agree
bit for bit):

- ``softmax_topk`` (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral; DeepSeek-V2's ``greedy``): top-k of
  the probabilities, renormalised when ``norm_topk_prob`` (Mixtral always), cast to the
  activation dtype unless the family multiplies in float32 (Mixtral, DeepSeek);
- ``group_limited_topk`` (DeepSeek-V2's ``group_limited_greedy``): experts come in ``n_group``
  equal groups; a group scores the maximum probability in it, only the ``topk_group`` best groups
  stay eligible, and the top-k is taken among their experts;
- DeepSeek computes the router in float32 whatever the activation dtype (its gate weight is kept
  in float32) and multiplies the weights by ``routed_scaling_factor``.

Expert ids come back in router rank order (highest weight first).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import ModelConfig

__all__ = ["route"]


def route(x: torch.Tensor, gate_weight: torch.Tensor, config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of ``x`` [T, H] with router ``gate_weight`` [E, H].

    Returns ``weights`` [T, k] (float32 or the activation dtype, as the family multiplies) and
    ``expert_ids`` int64 [T, k].
    """
    if config.router_float32:
        logits = F.linear(x.to(torch.float32), gate_weight.to(torch.float32))
    else:
        logits = F.linear(x, gate_weight)
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    if config.router == "group_limited_topk":
        probs = _keep_best_groups(probs, config.n_group, config.topk_group)
    weights, expert_ids = torch.topk(probs, config.top_k, dim=-1)
    if config.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if config.routed_scaling_factor != 1.0:
        weights = weights * config.routed_scaling_factor
    if not config.routing_weights_float32:
        weights = weights.to(logits.dtype)
    return weights, expert_ids


def _keep_best_groups(probs: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """``probs`` with every expert outside the ``topk_group`` best groups set to 0."""
    T, E = probs.shape
    group_scores = probs.view(T, n_group, E // n_group).max(dim=-1).values
    best_groups = torch.topk(group_scores, topk_group, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_scores).scatter_(1, best_groups, 1.0).bool()
    keep = keep[:, :, None].expand(T, n_group, E // n_group).reshape(T, E)
    return probs.masked_fill(~keep, 0.0)
