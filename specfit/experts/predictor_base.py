"""The interface every expert predictor implements, and the one question both drivers ask it
(:class:`NodeBatch`); see :mod:`specfit.experts.predictors` for the predictors themselves."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

__all__ = ["NodeBatch", "ExpertPredictor", "last_known_experts", "trace_batch", "selected_rows"]


@dataclass
class NodeBatch:
    """The draft nodes a predictor is asked about, as either driver has them.

    Attributes:
        tokens: int [n] each node's token.
        last_known: int [n, L, k] the most recent routing the target has revealed before each
            node's cycle (the token before the root), -1 where none is known.
        context: [n, H] torch tensor or None: the drafter's output at each node's parent (live,
            when the drafter works in the target's hidden space).
        true_experts, recorded: what a trace knows (replay only): the nodes' true experts, and the
            predictions recorded live.
    """

    tokens: np.ndarray
    last_known: np.ndarray
    context: object | None = None
    true_experts: np.ndarray | None = None
    recorded: np.ndarray | None = None

    def __len__(self) -> int:
        return int(np.asarray(self.tokens).size)


def last_known_experts(trace) -> np.ndarray:
    """[cycles, layers, top_k] the routing of the token before each cycle's root, -1 where none
    is known (a sequence's first position, or a previous root without true experts)."""
    out = np.full((trace.n_cycles, trace.n_layers, trace.top_k), -1, dtype=np.int16)
    roots = trace.offsets[:-1]
    follows = np.r_[False, (trace.sequence[1:] == trace.sequence[:-1]) & (trace.position[1:] == trace.position[:-1] + 1)]
    c = np.flatnonzero(follows)
    out[c] = trace.true_experts[roots[c - 1]]
    return out


def trace_batch(trace, cycles=None) -> NodeBatch:
    """The nodes of ``cycles`` (None: all) of ``trace`` as a :class:`NodeBatch`."""
    cycles, rows = selected_rows(trace, cycles)
    sizes = trace.offsets[cycles + 1] - trace.offsets[cycles]
    return NodeBatch(tokens=trace.token[rows], last_known=np.repeat(last_known_experts(trace)[cycles], sizes, axis=0),
                     true_experts=trace.true_experts[rows] if trace.true_known[rows].all() else None,
                     recorded=None if trace.predicted_experts is None else trace.predicted_experts[rows])


def selected_rows(trace, cycles) -> tuple[np.ndarray, np.ndarray]:
    """(cycles, node rows of those cycles) for ``cycles`` (None: all)."""
    cycles = np.arange(trace.n_cycles) if cycles is None else np.asarray(cycles, dtype=np.int64)
    sizes = trace.offsets[cycles + 1] - trace.offsets[cycles]
    rows = np.repeat(trace.offsets[cycles] - np.r_[0, np.cumsum(sizes)[:-1]], sizes) + np.arange(sizes.sum())
    return cycles, rows


class ExpertPredictor(ABC):
    """Base class: ``fit`` and ``update`` do nothing, ``predict`` is each predictor's own.

    ``needs_truth``: it reads what only a recorded trace knows (replay only).
    """

    name = "predictor"
    needs_truth = False
    # whether :meth:`update` can still change what it predicts (a driver skips gathering what it
    # would hand an update otherwise)
    learning = True
    # seconds of the refit the last :meth:`update` ran (0.0: none): a step of one cycle in many,
    # which the live decoder's online cost model leaves out of what it learns a cycle costs
    refit_s = 0.0

    def fit(self, trace, cycles=None) -> "ExpertPredictor":
        return self

    def update(self, tokens: np.ndarray, experts: np.ndarray, n_experts: int, last_known: np.ndarray | None = None,
               context=None) -> None:
        """Learn from nodes the target has just run: ``tokens`` [m] routed to ``experts`` [m, L, k]
        (ids below ``n_experts``); ``last_known`` [m, L, k] and ``context`` [m, H] are what the
        nodes' :class:`NodeBatch` held when they were predicted (rows of NaN: no context)."""

    @abstractmethod
    def predict(self, batch: NodeBatch) -> np.ndarray:
        """int [nodes of ``batch``, layers, top_k] predicted experts."""

    def predict_trace(self, trace, cycles=None) -> np.ndarray:
        """:meth:`predict` for every node of ``cycles`` (None: all) of ``trace``."""
        return self.predict(trace_batch(trace, cycles))

    def get_params(self) -> dict:
        return {}

    def to_dict(self) -> dict:
        return {"predictor": self.name, "params": self.get_params()}

    @classmethod
    def from_dict(cls, d: dict) -> "ExpertPredictor":
        """The predictor of :meth:`to_dict`'s output (``specfit.experts.predictors.predictor_from_dict``
        picks the class by name)."""
        return cls(**d.get("params", {}))


