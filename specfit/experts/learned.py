"""A small learned expert predictor: a logistic model of "node v routes to expert e at layer l" on
what either driver has at draft time, cut to the top-k per layer.

Features of a (node, layer, expert) triple:

- the share of the node's token's past routings that went to the expert at that layer, weighted by
  how often the token was seen (``n / (n + prior_strength)``), and the share alone;
- whether the most recent known routing (the token before the cycle's root) used the expert;
- the expert's log popularity at the layer;
- live, when the drafter's state lives in the target's space: the score of a linear probe from the
  drafter's output at the node's parent (the context its token was drafted from) to the layer's
  experts, fitted by ridge regression on the verified nodes' true experts (a replay has no drafter
  state: the feature is 0 and its weight stays 0).

The weights are one logistic regression over all layers (scikit-learn, L2), fitted on a trace's
nodes whose true experts are known (:meth:`LearnedPredictor.fit`) and refitted every
``refit_every`` updates on the nodes the live decoder verified (:meth:`LearnedPredictor.update`).
Before any fit it predicts like the affinity table it keeps. Scikit-learn shaped: hyper-parameters
in the constructor, ``coef_`` and the table learned, ``predict`` pure.
"""

from __future__ import annotations

import time

import numpy as np

from ..threads import one_blas_thread
from .predictor_base import ExpertPredictor, NodeBatch, selected_rows, trace_batch
from .affinity import AffinityPredictor
from ..errors import SpecFitError

__all__ = ["LearnedPredictor", "FEATURES"]

FEATURES = ("token_share_weighted", "token_share", "last_known", "log_popularity", "context_probe")
_PRIOR_COEF = np.array([4.0, 0.0, 1.0, 1.0, 0.0])   # before a fit: roughly the affinity blend


class LearnedPredictor(ExpertPredictor):
    """See the module docstring.

    Args:
        prior_strength: occurrences at which a token's own routing counts half.
        max_rows: (node, layer, expert) rows a fit uses at most (nodes are subsampled).
        l2: the L2 penalty of the logistic regression (scikit-learn's ``C = 1 / l2``).
        refit_every: live updates between refits.
        probe_ridge: the context probe's ridge penalty.
        sample: draw the k experts from the model's probabilities (Gumbel top-k) instead of taking
            the k most probable: siblings the model cannot tell apart then still differ.
    """

    name = "learned"

    def __init__(self, prior_strength: float = 1.0, max_rows: int = 1_000_000, l2: float = 1.0, refit_every: int = 64,
                 probe_ridge: float = 1.0, sample: bool = False, seed: int = 0, memory_nodes: int = 4096):
        if prior_strength < 0 or max_rows < 1 or l2 <= 0 or refit_every < 1 or probe_ridge <= 0 or memory_nodes < 1:
            raise ValueError("learned: expected prior_strength >= 0, l2 > 0, probe_ridge > 0 and positive max_rows, "
                             "refit_every, memory_nodes")
        self.prior_strength, self.max_rows, self.l2 = float(prior_strength), int(max_rows), float(l2)
        self.refit_every, self.probe_ridge, self.sample, self.seed = int(refit_every), float(probe_ridge), bool(sample), int(seed)
        self.memory_nodes = int(memory_nodes)
        self.table_ = AffinityPredictor(prior_strength=prior_strength, sample=False)
        self.coef_ = _PRIOR_COEF.copy()
        self.intercept_ = 0.0
        self.probe_: np.ndarray | None = None       # [H, L * E] drafter context -> expert scores
        self._updates = 0
        self._buffer: list[tuple] = []              # live: (tokens, last_known, experts, context) of verified nodes

    def get_params(self) -> dict:
        return {"prior_strength": self.prior_strength, "max_rows": self.max_rows, "l2": self.l2,
                "refit_every": self.refit_every, "probe_ridge": self.probe_ridge, "sample": self.sample,
                "seed": self.seed, "memory_nodes": self.memory_nodes}

    # ------------------------------------------------------------------ features
    def features(self, batch: NodeBatch, own: np.ndarray | None = None) -> np.ndarray:
        """float32 [n, L, E, len(FEATURES)]. ``own`` (bool [n, L, E], training only): each node's
        own routing, which the token table holds already; it leaves the node's token shares, as
        it is absent from them at prediction time (a token seen once would otherwise show its
        label as its share)."""
        if getattr(self.table_, "keys_", None) is None:
            raise SpecFitError("--predictor learned: not fitted; fit it on a trace or update it with routed tokens first")
        last = np.asarray(batch.last_known).astype(np.int64)
        n, L, _ = last.shape
        E = self.table_.n_experts_
        share, n_x = self.table_.token_shares(batch.tokens)
        if own is not None:
            others = np.maximum(n_x - 1, 0)
            share = ((share * n_x[:, None, None] - own) / np.maximum(others, 1)[:, None, None]).clip(0, 1)
            share = share.astype(np.float32)
            n_x = others.astype(np.float32)
        w = (n_x / (n_x + self.prior_strength) if self.prior_strength > 0 else (n_x > 0)).astype(np.float32)
        x = np.zeros((n, L, E, len(FEATURES)), dtype=np.float32)
        x[..., 0] = share * w[:, None, None]
        x[..., 1] = share
        known = last[:, 0, 0] >= 0
        node, layer, slot = np.nonzero(np.broadcast_to(known[:, None, None], last.shape))
        x[node, layer, last[node, layer, slot], 2] = 1.0
        x[..., 3] = np.log(self.table_.popularity_)[None].astype(np.float32)
        if self.probe_ is not None and batch.context is not None:
            context = _as_array(batch.context)
            if context.shape[-1] == self.probe_.shape[0]:
                # rows without a context (NaN: the root) score 0
                x[..., 4] = np.nan_to_num(context @ self.probe_).reshape(n, L, E)
        return x

    def _scores(self, batch: NodeBatch) -> np.ndarray:
        return self.features(batch) @ self.coef_.astype(np.float32) + np.float32(self.intercept_)

    # ------------------------------------------------------------------ fitting
    def fit(self, trace, cycles=None) -> "LearnedPredictor":
        """The token table, then the logistic weights, on the nodes of ``cycles`` whose true
        experts the trace knows."""
        self.table_ = AffinityPredictor(prior_strength=self.prior_strength, sample=False).fit(trace, cycles)
        cycles, rows = selected_rows(trace, cycles)
        batch = trace_batch(trace, cycles)
        keep = trace.true_known[rows]
        self._fit_rows(_take(batch, keep), trace.true_experts[rows][keep].astype(np.int64))
        return self

    def _fit_rows(self, batch: NodeBatch, true: np.ndarray) -> None:
        from sklearn.linear_model import LogisticRegression

        n, L, _ = true.shape
        E = self.table_.n_experts_
        if n == 0:
            return
        per_node = L * E
        take = np.arange(n)
        if n * per_node > self.max_rows:
            take = np.sort(np.random.default_rng(self.seed).choice(n, self.max_rows // per_node, replace=False))
        batch, true = _take(batch, take), true[take]
        y = np.zeros((take.size, L, E), dtype=bool)
        layer = np.broadcast_to(np.arange(L)[None, :, None], true.shape)
        y[np.broadcast_to(np.arange(take.size)[:, None, None], true.shape), layer, true] = True
        x = self.features(batch, own=y).reshape(-1, len(FEATURES))
        y = y.ravel()
        if y.all() or not y.any():
            return
        used = x.std(axis=0) > 0                      # a constant feature (no probe in a replay) keeps weight 0
        model = LogisticRegression(C=1.0 / self.l2, max_iter=200)
        with one_blas_thread():             # the same weights on any machine
            model.fit(x[:, used], y)
        coef = np.zeros(len(FEATURES))
        coef[used] = model.coef_[0]
        self.coef_, self.intercept_ = coef, float(model.intercept_[0])

    def update(self, tokens: np.ndarray, experts: np.ndarray, n_experts: int, last_known: np.ndarray | None = None,
               context=None) -> None:
        """Learn the verified nodes' routing: the token table at once, the weights (and the probe,
        given the drafter contexts) every ``refit_every`` updates on the latest nodes."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        experts = np.asarray(experts, dtype=np.int64)
        if last_known is None:
            last_known = np.full(experts.shape, -1, dtype=np.int64)
        self._buffer.append((tokens, np.asarray(last_known), experts, None if context is None else _as_array(context)))
        while sum(b[0].size for b in self._buffer) > self.memory_nodes and len(self._buffer) > 1:
            self._buffer.pop(0)
        self.table_.update(tokens, experts, n_experts)
        self._updates += 1
        self.refit_s = 0.0
        if self._updates % self.refit_every == 0:
            started = time.perf_counter()
            self._refit_from_buffer()
            self.refit_s = time.perf_counter() - started

    def _refit_from_buffer(self) -> None:
        tokens = np.concatenate([b[0] for b in self._buffer])
        last = np.concatenate([b[1] for b in self._buffer])
        true = np.concatenate([b[2] for b in self._buffer])
        contexts = [b[3] for b in self._buffer]
        width = {c.shape[1] for c in contexts if c is not None}
        context = None
        if len(width) == 1:
            # entries without one (the prompt's pass) get NaN rows: they leave the probe's fit
            h = width.pop()
            context = np.concatenate([np.full((b[0].size, h), np.nan, dtype=np.float32) if b[3] is None else b[3]
                                      for b in self._buffer])
            known = np.isfinite(context).all(axis=1)
            if known.sum() > 1:
                self.probe_ = _ridge_probe(context[known], true[known], self.table_.n_experts_, self.probe_ridge)
        self._fit_rows(NodeBatch(tokens=tokens, last_known=last, context=context), true)

    # ------------------------------------------------------------------ prediction
    def predict(self, batch: NodeBatch) -> np.ndarray:
        k = np.asarray(batch.last_known).shape[2]
        scores = self._scores(batch)
        if self.sample:
            u = np.random.default_rng(self.seed).random(scores.shape, dtype=np.float32)
            # Gumbel top-k of the log-probabilities: log sigmoid(s) + Gumbel noise
            scores = -np.logaddexp(0, -scores) - np.log(-np.log(np.maximum(u, np.float32(1e-12))))
        return np.argpartition(-scores, k - 1, axis=2)[:, :, :k].astype(np.int16)

    def to_dict(self) -> dict:
        return {"predictor": self.name, "params": self.get_params(), "coef_": self.coef_.tolist(),
                "intercept_": self.intercept_, "table_": self.table_.to_dict(),
                "probe_": None if self.probe_ is None else self.probe_.tolist()}

    @classmethod
    def from_dict(cls, d: dict) -> "LearnedPredictor":
        p = cls(**d.get("params", {}))
        p.coef_, p.intercept_ = np.asarray(d["coef_"], dtype=np.float64), float(d["intercept_"])
        p.table_ = AffinityPredictor.from_dict(d["table_"])
        p.probe_ = None if d.get("probe_") is None else np.asarray(d["probe_"], dtype=np.float32)
        return p


def _as_array(context) -> np.ndarray:
    if hasattr(context, "detach"):
        context = context.detach().float().cpu().numpy()
    return np.asarray(context, dtype=np.float32)


def _take(batch: NodeBatch, rows) -> NodeBatch:
    pick = (lambda a: None if a is None else a[rows])
    return NodeBatch(tokens=np.asarray(batch.tokens)[rows], last_known=np.asarray(batch.last_known)[rows],
                     context=None if batch.context is None else _as_array(batch.context)[rows],
                     true_experts=pick(batch.true_experts), recorded=pick(batch.recorded))


def _ridge_probe(context: np.ndarray, true: np.ndarray, n_experts: int, ridge: float) -> np.ndarray:
    """[H, L * E]: ridge regression of the one-hot true experts on the (centred-free) contexts."""
    n, L, _ = true.shape
    y = np.zeros((n, L, n_experts), dtype=np.float32)
    layer = np.broadcast_to(np.arange(L)[None, :, None], true.shape)
    y[np.broadcast_to(np.arange(n)[:, None, None], true.shape), layer, true] = 1.0
    y = y.reshape(n, -1) - y.reshape(n, -1).mean(axis=0)
    with one_blas_thread():
        gram = context.T @ context + ridge * np.eye(context.shape[1], dtype=np.float32)
        return np.linalg.solve(gram, context.T @ y).astype(np.float32)
