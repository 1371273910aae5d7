"""Shared strategies and brute-force references for the core tests (tree, cost model, search, cache).

Everything here is written from the issue text and DESIGN.md, never by calling the code under test
to compute an expectation: the cost formula, the enumeration of ancestor-closed subsets, the
maximum-weight-closure brute force and the expert-cache reference are all plain Python.

Example counts scale with the environment variable ``SPECFIT_TEST_SCALE`` (default 1; CI may run
e.g. ``SPECFIT_TEST_SCALE=10`` for a thorough pass). At scale 1 the search properties alone check a
few thousand random trees.
"""

from __future__ import annotations

import heapq
import math
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from specfit import CostModel, DraftTree

TIE_REL = 1e-12  # the tolerance: ratios within this relative distance are ties

_SCALE = float(os.environ.get("SPECFIT_TEST_SCALE", "1"))

settings.register_profile(
    "specfit-core",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    print_blob=True,
)


def core_settings(max_examples: int) -> settings:
    """Hypothesis settings for a core property: no deadline, ``max_examples`` times the scale."""
    return settings(settings.get_profile("specfit-core"), max_examples=max(1, int(max_examples * _SCALE)))


# --------------------------------------------------------------------------- reference cost formula
@dataclass(frozen=True)
class Costs:
    base_s: float
    per_node_s: float
    hit_s: float
    miss_s: float
    draft_level_s: float

    def model(self) -> CostModel:
        return CostModel(base_s=self.base_s, per_node_s=self.per_node_s, hit_s=self.hit_s,
                         miss_s=self.miss_s, draft_level_s=self.draft_level_s)


@dataclass
class Case:
    """One search input, as plain arrays plus the objects the API takes."""

    parents: np.ndarray      # int64 [n]
    probs: np.ndarray        # float64 [n]
    experts: np.ndarray      # int64 [n, L, k]
    cached: np.ndarray       # bool [L, E]
    costs: Costs
    draft_levels: int

    @property
    def tree(self) -> DraftTree:
        return DraftTree(parents=self.parents.copy(), path_probs=self.probs.copy())

    @property
    def cost(self) -> CostModel:
        return self.costs.model()

    @property
    def n(self) -> int:
        return int(self.parents.size)

    def ref(self) -> "RefProblem":
        return RefProblem(self.parents, self.probs, self.experts, self.cached, self.costs, self.draft_levels)


class RefProblem:
    """The issue's formula in plain Python (item sets as int bitmasks)."""

    def __init__(self, parents, probs, experts, cached, costs: Costs, draft_levels: int):
        self.parents = [int(p) for p in parents]
        self.probs = [float(p) for p in probs]
        experts = np.asarray(experts)
        cached = np.asarray(cached)
        n_layers, n_experts = cached.shape
        self.n_experts = n_experts
        self.node_items = []
        for v in range(len(self.parents)):
            mask = 0
            for layer in range(n_layers):
                for e in experts[v, layer]:
                    mask |= 1 << (layer * n_experts + int(e))
            self.node_items.append(mask)
        self.cached_mask = 0
        for layer in range(n_layers):
            for e in range(n_experts):
                if cached[layer, e]:
                    self.cached_mask |= 1 << (layer * n_experts + e)
        self.costs = costs
        self.draft_levels = int(draft_levels)

    def time_from_counts(self, n_nodes: int, hits: int, misses: int) -> float:
        c = self.costs
        return (c.draft_level_s * self.draft_levels + c.base_s + c.per_node_s * n_nodes
                + c.hit_s * hits + c.miss_s * misses)

    def union(self, nodes) -> int:
        mask = 0
        for v in nodes:
            mask |= self.node_items[v]
        return mask

    def evaluate(self, nodes):
        """(expected_tokens, time_s, hits, misses) of ``nodes`` by the issue's formula."""
        nodes = sorted(set(int(v) for v in nodes) | {0})
        union = self.union(nodes)
        hits = (union & self.cached_mask).bit_count()
        misses = union.bit_count() - hits
        expected = 1.0 + math.fsum(self.probs[v] for v in nodes if v != 0)
        return expected, self.time_from_counts(len(nodes), hits, misses), hits, misses

    def ratio(self, nodes) -> float:
        a, t, _, _ = self.evaluate(nodes)
        return a / t

    def all_closed(self):
        """Every ancestor-closed set containing the root: list of (nodes, A, T, hits, misses)."""
        n = len(self.parents)
        parents, probs, items = self.parents, self.probs, self.node_items
        out = []
        chosen = [False] * n
        chosen[0] = True
        nodes = [0]

        def rec(v: int, union: int, psum: float) -> None:
            if v == n:
                hits = (union & self.cached_mask).bit_count()
                misses = union.bit_count() - hits
                out.append((tuple(nodes), 1.0 + psum, self.time_from_counts(len(nodes), hits, misses), hits, misses))
                return
            rec(v + 1, union, psum)
            if chosen[parents[v]]:
                chosen[v] = True
                nodes.append(v)
                rec(v + 1, union | items[v], psum + probs[v])
                nodes.pop()
                chosen[v] = False

        rec(1, items[0], 0.0)
        return out

    def brute_force(self):
        """(max ratio, smallest size among sets within TIE_REL of it, {tie sets}, all sets)."""
        sets = self.all_closed()
        ratios = [a / t for _, a, t, _, _ in sets]
        best = max(ratios)
        ties = {s[0] for s, r in zip(sets, ratios) if r >= best - TIE_REL * best}
        return best, min(len(s) for s in ties), ties, sets


def is_closed(parents, nodes) -> bool:
    """Ancestor-closed and containing the root, by walking parents."""
    sel = set(int(v) for v in nodes)
    if 0 not in sel:
        return False
    return all(v == 0 or int(parents[v]) in sel for v in sel)


def ancestors_or_self(parents, v: int) -> list[int]:
    path = [int(v)]
    while path[-1] != 0:
        path.append(int(parents[path[-1]]))
    return path


def depths(parents) -> list[int]:
    return [len(ancestors_or_self(parents, v)) - 1 for v in range(len(parents))]


# --------------------------------------------------------------------------- strategies
TREE_SHAPES = ("random", "chain", "star", "bushy", "deep", "level_order")


@st.composite
def parents_st(draw, min_nodes: int = 1, max_nodes: int = 11, shape: str | None = None):
    n = draw(st.integers(min_nodes, max_nodes))
    shape = shape or draw(st.sampled_from(TREE_SHAPES))
    parents = [-1]
    for v in range(1, n):
        if shape == "chain":
            p = v - 1
        elif shape == "star":
            p = 0
        elif shape == "deep":
            p = draw(st.integers(max(0, v - 2), v - 1))
        elif shape == "bushy":
            p = draw(st.integers(0, min(v - 1, 2)))
        else:
            p = draw(st.integers(0, v - 1))
        parents.append(p)
    if shape == "level_order":  # sorted parents: depth non-decreasing with the node id
        parents = [-1] + sorted(parents[1:])
    return np.array(parents, dtype=np.int64)


DYADIC_Q = (1.0, 0.75, 0.5, 0.25, 0.125, 0.0)
PROB_KINDS = ("dyadic", "random", "mixed", "ones", "zeros", "near_tie")


@st.composite
def probs_st(draw, parents, kind: str | None = None):
    kind = kind or draw(st.sampled_from(PROB_KINDS))
    n = parents.size
    probs = np.ones(n)
    for v in range(1, n):
        if kind == "ones":
            q = 1.0
        elif kind == "dyadic":
            q = draw(st.sampled_from(DYADIC_Q))
        elif kind == "zeros":
            q = draw(st.sampled_from((0.0, 1.0, 0.5)))
        elif kind == "random":
            # per-edge acceptance >= 0.2 keeps every path probability far above the 1e-12 tie scale
            # (gains of that size are pinned by a dedicated test, not left to chance)
            q = draw(st.one_of(st.just(0.0), st.floats(0.2, 1.0)))
        elif kind == "near_tie":
            q = draw(st.sampled_from(DYADIC_Q[:-1]))
            q *= 1.0 - draw(st.sampled_from((0.0, 0.0, 1e-6, 1e-9, 1e-10)))
        else:
            q = draw(st.one_of(st.sampled_from(DYADIC_Q), st.floats(0.2, 1.0)))
        probs[v] = probs[parents[v]] * q
    return probs


EXPERT_KINDS = ("random", "topk", "identical", "pool", "siblings", "parent", "root_cached")


def make_experts(rng: np.random.Generator, kind: str, parents, n_layers: int, n_experts: int,
                 top_k: int) -> np.ndarray:
    """experts[node, layer, slot] of one of EXPERT_KINDS (bulk arrays come from a seeded generator:
    drawing hundreds of ids one by one through hypothesis would dominate the run time)."""
    n = len(parents)
    experts = np.zeros((n, n_layers, top_k), dtype=np.int64)

    def row():
        if kind == "topk" and top_k <= n_experts:   # distinct ids, as a router's top-k
            return rng.choice(n_experts, size=top_k, replace=False)
        if kind == "pool":
            return rng.choice(pool, size=top_k)
        return rng.integers(0, n_experts, size=top_k)   # repeats possible (malformed but valid)

    if kind == "identical":
        experts[:] = np.stack([row() for _ in range(n_layers)])[None]
        return experts
    # a few experts shared by everyone: heavy overlap between siblings and cousins
    pool = rng.choice(n_experts, size=int(rng.integers(1, min(n_experts, top_k + 1) + 1)), replace=False)
    for v in range(n):
        if v and kind in ("siblings", "parent", "root_cached") and rng.random() < 0.6:
            src = {"siblings": int(rng.integers(0, v)), "parent": int(parents[v]), "root_cached": 0}[kind]
            experts[v] = experts[src]
            if rng.random() < 0.5:  # mutate one slot
                experts[v, rng.integers(0, n_layers), rng.integers(0, top_k)] = rng.integers(0, n_experts)
            continue
        for layer in range(n_layers):
            experts[v, layer] = row()
    return experts


def mirrored_case(depth: int, shared: int, unique: int, miss_s: float, decay: float, n_layers: int = 48,
                  n_experts: int = 128, per_node_s: float = 0.001) -> "Case":
    """Two chains from the root, A and B; the cousins A_i and B_i (same depth) share ``shared``
    experts and each has ``unique`` of its own. A cousin alone rarely pays for the shared experts,
    the pair often does: the search cannot decide node by node."""
    n = 1 + 2 * depth
    parents = [-1] + [0 if i == 0 else b * depth + i for b in range(2) for i in range(depth)]
    probs = np.r_[1.0, decay ** np.arange(1, depth + 1), decay ** np.arange(1, depth + 1)]
    k = shared + unique
    common = np.arange(n_experts - k, n_experts)  # everyone's default experts, paid by the root
    experts = np.broadcast_to(common, (n, n_layers, k)).copy()
    per_layer = shared + 2 * unique
    for i in range(depth):
        a, b = 1 + i, 1 + depth + i
        layer, block = i % n_layers, (i // n_layers) * per_layer
        assert block + per_layer <= n_experts - k, "too deep for this many experts"
        sh = block + np.arange(shared)
        experts[a, layer] = np.r_[sh, block + shared + np.arange(unique)]
        experts[b, layer] = np.r_[sh, block + shared + unique + np.arange(unique)]
    cached = np.zeros((n_layers, n_experts), dtype=bool)
    return Case(np.array(parents, dtype=np.int64), probs, experts, cached,
                Costs(base_s=1.0, per_node_s=per_node_s, hit_s=0.0, miss_s=miss_s, draft_level_s=0.0), 0)


DYADIC_COSTS = {
    "base_s": (0.0, 0.25, 0.5, 1.0, 2.0),
    "per_node_s": (0.0, 0.0625, 0.125, 0.25),
    "hit_s": (0.0, 0.03125, 0.0625),
    "miss_s": (0.0, 0.125, 0.25, 0.5, 1.0),
    "draft_level_s": (0.0, 0.125, 0.5),
}
REAL_COSTS = {  # seconds, roughly a PCIe offload setting and a fast link
    "base_s": (1e-4, 1e-2),
    "per_node_s": (0.0, 2e-4),
    "hit_s": (0.0, 5e-5),
    "miss_s": (0.0, 1e-3),
    "draft_level_s": (0.0, 2e-3),
}
COST_KINDS = ("dyadic", "real", "sparse")


@st.composite
def costs_st(draw, kind: str | None = None, zero: tuple[str, ...] = ()):
    """Cost parameters; ``sparse`` sets random terms to exactly zero; ``zero`` forces some to zero."""
    kind = kind or draw(st.sampled_from(COST_KINDS))
    values = {}
    for name in DYADIC_COSTS:
        if kind == "dyadic":
            value = draw(st.sampled_from(DYADIC_COSTS[name]))
        else:
            lo, hi = REAL_COSTS[name]
            # no subnormal or vanishing times: a ratio of 1 / 1e-310 overflows the comparisons
            value = draw(st.one_of(st.just(lo), st.floats(max(lo, hi * 1e-4), hi)))
            if kind == "sparse" and draw(st.booleans()):
                value = 0.0
        values[name] = 0.0 if name in zero else value
    return Costs(**values)


@st.composite
def search_case_st(draw, max_nodes: int = 11, prob_kind=None, expert_kind=None, cost_kind=None,
                   zero: tuple[str, ...] = (), tree_shape=None, max_layers: int = 3, max_experts: int = 8,
                   max_draft_levels: int = 3):
    parents = draw(parents_st(max_nodes=max_nodes, shape=tree_shape))
    probs = draw(probs_st(parents, kind=prob_kind))
    n_layers = draw(st.integers(1, max_layers))
    n_experts = draw(st.integers(1, max_experts))
    top_k = draw(st.integers(1, min(4, n_experts + 1)))
    kind = expert_kind or draw(st.sampled_from(EXPERT_KINDS))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    experts = make_experts(rng, kind, parents, n_layers, n_experts, top_k)
    cached_kind = draw(st.sampled_from(("random", "none", "all", "root")))
    if cached_kind == "random":
        cached = rng.random((n_layers, n_experts)) < rng.random()
    elif cached_kind == "root":  # the root's experts resident, as after its own forward pass
        cached = np.zeros((n_layers, n_experts), dtype=bool)
        cached[np.arange(n_layers)[:, None], experts[0]] = True
    else:
        cached = np.full((n_layers, n_experts), cached_kind == "all")
    costs = draw(costs_st(kind=cost_kind, zero=zero))
    draft_levels = draw(st.integers(0, max_draft_levels))
    case = Case(parents, probs, experts, cached.astype(bool), costs, draft_levels)
    return case


def root_time_positive(case: Case) -> bool:
    return case.ref().evaluate([0])[1] > 0


# --------------------------------------------------------------------------- maximum-weight closure
def brute_force_closure(weights, requires) -> np.ndarray:
    """The minimal maximum-weight closed set, by enumerating all 2^m subsets (exact for ints)."""
    m = len(weights)
    best_w, best = None, []
    for mask in range(1 << m):
        if any((mask >> u) & 1 and not (mask >> v) & 1 for u, v in requires):
            continue
        w = sum(weights[i] for i in range(m) if (mask >> i) & 1)
        if best_w is None or w > best_w:
            best_w, best = w, [mask]
        elif w == best_w:
            best.append(mask)
    inter = best[0]
    for mask in best[1:]:
        inter &= mask
    # the maximisers are closed under intersection, so the intersection is itself a maximiser
    assert inter in best
    return np.array([(inter >> i) & 1 for i in range(m)], dtype=bool)


# --------------------------------------------------------------------------- expert cache reference
class RefLRUCache:
    """The rules at the top of ``specfit/experts/cache.py``, written with OrderedDicts (LRU only).

    Per layer (or one dict for ``global`` mode), front = least recently touched. At a layer: hits
    are touched first in ascending id, then each miss in ascending id takes a free slot, else the
    slot of the least recent resident expert outside this layer's union, else it is streamed.
    """

    def __init__(self, n_layers: int, n_experts: int, capacity: int, mode: str = "per_layer"):
        self.n_layers, self.n_experts, self.mode = n_layers, n_experts, mode
        limit = n_experts if mode == "per_layer" else n_layers * n_experts
        self.capacity = min(capacity, limit)
        n_dicts = n_layers if mode == "per_layer" else 1
        self.dicts = [OrderedDict() for _ in range(n_dicts)]

    def _dict(self, layer: int) -> OrderedDict:
        return self.dicts[layer] if self.mode == "per_layer" else self.dicts[0]

    def resident(self) -> np.ndarray:
        out = np.zeros((self.n_layers, self.n_experts), dtype=bool)
        for layer in range(self.n_layers):
            for key in self._dict(layer):
                if self.mode == "per_layer":
                    out[layer, key] = True
                elif key[0] == layer:
                    out[key[0], key[1]] = True
        return out

    def admit(self, union: np.ndarray) -> dict:
        L, E = self.n_layers, self.n_experts
        out = {k: np.zeros(L, dtype=np.int64) for k in ("hits", "misses", "evictions", "streamed")}
        masks = {k: np.zeros((L, E), dtype=bool) for k in ("hit", "admitted", "evicted", "streamed")}
        rows, cols = np.nonzero(union)
        wanted = [[] for _ in range(L)]
        for layer, e in zip(rows.tolist(), cols.tolist()):  # ascending id within each layer
            wanted[layer].append(e)
        for layer in range(L):
            od = self._dict(layer)
            want = wanted[layer] if self.mode == "per_layer" else [(layer, e) for e in wanted[layer]]
            want_set = set(want)
            hits = [k for k in want if k in od]
            misses = [k for k in want if k not in od]
            for k in hits:
                od.move_to_end(k)
            evictable = None  # least recent first, outside this layer's union; built when needed
            for k in misses:
                e = k if self.mode == "per_layer" else k[1]
                if len(od) >= self.capacity:
                    if evictable is None:
                        evictable = iter([x for x in od if x not in want_set])
                    victim = next(evictable, None)
                    if victim is None:
                        out["streamed"][layer] += 1
                        masks["streamed"][layer, e] = True
                        continue
                    del od[victim]
                    owner, ve = (layer, victim) if self.mode == "per_layer" else victim
                    out["evictions"][owner] += 1
                    masks["evicted"][owner, ve] = True
                od[k] = True
                masks["admitted"][layer, e] = True
            for k in hits:
                masks["hit"][layer, k if self.mode == "per_layer" else k[1]] = True
            out["hits"][layer] = len(hits)
            out["misses"][layer] = len(misses)
        out.update({f"{k}_mask": v for k, v in masks.items()})
        return out


class RefCache:
    """The rules at the top of ``specfit/experts/cache.py`` for every eviction policy, in plain
    Python: each resident key has a score tuple, the victim is the smallest among the resident
    keys outside the layer's union. A global tick counts touches in order (hits before admitted
    misses, ascending id, layer by layer): ``lru`` scores by the last touch, ``lfu`` by (touches
    since admission, last touch), ``fifo`` by the admission tick, ``moe-infinity`` by (fetches
    since :meth:`begin_decode`, layer, expert), a fetch being a miss, admitted or streamed (not a
    hit)."""

    def __init__(self, n_layers: int, n_experts: int, capacity: int, mode: str = "per_layer", policy: str = "lru"):
        self.n_layers, self.n_experts, self.mode, self.policy = n_layers, n_experts, mode, policy
        self.capacity = min(capacity, n_experts if mode == "per_layer" else n_layers * n_experts)
        self.pools = [dict() for _ in range(n_layers if mode == "per_layer" else 1)]  # key -> [last, count, admitted]
        self.tick = 0
        self.totals = {k: [0] * n_layers for k in ("hits", "misses", "evictions", "streamed")}
        self.uses = {}       # moe-infinity: (layer, expert) -> fetches since begin_decode, kept across evictions

    def begin_decode(self) -> None:
        self.uses = {}

    def _pool(self, layer: int) -> dict:
        return self.pools[layer if self.mode == "per_layer" else 0]

    def _item(self, layer: int, key) -> tuple[int, int]:
        return (layer, key) if self.mode == "per_layer" else key

    def _score(self, layer: int, key, entry):
        last, count, admitted = entry
        if self.policy == "moe-infinity":
            item = self._item(layer, key)
            return (self.uses.get(item, 0), *item)
        return {"lru": (last,), "lfu": (count, last), "fifo": (admitted,)}[self.policy]

    def resident(self) -> np.ndarray:
        out = np.zeros((self.n_layers, self.n_experts), dtype=bool)
        if self.mode == "per_layer":
            for layer, pool in enumerate(self.pools):
                out[layer, list(pool)] = True
        else:
            for layer, e in self.pools[0]:
                out[layer, e] = True
        return out

    def admit_ids(self, layer: int, ids) -> tuple[int, int]:
        """One layer's union (expert ids); returns (hits, misses)."""
        pool = self._pool(layer)
        keys = sorted(ids) if self.mode == "per_layer" else [(layer, e) for e in sorted(ids)]
        wanted = set(keys)
        hits = [k for k in keys if k in pool]
        misses = [k for k in keys if k not in pool]
        for k in keys:
            if k not in pool:
                item = self._item(layer, k)
                self.uses[item] = self.uses.get(item, 0) + 1
        for k in hits:
            self.tick += 1
            pool[k][0] = self.tick
            pool[k][1] += 1
        victims = None   # a heap of the residents outside the union (their scores do not change here)
        for k in misses:
            if len(pool) >= self.capacity:
                if victims is None:
                    victims = [(self._score(layer, x, entry), x) for x, entry in pool.items() if x not in wanted]
                    heapq.heapify(victims)
                if not victims:
                    self.totals["streamed"][layer] += 1
                    continue
                _, victim = heapq.heappop(victims)
                del pool[victim]
                self.totals["evictions"][layer if self.mode == "per_layer" else victim[0]] += 1
            self.tick += 1
            pool[k] = [self.tick, 1, self.tick]
        self.totals["hits"][layer] += len(hits)
        self.totals["misses"][layer] += len(misses)
        return len(hits), len(misses)


def find_shared_data(name: str) -> Path | None:
    """``../shared/data/<name>`` relative to the repository root, if present."""
    here = Path(__file__).resolve()
    candidates = [
        here.parents[2] / "shared" / "data" / name,     # <workspace>/shared next to the checkout
        here.parents[1] / "shared" / "data" / name,     # shared/ inside the checkout
        here.parents[1] / ".." / "shared" / "data" / name,
        Path.cwd() / ".." / "shared" / "data" / name,
    ]
    for path in candidates:
        if path.is_file():
            return path
    return None
