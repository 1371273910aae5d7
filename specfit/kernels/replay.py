"""The trace replay compiled: the per-cycle commit (accepted prefix, union of the true experts,
cache admit, the cycle's columns) and the whole loop for the policies whose decisions compile.

The replay's rules are those of :mod:`specfit.simulate.replay`, which prepares the flat arrays
(:class:`~specfit.simulate.replay.PreparedTrace`) and calls these. A trace is node arrays of all
cycles concatenated (cycle c owns rows ``offsets[c]:offsets[c + 1]``, node ids local to the cycle)
and, per cycle, the tree's size within each number of drafted levels and the full tree's accepted
path. The decisions compiled here are those of :mod:`specfit.policies`'s ``ar``, ``chain:K``,
rerank (``eagle3``, ``static:N``, ``sequoia:N`` by its scores) and ``oracle``, on the same arrays the Python policies see;
SpecFit's (:func:`replay_specfit`) are :mod:`.decide`'s, the code its policy object calls live.
Both loops run the levers compiled too (:mod:`.levers`: the draft's look-ahead ``keep`` for the
cache's evictions, prefetch before each drafted level, the advisor's use record), as the Python
loop of :mod:`specfit.simulate.replay` runs them through the lever objects.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .bitsets import count_missing_row, popcount, union_of_rows
from .cache import MISSES as CACHE_MISSES
from .cache import admit_cycle, begin_decode, begin_prompt
from .decide import MAX_LEVELS, NODE_PRICE, OK, decide_level, node_price, observe_cycle, select_level
from .evaluate import TRUE_MISSES, count_unions, cycle_time, expected_tokens
from .levers import ADVISOR, CARRY, PREFETCH, keep_priorities, observe_union, prefetch_level
from .tree import accepted_path

__all__ = ["AR", "CHAIN", "RERANK", "ORACLE", "DRAFTER_RERANK", "INT_COLUMNS", "FLOAT_COLUMNS", "accepted_paths", "commit_cycle",
           "record_decision", "replay_compiled", "replay_specfit"]

AR, CHAIN, RERANK, ORACLE = 0, 1, 2, 3
DRAFTER_RERANK = 4     # the rerank by the drafter's own path probabilities (EAGLE-3's), not the calibrated ones
# the rows of the replay's output arrays
INT_COLUMNS = ("sequence", "position", "nodes_verified", "draft_levels", "deepest_selected", "union_size", "hits",
               "misses", "predicted_union_size", "predicted_misses", "union_overlap", "committed_tokens")
FLOAT_COLUMNS = ("predicted_time_s", "predicted_tokens")
(SEQUENCE, POSITION, NODES_VERIFIED, DRAFT_LEVELS, DEEPEST_SELECTED, UNION_SIZE, HITS, MISSES, PREDICTED_UNION_SIZE,
 PREDICTED_MISSES, UNION_OVERLAP, COMMITTED_TOKENS) = range(12)
PREDICTED_TIME_S, PREDICTED_TOKENS = 0, 1


@njit(cache=True)
def accepted_paths(offsets, parents, depth, tokens, verdicts):
    """Every cycle's full-tree accepted path: ``(path_offsets [cycles + 1], paths)``."""
    n_cycles = offsets.size - 1
    max_nodes = 1
    for c in range(n_cycles):
        max_nodes = max(max_nodes, offsets[c + 1] - offsets[c])
    ok = np.empty(max_nodes, dtype=np.bool_)
    path = np.empty(max_nodes, dtype=np.int64)
    everywhere = np.zeros(0, dtype=np.bool_)
    path_offsets = np.zeros(n_cycles + 1, dtype=np.int64)
    paths = np.empty(offsets[-1], dtype=np.int64)
    for c in range(n_cycles):
        size = accepted_path(parents, depth, tokens, verdicts, offsets[c], offsets[c + 1] - offsets[c], everywhere, ok,
                             path)
        for i in range(size):
            paths[path_offsets[c] + i] = path[i]
        path_offsets[c + 1] = path_offsets[c] + size
    return path_offsets, paths[:path_offsets[-1]].copy()


@njit(cache=True)
def commit_cycle(c, nodes, n_sel, same_experts, union_ready, offsets, depth, tokens, verdicts, true_bits,
                 predicted_bits, path_offsets, paths, bits, score, count, slots, n_used, clock, counters, config,
                 keep, selected, true_union, predicted_union, admitted, evicted, cand_score, cand_slot, int_cols, row,
                 layer_counts, tokens_out, n_out):
    """Verify ``nodes[:n_sel]`` (sorted, closed, with the root) at cycle ``c``: commit the accepted
    path's prefix inside them plus the bonus token, admit the union of their true experts
    (``true_bits`` / ``predicted_bits``: the trace's per-node sets ``[nodes, L, words]``; the true
    union already in ``true_union`` when ``union_ready``), and fill the cycle's columns in
    ``int_cols[:, row]`` (all but the policy's predictions); ``keep`` orders the cache's evictions
    (:mod:`specfit.kernels.cache`). When ``layer_counts`` (int64 ``[cycles, 5, L]``) has rows, the
    cycle's per-layer accounting goes to ``layer_counts[row]``: the rows of
    :func:`.evaluate.union_accounting`, taken against the residency before the admit (the one the
    policy's selection saw), with :data:`~.evaluate.TRUE_MISSES` the admit's own misses per layer
    (those the ``misses`` column sums; in global mode a layer's admit can evict an expert a later
    layer then misses). Returns the number of committed tokens and the new length of
    ``tokens_out``."""
    base = offsets[c]
    for i in range(n_sel):
        selected[nodes[i]] = True
    k = 0
    for i in range(path_offsets[c], path_offsets[c + 1]):
        if not selected[paths[i]]:
            break
        k += 1
    for i in range(n_sel):
        selected[nodes[i]] = False
    start = path_offsets[c]
    for i in range(1, k):
        tokens_out[n_out] = tokens[base + paths[start + i]]
        n_out += 1
    tokens_out[n_out] = verdicts[base + paths[start + k - 1]]
    n_out += 1
    if not union_ready:
        union_of_rows(true_bits, base, nodes, n_sel, true_union)
    if not same_experts:
        union_of_rows(predicted_bits, base, nodes, n_sel, predicted_union)
    overlap = 0
    union_size = 0
    n_layers, words = true_union.shape
    for layer in range(n_layers):
        for w in range(words):
            union_size += popcount(true_union[layer, w])
            if not same_experts:
                overlap += popcount(true_union[layer, w] & predicted_union[layer, w])
    if same_experts:
        overlap = union_size
    per_layer = layer_counts.shape[0] > 0
    if per_layer:
        count_unions(true_union, true_union if same_experts else predicted_union, bits, layer_counts[row])
        for layer in range(n_layers):      # the admit's misses: its running per-layer counters across it
            layer_counts[row, TRUE_MISSES, layer] = -counters[CACHE_MISSES, layer]
    hits, misses = admit_cycle(true_union, bits, score, count, slots, n_used, clock, counters, config, keep, admitted,
                               evicted, cand_score, cand_slot)
    if per_layer:
        for layer in range(n_layers):
            layer_counts[row, TRUE_MISSES, layer] += counters[CACHE_MISSES, layer]
    int_cols[NODES_VERIFIED, row] = n_sel
    int_cols[DEEPEST_SELECTED, row] = depth[base + nodes[n_sel - 1]]
    int_cols[UNION_SIZE, row] = hits + misses
    int_cols[HITS, row] = hits
    int_cols[MISSES, row] = misses
    int_cols[UNION_OVERLAP, row] = overlap
    int_cols[COMMITTED_TOKENS, row] = k
    return k, n_out


@njit(cache=True)
def _evaluate(probs, bits, base, nodes, n_sel, cached, params, draft_levels, union, scratch):
    """The cost formula on ``nodes[:n_sel]`` of the tree at rows ``base:`` (Selection's numbers;
    ``bits`` the per-node expert sets the policy decides with)."""
    union_of_rows(bits, base, nodes, n_sel, union)
    hits = 0
    total = 0
    for layer in range(union.shape[0]):
        for w in range(union.shape[1]):
            total += popcount(union[layer, w])
            hits += popcount(union[layer, w] & cached[layer, w])
    misses = total - hits
    time_s = cycle_time(params[0], params[1], params[2], params[3], params[4], draft_levels, n_sel, hits, misses)
    return expected_tokens(probs[base:], nodes, n_sel, scratch), time_s, hits, misses


@njit(cache=True)
def record_decision(int_cols, float_cols, row, sequence, position, draft_levels, hits, misses, time_s, tokens):
    """The policy's part of cycle ``row``'s columns: where it ran, the levels it drafted and its
    selection's predicted union, misses, time and tokens (:func:`commit_cycle` writes the rest)."""
    int_cols[SEQUENCE, row] = sequence
    int_cols[POSITION, row] = position
    int_cols[DRAFT_LEVELS, row] = draft_levels
    int_cols[PREDICTED_UNION_SIZE, row] = hits + misses
    int_cols[PREDICTED_MISSES, row] = misses
    float_cols[PREDICTED_TIME_S, row] = time_s
    float_cols[PREDICTED_TOKENS, row] = tokens


@njit(cache=True)
def _cycle_arrays(parents, predicted_experts, base, n, cycle_parents, cycle_experts):
    """Cycle rows ``base:base + n``'s parents and predicted experts as int64 (what the search and
    the levers take), into the scratch arrays."""
    for v in range(n):
        cycle_parents[v] = parents[base + v]
    _expert_rows(predicted_experts, base, 0, n, cycle_experts)


@njit(cache=True)
def _expert_rows(predicted_experts, base, lo, hi, cycle_experts):
    """Rows ``lo:hi`` of the cycle at ``base``'s predicted experts as int64, into the scratch;
    returns how many rows it then holds (``hi``, or ``lo`` when that is more)."""
    for v in range(lo, hi):
        for layer in range(cycle_experts.shape[1]):
            for slot in range(cycle_experts.shape[2]):
                cycle_experts[v, layer, slot] = predicted_experts[base + v, layer, slot]
    return max(lo, hi)


@njit(cache=True)
def _log_union(union_log, row, true_union):
    """Keep cycle ``row``'s true union (words) in ``union_log[row]`` when the unions are recorded
    (``union_log`` has a row per cycle; none: not recorded)."""
    if union_log.shape[0] == 0:
        return
    for layer in range(true_union.shape[0]):
        for w in range(true_union.shape[1]):
            union_log[row, layer, w] = true_union[layer, w]


@njit(cache=True)
def _commit_scratch(offsets, bits, config):
    """The largest tree's size and the scratch arrays :func:`commit_cycle` takes: the plain
    eviction order (no keep), a node mask, the true and predicted unions, the residency the policy
    sees, and the cache's admit scratch."""
    max_nodes = 1
    for c in range(offsets.size - 1):
        max_nodes = max(max_nodes, offsets[c + 1] - offsets[c])
    n_layers, words = bits.shape
    capacity = max(config[3], 1)
    return (max_nodes, np.zeros((0, 0), dtype=np.float64), np.zeros(max_nodes, dtype=np.bool_),
            np.empty((n_layers, words), dtype=np.uint64), np.empty((n_layers, words), dtype=np.uint64),
            np.empty((n_layers, words), dtype=np.uint64), np.empty((n_layers, words), dtype=np.uint64),
            np.empty(n_layers * capacity, dtype=np.int64), np.empty(capacity, dtype=np.int64),
            np.empty(capacity, dtype=np.int64))


@njit(cache=True)
def replay_compiled(kind, total_nodes, max_levels, same_experts, offsets, parents, depth, tokens, verdicts,
                    predicted_experts, true_bits, predicted_bits, path_probs, level_probs, drafter_probs,
                    level_offsets, level_sizes, path_offsets, paths, sequence_starts, prefill_bits, prefill_offsets, params,
                    bits, score,
                    count, slots, n_used, clock, counters, config, link_params, lconf, lf, usage, layer_prefetched,
                    prefetched, union_log, layer_counts, int_cols, float_cols, tokens_out, tokens_per_sequence):
    """Replay every sequence with a compiled policy (``kind`` one of AR, CHAIN, RERANK, DRAFTER_RERANK, ORACLE;
    ``total_nodes`` the rerank's N, ``max_levels`` the levels it drafts) and the levers of
    ``lconf`` (:mod:`.levers`, not with the oracle); ``true_bits`` / ``predicted_bits`` are the
    expert ids' per-node sets (the unions are taken on them); each cycle's true union goes to
    ``union_log[row]`` when it has rows, and its per-layer accounting to ``layer_counts[row]``
    likewise (:func:`commit_cycle`); sequence ``s``'s prompt passes
    ``prefill_bits[prefill_offsets[s]:prefill_offsets[s + 1]]`` are admitted in order before its
    first cycle, and then its decoding begins (:func:`~.cache.begin_decode`). Returns the number of
    cycles run (the columns' length)."""
    max_nodes, no_keep, selected, true_union, predicted_union, cached, admitted, evicted, cand_score, cand_slot = \
        _commit_scratch(offsets, bits, config)
    n_layers, words = bits.shape
    top_k = predicted_experts.shape[2]
    levers = lconf[ADVISOR] != 0 or lconf[PREFETCH] != 0
    read = np.empty_like(bits)
    cycle_parents = np.empty(max_nodes if levers else 0, dtype=np.int64)
    cycle_experts = np.empty((max_nodes if levers else 0, n_layers, top_k), dtype=np.int64)
    nodes = np.empty(max_nodes, dtype=np.int64)
    ok = np.empty(max_nodes, dtype=np.bool_)
    path = np.empty(max_nodes, dtype=np.int64)
    everywhere = np.zeros(0, dtype=np.bool_)
    neg = np.empty(max_nodes, dtype=np.float64)
    scratch = np.empty(max_nodes, dtype=np.float64)
    # the oracle decides with the true experts; with them as the prediction the policy's union is
    # the one charged
    same_union = same_experts or kind == ORACLE
    union_ready = same_experts and kind != ORACLE
    row = 0
    n_out = 0
    for s in range(sequence_starts.size - 1):
        c = sequence_starts[s]
        first_token = n_out
        begin_prompt(config)
        for p in range(prefill_offsets[s], prefill_offsets[s + 1]):   # the prompt's passes in order, as live
            admit_cycle(prefill_bits[p], bits, score, count, slots, n_used, clock, counters, config, no_keep, admitted,
                        evicted, cand_score, cand_slot)
        begin_decode(score, count, config)
        while c < sequence_starts[s + 1]:
            base = offsets[c]
            deepest = level_offsets[c + 1] - level_offsets[c] - 1
            levels = 0 if kind == AR else min(max_levels, deepest)
            n = level_sizes[level_offsets[c] + levels]
            # a tree cut at fewer levels than drafted has its probabilities clipped once more
            probs = path_probs if levels == deepest else level_probs
            for layer in range(n_layers):
                for w in range(words):
                    cached[layer, w] = bits[layer, w]
            if levers:
                _cycle_arrays(parents, predicted_experts, base, n, cycle_parents, cycle_experts)
            copied = 0
            if lconf[PREFETCH]:
                # before each level the policy drafts, on the tree so far (prefetch_level refreshes
                # the residency the selection below is evaluated on)
                lf[CARRY] = 0.0
                for d in range(levels):
                    m = level_sizes[level_offsets[c] + d]
                    copied += prefetch_level(cycle_parents[:m], level_probs[base:base + m], cycle_experts[:m],
                                             config[2], lconf, lf, usage,
                                             link_params, bits, score, count, slots, n_used, clock, counters, config,
                                             cached, layer_prefetched)
            if kind == ORACLE:
                # the best prefix of the accepted path by true throughput; it commits all of it
                size = accepted_path(parents, depth, tokens, verdicts, base, n, everywhere, ok, path)
                for layer in range(n_layers):
                    for w in range(words):
                        true_union[layer, w] = 0
                best_tokens = best_s = 0.0
                best_hits = best_misses = best_j = -1
                for j in range(size):
                    row_j = base + path[j]
                    for layer in range(n_layers):
                        for w in range(words):
                            true_union[layer, w] |= true_bits[row_j, layer, w]
                    hits = 0
                    total = 0
                    for layer in range(n_layers):
                        for w in range(words):
                            total += popcount(true_union[layer, w])
                            hits += popcount(true_union[layer, w] & cached[layer, w])
                    time_s = cycle_time(params[0], params[1], params[2], params[3], params[4], j, j + 1, hits,
                                        total - hits)
                    if best_j < 0 or (j + 1) * best_s > best_tokens * time_s:
                        best_tokens, best_s, best_hits, best_misses, best_j = float(j + 1), time_s, hits, total - hits, j
                n_sel = best_j + 1
                for i in range(n_sel):
                    nodes[i] = path[i]
                sel_levels = best_j
                sel_tokens, sel_s, sel_hits, sel_misses = best_tokens, best_s, best_hits, best_misses
            else:
                if kind == AR:
                    nodes[0] = 0
                    n_sel = 1
                elif kind == CHAIN:
                    nodes[0] = 0
                    n_sel = 1
                    while n_sel <= max_levels:
                        top = -1
                        for u in range(nodes[n_sel - 1] + 1, n):
                            # the drafter's top-1 (``drafter_probs``), as a live chain is drafted,
                            # whatever the calibrated probabilities say
                            if parents[base + u] == nodes[n_sel - 1] and (
                                    top < 0 or drafter_probs[base + u] > drafter_probs[base + top]):
                                top = u
                        if top < 0:
                            break
                        nodes[n_sel] = top
                        n_sel += 1
                else:
                    # rerank: the total_nodes most probable nodes (ties: the earlier), closed; by the
                    # drafter's own probabilities for DRAFTER_RERANK
                    for v in range(n):
                        neg[v] = -(drafter_probs[base + v] if kind == DRAFTER_RERANK else probs[base + v])
                    order = np.argsort(neg[:n], kind="mergesort")
                    selected[0] = True
                    for i in range(min(total_nodes, n)):
                        selected[order[i]] = True
                    for v in range(n - 1, 0, -1):
                        if selected[v]:
                            selected[parents[base + v]] = True
                    n_sel = 0
                    for v in range(n):
                        if selected[v]:
                            nodes[n_sel] = v
                            n_sel += 1
                            selected[v] = False
                sel_levels = levels
                sel_tokens, sel_s, sel_hits, sel_misses = _evaluate(probs, predicted_bits, base, nodes, n_sel,
                                                                    cached, params, levels, true_union, scratch)
            record_decision(int_cols, float_cols, row, s, c - sequence_starts[s], sel_levels, sel_hits, sel_misses,
                            sel_s, sel_tokens)
            keep = no_keep
            if lconf[ADVISOR]:
                keep = _commit_keep(cycle_parents, path_probs[base:base + n], level_probs[base:base + n], cycle_experts,
                                    n, deepest, levels, nodes[:n_sel], config[2], lconf, lf, usage, no_keep,
                                    true_bits, base, bits, true_union, read)
            ready = union_ready or lconf[ADVISOR] != 0      # _commit_keep made the true union
            k, n_out = commit_cycle(c, nodes, n_sel, same_union, ready, offsets, depth, tokens, verdicts,
                                    true_bits, predicted_bits, path_offsets, paths, bits, score, count, slots,
                                    n_used, clock, counters, config, keep, selected, true_union, predicted_union,
                                    admitted, evicted, cand_score, cand_slot, int_cols, row, layer_counts, tokens_out,
                                    n_out)
            if lconf[ADVISOR]:
                observe_union(true_union, config[2], lconf, lf, usage)
            prefetched[row] = copied
            if union_log.shape[0]:
                _log_union(union_log, row, true_union)
            row += 1
            c += k
        tokens_per_sequence[s] = n_out - first_token
    return row


@njit(cache=True)
def decide_cycle(parents, path_probs, level_probs, experts, source, base, level_sizes, cached_bits, n_experts, params,
                 conf, fstate, istate, recent_p, recent_w, acceptance, new_experts, new_is_share, seen, width,
                 link_params, lconf, lf, usage, bits, score, count, slots, n_used, clock, counters, config,
                 layer_prefetched):
    """SpecFit's whole cycle on an already drafted tree (``choose`` over
    :func:`.decide.decide_level`): levels 0, 1, ... until the rule stops or the tree ends, then the
    selection at the levels drafted. ``level_sizes[d]``: nodes within ``d`` levels; a tree cut at
    fewer levels than drafted has the probabilities ``level_probs``, the full one ``path_probs``.
    With the prefetch lever on (``lconf``), each level the rule asks for is preceded by
    :func:`.levers.prefetch_level` on the tree so far (``link_params``: the cost model whose link
    time it fills), which refreshes ``cached_bits``. ``experts`` is int64 scratch that takes the
    predicted experts of ``source``'s rows ``base:`` as the levels reach them (a cycle rarely
    drafts its whole tree). Returns ``(status, draft_levels, nodes, tokens, time_s, hits, misses,
    experts copied)``."""
    deepest = level_sizes.size - 1
    n_layers, top_k = experts.shape[1], experts.shape[2]
    fstate[NODE_PRICE] = node_price(conf, fstate, istate, n_layers, top_k, params[3], params[4])
    prev_nodes, prev_tokens, prev_s, prev_hits, prev_misses = np.zeros(0, dtype=np.int64), 0.0, 0.0, 0, 0
    levels = 0
    searched = -1
    copied = 0
    have = 0
    while levels < deepest and levels < conf[MAX_LEVELS]:
        n = level_sizes[levels]
        have = _expert_rows(source, base, have, n, experts)
        status, go, nodes, tokens, time_s, hits, misses = decide_level(
            parents[:n], level_probs[:n], experts[:n], cached_bits, n_experts, params, levels, conf, fstate,
            istate, recent_p, recent_w, acceptance, new_experts, new_is_share, seen, width, prev_nodes, prev_tokens,
            prev_s)
        if status != OK:
            return status, levels, nodes, tokens, time_s, hits, misses, copied
        prev_nodes, prev_tokens, prev_s, prev_hits, prev_misses, searched = nodes, tokens, time_s, hits, misses, levels
        if not go:
            break
        if lconf[PREFETCH]:
            copied += prefetch_level(parents[:n], level_probs[:n], experts[:n], n_experts, lconf, lf, usage, link_params,
                                     bits, score, count, slots, n_used, clock, counters, config, cached_bits,
                                     layer_prefetched)
        levels += 1
    if searched == levels:
        return OK, levels, prev_nodes, prev_tokens, prev_s, prev_hits, prev_misses, copied
    n = level_sizes[levels]
    _expert_rows(source, base, have, n, experts)
    probs = path_probs if levels == deepest else level_probs
    status, nodes, tokens, time_s, hits, misses = select_level(parents[:n], probs[:n], experts[:n], cached_bits,
                                                               n_experts, params, levels, fstate, prev_nodes)
    return status, levels, nodes, tokens, time_s, hits, misses, copied


@njit(cache=True)
def _commit_keep(parents, path_probs, level_probs, experts, n, deepest, levels, nodes, n_experts, lconf, lf, usage,
                 no_keep, true_bits, base, bits, true_union, read):
    """The cache advisor's keep for a cycle's commit (the tree of the ``levels`` drafted, ``n``
    nodes, after verifying ``nodes``), or ``no_keep`` without an advisor. With one, the true union
    of ``nodes`` is made here (in ``true_union``: the commit takes it as ready) and the keep is
    computed where the admit reads it, at the resident experts and the union's."""
    if not lconf[ADVISOR]:
        return no_keep
    union_of_rows(true_bits, base, nodes, nodes.size, true_union)
    for layer in range(bits.shape[0]):
        for w in range(bits.shape[1]):
            read[layer, w] = bits[layer, w] | true_union[layer, w]
    probs = path_probs if levels == deepest else level_probs
    return keep_priorities(parents[:n], probs[:n], experts[:n], nodes, n_experts, lconf, lf, usage, read)


@njit(cache=True)
def replay_specfit(same_experts, offsets, parents, depth, tokens, verdicts, true_bits, predicted_experts,
                   predicted_bits, path_probs, level_probs, level_offsets, level_sizes, path_offsets, paths,
                   sequence_starts, prefill_bits, prefill_offsets, n_experts,
                   params, conf, fstate, istate, recent_p, recent_w, acceptance, new_experts, new_is_share, seen, width,
                   bits, score, count, slots, n_used, clock, counters, config, link_params, lconf, lf, usage,
                   layer_prefetched, prefetched, union_log, layer_counts, int_cols, float_cols, tokens_out,
                   tokens_per_sequence):
    """Replay every sequence with SpecFit's rules (:func:`decide_cycle` on each cycle's tree with
    its predicted experts and the residency at the cycle's start, then the commit and
    :func:`.decide.observe_cycle`), the policy's state arrays updated in place, and the levers of
    ``lconf`` (:mod:`.levers`; ``prefetched[row]`` the experts each cycle copied ahead), and each
    cycle's true union in ``union_log[row]`` and its per-layer accounting in ``layer_counts[row]``
    when they have rows (:func:`commit_cycle`). Returns the number of cycles run;
    ``status`` errors of the search end the replay early with ``-1 - status``."""
    max_nodes, no_keep, selected, true_union, predicted_union, cached, admitted, evicted, cand_score, cand_slot = \
        _commit_scratch(offsets, bits, config)
    n_layers, words = bits.shape
    top_k = predicted_experts.shape[2]
    cycle_parents = np.empty(max_nodes, dtype=np.int64)
    cycle_experts = np.empty((max_nodes, n_layers, top_k), dtype=np.int64)
    read = np.empty_like(bits)
    row = 0
    n_out = 0
    for s in range(sequence_starts.size - 1):
        c = sequence_starts[s]
        first_token = n_out
        begin_prompt(config)
        for p in range(prefill_offsets[s], prefill_offsets[s + 1]):   # the prompt's passes in order, as live
            admit_cycle(prefill_bits[p], bits, score, count, slots, n_used, clock, counters, config, no_keep, admitted,
                        evicted, cand_score, cand_slot)
        begin_decode(score, count, config)
        while c < sequence_starts[s + 1]:
            base = offsets[c]
            n = offsets[c + 1] - base
            for v in range(n):
                cycle_parents[v] = parents[base + v]
            for layer in range(n_layers):
                for w in range(words):
                    cached[layer, w] = bits[layer, w]
            lf[CARRY] = 0.0
            sizes = level_sizes[level_offsets[c]:level_offsets[c + 1]]
            # (decide_cycle copies the predicted experts of the levels it reaches)
            status, levels, nodes, sel_tokens, sel_s, sel_hits, sel_misses, copied = decide_cycle(
                cycle_parents[:n], path_probs[base:base + n], level_probs[base:base + n], cycle_experts,
                predicted_experts, base, sizes, cached, n_experts, params, conf, fstate, istate, recent_p, recent_w,
                acceptance, new_experts, new_is_share, seen, width, link_params, lconf, lf, usage, bits, score, count,
                slots, n_used, clock, counters, config, layer_prefetched)
            if status != 0:
                return -1 - status
            # what the root's true and predicted experts miss against the residency the policy saw
            root_misses = count_missing_row(true_bits, base, bits)
            root_predicted_misses = count_missing_row(predicted_bits, base, bits)
            record_decision(int_cols, float_cols, row, s, c - sequence_starts[s], levels, sel_hits, sel_misses, sel_s,
                            sel_tokens)
            keep = no_keep
            if lconf[ADVISOR]:      # (guarded here: a call passes every array it takes)
                keep = _commit_keep(cycle_parents, path_probs[base:base + n], level_probs[base:base + n], cycle_experts,
                                    sizes[levels], sizes.size - 1, levels, nodes, n_experts, lconf, lf, usage, no_keep,
                                    true_bits, base, bits, true_union, read)
            ready = lconf[ADVISOR] != 0      # _commit_keep made the true union
            k, n_out = commit_cycle(c, nodes, nodes.size, same_experts, ready, offsets, depth, tokens, verdicts,
                                    true_bits, predicted_bits, path_offsets, paths, bits, score, count, slots,
                                    n_used, clock, counters, config, keep, selected, true_union, predicted_union,
                                    admitted, evicted, cand_score, cand_slot, int_cols, row, layer_counts, tokens_out,
                                    n_out)
            if lconf[ADVISOR]:
                observe_union(true_union, n_experts, lconf, lf, usage)
            if union_log.shape[0]:
                _log_union(union_log, row, true_union)
            observe_cycle(fstate, istate, nodes.size, int_cols[MISSES, row], root_misses, sel_misses,
                          root_predicted_misses)
            prefetched[row] = copied
            row += 1
            c += k
        tokens_per_sequence[s] = n_out - first_token
    return row
