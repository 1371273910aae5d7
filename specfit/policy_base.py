"""What every policy shares with both drivers: the view of a cycle it decides on
(:class:`CycleView`), what a verified cycle reveals (:class:`Observation`) and the :class:`Policy`
interface. The policies themselves and their registry are in :mod:`specfit.policies`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from .costmodel import CostModel
from .search import Selection, evaluate
from .tree import DraftTree

__all__ = ["CycleView", "Observation", "Policy", "edge_outcomes"]


@dataclass
class CycleView:
    """What a policy knows after ``draft_levels`` levels have been drafted this cycle.

    ``tree`` holds the root and every node drafted so far; ``experts[node, layer, slot]`` are the
    predicted experts of those nodes; ``cached[layer, expert]`` the residency before the cycle.
    ``verdicts`` (the target's greedy next token at each node) and ``true_experts`` are known only
    to the oracle in the simulator.
    """

    tree: DraftTree
    experts: np.ndarray
    cached: np.ndarray
    cost: CostModel
    draft_levels: int
    verdicts: np.ndarray | None = None
    true_experts: np.ndarray | None = None
    # the drafter's own path probabilities where ``tree`` holds calibrated ones (a replay's, and a
    # live run's that calibrates acceptance): a chain follows the drafter's top-1 child, the one a
    # live chain drafts, and eagle3 ranks by them as EAGLE-3 does
    drafter_probs: np.ndarray | None = None

    def truncated(self, levels: int) -> "CycleView":
        """The view after only ``levels`` levels (nodes of a level-by-level tree come in depth
        order, so the first levels are a prefix of the arrays)."""
        keep = np.flatnonzero(self.tree.depth <= levels)
        if keep.size == self.tree.n_nodes:
            return CycleView(self.tree, self.experts, self.cached, self.cost, levels, self.verdicts, self.true_experts,
                             self.drafter_probs)
        if not np.array_equal(keep, np.arange(keep.size)):
            raise ValueError("tree: expected nodes in order of depth (drafted level by level)")
        n = keep.size
        return CycleView(
            tree=self.tree.subtree(keep), experts=self.experts[:n], cached=self.cached, cost=self.cost,
            draft_levels=levels,
            verdicts=None if self.verdicts is None else self.verdicts[:n],
            true_experts=None if self.true_experts is None else self.true_experts[:n],
            drafter_probs=None if self.drafter_probs is None else self.drafter_probs[:n],
        )

    def evaluate(self, nodes) -> Selection:
        return evaluate(self.tree, nodes, self.experts, self.cached, self.cost, self.draft_levels)


@dataclass(frozen=True)
class Observation:
    """What verification revealed, reported to :meth:`Policy.observe` by either driver.

    ``predicted_slots`` counts the (layer, rank) expert slots predicted for verified draft nodes,
    ``predicted_slots_right`` those naming an expert the node really routed to; the live decoder
    reports each cycle's, the simulator the whole trace's at once (its predictions are made for the
    whole trace up front). ``resident_share`` is the share of each layer the expert cache can hold
    (None: unchanged).

    Per cycle, both drivers also report the drafted ``tree`` (as the policy saw it), the
    ``verified`` node ids and the target's greedy next token at each of them (``verdicts``,
    aligned with ``verified``): every drafted child of a verified node is then known to be accepted
    or not (:func:`edge_outcomes`), for free; where the decoder samples, it reports those outcomes
    itself in ``edges`` (the nodes and the chance each is accepted, see
    :func:`specfit.runtime.acceptance.sample_accept`). ``decision_time_s`` is what the driver measured the
    policy's decisions and the expert predictions to cost this cycle (None where the driver does
    not charge them, as the simulator does not); ``draft_levels`` the levels drafted.

    What the predicted experts missed, per cycle: ``misses`` of the verified nodes' true union and
    ``predicted_misses`` of their predicted union (both against the residency the policy saw), and
    the same for the root alone (``root_misses``, ``root_predicted_misses``); None where unknown.
    """

    predicted_slots: int = 0
    predicted_slots_right: int = 0
    resident_share: float | None = None
    tree: DraftTree | None = None
    verified: np.ndarray | None = None
    verdicts: np.ndarray | None = None
    draft_levels: int = 0
    decision_time_s: float | None = None
    misses: int | None = None
    predicted_misses: int | None = None
    root_misses: int | None = None
    root_predicted_misses: int | None = None
    edges: tuple[np.ndarray, np.ndarray] | None = None


def edge_outcomes(observation: Observation) -> tuple[np.ndarray, np.ndarray]:
    """(nodes, accepted 0/1) of every drafted node whose parent lies on the accepted path (the
    root always does): accepted when its token is the target's greedy next token at the parent.
    The product of such outcomes along a path is its acceptance (the chain rule); children of a
    rejected parent are left out (the target's verdict there continues a context it never keeps).
    A sampling decoder's ``observation.edges`` are the same nodes with the chance each is accepted."""
    if observation.edges is not None:
        return observation.edges
    tree, verified, verdicts = observation.tree, observation.verified, observation.verdicts
    if tree is None or verified is None or verdicts is None or tree.tokens is None or tree.n_nodes < 2:
        return np.zeros(0, dtype=np.int64), np.zeros(0)
    verdict_of = np.full(tree.n_nodes, -1, dtype=np.int64)
    verdict_of[np.asarray(verified, dtype=np.int64)] = np.asarray(verdicts, dtype=np.int64)
    on_path = np.zeros(tree.n_nodes, dtype=bool)
    on_path[tree.accepted_path(verdict_of, verified)] = True
    nodes = np.arange(1, tree.n_nodes)
    nodes = nodes[on_path[tree.parents[nodes]]]
    accepted = (tree.tokens[nodes] == verdict_of[tree.parents[nodes]]).astype(np.float64)
    return nodes, accepted


class Policy(ABC):
    """Base class. ``max_levels`` bounds drafting; subclasses override the two decisions.

    Class attributes a driver reads: ``needs_truth`` (decides with the target's verdicts: replay
    only), ``draft_top_k`` (how the tree should be drafted: children per node and frontier width;
    None means the run's setting), ``cache_capacity`` (an expert-cache size the policy imposes, None:
    the run's), ``simulator_only`` (cannot run live), ``cache_advisor`` (eviction priorities from
    the draft, :class:`specfit.experts.lookahead.DraftLookahead`; None: the cache's own policy),
    ``prefetcher`` (copies into the link time of drafted levels,
    :class:`specfit.experts.prefetch.DraftPrefetch`; None: none).
    """

    name = "policy"
    max_levels = 0
    needs_truth = False
    draft_top_k: int | None = None
    cache_capacity: int | None = None
    simulator_only = False
    # the draft as a look-ahead for the expert cache (specfit.experts.lookahead.DraftLookahead):
    # both drivers pass its keep priorities to the cache's evictions; None: the cache's own policy
    cache_advisor = None
    # prefetch into the link time of drafted levels (specfit.experts.prefetch.DraftPrefetch): both
    # drivers copy its plan while each level is drafted; None: no prefetch
    prefetcher = None

    def begin_cycle(self) -> None:
        """Forget per-cycle state; called before level 0 of every cycle."""

    def observe(self, observation: Observation) -> None:
        """Learn from a verified cycle (or a whole trace); nothing by default."""

    def fit_on_trace(self, prep) -> None:
        """Tune to the prepared trace a replay is about to run (a simulator-only baseline given
        hindsight, e.g. Sequoia's acceptance rates); nothing by default."""

    def keep_drafting(self, view: CycleView) -> bool:
        return view.draft_levels < self.max_levels

    @abstractmethod
    def select(self, view: CycleView) -> Selection:
        """The nodes to verify (ancestor-closed, with the root) and their predicted outcome."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"
