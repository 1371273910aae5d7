"""Acceptance calibration: from the drafter's probabilities to the probability that the target
accepts.

The throughput a policy predicts is ``A(S) / T(S)``; the cost model predicts ``T`` and the draft
tree's path probabilities predict ``A``. Drafters are rarely calibrated (EAGLE heads tend to be
over-confident), so :class:`AcceptanceCalibrator` learns a monotone map from a node's draft
probability ``q = exp(draft_logprob)`` to the probability that the node equals the target's
verdict at its parent, by isotonic regression on the traced nodes whose parent's verdict is
known. Calibrated path probabilities are the products of calibrated edge probabilities along each
path (so they stay non-increasing along paths, as a :class:`~specfit.tree.DraftTree` requires).
"""

from __future__ import annotations

import numpy as np
from sklearn.isotonic import IsotonicRegression

__all__ = ["AcceptanceCalibrator", "edge_outcomes", "cross_calibrate"]


def edge_outcomes(trace, cycles=None) -> tuple[np.ndarray, np.ndarray]:
    """(draft probability, accepted 0/1) of every non-root node of ``cycles`` whose parent's
    verdict is known."""
    parent_row = trace.parent_rows
    mask = parent_row >= 0
    if cycles is not None:
        mask &= np.isin(trace.cycle_of_node, np.asarray(cycles))
    mask[mask] = trace.verdict[parent_row[mask]] >= 0
    q = np.exp(trace.draft_logprob[mask].astype(np.float64))
    return q, (trace.token[mask] == trace.verdict[parent_row[mask]]).astype(np.float64)


class AcceptanceCalibrator:
    """Isotonic map from draft probability to acceptance probability (scikit-learn shaped)."""

    def __init__(self, min_prob: float = 1e-4):
        self.min_prob = float(min_prob)

    def fit(self, trace, cycles=None) -> "AcceptanceCalibrator":
        q, accepted = edge_outcomes(trace, cycles)
        iso = IsotonicRegression(y_min=self.min_prob, y_max=1.0, increasing=True, out_of_bounds="clip")
        iso.fit(np.r_[0.0, q, 1.0], np.r_[0.0, accepted, 1.0])   # anchor the ends: q=0 never, q=1 always
        self.x_, self.y_ = iso.X_thresholds_.copy(), np.clip(iso.y_thresholds_, self.min_prob, 1.0)
        # held-out quality is measured by the caller on other cycles; the fit's own Brier score:
        self.brier_ = float(np.mean((self.predict_edge(q) - accepted) ** 2)) if q.size else float("nan")
        self.n_edges_ = int(q.size)
        return self

    def predict_edge(self, draft_prob: np.ndarray) -> np.ndarray:
        """Acceptance probability of nodes with draft probability ``draft_prob``."""
        return np.interp(np.asarray(draft_prob, dtype=np.float64), self.x_, self.y_)

    def path_probs(self, trace) -> np.ndarray:
        """[nodes] calibrated path probabilities of every node of ``trace`` (root: 1)."""
        edge = self.predict_edge(np.exp(trace.draft_logprob.astype(np.float64)))
        root = trace.parent < 0
        edge[root] = 1.0
        parent_row = np.where(root, np.arange(trace.n_nodes), trace.parent_rows)
        out = edge.copy()
        # parents precede children: one pass per level turns edge probabilities into path products
        for _ in range(int(trace.depth.max(initial=0))):
            out = np.where(root, 1.0, edge * out[parent_row])
        return out

    def to_dict(self) -> dict:
        return {"calibrator": "isotonic", "min_prob": self.min_prob, "x_": self.x_.tolist(), "y_": self.y_.tolist(),
                "brier_": self.brier_, "n_edges_": self.n_edges_}

    @classmethod
    def from_dict(cls, d: dict) -> "AcceptanceCalibrator":
        c = cls(min_prob=d.get("min_prob", 1e-4))
        c.x_, c.y_ = np.asarray(d["x_"]), np.asarray(d["y_"])
        c.brier_, c.n_edges_ = float(d.get("brier_", np.nan)), int(d.get("n_edges_", 0))
        return c


def cross_calibrate(trace, n_folds: int = 2) -> np.ndarray:
    """[nodes] calibrated path probabilities, each fold of cycles calibrated by a map fitted on
    the other folds."""
    from .predictors import cycle_folds

    fold = cycle_folds(trace, n_folds)
    out = np.ones(trace.n_nodes)
    fold_of_node = fold[trace.cycle_of_node]
    for f in range(n_folds):
        train = np.flatnonzero(fold != f)
        if not (fold == f).any():
            continue
        probs = AcceptanceCalibrator().fit(trace, train if train.size else np.flatnonzero(fold == f)).path_probs(trace)
        out[fold_of_node == f] = probs[fold_of_node == f]
    return out
