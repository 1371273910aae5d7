"""The layer-ahead prefetch's ceiling: how much of a cycle's transfer time copies of the next
layer's experts, made while a layer computes, could hide.

Like :mod:`specfit.experts.belady`, this recharges a replay's recorded cycle unions offline; it
changes no decision. The cost model's terms are split by layer (no preset or fit gives another
split): a verification pass runs its layers in order, and at layer ``l`` the link first copies
the layer's misses (``misses_l * transfer_s``, ``transfer_s = miss_s - hit_s``), then the layer
computes for

    compute_l = (base_s + per_node_s * nodes) / L + union_l * hit_s

with the link idle. A prefetcher that knows (or predicts) layer ``l + 1``'s experts once layer
``l`` is routed can use that idle window: it copies its candidates for ``l + 1`` in rank order,
those not resident, one ``transfer_s`` each, and stops when the window closes. Each copy of an
expert that layer ``l + 1`` misses hides the part of its transfer inside the window (the rest
runs on in layer ``l + 1``'s time, as its miss would have); a copy of an expert it does not need
hides nothing, costs nothing while inside the window, and if it is still under way when the window
closes its overrun delays layer ``l + 1``'s own copies where it has any left, and otherwise keeps the
link from the next window for as long (a copy is not cancelled). So the copy that
would run past the window is started only when it pays in expectation: ``p * inside >= (1 - p) *
overrun``, ``p`` the prefetcher's probability that the expert is needed. With the true misses as
the candidates the hidden time is ``min(misses_{l+1} * transfer_s, compute_l)``, the ceiling of any
next-layer predictor. Layer 0 has no window in the pass (the drafting before it is the draft-time
prefetch's, :mod:`specfit.experts.prefetch`).

The cache is the replay's own (:class:`~specfit.experts.cache.ExpertCache`, per layer or
global, any eviction rule, rebuilt here and admitting each cycle's union as the replay did); prefetched experts go to a
staging buffer for one layer and evict nothing, so residency, hits and misses are those of the
replay and only time is recharged. A policy that knew of the overlap might choose other subtrees;
this keeps its choices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..costmodel import CostModel
from .belady import request_matrix
from .cache import ExpertCache

__all__ = ["LayerAhead", "layer_ahead", "TransitionRanker", "CrossFitRankers", "PREFETCHERS", "recount"]

# rank(cycle, union) -> (ids int64 [L - 1, E], p float [L - 1, E]): per layer l >= 1 the candidates
# for it, best first, given ``union`` (bool [L, E], each layer's union of the cycle; a prefetcher
# reads only layer l - 1's row for layer l), and the probability that each is needed; -1 pads a row
Ranker = Callable[[int, np.ndarray], tuple[np.ndarray, np.ndarray]]


@dataclass
class LayerAhead:
    """Per-cycle arrays of a recharge (int64 or float64 [cycles])."""

    hits: np.ndarray
    misses: np.ndarray
    time_s: np.ndarray          # the cost model's cycle time (no overlap)
    hidden_s: np.ndarray        # transfer time the windows hid, less wasted copies' overruns
    copies: np.ndarray          # copies started in the windows
    useful: np.ndarray          # of them, copies of an expert the next layer missed

    @property
    def time_with_overlap_s(self) -> np.ndarray:
        return self.time_s - self.hidden_s

    @property
    def precision(self) -> float:
        """Share of the copies made that the next layer needed."""
        copies = int(self.copies.sum())
        return float(self.useful.sum()) / copies if copies else float("nan")


def _last_copy(window: np.ndarray, started: np.ndarray, transfer_s: float):
    """Per layer, the last of ``started`` copies (copy j takes ``[j t, (j + 1) t)``): its index,
    and its seconds inside the window and past it (0 for a copy that ends inside)."""
    last = np.maximum(started - 1, 0).astype(np.int64)
    return last, window - last * transfer_s, np.maximum(started * transfer_s - window, 0.0)


def _hidden(room: np.ndarray, useful: np.ndarray, transfer_s: float) -> float:
    """Transfer time hidden by the copies ``useful[l, j]`` marks as of a missed expert, copy j
    taking ``[j t, (j + 1) t)`` of a window with ``room[l]`` seconds free for copies."""
    j = np.arange(useful.shape[1])
    inside = np.clip(room[:, None] - j[None, :] * transfer_s, 0.0, transfer_s)
    return float((inside * useful).sum())


def layer_ahead(unions: list[np.ndarray], nodes: np.ndarray, draft_levels: np.ndarray, n_layers: int,
                n_experts: int, capacity: int, cost: CostModel, rank: Ranker | None = None,
                policy: str = "lru", mode: str = "per_layer", sequence: np.ndarray | None = None,
                prefill_unions: dict[int, list[np.ndarray]] | None = None) -> LayerAhead:
    """Recharge a replay's cycles (``unions``: flat item ids ``layer * E + expert`` per cycle;
    ``nodes`` and ``draft_levels`` per cycle) with the layer-ahead windows, on a cache of
    ``capacity`` experts per layer (``mode="global"``: slots shared by every layer) evicting by
    ``policy`` (LRU by default; any of :data:`~specfit.experts.cache.EVICTION_POLICIES`).
    ``rank``: the prefetcher's candidates (see :data:`Ranker`); ``None``: the true misses, the
    ceiling.

    With ``sequence`` (int [cycles], each cycle's sequence, in order: a replay log's column) the
    cache serves the requests as the replay's did: before each sequence's first cycle its prompt
    passes (``prefill_unions[s]``, a log's, flat item ids per pass) are admitted and its decoding
    begins (:meth:`~specfit.experts.cache.ExpertCache.begin_decode`); a sequence with prompt
    passes and no cycle still admits them. Without it, one request throughout."""
    transfer_s = cost.miss_s - cost.hit_s
    if transfer_s < 0:
        raise ValueError(f"cost model: miss_s ({cost.miss_s}) below hit_s ({cost.hit_s})")
    req = request_matrix(unions, n_layers * n_experts).reshape(len(unions), n_layers, n_experts)
    T = req.shape[0]
    cache = ExpertCache(n_layers, n_experts, capacity, mode=mode, policy=policy)
    out = LayerAhead(*(np.zeros(T, dtype=np.int64) for _ in range(2)), np.zeros(T), np.zeros(T),
                     *(np.zeros(T, dtype=np.int64) for _ in range(2)))
    fixed_s = cost.base_s / n_layers
    for lo, hi in _requests(cache, T, n_layers, n_experts, sequence, prefill_unions):
        for t in range(lo, hi):
            _window(t, req[t], cache, out, rank, nodes[t], fixed_s, transfer_s, cost)
    out.time_s[:] = cost.predict_counts(draft_levels, nodes, out.hits, out.misses)
    return out


def _requests(cache: ExpertCache, T: int, n_layers: int, n_experts: int, sequence, prefill_unions):
    """Yield each request's cycles ``(lo, hi)``, its prompt passes admitted and its decoding begun
    first (see :func:`layer_ahead`)."""
    if sequence is None:
        if prefill_unions:
            raise ValueError("layer_ahead: prefill_unions needs sequence, the cycles' sequences")
        yield 0, T
        return
    sequence = np.asarray(sequence, dtype=np.int64)
    if sequence.shape != (T,) or np.any(np.diff(sequence) < 0):
        raise ValueError(f"layer_ahead: sequence has shape {sequence.shape}, expected ({T},) in non-decreasing order, "
                         f"one a cycle as a replay makes them")
    prefills = prefill_unions or {}
    for s in sorted(set(prefills) | set(sequence.tolist())):
        cache.begin_prompt()
        for union in prefills.get(s, []):
            cache.admit(request_matrix([union], n_layers * n_experts).reshape(n_layers, n_experts))
        cache.begin_decode()
        yield int(np.searchsorted(sequence, s)), int(np.searchsorted(sequence, s, side="right"))


def _window(t: int, union: np.ndarray, cache: ExpertCache, out: LayerAhead, rank, nodes: int, fixed_s: float,
            transfer_s: float, cost: CostModel) -> None:
    """Admit cycle ``t``'s ``union`` (bool [L, E]) and charge its windows into ``out``."""
    result = cache.admit(union)
    # each layer's residency when the window before it runs: once the earlier layers are admitted
    # (in global mode they may evict its experts, needed or not)
    hit_mask, resident = result.hit_mask, result.resident_before
    out.hits[t], out.misses[t] = int(hit_mask.sum()), int((union & ~hit_mask).sum())
    n_layers = union.shape[0]
    if n_layers < 2 or transfer_s == 0:
        return
    missed = union & ~hit_mask                     # [L, E]: what the pass copies, per layer
    window = fixed_s + cost.per_node_s * nodes / n_layers + union.sum(axis=1)[:-1] * cost.hit_s
    # no layer copies more than its experts (a near-free copy would ask for slots without end)
    slots = min(int(np.ceil(window.max() / transfer_s)), union.shape[1])
    if slots == 0:                                 # no compute time to overlap
        return
    if rank is None:
        # the true misses of each next layer, as many as the window starts
        started = np.minimum(missed[1:].sum(axis=1), np.ceil(window / transfer_s))
        # every copy started is of a true miss; the slots run to the widest window
        useful = np.arange(slots)[None, :] < started[:, None]
        out.hidden_s[t] = _hidden(window, useful, transfer_s)
    else:
        ranked, p = (np.asarray(x) for x in rank(t, union))
        ok = ranked >= 0
        ids = np.where(ok, ranked, 0)
        # candidates already resident need no copy: drop them, keeping the order
        ok &= ~np.take_along_axis(resident[1:], ids, axis=1)
        order = np.argsort(~ok, axis=1, kind="stable")[:, :slots]
        ids, ok, p = (np.take_along_axis(x, order, axis=1) for x in (ids, ok, p))
        hit = np.zeros((n_layers - 1, slots), dtype=bool)
        hit[:, :ids.shape[1]] = ok & np.take_along_axis(missed[1:], ids, axis=1)
        candidates, needed = ok.sum(axis=1), missed[1:].sum(axis=1)
        # the link may still be busy as a window opens (``carry``): a wasted copy still under way
        # at the last window's close, where that layer had no copy of its own left to delay
        carry = np.zeros(n_layers - 1)
        while True:
            room = np.maximum(window - carry, 0.0)
            started = np.minimum(candidates, np.ceil(room / transfer_s))
            # the copy that would run past the window: started only when it pays in expectation
            last, inside, overrun = _last_copy(room, started, transfer_s)
            chance = np.take_along_axis(p, np.minimum(last, p.shape[1] - 1)[:, None], axis=1)[:, 0]
            started -= (started > 0) & (overrun > 0) & (chance * inside < (1.0 - chance) * overrun)
            useful = hit & (np.arange(slots)[None, :] < started[:, None])
            last, _, overrun = _last_copy(room, started, transfer_s)
            wasted = (started > 0) & ~np.take_along_axis(useful, last[:, None], axis=1)[:, 0]
            # the link's time past the window's close that no needed copy uses
            spill = np.where(started > 0, np.where(wasted, overrun, 0.0), np.maximum(carry - window, 0.0))
            left = needed > useful.sum(axis=1)         # the next layer copies a miss of its own
            later = np.zeros_like(carry)
            later[1:] = np.where(left[:-1], 0.0, spill[:-1])
            if np.array_equal(later, carry):
                break
            carry = later
        # a spill delays the next layer's own copies where it has any; else it shortens its window
        out.hidden_s[t] = _hidden(room, useful, transfer_s) - float((spill * left).sum())
    out.copies[t], out.useful[t] = int(started.sum()), int(useful.sum())


class TransitionRanker:
    """A next-layer predictor a routing trace can replay: ``P(e' at l + 1 | e at l)`` counted over
    the positions given (one token's experts per position), and layer ``l + 1``'s candidates
    ranked by ``sum over e in union_l of P(e' | e)`` (ties: the lower id; experts never seen
    after the union's are not candidates). The probability that a candidate is needed by one token
    is the mean of its conditionals over the union (a token's ``k`` experts: a mixture of them),
    and by any of ``nodes`` tokens ``1 - (1 - mean) ** nodes``. (The noisy-or of the conditionals
    treats a token's experts as independent witnesses and put the top candidate near certainty
    where it was needed far less often on the shipped and shared traces; the mean stays near the
    observed rate, erring low: ``benchmarks/RESULTS.md``, "Stop 43: the layer-ahead prefetch's
    ceiling".)"""

    def __init__(self, experts: np.ndarray, n_experts: int):
        experts = np.asarray(experts, dtype=np.int64)          # [positions, L, k], -1: unknown
        n, n_layers, _ = experts.shape
        onehot = np.zeros((n, n_layers, n_experts + 1))
        np.put_along_axis(onehot, np.where(experts >= 0, experts, n_experts), 1.0, axis=2)
        onehot = onehot[:, :, :n_experts]
        # counts[l, e, e']: positions with e at layer l and e' at layer l + 1
        counts = np.einsum("nle,nlf->lef", onehot[:, :-1], onehot[:, 1:])
        seen = onehot[:, :-1].sum(axis=0)                      # [L - 1, E]
        self.conditional = counts / np.maximum(seen, 1.0)[:, :, None]
        self.n_experts = n_experts

    def scores(self, union: np.ndarray) -> np.ndarray:
        """float [L - 1, E]: each next layer's scores given ``union`` (bool [L, E])."""
        return np.einsum("le,lef->lf", np.asarray(union[:-1], dtype=np.float64), self.conditional)

    def rank(self, cycle: int, union: np.ndarray, nodes: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """:data:`Ranker` for a cycle that verified ``nodes`` tokens."""
        scores = self.scores(union)
        order = np.argsort(-scores, axis=1, kind="stable")
        mean = np.minimum(scores / np.maximum(np.asarray(union[:-1]).sum(axis=1), 1)[:, None], 1.0)
        chance = 1.0 - (1.0 - np.take_along_axis(mean, order, axis=1)) ** max(int(nodes), 1)
        return np.where(np.take_along_axis(scores, order, axis=1) > 0, order, -1), chance


# the prefetchers a replay can be recounted with: the true next-layer misses (the ceiling of any),
# the transition table, MoE-Infinity's activation-matrix matching (:mod:`specfit.experts.eam`)
PREFETCHERS = ("ceiling", "transition", "eam")


class CrossFitRankers:
    """The next-layer predictors of one prepared trace, cross-fitted: the trace's cycles dealt to two
    folds (:func:`~specfit.experts.predictors.cycle_folds`, as the expert predictors are), and a
    cycle ranked by what the other fold fitted: a transition table on its committed tokens, and
    MoE-Infinity's collection of its requests' activation matrices (a request: one sequence of one
    fold). A trace of one sequence is cut in two halves, each ranked by the other's fit; a trace of
    one cycle has no other fold, and its rankers know nothing (no transition; one empty matrix)."""

    def __init__(self, prep):
        from .eam import EAMRanker, activation_matrices
        from .predictors import cycle_folds

        trace = self.trace = prep.trace
        self.prep = prep
        self.fold = cycle_folds(trace, 2)
        self.roots = trace.true_experts[trace.offsets[:-1]]          # [cycles, L, k]: committed tokens
        _, request = np.unique(np.stack([trace.sequence, self.fold]), axis=1, return_inverse=True)
        request = request.ravel()
        self.eam, self.transition = [], []
        k = trace.true_experts.shape[2]
        for f in (0, 1):
            mine = self.fold == f
            _, owner = np.unique(request[mine], return_inverse=True)
            matrices = activation_matrices(self.roots[mine], owner, trace.n_experts)
            if not mine.any():                                        # one cycle: no other fold
                matrices = np.zeros((1, trace.n_layers, trace.n_experts))
            self.eam.append(EAMRanker(matrices, k))
            self.transition.append(TransitionRanker(self.roots[mine], trace.n_experts))

    def ranker(self, name: str, log) -> Ranker | None:
        """:func:`layer_ahead`'s ``rank`` for prefetcher ``name`` (:data:`PREFETCHERS`; ``ceiling``:
        None) over the cycles of ``log``, a replay of this trace in order; MoE-Infinity's with the
        activation matrix of the request's tokens committed before each cycle."""
        if name not in PREFETCHERS:
            raise ValueError(f"prefetcher: expected one of {', '.join(PREFETCHERS)}, got {name!r}")
        if name == "ceiling":
            return None
        c, prep, trace = log.columns, self.prep, self.trace
        first = prep.first_cycles[c["sequence"]] + c["position"]          # each cycle's first trace cycle
        other = 1 - self.fold[first]
        nodes = c["nodes_verified"]
        if name == "transition":
            return lambda t, union: self.transition[other[t]].rank(t, union, nodes[t])
        history = np.zeros((trace.n_layers, trace.n_experts))
        at = [-1, -1]                                                     # (sequence, trace cycle) counted to
        layers = np.arange(trace.n_layers)[:, None]

        def eam(t, union):
            seq = int(c["sequence"][t])
            if at[0] != seq:
                history[:] = 0.0
                at[:] = [seq, int(prep.first_cycles[seq])]
            for cycle in range(at[1], int(first[t])):                     # the tokens committed since
                ids = self.roots[cycle]
                known = ids >= 0                                          # -1: an unknown expert
                np.add.at(history, (np.broadcast_to(layers, ids.shape)[known], ids[known]), 1.0)
            at[1] = max(at[1], int(first[t]))
            return self.eam[other[t]].rank(history, nodes[t])

        return eam


def recount(trace, log, capacity: int, cost: CostModel, prefetcher: str = "ceiling",
            rankers: CrossFitRankers | None = None, mode: str = "per_layer", policy: str = "lru") -> LayerAhead:
    """A replay's ``log`` of ``trace`` (recorded with ``record_unions``, of a policy without cache
    levers, on a ``mode`` cache of ``capacity`` evicting by ``policy``) recounted with
    ``prefetcher``'s layer-ahead windows (:data:`PREFETCHERS`; all but the ceiling take their
    predictors from ``rankers``), each request served as the replay served it; refuses to answer
    unless the recount's hits, misses and time are the replay's."""
    c = log.columns
    if log.unions is None:
        raise ValueError("recount: the log has no unions; replay with record_unions=True")
    if prefetcher != "ceiling" and rankers is None:
        raise ValueError(f"recount: prefetcher {prefetcher!r} needs rankers (CrossFitRankers of the trace)")
    rank = None if prefetcher == "ceiling" else rankers.ranker(prefetcher, log)
    out = layer_ahead(log.unions, c["nodes_verified"], c["draft_levels"], trace.n_layers, trace.n_experts, capacity,
                      cost, rank=rank, policy=policy, mode=mode, sequence=c["sequence"],
                      prefill_unions=log.prefill_unions)
    if not (np.array_equal(out.hits, c["hits"]) and np.array_equal(out.misses, c["misses"])
            and np.allclose(out.time_s, c["charged_time_s"], rtol=1e-9)):
        raise ValueError("recount: the cache rebuilt from the log's unions gives other hits, misses or time than the "
                         "replay (a policy with cache levers, or another cache or cost model)")
    return out
