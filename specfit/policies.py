"""Policies: which draft nodes to verify, and when to stop drafting.

A policy sees the cycle's tree level by level (a :class:`CycleView` after each drafted level) and
answers two questions: ``keep_drafting(view)`` (draft another level?) and, once drafting stops,
``select(view)`` (which ancestor-closed nodes to verify, with the predicted outcome). After the
target has verified, both drivers tell the policy what the cycle revealed through
:meth:`Policy.observe` (an :class:`Observation`). The simulator and the live decoder drive the same
policy objects: the simulator through :func:`choose` on a recorded tree, the live decoder level by
level as the drafter produces them.

Policies are built from spec strings by :func:`make_policy`; :data:`POLICIES` is the one registry of
the grammar (:data:`POLICY_HELP` is written from it):

- ``ar``: no speculation, the root alone.
- ``chain:K``: draft K levels of the drafter's top-1 (a chain), verify it.
- ``eagle3[:N[:D]]``: EAGLE-2/3 dynamic tree: draft D levels (default 7), keep the N nodes
  (default 60, root included) with the highest path probabilities (rerank).
- ``eagle3-nocache``: ``eagle3`` with no expert cache (every expert streamed), the "vanilla"
  offloaded setup (simulator only).
- ``static:N``: the same rerank with N nodes (root included) and depth N - 1 capped at the
  drafted depth: a fixed tree size.
- ``static:auto``: ``static:N`` with the N that is best on the trace, cache size and cost model (a
  strong baseline that knows the trace; simulator only, which tries every candidate).
- ``specfit``: the exact max-throughput search after every level; stop drafting as soon as a level
  does not improve the best predicted throughput.
- ``oracle``: knows the target's verdicts and true experts: drafts exactly the accepted path and
  verifies the prefix of it with the best true throughput (an upper bound, simulator only).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .costmodel import CostModel
from .search import Selection, best_subtree, evaluate, should_continue, uncertainty_price_s
from .tree import DraftTree

__all__ = [
    "CycleView", "Observation", "Policy", "ArPolicy", "ChainPolicy", "RerankPolicy", "SpecFitPolicy", "OraclePolicy",
    "TunedPolicy", "PolicySpec", "POLICIES", "rerank", "POLICY_HELP", "DEFAULT_POLICIES", "make_policy", "choose",
    "STATIC_AUTO_SIZES",
]


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

    def truncated(self, levels: int) -> "CycleView":
        """The view after only ``levels`` levels (nodes of a level-by-level tree come in depth
        order, so the first levels are a prefix of the arrays)."""
        keep = np.flatnonzero(self.tree.depth <= levels)
        if keep.size == self.tree.n_nodes:
            return CycleView(self.tree, self.experts, self.cached, self.cost, levels, self.verdicts, self.true_experts)
        if not np.array_equal(keep, np.arange(keep.size)):
            raise ValueError("tree: expected nodes in order of depth (drafted level by level)")
        n = keep.size
        return CycleView(
            tree=self.tree.subtree(keep), experts=self.experts[:n], cached=self.cached, cost=self.cost,
            draft_levels=levels,
            verdicts=None if self.verdicts is None else self.verdicts[:n],
            true_experts=None if self.true_experts is None else self.true_experts[:n],
        )

    def evaluate(self, nodes) -> Selection:
        return evaluate(self.tree, nodes, self.experts, self.cached, self.cost, self.draft_levels)


@dataclass(frozen=True)
class Observation:
    """What verification revealed, reported to :meth:`Policy.observe` by either driver.

    ``predicted_slots`` counts the (layer, rank) expert slots predicted for verified draft nodes,
    ``predicted_slots_right`` those naming an expert the node really routed to; the live decoder
    reports each cycle's, the simulator the whole trace's at once (its predictions are made for the
    whole trace up front). ``resident_share`` is the share of each layer the expert cache can hold.
    """

    predicted_slots: int = 0
    predicted_slots_right: int = 0
    resident_share: float = 0.0


class Policy(ABC):
    """Base class. ``max_levels`` bounds drafting; subclasses override the two decisions.

    Class attributes a driver reads: ``needs_truth`` (decides with the target's verdicts: replay
    only), ``draft_top_k`` (how the tree should be drafted: children per node and frontier width;
    None means the run's setting), ``cache_capacity`` (an expert-cache size the policy imposes, None:
    the run's), ``simulator_only`` (cannot run live).
    """

    name = "policy"
    max_levels = 0
    needs_truth = False
    draft_top_k: int | None = None
    cache_capacity: int | None = None
    simulator_only = False

    def begin_cycle(self) -> None:
        """Forget per-cycle state; called before level 0 of every cycle."""

    def observe(self, observation: Observation) -> None:
        """Learn from a verified cycle (or a whole trace); nothing by default."""

    def keep_drafting(self, view: CycleView) -> bool:
        return view.draft_levels < self.max_levels

    @abstractmethod
    def select(self, view: CycleView) -> Selection:
        """The nodes to verify (ancestor-closed, with the root) and their predicted outcome."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class ArPolicy(Policy):
    name = "ar"

    def select(self, view: CycleView) -> Selection:
        return view.evaluate([0])


class ChainPolicy(Policy):
    """Draft K levels, verify the chain that follows the most probable child at each level. Live,
    the chain is drafted as a chain (top-1 at every level), as EAGLE's chain mode does."""

    draft_top_k = 1

    def __init__(self, k: int):
        if k < 1:
            raise ValueError(f"policy 'chain:{k}': expected K >= 1 draft levels (chain:0 would be ar)")
        self.max_levels = int(k)
        self.name = f"chain:{k}"

    def select(self, view: CycleView) -> Selection:
        children = view.tree.children()
        probs = view.tree.path_probs
        chain = [0]
        while len(chain) <= self.max_levels and children[chain[-1]].size:
            kids = children[chain[-1]]
            chain.append(int(kids[np.argmax(probs[kids])]))  # first of equals: the drafter's order
        return view.evaluate(chain)


class RerankPolicy(Policy):
    """EAGLE-2/3 rerank: after a fixed number of levels keep the ``total_nodes`` nodes (root
    included) with the highest path probability; a child never outscores its parent, so the kept
    set is connected (ties keep the earlier node, which a parent always is)."""

    def __init__(self, total_nodes: int, depth: int, name: str, cache_capacity: int | None = None):
        if total_nodes < 2 or depth < 1:
            raise ValueError(f"policy {name!r}: expected N >= 2 nodes (root included) and depth >= 1, got N={total_nodes}, "
                             f"depth={depth} (a tree of the root alone is ar)")
        self.total_nodes, self.max_levels, self.name = int(total_nodes), int(depth), name
        if cache_capacity is not None:     # a cache the run does not have: only a replay can impose it
            self.cache_capacity, self.simulator_only = int(cache_capacity), True

    def select(self, view: CycleView) -> Selection:
        return view.evaluate(rerank(view.tree, self.total_nodes))


def rerank(tree: DraftTree, total_nodes: int) -> np.ndarray:
    """EAGLE's rerank: the ``total_nodes`` nodes (root included) with the highest path probability,
    ties to the earlier node; sorted ids of an ancestor-closed set."""
    probs = tree.path_probs
    order = np.lexsort((np.arange(probs.size), -probs))   # by probability desc, then index
    return tree.closure(np.sort(order[:total_nodes]))


class SpecFitPolicy(Policy):
    """Exact max-throughput subtree after every level; keep drafting while a level pays for itself
    or a one-level look-ahead says the next one could."""

    name = "specfit"

    def __init__(self, max_levels: int = 8, price_uncertainty: bool = True, lookahead: bool = True,
                 first_level_test: bool = True):
        self.max_levels = int(max_levels)
        # ablation switches (benchmarks/bench_policy.py): the one-level look-ahead of the stopping
        # rule and the level-0 test that declines to draft after useless first levels
        self.lookahead, self.first_level_test = bool(lookahead), bool(first_level_test)
        # price per draft node for the experts its prediction gets wrong (search.uncertainty_price_s),
        # from the precision observed so far; 0 until a verified draft node has been observed
        self.price_uncertainty = bool(price_uncertainty)
        self._slots = self._slots_right = 0
        self._resident_share = 0.0
        self.draft_node_s = 0.0
        self._best: Selection | None = None
        self._previous: Selection | None = None
        self._levels = -1
        # across cycles: the best level-1 path probability and width of recently drafted first
        # levels, and how many cycles in a row the level-0 test has declined to draft
        self._recent_first = deque(maxlen=8)
        self._declined = 0

    def begin_cycle(self) -> None:
        self._best = self._previous = None
        self._levels = -1

    def observe(self, observation: Observation) -> None:
        self._slots += observation.predicted_slots
        self._slots_right += observation.predicted_slots_right
        self._resident_share = observation.resident_share

    def _price(self, view: CycleView) -> float:
        if not self.price_uncertainty or not self._slots:
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

    def keep_drafting(self, view: CycleView) -> bool:
        if view.draft_levels >= self.max_levels:
            return False
        if view.draft_levels == 0:
            root = self._search(view)
            return self._first_level_may_pay(view, root) if self.first_level_test else root.time_s > 0
        if view.draft_levels == 1:
            first = view.tree.level(1)
            if first.size:
                self._recent_first.append((float(view.tree.path_probs[first].max()), int(first.size)))
        current = self._search(view)
        return should_continue(self._previous, current) or (self.lookahead and self._next_level_may_pay(view, current))

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
        """A level can fail to pay while the one after it would (a long accepted chain whose first
        steps alone do not cover their draft cost). Look one virtual level ahead: each node of the
        newest level gets a child with its path probability times the conditional probability of
        the level's most probable node, routed to its parent's experts (no new expert: optimistic on cost), and
        drafting goes on when the best subtree with it, charged one more level, beats the current."""
        tree, d = view.tree, view.draft_levels
        frontier = tree.level(d)
        if frontier.size == 0:
            return False
        # the conditional probability of the level's most probable node: the drafter's confidence
        # one step further along the branch most worth extending
        top = frontier[np.argmax(tree.path_probs[frontier])]
        parent_p = tree.path_probs[tree.parents[top]]
        q = min(float(tree.path_probs[top] / parent_p), 1.0) if parent_p > 0 else 0.0
        if q <= 0:
            return False
        virtual = DraftTree(parents=np.concatenate([tree.parents, frontier]),
                            path_probs=np.concatenate([tree.path_probs, tree.path_probs[frontier] * q]))
        experts = np.concatenate([view.experts, view.experts[frontier]])
        ahead = best_subtree(virtual, experts, view.cached, view.cost, d + 1, start=current.nodes,
                             draft_node_s=self.draft_node_s)
        return should_continue(current, ahead)

    def select(self, view: CycleView) -> Selection:
        # the whole drafted tree with the levels actually spent: no earlier subtree is missed
        return self._search(view)


class OraclePolicy(Policy):
    """Knows the verdicts and the true experts; verifies the best prefix of the accepted path."""

    name = "oracle"
    needs_truth = True
    simulator_only = True

    def __init__(self, max_levels: int = 64):
        self.max_levels = int(max_levels)

    def keep_drafting(self, view: CycleView) -> bool:
        # the oracle decides on the full tree; the driver gives it every level
        return view.draft_levels < self.max_levels

    def select(self, view: CycleView) -> Selection:
        if view.verdicts is None or view.true_experts is None:
            raise ValueError("oracle: needs the target's verdicts and true experts (a full trace)")
        path = view.tree.accepted_path(view.verdicts)
        best = None
        for j in range(path.size):
            prefix = path[: j + 1]
            sel = evaluate(view.tree, prefix, view.true_experts, view.cached, view.cost, draft_levels=j)
            # every node on the accepted path is accepted: it commits j + 1 tokens for sure
            sel = Selection(nodes=prefix, expected_tokens=float(j + 1), time_s=sel.time_s, hits=sel.hits,
                            misses=sel.misses, draft_levels=j)
            if best is None or sel.expected_tokens * best.time_s > best.expected_tokens * sel.time_s:
                best = sel
        return best


class TunedPolicy(RerankPolicy):
    """A family of fixed policies of which a driver that can replay them all (the simulator) keeps
    the best: ``static:auto`` is ``static:N`` for the best N of :meth:`candidates`. Run alone it
    behaves like its first candidate's rerank, which no driver does."""

    simulator_only = True

    def __init__(self, name: str, sizes: tuple[int, ...], max_levels: int):
        super().__init__(sizes[0], max(1, min(sizes[0] - 1, max_levels)), name=name)
        self.sizes, self.max_levels_cap = tuple(sizes), int(max_levels)

    def candidates(self, max_nodes: int) -> list[Policy]:
        """The fixed policies to try on trees of at most ``max_nodes`` nodes."""
        sizes = [n for n in self.sizes if n <= max_nodes] or [max(2, max_nodes)]
        return [make_policy(f"static:{n}", self.max_levels_cap) for n in sizes]


# static:auto tries these tree sizes (root included)
STATIC_AUTO_SIZES = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


@dataclass(frozen=True)
class PolicySpec:
    """One entry of the policy grammar: ``name`` with up to ``n_args`` integer parameters (or the
    literal forms in ``grammar``), built by ``build(args, max_levels)``."""

    grammar: str
    help: str
    build: Callable[[list[int], int], Policy]
    n_args: tuple[int, ...] = (0,)


def _rerank(name: str):
    def build(args: list[int], max_levels: int) -> Policy:
        total, depth = (args + [60, 7][len(args):])[:2]
        return RerankPolicy(total, depth, name=name if not args else f"{name}:" + ":".join(map(str, args)))
    return build


POLICIES: dict[str, PolicySpec] = {
    "ar": PolicySpec("ar", "no speculation", lambda a, m: ArPolicy()),
    "chain": PolicySpec("chain:K", "a chain of K draft tokens", lambda a, m: ChainPolicy(a[0]), n_args=(1,)),
    "eagle3": PolicySpec("eagle3[:N[:D]]", "EAGLE-3's tree: N nodes (60) of D levels (7)", _rerank("eagle3"),
                         n_args=(0, 1, 2)),
    "eagle3-nocache": PolicySpec("eagle3-nocache", "eagle3 with no expert cache (simulator)",
                                 lambda a, m: RerankPolicy(60, 7, name="eagle3-nocache", cache_capacity=0)),
    "static": PolicySpec("static:N|static:auto", "the best N nodes of the tree; auto: the best N on the trace "
                         "(simulator)", lambda a, m: RerankPolicy(a[0], max(1, min(a[0] - 1, m)), name=f"static:{a[0]}"),
                         n_args=(1,)),
    "specfit": PolicySpec("specfit[:D]", "exact max-throughput subtree, level stopping (D levels at most)",
                          lambda a, m: SpecFitPolicy(a[0] if a else m), n_args=(0, 1)),
    "oracle": PolicySpec("oracle", "knows the verdicts (simulator, an upper bound)", lambda a, m: OraclePolicy(64)),
}
POLICY_HELP = ", ".join(spec.grammar for spec in POLICIES.values())
# what `specfit simulate` compares by default
DEFAULT_POLICIES = ("ar", "chain:4", "eagle3", "eagle3-nocache", "static:auto", "specfit", "oracle")


def make_policy(spec: str, max_levels: int = 8) -> Policy:
    """A policy from its spec string (see the module docstring and :data:`POLICIES`);
    ``max_levels`` caps drafting for ``specfit`` and ``static``."""
    text = str(spec).strip()
    if text == "static:auto":
        return TunedPolicy("static:auto", STATIC_AUTO_SIZES, max_levels)
    name, _, rest = text.partition(":")
    entry = POLICIES.get(name) if name != "eagle3-nocache" or not rest else None
    if entry is None:
        raise ValueError(f"policy {spec!r}: expected one of {POLICY_HELP}")
    try:
        args = [int(a) for a in rest.split(":")] if rest else []
    except ValueError:
        raise ValueError(f"policy {spec!r}: expected integer parameters, e.g. chain:4, static:8, eagle3:60:7") from None
    if len(args) not in entry.n_args:
        raise ValueError(f"policy {spec!r}: expected {entry.grammar}")
    return entry.build(args, max_levels)


def choose(policy: Policy, view: CycleView) -> Selection:
    """Drive ``policy`` over an already drafted tree (the simulator's case): offer it levels
    0, 1, ... of ``view`` until it stops or the tree ends; return its selection, whose
    ``draft_levels`` says how many levels it drafted."""
    policy.begin_cycle()
    levels = 0
    deepest = view.tree.max_depth
    while levels < deepest and policy.keep_drafting(view.truncated(levels)):
        levels += 1
    return policy.select(view.truncated(levels))
