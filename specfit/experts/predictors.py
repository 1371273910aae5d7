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
- ``noisy:P``: the true experts with each slot wrong with probability ``1 - P`` (replay only): how
  good a predictor must be for a policy to keep what it gains with true experts;
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

from .. import kernels
from ..errors import SpecFitError
from .affinity import AffinityPredictor, popularity
from .predictor_base import ExpertPredictor, NodeBatch, last_known_experts, selected_rows as _selected_rows, trace_batch

__all__ = ["NodeBatch", "ExpertPredictor", "OraclePredictor", "NoisyOraclePredictor", "RecordedPredictor",
           "ParentPredictor", "AffinityPredictor", "make_predictor", "parse_predictor", "predictor_from_dict",
           "PREDICTORS", "LIVE_PREDICTORS", "last_known_experts", "trace_batch", "cross_predict", "union_quality",
           "slots_right"]


class OraclePredictor(ExpertPredictor):
    """The true experts (needs a trace that knows them for every node)."""

    name = "oracle"
    needs_truth = True
    _UNKNOWN = "--predictor oracle: the trace does not know every node's true experts"

    def predict(self, batch: NodeBatch) -> np.ndarray:
        if batch.true_experts is None:
            raise SpecFitError(self._UNKNOWN)
        return batch.true_experts

    def predict_trace(self, trace, cycles=None) -> np.ndarray:
        if cycles is not None:
            return super().predict_trace(trace, cycles)
        # the whole trace's own array, without a batch's copies: the replay recognises it and
        # skips a second union
        if not trace.true_known.all():
            raise SpecFitError(self._UNKNOWN)
        return trace.true_experts


class NoisyOraclePredictor(ExpertPredictor):
    """The true experts with each (layer, slot) wrong with probability ``1 - precision``: a wrong
    slot names an expert the node does not route to at that layer, drawn uniformly and distinct
    from the node's other picks there. A what-if for replay (``--predictor noisy:0.8``): the slot
    precision a real predictor would need. Its errors are spread uniformly; a real predictor's
    lean towards popular experts, so it overlaps its own picks more than this one does. Where a
    layer has fewer than ``k`` experts besides a node's ``k``, only that many of its slots can be
    wrong.

    ``predict`` is pure: the same batch with the same ``seed`` gets the same picks."""

    name = "noisy"
    needs_truth = True
    _CHUNK = 4096            # nodes per draw: keeps the [nodes, layers, experts] keys small

    def __init__(self, precision: float = 0.8, seed: int = 0):
        self.precision, self.seed = _slot_precision(precision, "--predictor noisy"), int(seed)

    def get_params(self) -> dict:
        return {"precision": self.precision, "seed": self.seed}

    def fit(self, trace, cycles=None) -> "NoisyOraclePredictor":
        self.n_experts_ = int(trace.n_experts)      # what a wrong slot is drawn from
        return self

    def predict_trace(self, trace, cycles=None) -> np.ndarray:
        return self.fit(trace).predict(trace_batch(trace, cycles))

    def predict(self, batch: NodeBatch) -> np.ndarray:
        true = batch.true_experts
        if true is None or (np.asarray(true) < 0).any():
            raise SpecFitError("--predictor noisy: the trace does not know every node's true experts")
        if getattr(self, "n_experts_", None) is None:
            raise SpecFitError("--predictor noisy: fit it on a trace first (it draws wrong experts among the trace's)")
        true = np.asarray(true)
        n, n_layers, k = true.shape
        n_experts = self.n_experts_
        rng = np.random.default_rng(self.seed)
        out = true.copy()
        spare = min(k, n_experts - k)     # experts outside a node's k at a layer: at most that many can be wrong
        if spare <= 0 or self.precision >= 1.0:
            return out
        for lo in range(0, n, self._CHUNK):
            part = true[lo:lo + self._CHUNK]
            keys = rng.random((part.shape[0], n_layers, n_experts))
            np.put_along_axis(keys, part.astype(np.int64), 2.0, axis=2)        # never draw a true expert
            others = np.argsort(keys, axis=2)[:, :, :spare]
            wrong = rng.random(part.shape) >= self.precision
            out[lo:lo + self._CHUNK, :, :spare] = np.where(wrong[:, :, :spare], others, part[:, :, :spare])
        return out


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
        self.popularity_ = popularity(trace, cycles)
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


def _learned(**params) -> ExpertPredictor:
    from .learned import LearnedPredictor

    return LearnedPredictor(**params)


def _router(**params) -> ExpertPredictor:
    from .router import RouterPredictor

    if "model" not in params and "embed" not in params:
        raise SpecFitError("--predictor router: needs the target's weights (pass --model DIR)")
    return RouterPredictor(**params)


PREDICTORS = {"oracle": OraclePredictor, "noisy": NoisyOraclePredictor, "recorded": RecordedPredictor,
              "parent": ParentPredictor, "affinity": AffinityPredictor, "learned": _learned, "router": _router}
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


def parse_predictor(spec: str, where: str = "--predictor") -> tuple[str, dict]:
    """``(name, params)`` of a predictor spec: a name of :data:`PREDICTORS`, or ``noisy:P`` with a
    slot precision P in [0, 1]. ``where`` names the option or field in the error."""
    name, colon, arg = str(spec).partition(":")
    if name not in PREDICTORS:
        raise SpecFitError(f"{where}: unknown predictor {spec!r}; expected one of {sorted(PREDICTORS)} "
                           "(noisy as noisy:P)")
    if not colon:
        return name, {}
    if name != "noisy":
        raise SpecFitError(f"{where}: {name} takes no argument, got {spec!r}")
    return name, {"precision": _slot_precision(arg, where, spec)}


def _slot_precision(value, where: str, spec=None) -> float:
    """``value`` as a slot precision in [0, 1], or one error naming ``where`` (and the spec it came in)."""
    try:
        precision = float(value)
    except (TypeError, ValueError):
        precision = float("nan")
    if not 0.0 <= precision <= 1.0:
        got = spec if spec is not None else value
        raise SpecFitError(f"{where}: expected noisy:P with a slot precision P in [0, 1], got {got!r}")
    return precision


def make_predictor(spec: str, **params) -> ExpertPredictor:
    """The predictor of ``spec`` (:func:`parse_predictor`); ``params`` override the spec's."""
    name, spec_params = parse_predictor(spec)
    return PREDICTORS[name](**{**spec_params, **params})


def cross_predict(name: str, trace, n_folds: int = 2, **params) -> np.ndarray:
    """Predictions for every node of ``trace``, each fold of cycles predicted by a predictor
    fitted on the other folds (so a fitted predictor never sees the experts it predicts).
    Folds are whole sequences dealt in turn (:func:`cycle_folds`)."""
    predictor = make_predictor(name, **params)
    if predictor.needs_truth or predictor.name == "router":    # nothing fitted on the trace: no fold can leak
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
    """[cycles] fold index: whole sequences dealt to the folds in turn (sequence i to fold i mod
    ``n_folds``), or contiguous blocks of cycles for fewer sequences than folds.

    A trace is often recorded prompt set by prompt set (the bundled prompts are four ``docs``, then
    four ``math``), so contiguous blocks of sequences would fit every fold on another workload than
    the one it is scored on: on ``specfit demo``'s trace that cross-fit put the calibrated acceptance
    of EAGLE-3's trees far below the tokens committed; dealt in turn, close to them
    (``benchmarks/RESULTS.md``, "Stop 32: cross-fitting folds that hold every workload"). With as
    many sequences as folds or more, a sequence stays whole in one fold, so nothing of a scored
    sequence is ever fitted on; with fewer, the blocks split a sequence, and part of it is fitted on
    for its other part."""
    seqs, seq_index = np.unique(trace.sequence, return_inverse=True)
    if seqs.size >= n_folds:
        return seq_index % n_folds
    return (np.arange(trace.n_cycles) * n_folds) // trace.n_cycles


def slots_right(predicted: np.ndarray, true: np.ndarray) -> int:
    """How many predicted ``[nodes, layers, k]`` (layer, expert) slots name an expert the node
    really routes to at that layer: the numerator of the slot precision that prices prediction
    uncertainty (:func:`specfit.search.uncertainty_price_s`), live and in the simulator."""
    return int(kernels.bitsets.slots_right(np.ascontiguousarray(predicted, dtype=np.int64),
                                           np.ascontiguousarray(true, dtype=np.int64)))


def union_quality(predicted: np.ndarray, true: np.ndarray, n_experts: int) -> tuple[int, int, int]:
    """(|predicted union|, |true union|, |both|) of a node set's experts, summed over layers."""
    L = true.shape[1]
    p = np.zeros((L, n_experts), dtype=bool)
    t = np.zeros((L, n_experts), dtype=bool)
    layer = np.broadcast_to(np.arange(L)[None, :, None], true.shape)
    p[layer.ravel(), predicted.astype(np.int64).ravel()] = True
    t[layer.ravel(), true.astype(np.int64).ravel()] = True
    return int(p.sum()), int(t.sum()), int((p & t).sum())
