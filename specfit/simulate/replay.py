"""Counterfactual replay of a position-indexed trace through one policy.

Greedy decoding is lossless, so every policy produces the trace's reference output; a policy only
decides how many tokens each cycle commits, and so at which positions cycles start. The replay
starts each sequence at position 0; at position t it hands the policy the tree drafted there (with
*predicted* experts), lets it choose a subtree, commits the greedy accepted path inside that
subtree plus the bonus token, charges the cycle with the *true* experts of the subtree against
the expert cache (which then admits them), and moves to position t + committed. The cache state
carries from cycle to cycle and from sequence to sequence.

Everything that does not depend on the policy is computed once per trace in
:class:`PreparedTrace`, as flat arrays over the trace's node rows: the path probabilities of the
full trees and of the trees cut at fewer levels, the tree's size within each number of levels,
the predicted experts, and the accepted path of every full tree (the accepted path inside a
selected, ancestor-closed subtree is its prefix inside the subtree, because siblings carry
distinct tokens).

The loop runs compiled (:mod:`specfit.kernels.replay`): entirely for ``ar``, ``chain:K``, the
rerank policies (``eagle3``, ``static:N``) and ``oracle``, whose decisions compile; for any other
policy (``specfit``) a Python loop hands the policy each cycle's :class:`~specfit.policies.CycleView`
and calls the compiled commit (accepted prefix, union, cache admit, columns) with its selection.
That loop also runs the policy's levers (:data:`specfit.policies.LEVERS`: the cache advisor's keep
priorities for the admit, the prefetcher's copies while levels are "drafted") and reports each
cycle to :meth:`~specfit.policies.Policy.observe`, as the live decoder does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from .. import kernels
from ..costmodel import CostModel
from ..errors import SpecFitError
from ..experts.cache import ExpertCache
from ..policies import ArPolicy, ChainPolicy, CycleView, Observation, OraclePolicy, Policy, RerankPolicy, choose
from ..traces.format import Trace
from ..tree import DraftTree

__all__ = ["PreparedTrace", "prepare", "prepare_trace", "replay", "CycleLog", "CYCLE_COLUMNS"]


@dataclass(eq=False)
class PreparedTrace:
    """Per-trace inputs of the replay, shared by every policy, cache size and cost model.

    Node arrays are aligned with the trace's rows (``trace.offsets`` splits them into cycles).
    """

    name: str
    trace: Trace
    predictor: str
    offsets: np.ndarray             # int64 [cycles + 1]: cycle c owns node rows offsets[c]:offsets[c + 1]
    parents: np.ndarray             # int16 [nodes]: local parent ids, -1 at roots
    depths: np.ndarray              # int16 [nodes]
    tokens: np.ndarray              # int32 [nodes]
    verdicts: np.ndarray            # int32 [nodes]: the target's greedy next token at each node
    true_experts: np.ndarray        # int16 [nodes, L, k]
    raw_probs: np.ndarray           # float64 [nodes]: the path probabilities given (drafter's or calibrated)
    path_probs: np.ndarray          # float64 [nodes]: each full tree's, clipped to the parent's as a DraftTree does
    level_probs: np.ndarray         # float64 [nodes]: the same in a tree cut at fewer levels than drafted
    level_offsets: np.ndarray       # int64 [cycles + 1]: cycle c's level sizes are level_sizes[lo[c]:lo[c + 1]]
    level_sizes: np.ndarray         # int64: nodes within d levels, d = 0 .. the cycle's depth
    predicted_experts: np.ndarray   # int16 [nodes, L, k] the policies decide with (the true array for oracle)
    path_offsets: np.ndarray        # int64 [cycles + 1]: cycle c's accepted path is paths[po[c]:po[c + 1]]
    paths: np.ndarray               # int64: accepted paths of the full trees, root first, local node ids
    first_cycles: np.ndarray        # first cycle (position 0) of each sequence
    info: dict = field(default_factory=dict)   # e.g. the predictor's and calibrator's quality
    _trees: dict = field(default_factory=dict, repr=False)

    @property
    def n_cycles(self) -> int:
        return self.trace.n_cycles

    @property
    def predicted_is_true(self) -> bool:
        """The policies decide with the true experts (the oracle predictor)."""
        return self.predicted_experts is self.true_experts

    @property
    def max_nodes(self) -> int:
        """Nodes of the largest drafted tree."""
        return int(self.trace.tree_sizes.max())

    def accepted_path(self, cycle: int) -> np.ndarray:
        """The full tree's accepted path at ``cycle`` (local node ids, root first)."""
        return self.paths[self.path_offsets[cycle]:self.path_offsets[cycle + 1]]

    def depth(self, cycle: int) -> int:
        """Levels drafted at ``cycle``."""
        return int(self.level_offsets[cycle + 1] - self.level_offsets[cycle] - 1)

    def tree(self, cycle: int, levels: int | None = None) -> DraftTree:
        """The tree of ``cycle`` cut at ``levels`` drafted levels (all by default), built on first
        use and kept: the Python policies' view of the arrays the compiled ones read."""
        deepest = self.depth(cycle)
        levels = deepest if levels is None else min(int(levels), deepest)
        key = (cycle, levels)
        tree = self._trees.get(key)
        if tree is None:
            lo = int(self.offsets[cycle])
            n = int(self.level_sizes[self.level_offsets[cycle] + levels])
            # the DraftTree clips what it is given once: the given values for the full tree, the full
            # tree's for a cut one (so its path_probs are path_probs or level_probs exactly)
            probs = self.raw_probs if levels == deepest else self.path_probs
            tree = DraftTree(parents=self.parents[lo:lo + n].astype(np.int64), path_probs=probs[lo:lo + n],
                             tokens=self.tokens[lo:lo + n].astype(np.int64))
            self._trees[key] = tree
        return tree

    @property
    def level_trees(self) -> "_LevelTrees":
        """``level_trees[c][d]``: the tree of cycle c cut at d levels, built when asked for (prefer
        :meth:`tree`, and :attr:`max_nodes` over the largest ``level_trees[c][-1].n_nodes``)."""
        return _LevelTrees(self)

    @property
    def reference(self) -> list[np.ndarray]:
        """Each sequence's reference output after position 0 (what any policy must commit)."""
        tr = self.trace
        out = []
        bounds = np.r_[self.first_cycles, tr.n_cycles]
        for a, b in zip(bounds[:-1], bounds[1:]):
            out.append(tr.verdict[tr.offsets[a:b]].astype(np.int64))
        return out


class _LevelTrees:
    """A lazy ``[cycle][levels]`` sequence of :meth:`PreparedTrace.tree`."""

    def __init__(self, prep: PreparedTrace):
        self._prep = prep

    def __len__(self) -> int:
        return self._prep.n_cycles

    def __getitem__(self, cycle: int) -> "_CycleTrees":
        if not -len(self) <= cycle < len(self):
            raise IndexError(cycle)
        return _CycleTrees(self._prep, cycle % len(self))

    def __iter__(self):
        return (_CycleTrees(self._prep, c) for c in range(len(self)))


class _CycleTrees:
    """One cycle's trees by number of levels, each built when first asked for."""

    def __init__(self, prep: PreparedTrace, cycle: int):
        self._prep, self._cycle = prep, cycle

    def __len__(self) -> int:
        return self._prep.depth(self._cycle) + 1

    def __getitem__(self, levels: int) -> DraftTree:
        if not -len(self) <= levels < len(self):
            raise IndexError(levels)
        return self._prep.tree(self._cycle, levels % len(self))


def prepare(name: str, trace: Trace, predicted_experts: np.ndarray, path_probs: np.ndarray | None = None,
            predictor: str = "oracle", info: dict | None = None) -> PreparedTrace:
    """Cut the trace into the replay's flat arrays. ``predicted_experts`` ``[nodes, L, k]`` is what
    the policies decide with; ``path_probs`` ``[nodes]`` replaces the drafter's (e.g. calibrated)."""
    if not trace.position_indexed:
        raise SpecFitError(f"{name}: counterfactual replay needs a position-indexed trace (a full tree at every "
                           "position with every verdict known); this one was recorded as "
                           f"{trace.meta['recording'].get('kind')!r} without it")
    # the dtypes the compiled kernels take (those of a trace read from disk: no copies)
    offsets = np.ascontiguousarray(trace.offsets, dtype=np.int64)
    parents = np.ascontiguousarray(trace.parent, dtype=np.int16)
    depths = np.ascontiguousarray(trace.depth, dtype=np.int16)
    tokens = np.ascontiguousarray(trace.token, dtype=np.int32)
    verdicts = np.ascontiguousarray(trace.verdict, dtype=np.int32)
    true_experts = np.ascontiguousarray(trace.true_experts, dtype=np.int16)
    n = trace.n_nodes
    cycle_of = trace.cycle_of_node
    root = trace.parent < 0
    parent_row = np.where(root, np.arange(n), trace.parent.astype(np.int64) + offsets[:-1][cycle_of])
    raw = trace.path_prob if path_probs is None else np.asarray(path_probs, dtype=np.float64)
    _check_path_probs(name, raw, root, parent_row, cycle_of, offsets)
    # a DraftTree clips each node to its parent's value (rounding slack); a tree cut at fewer
    # levels is built from the full tree's clipped values and clips once more
    full = np.where(root, raw, np.minimum(raw, raw[parent_row]))
    level = np.where(root, full, np.minimum(full, full[parent_row]))
    depth = trace.depth.astype(np.int64)
    n_levels = np.maximum.reduceat(depth, offsets[:-1]) + 1
    level_offsets = np.r_[0, np.cumsum(n_levels)].astype(np.int64)
    # nodes within d levels: depth is sorted within a cycle, so count the nodes at depth <= d
    within = np.zeros(level_offsets[-1], dtype=np.int64)
    np.add.at(within, level_offsets[:-1][cycle_of] + depth, 1)
    level_sizes = np.cumsum(within)
    level_sizes -= np.repeat(np.r_[0, level_sizes[level_offsets[1:-1] - 1]], n_levels)
    if predicted_experts is trace.true_experts:
        predicted_experts = true_experts     # the oracle predictor: the replay then skips a second union
    else:
        predicted_experts = _checked_experts(name, predicted_experts, trace)
    path_offsets, paths = kernels.replay.accepted_paths(offsets, parents, depths, tokens, verdicts)
    seq = trace.sequence
    first = np.flatnonzero(np.r_[True, seq[1:] != seq[:-1]])
    info = dict(info or {})
    slots, right = _slots_right(predicted_experts, true_experts, ~root)
    info.setdefault("predicted_slots", slots)
    info.setdefault("predicted_slots_right", right)
    info.setdefault("slot_precision", right / slots if slots else 1.0)
    return PreparedTrace(name=name, trace=trace, predictor=predictor, offsets=offsets, parents=parents, depths=depths,
                         tokens=tokens, verdicts=verdicts, true_experts=true_experts, raw_probs=raw, path_probs=full,
                         level_probs=level,
                         level_offsets=level_offsets, level_sizes=level_sizes, predicted_experts=predicted_experts,
                         path_offsets=path_offsets, paths=paths, first_cycles=first, info=info)


def _check_path_probs(name, probs, root, parent_row, cycle_of, offsets) -> None:
    """The checks a DraftTree makes, on every cycle at once, naming the first bad node."""
    def fail(bad: np.ndarray, what: str) -> None:
        i = int(np.flatnonzero(bad)[0])
        c = int(cycle_of[i])
        raise ValueError(f"{name}: path_probs {what} (cycle {c}, node {i - int(offsets[c])}, got {probs[i]!r})")

    if probs.shape != root.shape:
        raise ValueError(f"{name}: path_probs: expected one value per node ({root.size}), got shape {probs.shape}")
    if not np.all(np.isfinite(probs) & (probs >= 0) & (probs <= 1)):
        fail(~(np.isfinite(probs) & (probs >= 0) & (probs <= 1)), "must be probabilities in [0, 1]")
    if np.any(probs[root] != 1.0):
        fail(root & (probs != 1.0), "must be 1 at the root")
    rising = ~root & (probs > probs[parent_row] + 1e-9)
    if rising.any():
        fail(rising, "must not increase along a path")


def _checked_experts(name: str, experts, trace: Trace) -> np.ndarray:
    experts = np.asarray(experts)
    want = (trace.n_nodes, trace.n_layers, trace.top_k)
    if experts.shape != want or not np.issubdtype(experts.dtype, np.integer):
        raise ValueError(f"{name}: predicted experts: expected integers of shape {list(want)}, got "
                         f"{experts.dtype} {list(experts.shape)}")
    if experts.size and (experts.min() < 0 or experts.max() >= trace.n_experts):
        raise ValueError(f"{name}: predicted experts: expected ids in [0, {trace.n_experts}), got "
                         f"[{experts.min()}, {experts.max()}]")
    return np.ascontiguousarray(experts, dtype=np.int16)


def _slots_right(predicted: np.ndarray, true: np.ndarray, draft: np.ndarray) -> tuple[int, int]:
    """(predicted, right) (layer, expert) slots of the draft nodes: how many name an expert the
    node really routes to, what pricing prediction uncertainty (:func:`specfit.search.uncertainty_price_s`)
    needs."""
    from ..experts.predictors import slots_right

    rows = np.flatnonzero(draft)
    total = rows.size * int(np.prod(true.shape[1:]))
    if predicted is true:
        return total, total
    right = 0
    for lo in range(0, rows.size, 65536):   # slots_right compares k x k per slot: keep the temporary small
        chunk = rows[lo:lo + 65536]
        right += slots_right(predicted[chunk], true[chunk])
    return int(total), int(right)


def prepare_trace(name: str, trace: Trace, predictor: str = "oracle", acceptance: str = "calibrated",
                  model_dir=None) -> PreparedTrace:
    """:func:`prepare` with the experts of ``predictor`` and, for ``acceptance="calibrated"``, path
    probabilities from the acceptance calibrator (both fitted on the other sequences only).
    ``predictor="router"`` reads the target's routers from ``model_dir`` (the trace's model)."""
    from ..experts.calibration import cross_calibrate
    from ..experts.predictors import PREDICTORS, cross_predict

    if predictor not in PREDICTORS:
        raise SpecFitError(f"--predictor: expected one of {sorted(PREDICTORS)}, got {predictor!r}")
    if acceptance not in ("calibrated", "raw"):
        raise SpecFitError(f"--acceptance: expected calibrated or raw, got {acceptance!r}")
    unfittable = trace.meta.get("recording", {}).get("unfittable_predictors", [])
    if predictor in unfittable:
        raise SpecFitError(f"--predictor {predictor}: the trace cannot fit it (its token ids are "
                           f"{trace.meta['recording'].get('token_ids', 'unknown')}); use oracle, parent or recorded")
    probs = cross_calibrate(trace) if acceptance == "calibrated" else None
    if predictor == "router":
        if model_dir is None:
            raise SpecFitError("--predictor router: needs the target's weights; pass --model DIR (the trace's model)")
        from ..runtime.loader import load_router

        router = load_router(model_dir)
        if router.router_weight.shape[:2] != (trace.n_layers, trace.n_experts):
            raise SpecFitError(f"--model {model_dir}: {router.router_weight.shape[0]} layers x "
                               f"{router.router_weight.shape[1]} experts, the trace has {trace.n_layers} x {trace.n_experts}")
        experts = router.predict_trace(trace)
    else:
        experts = cross_predict(predictor, trace)
    return prepare(name, trace, experts, probs, predictor=predictor)


@dataclass
class _LevelView(CycleView):
    """A :class:`CycleView` whose truncations come from the prepared trace's arrays (trees built
    once per cycle and level) instead of being cut from the full tree (the policies are unchanged)."""

    prep: PreparedTrace | None = None
    cycle: int = 0

    def truncated(self, levels: int) -> "_LevelView":
        prep, c = self.prep, self.cycle
        levels = min(int(levels), prep.depth(c))
        n = int(prep.level_sizes[prep.level_offsets[c] + levels])
        return _LevelView(
            tree=prep.tree(c, levels), experts=self.experts[:n], cached=self.cached, cost=self.cost,
            draft_levels=levels,
            verdicts=None if self.verdicts is None else self.verdicts[:n],
            true_experts=None if self.true_experts is None else self.true_experts[:n],
            prep=prep, cycle=c)


CYCLE_COLUMNS = ("sequence", "position", "nodes_verified", "draft_levels", "deepest_selected", "union_size",
                 "hits", "misses", "predicted_union_size", "predicted_misses", "union_overlap",
                 "predicted_time_s", "predicted_tokens", "committed_tokens")


@dataclass
class CycleLog:
    """Per-cycle columns of one replay (numpy arrays of equal length) and the committed tokens."""

    columns: dict[str, np.ndarray]
    committed: list[np.ndarray]        # per sequence: the tokens committed, in order
    unions: list[np.ndarray] | None = None   # per cycle: flat item ids of the true union (record_unions)

    def __len__(self) -> int:
        return int(self.columns["sequence"].size)


def _compiled_rule(policy: Policy) -> tuple[int, int, int] | None:
    """``(kind, total_nodes, max_levels)`` for a policy whose decision the replay kernel makes
    itself, or None. Exact classes only (a subclass may decide differently), and no lever."""
    k = kernels.replay
    if policy.cache_advisor is not None or policy.prefetcher is not None:
        return None
    kind = type(policy)
    if kind is ArPolicy:
        return k.AR, 0, 0
    if kind is ChainPolicy:
        return k.CHAIN, 0, int(policy.max_levels)
    if kind is RerankPolicy:
        return k.RERANK, int(policy.total_nodes), int(policy.max_levels)
    if kind is OraclePolicy:
        return k.ORACLE, 0, int(policy.max_levels)
    return None


def replay(prep: PreparedTrace, policy: Policy, cache: ExpertCache, cost: CostModel,
           record_unions: bool = False) -> CycleLog:
    """Replay every sequence of ``prep`` through ``policy`` with ``cache`` (mutated: it carries
    state across cycles) and ``cost`` (the policy's cost model). ``record_unions`` keeps each
    cycle's true union (e.g. for :func:`specfit.experts.belady.belady_counts`)."""
    trace = prep.trace
    if (cache.n_layers, cache.n_experts) != (trace.n_layers, trace.n_experts):
        raise ValueError(f"cache: expected {trace.n_layers} layers x {trace.n_experts} experts to match the trace, "
                         f"got {cache.n_layers} x {cache.n_experts}")
    n = prep.n_cycles
    int_cols = np.zeros((len(kernels.replay.INT_COLUMNS), n), dtype=np.int64)
    float_cols = np.zeros((len(kernels.replay.FLOAT_COLUMNS), n), dtype=np.float64)
    tokens_out = np.zeros(n + int(prep.depths.max(initial=0)) + 1, dtype=np.int64)
    bounds = np.r_[prep.first_cycles, n].astype(np.int64)
    per_sequence = np.zeros(bounds.size - 1, dtype=np.int64)
    rule = None if record_unions else _compiled_rule(policy)
    unions: list[np.ndarray] | None = [] if record_unions else None
    prefetched = np.zeros(n, dtype=np.int64)
    if rule is not None:
        rows = kernels.replay.replay_compiled(
            *rule, prep.predicted_is_true, prep.offsets, prep.parents, prep.depths, prep.tokens, prep.verdicts,
            prep.true_experts, prep.predicted_experts, prep.path_probs, prep.level_probs, prep.level_offsets,
            prep.level_sizes, prep.path_offsets, prep.paths, bounds, cost.params, *cache.kernel_state(),
            int_cols, float_cols, tokens_out, per_sequence)
    else:
        rows = _replay_python(prep, policy, cache, cost, bounds, int_cols, float_cols, tokens_out, per_sequence,
                              prefetched, unions)
    cols = {name: int_cols[i, :rows] for i, name in enumerate(kernels.replay.INT_COLUMNS)}
    cols.update({name: float_cols[i, :rows] for i, name in enumerate(kernels.replay.FLOAT_COLUMNS)})
    cols = {name: cols[name] for name in CYCLE_COLUMNS}
    # the charged time: the same cost formula, on the true union against the cache state
    cols["charged_time_s"] = cost.predict_counts(cols["draft_levels"], cols["nodes_verified"], cols["hits"], cols["misses"])
    cols["prefetched"] = prefetched[:rows]
    # the traced model's experts: the misses and the prefetched copies (whose link time was idle)
    cols["bytes_h2d"] = (cols["misses"] + cols["prefetched"]) * trace.expert_bytes
    committed = np.split(tokens_out[:int(per_sequence.sum())], np.cumsum(per_sequence)[:-1])
    return CycleLog(columns=cols, committed=committed, unions=unions)


def _replay_python(prep: PreparedTrace, policy: Policy, cache: ExpertCache, cost: CostModel, bounds, int_cols,
                   float_cols, tokens_out, per_sequence, prefetched, unions) -> int:
    """The loop for a policy that decides in Python: a view per cycle, ``choose`` (with the
    prefetcher's copies before each level), the compiled commit (with the cache advisor's keep
    priorities), then what the cycle revealed to ``policy.observe``."""
    trace = prep.trace
    k = kernels.replay
    state = cache.kernel_state()
    n_experts = trace.n_experts
    words = (n_experts + 63) // 64
    selected = np.zeros(prep.max_nodes, dtype=bool)
    true_union = np.empty((trace.n_layers, words), dtype=np.uint64)
    predicted_union = np.empty_like(true_union)
    admitted = np.empty(words, dtype=np.uint64)
    evicted = np.empty(max(cache.capacity, 1), dtype=np.int64)
    cand_score, cand_slot = np.empty_like(evicted), np.empty_like(evicted)
    needs_truth = policy.needs_truth
    same = needs_truth or prep.predicted_is_true
    advisor, prefetcher = policy.cache_advisor, policy.prefetcher
    offsets = prep.offsets
    row = n_out = 0

    def prefetch_level(view: _LevelView, levels: int) -> _LevelView:
        """Copy the prefetcher's plan while level ``levels + 1`` is drafted (the tree so far)."""
        part = view.truncated(levels)
        keep = None if advisor is None else advisor.keep(part.tree, part.experts, [0], n_experts)
        mask, priority = prefetcher.plan(part.tree, part.experts, view.cached, cost, keep=keep)
        if mask.any():
            prefetched[row] += int(cache.prefetch(mask, keep=priority).admitted_mask.sum())
            return dataclasses.replace(view, cached=cache.resident())
        return view

    for s in range(bounds.size - 1):
        c, first_token = int(bounds[s]), n_out
        while c < bounds[s + 1]:
            lo, hi = int(offsets[c]), int(offsets[c + 1])
            # int64 once per cycle: the search takes int64 ids, and a policy may search several times
            view = _LevelView(
                tree=prep.tree(c), experts=prep.predicted_experts[lo:hi].astype(np.int64), cached=cache.resident(),
                cost=cost, draft_levels=prep.depth(c),
                verdicts=prep.verdicts[lo:hi] if needs_truth else None,
                true_experts=prep.true_experts[lo:hi].astype(np.int64) if needs_truth else None, prep=prep, cycle=c)
            if prefetcher is not None:
                prefetcher.begin_cycle()
            sel = choose(policy, view, before_level=None if prefetcher is None else prefetch_level)
            nodes = np.ascontiguousarray(sel.nodes, dtype=np.int64)
            drafted = prep.tree(c, sel.draft_levels)
            keep = None
            if advisor is not None:
                # the draft's look-ahead for the cache: what the nodes left out predict the next
                # cycles need, before the verdicts are known (only the levels the policy drafted)
                n_drafted = int(prep.level_sizes[prep.level_offsets[c] + sel.draft_levels])
                keep = advisor.keep(drafted, view.experts[:n_drafted], nodes, n_experts)
            # what the root's true and predicted experts miss against the residency the policy saw
            root_misses = kernels.bitsets.count_missing(prep.true_experts, lo, state[0])
            root_predicted_misses = kernels.bitsets.count_missing(prep.predicted_experts, lo, state[0])
            committed, n_out = k.commit_cycle(
                c, nodes, nodes.size, same, False, offsets, prep.depths, prep.tokens, prep.verdicts, prep.true_experts,
                prep.predicted_experts, prep.path_offsets, prep.paths, *state, cache._check_keep(keep), selected,
                true_union, predicted_union, admitted, evicted, cand_score, cand_slot, int_cols, row, tokens_out, n_out)
            if advisor is not None or unions is not None:
                union = kernels.bitsets.unpack(true_union, n_experts)
                if advisor is not None:
                    advisor.observe(union)
                if unions is not None:
                    unions.append(np.flatnonzero(union))
            int_cols[k.SEQUENCE, row] = s
            int_cols[k.POSITION, row] = c - bounds[s]
            int_cols[k.DRAFT_LEVELS, row] = sel.draft_levels
            int_cols[k.PREDICTED_UNION_SIZE, row] = sel.hits + sel.misses
            int_cols[k.PREDICTED_MISSES, row] = sel.misses
            float_cols[k.PREDICTED_TIME_S, row] = sel.time_s
            float_cols[k.PREDICTED_TOKENS, row] = sel.expected_tokens
            # what the cycle revealed, as the live decoder reports it: the drafted tree, the
            # verified nodes and the target's verdicts at them (the trace's predictions were
            # scored for the whole trace up front)
            policy.observe(Observation(tree=drafted, verified=nodes, verdicts=prep.verdicts[lo + nodes],
                                       draft_levels=sel.draft_levels, misses=int(int_cols[k.MISSES, row]),
                                       predicted_misses=sel.misses,
                                       root_misses=root_misses, root_predicted_misses=root_predicted_misses))
            row += 1
            c += committed
        per_sequence[s] = n_out - first_token
    return row

