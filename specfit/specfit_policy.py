"""SpecFit's policy: the exact max-throughput subtree after every drafted level, and when to stop.

After each level the exact search (:func:`specfit.search.best_subtree`) finds the subtree with the
highest predicted throughput; drafting goes on while the level paid for itself
(:func:`specfit.search.should_continue`) or the expected next level would
(:func:`specfit.next_level.expected_level`), and a level-0 test declines to draft after first levels
that could not pay. What the policy decides with:

- **Prices.** Per draft node, the experts its predictor gets wrong (uncertainty price from the
  observed slot precision, :func:`specfit.search.uncertainty_price_s`); per drafted level and for
  the level-0 decision, SpecFit's own overhead (``overhead_level_s``: fixed, or learned from the
  decision time a driver measures, :attr:`Observation.decision_time_s`). The overhead enters the
  cost model the search ranks with (``draft_level_s`` and ``base_s`` grow by it), so it is part of
  the predicted time, and the search stays exact for it: it is the same formula.
- **Acceptance.** The tree's path probabilities, or an online calibration of them
  (:class:`specfit.experts.acceptance_online.OnlineAcceptance`) learned from every cycle's verdicts.
"""

from __future__ import annotations

from collections import deque

from .next_level import LevelStats, expected_level, optimistic_level
from .policy_base import CycleView, Observation, Policy, edge_outcomes
from .search import Selection, best_subtree, should_continue, uncertainty_price_s

__all__ = ["SpecFitPolicy", "LOOKAHEADS", "PRICES"]

LOOKAHEADS = ("expected", "optimistic", "none")
PRICES = ("observed", "precision", "none")
# observed prices forget at this rate per cycle that verified draft nodes
_PRICE_MEMORY = 0.99


class SpecFitPolicy(Policy):
    """Exact max-throughput subtree after every level; stop drafting when neither this level nor
    the expected next one pays.

    Args:
        max_levels: levels drafted at most.
        price_uncertainty: price, per draft node, the experts its prediction gets wrong:
            ``"observed"`` (True): the misses verified draft nodes turned out to have beyond their
            predicted ones (what each driver reports in :class:`Observation`), with the
            precision-based bound until ``min_observed`` draft nodes have been verified;
            ``"precision"``: that bound alone (:func:`specfit.search.uncertainty_price_s`);
            ``"none"`` (False): no price.
        lookahead: ``"expected"`` (the next level from the statistics of drafted levels),
            ``"optimistic"`` (children at the level's best probability with their parents' experts)
            or ``"none"``; ``True`` / ``False`` mean ``"expected"`` / ``"none"``.
        first_level_test: decline to draft when recent first levels could not have paid.
        overhead_level_s: SpecFit's own time per decision (search and bookkeeping of one level);
            None learns it from the drivers' measurements (0 until one is reported).
        acceptance: an online acceptance calibrator applied to every tree before the search, learned
            from the verdicts; None uses the tree's probabilities as they come.
    """

    name = "specfit"

    def __init__(self, max_levels: int = 8, price_uncertainty="observed", lookahead="expected",
                 first_level_test: bool = True, overhead_level_s: float | None = None, acceptance=None,
                 min_observed: int = 16):
        self.max_levels = int(max_levels)
        lookahead = {True: "expected", False: "none"}.get(lookahead, lookahead)
        if lookahead not in LOOKAHEADS:
            raise ValueError(f"lookahead: expected one of {LOOKAHEADS}, got {lookahead!r}")
        if overhead_level_s is not None and not overhead_level_s >= 0:
            raise ValueError(f"overhead_level_s: expected seconds >= 0 or None, got {overhead_level_s!r}")
        self.lookahead, self.first_level_test = lookahead, bool(first_level_test)
        price_uncertainty = {True: "observed", False: "none"}.get(price_uncertainty, price_uncertainty)
        if price_uncertainty not in PRICES:
            raise ValueError(f"price_uncertainty: expected one of {PRICES}, got {price_uncertainty!r}")
        self.price_uncertainty = price_uncertainty
        # observed mode: misses beyond the predicted ones, per verified draft node (exponential sums)
        self.min_observed = int(min_observed)
        self._extra_misses = self._draft_nodes = 0.0
        self._n_observed = 0
        self.acceptance = acceptance
        self.fixed_overhead_s = overhead_level_s
        self.overhead_level_s = 0.0 if overhead_level_s is None else float(overhead_level_s)
        self._slots = self._slots_right = 0
        self._resident_share = 0.0
        self.draft_node_s = 0.0
        self.stats = LevelStats(max_depth=max(self.max_levels, 1))
        self._best: Selection | None = None
        self._previous: Selection | None = None
        self._levels = -1
        self._cost_key = None
        self._cost = None
        self._view_key = None
        self._view: CycleView | None = None
        # across cycles: the best level-1 path probability and width of recently drafted first
        # levels, and how many cycles in a row the level-0 test has declined to draft
        self._recent_first = deque(maxlen=8)
        self._declined = 0

    def begin_cycle(self) -> None:
        self._best = self._previous = None
        self._levels = -1
        self._view_key = self._view = None

    # ------------------------------------------------------------------ learning
    def observe(self, observation: Observation) -> None:
        self._slots += observation.predicted_slots
        self._slots_right += observation.predicted_slots_right
        if observation.resident_share is not None:
            self._resident_share = observation.resident_share
        if self.fixed_overhead_s is None and observation.decision_time_s is not None:
            per_decision = observation.decision_time_s / (observation.draft_levels + 1)
            self.overhead_level_s = per_decision if self.overhead_level_s == 0 else \
                0.9 * self.overhead_level_s + 0.1 * per_decision
        o = observation
        if o.misses is not None and o.verified is not None and o.verified.size > 1 and o.root_misses is not None:
            # misses the draft nodes added beyond their prediction: the root's own errors are paid
            # by every candidate subtree alike, so they are left out
            extra = (o.misses - o.root_misses) - (o.predicted_misses - o.root_predicted_misses)
            self._extra_misses = _PRICE_MEMORY * self._extra_misses + extra
            self._draft_nodes = _PRICE_MEMORY * self._draft_nodes + (o.verified.size - 1)
            self._n_observed += o.verified.size - 1
        if self.acceptance is not None and observation.tree is not None:
            nodes, accepted = edge_outcomes(observation)
            self.acceptance.update(observation.tree, nodes, accepted)

    # ------------------------------------------------------------------ what the search sees
    def _decision_view(self, view: CycleView) -> CycleView:
        """The view with the calibrated tree and the cost model that carries the overhead."""
        key = (id(view.tree), view.draft_levels)
        if self._view_key == key:
            return self._view
        cost = self._priced_cost(view.cost)
        tree = view.tree if self.acceptance is None else self.acceptance.calibrated(view.tree)
        self._view = CycleView(tree, view.experts, view.cached, cost, view.draft_levels, view.verdicts,
                               view.true_experts)
        self._view_key = key
        return self._view

    def _priced_cost(self, cost):
        o = self.overhead_level_s
        if o <= 0:
            return cost
        key = (id(cost), o)
        if self._cost_key != key:
            self._cost = cost.replace(base_s=cost.base_s + o, draft_level_s=cost.draft_level_s + o)
            self._cost_key = key
        return self._cost

    def _price(self, view: CycleView) -> float:
        mode = self.price_uncertainty
        if mode == "none":
            return 0.0
        if mode == "observed" and self._n_observed >= self.min_observed and self._draft_nodes > 0:
            per_node = max(self._extra_misses / self._draft_nodes, 0.0)
            return per_node * max(view.cost.miss_s - view.cost.hit_s, 0.0)
        if not self._slots:
            return 0.0
        _, n_layers, top_k = view.experts.shape
        return uncertainty_price_s(view.cost, n_layers, top_k, self._slots_right / self._slots,
                                   resident_share=self._resident_share)

    def _search(self, view: CycleView) -> Selection:
        if self._levels != view.draft_levels or self._best is None:
            if self._levels < 0:
                self.draft_node_s = self._price(view)    # one price per cycle
            self._previous = self._best
            # the previous level's answer is still a valid subtree: a warm start for Dinkelbach
            start = None if self._previous is None else self._previous.nodes
            self._best = best_subtree(view.tree, view.experts, view.cached, view.cost, view.draft_levels, start=start,
                                      draft_node_s=self.draft_node_s)
            self._levels = view.draft_levels
        return self._best

    # ------------------------------------------------------------------ the two decisions
    def keep_drafting(self, view: CycleView) -> bool:
        if view.draft_levels >= self.max_levels:
            return False
        view = self._decision_view(view)
        if view.draft_levels == 0:
            root = self._search(view)
            return self._first_level_may_pay(view, root) if self.first_level_test else root.time_s > 0
        if view.draft_levels == 1:
            first = view.tree.level(1)
            if first.size:
                self._recent_first.append((float(view.tree.path_probs[first].max()), int(first.size)))
        self.stats.update(view.tree, view.experts, view.draft_levels)
        current = self._search(view)
        if should_continue(self._previous, current):
            return True
        return self.lookahead != "none" and self._next_level_may_pay(view, current)

    def select(self, view: CycleView) -> Selection:
        # the whole drafted tree with the levels actually spent: no earlier subtree is missed
        return self._search(self._decision_view(view))

    def _first_level_may_pay(self, view: CycleView, root: Selection) -> bool:
        """Whether drafting level 1 can beat verifying the root alone.

        k first-level nodes with path probability at most p add at most k p tokens and cost at
        least d + k c (d: a draft level, c: per node plus its price), so they pay only if
        p T0 > c + d / k, T0 the root's cycle time. With p = 1 this is a bound that holds for any
        drafter; with p and k from recently drafted first levels it stops a drafter that has been
        useless, and every 16th declined cycle drafts anyway to notice when it improves.
        """
        c = view.cost.per_node_s + self.draft_node_s
        if root.time_s <= c:
            return False
        if self._recent_first and self._declined < 16:
            p = max(prob for prob, _ in self._recent_first)
            k = max(width for _, width in self._recent_first)
            if p * root.time_s <= c + view.cost.draft_level_s / k:
                self._declined += 1
                return False
        self._declined = 0
        return True

    def _next_level_may_pay(self, view: CycleView, current: Selection) -> bool:
        """Whether the best subtree with one more (virtual) level, charged that level, beats the
        current best: the expected level of :func:`specfit.next_level.expected_level`, or the
        optimistic one."""
        d = view.draft_levels
        if self.lookahead == "expected":
            grown = expected_level(view.tree, view.experts, view.cached, self.stats, d)
            if grown is None:
                return False
            tree, experts, cached = grown
            # a bound that saves the search: a subtree S with the virtual level has A(S) <= A_r + x
            # (x: all virtual probability) and T(S) >= T_r + d (one more level), where A_r <= R T_r
            # for its real part (R: the current best ratio); so A(S) / T(S) <= R whenever x <= R d
            extra = float(tree.path_probs[view.tree.n_nodes:].sum())
            bound_tokens = current.expected_tokens + extra
            bound_time = current.priced_time_s + view.cost.draft_level_s
            if bound_tokens * current.priced_time_s <= current.expected_tokens * bound_time:
                return False
        else:
            grown = optimistic_level(view.tree, view.experts, d)
            if grown is None:
                return False
            (tree, experts), cached = grown, view.cached
        ahead = best_subtree(tree, experts, cached, view.cost, d + 1, start=current.nodes,
                             draft_node_s=self.draft_node_s)
        return should_continue(current, ahead)
