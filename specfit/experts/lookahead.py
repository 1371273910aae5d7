"""The draft as a look-ahead for the expert cache.

A cycle drafts more than it verifies, and the nodes it leaves out predict what the next cycles
will need: the next cycle's root is the target's bonus token, which the drafter has usually
drafted already as a child of the last accepted node, and the drafted nodes below it are the
drafter's guess of the tokens after it. :class:`DraftLookahead` turns a cycle's tree, its predicted
experts and the verified selection into ``keep[layer, expert]``: the probability that a near
future token routes to the expert. The expert cache evicts the experts with the lowest ``keep``
first (:meth:`specfit.experts.cache.ExpertCache.admit`) and can prefetch the most probable ones
(:meth:`~specfit.experts.cache.ExpertCache.prefetch`).

Node x, a drafted descendant of a selected node v through a child that is *not* selected, is a
near-future token with probability

    P(v is the last accepted node) * p_x / p_v,   P(v last) = p_v - sum of p_w over v's selected children w

(path probabilities ``p``; the bonus token follows the last accepted node). An expert's ``keep`` is
``1 - prod(1 - w_x)`` over the nodes x predicted to route to it, each weight discounted by
``decay ** (depth of x below v - 1)`` (a later token is needed later, and the cache may turn over
before). Nothing here knows the verdicts: it runs before verification, in both drivers.

The draft sees a few tokens ahead; beyond them an expert's recent use rate is the best guess
(routing is skewed, and LRU forgets a popular expert after two tokens that skip it). With
``usage_weight > 0`` the advisor also keeps an exponential average of each expert's use per cycle
(:meth:`DraftLookahead.observe`, called by the drivers with the true union after verification)
and combines the two: ``keep = 1 - (1 - draft) * (1 - usage_weight * usage)``. The usage part alone
(``use_draft=False``) is an eviction rule any runtime could use, with or without a drafter.
"""

from __future__ import annotations

import numpy as np

from .. import kernels
from ..tree import DraftTree

__all__ = ["DraftLookahead", "next_token_weights"]


def next_token_weights(tree: DraftTree, selected, decay: float = 1.0) -> np.ndarray:
    """float [n]: the weight of each node as a near-future token after verifying ``selected``
    (0 for the selected nodes and for nodes hanging from no selected node)."""
    return kernels.lookahead.next_token_weights(np.array(tree.parents), np.array(tree.path_probs),
                                                np.asarray(selected, dtype=np.int64), float(decay))


class DraftLookahead:
    """``keep`` priorities from a cycle's draft (see the module docstring).

    Args:
        decay: weight factor per level below the first unselected one.
        min_weight: nodes below this weight are ignored (they would only reorder ties).
    """

    name = "lookahead"

    def __init__(self, decay: float = 0.7, min_weight: float = 0.02, usage_weight: float = 0.5,
                 usage_memory: float = 0.95, use_draft: bool = True):
        if not 0 < decay <= 1 or not 0 <= min_weight < 1:
            raise ValueError(f"lookahead: expected 0 < decay <= 1 and 0 <= min_weight < 1, got {decay}, {min_weight}")
        if not 0 <= usage_weight <= 1 or not 0 < usage_memory < 1:
            raise ValueError(f"lookahead: expected usage_weight in [0, 1] and usage_memory in (0, 1), got "
                             f"{usage_weight}, {usage_memory}")
        self.decay, self.min_weight = float(decay), float(min_weight)
        self.usage_weight, self.usage_memory, self.use_draft = float(usage_weight), float(usage_memory), bool(use_draft)
        self.usage_: np.ndarray | None = None      # [L, E] exponential average of use per cycle

    def get_params(self) -> dict:
        return {"decay": self.decay, "min_weight": self.min_weight, "usage_weight": self.usage_weight,
                "usage_memory": self.usage_memory, "use_draft": self.use_draft}

    def observe(self, union: np.ndarray) -> None:
        """Learn from a cycle's true union (bool [L, E]), after verification."""
        union = np.asarray(union, dtype=bool)
        if self.usage_ is None or self.usage_.shape != union.shape:
            self.usage_ = np.zeros(union.shape)
        self.usage_ *= self.usage_memory
        self.usage_ += (1 - self.usage_memory) * union

    def keep(self, tree: DraftTree, experts: np.ndarray, selected, n_experts: int) -> np.ndarray:
        """float [L, E] in [0, 1]: the probability that a near-future token needs each expert
        (:func:`specfit.kernels.levers.keep_priorities`, the code the compiled replay runs)."""
        lv = kernels.levers
        experts = np.ascontiguousarray(experts, dtype=np.int64)
        lconf, lf = np.zeros(lv.N_LCONF, dtype=np.int64), np.zeros(lv.N_LF)
        usage = self.usage_ if self.usage_ is not None and self.usage_.shape == (experts.shape[1], n_experts) else None
        self.kernel_config(lconf, lf, usage is not None)
        if usage is None:
            usage = np.zeros((experts.shape[1], n_experts))
        return lv.keep_priorities(np.array(tree.parents), np.array(tree.path_probs), experts,
                                  np.asarray(selected, dtype=np.int64), int(n_experts), lconf, lf, usage,
                                  lv.EVERYWHERE)

    def kernel_config(self, lconf: np.ndarray, lf: np.ndarray, usage_seen: bool) -> None:
        """Write this advisor's settings into the lever arrays of :mod:`specfit.kernels.levers`
        (``usage_seen``: its use record counts)."""
        lv = kernels.levers
        lconf[lv.ADVISOR], lconf[lv.USE_DRAFT], lconf[lv.USAGE_SEEN] = 1, int(self.use_draft), int(usage_seen)
        lf[[lv.DECAY, lv.MIN_WEIGHT, lv.USAGE_WEIGHT, lv.USAGE_MEMORY]] = (self.decay, self.min_weight,
                                                                           self.usage_weight, self.usage_memory)
