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
target's; a replay, where no drafter state was recorded) the embedding alone is routed. How far
the context pulls differs by layer (a deep layer's residual holds more of the context than the
token), so the weight is chosen per layer, online, from the nodes the target has verified: each
:meth:`RouterPredictor.update` counts, per layer and per candidate weight (:data:`CONTEXT_WEIGHTS`),
how many of the verified nodes' experts that weight would have predicted (in batches of
``batch_nodes`` nodes, so a cycle with few verified nodes pays only for keeping them), and from
``min_nodes`` nodes on each layer uses its best candidate (ties: the configured
``context_weight``); after ``max_nodes`` the choice is kept (the statistics of one target and
drafter do not move, and the counting costs a live cycle time). Its measured precision is in
``benchmarks/RESULTS.md``. For a replay, :func:`specfit.runtime.loader.load_router`
builds it from a checkpoint's embedding, norms and routers alone.

Consecutive tokens share experts, and the most recent routing the target has revealed (the token
before the cycle's root, :attr:`NodeBatch.last_known`) is known at draft time: each layer adds
``recent_bonus`` standard deviations of the node's logits to that routing's experts. The bonus is
chosen per layer online like the context weight (candidates :data:`RECENT_BONUSES`; the two are
counted one coordinate at a time, each at the other's current value). Without it the predicted
experts of a tree's nodes overlap less than the true ones do, and the predicted union is too large
(``benchmarks/RESULTS.md``, stop 25).
"""

from __future__ import annotations

import numpy as np
import torch

from .. import kernels
from .predictor_base import ExpertPredictor, NodeBatch

__all__ = ["RouterPredictor", "CONTEXT_WEIGHTS", "RECENT_BONUSES", "TOKEN_TABLE_BYTES"]

# the per-layer context weights and recent-routing bonuses the online choice compares (with the
# configured ones)
CONTEXT_WEIGHTS = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)
RECENT_BONUSES = (0.0, 0.5, 1.0, 1.5, 2.0)
# with the weights on the host, every token's router logits are computed once when they take at
# most this many bytes (the bundled model's: 512 KiB), and each prediction reads its tokens' rows
TOKEN_TABLE_BYTES = 64 << 20

_NO_ROWS = np.zeros((0, 0), dtype=np.float32)      # no context: no context logits
_NO_SCALE = np.zeros(0)
_NO_LAST = np.zeros((0, 0, 0), dtype=np.int64)     # no recent routing known


class RouterPredictor(ExpertPredictor):
    """Top-k experts at every layer from the target's routers.

    Args:
        model: the target; its embedding, per-layer ``post_attention_layernorm`` and ``moe.gate``
            weights are used in place (nothing is copied but the stacked router matrices).
        context_weight: the drafter context's norm relative to the token embedding's (every
            layer's until the online choice has seen ``min_nodes`` verified nodes with a context).
        recent_bonus: standard deviations of a node's logits added to the experts of the most
            recent known routing (every layer's until the online choice replaces it).
        adapt: choose the weight and the bonus per layer from the verified nodes (False: the
            configured ones always).
        min_nodes: verified nodes with a context before the per-layer choice replaces it.
        batch_nodes, max_nodes: nodes counted per batch; nodes after which the choice is kept.
    """

    name = "router"

    def __init__(self, model=None, context_weight: float = 0.5, *, recent_bonus: float = 1.0,
                 embed: torch.Tensor | None = None, router_weight: torch.Tensor | None = None, top_k: int = 0,
                 adapt: bool = True, min_nodes: int = 64, batch_nodes: int = 64, max_nodes: int = 1024):
        if not context_weight >= 0:
            raise ValueError(f"context_weight: expected >= 0, got {context_weight}")
        if not recent_bonus >= 0:
            raise ValueError(f"recent_bonus: expected >= 0, got {recent_bonus}")
        self.context_weight, self.recent_bonus = float(context_weight), float(recent_bonus)
        self.adapt, self.min_nodes = bool(adapt), int(min_nodes)
        self.batch_nodes, self.max_nodes = max(int(batch_nodes), 1), int(max_nodes)
        self._batch: list[tuple] = []     # verified nodes not yet counted: (tokens, contexts, recent routing, experts)
        if model is not None:
            embed = model.embed_tokens.weight
            # each layer's RMSNorm weight folded into its router: logits = rms(x) @ (gate * norm).T
            router_weight = torch.stack([layer.moe.gate.weight.float() * layer.post_attention_layernorm.weight.float()
                                         for layer in model.layers if layer.moe is not None])
            top_k = model.config.top_k
        if embed is None or router_weight is None or top_k < 1:
            raise ValueError("RouterPredictor: pass the target model, or its embedding, router weights and top_k")
        self.embed, self.top_k = embed, int(top_k)
        # every layer's router, one row per expert [L * E, H]; on a device as the columns of one
        # matrix [H, L * E]: one GEMM per call
        n_layers, n_experts, hidden = router_weight.shape
        expert_rows = router_weight.reshape(n_layers * n_experts, hidden)
        self._columns = expert_rows.t().contiguous()
        # on the host the same weights as float32 numpy arrays (views where they are float32 already),
        # the routers one row per expert, and every token's logits where they fit TOKEN_TABLE_BYTES
        self._host_weights = None
        if embed.device.type == "cpu":
            host_embed = embed.detach().float().numpy()
            rows = expert_rows.detach().float().contiguous().numpy()
            table, norms = _NO_ROWS, _NO_SCALE
            if host_embed.shape[0] * rows.shape[0] * 4 <= TOKEN_TABLE_BYTES:
                table, norms = kernels.router.token_table(host_embed, rows)
            self._host_weights = (host_embed, rows, table, norms)
        self._layers_experts = (n_layers, n_experts)
        # the online choice: candidates (the configured values among them), right slots per
        # (candidate, layer) so far, nodes seen, and the weight and bonus each layer uses now
        weights = sorted(set(CONTEXT_WEIGHTS) | {self.context_weight})
        bonuses = sorted(set(RECENT_BONUSES) | {self.recent_bonus})
        self._candidates = np.array(weights, dtype=np.float64)
        self._bonus_candidates = np.array(bonuses, dtype=np.float64)
        self._configured = (weights.index(self.context_weight), bonuses.index(self.recent_bonus))
        self._right = np.zeros((len(weights), n_layers), dtype=np.int64)
        self._right_bonus = np.zeros((len(bonuses), n_layers), dtype=np.int64)
        self._nodes_seen = 0
        self._layer_weight = np.full(n_layers, self.context_weight)
        self._layer_bonus = np.full(n_layers, self.recent_bonus)

    def get_params(self) -> dict:
        return {"context_weight": self.context_weight, "recent_bonus": self.recent_bonus, "adapt": self.adapt,
                "min_nodes": self.min_nodes, "batch_nodes": self.batch_nodes, "max_nodes": self.max_nodes}

    def predict(self, batch: NodeBatch) -> np.ndarray:
        """int64 [n, L, top_k] experts of the batch's nodes from their tokens and, when given, the
        drafter's context."""
        tokens = np.ascontiguousarray(batch.tokens, dtype=np.int64).reshape(-1)
        last = _recent(batch.last_known)
        if self._host_weights is not None:
            return kernels.router.predict_host(*self._host_weights, tokens, _host(batch.context), self._layer_weight,
                                               last, self._layer_bonus, self.top_k)
        return kernels.router.top_k_experts(*self._device_logits(tokens, batch.context), self._layer_weight, last,
                                            self._layer_bonus, self.top_k)

    @property
    def layers_experts(self) -> tuple[int, int]:
        """(MoE layers, experts per layer) of the routers."""
        return self._layers_experts

    @property
    def layer_weights(self) -> np.ndarray:
        """float [L]: the context weight each layer uses now."""
        return self._layer_weight.copy()

    @property
    def layer_bonuses(self) -> np.ndarray:
        """float [L]: the recent-routing bonus each layer uses now."""
        return self._layer_bonus.copy()

    @property
    def learning(self) -> bool:
        """Whether verified nodes still change the per-layer choice."""
        return self.adapt and self._nodes_seen < self.max_nodes

    def update(self, tokens, experts, n_experts, last_known=None, context=None) -> None:
        """Keep the verified nodes that have a context; every ``batch_nodes`` of them, count what
        each candidate weight would have predicted and move each layer to its best candidate."""
        if not self.learning or context is None:
            return
        context = _host(context)
        valid = ~np.isnan(context[:, 0])                         # a node without a context is a row of NaN
        if not valid.any():
            return
        experts = np.asarray(experts)
        last = np.full(experts.shape, -1, dtype=np.int64) if last_known is None else np.asarray(last_known)
        self._batch.append((np.asarray(tokens)[valid], context[valid], last[valid], experts[valid]))
        if sum(b[0].size for b in self._batch) >= self.batch_nodes:
            tokens, context, last, experts = (np.concatenate([b[i] for b in self._batch]) for i in range(4))
            self._batch.clear()
            self._count(tokens, context, last, experts)

    def _count(self, tokens: np.ndarray, context: np.ndarray, last: np.ndarray, experts: np.ndarray) -> None:
        true, last = np.ascontiguousarray(experts, dtype=np.int64), np.ascontiguousarray(last, dtype=np.int64)
        state = (self._layer_weight, last, self._layer_bonus, self._candidates, self._bonus_candidates, true,
                 self._right, self._right_bonus)
        if self._host_weights is not None:
            kernels.router.count_host(*self._host_weights, tokens, context, *state)
        else:
            kernels.router.count_right(*self._device_logits(tokens, context), *state)
        self._nodes_seen += int(tokens.size)
        if self._nodes_seen >= self.min_nodes:
            # the best candidate per layer, each coordinate at the other's value when it was
            # counted; the configured values win ties
            for right, candidates, configured, name in ((self._right, self._candidates, self._configured[0],
                                                         "_layer_weight"),
                                                        (self._right_bonus, self._bonus_candidates, self._configured[1],
                                                         "_layer_bonus")):
                score = right.astype(np.float64)
                score[configured] += 0.5
                setattr(self, name, candidates[score.argmax(axis=0)])

    @torch.inference_mode()
    def _device_logits(self, tokens: np.ndarray, context) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """With the weights on a device: the routers' logits of the nodes' embeddings and of their
        contexts (float32 [n, L * E] each, brought to the host; the context's with no rows without
        a context), and each row's scale ``|embedding| / |context|``, from one GEMM there
        (:func:`specfit.kernels.router.host_logits` is the same on the host)."""
        x = self.embed.index_select(0, torch.from_numpy(tokens).to(self.embed.device)).float()
        if context is None:
            return (x @ self._columns).cpu().numpy(), _NO_ROWS, _NO_SCALE
        n = x.shape[0]
        both = torch.cat((x, torch.as_tensor(context).to(device=x.device, dtype=torch.float32)))
        logits = (both @ self._columns).cpu().numpy()
        host = both.cpu().numpy()
        return logits[:n], logits[n:], kernels.router.row_scales(host[:n], host[n:])


def _recent(last_known) -> np.ndarray:
    """The most recent known routing of each node (int [n, L, k'], -1 unknown) as the kernels take
    it; none: no rows."""
    if last_known is None:
        return _NO_LAST
    return np.ascontiguousarray(last_known, dtype=np.int64)


def _host(context) -> np.ndarray:
    """A context (a tensor, on any device, or an array; None: no rows) as float32 [n, H] on the host."""
    if context is None:
        return _NO_ROWS
    if isinstance(context, torch.Tensor):
        context = context.detach().float().cpu().numpy()
    return np.ascontiguousarray(context, dtype=np.float32)
