"""Acceptance calibration: from the drafter's probabilities to the probability that the target
accepts.

The throughput a policy predicts is ``A(S) / T(S)``; the cost model predicts ``T`` and the draft
tree's path probabilities predict ``A``: a subtree's expected tokens are 1 + the sum of its nodes'
probabilities of lying on the accepted path. Drafters are rarely calibrated (EAGLE heads tend to
be over-confident), so :class:`AcceptanceCalibrator` learns, on a trace's verified nodes:

1. **an edge map**: a monotone (isotonic) map from a node's draft probability
   ``q = exp(draft_logprob)`` to the probability that its token is the target's verdict at its
   parent, *given that the parent is accepted* (the parent lies on the accepted path; the root
   always does). The product of such conditional probabilities along a path is the chain rule
   for the path's acceptance. Fitted on every edge whose parent was verified instead, the map
   also learns from children of rejected parents (whose verdict continues a context the target
   never keeps) and over-predicts the accepted tokens on the shipped OLMoE and Qwen3 traces
   (``benchmarks/bench_acceptance.py``; ``benchmarks/RESULTS.md``, "Stop 24: acceptance calibrated
   where it is used");
2. **the drafter's confidence at the parent**: a logistic refinement of the edge map on the
   largest draft probability among the node's siblings ``q1`` (itself included) and whether the
   node is that top child: ``logit P = w . [1, logit iso(q), top, (1 - top) logit q1]``.
   A runner-up whose parent's top child has ``q1 = 0.999`` is almost never the verdict, one of a
   parent with ``q1 = 0.4`` often is; the isotonic map of ``q`` alone gives both the same
   probability. On the bundled drafter's trees it lowers the Brier score of the path
   probabilities (the same section);
3. **a depth correction** of the product: ``P = sigmoid(a + (b + e d) logit(prod) + c d)``, a
   logistic fit of "the node is on the accepted path" on the product and the node's depth ``d``,
   with ``b + e d > 0`` at every depth it fitted (monotone in the product). The product treats a
   path's edges as independent given their own ``q``; a drafter that drifts from the target's
   features with depth (EAGLE-3 drafts level ``d`` from its own level ``d - 1``) is wrong more
   often deep down at the same ``q``: on the bundled drafter's trees the product alone predicts
   far more accepted nodes at the deepest levels than were accepted (``benchmarks/RESULTS.md``,
   "Stop 23: the acceptance calibration per depth").

Path probabilities are then kept non-increasing along every path (each node at most its
parent's), as a :class:`~specfit.tree.DraftTree` requires.
"""

from __future__ import annotations

import numpy as np

from .. import kernels

__all__ = ["AcceptanceCalibrator", "accepted_nodes", "edge_mask", "edge_outcomes", "edge_probs", "cross_calibrate"]

_EMPTY = np.zeros(0)


def _floats(x) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float64).reshape(-1)


def accepted_nodes(trace) -> np.ndarray:
    """bool [nodes]: the node lies on its cycle's accepted path (greedy verdicts; the root always).
    A node below an unverified parent is never on it."""
    offsets = np.ascontiguousarray(trace.offsets, dtype=np.int64)
    path_offsets, paths = kernels.replay.accepted_paths(
        offsets, np.ascontiguousarray(trace.parent, dtype=np.int16), np.ascontiguousarray(trace.depth, dtype=np.int16),
        np.ascontiguousarray(trace.token, dtype=np.int32), np.ascontiguousarray(trace.verdict, dtype=np.int32))
    out = np.zeros(trace.n_nodes, dtype=bool)
    out[paths + np.repeat(offsets[:-1], np.diff(path_offsets))] = True
    return out


def _known(trace, cycles=None) -> np.ndarray:
    """bool [nodes]: non-root nodes whose parent has a verdict (so whether they are accepted is
    known), in ``cycles`` when given."""
    parent_row = trace.parent_rows
    mask = parent_row >= 0
    if cycles is not None:
        mask &= np.isin(trace.cycle_of_node, np.asarray(cycles))
    mask[mask] = trace.verdict[parent_row[mask]] >= 0
    return mask


def edge_probs(trace) -> tuple[np.ndarray, np.ndarray]:
    """(q, q1) per node: its draft probability given the parent, and the largest among its
    siblings (itself included; the root: 1, 1)."""
    q = np.exp(trace.draft_logprob.astype(np.float64))
    root = trace.parent < 0
    parent_row = np.where(root, np.arange(trace.n_nodes), trace.parent_rows)
    top = np.zeros(trace.n_nodes)
    np.maximum.at(top, parent_row[~root], q[~root])
    q[root] = 1.0
    return q, np.where(root, 1.0, top[parent_row])


def edge_mask(trace, cycles=None, given_parent_accepted: bool = True, accepted=None) -> np.ndarray:
    """bool [nodes]: the edges :func:`edge_outcomes` scores (non-root nodes of ``cycles`` whose
    parent has a verdict; with ``given_parent_accepted`` only those whose parent lies on the
    accepted path). ``accepted``: the trace's :func:`accepted_nodes`, when the caller has them."""
    mask = _known(trace, cycles)
    if given_parent_accepted:
        on_path = accepted_nodes(trace) if accepted is None else accepted
        mask &= on_path[np.maximum(trace.parent_rows, 0)]
    return mask


def edge_outcomes(trace, cycles=None, given_parent_accepted: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(draft probability, accepted 0/1) of the edges of :func:`edge_mask`: accepted when the
    node's token is the target's verdict at its parent. ``given_parent_accepted`` keeps only the
    outcomes the chain rule multiplies."""
    mask = edge_mask(trace, cycles, given_parent_accepted)
    q = np.exp(trace.draft_logprob[mask].astype(np.float64))
    return q, (trace.token[mask] == trace.verdict[trace.parent_rows[mask]]).astype(np.float64)


class AcceptanceCalibrator:
    """Edge map, confidence refinement and depth correction (scikit-learn shaped: hyper-parameters
    in the constructor, learned attributes with a trailing underscore).

    Args:
        min_prob: the edge map's floor.
        given_parent_accepted: fit the edge map on edges whose parent is accepted (the chain rule);
            False fits it on every edge whose parent was verified (the toolkit before, kept to
            measure against).
        confidence: refine the edge map by the drafter's confidence at the parent.
        depth_correction: fit the depth correction (False: path probabilities are the products).
        min_nodes: outcomes the confidence refinement (edges) and the depth correction (nodes) need;
            fewer leave that step off.
    """

    def __init__(self, min_prob: float = 1e-4, given_parent_accepted: bool = True, confidence: bool = True,
                 depth_correction: bool = True, min_nodes: int = 200):
        self.min_prob = float(min_prob)
        self.given_parent_accepted, self.depth_correction = bool(given_parent_accepted), bool(depth_correction)
        self.confidence, self.min_nodes = bool(confidence), int(min_nodes)
        self.edge_coef_: np.ndarray | None = None  # the confidence refinement's 4 weights, None: off
        self.coef_: np.ndarray | None = None      # (a, b, c, e) of the depth correction, None: off
        self.max_depth_ = 0                       # deepest depth the correction was fitted on (deeper: clamped)

    def get_params(self) -> dict:
        return {"min_prob": self.min_prob, "given_parent_accepted": self.given_parent_accepted,
                "confidence": self.confidence, "depth_correction": self.depth_correction, "min_nodes": self.min_nodes}

    def fit(self, trace, cycles=None) -> "AcceptanceCalibrator":
        self._fit(trace, cycles)
        return self

    def _fit(self, trace, cycles) -> np.ndarray | None:
        """:meth:`fit`; returns the trace's path products (:meth:`_products`, for every node) when
        the depth fit computed them, for a caller that predicts the same trace next."""
        # imported here: scikit-learn costs half a second of start-up to every command that
        # only applies a fitted calibration
        from sklearn.isotonic import IsotonicRegression
        from sklearn.linear_model import LogisticRegression

        on_path = accepted_nodes(trace)
        mask = edge_mask(trace, cycles, self.given_parent_accepted, on_path)
        q_all, top_all = edge_probs(trace)
        q, top = q_all[mask], top_all[mask]
        accepted = (trace.token[mask] == trace.verdict[trace.parent_rows[mask]]).astype(np.float64)
        iso = IsotonicRegression(y_min=self.min_prob, y_max=1.0, increasing=True, out_of_bounds="clip")
        iso.fit(np.r_[0.0, q, 1.0], np.r_[0.0, accepted, 1.0])   # anchor the ends: q=0 never, q=1 always
        self.x_, self.y_ = iso.X_thresholds_.copy(), np.clip(iso.y_thresholds_, self.min_prob, 1.0)
        self.edge_coef_, self.coef_, self.max_depth_ = None, None, 0
        if self.confidence and q.size >= self.min_nodes and 0 < accepted.sum() < q.size:
            lr = LogisticRegression(C=1.0, max_iter=1000).fit(self._confidence_features(q, top), accepted)
            coef = np.r_[lr.intercept_, lr.coef_[0]]
            if coef[1] > 0:                      # increasing in the node's own probability
                self.edge_coef_ = coef
        # held-out quality is measured by the caller on other cycles; the fit's own Brier score:
        self.brier_ = float(np.mean((self.predict_edge(q, top) - accepted) ** 2)) if q.size else float("nan")
        self.n_edges_ = int(q.size)
        return self._fit_depth(trace, cycles, on_path) if self.depth_correction else None

    def _confidence_features(self, q: np.ndarray, top: np.ndarray) -> np.ndarray:
        """[n, 3] the refinement's features (:func:`specfit.kernels.acceptance.features`, which
        the edge map computes per edge)."""
        return kernels.acceptance.confidence_features(_floats(q), _floats(top), _floats(self.x_), _floats(self.y_))

    def _fit_depth(self, trace, cycles, on_path: np.ndarray) -> np.ndarray | None:
        """The logistic depth correction on every node with a known outcome, or none when too few
        nodes or no monotone fit; returns the path products it computed (None: too few nodes)."""
        from sklearn.linear_model import LogisticRegression     # as in fit

        known = _known(trace, cycles)
        if known.sum() < self.min_nodes:
            return None
        products = self._products(trace)
        x = kernels.acceptance.logits(_floats(products[known]))
        depth = trace.depth[known].astype(np.float64)
        y = on_path[known]
        if y.all() or not y.any():
            return products
        max_depth = int(depth.max())
        for features in ((x, depth, depth * x), (x, depth)):        # without the interaction if not monotone
            lr = LogisticRegression(C=1.0, max_iter=1000).fit(np.stack(features, axis=1), y)
            w = lr.coef_[0]
            coef = np.array([lr.intercept_[0], w[0], w[1], w[2] if w.size > 2 else 0.0])
            if min(coef[1] + coef[3] * d for d in (1, max_depth)) > 0:
                self.coef_, self.max_depth_ = coef, max_depth
                return products
        return products

    def predict_edge(self, draft_prob: np.ndarray, top_prob: np.ndarray | None = None) -> np.ndarray:
        """Acceptance probability of nodes with draft probability ``draft_prob`` given their
        parent's, when the largest draft probability among each node's siblings (itself included)
        is ``top_prob`` (None: each node is its parent's top child)."""
        q = _floats(draft_prob)
        top = q if top_prob is None else _floats(top_prob)
        return kernels.acceptance.edge_probs(q, top, *self._edge_params())

    def path_from_product(self, product: np.ndarray, depth: np.ndarray) -> np.ndarray:
        """Path probabilities from products of edge probabilities at ``depth`` (>= 1), before the
        non-increasing rule along paths (the caller's, who knows the parents)."""
        return kernels.acceptance.path_probs(_floats(product), _floats(depth), *self._depth_params())

    def _edge_params(self) -> tuple:
        """The edge map's arrays as the kernels take them (x, y, edge_coef, min_prob)."""
        coef = _EMPTY if self.edge_coef_ is None else _floats(self.edge_coef_)
        return _floats(self.x_), _floats(self.y_), coef, float(self.min_prob)

    def _depth_params(self) -> tuple:
        """The depth correction as the kernels take it (depth_coef, max_depth)."""
        coef = _EMPTY if self.coef_ is None else _floats(self.coef_)
        return coef, int(self.max_depth_)

    def calibrate_level(self, edge_lp: np.ndarray, width: int, new: np.ndarray, parents: np.ndarray,
                        depth: np.ndarray, edge_product: np.ndarray, path_prob: np.ndarray) -> None:
        """One drafted level in place, in one compiled call (the live drafter's): nodes ``new``,
        ``width`` children per expanded node in ``parents`` (each node's first child its top), get
        ``edge_product`` (their parent's times :meth:`predict_edge`) and ``path_prob``
        (:meth:`path_from_product`, never above the parent's)."""
        kernels.acceptance.calibrate_level(edge_lp, int(width), new, parents, depth, edge_product, path_prob,
                                           *self._edge_params(), *self._depth_params())

    def _products(self, trace) -> np.ndarray:
        """[nodes] products of edge probabilities along every path (root: 1)."""
        edge = self.predict_edge(*edge_probs(trace))
        root = trace.parent < 0
        parent_row = np.where(root, np.arange(trace.n_nodes), trace.parent_rows)
        out = np.where(root, 1.0, edge)
        # parents precede children: one pass per level turns edge probabilities into path products
        for _ in range(int(trace.depth.max(initial=0))):
            out = np.where(root, 1.0, edge * out[parent_row])
        return out

    def path_probs(self, trace, products: np.ndarray | None = None) -> np.ndarray:
        """[nodes] calibrated path probabilities of every node of ``trace`` (root: 1), each at
        most its parent's. ``products``: the trace's :meth:`_products`, when the caller has them."""
        root = trace.parent < 0
        parent_row = np.where(root, np.arange(trace.n_nodes), trace.parent_rows)
        products = self._products(trace) if products is None else products
        out = np.where(root, 1.0, self.path_from_product(products, trace.depth))
        for _ in range(int(trace.depth.max(initial=0))):
            out = np.where(root, 1.0, np.minimum(out, out[parent_row]))
        return out

    def to_dict(self) -> dict:
        return {"calibrator": "isotonic", **self.get_params(), "x_": self.x_.tolist(), "y_": self.y_.tolist(),
                "brier_": self.brier_, "n_edges_": self.n_edges_,
                "edge_coef_": None if self.edge_coef_ is None else self.edge_coef_.tolist(),
                "coef_": None if self.coef_ is None else self.coef_.tolist(), "max_depth_": self.max_depth_}

    @classmethod
    def from_dict(cls, d: dict) -> "AcceptanceCalibrator":
        # a calibrator written before the depth correction: its edge map as it was fitted
        c = cls(min_prob=d.get("min_prob", 1e-4), given_parent_accepted=d.get("given_parent_accepted", False),
                confidence=d.get("confidence", False), depth_correction=d.get("depth_correction", False),
                min_nodes=d.get("min_nodes", 200))
        c.x_, c.y_ = np.asarray(d["x_"]), np.asarray(d["y_"])
        c.brier_, c.n_edges_ = float(d.get("brier_", np.nan)), int(d.get("n_edges_", 0))
        c.edge_coef_ = None if d.get("edge_coef_") is None else np.asarray(d["edge_coef_"], dtype=np.float64)
        c.coef_ = None if d.get("coef_") is None else np.asarray(d["coef_"], dtype=np.float64)
        c.max_depth_ = int(d.get("max_depth_", 0))
        return c


def cross_calibrate(trace, n_folds: int = 2, **params) -> np.ndarray:
    """[nodes] calibrated path probabilities, each fold of cycles calibrated by a map fitted on
    the other folds (``params``: :class:`AcceptanceCalibrator`'s)."""
    from .predictors import cycle_folds

    fold = cycle_folds(trace, n_folds)
    out = np.ones(trace.n_nodes)
    fold_of_node = fold[trace.cycle_of_node]
    for f in range(n_folds):
        train = np.flatnonzero(fold != f)
        if not (fold == f).any():
            continue
        calibrator = AcceptanceCalibrator(**params)
        # the depth fit's path products serve the prediction too: the same edge map on the same trace
        products = calibrator._fit(trace, train if train.size else np.flatnonzero(fold == f))
        probs = calibrator.path_probs(trace, products)
        out[fold_of_node == f] = probs[fold_of_node == f]
    return out
