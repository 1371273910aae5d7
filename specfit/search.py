"""Exact maximum-throughput subtree search, a greedy baseline, and the per-level stopping rule.

``best_subtree`` maximises ``A(S) / T(S, d)`` over ancestor-closed node sets S that contain the root:

* **Dinkelbach** on the ratio: from ``S = {root}``, with ``lam = A(S) / T(S)``, solve
  ``max_S A(S) - lam * T(S)``; a set with a better ratio becomes the new S; stop when none is
  better. Each candidate is re-evaluated with the cost formula itself, so the answer's reported
  ratio is exact and the loop accepts strict improvements only.
* Each inner problem is a **maximum-weight closure**: draft node v has weight
  ``p_v - lam * per_node_s`` and requires its parent and every expert item (l, e) it routes to;
  an item costs ``lam * w[l, e]``. Reductions before any max-flow:
  - an item is attached only to its *minimal* requiring nodes (an item needed by an ancestor is
    already paid when the node can be selected); the root's items are prepaid;
  - items with a single minimal node are folded into that node's weight; items with the same set
    of minimal nodes are merged;
  - a subtree whose optimistic value (shared items free) is not positive is pruned;
  - a node whose pessimistic value (every shared item paid alone) is positive once its parent is
    in is forced in, which prepays its shared items;
  - what is left is either a forest without shared items (a tree DP, exact) or a small closure
    problem solved by a max-flow with float capacities.
* Ties go to the smallest set: the maximisers of a closure problem are closed under intersection,
  and every step above keeps the minimal one (prune at ``<= 0``, force at ``> 0``, the source side
  of the min cut is what the source reaches in the residual graph).
* Before any of it, a bound on the root's ratio with every expert free says whether any draft
  node can pay at all; when none can, the root is returned without building expert sets. The
  first inner problem's prune (lam only grows) drops the nodes no later one can take, before the
  shared items are listed.
* An optional price per draft node (``draft_node_s``, e.g. for experts the predictor gets wrong,
  :func:`uncertainty_price_s`) enters every node's weight; the ranking uses the priced time and
  the selection reports the predicted time and the price apart.

The algorithm runs compiled (:mod:`specfit.kernels.search` and :mod:`specfit.kernels.inner`,
expert sets as ``uint64`` bitsets, the cost formula in :mod:`specfit.kernels.evaluate`, the min
cut in :mod:`specfit.kernels.closure`); this module validates the inputs, words the errors and
returns :class:`Selection` objects.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np

from . import kernels
from .costmodel import CostModel, check_experts
from .kernels.tolerances import GAIN_EPS, TIE_REL
from .tree import DraftTree, check_nodes

__all__ = ["Selection", "best_subtree", "greedy_subtree", "evaluate", "should_continue", "max_weight_closure",
           "uncertainty_price_s", "TIE_REL", "GAIN_EPS"]


@dataclass(frozen=True)
class Selection:
    """A chosen subtree and its predicted outcome."""

    nodes: np.ndarray          # sorted node ids, contains 0, ancestor-closed
    expected_tokens: float     # 1 + sum of the selected draft nodes' path probabilities
    time_s: float              # predicted cycle time
    hits: int                  # union experts already resident
    misses: int                # union experts to copy host-to-device
    draft_levels: int
    price_s: float = 0.0       # uncertainty price of the draft nodes (draft_node_s each); not a time

    @property
    def throughput(self) -> float:
        """Expected committed tokens per second."""
        return self.expected_tokens / self.time_s if self.time_s > 0 else float("inf")

    @property
    def priced_time_s(self) -> float:
        """The time the search ranks subtrees by: the predicted time plus the price."""
        return self.time_s + self.price_s

    @property
    def n_nodes(self) -> int:
        return int(self.nodes.size)


def _better(a: Selection, b: Selection) -> bool:
    """True when a beats b: a higher ratio, or (a tie) the same ratio with fewer nodes."""
    return kernels.search.better(a.expected_tokens, a.priced_time_s, a.n_nodes, b.expected_tokens, b.priced_time_s,
                                 b.n_nodes)


def check_draft_node_s(draft_node_s) -> float:
    """``draft_node_s`` as a float, or an error naming it when it is not finite and >= 0."""
    value = float(draft_node_s)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"draft_node_s: expected a finite non-negative number of seconds, got {draft_node_s!r}")
    return value


def validated(tree, experts, cached, cost, draft_levels):
    """The inputs as the kernels take them (int64 [n, L, k] and bool [L, E], C order). Well-formed
    arrays skip :func:`check_experts`; expert ids are range-checked by the kernel, which reports
    a bad id for :func:`check_experts` to word."""
    if not isinstance(tree, DraftTree):
        raise ValueError(f"tree: expected a DraftTree, got {type(tree).__name__}")
    if not isinstance(cost, CostModel):
        raise ValueError(f"cost: expected a CostModel, got {type(cost).__name__}")
    if not (type(experts) is np.ndarray and experts.ndim == 3 and experts.dtype.kind in "iu"
            and type(cached) is np.ndarray and cached.ndim == 2 and cached.dtype == np.bool_
            and experts.shape[0] == tree.n_nodes and experts.shape[1] == cached.shape[0]):
        experts, cached = check_experts(tree, experts, cached)
    if not (isinstance(draft_levels, (int, np.integer)) and not isinstance(draft_levels, bool)
            or isinstance(draft_levels, float) and draft_levels.is_integer()) or draft_levels < 0:
        raise ValueError(f"draft_levels: expected a non-negative integer, got {draft_levels!r}")
    return np.ascontiguousarray(experts, dtype=np.int64), np.ascontiguousarray(cached)


def _tree_arrays(tree: DraftTree) -> tuple[np.ndarray, np.ndarray]:
    """Writable copies of the tree's (read-only) parents and path probabilities: the kernels are
    then compiled for one array type whoever calls them, which halves their first-call cost."""
    return np.array(tree.parents), np.array(tree.path_probs)


ROOT_TIME_MESSAGE = ("cost: verifying the root alone is predicted to take 0 s; expected a cost model with a positive "
                     "cycle time (base_s, per_node_s or the root's expert costs > 0)")


def kernel_selection(status: int, tree, experts, cached, draft_levels, draft_node_s, nodes, tokens, time_s, hits,
                     misses) -> Selection:
    """The :class:`Selection` of a search kernel's answer (``status`` and its outcome), or the
    error its status stands for, worded (a bad expert id, a cost model with no cycle time)."""
    if status == kernels.search.BAD_EXPERT:
        check_experts(tree, experts, cached)   # raises, naming the id and the range
        raise AssertionError("the search kernel rejected expert ids that check_experts accepts")
    if status == kernels.search.ROOT_TIME:
        raise ValueError(ROOT_TIME_MESSAGE)
    return Selection(nodes=nodes, expected_tokens=float(tokens), time_s=float(time_s), hits=int(hits),
                     misses=int(misses), draft_levels=int(draft_levels), price_s=draft_node_s * (nodes.size - 1))


def evaluate(tree: DraftTree, nodes, experts, cached, cost: CostModel, draft_levels: int = 0,
             draft_node_s: float = 0.0) -> Selection:
    """The predicted outcome of verifying ``nodes`` (validated, then the cost formula). Only the
    selected nodes' experts are read for the union: policies call this once per cycle on large trees."""
    experts, cached = validated(tree, experts, cached, cost, draft_levels)
    draft_node_s = check_draft_node_s(draft_node_s)
    formula = kernels.evaluate
    parents, probs = _tree_arrays(tree)
    given = np.asarray(nodes)
    if not (given.ndim == 1 and given.dtype == np.int64 and formula.canonical_closed(parents, given)):
        given = check_nodes(tree, nodes)   # sorts and dedups, or words what is wrong
    nodes = given
    status, tokens, time_s, hits, misses = formula.evaluate_nodes(
        probs, experts, packed(cached), cached.shape[1], nodes, cost.params, int(draft_levels))
    return kernel_selection(status, tree, experts, cached, draft_levels, draft_node_s, nodes, tokens, time_s, hits, misses)


_NO_START = np.zeros(0, dtype=np.int64)
# per thread (two decoders in two threads must not trade residencies): the last read-only
# residency registered, and its words once packed
_LAST_PACKED = threading.local()


def remember_packed(cached: np.ndarray) -> np.ndarray:
    """Make ``cached`` (a residency copy a driver hands a cycle's decisions) read-only and pack it
    once, at its first search: a policy searches several times per cycle on it. Only an array
    registered here (in this thread) is trusted not to change; any other is packed at every call
    (a read-only view of a writable array can change under it)."""
    cached.flags.writeable = False
    _LAST_PACKED.cached, _LAST_PACKED.words = cached, None
    return cached


def packed(cached: np.ndarray) -> np.ndarray:
    """``cached`` as the kernels' words (once per residency :func:`remember_packed` registered)."""
    if cached is not getattr(_LAST_PACKED, "cached", None) or cached.flags.writeable:
        return kernels.bitsets.pack_mask(cached)
    if _LAST_PACKED.words is None:
        _LAST_PACKED.words = kernels.bitsets.pack_mask(cached)
    return _LAST_PACKED.words


def best_subtree(tree: DraftTree, experts, cached, cost: CostModel, draft_levels: int = 0,
                 start=None, draft_node_s: float = 0.0) -> Selection:
    """The ancestor-closed subtree with the highest predicted throughput (exact; ties: smallest).

    Args:
        tree: the drafted tree (node 0 the root).
        experts: int [n, L, k]; each node's (predicted) experts per MoE layer.
        cached: bool [L, E]; experts resident before this cycle.
        cost: the cycle-time model.
        draft_levels: draft levels already spent this cycle (charged to every candidate).
        start: optional ancestor-closed node set to start Dinkelbach from (e.g. the previous
            level's answer); it changes the number of iterations, not the answer, but for sets
            whose ratios lie within a few ``TIE_REL`` of each other (float rounding decides such
            ties, and ties within a tolerance are not transitive).
        draft_node_s: a price in seconds added per draft node (not the root), e.g. the expected
            cost of the experts a node needs that its prediction missed (see
            :func:`uncertainty_price_s`). The search ranks by ``time_s + price_s``; the selection's
            ``time_s`` stays the cost model's prediction and ``price_s`` holds the price.
    """
    experts, cached = validated(tree, experts, cached, cost, draft_levels)
    draft_node_s = check_draft_node_s(draft_node_s)
    first = _NO_START
    if start is not None:
        first = np.asarray(start)
        if not (first.ndim == 1 and first.dtype == np.int64):
            first = check_nodes(tree, start, "start")
    search = kernels.search
    args = (*_tree_arrays(tree), experts, packed(cached), cached.shape[1], cost.params,
            int(draft_levels), draft_node_s)
    status, nodes, tokens, time_s, hits, misses = search.best_subtree(*args, first, start is not None)
    if status == search.BAD_START:
        # not sorted and unique, or not closed: check_nodes canonicalises the first and words the rest
        first = check_nodes(tree, start, "start")
        status, nodes, tokens, time_s, hits, misses = search.best_subtree(*args, first, True)
    return kernel_selection(status, tree, experts, cached, draft_levels, draft_node_s, nodes, tokens, time_s, hits, misses)


def greedy_subtree(tree: DraftTree, experts, cached, cost: CostModel, draft_levels: int = 0,
                   draft_node_s: float = 0.0) -> Selection:
    """Baseline: grow from the root, each step adding the frontier node (a child of the selected
    set) that gives the best ratio, while the ratio improves. Each step prices every frontier
    node against the selected set's expert union, so the time grows with the square of the tree's
    size times its layers (0.18 s at a thousand nodes of 48 layers x top-8 of 128 on a wide tree,
    where :func:`best_subtree` takes milliseconds: ``benchmarks/RESULTS.md``, "Stop 55"), and,
    compiled, it hears a Ctrl-C only when it returns: a comparison for trees of up to a few
    thousand nodes."""
    experts, cached = validated(tree, experts, cached, cost, draft_levels)
    draft_node_s = check_draft_node_s(draft_node_s)
    status, nodes, tokens, time_s, hits, misses = kernels.search.greedy_subtree(
        *_tree_arrays(tree), experts, packed(cached), cached.shape[1], cost.params,
        int(draft_levels), draft_node_s)
    return kernel_selection(status, tree, experts, cached, draft_levels, draft_node_s, nodes, tokens, time_s, hits, misses)


def max_weight_closure(weights: np.ndarray, requires: list[tuple[int, int]]) -> np.ndarray:
    """The minimal maximum-weight closed set: bool mask over ``weights``; ``(u, v)`` in
    ``requires`` means u can only be chosen together with v. Solved as one s-t minimum cut
    (Dinic's algorithm on float capacities). The weights must be finite; a gain smaller than
    ``GAIN_EPS`` plus ``FLOW_REL`` times the sum of the weights' magnitudes (what the flow's float
    subtractions round off) counts as none (a tie: the smaller set)."""
    try:
        weights = np.ascontiguousarray(weights, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError("weights: expected a 1-D array of finite numbers") from None
    if weights.ndim != 1:
        raise ValueError(f"weights: expected a 1-D array of finite numbers, got shape {weights.shape}")
    if not np.isfinite(weights).all():
        bad = int(np.flatnonzero(~np.isfinite(weights))[0])
        raise ValueError(f"weights: expected finite numbers, got {weights[bad]} at index {bad}")
    try:
        given = np.asarray(requires, dtype=np.float64).reshape(-1, 2)
    except (TypeError, ValueError):
        given = np.full((1, 2), np.nan)
    if given.size and not (np.isfinite(given).all() and (given == np.round(given)).all() and given.min() >= 0
                           and given.max() < weights.size):
        raise ValueError(f"requires: expected pairs of integer indices into {weights.size} weights")
    pairs = given.astype(np.int64)
    return kernels.closure.closure_of_weights(weights, np.ascontiguousarray(pairs[:, 0]),
                                              np.ascontiguousarray(pairs[:, 1]), GAIN_EPS)


def uncertainty_price_s(cost: CostModel, n_layers: int, top_k: int, precision: float,
                        resident_share: float = 0.0) -> float:
    """Expected extra seconds per draft node when a share ``1 - precision`` of its predicted
    experts is wrong: each wrong slot's true expert is a miss the search did not see unless it is
    resident (probability ``resident_share``, e.g. the cache's share of each layer), while the
    wrong prediction it replaces was priced at least as a hit."""
    if not 0.0 <= precision <= 1.0:
        raise ValueError(f"precision: expected a share in [0, 1], got {precision!r}")
    if not 0.0 <= resident_share <= 1.0:
        raise ValueError(f"resident_share: expected a share in [0, 1], got {resident_share!r}")
    return float(kernels.decide.precision_price(float(precision), int(n_layers), int(top_k), float(resident_share),
                                                cost.transfer_s))


def should_continue(previous: Selection | None, current: Selection) -> bool:
    """The per-level stopping rule: after drafting a level, keep drafting only when the best
    subtree with it (charged its draft cost) beats the best without it, and uses the new level."""
    if previous is None:
        return True
    # a subtree without the new level was available one level earlier, at less draft cost, so
    # beating the previous best implies using the new level
    return _better(current, previous)
