"""Acceptance calibrated where it is used: edge acceptance learned online from every cycle's verdicts.

Each verified cycle reveals, for free, whether every drafted child of a verified node is accepted
(its token is the target's greedy next token at the parent, :func:`specfit.policy_base.edge_outcomes`).
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
(:func:`reliability`).
"""

from __future__ import annotations

import numpy as np

from ..tree import DraftTree

__all__ = ["OnlineAcceptance", "edge_features", "reliability"]

# probabilities are clipped to [_EPS, 1 - _EPS] before the logit (|logit| <= 8): a calibrated tree
# may carry 0s and 1s, and an unbounded feature lets a few edges swing the fit
_EPS = 3e-4
N_FEATURES = 8
_PRIOR = np.array([0.0, 1.0, 0, 0, 0, 0, 0, 0])   # logit P = logit q: the tree's own probabilities


def edge_features(tree: DraftTree) -> tuple[np.ndarray, np.ndarray]:
    """(q [n], features [n, N_FEATURES]) of every node's edge (row 0, the root, is unused)."""
    n = tree.n_nodes
    p = tree.path_probs
    parents = np.maximum(tree.parents, 0)
    q = np.clip(np.where(p[parents] > 0, p / np.maximum(p[parents], 1e-300), 0.0), _EPS, 1 - _EPS)
    q[0] = 1 - _EPS
    lq = np.log(q) - np.log1p(-q)
    # the two largest conditional probabilities among each node's siblings, and its rank
    nodes = np.arange(1, n)
    order = np.lexsort((nodes, -q[nodes], parents[nodes]))
    sorted_nodes, sorted_par = nodes[order], parents[nodes][order]
    first = np.r_[True, sorted_par[1:] != sorted_par[:-1]] if order.size else np.zeros(0, dtype=bool)
    start = np.maximum.accumulate(np.where(first, np.arange(order.size), 0)) if order.size else np.zeros(0, int)
    rank = np.zeros(n)
    rank[sorted_nodes] = np.arange(order.size) - start
    q1 = np.zeros(n)
    q2 = np.zeros(n)
    top = sorted_nodes[first]
    q1_par = np.zeros(n)
    q1_par[sorted_par[first]] = q[top]
    second = np.flatnonzero(~first & np.r_[False, first[:-1]]) if order.size else np.zeros(0, int)
    q2_par = np.zeros(n)
    q2_par[sorted_par[second]] = q[sorted_nodes[second]]
    q1[1:], q2[1:] = q1_par[parents[1:]], q2_par[parents[1:]]
    c1 = np.clip(q1, _EPS, 1 - _EPS)
    depth = tree.depth.astype(np.float64)
    x = np.stack([np.ones(n), lq, lq * lq / 10.0, depth, depth * lq / 4.0, np.log(c1) - np.log1p(-c1), q1 - q2,
                  rank], axis=1)
    return q, x


def reliability(predicted, outcome, bins: int = 10) -> dict:
    """Brier score and expected calibration error (equal-width bins) of probabilities."""
    p = np.asarray(predicted, dtype=np.float64)
    y = np.asarray(outcome, dtype=np.float64)
    if p.size == 0:
        return {"n": 0, "brier": float("nan"), "ece": float("nan")}
    which = np.minimum((p * bins).astype(int), bins - 1)
    gap = np.abs(np.bincount(which, weights=p, minlength=bins) - np.bincount(which, weights=y, minlength=bins))
    return {"n": int(p.size), "brier": float(np.mean((p - y) ** 2)), "ece": float(gap.sum() / p.size)}


class OnlineAcceptance:
    """Online logistic calibration of edge acceptance (scikit-learn shaped: hyper-parameters in the
    constructor, learned ``coef_``; :meth:`update` learns, :meth:`path_probs` is pure)."""

    def __init__(self, memory: int = 4096, refit_every: int = 8, min_edges: int = 64, l2: float = 1.0,
                 newton_steps: int = 4):
        if memory < 1 or refit_every < 1 or min_edges < 1 or l2 < 0 or newton_steps < 1:
            raise ValueError("online acceptance: expected positive memory, refit_every, min_edges and newton_steps, "
                             "and l2 >= 0")
        self.memory, self.refit_every, self.min_edges = int(memory), int(refit_every), int(min_edges)
        self.l2, self.newton_steps = float(l2), int(newton_steps)
        self.coef_: np.ndarray | None = None
        self._x = np.zeros((0, N_FEATURES))
        self._y = np.zeros(0)
        self._updates = 0
        # prequential scores: (this model's prediction, the tree's own, outcome) per scored edge
        self._scored: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def get_params(self) -> dict:
        return {"memory": self.memory, "refit_every": self.refit_every, "min_edges": self.min_edges, "l2": self.l2,
                "newton_steps": self.newton_steps}

    # ------------------------------------------------------------------ prediction
    def edge_probs(self, tree: DraftTree) -> np.ndarray:
        """[n] acceptance probability of each node given its parent (root: 1)."""
        q, x = edge_features(tree)
        if self.coef_ is None:
            out = q
        else:
            out = 1.0 / (1.0 + np.exp(-np.clip(x @ self.coef_, -30, 30)))
        out = out.copy()
        out[0] = 1.0
        return out

    def path_probs(self, tree: DraftTree) -> np.ndarray:
        """[n] calibrated path probabilities (products of edge probabilities along each path)."""
        edge = self.edge_probs(tree)
        out = np.ones(tree.n_nodes)
        for level in tree.levels[1:]:           # a level's parents are all in the one before
            out[level] = out[tree.parents[level]] * edge[level]
        return out

    def calibrated(self, tree: DraftTree) -> DraftTree:
        return DraftTree(parents=tree.parents, path_probs=self.path_probs(tree), tokens=tree.tokens)

    # ------------------------------------------------------------------ learning
    def update(self, tree: DraftTree, nodes: np.ndarray, accepted: np.ndarray) -> None:
        """Score this model's and the tree's own predictions for ``nodes`` (edges whose outcome
        ``accepted`` the target just revealed), then learn from them."""
        nodes = np.asarray(nodes, dtype=np.int64)
        if nodes.size == 0:
            return
        q, x = edge_features(tree)
        self._scored.append((self.edge_probs(tree)[nodes], q[nodes], np.asarray(accepted, dtype=np.float64)))
        self._x = np.concatenate([self._x, x[nodes]])[-self.memory:]
        self._y = np.concatenate([self._y, accepted])[-self.memory:]
        self._updates += 1
        if self._y.size >= self.min_edges and (self.coef_ is None or self._updates % self.refit_every == 0):
            self._refit()

    def _loss(self, w: np.ndarray) -> float:
        """The penalised negative log-likelihood the fit minimises."""
        z = self._x @ w
        return float(np.sum(np.logaddexp(0, z) - self._y * z) + 0.5 * self.l2 * np.sum((w - _PRIOR) ** 2))

    def _refit(self) -> None:
        """Damped Newton steps (halved until the penalised loss falls: plain Newton can overshoot
        on nearly separable edges)."""
        x, y = self._x, self._y
        w = _PRIOR.copy() if self.coef_ is None else self.coef_.copy()
        reg = np.full(N_FEATURES, self.l2)
        loss = self._loss(w)
        for _ in range(self.newton_steps):
            p = 1.0 / (1.0 + np.exp(-np.clip(x @ w, -30, 30)))
            grad = x.T @ (p - y) + reg * (w - _PRIOR)
            hess = (x * (p * (1 - p))[:, None]).T @ x + np.diag(reg)
            step = np.linalg.solve(hess, grad)
            for _ in range(20):
                trial = self._loss(w - step)
                if trial <= loss:
                    break
                step = step / 2
            else:
                break
            w, loss = w - step, trial
            if np.abs(step).max() < 1e-6:
                break
        self.coef_ = w

    # ------------------------------------------------------------------ quality
    def quality(self) -> dict:
        """Prequential reliability of this model and of the tree's own probabilities on every
        edge scored so far (``n``, ``brier``, ``ece`` and the same with the ``raw_`` prefix)."""
        if not self._scored:
            return {**reliability([], []), **{f"raw_{k}": v for k, v in reliability([], []).items()}}
        pred, raw, y = (np.concatenate(parts) for parts in zip(*self._scored))
        out = reliability(pred, y)
        out.update({f"raw_{k}": v for k, v in reliability(raw, y).items()})
        return out

    def to_dict(self) -> dict:
        return {"calibrator": "online-logistic", "params": self.get_params(),
                "coef_": None if self.coef_ is None else self.coef_.tolist()}

    @classmethod
    def from_dict(cls, d: dict) -> "OnlineAcceptance":
        c = cls(**d.get("params", {}))
        c.coef_ = None if d.get("coef_") is None else np.asarray(d["coef_"], dtype=np.float64)
        return c
