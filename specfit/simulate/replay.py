"""Counterfactual replay of a position-indexed trace through one policy.

Greedy decoding is lossless, so every policy produces the trace's reference output; a policy only
decides how many tokens each cycle commits, and so at which positions cycles start. The replay
starts each sequence at position 0; at position t it hands the policy the tree drafted there (with
*predicted* experts), lets it choose a subtree, commits the greedy accepted path inside that
subtree plus the bonus token, charges the cycle with the *true* experts of the subtree against
the expert cache (which then admits them), and moves to position t + committed. The cache state
carries from cycle to cycle and from sequence to sequence.

Everything that does not depend on the policy is computed once per trace in a
:class:`~specfit.simulate.prepared.PreparedTrace` (:mod:`specfit.simulate.prepared`).

The loop runs compiled (:mod:`specfit.kernels.replay`): entirely for ``ar``, ``chain:K``, the
rerank policies (``eagle3``, ``static:N``, ``sequoia:N`` by its products of rates), ``oracle`` and ``specfit`` (whose decisions are
compiled in :mod:`specfit.kernels.decide`, the code its policy object runs live), with the cache
and prefetch levers (:data:`specfit.policies.LEVERS` ``+cache``, ``+usage``, ``+prefetch``; their
rules compiled in :mod:`specfit.kernels.levers`) but not with an online acceptance calibrator,
and not for the oracle with a cache lever (``+prefetch`` is refused for the oracle, which drafts,
in hindsight, only the levels it verifies). For any other policy (and with ``compiled=False``, the
reference the kernels are tested against) a Python loop hands the policy each cycle's :class:`~specfit.policies.CycleView` and calls the
compiled commit (accepted prefix, union, cache admit, columns) with its selection. That loop runs
the levers through their objects (the cache advisor's keep priorities for the admit, the
prefetcher's copies while levels are "drafted") and reports each cycle to
:meth:`~specfit.policies.Policy.observe`, as the live decoder does; a test checks that the two
loops give the same columns, cache, advisor and policy state.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .. import kernels
from ..costmodel import CostModel
from ..experts.cache import ExpertCache
from ..experts.lookahead import DraftLookahead
from ..experts.prefetch import DraftPrefetch
from ..policies import (ArPolicy, ChainPolicy, CycleView, Observation, OraclePolicy, Policy, RerankPolicy,
                        SequoiaPolicy, TunedPolicy, choose)
from ..search import ROOT_TIME_MESSAGE
from ..specfit_policy import SpecFitPolicy
from .prepared import PreparedTrace, prepare, prepare_trace

__all__ = ["PreparedTrace", "prepare", "prepare_trace", "replay", "CycleLog"]


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
            drafter_probs=self.drafter_probs[:n], prep=prep, cycle=c)


@dataclass
class CycleLog:
    """Per-cycle columns of one replay (numpy arrays of equal length; the per-layer ones, when
    recorded, ``[cycles, L]``) and the committed tokens."""

    columns: dict[str, np.ndarray]
    committed: list[np.ndarray]        # per sequence: the tokens committed, in order
    unions: list[np.ndarray] | None = None   # per cycle: flat item ids of the true union (record_unions)
    # per sequence with recorded prompt passes: the flat item ids each admitted before its first cycle
    prefill_unions: dict[int, list[np.ndarray]] | None = None

    def __len__(self) -> int:
        return int(self.columns["sequence"].size)


def _compiled_rule(policy: Policy) -> tuple[int, int, int] | None:
    """``(kind, total_nodes, max_levels)`` for a policy whose decision the replay kernel makes
    itself, or None. Exact classes only (a subclass may decide differently); the oracle with no
    lever."""
    k = kernels.replay
    kind = type(policy)
    if kind is OraclePolicy and (policy.cache_advisor is not None or policy.prefetcher is not None):
        return None
    if kind is ArPolicy:
        return k.AR, 0, 0
    if kind is ChainPolicy:
        return k.CHAIN, 0, int(policy.max_levels)
    if kind is SequoiaPolicy:                             # a rerank by its own scores, of its tree's size
        return k.DRAFTER_RERANK, int(policy.verified_nodes), int(policy.max_levels)
    if kind is RerankPolicy:
        return k.DRAFTER_RERANK if policy.drafter_scores else k.RERANK, int(policy.total_nodes), int(policy.max_levels)
    if kind is OraclePolicy:
        return k.ORACLE, 0, int(policy.max_levels)
    return None


def replay(prep: PreparedTrace, policy: Policy, cache: ExpertCache, cost: CostModel,
           record_unions: bool = False, compiled: bool = True, per_layer: bool = False) -> CycleLog:
    """Replay every sequence of ``prep`` through ``policy`` with ``cache`` and ``cost`` (the
    policy's cost model). Both ``cache`` and ``policy`` are mutated: they carry state across
    cycles (residency; what the policy and its levers learn), so a second replay wants fresh ones
    (:func:`specfit.policies.make_policy`). ``record_unions`` keeps each
    cycle's true union (e.g. for :func:`specfit.experts.belady.belady_counts`). ``per_layer`` adds
    the schema's per-layer columns (``[cycles, L]`` each, :func:`_per_layer_columns`: for rows
    written to a file; a sweep's summary goes without them). ``compiled=False`` runs the Python loop
    through the policy and lever objects even where the kernels could run the whole replay (the
    reference the kernels are tested against; slower, same results)."""
    trace = prep.trace
    if (cache.n_layers, cache.n_experts) != (trace.n_layers, trace.n_experts):
        raise ValueError(f"cache: expected {trace.n_layers} layers x {trace.n_experts} experts to match the trace, "
                         f"got {cache.n_layers} x {cache.n_experts}")
    if isinstance(policy, TunedPolicy):
        raise ValueError(f"policy {policy.name!r}: a tuned family, not one policy; replay each of its candidates "
                         f"(run_sweep does, and keeps the fastest)")
    policy.fit_on_trace(prep)
    n = prep.n_cycles
    int_cols = np.zeros((len(kernels.replay.INT_COLUMNS), n), dtype=np.int64)
    float_cols = np.zeros((len(kernels.replay.FLOAT_COLUMNS), n), dtype=np.float64)
    tokens_out = np.zeros(n + int(prep.depths.max(initial=0)) + 1, dtype=np.int64)
    bounds = np.r_[prep.first_cycles, n].astype(np.int64)
    per_sequence = np.zeros(bounds.size - 1, dtype=np.int64)
    levers = lever_state(policy, cache) if compiled else None
    rule = None if levers is None else _compiled_rule(policy)
    compiled_specfit = levers is not None and type(policy) is SpecFitPolicy and policy.acceptance is None
    unions: list[np.ndarray] | None = [] if record_unions else None
    prefetched = np.zeros(n, dtype=np.int64)
    layer_counts = np.zeros((n if per_layer else 0, 5, trace.n_layers), dtype=np.int64)
    if rule is not None or compiled_specfit:
        layer_prefetched = np.zeros(trace.n_layers, dtype=np.int64)
        union_log = np.zeros((n if record_unions else 0, trace.n_layers, (trace.n_experts + 63) // 64), dtype=np.uint64)
        lever_args = (cost.params, *levers, layer_prefetched, prefetched, union_log, layer_counts)
    if rule is not None:
        # what a rerank by the drafter's probabilities ranks by (Sequoia: its products of rates)
        rank_scores = prep.drafter_probs
        if type(policy) is SequoiaPolicy:
            rank_scores = policy.scores(trace.parent_rows, prep.depths, prep.sibling_ranks)
        rows = kernels.replay.replay_compiled(
            *rule, prep.predicted_is_true, prep.offsets, prep.parents, prep.depths, prep.tokens, prep.verdicts,
            prep.predicted_experts, prep.true_bits, prep.predicted_bits, prep.path_probs, prep.level_probs,
            rank_scores, prep.level_offsets, prep.level_sizes, prep.path_offsets, prep.paths, bounds,
            prep.prefill_bits, prep.prefill_offsets, cost.params,
            *cache.kernel_state(), *lever_args, int_cols, float_cols, tokens_out, per_sequence)
    elif compiled_specfit:
        # the policy's state arrays are updated in place, as its own calls would update them
        rows = kernels.replay.replay_specfit(
            prep.predicted_is_true, prep.offsets, prep.parents, prep.depths, prep.tokens, prep.verdicts,
            prep.true_bits, prep.predicted_experts, prep.predicted_bits, prep.path_probs, prep.level_probs,
            prep.level_offsets, prep.level_sizes, prep.path_offsets, prep.paths, bounds, prep.prefill_bits,
            prep.prefill_offsets, trace.n_experts,
            policy._priced_cost(cost).params, *policy.state, *cache.kernel_state(), *lever_args, int_cols, float_cols,
            tokens_out, per_sequence)
        if rows < 0:
            raise ValueError(ROOT_TIME_MESSAGE if -1 - rows == kernels.search.ROOT_TIME else
                             "trace: a predicted expert id is out of range for the trace's experts")
    else:
        rows = _replay_python(prep, policy, cache, cost, bounds, int_cols, float_cols, tokens_out, per_sequence,
                              prefetched, unions, layer_counts)
    if rule is not None or compiled_specfit:
        _return_lever_state(policy, cache, levers, layer_prefetched)
        if record_unions:
            unions = [np.flatnonzero(kernels.bitsets.unpack(union_log[r], trace.n_experts)) for r in range(rows)]
    prefill_unions = None
    if record_unions:
        po = prep.prefill_offsets
        prefill_unions = {int(s): [np.flatnonzero(kernels.bitsets.unpack(prep.prefill_bits[p], trace.n_experts))
                                   for p in range(po[s], po[s + 1])] for s in np.flatnonzero(prep.has_prefill)}
    cols = {name: int_cols[i, :rows] for i, name in enumerate(kernels.replay.INT_COLUMNS)}
    cols.update({name: float_cols[i, :rows] for i, name in enumerate(kernels.replay.FLOAT_COLUMNS)})
    # the nodes of the levels drafted: the trace's tree at the cycle's position, cut there; a policy
    # drafting top-1 (a chain) drafts a node per level, as live
    cycle = bounds[cols["sequence"]] + cols["position"]
    if policy.draft_top_k == 1:
        cols["nodes_drafted"] = cols["draft_levels"] + 1
    else:
        cols["nodes_drafted"] = prep.level_sizes[prep.level_offsets[cycle] + cols["draft_levels"]]
    # the charged time: the same cost formula, on the true union against the cache state
    cols["charged_time_s"] = cost.predict_counts(cols["draft_levels"], cols["nodes_verified"], cols["hits"],
                                                 cols["misses"])
    cols["prefetched"] = prefetched[:rows]
    # the misses and the prefetched copies (whose link time was idle), each an expert of the size
    # the cost model charges a miss for
    cols["bytes_h2d"] = (cols["misses"] + cols["prefetched"]) * cost.bytes_per_miss(trace.expert_bytes)
    if per_layer:
        cols.update(_per_layer_columns(layer_counts[:rows]))
    committed = np.split(tokens_out[:int(per_sequence.sum())], np.cumsum(per_sequence)[:-1])
    return CycleLog(columns=cols, committed=committed, unions=unions, prefill_unions=prefill_unions)


def _per_layer_columns(layer_counts: np.ndarray) -> dict[str, np.ndarray]:
    """The schema's per-layer columns (``[cycles, L]`` each) from the replay's accounting
    (``layer_counts[cycle]``: :func:`specfit.kernels.replay.commit_cycle`'s rows of
    :func:`specfit.kernels.evaluate.union_accounting`), as a live cycle reports them: the admit's hits
    and misses, the true union their sum, the predicted union and its misses against the residency
    the selection saw."""
    e = kernels.evaluate
    union, misses = layer_counts[:, e.TRUE_UNION], layer_counts[:, e.TRUE_MISSES]
    return {"hits_per_layer": union - misses, "misses_per_layer": misses, "union_per_layer": union,
            "predicted_union_per_layer": layer_counts[:, e.PREDICTED_UNION],
            "predicted_misses_per_layer": layer_counts[:, e.PREDICTED_MISSES]}


def lever_state(policy: Policy, cache: ExpertCache) -> tuple | None:
    """``(lconf, lf, usage)`` of :mod:`specfit.kernels.levers` for the policy's cache advisor and
    prefetcher (none: the levers off), or None when one of them is not a lever the compiled replay
    runs (an exact :class:`DraftLookahead` / :class:`DraftPrefetch`)."""
    lv = kernels.levers
    advisor, prefetcher = policy.cache_advisor, policy.prefetcher
    if (advisor is not None and type(advisor) is not DraftLookahead) or \
            (prefetcher is not None and type(prefetcher) is not DraftPrefetch):
        return None
    lconf, lf = np.zeros(lv.N_LCONF, dtype=np.int64), np.zeros(lv.N_LF)
    usage = np.zeros((cache.n_layers, cache.n_experts))
    if advisor is not None:
        seen = advisor.usage_ is not None and advisor.usage_.shape == usage.shape
        advisor.kernel_config(lconf, lf, seen)
        if seen:
            usage[:] = advisor.usage_
    if prefetcher is not None:
        prefetcher.kernel_config(lconf, lf)
    return lconf, lf, usage


def _return_lever_state(policy: Policy, cache: ExpertCache, levers: tuple, layer_prefetched: np.ndarray) -> None:
    """What the compiled replay changed in the levers' arrays, back into their objects."""
    lv = kernels.levers
    lconf, lf, usage = levers
    if policy.cache_advisor is not None and lconf[lv.USAGE_SEEN]:
        policy.cache_advisor.usage_ = usage
    if policy.prefetcher is not None:
        policy.prefetcher._carry = float(lf[lv.CARRY])
    cache.prefetched += layer_prefetched


def _replay_python(prep: PreparedTrace, policy: Policy, cache: ExpertCache, cost: CostModel, bounds, int_cols,
                   float_cols, tokens_out, per_sequence, prefetched, unions, layer_counts) -> int:
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
    admitted = np.empty((trace.n_layers, words), dtype=np.uint64)
    cand_score, cand_slot = (np.empty(max(cache.capacity, 1), dtype=np.int64) for _ in range(2))
    evicted = np.empty(trace.n_layers * cand_score.size, dtype=np.int64)
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
            return dataclasses.replace(view, cached=cache.resident(read_only=True))
        return view

    for s in range(bounds.size - 1):
        c, first_token = int(bounds[s]), n_out
        cache.begin_prompt()
        for p in range(prep.prefill_offsets[s], prep.prefill_offsets[s + 1]):   # the prompt's passes, as live
            kernels.cache.admit_cycle(prep.prefill_bits[p], *state, kernels.cache.NO_KEEP, admitted, evicted, cand_score,
                                      cand_slot)
        cache.begin_decode()
        while c < bounds[s + 1]:
            lo, hi = int(offsets[c]), int(offsets[c + 1])
            # int64 once per cycle: the search takes int64 ids, and a policy may search several times
            view = _LevelView(
                tree=prep.tree(c), experts=prep.predicted_experts[lo:hi].astype(np.int64),
                cached=cache.resident(read_only=True), cost=cost, draft_levels=prep.depth(c),
                verdicts=prep.verdicts[lo:hi] if needs_truth else None,
                true_experts=prep.true_experts[lo:hi].astype(np.int64) if needs_truth else None,
                drafter_probs=prep.drafter_probs[lo:hi], prep=prep, cycle=c)
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
            root_misses = kernels.bitsets.count_missing_row(prep.true_bits, lo, state[0])
            root_predicted_misses = kernels.bitsets.count_missing_row(prep.predicted_bits, lo, state[0])
            committed, n_out = k.commit_cycle(
                c, nodes, nodes.size, same, False, offsets, prep.depths, prep.tokens, prep.verdicts, prep.true_bits,
                prep.predicted_bits, prep.path_offsets, prep.paths, *state, cache.kernel_keep(keep), selected,
                true_union, predicted_union, admitted, evicted, cand_score, cand_slot, int_cols, row, layer_counts,
                tokens_out, n_out)
            if advisor is not None or unions is not None:
                union = kernels.bitsets.unpack(true_union, n_experts)
                if advisor is not None:
                    advisor.observe(union)
                if unions is not None:
                    unions.append(np.flatnonzero(union))
            k.record_decision(int_cols, float_cols, row, s, c - int(bounds[s]), sel.draft_levels, sel.hits, sel.misses,
                              sel.time_s, sel.expected_tokens)
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

