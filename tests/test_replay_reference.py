"""The compiled replay against a plain-Python replay written from the specification (the module
docstring of ``specfit/simulate/replay.py``, the policy rules of ``specfit/policies.py`` and the
cache rules of ``specfit/experts/cache.py``), on both shipped traces, for every policy and every
cache mode and eviction policy, with true and with predicted experts.

The reference shares no code with the replay: trees, unions, the accepted path, the fixed
policies' choices, the cost formula and the cache are all re-done here. ``specfit`` is the one
policy it drives through the library (``choose`` on plain :class:`CycleView` objects), since the
replay's job there is the bookkeeping around the policy's decision.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from core_helpers import RefCache
from specfit import CostModel, ExpertCache
from specfit.calibrate.presets import SHAPES, preset_profile
from specfit.experts.calibration import cross_calibrate
from specfit.experts.predictors import cross_predict
from specfit.policies import CycleView, Observation, choose, make_policy
from specfit.simulate.replay import prepare, replay
from specfit.traces.format import Trace, read_trace
from specfit.tree import DraftTree

from trace_helpers import SAMPLE_OLMOE, SAMPLE_QWEN3, hand_trace


# --------------------------------------------------------------------------- the reference
class RefTree:
    """One cycle's tree as Python lists; probabilities clipped to the parent's as a DraftTree does."""

    def __init__(self, trace, c: int, predicted, raw_probs):
        lo, hi = int(trace.offsets[c]), int(trace.offsets[c + 1])
        self.parents = [int(p) for p in trace.parent[lo:hi]]
        self.tokens = [int(t) for t in trace.token[lo:hi]]
        self.verdicts = [int(v) for v in trace.verdict[lo:hi]]
        self.depth = [0] * len(self.parents)
        for v in range(1, len(self.parents)):
            self.depth[v] = self.depth[self.parents[v]] + 1
        self.raw = [float(x) for x in raw_probs[lo:hi]]
        self.drafter = [float(x) for x in trace.path_prob[lo:hi]]     # the drafter's own: a chain's top-1
        self.probs = [self.raw[0]] + [min(self.raw[v], self.raw[self.parents[v]]) for v in range(1, len(self.raw))]
        self.lo, self.hi = lo, hi
        self._true, self._predicted, self._n_experts = trace.true_experts, predicted, trace.n_experts

    def _items(self, experts, v: int) -> set[int]:
        E, rows = self._n_experts, experts[self.lo + v].tolist()
        return {layer * E + e for layer, row in enumerate(rows) for e in row}

    def true_items(self, nodes) -> set[int]:
        """The (layer, expert) items, as layer * E + expert, the nodes route to."""
        return set().union(*(self._items(self._true, v) for v in nodes))

    def pred_items(self, nodes) -> set[int]:
        return set().union(*(self._items(self._predicted, v) for v in nodes))

    @property
    def max_depth(self) -> int:
        return max(self.depth)

    def within(self, levels: int) -> list[int]:
        return [v for v in range(len(self.parents)) if self.depth[v] <= levels]

    def level_probs(self, levels: int) -> list[float]:
        """Probabilities as the policies see them after ``levels`` levels: a tree cut short is
        rebuilt from the full tree's values, which clips them once more."""
        if levels >= self.max_depth:
            return self.probs
        return [self.probs[0]] + [min(self.probs[v], self.probs[self.parents[v]]) for v in range(1, len(self.probs))]

    def accepted_path(self, nodes: list[int]) -> list[int]:
        """Greedy acceptance inside ``nodes``: follow the child whose token is the parent's verdict."""
        inside = set(nodes)
        path = [0]
        while True:
            nxt = [u for u in inside if u and self.parents[u] == path[-1] and self.tokens[u] == self.verdicts[path[-1]]]
            if not nxt:
                return path
            path.append(min(nxt))


def ref_time(cost: CostModel, draft_levels: int, n_nodes: int, hits: int, misses: int) -> float:
    return (cost.draft_level_s * draft_levels + cost.base_s + cost.per_node_s * n_nodes + cost.hit_s * hits
            + cost.miss_s * misses)


def ref_counts(items: set[int], resident: np.ndarray) -> tuple[int, int]:
    E = resident.shape[1]
    hits = sum(1 for i in items if resident[i // E, i % E])
    return hits, len(items) - hits


def ref_ranks(tree: RefTree) -> list[int]:
    """Each node's rank among its siblings by the drafter's probability (ties: the lower id); -1 at the root."""
    ranks = [-1] * len(tree.parents)
    for p in range(len(tree.parents)):
        kids = sorted((u for u in range(1, len(tree.parents)) if tree.parents[u] == p), key=lambda u: (-tree.drafter[u], u))
        for r, u in enumerate(kids):
            ranks[u] = r
    return ranks


def ref_sequoia_rates(trace, predicted, raw_probs) -> list[float]:
    """Sequoia's positional acceptance rates on the whole trace: of the rank-r children of the
    nodes on a cycle's accepted path, the share on it too."""
    tried, accepted = {}, {}
    for c in range(trace.n_cycles):
        tree = RefTree(trace, c, predicted, raw_probs)
        path = set(tree.accepted_path(list(range(len(tree.parents)))))
        for u, r in enumerate(ref_ranks(tree)):
            if r >= 0 and tree.parents[u] in path:
                tried[r] = tried.get(r, 0) + 1
                accepted[r] = accepted.get(r, 0) + (u in path)
    return [accepted.get(r, 0) / tried[r] if tried.get(r) else 0.0 for r in range(max(tried, default=-1) + 1)]


def ref_sequoia_depth(rates: list[float], total: int, cap: int) -> int:
    """The levels of Sequoia's tree: the ``total`` rank paths of the infinite tree (at most ``cap``
    deep) with the largest products of rates, ties to the shallower, then the lower ranks (its tree
    where the rates fall with the rank, as on both shipped traces; ``test_sequoia.py`` checks the
    tree against Sequoia's program for any rates)."""
    paths = [()]
    for _ in range(cap):
        paths += [p + (r,) for p in paths if len(p) == len(paths[-1]) for r in range(len(rates))]
    def product(p):
        value = 1.0
        for r in p:
            value *= rates[r]
        return value
    best = sorted(paths, key=lambda p: (-product(p), len(p), p))[:total]
    return max(1, max(len(p) for p in best))


def ref_decide(spec: str, tree: RefTree, resident: np.ndarray, cost: CostModel, rates=None):
    """(nodes, draft_levels, predicted tokens, predicted time, hits, misses) of a fixed policy
    (``rates``: Sequoia's, for ``sequoia:N``)."""
    name, _, rest = spec.partition(":")
    args = [int(a) for a in rest.split(":")] if rest else []
    depth = tree.max_depth
    if name == "oracle":
        levels = min(64, depth)
        path = tree.accepted_path(tree.within(levels))
        best = None
        for j in range(len(path)):
            items = tree.true_items(path[:j + 1])
            hits, misses = ref_counts(items, resident)
            t = ref_time(cost, j, j + 1, hits, misses)
            if best is None or (j + 1) * best[3] > best[2] * t:
                best = (path[:j + 1], j, float(j + 1), t, hits, misses)
        return best
    if name == "ar":
        levels, nodes = 0, [0]
    elif name == "chain":
        levels = min(args[0], depth)
        nodes = [0]
        while len(nodes) <= args[0]:
            kids = [u for u in tree.within(levels) if u and tree.parents[u] == nodes[-1]]
            if not kids:
                break
            nodes.append(max(kids, key=lambda u: (tree.drafter[u], -u)))
    else:   # eagle3[:N[:D]], static:N and sequoia:N rank nodes and keep N, ties to the lower id
        if name == "eagle3":
            total, levels = (args + [60, 8][len(args):])[:2]   # EAGLE-3's 60 tokens, 8 levels
        elif name == "sequoia":     # the levels its tree reaches, at most N - 1 and the 8 drafted
            total = args[0]
            levels = ref_sequoia_depth(rates, total, max(1, min(total - 1, 8)))
        else:
            total, levels = args[0], min(args[0] - 1, 8)   # static: depth N - 1, at most the 8 levels drafted
        levels = min(levels, depth)
        # eagle3 by the drafter's own probabilities (EAGLE's cumulative log-probabilities), static by
        # the policies', sequoia by the product of its rates along the sibling ranks
        probs = tree.drafter if name == "eagle3" else tree.level_probs(levels)
        if name == "sequoia":
            ranks, probs = ref_ranks(tree), [1.0] * len(tree.parents)
            for v in range(1, len(tree.parents)):
                probs[v] = probs[tree.parents[v]] * (rates[ranks[v]] if ranks[v] < len(rates) else 0.0)
        keep = sorted(tree.within(levels), key=lambda u: (-probs[u], u))[:total]
        closed = set(keep) | {0}
        for v in list(closed):
            while v:
                v = tree.parents[v]
                closed.add(v)
        nodes = sorted(closed)
    probs = tree.level_probs(levels)
    items = tree.pred_items(nodes)
    hits, misses = ref_counts(items, resident)
    tokens = 1.0 + math.fsum(probs[v] for v in nodes if v)
    return nodes, levels, tokens, ref_time(cost, levels, len(nodes), hits, misses), hits, misses


def reference_replay(trace, predicted, raw_probs, spec: str, cache: RefCache, cost: CostModel):
    """Per-cycle rows (dicts) and the tokens committed per sequence."""
    rows, committed = [], []
    seq = trace.sequence
    starts = [c for c in range(trace.n_cycles) if c == 0 or seq[c] != seq[c - 1]] + [trace.n_cycles]
    policy = make_policy(spec) if spec == "specfit" else None
    rates = ref_sequoia_rates(trace, predicted, raw_probs) if spec.startswith("sequoia") else None
    E = trace.n_experts
    for s, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
        c, out = a, []
        cache.begin_decode()          # each sequence is a request whose decoding begins here
        while c < b:
            tree = RefTree(trace, c, predicted, raw_probs)
            resident = cache.resident()
            if policy is not None:
                view = CycleView(tree=DraftTree(parents=np.array(tree.parents), path_probs=np.array(tree.raw),
                                                tokens=np.array(tree.tokens)),
                                 experts=np.asarray(predicted[tree.lo:tree.hi]), cached=resident, cost=cost,
                                 draft_levels=tree.max_depth)
                sel = choose(policy, view)
                nodes, levels = [int(v) for v in sel.nodes], sel.draft_levels
                tokens_p, time_p, hits_p, misses_p = sel.expected_tokens, sel.time_s, sel.hits, sel.misses
            else:
                nodes, levels, tokens_p, time_p, hits_p, misses_p = ref_decide(spec, tree, resident, cost, rates)
            path = tree.accepted_path(nodes)
            k = len(path)
            out += [tree.tokens[v] for v in path[1:]] + [tree.verdicts[path[-1]]]
            true = tree.true_items(nodes)
            pred = true if spec == "oracle" else tree.pred_items(nodes)
            by_layer = [[] for _ in range(trace.n_layers)]
            for i in true:
                by_layer[i // E].append(i % E)
            hits = misses = 0
            for layer in range(trace.n_layers):
                h, m = cache.admit_ids(layer, by_layer[layer])
                hits, misses = hits + h, misses + m
            if policy is not None:      # what the cycle revealed, as both drivers report it
                policy.observe(Observation(
                    verified=np.array(nodes), verdicts=np.array([tree.verdicts[v] for v in nodes]), draft_levels=levels,
                    misses=misses, predicted_misses=misses_p,
                    root_misses=ref_counts(tree.true_items([0]), resident)[1],
                    root_predicted_misses=ref_counts(tree.pred_items([0]), resident)[1]))
            rows.append({"sequence": s, "position": c - a, "nodes_verified": len(nodes), "draft_levels": levels,
                         "deepest_selected": max(tree.depth[v] for v in nodes), "union_size": len(true),
                         "hits": hits, "misses": misses, "predicted_union_size": hits_p + misses_p,
                         "predicted_misses": misses_p, "union_overlap": len(pred & true),
                         "predicted_time_s": time_p, "predicted_tokens": tokens_p, "committed_tokens": k,
                         "charged_time_s": ref_time(cost, levels, len(nodes), hits, misses)})
            c += k
        committed.append(out)
    return rows, committed


# --------------------------------------------------------------------------- the comparison
EXACT = ("sequence", "position", "nodes_verified", "draft_levels", "deepest_selected", "union_size", "hits", "misses",
         "predicted_union_size", "predicted_misses", "union_overlap", "committed_tokens")
CLOSE = ("predicted_time_s", "predicted_tokens", "charged_time_s")


def check_replay(trace, predicted, raw_probs, spec, capacity, mode, cache_policy, cost):
    prep = prepare("t", trace, predicted, None if raw_probs is trace.path_prob else raw_probs)
    cache = ExpertCache(trace.n_layers, trace.n_experts, capacity, mode=mode, policy=cache_policy)
    log = replay(prep, make_policy(spec), cache, cost)
    ref = RefCache(trace.n_layers, trace.n_experts, capacity, mode=mode, policy=cache_policy)
    rows, committed = reference_replay(trace, predicted, raw_probs, spec, ref, cost)
    where = f"{spec} {mode} {cache_policy} {capacity}"
    assert len(log) == len(rows), where
    for name in EXACT:
        assert log.columns[name].tolist() == [r[name] for r in rows], f"{where}: {name}"
    for name in CLOSE:
        np.testing.assert_allclose(log.columns[name], [r[name] for r in rows], rtol=1e-12, atol=0,
                                   err_msg=f"{where}: {name}")
    assert [x.tolist() for x in log.committed] == committed, where
    assert log.columns["bytes_h2d"].tolist() == [r["misses"] * trace.expert_bytes for r in rows], where
    assert np.array_equal(cache.resident(), ref.resident()), where
    for name in ("hits", "misses", "evictions", "streamed"):
        assert getattr(cache, name).tolist() == ref.totals[name], f"{where}: cache {name}"


POLICIES = ["ar", "chain:1", "chain:4", "eagle3", "eagle3:16:3", "static:8", "sequoia:6", "specfit", "oracle"]
CACHES = [("per_layer", "lru"), ("per_layer", "lfu"), ("per_layer", "fifo"), ("per_layer", "moe-infinity"),
          ("global", "lru"), ("global", "lfu"), ("global", "fifo"), ("global", "moe-infinity")]


@pytest.fixture(scope="module")
def olmoe():
    trace = read_trace(SAMPLE_OLMOE)
    return trace, cross_predict("affinity", trace), cross_calibrate(trace)


@pytest.fixture(scope="module")
def qwen3():
    return read_trace(SAMPLE_QWEN3)


@pytest.mark.parametrize("mode, cache_policy", CACHES)
@pytest.mark.parametrize("spec", POLICIES)
def test_replay_equals_the_reference_on_real_routing_with_predicted_experts(olmoe, spec, mode, cache_policy):
    trace, predicted, probs = olmoe
    capacity = 12 if mode == "per_layer" else 16 * 12
    cost = preset_profile("gh200", SHAPES["olmoe-1b-7b"]).cost
    check_replay(trace, predicted, probs, spec, capacity, mode, cache_policy, cost)


@pytest.mark.parametrize("spec", POLICIES)
def test_replay_equals_the_reference_with_true_experts_and_no_cache(olmoe, spec):
    trace = olmoe[0]
    cost = preset_profile("pcie4", SHAPES["olmoe-1b-7b"]).cost
    check_replay(trace, trace.true_experts, trace.path_prob, spec, 0, "per_layer", "lru", cost)


@pytest.mark.parametrize("mode, cache_policy, capacity", [("per_layer", "lru", 32), ("per_layer", "fifo", 16),
                                                          ("global", "lfu", 48 * 8),
                                                          ("global", "moe-infinity", 48 * 8)])
@pytest.mark.parametrize("spec", ["ar", "chain:4", "eagle3", "static:8", "sequoia:12", "specfit", "oracle"])
def test_replay_equals_the_reference_on_the_qwen3_sample(qwen3, spec, mode, cache_policy, capacity):
    cost = preset_profile("gh200", SHAPES["qwen3-30b-a3b"]).cost
    check_replay(qwen3, qwen3.true_experts, qwen3.path_prob, spec, capacity, mode, cache_policy, cost)


@pytest.mark.parametrize("spec", POLICIES)
def test_replay_equals_the_reference_on_the_hand_trace(spec):
    trace = hand_trace()
    cost = CostModel(base_s=1.0, per_node_s=0.1, hit_s=0.01, miss_s=0.5, draft_level_s=0.2, expert_bytes=1000)
    check_replay(trace, trace.true_experts, trace.path_prob, spec, 1, "per_layer", "lru", cost)


def tie_trace(n_children: int, accepted_child: int) -> Trace:
    """Reference output 11 12 13 over positions 0, 1, 2. Position 0: root 10 (e0) with
    ``n_children`` children of path probability 0.5 each (child i: token 20 + i, expert 1 + i % 3),
    of which child ``accepted_child`` (1-based) carries token 11 and is accepted, its verdict 12;
    positions 1 and 2: the root alone (11, then 12)."""
    n = n_children + 1
    tokens = [10] + [20 + i for i in range(1, n)]
    tokens[accepted_child] = 11
    verdicts = [11] + [0] * n_children
    verdicts[accepted_child] = 12
    parent = [-1] + [0] * n_children + [-1, -1]
    path_prob = [1.0] + [0.5] * n_children + [1.0, 1.0]
    experts = [0] + [1 + i % 3 for i in range(n_children)] + [1, 2]
    h = hand_trace()
    return Trace(meta=h.meta, offsets=np.array([0, n, n + 1, n + 2]), sequence=np.zeros(3, dtype=np.int32),
                 position=np.arange(3, dtype=np.int32), parent=np.array(parent, dtype=np.int16),
                 depth=np.array([0] + [1] * n_children + [0, 0], dtype=np.int16),
                 token=np.array(tokens + [11, 12], dtype=np.int32),
                 draft_logprob=np.log(np.array(path_prob)).astype(np.float32), path_prob=np.array(path_prob),
                 verdict=np.array(verdicts + [12, 13], dtype=np.int32),
                 true_experts=np.array(experts, dtype=np.int16).reshape(n + 2, 1, 1))


COST = CostModel(base_s=1.0, per_node_s=0.1, hit_s=0.01, miss_s=0.5, draft_level_s=0.2, expert_bytes=1000)


def _replay(trace, spec, cost=COST, compiled=True):
    prep = prepare("ties", trace, trace.true_experts)
    return replay(prep, make_policy(spec), ExpertCache(1, 4, capacity=1, expert_bytes=1000), cost, compiled=compiled)


@pytest.mark.parametrize("compiled", [True, False])
def test_chain_follows_the_earlier_of_two_equally_probable_children(compiled):
    # children 1 and 2 both at 0.5: chain:1 verifies root + child 1; child 1 is the accepted one
    # (11), so the cycle commits 11 and the bonus 12, then position 2 commits 13
    log = _replay(tie_trace(2, accepted_child=1), "chain:1", compiled=compiled)
    c = log.columns
    assert c["position"].tolist() == [0, 2]
    assert c["committed_tokens"].tolist() == [2, 1]
    assert log.committed[0].tolist() == [11, 12, 13]
    # the accepted child second: the chain still takes child 1 (rejected) and commits the bonus only
    log = _replay(tie_trace(2, accepted_child=2), "chain:1", compiled=compiled)
    assert log.columns["position"].tolist() == [0, 1, 2]
    assert log.columns["committed_tokens"].tolist() == [1, 1, 1]


@pytest.mark.parametrize("compiled", [True, False])
def test_chain_follows_the_drafters_top_child_whatever_the_calibrated_probabilities(compiled):
    """Live, ``chain:K`` drafts the drafter's top-1 at every level; a replay deciding with
    calibrated probabilities that rank a sibling above it must still verify that top-1 (it took
    the calibrated favourite, a chain no live run drafts)."""
    trace = tie_trace(2, accepted_child=2)
    trace.path_prob[1], trace.draft_logprob[1] = 0.6, np.log(0.6)      # the drafter's top-1: child 1, rejected
    calibrated = trace.path_prob.copy()
    calibrated[1], calibrated[2] = 0.3, 0.5                            # calibration prefers child 2
    prep = prepare("reordered", trace, trace.true_experts, calibrated)
    log = replay(prep, make_policy("chain:1"), ExpertCache(1, 4, capacity=1, expert_bytes=1000), COST,
                 compiled=compiled)
    # child 1 verified and rejected: the first cycle commits the bonus 11 only
    assert log.columns["committed_tokens"].tolist() == [1, 1, 1]
    # a chain drafts one node per level (the recorded tree's level 1 has two)
    assert log.columns["nodes_drafted"].tolist() == [2, 1, 1]
    # and its predicted tokens are priced with the calibrated probability of the node it verifies
    assert log.columns["predicted_tokens"][0] == pytest.approx(1.3)


@pytest.mark.parametrize("compiled", [True, False])
def test_eagle3_reranks_by_the_drafters_probabilities_and_static_by_the_calibrated(compiled):
    """EAGLE-3 ranks its candidates by the drafter's cumulative log-probability: a replay whose
    calibrated probabilities rank a sibling above the drafter's favourite still verifies the
    favourite with ``eagle3``; ``static:N`` (SpecFit's fixed size) ranks by the calibrated ones."""
    trace = tie_trace(2, accepted_child=2)
    trace.path_prob[1], trace.draft_logprob[1] = 0.6, np.log(0.6)      # the drafter's favourite: child 1, rejected
    calibrated = trace.path_prob.copy()
    calibrated[1], calibrated[2] = 0.3, 0.5                            # calibration prefers child 2, accepted
    prep = prepare("reordered", trace, trace.true_experts, calibrated)
    committed = {}
    for spec in ("eagle3:2:1", "static:2"):
        log = replay(prep, make_policy(spec), ExpertCache(1, 4, capacity=1, expert_bytes=1000), COST,
                     compiled=compiled)
        committed[spec] = log.columns["committed_tokens"].tolist()
        if spec == "eagle3:2:1":     # priced with the calibrated probability of the node it verifies
            assert log.columns["predicted_tokens"][0] == pytest.approx(1.3)
    assert committed == {"eagle3:2:1": [1, 1, 1], "static:2": [2, 1]}


@pytest.mark.parametrize("compiled", [True, False])
def test_rerank_keeps_the_earliest_of_many_equally_probable_nodes(compiled):
    # 40 children at 0.5 (more than a sort's small-array cutoff): static:3 keeps the root and the
    # two earliest children, 1 and 2; child 1 is the accepted one, so position 0 commits 2 tokens
    log = _replay(tie_trace(40, accepted_child=1), "static:3", compiled=compiled)
    c = log.columns
    assert c["position"].tolist() == [0, 2]
    assert c["nodes_verified"].tolist()[0] == 3
    assert c["committed_tokens"].tolist() == [2, 1]
    # child 1 (e1) and child 2 (e2) with the root (e0): three distinct experts in the union
    assert c["union_size"].tolist()[0] == 3
    log = _replay(tie_trace(40, accepted_child=3), "static:3", compiled=compiled)
    assert log.columns["committed_tokens"].tolist() == [1, 1, 1]


@pytest.mark.parametrize("compiled", [True, False])
def test_oracle_breaks_an_exact_throughput_tie_toward_the_shorter_prefix(compiled):
    # only the draft levels and the base cost (1 s each, exact in floats): a prefix of j + 1 nodes
    # commits j + 1 tokens in j + 1 seconds, so every prefix of the accepted path root-A-C ties at
    # one token per second; the oracle keeps the shortest, the root alone, at every position
    cost = CostModel(base_s=1.0, per_node_s=0.0, hit_s=0.0, miss_s=0.0, draft_level_s=1.0, expert_bytes=1000)
    trace = hand_trace()
    log = _replay(trace, "oracle", cost=cost, compiled=compiled)
    c = log.columns
    assert c["position"].tolist() == [0, 1, 2]
    assert c["committed_tokens"].tolist() == [1, 1, 1]
    assert c["nodes_verified"].tolist() == [1, 1, 1]
    assert log.committed[0].tolist() == [11, 12, 13]


def chain_trace(path_prob) -> Trace:
    """Reference output 11 12 13. Position 0: a chain root 10 -> 11 -> 99 -> 98 -> 97 with the given
    path probabilities, of which only 11 is accepted (the target says 12 after it). Positions 1 and
    2: the root alone (11, then 12)."""
    h = hand_trace()
    path_prob = np.r_[path_prob, 1.0, 1.0]
    parent = np.array([-1, 0, 1, 2, 3, -1, -1], dtype=np.int16)
    edge = np.where(parent >= 0, path_prob / path_prob[np.maximum(parent, 0)], 1.0)
    return Trace(meta=h.meta, offsets=np.array([0, 5, 6, 7]), sequence=np.zeros(3, dtype=np.int32),
                 position=np.arange(3, dtype=np.int32), parent=parent,
                 depth=np.array([0, 1, 2, 3, 4, 0, 0], dtype=np.int16),
                 token=np.array([10, 11, 99, 98, 97, 11, 12], dtype=np.int32),
                 draft_logprob=np.log(edge).astype(np.float32), path_prob=path_prob,
                 verdict=np.array([11, 12, 0, 0, 0, 12, 13], dtype=np.int32),
                 true_experts=np.array([0, 1, 2, 3, 0, 1, 2], dtype=np.int16).reshape(7, 1, 1))


def rising_chain_trace() -> Trace:
    """The chain's path probabilities 1, .5, .5 + 5e-10, .5 + 1e-9, .4 rise by float slack (within
    PROB_SLACK): the full tree clips node 3 to its parent's given value, .5 + 5e-10, and a tree cut
    at fewer levels clips it once more, to .5."""
    return chain_trace([1.0, 0.5, 0.5 + 5e-10, 0.5 + 1e-9, 0.4])


@pytest.mark.parametrize("compiled", [True, False])
def test_a_tree_cut_at_fewer_levels_is_priced_with_its_own_clipped_probabilities(compiled):
    # chain:3 drafts 3 of the 4 levels: the cut tree's probabilities are .5, .5, .5 (clipped
    # twice), so the chain's expected tokens are 1 + 3 x .5 = 2.5 exactly, not 2.5 + 5e-10
    log = _replay(rising_chain_trace(), "chain:3", compiled=compiled)
    c = log.columns
    assert c["position"].tolist() == [0, 2]
    assert c["draft_levels"].tolist() == [3, 0]
    assert c["nodes_verified"].tolist() == [4, 1]
    assert c["predicted_tokens"].tolist() == [2.5, 1.0]
    assert log.committed[0].tolist() == [11, 12, 13]
    # drafting all four levels (chain:4) uses the full tree's clip: .5, .5, .5 + 5e-10, .4
    c = _replay(rising_chain_trace(), "chain:4", compiled=compiled).columns
    assert c["draft_levels"].tolist() == [4, 0]
    assert c["predicted_tokens"].tolist()[0] == 1.0 + float(np.sum([0.5, 0.5, 0.5 + 5e-10, 0.4]))


def slack_rising_chain_trace() -> Trace:
    """The chain's path probabilities 1, .5, .5 + 1e-10, .5 + 2e-10, .5 + 3e-10 rise by float slack
    at every step (each within PROB_SLACK of its parent): clipped once to each parent's given value
    they are 1, .5, .5, .5 + 1e-10, .5 + 2e-10, so the deepest node outranks its ancestors."""
    return chain_trace([1.0, 0.5, 0.5 + 1e-10, 0.5 + 2e-10, 0.5 + 3e-10])


@pytest.mark.parametrize("compiled", [True, False])
def test_rerank_closes_its_selection_when_a_deep_node_outranks_its_ancestors(compiled):
    # eagle3:2:4 keeps the root and the most probable other node, the deepest (.5 + 2e-10 after
    # the clip): verified with all its ancestors, the whole chain of 5 nodes; 11 is accepted, so
    # position 0 commits 11 and the bonus 12
    log = _replay(slack_rising_chain_trace(), "eagle3:2:4", compiled=compiled)
    c = log.columns
    assert c["position"].tolist() == [0, 2]
    assert c["draft_levels"].tolist() == [4, 0]
    assert c["nodes_verified"].tolist() == [5, 1]
    assert c["deepest_selected"].tolist() == [4, 0]
    assert c["committed_tokens"].tolist() == [2, 1]
    assert log.committed[0].tolist() == [11, 12, 13]


@pytest.mark.parametrize("compiled", [True, False])
def test_specfit_prices_the_full_tree_it_drafted_with_the_full_trees_probabilities(compiled):
    # nodes and experts cost nothing and a draft level almost nothing: SpecFit drafts all four
    # levels of the rising chain and verifies every node; the full tree's probabilities (clipped
    # once) are .5, .5, .5 + 5e-10, .4, so its expected tokens are 1 + .5 + .5 + (.5 + 5e-10) + .4
    # summed in that order, not the cut trees' .5 for node 3
    cost = CostModel(base_s=1.0, per_node_s=0.0, hit_s=0.0, miss_s=0.0, draft_level_s=1e-6, expert_bytes=1000)
    c = _replay(rising_chain_trace(), "specfit", cost=cost, compiled=compiled).columns
    assert c["position"].tolist() == [0, 2]
    assert c["draft_levels"].tolist() == [4, 0]
    assert c["nodes_verified"].tolist() == [5, 1]
    assert c["predicted_tokens"].tolist()[0] == 1.0 + (((0.5 + 0.5) + (0.5 + 5e-10)) + 0.4)
