"""Expert predictors: which experts a draft node will route to, before the target has run it.

The cost of verifying a subtree depends on the experts of tokens the target has not processed
yet, so policies decide with *predicted* experts. Both drivers ask a predictor the same question
with :meth:`ExpertPredictor.predict` on a :class:`NodeBatch` (the nodes' tokens, the most recent
routing known, and, live, the drafter's state): the simulator once for every node of a trace, the
live decoder once per drafted level. Predictors are scikit-learn shaped: hyper-parameters in the
constructor, ``fit(trace, cycles)`` learns attributes ending in ``_`` from the nodes whose true
experts a trace knows, ``update(tokens, experts)`` learns from nodes the target has just verified
(the live decoder calls it every cycle), ``predict`` returns ``int [nodes, layers, top_k]`` and is
pure, ``to_dict()`` / ``from_dict()`` round-trip through JSON.

At draft time the target has processed every committed token except the root (the previous
cycle's bonus token), so the most recent routing known is the token before the root: in a
position-indexed trace the root of the previous position (:func:`last_known_experts`), live the
last token the previous cycle committed before its bonus.

- ``oracle``: the true experts (isolates search quality from prediction quality);
- ``recorded``: the predictions stored in the trace by the live recorder;
- ``parent``: every node gets the most recent known routing (temporal locality); siblings get
  identical predictions, which makes extra nodes look free;
- ``affinity``: a token -> experts frequency table fitted from traces, blended with the most
  recent known routing and the layer's popularity for tokens seen rarely or never;
- ``learned`` (:class:`specfit.experts.learned.LearnedPredictor`): a logistic model on the token
  table, the most recent known routing, popularity and (live) a probe of the drafter's state;
- ``router`` (:class:`specfit.experts.router.RouterPredictor`): the target's own routers applied to
  an estimate of the node's hidden state (needs the target's weights).
"""

from __future__ import annotations

import numpy as np

from ..errors import SpecFitError
from .predictor_base import ExpertPredictor, NodeBatch, last_known_experts, selected_rows as _selected_rows, trace_batch

__all__ = ["NodeBatch", "ExpertPredictor", "OraclePredictor", "RecordedPredictor", "ParentPredictor",
           "AffinityPredictor", "make_predictor", "predictor_from_dict", "PREDICTORS", "LIVE_PREDICTORS", "last_known_experts", "trace_batch",
           "cross_predict", "union_quality", "slots_right"]


class OraclePredictor(ExpertPredictor):
    """The true experts (needs a trace that knows them for every node)."""

    name = "oracle"
    needs_truth = True

    def predict(self, batch: NodeBatch) -> np.ndarray:
        if batch.true_experts is None:
            raise SpecFitError("--predictor oracle: the trace does not know every node's true experts")
        return batch.true_experts

    def predict_trace(self, trace, cycles=None) -> np.ndarray:
        out = super().predict_trace(trace, cycles)
        # the whole trace's own array: the replay recognises it and skips a second union
        return trace.true_experts if cycles is None else out


class RecordedPredictor(ExpertPredictor):
    """The predictions the live recorder stored in the trace."""

    name = "recorded"
    needs_truth = True

    def predict(self, batch: NodeBatch) -> np.ndarray:
        if batch.recorded is None or (batch.recorded[:, 0, 0] < 0).any():
            raise SpecFitError("--predictor recorded: the trace has no recorded predictions for every node")
        return batch.recorded


class ParentPredictor(ExpertPredictor):
    """Every node routes like the most recent token whose routing is known (the nearest ancestor
    the target has processed); the layer's most popular experts where none is known."""

    name = "parent"

    def fit(self, trace, cycles=None) -> "ParentPredictor":
        self.popularity_ = _popularity(trace, cycles)
        return self

    def predict(self, batch: NodeBatch) -> np.ndarray:
        last = np.asarray(batch.last_known)
        if getattr(self, "popularity_", None) is None:
            # not fitted (live): nothing to fall back on where no routing is known yet
            return np.where(last >= 0, last, np.arange(last.shape[2])[None, None, :]).astype(np.int16)
        fallback = np.argsort(-self.popularity_, axis=1, kind="stable")[:, : last.shape[2]].astype(np.int16)
        return np.where(last[:, :1, :1] >= 0, last, fallback[None]).astype(np.int16)

    def to_dict(self) -> dict:
        return {"predictor": self.name, "params": {}, "popularity_": self.popularity_.tolist()}

    @classmethod
    def from_dict(cls, d: dict) -> "ParentPredictor":
        p = cls()
        p.popularity_ = np.asarray(d["popularity_"])
        return p


def _popularity(trace, cycles) -> np.ndarray:
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
        self.popularity_ = _popularity(trace, cycles)
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


def _learned(**params) -> ExpertPredictor:
    from .learned import LearnedPredictor

    return LearnedPredictor(**params)


def _router(**params) -> ExpertPredictor:
    from .router import RouterPredictor

    if "model" not in params and "embed" not in params:
        raise SpecFitError("--predictor router: needs the target's weights (pass --model DIR)")
    return RouterPredictor(**params)


PREDICTORS = {"oracle": OraclePredictor, "recorded": RecordedPredictor, "parent": ParentPredictor,
              "affinity": AffinityPredictor, "learned": _learned, "router": _router}
# what the live decoder can run: the others read what only a recorded trace knows
LIVE_PREDICTORS = ("router", "affinity", "parent", "learned")


def predictor_from_dict(d: dict) -> ExpertPredictor:
    """A predictor from :meth:`ExpertPredictor.to_dict`'s JSON, of the class its name says."""
    name = d.get("predictor")
    if name not in PREDICTORS or name == "router":
        raise SpecFitError(f"predictor: unknown or unserialisable predictor {name!r}")
    if name == "learned":
        from .learned import LearnedPredictor

        return LearnedPredictor.from_dict(d)
    return PREDICTORS[name].from_dict(d)


def make_predictor(name: str, **params) -> ExpertPredictor:
    if name not in PREDICTORS:
        raise SpecFitError(f"--predictor: unknown predictor {name!r}; expected one of {sorted(PREDICTORS)}")
    return PREDICTORS[name](**params)


def cross_predict(name: str, trace, n_folds: int = 2, **params) -> np.ndarray:
    """Predictions for every node of ``trace``, each fold of cycles predicted by a predictor
    fitted on the other folds (so a fitted predictor never sees the experts it predicts).
    Folds are contiguous blocks of sequences (of positions when there is one sequence)."""
    predictor = make_predictor(name, **params)
    if name in ("oracle", "recorded", "router"):    # nothing fitted on the trace: no fold can leak
        return predictor.predict_trace(trace)
    fold = cycle_folds(trace, n_folds)
    out = np.empty_like(trace.true_experts)
    for f in range(n_folds):
        test = np.flatnonzero(fold == f)
        train = np.flatnonzero(fold != f)
        if test.size == 0:
            continue
        _, rows = _selected_rows(trace, test)
        out[rows] = make_predictor(name, **params).fit(trace, train if train.size else test).predict_trace(trace, test)
    return out


def cycle_folds(trace, n_folds: int) -> np.ndarray:
    """[cycles] fold index: contiguous blocks of sequences, or of cycles for a single sequence."""
    seqs, seq_index = np.unique(trace.sequence, return_inverse=True)
    if seqs.size >= n_folds:
        return (seq_index * n_folds) // seqs.size
    return (np.arange(trace.n_cycles) * n_folds) // trace.n_cycles


def slots_right(predicted: np.ndarray, true: np.ndarray) -> int:
    """How many predicted ``[nodes, layers, k]`` (layer, expert) slots name an expert the node
    really routes to at that layer: the numerator of the slot precision that prices prediction
    uncertainty (:func:`specfit.search.uncertainty_price_s`), live and in the simulator."""
    return int((predicted[..., :, None] == true[..., None, :]).any(axis=-1).sum())


def union_quality(predicted: np.ndarray, true: np.ndarray, n_experts: int) -> tuple[int, int, int]:
    """(|predicted union|, |true union|, |both|) of a node set's experts, summed over layers."""
    L = true.shape[1]
    p = np.zeros((L, n_experts), dtype=bool)
    t = np.zeros((L, n_experts), dtype=bool)
    layer = np.broadcast_to(np.arange(L)[None, :, None], true.shape)
    p[layer.ravel(), predicted.astype(np.int64).ravel()] = True
    t[layer.ravel(), true.astype(np.int64).ravel()] = True
    return int(p.sum()), int(t.sum()), int((p & t).sum())
