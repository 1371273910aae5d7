"""The ``affinity`` expert predictor: a token -> experts frequency table fitted from traces,
blended with the most recent known routing and each layer's popularity (see
:mod:`specfit.experts.predictors` for the interface and the other predictors)."""

from __future__ import annotations

import numpy as np

from ..errors import SpecFitError
from .predictor_base import ExpertPredictor, NodeBatch, selected_rows as _selected_rows

__all__ = ["AffinityPredictor", "popularity"]


def popularity(trace, cycles) -> np.ndarray:
    _, rows = _selected_rows(trace, cycles)
    rows = rows[trace.true_known[rows]]
    L, E = trace.n_layers, trace.n_experts
    flat = (trace.true_experts[rows].astype(np.int64) + np.arange(L)[None, :, None] * E).ravel()
    return _normalised(np.bincount(flat, minlength=L * E).reshape(L, E))


def _normalised(counts: np.ndarray) -> np.ndarray:
    counts = counts + 1.0   # add-one: unseen experts stay possible
    return counts / counts.sum(axis=1, keepdims=True)


class AffinityPredictor(ExpertPredictor):
    """Token -> experts frequencies, fitted from the nodes whose true experts are known.

    A node with token x scores expert e at layer l as

        w_x * freq(x, l, e) + (1 - w_x) * (reuse_weight * [e in last known routing] + (1 - reuse_weight) * pop(l, e))

    with ``w_x = n_x / (n_x + prior_strength)`` for a token seen ``n_x`` times. With
    ``sample=False`` the top-k scores are the prediction; with ``sample=True`` (the default) the
    k experts are drawn from the scores (Gumbel top-k of their logarithms). Drawing prices the
    uncertainty of rarely seen tokens: their argmax would be the same few popular experts for
    every such node, so the predicted union would be far smaller than the true one and extra
    nodes would look free; drawn sets spread like real routing does, while a confident token's
    peaked scores still give its usual experts.
    """

    name = "affinity"

    def __init__(self, prior_strength: float = 1.0, reuse_weight: float = 0.5, sample: bool = True, seed: int = 0,
                 chunk_nodes: int = 1024):
        if prior_strength < 0 or not 0 <= reuse_weight <= 1:
            raise ValueError("affinity: expected prior_strength >= 0 and reuse_weight in [0, 1]")
        self.prior_strength, self.reuse_weight = float(prior_strength), float(reuse_weight)
        self.sample, self.seed, self.chunk_nodes = bool(sample), int(seed), int(chunk_nodes)

    def get_params(self) -> dict:
        return {"prior_strength": self.prior_strength, "reuse_weight": self.reuse_weight, "sample": self.sample,
                "seed": self.seed}

    def fit(self, trace, cycles=None) -> "AffinityPredictor":
        _, rows = _selected_rows(trace, cycles)
        rows = rows[trace.true_known[rows]]
        L, E = trace.n_layers, trace.n_experts
        self.popularity_ = popularity(trace, cycles)
        self.tokens_, token_row, self.occurrences_ = np.unique(trace.token[rows], return_inverse=True, return_counts=True)
        # sparse (token row, layer, expert) counts, keyed in one int64 so that a token's entries
        # for every layer are one contiguous, sorted range
        keys = ((token_row.astype(np.int64)[:, None, None] * L + np.arange(L)[None, :, None]) * E
                + trace.true_experts[rows].astype(np.int64)).ravel()
        self.keys_, self.counts_ = np.unique(keys, return_counts=True)
        self.n_layers_, self.n_experts_ = L, E
        return self

    def update(self, tokens: np.ndarray, experts: np.ndarray, n_experts: int, last_known: np.ndarray | None = None,
               context=None) -> None:
        """Add the verified nodes' routings to the token table (live: it grows as the run goes)."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        experts = np.asarray(experts, dtype=np.int64)
        L, E = experts.shape[1], int(n_experts)
        if getattr(self, "keys_", None) is None:
            self.tokens_, self.occurrences_ = np.zeros(0, np.int64), np.zeros(0, np.int64)
            self.keys_, self.counts_ = np.zeros(0, np.int64), np.zeros(0, np.int64)
            self.n_layers_, self.n_experts_ = L, E
        if (L, E) != (self.n_layers_, self.n_experts_):
            raise SpecFitError(f"affinity: fitted for {self.n_layers_} layers x {self.n_experts_} experts, updated with "
                               f"{L} x {E}")
        span = L * E
        old = self.tokens_[self.keys_ // span] * span + self.keys_ % span            # (token, layer, expert) keys
        new = ((tokens[:, None, None] * L + np.arange(L)[None, :, None]) * E + experts).ravel()
        keys, inverse = np.unique(np.r_[old, new], return_inverse=True)
        counts = np.bincount(inverse, weights=np.r_[self.counts_, np.ones(new.size)]).astype(np.int64)
        seen, seen_inverse = np.unique(np.r_[self.tokens_, tokens], return_inverse=True)
        self.occurrences_ = np.bincount(seen_inverse, weights=np.r_[self.occurrences_, np.ones(tokens.size)]).astype(np.int64)
        self.tokens_ = seen
        self.keys_ = np.searchsorted(seen, keys // span) * span + keys % span
        self.counts_ = counts
        self.popularity_ = _normalised(np.bincount(keys % span, weights=counts, minlength=span).reshape(L, E))

    def predict(self, batch: NodeBatch) -> np.ndarray:
        if getattr(self, "keys_", None) is None:
            raise SpecFitError("--predictor affinity: not fitted; fit it on a trace or update it with routed tokens first")
        last_all = np.asarray(batch.last_known)
        n_nodes, L, k = last_all.shape
        E = self.n_experts_
        if L != self.n_layers_:
            raise SpecFitError(f"--predictor affinity: fitted for {self.n_layers_} layers x {self.n_experts_} experts, "
                               f"asked about {L} layers")
        tokens = np.asarray(batch.tokens)
        out = np.empty((n_nodes, L, k), dtype=np.int16)
        prior_pop = ((1 - self.reuse_weight) * self.popularity_).astype(np.float32)
        rng = np.random.default_rng(self.seed)
        for s in range(0, n_nodes, self.chunk_nodes):
            n = min(self.chunk_nodes, n_nodes - s)
            tok = tokens[s:s + n]
            n_x, (owner, layer_of, expert_of, count) = self._occurrences(tok), self._token_entries(tok)
            w_x = n_x / (n_x + self.prior_strength) if self.prior_strength > 0 else (n_x > 0).astype(np.float32)
            scores = np.broadcast_to(prior_pop[None], (n, L, E)).copy()
            lk = last_all[s:s + n].astype(np.int64)
            has_last = lk[:, 0, 0] >= 0
            node, layer, slot = np.nonzero(np.broadcast_to(has_last[:, None, None], lk.shape))
            scores[node, layer, lk[node, layer, slot]] += self.reuse_weight
            scores *= (1 - w_x)[:, None, None]
            scores[owner, layer_of, expert_of] += (w_x[owner] * count / np.maximum(n_x[owner], 1)).astype(np.float32)
            # popularity breaks ties (e.g. an unseen token with no known routing)
            scores += 1e-6 * self.popularity_[None].astype(np.float32)
            if self.sample:
                u = rng.random(scores.shape, dtype=np.float32)
                scores = np.log(scores) - np.log(-np.log(np.maximum(u, np.float32(1e-12))))
            out[s:s + n] = np.argpartition(-scores, k - 1, axis=2)[:, :, :k]
        return out

    def _occurrences(self, tokens: np.ndarray) -> np.ndarray:
        """float32 [n]: how often each token was seen (0: never)."""
        pos = np.searchsorted(self.tokens_, tokens)
        last = np.minimum(pos, self.tokens_.size - 1)
        seen = (pos < self.tokens_.size) & (self.tokens_[last] == tokens)
        return np.where(seen, self.occurrences_[last], 0).astype(np.float32)

    def _token_entries(self, tokens: np.ndarray):
        """(node, layer, expert, count) of the sparse table's entries for ``tokens``: each seen
        token's contiguous range of (layer, expert) counts."""
        L, E = self.n_layers_, self.n_experts_
        pos = np.searchsorted(self.tokens_, tokens)
        seen = (pos < self.tokens_.size) & (self.tokens_[np.minimum(pos, self.tokens_.size - 1)] == tokens)
        base = np.where(seen, pos, 0).astype(np.int64) * L * E
        lo = np.searchsorted(self.keys_, base)
        hi = np.where(seen, np.searchsorted(self.keys_, base + L * E), lo)
        counts = hi - lo
        owner = np.repeat(np.arange(tokens.size), counts)
        entry = np.repeat(lo - np.r_[0, np.cumsum(counts)[:-1]], counts) + np.arange(counts.sum())
        key = self.keys_[entry] - base[owner]
        return owner, key // E, key % E, self.counts_[entry]

    def token_shares(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(share float32 [n, L, E], occurrences float32 [n]): the share of each token's past
        routings that went to each expert (0 for an unseen token), and how often it was seen."""
        if getattr(self, "keys_", None) is None:
            raise SpecFitError("--predictor affinity: not fitted; fit it on a trace or update it with routed tokens first")
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        n_x = self._occurrences(tokens)
        owner, layer, expert, count = self._token_entries(tokens)
        share = np.zeros((tokens.size, self.n_layers_, self.n_experts_), dtype=np.float32)
        share[owner, layer, expert] = (count / np.maximum(n_x[owner], 1)).astype(np.float32)
        return share, n_x

    def to_dict(self) -> dict:
        return {"predictor": self.name, "params": self.get_params(), "popularity_": self.popularity_.tolist(),
                "tokens_": self.tokens_.tolist(), "occurrences_": self.occurrences_.tolist(),
                "keys_": self.keys_.tolist(), "counts_": self.counts_.tolist(),
                "n_layers_": self.n_layers_, "n_experts_": self.n_experts_}

    @classmethod
    def from_dict(cls, d: dict) -> "AffinityPredictor":
        p = cls(**d.get("params", {}))
        p.popularity_ = np.asarray(d["popularity_"])
        for name in ("tokens_", "occurrences_", "keys_", "counts_"):
            setattr(p, name, np.asarray(d[name], dtype=np.int64))
        p.n_layers_, p.n_experts_ = int(d["n_layers_"]), int(d["n_experts_"])
        return p
