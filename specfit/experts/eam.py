"""MoE-Infinity's activation-aware prefetcher as a next-layer predictor a routing trace can replay.

MoE-Infinity (Xue et al., EfficientMoE/MoE-Infinity; read for this: ``moe_infinity/memory/
expert_tracer.py`` and ``expert_predictor.py``) keeps, per request, an *expert activation matrix*
(EAM): ``M[l, e]``, how many of the request's tokens layer ``l`` routed to expert ``e`` so far
(``ExpertTracer.update_entry``, called as each layer routes). Past requests' matrices form a
collection (``trace_collection``). When layer ``l`` has routed, ``ExpertTracer.find_most_similar``
picks the collection entry closest to the request's matrix and ``ExpertPredictor.predict`` turns
it into prefetch priorities:

- in a copy of the collection, the rows of layers ``0..l`` are set to ``1e-9`` (so, once each row
  is divided by its sum, uniform), and each row is normalised to sum 1; the request's matrix is
  normalised likewise (an empty row: 0, ``nan_to_num``);
- per entry, the cosine similarity of each layer's row pair (``CosineSimilarity(dim=2,
  eps=1e-6)``), averaged over the layers; the entry with the smallest ``1 - mean`` wins (the first
  of equals, ``argmin``);
- the winner's rows ``>= l`` (raw counts), plus ``1e-8``, times a layer decay ``1 - (l' - l) /
  (L + 1)``, are every expert's priority; ``ExpertPrefetcher.prefetch_experts`` queues all of them,
  highest first (ties: the lower layer, then the lower expert, the order the list is built in).

Because layers ``0..l`` are uniform in every entry, the similarity of those layers is the same for
all entries, and the choice is made by the layers after ``l`` alone, where the request's matrix
holds its earlier tokens (the current token has not reached them). :class:`EAMRanker` computes it
that way: per entry, the sum of the cosines of layers ``> l``, the first maximum winning.

In :func:`~specfit.experts.layer_ahead.layer_ahead`'s windows (layer ``l + 1``'s copies while layer
``l`` computes) the ranker offers layer ``l + 1``'s experts in the winner's order (the decay is one
factor per layer, so within a layer it changes nothing). What differs from MoE-Infinity:

- its queue, replaced as each layer routes (``replace_cache_candidates``), holds the experts of
  every layer from ``l`` on, ordered by count times decay, so the copies made while layer ``l``
  computes are layer ``l + 1``'s only in part (after layer 0 on the OLMoE general trace, layer 1's
  first expert is the 16th queued); the windows give layer ``l + 1`` all of its window, which
  credits MoE-Infinity with more than its queue would hide there, and with nothing for the later
  layers' copies;
- a prefetched expert enters its cache and the predicted experts are shielded from eviction; here
  a copy waits a layer in a staging buffer and evicts nothing (the cache's rule can be
  MoE-Infinity's, ``ExpertCache(policy="moe-infinity")``);
- a request's matrix counts its prompt's tokens as well (routing logs record decoded positions: the
  matrices here count those);
- its collection grows as requests finish (``finish_entry``); here it is fixed, the requests of the
  other fold of the trace (as the paper's offline collection);
- an entry with an empty row (experts unknown at a layer) gives it NaN similarities, which
  ``argmin`` may pick; here such a row's cosine is 0.

Its repository's HEAD calls the prefetcher for two model families (Arctic, Grok; the others'
calls are commented out) and does not load a recorded collection given as a path: this is the
prefetcher of its design and its predictor's code. The recharge's overrun rule needs a probability
that a candidate is needed: the winner's share of its tokens that routed to it at layer ``l + 1``
(count over the row's sum divided by ``k``), for any of the cycle's ``nodes`` tokens ``1 - (1 -
share) ** nodes`` (MoE-Infinity has no such rule: it never cancels a copy, and the recharge's rule
only ever spares it a wasted copy's overrun).
"""

from __future__ import annotations

import numpy as np

__all__ = ["EAMRanker", "activation_matrices"]

_EPS = 1e-6          # torch.nn.CosineSimilarity's eps in MoE-Infinity's tracer


def activation_matrices(experts: np.ndarray, owner: np.ndarray, n_experts: int) -> np.ndarray:
    """float [requests, L, E]: each request's expert activation matrix, ``experts`` (int [positions,
    L, k], -1 unknown) counted per ``owner`` (int [positions], request ids ``0..requests - 1``)."""
    experts = np.asarray(experts, dtype=np.int64)
    owner = np.asarray(owner, dtype=np.int64)
    n, n_layers, _ = experts.shape
    out = np.zeros((int(owner.max()) + 1 if n else 0, n_layers, n_experts + 1))
    layer = np.broadcast_to(np.arange(n_layers)[None, :, None], experts.shape)
    who = np.broadcast_to(owner[:, None, None], experts.shape)
    np.add.at(out, (who, layer, np.where(experts >= 0, experts, n_experts)), 1.0)
    return out[:, :, :n_experts]


def _unit_rows(m: np.ndarray) -> np.ndarray:
    """Rows normalised to sum 1, then to unit length (an empty row stays 0)."""
    total = m.sum(axis=-1, keepdims=True)
    share = np.divide(m, total, out=np.zeros_like(m, dtype=np.float64), where=total > 0)
    norm = np.linalg.norm(share, axis=-1, keepdims=True)
    return share / np.maximum(norm, _EPS)


class EAMRanker:
    """Layer ``l + 1``'s candidates for :func:`~specfit.experts.layer_ahead.layer_ahead` by
    MoE-Infinity's matching (module docstring): ``collection`` is float [entries, L, E], the past
    requests' activation matrices; ``top_k`` the model's experts per token."""

    def __init__(self, collection: np.ndarray, top_k: int):
        self.collection = np.asarray(collection, dtype=np.float64)
        if self.collection.ndim != 3 or self.collection.shape[0] == 0:
            raise ValueError(f"EAMRanker.collection: expected float [entries >= 1, L, E], got shape "
                             f"{self.collection.shape}")
        if top_k <= 0:
            raise ValueError(f"EAMRanker.top_k: expected a positive integer, got {top_k!r}")
        self.top_k = int(top_k)
        self._unit = _unit_rows(self.collection)                       # [R, L, E]
        _, n_layers, n_experts = self.collection.shape
        # each entry's experts per layer, the highest count first (ties: the lower id)
        self._order = np.argsort(-self.collection, axis=2, kind="stable")
        tokens = self.collection.sum(axis=2, keepdims=True) / self.top_k
        share = np.divide(self.collection, tokens, out=np.zeros_like(self.collection), where=tokens > 0)
        self._share = np.minimum(np.take_along_axis(share, self._order, axis=2), 1.0)

    def matches(self, history: np.ndarray) -> np.ndarray:
        """int [L - 1]: per routed layer ``l``, the entry MoE-Infinity's tracer picks for the
        request whose activation matrix is ``history`` (float [L, E]: its tokens before this one;
        the current token's rows ``<= l`` do not enter the choice)."""
        cos = np.einsum("le,rle->rl", _unit_rows(np.asarray(history, dtype=np.float64)), self._unit)
        # after[r, l] = sum of entry r's cosines over layers > l
        after = np.cumsum(cos[:, ::-1], axis=1)[:, ::-1]
        after = np.concatenate([after[:, 1:], np.zeros((after.shape[0], 1))], axis=1)
        return np.argmax(after[:, :-1], axis=0)

    def rank(self, history: np.ndarray, nodes: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """A :data:`~specfit.experts.layer_ahead.Ranker`'s answer for a cycle of ``nodes`` tokens
        of a request whose earlier tokens' activation matrix is ``history``: per layer ``l + 1``
        every expert, the matched entry's most used first, and the chance each is needed."""
        match = self.matches(history)
        layers = np.arange(1, self.collection.shape[1])
        ids = self._order[match, layers]
        chance = 1.0 - (1.0 - self._share[match, layers]) ** max(int(nodes), 1)
        return ids, chance
