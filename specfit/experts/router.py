"""The router predictor: the target's own routers applied to an estimate of a draft node's hidden
state.

A token's residual stream in the target starts at its embedding and accumulates what attention and
the MLPs add from the context, and every MoE layer routes ``post_attention_layernorm(residual)``
with its gate. The predictor estimates a draft node's residual as

    e + context_weight * |e| * c / |c|,   e = embedding(token of v), c = drafter output at v's parent

(the drafter's output at the parent summarises the context from which it drafted v), and routes
that estimate through every layer's norm and router (the norm's per-row scale moves no expert past
another, so only the norm weights, folded into the routers, are applied). The drafter's states live in its own learned,
un-normalised space, so the context is rescaled to the embedding's norm: added raw it swamps the
token. Siblings differ by their token, so they get different experts — identical predictions for
siblings make extra nodes look free (see DESIGN.md). Without a context (the root, whose drafter
entry is only computed once a level is drafted; a drafter whose hidden size differs from the
target's; a replay, where no drafter state was recorded) the embedding alone is routed. Its
measured precision is in ``benchmarks/RESULTS.md``. For a replay, :func:`specfit.runtime.loader.load_router`
builds it from a checkpoint's embedding, norms and routers alone.
"""

from __future__ import annotations

import numpy as np
import torch

from .predictor_base import ExpertPredictor, NodeBatch

__all__ = ["RouterPredictor"]


class RouterPredictor(ExpertPredictor):
    """Top-k experts at every layer from the target's routers.

    Args:
        model: the target; its embedding, per-layer ``post_attention_layernorm`` and ``moe.gate``
            weights are used in place (nothing is copied but the stacked router matrices).
        context_weight: the drafter context's norm relative to the token embedding's.
    """

    name = "router"

    def __init__(self, model=None, context_weight: float = 0.5, *, embed: torch.Tensor | None = None,
                 router_weight: torch.Tensor | None = None, eps: float = 1e-6, top_k: int = 0):
        if not context_weight >= 0:
            raise ValueError(f"context_weight: expected >= 0, got {context_weight}")
        self.context_weight = float(context_weight)
        if model is not None:
            embed = model.embed_tokens.weight
            # each layer's RMSNorm weight folded into its router: logits = rms(x) @ (gate * norm).T
            router_weight = torch.stack([layer.moe.gate.weight.float() * layer.post_attention_layernorm.weight.float()
                                         for layer in model.layers if layer.moe is not None])
            eps, top_k = model.config.rms_norm_eps, model.config.top_k
        if embed is None or router_weight is None or top_k < 1:
            raise ValueError("RouterPredictor: pass the target model, or its embedding, router weights and top_k")
        self.embed, self.router_weight, self.eps, self.top_k = embed, router_weight, float(eps), int(top_k)
        # every layer's router as the columns of one matrix [H, L * E]: one GEMM per call
        n_layers, n_experts, hidden = router_weight.shape
        self._columns = router_weight.reshape(n_layers * n_experts, hidden).t().contiguous()
        self._layers_experts = (n_layers, n_experts)

    def get_params(self) -> dict:
        return {"context_weight": self.context_weight}

    @torch.inference_mode()
    def predict(self, batch: NodeBatch) -> np.ndarray:
        """int64 [n, L, top_k] experts of the batch's nodes from their tokens and, when given, the
        drafter's context."""
        tokens = torch.as_tensor(np.asarray(batch.tokens, dtype=np.int64), device=self.embed.device).reshape(-1)
        x = self.embed[tokens].float()
        if batch.context is not None:
            c = batch.context.to(device=x.device, dtype=torch.float32)
            scale = x.norm(dim=-1, keepdim=True).div_(c.norm(dim=-1, keepdim=True).clamp_min_(1e-12))
            x = torch.addcmul(x, scale.mul_(self.context_weight), c)
        # The layers route rms(x) = x / sqrt(mean(x^2) + eps) (the norm weights are folded into the
        # router matrix): one positive factor per row, which moves no logit past another, and
        # softmax is monotone: the top-k of x's raw logits are the router's top-k
        logits = (x @ self._columns).view(x.shape[0], *self._layers_experts)      # [n, L, E]
        return logits.topk(self.top_k, dim=-1).indices.cpu().numpy()             # int64 [n, L, k]
