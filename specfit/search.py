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
  node can pay at all; when none can, the root is returned without building expert sets.
* An optional price per draft node (``draft_node_s``, e.g. for experts the predictor gets wrong,
  :func:`uncertainty_price_s`) enters every node's weight; the ranking uses the priced time and
  the selection reports the predicted time and the price apart.

Expert sets are bitsets (:mod:`specfit.bitsets`); trees of up to 96 nodes are swept in plain
Python, larger ones level by level in numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .bitsets import pack_experts, pack_mask, popcount
from .costmodel import CostModel, check_experts, expert_union
from .tree import DraftTree, check_nodes

__all__ = ["Selection", "best_subtree", "greedy_subtree", "evaluate", "should_continue", "max_weight_closure",
           "uncertainty_price_s"]


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


class _Problem:
    """Inputs of one search, pre-processed once (independent of lambda)."""

    def __init__(self, tree: DraftTree, experts: np.ndarray, cached: np.ndarray, cost: CostModel, draft_levels: int,
                 draft_node_s: float = 0.0):
        self.tree, self.experts, self.cached, self.cost = tree, experts, cached, cost
        self.draft_levels = int(draft_levels)
        self.draft_node_s = float(draft_node_s)
        n, n_layers, _ = experts.shape
        self.n = n
        self.n_items = n_layers * cached.shape[1]
        self.item_w = cost.item_weights(cached).ravel()
        # expert sets as bitsets [n, L, words]; a slot repeating an expert of the same node and
        # layer (malformed routing) is marked and counted once
        self.bits, repeated = pack_experts(experts, cached.shape[1])
        self.cached_bits = pack_mask(cached)
        # flat [n, L*k] views; numpy is slow on broadcasts whose inner axis is only k long
        self.slot_layer = np.repeat(np.arange(n_layers), experts.shape[2])
        self.items_of = experts.reshape(n, -1) + self.slot_layer * cached.shape[1]
        self.repeated = repeated.reshape(n, -1)

    def evaluate(self, nodes: np.ndarray) -> Selection:
        """The cost formula, evaluated from scratch for ``nodes`` (sorted, closed, with root)."""
        union = np.bitwise_or.reduce(self.bits[nodes], axis=0)
        hits = popcount(union & self.cached_bits)
        misses = popcount(union) - hits
        c = self.cost
        time_s = (c.draft_level_s * self.draft_levels + c.base_s + c.per_node_s * nodes.size
                  + c.hit_s * hits + c.miss_s * misses)
        expected = 1.0 + float(self.tree.path_probs[nodes[1:]].sum())
        return Selection(nodes=nodes, expected_tokens=expected, time_s=float(time_s), hits=hits,
                         misses=misses, draft_levels=self.draft_levels, price_s=self.draft_node_s * (nodes.size - 1))


# Ratios within this relative distance are ties (float rounding of sums that are equal in reals).
TIE_REL = 1e-12
# The inner solver treats gains below this many tokens as zero: far above the rounding of
# p - lam * cost (~1e-16 for the magnitudes involved), far below any gain that changes a ratio by
# TIE_REL, even summed over a few hundred nodes.
GAIN_EPS = 1e-14
# Trees up to this many nodes are swept in plain Python: cheaper than a numpy call per level.
_SCALAR_SWEEP_NODES = 96


def _better(a: Selection, b: Selection) -> bool:
    """True when a beats b: a higher ratio, or (a tie) the same ratio with fewer nodes."""
    lhs = a.expected_tokens * b.priced_time_s
    rhs = b.expected_tokens * a.priced_time_s
    if abs(lhs - rhs) > TIE_REL * max(abs(lhs), abs(rhs)):
        return lhs > rhs
    return a.n_nodes < b.n_nodes


def _check_draft_node_s(draft_node_s) -> float:
    value = float(draft_node_s)
    if not np.isfinite(value) or value < 0:
        raise ValueError(f"draft_node_s: expected a finite non-negative number of seconds, got {draft_node_s!r}")
    return value


def _validated(tree, experts, cached, cost, draft_levels):
    if not isinstance(tree, DraftTree):
        raise ValueError(f"tree: expected a DraftTree, got {type(tree).__name__}")
    if not isinstance(cost, CostModel):
        raise ValueError(f"cost: expected a CostModel, got {type(cost).__name__}")
    experts, cached = check_experts(tree, experts, cached)
    if not (isinstance(draft_levels, (int, np.integer)) and not isinstance(draft_levels, bool)
            or isinstance(draft_levels, float) and draft_levels.is_integer()) or draft_levels < 0:
        raise ValueError(f"draft_levels: expected a non-negative integer, got {draft_levels!r}")
    return experts, cached


def evaluate(tree: DraftTree, nodes, experts, cached, cost: CostModel, draft_levels: int = 0,
             draft_node_s: float = 0.0) -> Selection:
    """The predicted outcome of verifying ``nodes`` (validated, then the cost formula). Only the
    selected nodes' experts are touched: policies call this once per cycle on large trees."""
    experts, cached = _validated(tree, experts, cached, cost, draft_levels)
    draft_node_s = _check_draft_node_s(draft_node_s)
    nodes = check_nodes(tree, nodes)
    union = expert_union(experts, nodes, cached.shape[1])
    hits = int(np.count_nonzero(union & cached))
    misses = int(np.count_nonzero(union)) - hits
    c = cost   # the formula on scalars: predict_counts' array machinery costs more than the sum
    time_s = c.draft_level_s * draft_levels + c.base_s + c.per_node_s * nodes.size + c.hit_s * hits + c.miss_s * misses
    return Selection(nodes=nodes, expected_tokens=tree.expected_tokens(nodes), time_s=float(time_s), hits=hits,
                     price_s=draft_node_s * (nodes.size - 1),
                     misses=misses, draft_levels=int(draft_levels))


# --------------------------------------------------------------------------- exact search
def _root_selection(prob: _Problem) -> Selection:
    root = prob.evaluate(np.zeros(1, dtype=np.int64))
    if root.time_s <= 0:
        raise ValueError("cost: verifying the root alone is predicted to take 0 s; expected a cost model with a "
                         "positive cycle time (base_s, per_node_s or the root's expert costs > 0)")
    return root


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
            level's answer); it changes the number of iterations, never the answer.
        draft_node_s: a price in seconds added per draft node (not the root), e.g. the expected
            cost of the experts a node needs that its prediction missed (see
            :func:`uncertainty_price_s`). The search ranks by ``time_s + price_s``; the selection's
            ``time_s`` stays the cost model's prediction and ``price_s`` holds the price.
    """
    experts, cached = _validated(tree, experts, cached, cost, draft_levels)
    draft_node_s = _check_draft_node_s(draft_node_s)
    if start is None and not _any_node_may_pay(tree, experts, cached, cost, draft_levels, draft_node_s):
        return _root_selection(_Problem(tree, experts[:1], cached, cost, draft_levels, draft_node_s))
    prob = _Problem(tree, experts, cached, cost, draft_levels, draft_node_s)
    best = _root_selection(prob)
    if start is not None:
        first = prob.evaluate(check_nodes(tree, start, "start"))
        if _better(first, best):
            best = first
    if prob.n == 1:
        return best
    inner = _InnerSolver(prob)
    for _ in range(64):  # Dinkelbach converges superlinearly; the cap is a guard, never reached in tests
        lam = best.expected_tokens / best.priced_time_s
        nodes = inner.solve(lam)
        cand = prob.evaluate(nodes)
        if not _better(cand, best):
            break
        best = cand
    return best


def _any_node_may_pay(tree: DraftTree, experts, cached, cost: CostModel, draft_levels: int,
                      draft_node_s: float) -> bool:
    """A cheap test before the search proper: with lam the root's ratio (a lower bound on the
    optimum) and every expert free, does any subtree still have a positive value? If not, the
    root alone is optimal and no expert set needs to be built."""
    if tree.n_nodes == 1:
        return False
    hits, misses = cost.union_counts(experts, [0], cached)
    root_s = cost.predict_counts(draft_levels, 1, hits, misses)
    if root_s <= 0:
        return True  # let the search report the degenerate cost model
    gain = (tree.path_probs - (cost.per_node_s + draft_node_s) / root_s).tolist()
    parents = tree.parents.tolist()
    for v in range(len(parents) - 1, 0, -1):   # children have larger ids: a bottom-up sweep
        if gain[v] > GAIN_EPS:
            if parents[v] == 0:
                return True
            gain[parents[v]] += gain[v]
    return False


class _InnerSolver:
    """max over closed S of sum_v (p_v - lam * t_node) - lam * (sum of new items' weights).

    Shared items (needed by two or more minimal nodes) are kept as a sparse membership list
    ``(member_item[j], member_node[j])``; every reduction step is a handful of bincounts over it.
    """

    def __init__(self, prob: _Problem):
        tree = prob.tree
        n = prob.n
        self.prob = prob
        self.parents = tree.parents
        self.levels = tree.levels
        # below this size the tree sweeps run as scalar Python loops (see _prune)
        self.parent_list = tree.parents.tolist() if n <= _SCALAR_SWEEP_NODES else None
        # experts needed by v or an ancestor of v, by depth level (bitsets [n, L, words])
        anc = prob.bits.copy()
        for level in self.levels[1:]:
            anc[level] |= anc[tree.parents[level]]
        # slot (v, l, s) is new when v's parent's ancestor set lacks that expert; root items are prepaid
        ex = prob.experts.reshape(n, -1)[1:]                   # [n-1, L*k]
        n_layers, words = anc.shape[1], anc.shape[2]
        at = (tree.parents[1:, None] * (n_layers * words) + prob.slot_layer * words) + (ex >> 6)
        has = (anc.ravel()[at] >> (ex & 63).astype(np.uint64)) & np.uint64(1)
        items = prob.items_of                                  # [n, L*k]
        new = np.zeros(items.shape, dtype=bool)                # entry is an item v needs first
        new[1:] = has == 0
        new &= ~prob.repeated                                  # an item counts once per node
        count = np.bincount(items.ravel(), weights=new.ravel(), minlength=prob.n_items)
        w = prob.item_w
        n_req = count[items] * new                             # minimal requirers of each new entry
        self.p = tree.path_probs.astype(np.float64)
        self.own_cost = prob.cost.per_node_s + prob.draft_node_s + np.where(n_req == 1, w[items], 0.0).sum(axis=1)
        shared_v, shared_j = np.nonzero(n_req >= 2)
        shared = count >= 2
        group_of_item = np.cumsum(shared) - 1                  # shared items numbered 0..G-1
        self.member_group = group_of_item[items[shared_v, shared_j]]
        self.member_node = shared_v
        self.group_cost = w[shared]
        self.n_groups = self.group_cost.size

    def _prune(self, weight, alive, inside) -> None:
        """Drop subtrees whose optimistic value (shared items free) is not positive."""
        if self.parent_list is not None:
            # small trees: one scalar sweep (children have larger ids) beats a numpy call per level
            par, ub, al, ins = self.parent_list, weight.tolist(), alive.tolist(), inside.tolist()
            for v in range(len(par) - 1, 0, -1):
                if al[v]:
                    if ins[v] or ub[v] > GAIN_EPS:
                        ub[par[v]] += ub[v]
                    else:
                        al[v] = False
            for v in range(1, len(par)):
                al[v] = al[v] and al[par[v]]
            alive[:] = al
            return
        ub = np.where(alive, weight, -np.inf)
        for level in self.levels[:0:-1]:
            vals = ub[level]
            keep = (vals > GAIN_EPS) | inside[level]
            alive[level[~keep]] = False
            np.add.at(ub, self.parents[level[keep]], vals[keep])
        for level in self.levels[1:]:
            alive[level] &= alive[self.parents[level]]

    def solve(self, lam: float) -> np.ndarray:
        n, G = self.prob.n, self.n_groups
        weight = self.p - lam * self.own_cost
        weight[0] = 0.0
        gcost = lam * self.group_cost
        mg, mv = self.member_group, self.member_node
        alive = np.ones(n, dtype=bool)
        inside = np.zeros(n, dtype=bool)
        inside[0] = True
        live = np.ones(G, dtype=bool)                 # groups not yet paid, folded or dropped

        for _ in range(n + 1):
            self._prune(weight, alive, inside)
            if not G:
                break
            changed = False
            # groups paid by a node inside, or with no live requirer, are gone
            live &= np.bincount(mg, weights=inside[mv], minlength=G) == 0
            n_alive = np.bincount(mg, weights=alive[mv], minlength=G)
            live &= n_alive > 0
            # a group with one live requirer is that node's own cost
            single = live & (n_alive == 1)
            if single.any():
                m = single[mg] & alive[mv]
                np.subtract.at(weight, mv[m], gcost[mg[m]])
                live &= ~single
                changed = True
            # force: a child of an inside node whose value stays positive when it pays every
            # live shared item alone is in every maximiser. Forcing one node only pays items for
            # the others, so values computed before the pass stay valid through it, level by level.
            pess = weight - np.bincount(mv, weights=gcost[mg] * live[mg], minlength=n) if G else weight
            candidate = alive & ~inside & (pess > GAIN_EPS)
            if candidate.any():
                changed |= self._force(candidate, inside)
            if not changed:
                break

        undecided = alive & ~inside
        coupled = live[mg] & undecided[mv] if G else np.zeros(0, dtype=bool)
        if not coupled.any():
            return np.flatnonzero(self._tree_dp(weight, undecided, inside))
        return np.flatnonzero(self._closure(weight, undecided, inside, gcost, coupled))

    def _force(self, candidate, inside) -> bool:
        """Take every candidate whose parent is inside, top-down; True if any was taken."""
        before = np.count_nonzero(inside)
        if self.parent_list is not None:
            par, cand, ins = self.parent_list, candidate.tolist(), inside.tolist()
            for v in range(1, len(par)):
                ins[v] = ins[v] or (cand[v] and ins[par[v]])
            inside[:] = ins
        else:
            for level in self.levels[1:]:
                inside[level] |= candidate[level] & inside[self.parents[level]]
        return np.count_nonzero(inside) != before

    def _tree_dp(self, weight, undecided, inside) -> np.ndarray:
        """No shared items left: the best forest hanging from the inside nodes, exactly."""
        if self.parent_list is not None:
            par, und = self.parent_list, undecided.tolist()
            gain = [w if u else 0.0 for w, u in zip(weight.tolist(), und)]
            for v in range(len(par) - 1, 0, -1):
                if und[v] and gain[v] > GAIN_EPS and und[par[v]]:
                    gain[par[v]] += gain[v]
            take = inside.tolist()
            for v in range(1, len(par)):
                if und[v]:
                    take[v] = take[par[v]] and gain[v] > GAIN_EPS
            return np.array(take, dtype=bool)
        parents = self.parents
        gain = np.where(undecided, weight, 0.0)
        for level in self.levels[:0:-1]:
            lv = level[undecided[level]]
            up = lv[(gain[lv] > GAIN_EPS) & undecided[parents[lv]]]
            np.add.at(gain, parents[up], gain[up])
        take = inside.copy()
        for level in self.levels[1:]:
            lv = level[undecided[level]]
            take[lv] = take[parents[lv]] & (gain[lv] > GAIN_EPS)
        return take

    def _closure(self, weight, undecided, inside, gcost, coupled) -> np.ndarray:
        """Shared items still couple undecided nodes: one max-weight closure by min cut, with the
        items that have the same requirers merged into one."""
        parents = self.parents
        idx = np.flatnonzero(undecided)
        pos = np.full(self.prob.n, -1, dtype=np.int64)
        pos[idx] = np.arange(idx.size)
        members: dict[int, list[int]] = {}
        for g, v in zip(self.member_group[coupled].tolist(), self.member_node[coupled].tolist()):
            members.setdefault(g, []).append(int(pos[v]))
        merged: dict[tuple[int, ...], float] = {}
        for g, mem in members.items():
            key = tuple(sorted(mem))
            merged[key] = merged.get(key, 0.0) + gcost[g]
        m = idx.size
        node_w = np.concatenate([weight[idx], -np.fromiter(merged.values(), dtype=np.float64, count=len(merged))])
        requires = [(int(pos[v]), int(pos[parents[v]])) for v in idx if undecided[parents[v]]]
        for j, key in enumerate(merged):
            requires.extend((i, m + j) for i in key)
        chosen = max_weight_closure(node_w, requires)
        take = inside.copy()
        take[idx[chosen[:m]]] = True
        return take


# --------------------------------------------------------------------------- max-weight closure
def max_weight_closure(weights: np.ndarray, requires: list[tuple[int, int]]) -> np.ndarray:
    """The minimal maximum-weight closed set: bool mask over ``weights``; ``(u, v)`` in
    ``requires`` means u can only be chosen together with v. Solved as one s-t minimum cut
    (Dinic's algorithm on float capacities)."""
    weights = np.asarray(weights, dtype=np.float64)
    m = weights.size
    s, t = m, m + 1
    graph = _FlowGraph(m + 2)
    scale = float(np.abs(weights).sum()) or 1.0
    for i, w in enumerate(weights):
        if w > 0:
            graph.add(s, i, float(w))
        elif w < 0:
            graph.add(i, t, float(-w))
    for u, v in requires:
        graph.add(u, v, float("inf"))
    eps = scale * 1e-15 + GAIN_EPS
    graph.max_flow(s, t, eps=eps)
    reach = graph.reachable(s, eps=eps)
    return reach[:m]


class _FlowGraph:
    """Residual graph for Dinic's algorithm (edges in flat lists, paired with their reverses)."""

    def __init__(self, n: int):
        self.n = n
        self.adj: list[list[int]] = [[] for _ in range(n)]
        self.to: list[int] = []
        self.cap: list[float] = []

    def add(self, u: int, v: int, c: float) -> None:
        self.adj[u].append(len(self.to))
        self.to.append(v)
        self.cap.append(c)
        self.adj[v].append(len(self.to))
        self.to.append(u)
        self.cap.append(0.0)

    def _levels(self, s: int, t: int, eps: float) -> list[int] | None:
        level = [-1] * self.n
        level[s] = 0
        queue = [s]
        for u in queue:
            for e in self.adj[u]:
                v = self.to[e]
                if level[v] < 0 and self.cap[e] > eps:
                    level[v] = level[u] + 1
                    queue.append(v)
        return level if level[t] >= 0 else None

    def max_flow(self, s: int, t: int, eps: float) -> float:
        total = 0.0
        to, cap, adj = self.to, self.cap, self.adj
        while (level := self._levels(s, t, eps)) is not None:
            it = [0] * self.n

            def push(u: int, limit: float) -> float:
                if u == t:
                    return limit
                edges = adj[u]
                while it[u] < len(edges):
                    e = edges[it[u]]
                    v = to[e]
                    if cap[e] > eps and level[v] == level[u] + 1:
                        got = push(v, min(limit, cap[e]))
                        if got > 0:
                            cap[e] -= got
                            cap[e ^ 1] += got
                            return got
                    it[u] += 1
                return 0.0

            while (f := push(s, float("inf"))) > 0:
                total += f
        return total

    def reachable(self, s: int, eps: float) -> np.ndarray:
        seen = np.zeros(self.n, dtype=bool)
        seen[s] = True
        stack = [s]
        while stack:
            u = stack.pop()
            for e in self.adj[u]:
                v = self.to[e]
                if not seen[v] and self.cap[e] > eps:
                    seen[v] = True
                    stack.append(v)
        return seen


# --------------------------------------------------------------------------- greedy and stopping
def greedy_subtree(tree: DraftTree, experts, cached, cost: CostModel, draft_levels: int = 0,
                   draft_node_s: float = 0.0) -> Selection:
    """Baseline: grow from the root, each step adding the frontier node (a child of the selected
    set) that gives the best ratio, while the ratio improves."""
    experts, cached = _validated(tree, experts, cached, cost, draft_levels)
    prob = _Problem(tree, experts, cached, cost, draft_levels, _check_draft_node_s(draft_node_s))
    children = tree.children()
    selected = np.zeros(prob.n, dtype=bool)
    selected[0] = True
    best = _root_selection(prob)
    frontier = set(children[0].tolist())
    while frontier:
        top = None
        for v in sorted(frontier):
            trial = selected.copy()
            trial[v] = True
            cand = prob.evaluate(np.flatnonzero(trial))
            if top is None or _better(cand, top[1]):
                top = (v, cand)
        if not _better(top[1], best):
            break
        v, best = top
        selected[v] = True
        frontier.remove(v)
        frontier.update(children[v].tolist())
    return best


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
    return (1.0 - precision) * n_layers * top_k * (1.0 - resident_share) * max(cost.miss_s - cost.hit_s, 0.0)


def should_continue(previous: Selection | None, current: Selection) -> bool:
    """The per-level stopping rule: after drafting a level, keep drafting only when the best
    subtree with it (charged its draft cost) beats the best without it, and uses the new level."""
    if previous is None:
        return True
    # a subtree without the new level was available one level earlier, at less draft cost, so
    # beating the previous best implies using the new level
    return _better(current, previous)
