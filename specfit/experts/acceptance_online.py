"""Acceptance calibrated where it is used: edge acceptance learned online from every cycle's verdicts.

Each verified cycle reveals, for free, whether every drafted child of a verified node is accepted
(its token is the target's greedy next token at the parent, :func:`specfit.policy_base.edge_outcomes`).
When the decoder samples, the outcome is the chance that tree speculative sampling accepts the
child, the target's probability of its token at the parent
(the edges of :func:`specfit.runtime.acceptance.sample_accept`): a number in [0, 1] that the same
log-likelihood takes as a soft label, and the scores below compare with.
:class:`OnlineAcceptance` fits a logistic model of that outcome on the drafter's confidence where
the policy uses it, per draft node (edge):

    logit P(accept) = w . [1, logit q, logit^2 q, depth, depth * logit q, logit q1, q1 - q2, rank]

``q`` is the node's own conditional probability (``p_v / p_parent`` of the tree the policy sees),
``q1`` and ``q2`` the two largest among its siblings (the drafter's top-1 probability and margin at
the parent), ``rank`` its place among them. It refits every ``refit_every`` updates on the latest
``memory`` edges by Newton's method with an L2 penalty towards "the tree's own probability" (weight
1 on ``logit q``, 0 elsewhere), so a model that has seen little stays close to the drafter. Path
probabilities are products of edge probabilities (each <= 1: non-increasing along every path).

Before it has ``min_edges`` outcomes it returns the tree's own probabilities. Its predictions are
scored before each update (prequential: every scored cycle is held out from the fit that made its
prediction), next to the tree's own probabilities: Brier score and expected calibration error
(:func:`reliability`), kept as running sums per bin, so a run of any length scores in constant
memory.
"""

from __future__ import annotations

import numpy as np

from .. import kernels
from ..tree import DraftTree

__all__ = ["OnlineAcceptance", "edge_features", "reliability"]

_PRIOR = np.array([0.0, 1.0, 0, 0, 0, 0, 0, 0])   # logit P = logit q: the tree's own probabilities
_NO_COEF = np.zeros(0)
_BINS = 10                                         # the reliability bins of quality()


def edge_features(tree: DraftTree) -> tuple[np.ndarray, np.ndarray]:
    """(q [n], features [n, 8]) of every node's edge (row 0, the root, is unused):
    :func:`specfit.kernels.acceptance.online_features`."""
    return kernels.acceptance.online_features(tree.parents, tree.path_probs, tree.depth)


def reliability(predicted, outcome, bins: int = _BINS) -> dict:
    """Brier score and expected calibration error (equal-width bins) of probabilities."""
    p = np.asarray(predicted, dtype=np.float64)
    y = np.asarray(outcome, dtype=np.float64)
    if p.size == 0:
        return {"n": 0, "brier": float("nan"), "ece": float("nan")}
    if p.shape != y.shape or not (np.isfinite(p).all() and np.isfinite(y).all()):
        raise ValueError(f"reliability: expected finite probabilities and outcomes of one shape, got shapes {p.shape} "
                         f"and {y.shape}")
    return _reliability_of(p.size, *_binned(p.ravel(), y.ravel(), bins))


def _binned(p: np.ndarray, y: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray, float]:
    """(sum of the probabilities per bin, sum of the outcomes per bin, sum of squared errors): the
    sums :func:`reliability` reads, which add up over batches of edges."""
    which = np.minimum((p * bins).astype(int), bins - 1)
    return (np.bincount(which, weights=p, minlength=bins), np.bincount(which, weights=y, minlength=bins),
            float(np.sum((p - y) ** 2)))


def _reliability_of(n: int, p_sums: np.ndarray, y_sums: np.ndarray, squared: float) -> dict:
    return {"n": int(n), "brier": squared / n, "ece": float(np.abs(p_sums - y_sums).sum() / n)}


class OnlineAcceptance:
    """Online logistic calibration of edge acceptance (scikit-learn shaped: hyper-parameters in the
    constructor, learned ``coef_``; :meth:`update` learns, :meth:`path_probs` is pure)."""

    def __init__(self, memory: int = 4096, refit_every: int = 8, min_edges: int = 64, l2: float = 1.0,
                 newton_steps: int = 4):
        if memory < 1 or refit_every < 1 or min_edges < 1 or not l2 > 0 or newton_steps < 1:
            # without a penalty a constant feature (rank 0 in a chain) leaves the Newton step singular
            raise ValueError("online acceptance: expected positive memory, refit_every, min_edges, newton_steps "
                             "and l2")
        self.memory, self.refit_every, self.min_edges = int(memory), int(refit_every), int(min_edges)
        self.l2, self.newton_steps = float(l2), int(newton_steps)
        self.coef_: np.ndarray | None = None
        # the last ``memory`` edges' features and outcomes, a ring (row ``n % memory`` is written next)
        self._x = np.zeros((self.memory, _PRIOR.size))
        self._y = np.zeros(self.memory)
        self._n = 0
        self._last: tuple | None = None      # (tree, coef_, its probabilities)
        self._updates = 0
        # prequential scores of this model's predictions (row 0) and the tree's own (row 1), as the
        # sums reliability() reads: per bin the probabilities' and the outcomes' (a list of every
        # scored edge grew with the run: ~350 bytes a cycle of the bundled model, and quality() took
        # longer each time)
        self._n_scored = 0
        self._bin_sums = np.zeros((2, 2, _BINS))
        self._squared = np.zeros(2)

    def get_params(self) -> dict:
        return {"memory": self.memory, "refit_every": self.refit_every, "min_edges": self.min_edges, "l2": self.l2,
                "newton_steps": self.newton_steps}

    # ------------------------------------------------------------------ prediction
    def edge_probs(self, tree: DraftTree) -> np.ndarray:
        """[n] acceptance probability of each node given its parent (root: 1)."""
        return self._probs(tree)[2]

    def path_probs(self, tree: DraftTree) -> np.ndarray:
        """[n] calibrated path probabilities (products of edge probabilities along each path)."""
        return self._probs(tree)[3]

    def _probs(self, tree: DraftTree) -> tuple:
        """(q, features, edge, path probabilities): :func:`specfit.kernels.acceptance.online_probs`.
        The last tree's are kept: a cycle's update reads those of the tree its last decision
        calibrated (a tree's arrays are read-only; a refit replaces ``coef_``)."""
        if self._last is None or self._last[0] is not tree or self._last[1] is not self.coef_:
            probs = kernels.acceptance.online_probs(tree.parents, tree.path_probs, tree.depth,
                                                    _NO_COEF if self.coef_ is None else self.coef_)
            for a in probs:          # shared by the calls on this tree: read-only, as the tree's are
                a.setflags(write=False)
            self._last = (tree, self.coef_, probs)
        return self._last[2]

    def calibrated(self, tree: DraftTree) -> DraftTree:
        """``tree`` with the calibrated path probabilities (products of edges in (0, 1], so each
        at most its parent's: the tree is taken as grown, without the constructor's checks)."""
        if tree.tokens is None:
            return DraftTree(parents=tree.parents, path_probs=self.path_probs(tree))
        return DraftTree.grown(tree.parents, self.path_probs(tree), tree.tokens, tree.depth)

    # ------------------------------------------------------------------ learning
    def update(self, tree: DraftTree, nodes: np.ndarray, accepted: np.ndarray) -> None:
        """Score this model's and the tree's own predictions for ``nodes`` (edges whose outcome
        ``accepted`` the target just revealed), then learn from them."""
        nodes = np.asarray(nodes, dtype=np.int64)
        if nodes.size == 0:
            return
        q, x, edge, _ = self._probs(tree)
        accepted = np.asarray(accepted, dtype=np.float64)
        for row, predicted in enumerate((edge[nodes], q[nodes])):
            p_sums, y_sums, squared = _binned(predicted, accepted, _BINS)
            self._bin_sums[row, 0] += p_sums
            self._bin_sums[row, 1] += y_sums
            self._squared[row] += squared
        self._n_scored += nodes.size
        self._remember(x[nodes], accepted)
        self._updates += 1
        if (min(self._n, self.memory) >= self.min_edges
                and (self.coef_ is None or self._updates % self.refit_every == 0)):
            self._refit()

    def _remember(self, x: np.ndarray, y: np.ndarray) -> None:
        """Write edges into the ring, the oldest overwritten first."""
        x, y = x[-self.memory:], y[-self.memory:]
        first = self._n % self.memory
        head = min(y.size, self.memory - first)
        self._x[first:first + head], self._y[first:first + head] = x[:head], y[:head]
        self._x[:y.size - head], self._y[:y.size - head] = x[head:], y[head:]
        self._n += y.size

    def _window(self) -> tuple[np.ndarray, np.ndarray]:
        """The remembered edges' features and outcomes, oldest first."""
        if self._n <= self.memory:
            return self._x[:self._n], self._y[:self._n]
        first = self._n % self.memory
        return np.concatenate([self._x[first:], self._x[:first]]), np.concatenate([self._y[first:], self._y[:first]])

    def _refit(self) -> None:
        """Damped Newton steps from the current weights (:func:`specfit.kernels.acceptance.online_refit`)."""
        start = _PRIOR if self.coef_ is None else self.coef_
        x, y = self._window()
        self.coef_ = kernels.acceptance.online_refit(x, y, start, _PRIOR, self.l2, self.newton_steps)

    # ------------------------------------------------------------------ quality
    def quality(self) -> dict:
        """Prequential reliability of this model and of the tree's own probabilities on every
        edge scored so far (``n``, ``brier``, ``ece`` and the same with the ``raw_`` prefix)."""
        if not self._n_scored:
            return {**reliability([], []), **{f"raw_{k}": v for k, v in reliability([], []).items()}}
        out = _reliability_of(self._n_scored, *self._bin_sums[0], self._squared[0])
        out.update({f"raw_{k}": v for k, v in _reliability_of(self._n_scored, *self._bin_sums[1],
                                                              self._squared[1]).items()})
        return out

    def to_dict(self) -> dict:
        return {"calibrator": "online-logistic", "params": self.get_params(),
                "coef_": None if self.coef_ is None else self.coef_.tolist()}

    @classmethod
    def from_dict(cls, d: dict) -> "OnlineAcceptance":
        c = cls(**d.get("params", {}))
        c.coef_ = None if d.get("coef_") is None else np.asarray(d["coef_"], dtype=np.float64)
        return c
