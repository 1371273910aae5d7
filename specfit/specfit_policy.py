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

The rules run compiled (:mod:`specfit.kernels.decide`): :meth:`SpecFitPolicy.keep_drafting` calls
:func:`~specfit.kernels.decide.decide_level` once per drafted level, as the live decoder drives it,
and the replay runs whole cycles of the same kernels (:func:`~specfit.kernels.replay.replay_specfit`)
when no lever and no acceptance calibrator is attached. The policy's state (the observed price, the
slot precision, the level-0 test's memory, :class:`~specfit.next_level.LevelStats`) lives in the
arrays those kernels update in place, so either driver leaves it the same.
"""

from __future__ import annotations

import numpy as np

from . import kernels
from .next_level import LevelStats
from .policy_base import CycleView, Observation, Policy, edge_outcomes
from .search import Selection, best_subtree, check_draft_node_s, kernel_selection, packed, validated

__all__ = ["SpecFitPolicy", "LOOKAHEADS", "PRICES"]

_LOOKAHEAD_CODES = {"expected": 1, "optimistic": 2, "none": 0}     # kernels.decide.EXPECTED, OPTIMISTIC, NONE
_PRICE_CODES = {"observed": 2, "precision": 1, "none": 0}          # kernels.decide.OBSERVED, PRECISION, NO_PRICE
LOOKAHEADS, PRICES = tuple(_LOOKAHEAD_CODES), tuple(_PRICE_CODES)


class _Setting:
    """A SpecFit setting stored in the configuration array the compiled rules read (slot ``slot``
    of :mod:`specfit.kernels.decide`), so a change after construction reaches them: a named choice
    (``codes``: name -> code, ``aliases`` for True / False) or a plain ``kind``."""

    def __init__(self, slot: str, codes: dict | None = None, aliases: dict | None = None, kind=int):
        self.slot, self.codes, self.aliases, self.kind = slot, codes, aliases or {}, kind
        self.names = None if codes is None else {code: name for name, code in codes.items()}

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, policy, owner=None):
        if policy is None:
            return self
        value = int(policy._conf[getattr(kernels.decide, self.slot)])
        return self.kind(value) if self.codes is None else self.names[value]

    def __set__(self, policy, value) -> None:
        if self.codes is None:
            value = self.kind(value)
        else:
            value = self.aliases.get(value, value)
            if value not in self.codes:
                raise ValueError(f"{self.name}: expected one of {tuple(self.codes)}, got {value!r}")
            value = self.codes[value]
        policy._conf[getattr(kernels.decide, self.slot)] = value


_RECENT_FIRST = 8     # first levels the level-0 test remembers
MAX_LEVELS = int(np.iinfo(np.int16).max)     # the deepest draft level a trace can record (depth is int16)
_NO_NODES = np.zeros(0, dtype=np.int64)


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
        if overhead_level_s is not None and not overhead_level_s >= 0:
            raise ValueError(f"overhead_level_s: expected seconds >= 0 or None, got {overhead_level_s!r}")
        if int(max_levels) < 1:
            raise ValueError(f"policy 'specfit:{max_levels}': expected D >= 1 draft levels (specfit:0 would be ar)")
        if int(max_levels) > MAX_LEVELS:      # its per-level state is [D + 2, ranks]: 10**12 levels, 116 TiB
            raise ValueError(f"policy 'specfit:{max_levels}': expected D <= {MAX_LEVELS} draft levels (a trace records "
                             f"a node's depth in int16)")
        d = kernels.decide
        # the state the compiled rules (specfit.kernels.decide) read and update in place: the
        # configuration (its settings below are properties that write it, so a setting changed
        # after construction reaches the compiled rules), the observed price's sums, the slot
        # precision, the level-0 test's memory of recent first levels (best path probability,
        # width) and the cycle's price per draft node
        self._conf = np.zeros(d.N_CONF, dtype=np.int64)
        self._conf[d.MAX_LEVELS] = int(max_levels)
        self.lookahead, self.first_level_test = lookahead, first_level_test
        self.price_uncertainty, self.min_observed = price_uncertainty, min_observed
        self.acceptance = acceptance
        self.fixed_overhead_s = overhead_level_s
        self.overhead_level_s = 0.0 if overhead_level_s is None else float(overhead_level_s)
        self.stats = LevelStats(max_depth=max(self.max_levels, 1))
        self._fstate = np.zeros(d.N_FSTATE)
        self._istate = np.zeros(d.N_ISTATE, dtype=np.int64)
        self._recent_p = np.zeros(_RECENT_FIRST)
        self._recent_w = np.zeros(_RECENT_FIRST, dtype=np.int64)
        self._best: tuple | None = None       # this cycle's best so far, as the kernel answers it
        self._previous: tuple | None = None
        self._levels = -1
        self._cost_key = None
        self._cost = None
        self._view_key = None
        self._view: CycleView | None = None
        self._params_of = self._params = None

    # ------------------------------------------------------------------ settings (in the compiled configuration)
    @property
    def max_levels(self) -> int:
        """Levels drafted at most (fixed at construction: the level statistics are sized by it)."""
        return int(self._conf[kernels.decide.MAX_LEVELS])

    lookahead = _Setting("LOOKAHEAD", _LOOKAHEAD_CODES, {True: "expected", False: "none"})
    price_uncertainty = _Setting("PRICE", _PRICE_CODES, {True: "observed", False: "none"})
    first_level_test = _Setting("FIRST_LEVEL_TEST", kind=bool)
    min_observed = _Setting("MIN_OBSERVED", kind=int)

    @property
    def draft_node_s(self) -> float:
        """This cycle's price per draft node (s)."""
        return float(self._fstate[kernels.decide.NODE_PRICE])

    @property
    def state(self) -> tuple:
        """The arrays the compiled rules take after the tree's (``conf, fstate, istate, recent_p,
        recent_w`` and the level statistics'), in :func:`specfit.kernels.decide.decide_level`'s order."""
        self._fstate[kernels.decide.STATS_MEMORY] = self.stats.memory    # the statistics' own rate
        return (self._conf, self._fstate, self._istate, self._recent_p, self._recent_w, *self.stats.arrays)

    def begin_cycle(self) -> None:
        self._best = self._previous = None
        self._levels = -1
        self._view_key = self._view = None

    # ------------------------------------------------------------------ learning
    def observe(self, observation: Observation) -> None:
        d = kernels.decide
        self._istate[d.SLOTS] += observation.predicted_slots
        self._istate[d.SLOTS_RIGHT] += observation.predicted_slots_right
        if observation.resident_share is not None:
            self._fstate[d.RESIDENT_SHARE] = observation.resident_share
        if self.fixed_overhead_s is None and observation.decision_time_s is not None:
            per_decision = observation.decision_time_s / (observation.draft_levels + 1)
            self.overhead_level_s = per_decision if self.overhead_level_s == 0 else \
                0.9 * self.overhead_level_s + 0.1 * per_decision
        o = observation
        if o.verified is not None and None not in (o.misses, o.root_misses, o.predicted_misses,
                                                    o.root_predicted_misses):
            d.observe_cycle(self._fstate, self._istate, int(o.verified.size), int(o.misses), int(o.root_misses),
                            int(o.predicted_misses), int(o.root_predicted_misses))
        if self.acceptance is not None and observation.tree is not None:
            nodes, accepted = edge_outcomes(observation)
            self.acceptance.update(observation.tree, nodes, accepted)

    # ------------------------------------------------------------------ what the search sees
    def _decision_view(self, view: CycleView) -> CycleView:
        """The view with the calibrated tree and the cost model that carries the overhead."""
        if self._view_key is not None and self._view_key[0] is view.tree and self._view_key[1] == view.draft_levels:
            return self._view
        cost = self._priced_cost(view.cost)
        if cost is not self._params_of:       # one parameter array per cost model (a cycle's)
            self._params, self._params_of = cost.params, cost
        tree = view.tree if self.acceptance is None else self.acceptance.calibrated(view.tree)
        self._view = CycleView(tree, view.experts, view.cached, cost, view.draft_levels, view.verdicts,
                               view.true_experts)
        self._view_key = (view.tree, view.draft_levels)     # the tree held: an id could be a later tree's
        return self._view

    def _priced_cost(self, cost):
        o = self.overhead_level_s
        if o <= 0:
            return cost
        # keyed by the model itself, held: a key of its id would match a later model at a freed one's
        # address (the online refit makes a model per cycle)
        if self._cost_key is None or self._cost_key[0] is not cost or self._cost_key[1] != o:
            self._cost = cost.scaled(1.0, plus_base_s=o, plus_draft_level_s=o)
            self._cost_key = (cost, o)
        return self._cost

    def _price_once(self, view: CycleView) -> float:
        """The cycle's price per draft node, set at its first search (one price per cycle)."""
        d = kernels.decide
        if self._levels < 0:
            _, n_layers, top_k = view.experts.shape
            self._fstate[d.NODE_PRICE] = check_draft_node_s(d.node_price(
                self._conf, self._fstate, self._istate, n_layers, top_k, view.cost.hit_s, view.cost.miss_s))
        return self.draft_node_s

    # ------------------------------------------------------------------ the two decisions
    def keep_drafting(self, view: CycleView) -> bool:
        levels = int(view.draft_levels)
        if levels >= self._conf[kernels.decide.MAX_LEVELS]:
            return False
        view = self._decision_view(view)
        tree = view.tree
        experts, cached = validated(tree, view.experts, view.cached, view.cost, levels)
        price = self._price_once(view)
        previous = self._previous if self._levels == levels else self._best
        # a level's best stays the kernel's raw answer (nodes, tokens, time, hits, misses, levels,
        # price) until select() makes the one Selection of the cycle
        start, prev_tokens, prev_s = (_NO_NODES, 0.0, 0.0) if previous is None else previous[:3]
        status, go_on, *best = kernels.decide.decide_level(
            np.array(tree.parents), np.array(tree.path_probs), experts, packed(cached), cached.shape[1],
            self._params, levels, *self.state, start, prev_tokens, prev_s)
        if status != kernels.search.OK:
            kernel_selection(status, tree, experts, cached, levels, price, *best)   # words the error
        self._previous, self._best, self._levels = previous, (*best, levels, price), levels
        return bool(go_on)

    def select(self, view: CycleView) -> Selection:
        # the model the selection is priced with: live, the rest of the cycle at its drafter's pace
        # (the decisions while drafting had the cycle start's)
        cost = self._priced_cost(view.cost)
        # the whole drafted tree with the levels actually spent: no earlier subtree is missed
        view = self._decision_view(view)
        if self._levels != view.draft_levels or self._best is None:
            price = self._price_once(view)
            self._previous = self._best
            start = None if self._previous is None else self._previous[0]
            best = best_subtree(view.tree, view.experts, view.cached, view.cost, view.draft_levels, start=start,
                                draft_node_s=price)
            self._best = (best.nodes, best.expected_tokens, best.time_s, best.hits, best.misses, best.draft_levels, price)
            self._levels = view.draft_levels
        nodes, tokens, time_s, hits, misses, levels, price = self._best
        if cost is not view.cost:           # the last level's search had the cycle start's model
            time_s = cost.time_s(levels, nodes.size, hits, misses)
        return Selection(nodes=nodes, expected_tokens=float(tokens), time_s=float(time_s), hits=int(hits),
                         misses=int(misses), draft_levels=int(levels), price_s=price * (nodes.size - 1))
