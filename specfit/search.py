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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .costmodel import CostModel, check_experts
from .tree import DraftTree

__all__ = ["Selection", "best_subtree", "greedy_subtree", "evaluate", "should_continue", "max_weight_closure"]


@dataclass(frozen=True)
class Selection:
    """A chosen subtree and its predicted outcome."""

    nodes: np.ndarray          # sorted node ids, contains 0, ancestor-closed
    expected_tokens: float     # 1 + sum of the selected draft nodes' path probabilities
    time_s: float              # predicted cycle time
    hits: int                  # union experts already resident
    misses: int                # union experts to copy host-to-device
    draft_levels: int

    @property
    def throughput(self) -> float:
        """Expected committed tokens per second."""
        return self.expected_tokens / self.time_s if self.time_s > 0 else float("inf")

    @property
    def n_nodes(self) -> int:
        return int(self.nodes.size)


class _Problem:
    """Inputs of one search, pre-processed once (independent of lambda)."""

    def __init__(self, tree: DraftTree, experts: np.ndarray, cached: np.ndarray, cost: CostModel, draft_levels: int):
        self.tree, self.experts, self.cached, self.cost = tree, experts, cached, cost
        self.draft_levels = int(draft_levels)
        n, n_layers, _ = experts.shape
        self.n = n
        self.n_items = n_layers * cached.shape[1]
        self.item_w = cost.item_weights(cached).ravel()
        # node x item incidence, items flattened as layer * E + expert
        flat = experts + (np.arange(n_layers) * cached.shape[1])[None, :, None]
        self.items_of = flat.reshape(n, -1)
        incidence = np.zeros((n, self.n_items), dtype=bool)
        incidence[np.arange(n)[:, None], self.items_of] = True
        self.incidence = incidence
        self.fixed_s = cost.draft_level_s * self.draft_levels + cost.base_s + cost.per_node_s
        self.root_items_s = float(self.item_w[incidence[0]].sum())

    def evaluate(self, nodes: np.ndarray) -> Selection:
        """The cost formula, evaluated from scratch for ``nodes`` (sorted, closed, with root)."""
        union = self.incidence[nodes].any(axis=0)
        cached = self.cached.ravel()
        hits = int(np.count_nonzero(union & cached))
        misses = int(np.count_nonzero(union)) - hits
        c = self.cost
        time_s = (c.draft_level_s * self.draft_levels + c.base_s + c.per_node_s * nodes.size
                  + c.hit_s * hits + c.miss_s * misses)
        expected = 1.0 + float(self.tree.path_probs[nodes[1:]].sum())
        return Selection(nodes=nodes, expected_tokens=expected, time_s=float(time_s), hits=hits,
                         misses=misses, draft_levels=self.draft_levels)


# Ratios within this relative distance are ties (float rounding of sums that are equal in reals);
# gains below this many tokens are treated as zero by the inner solver.
TIE_REL = 1e-12


def _better(a: Selection, b: Selection) -> bool:
    """True when a beats b: a higher ratio, or (a tie) the same ratio with fewer nodes."""
    lhs = a.expected_tokens * b.time_s
    rhs = b.expected_tokens * a.time_s
    if abs(lhs - rhs) > TIE_REL * max(abs(lhs), abs(rhs)):
        return lhs > rhs
    return a.n_nodes < b.n_nodes


def _validated(tree, experts, cached, cost, draft_levels):
    if not isinstance(tree, DraftTree):
        raise ValueError(f"tree: expected a DraftTree, got {type(tree).__name__}")
    if not isinstance(cost, CostModel):
        raise ValueError(f"cost: expected a CostModel, got {type(cost).__name__}")
    experts, cached = check_experts(tree, experts, cached)
    if int(draft_levels) != draft_levels or draft_levels < 0:
        raise ValueError(f"draft_levels: expected a non-negative integer, got {draft_levels!r}")
    return experts, cached


def evaluate(tree: DraftTree, nodes, experts, cached, cost: CostModel, draft_levels: int = 0) -> Selection:
    """The predicted outcome of verifying ``nodes`` (validated, then the cost formula)."""
    from .tree import check_nodes

    experts, cached = _validated(tree, experts, cached, cost, draft_levels)
    return _Problem(tree, experts, cached, cost, draft_levels).evaluate(check_nodes(tree, nodes))


# --------------------------------------------------------------------------- exact search
def best_subtree(tree: DraftTree, experts, cached, cost: CostModel, draft_levels: int = 0) -> Selection:
    """The ancestor-closed subtree with the highest predicted throughput (exact; ties: smallest).

    Args:
        tree: the drafted tree (node 0 the root).
        experts: int [n, L, k]; each node's (predicted) experts per MoE layer.
        cached: bool [L, E]; experts resident before this cycle.
        cost: the cycle-time model.
        draft_levels: draft levels already spent this cycle (charged to every candidate).
    """
    experts, cached = _validated(tree, experts, cached, cost, draft_levels)
    prob = _Problem(tree, experts, cached, cost, draft_levels)
    best = prob.evaluate(np.zeros(1, dtype=np.int64))
    if prob.n == 1:
        return best
    inner = _InnerSolver(prob)
    for _ in range(64):  # Dinkelbach converges superlinearly; the cap is a guard, never reached in tests
        lam = best.expected_tokens / best.time_s
        nodes = inner.solve(lam)
        cand = prob.evaluate(nodes)
        if not _better(cand, best):
            break
        best = cand
    return best


class _InnerSolver:
    """max over closed S of sum_v (p_v - lam * t_node) - lam * (sum of new items' weights)."""

    def __init__(self, prob: _Problem):
        tree = prob.tree
        n = prob.n
        self.prob = prob
        self.parents = tree.parents
        self.children = tree.children()
        self.order = np.argsort(tree.depth, kind="stable")
        # ancestor union of items, by depth level: new[v] = items of v not needed by any ancestor
        anc = prob.incidence.copy()
        for d in range(1, tree.max_depth + 1):
            level = np.flatnonzero(tree.depth == d)
            anc[level] |= anc[tree.parents[level]]
        new = prob.incidence.copy()
        new[1:] &= ~anc[tree.parents[1:]]
        new[0] = False  # root items are prepaid
        count = new.sum(axis=0)
        single = count == 1
        w = prob.item_w
        # lambda-independent parts of each node's weight
        self.p = tree.path_probs.astype(np.float64)
        self.own_cost = prob.cost.per_node_s + new[:, single].astype(np.float64) @ w[single]
        shared_cols = np.flatnonzero(count >= 2)
        if shared_cols.size:
            sh = new[:, shared_cols]                      # [n, m]
            keys = np.packbits(sh, axis=0).T              # [m, ceil(n/8)]
            keys = np.ascontiguousarray(keys).view(np.dtype((np.void, keys.shape[1]))).ravel()
            _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
            self.group_cost = np.bincount(inverse.ravel(), weights=w[shared_cols])
            member = sh[:, first]                         # [n, G]
            gi, gv = np.nonzero(member.T)
            self.group_members = np.split(gv, np.cumsum(np.bincount(gi, minlength=first.size))[:-1])
            vi, vg = np.nonzero(member)
            self.node_groups = np.split(vg, np.cumsum(np.bincount(vi, minlength=n))[:-1])
        else:
            self.group_cost = np.zeros(0)
            self.group_members = []
            self.node_groups = [np.zeros(0, dtype=np.int64)] * n

    def solve(self, lam: float) -> np.ndarray:
        n = self.prob.n
        parents, children = self.parents, self.children
        weight = self.p - lam * self.own_cost
        weight[0] = 0.0
        gcost = lam * self.group_cost
        n_groups = gcost.size
        alive = np.ones(n, dtype=bool)
        group_alive = np.ones(n_groups, dtype=bool)   # not yet paid and not yet folded
        inside = np.zeros(n, dtype=bool)
        inside[0] = True

        for _ in range(n + 1):
            # 1. prune: optimistic value (shared items free) of each subtree, bottom-up
            ub = weight.copy()
            for v in self.order[::-1]:
                if v and alive[v] and not inside[v]:
                    if ub[v] > TIE_REL:
                        ub[parents[v]] += ub[v]
                    else:
                        alive[v] = False
            for v in self.order:  # a pruned node takes its subtree with it
                if v and not alive[parents[v]]:
                    alive[v] = False
            # 2. fold groups with a single live, undecided requirer; drop dead or paid ones
            changed = False
            live_members = {}
            for g in np.flatnonzero(group_alive):
                mem = self.group_members[g]
                if inside[mem].any():
                    group_alive[g] = False          # paid by a node already in
                    continue
                mem = mem[alive[mem]]
                if mem.size == 0:
                    group_alive[g] = False
                elif mem.size == 1:
                    weight[mem[0]] -= gcost[g]
                    group_alive[g] = False
                    changed = True
                else:
                    live_members[g] = mem
            # 3. force: a child of the inside set whose value is positive even paying its shared
            #    items alone belongs to every maximiser
            frontier = [c for v in np.flatnonzero(inside) for c in children[v] if alive[c] and not inside[c]]
            while frontier:
                v = frontier.pop()
                pess = weight[v] - sum(gcost[g] for g in self.node_groups[v] if group_alive[g])
                if pess > TIE_REL:
                    inside[v] = True
                    changed = True
                    for g in self.node_groups[v]:
                        group_alive[g] = False
                    frontier.extend(c for c in children[v] if alive[c])
            if not changed:
                break

        live_groups = [g for g in live_members if group_alive[g]]
        undecided = alive & ~inside
        if not live_groups:
            # a forest hanging from inside nodes, no coupling: exact tree DP (positive gain only)
            gain = weight.copy()
            for v in self.order[::-1]:
                if v and undecided[v] and gain[v] > TIE_REL and undecided[parents[v]]:
                    gain[parents[v]] += gain[v]
            take = inside.copy()
            for v in self.order:
                if v and undecided[v] and take[parents[v]] and gain[v] > TIE_REL:
                    take[v] = True
            return np.flatnonzero(take)

        # 4. max-weight closure on the undecided nodes and the groups that still couple them
        idx = np.flatnonzero(undecided)
        pos = {int(v): i for i, v in enumerate(idx)}
        m = idx.size
        node_w = np.concatenate([weight[idx], -gcost[live_groups]])
        requires = []
        for i, v in enumerate(idx):
            p = int(parents[v])
            if p in pos:
                requires.append((i, pos[p]))
        for j, g in enumerate(live_groups):
            for v in live_members[g]:
                requires.append((pos[int(v)], m + j))
        chosen = max_weight_closure(node_w, requires)
        take = inside.copy()
        take[idx[chosen[:m]]] = True
        return np.flatnonzero(take)


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
    eps = scale * 1e-13 + TIE_REL
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
def greedy_subtree(tree: DraftTree, experts, cached, cost: CostModel, draft_levels: int = 0) -> Selection:
    """Baseline: grow from the root, each step adding the frontier node (a child of the selected
    set) that gives the best ratio, while the ratio improves."""
    experts, cached = _validated(tree, experts, cached, cost, draft_levels)
    prob = _Problem(tree, experts, cached, cost, draft_levels)
    children = tree.children()
    selected = np.zeros(prob.n, dtype=bool)
    selected[0] = True
    best = prob.evaluate(np.zeros(1, dtype=np.int64))
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


def should_continue(previous: Selection | None, current: Selection) -> bool:
    """The per-level stopping rule: after drafting a level, keep drafting only when the best
    subtree with it (charged its draft cost) beats the best without it, and uses the new level."""
    if previous is None:
        return True
    # a subtree without the new level was available one level earlier, at less draft cost, so
    # beating the previous best implies using the new level
    return _better(current, previous)
