"""The device expert cache, shared by the live decoder and the simulator.

The cache only does the bookkeeping: which experts are resident, which of a cycle's union are
hits, which must be copied (misses), which are evicted, and which overflow and are streamed
through a staging buffer without staying resident. The live runtime maps the admitted / evicted
masks onto its device buffers; the simulator only counts.

Rules (deterministic, the same in both modes):
- ``admit(union)`` handles layers in order 0..L-1, as a forward pass does.
- At a layer, the union's resident experts are hits; the others are misses.
- Misses are admitted in ascending expert id into free slots, then into slots freed by evicting the
  lowest-scoring resident experts that are not in the layer's union; misses that still find no
  slot are *streamed*: counted as misses, moved, and not kept.
- Scores (``lru``): the touch order, where within one admit the hits are touched before the
  admitted misses, each group in ascending expert id (and, in global mode, layer l before l + 1).
  ``lfu`` scores by touch count first, then recency; ``fifo`` by admission order.
  ``moe-infinity`` is the rule of MoE-Infinity's expert dispatcher (``FindExpertEvict`` in
  EfficientMoE/MoE-Infinity's ``core/parallel/expert_dispatcher.cpp``): the fewest fetches from
  the host since the request's decoding began (:meth:`begin_decode`), its ``incache_visit_count``:
  a miss counts, streamed or admitted, a hit does not (the dispatcher runs a resident expert
  without passing its fetch thread), nor a prefetch lever's copy; counts are kept across
  evictions; ties go to the lowest ``(layer, expert)`` (MoE-Infinity scans a
  ``std::unordered_set``, whose order its library decides); between :meth:`begin_prompt` and
  :meth:`begin_decode` (a request's prompt passes) it evicts nothing, a miss taking a free slot or
  streamed, as MoE-Infinity's dispatcher runs a prompt's miss in one extra slot and sends it back
  (it tells a prompt by a pass of more than one token; a speculative verification pass counts as
  decoding here, MoE-Infinity's decode path being the baseline compared with).
- ``admit_layer(layer, expert_ids)`` is ``admit`` of a union with only that row set (the touch
  clock advances once per call) and touches only that layer's state in per-layer mode.
- Look-ahead (optional, :mod:`specfit.experts.lookahead` computes it): ``keep[layer, expert]``, a
  non-negative priority (e.g. the probability that the draft's next tokens need the expert);
  victims are the evictable experts with the lowest ``(keep, score)``, and when not every miss
  finds a slot the admitted ones are those with the highest ``keep`` (ties: ascending id), so
  ``keep = 0`` everywhere is the plain policy. ``prefetch(mask, keep)`` makes experts resident
  before they are asked for (counted in ``prefetched``, not as hits or misses) by the same rules,
  taking no slot from an expert whose ``keep`` is not below the prefetched one's.

The bookkeeping runs compiled (:mod:`specfit.kernels.cache`) over the state this class owns:
resident sets as ``uint64`` bitsets, eviction scores, and a slot table that lists what is
resident so that victims are chosen among C slots rather than over ``[L, E]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import kernels
from ..search import remember_packed

__all__ = ["ExpertCache", "AdmitResult", "LayerAdmit", "LayerCounts", "EVICTION_POLICIES", "cache_mode_name"]

EVICTION_POLICIES = ("lru", "lfu", "fifo", "moe-infinity")


def cache_mode_name(value: str) -> str:
    """A cache mode as given (``per_layer`` or ``global``; ``per-layer`` spelled as the options
    spell their other values, e.g. ``moe-infinity``) as the cache and the outputs name it."""
    return "per_layer" if value == "per-layer" else value


class LayerCounts:
    """Totals over layers of per-layer ``hits`` and ``misses`` (int64 [L]) arrays."""

    hits: np.ndarray
    misses: np.ndarray

    @property
    def total_hits(self) -> int:
        return int(self.hits.sum())

    @property
    def total_misses(self) -> int:
        return int(self.misses.sum())

    @property
    def hit_rate(self) -> float:
        """Hits over the experts looked up; NaN when none was (no pass: no rate to give)."""
        total = self.total_hits + self.total_misses
        return self.total_hits / total if total else float("nan")


@dataclass
class AdmitResult(LayerCounts):
    """Per-layer outcome of one ``admit``; counts are int64 [L], masks bool [L, E]. In global mode
    an expert one layer admits may be evicted by a later layer of the same call: it is then in
    both ``admitted_mask`` and ``evicted_mask`` (once, though ``evictions`` counts each), and
    ``resident()`` says which it ended as; a caller that must map slots admits layer by layer
    (:meth:`ExpertCache.admit_layer`, as the live runtime does)."""

    hits: np.ndarray
    misses: np.ndarray
    evictions: np.ndarray
    streamed: np.ndarray
    hit_mask: np.ndarray
    admitted_mask: np.ndarray
    evicted_mask: np.ndarray
    streamed_mask: np.ndarray
    # each layer's residency as its admission began: after the earlier layers' (which in global
    # mode may have evicted its experts, needed or not); None for a prefetch
    resident_before: np.ndarray | None = None


@dataclass
class LayerAdmit:
    """Outcome of one ``admit_layer``: expert ids (int64, ascending) of the layer's hits, of the
    misses admitted into slots and of the misses streamed; ``evicted`` int64 [m, 2] holds the
    (layer, expert) pairs evicted, ascending (global mode may evict other layers' experts)."""

    hit_ids: np.ndarray
    admitted_ids: np.ndarray
    streamed_ids: np.ndarray
    evicted: np.ndarray
    hits: int
    misses: int
    evictions: int
    streamed: int


class ExpertCache(LayerCounts):
    """Expert residency for ``n_layers`` x ``n_experts`` experts.

    Args:
        n_layers, n_experts: the model's MoE shape.
        capacity: slots per layer (``mode="per_layer"``) or in total (``mode="global"``);
            0 means nothing stays resident (every expert is streamed).
        mode: ``"per_layer"`` or ``"global"``.
        policy: eviction policy, one of :data:`EVICTION_POLICIES`.
        expert_bytes: bytes of one expert, for the byte counters.
    """

    @staticmethod
    def slot_limit(n_layers: int, n_experts: int, mode: str = "per_layer") -> int:
        """The most experts a cache can hold: a layer's experts (``per_layer``, the capacity counts
        slots per layer) or every layer's (``global``); a larger capacity is clamped to it."""
        return n_experts if mode == "per_layer" else n_layers * n_experts

    @staticmethod
    def staging_buffers(capacity: int, n_experts: int, policy: str = "lru", limit: int | None = None) -> int:
        """Expert-sized device buffers held beside the cache's slots: a layer's union always fits
        once ``capacity`` >= ``n_experts`` (per layer, or globally since only the current layer's
        union is protected from eviction); below that its overflow streams through two, and so
        does a ``moe-infinity`` prompt pass's miss that finds no free slot (it evicts nothing),
        unless the cache holds every expert (``limit``: :meth:`slot_limit`)."""
        prompt_streams = policy == "moe-infinity" and (limit is None or capacity < limit)
        return 2 if capacity < n_experts or prompt_streams else 0

    def __init__(self, n_layers: int, n_experts: int, capacity: int, mode: str = "per_layer",
                 policy: str = "lru", expert_bytes: int = 0):
        if n_layers <= 0 or n_experts <= 0:
            raise ValueError(f"ExpertCache: expected positive n_layers and n_experts, got {n_layers}, {n_experts}")
        if mode not in ("per_layer", "global"):
            raise ValueError(f"ExpertCache.mode: expected 'per_layer' or 'global', got {mode!r}")
        if policy not in EVICTION_POLICIES:
            raise ValueError(f"ExpertCache.policy: expected one of {EVICTION_POLICIES}, got {policy!r}")
        limit = self.slot_limit(n_layers, n_experts, mode)
        for name, value in (("capacity", capacity), ("expert_bytes", expert_bytes)):
            if isinstance(value, (bool, str)) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"ExpertCache.{name}: expected a non-negative integer, got {value!r}")
        self.n_layers, self.n_experts = int(n_layers), int(n_experts)
        self.capacity = min(int(capacity), limit)
        self.mode, self.policy, self.expert_bytes = mode, policy, int(expert_bytes)
        self._words = (self.n_experts + 63) // 64
        self._config = np.array([mode == "global", EVICTION_POLICIES.index(policy), self.n_experts, self.capacity,
                                 kernels.cache.DECODING], dtype=np.int64)
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        shape = (self.n_layers, self.n_experts)
        rows = self.n_layers if self.mode == "per_layer" else 1
        self._bits = np.zeros((self.n_layers, self._words), dtype=np.uint64)   # resident sets
        self._score = np.zeros(shape, dtype=np.int64)   # eviction order key (smallest goes first)
        self._count = np.zeros(shape, dtype=np.int64)   # touches, for lfu and moe-infinity
        self._slots = np.full((rows, self.capacity), -1, dtype=np.int64)
        self._n_used = np.zeros(rows, dtype=np.int64)
        self._clock = np.zeros(1, dtype=np.int64)
        self._counters = np.zeros((4, self.n_layers), dtype=np.int64)
        self.hits, self.misses, self.evictions, self.streamed = self._counters
        self.prefetched = np.zeros(self.n_layers, dtype=np.int64)   # experts copied by prefetch()
        self._config[4] = kernels.cache.DECODING

    def kernel_state(self) -> tuple:
        """The arrays the compiled kernels update in place, in the order of
        :func:`specfit.kernels.cache.admit_rows` (bits, score, count, slots, n_used, clock,
        counters, config): for a compiled driver (the replay) that admits without a Python call."""
        return (self._bits, self._score, self._count, self._slots, self._n_used, self._clock, self._counters,
                self._config)

    def resident(self, read_only: bool = False) -> np.ndarray:
        """[L, E] bool copy of what is resident now; ``read_only`` marks it so (what a policy
        decides on: the search then packs it once however often it searches)."""
        out = kernels.bitsets.unpack(self._bits, self.n_experts)
        if read_only:
            remember_packed(out)
        return out

    def warm(self, resident: np.ndarray) -> None:
        """Start from ``resident`` (e.g. a prefill's experts) without counting hits or misses;
        when more are given than fit, the first in ascending (layer, expert) order are kept, and
        they count as touched in that order."""
        resident = np.asarray(resident, dtype=bool)
        if resident.shape != (self.n_layers, self.n_experts):
            raise ValueError(f"resident: expected shape {(self.n_layers, self.n_experts)}, got {resident.shape}")
        self.reset()
        if self.mode == "per_layer":
            keep = resident & (np.cumsum(resident, axis=1) <= self.capacity)
            layers, experts = np.nonzero(keep)
            rank = np.cumsum(keep, axis=1)[layers, experts] - 1
            self._slots[layers, rank] = experts
            self._n_used[:] = np.count_nonzero(keep, axis=1)
        else:
            keep = resident & (np.cumsum(resident.ravel()).reshape(resident.shape) <= self.capacity)
            items = np.flatnonzero(keep)
            self._slots[0, :items.size] = items
            self._n_used[0] = items.size
        self._bits[:] = kernels.bitsets.pack_mask(keep)
        order = np.arange(keep.size, dtype=np.int64).reshape(keep.shape) - keep.size  # before any admit
        np.copyto(self._score, order, where=keep)
        np.copyto(self._count, 1, where=keep)
        if self.policy == "moe-infinity":        # its order: fetches (one each here), then (layer, expert)
            self._score[:] = self._count * kernels.cache.SPAN + order + keep.size

    def begin_prompt(self) -> None:
        """A request's prompt passes begin: under ``moe-infinity`` they evict nothing until
        :meth:`begin_decode` (a miss takes a free slot or is streamed: MoE-Infinity runs a prompt
        pass's miss in one extra slot and sends it back, so that the prompt does not pollute the
        cache); the other policies admit as always. The live decoder and every replay call it
        before each prompt."""
        kernels.cache.begin_prompt(self._config)

    def begin_decode(self) -> None:
        """A request's decoding begins (its prompt has run): ``moe-infinity`` forgets its counts of
        fetches, as MoE-Infinity clears them when a request's first token is out, and evicts again;
        the other policies keep theirs. The live decoder and every replay call it after each
        prompt (a cache never given :meth:`begin_prompt` is decoding throughout)."""
        kernels.cache.begin_decode(self._score, self._count, self._config)

    @property
    def capacity_share(self) -> float:
        """The share of the experts that can be resident at once (per layer or overall)."""
        return self.capacity / self.slot_limit(self.n_layers, self.n_experts, self.mode)

    @property
    def bytes_h2d(self) -> int:
        return int(self.misses.sum()) * self.expert_bytes

    # ------------------------------------------------------------------ admit
    def admit(self, union: np.ndarray, keep: np.ndarray | None = None) -> AdmitResult:
        """Make a cycle's union (``[L, E]`` bool) resident as far as capacity allows; ``keep``
        (float ``[L, E]``, optional) orders the victims before the policy's scores do."""
        return self._admit(self._check_mask("union", union), self.kernel_keep(keep))

    def _admit(self, union: np.ndarray, keep: np.ndarray) -> AdmitResult:
        bitsets = kernels.bitsets
        counts = np.zeros((4, self.n_layers), dtype=np.int64)
        sets = np.zeros((5, self.n_layers, self._words), dtype=np.uint64)
        kernels.cache.admit_union(bitsets.pack_mask(union), *self.kernel_state(), keep, counts, *sets)
        hit, admitted, evicted, streamed, before = (bitsets.unpack(s, self.n_experts) for s in sets)
        return AdmitResult(hits=counts[0], misses=counts[1], evictions=counts[2], streamed=counts[3], hit_mask=hit,
                           admitted_mask=admitted, evicted_mask=evicted, streamed_mask=streamed,
                           resident_before=before)

    def admit_layer(self, layer: int, expert_ids: np.ndarray, keep: np.ndarray | None = None) -> LayerAdmit:
        """Make one layer's union (its expert ids) resident as far as capacity allows: the same
        effect on the state and the counters as :meth:`admit` of a union with only row ``layer``
        (and the same ``keep``)."""
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.n_layers:
            raise ValueError(f"layer: expected an integer in [0, {self.n_layers}), got {layer!r}")
        ids = np.asarray(expert_ids)
        if ids.ndim != 1 or not (np.issubdtype(ids.dtype, np.integer) or ids.size == 0):
            raise ValueError(f"expert_ids: expected a 1-D array of integer expert ids, got {ids.dtype} {ids.shape}")
        ok, hit_ids, admitted_ids, streamed_ids, evicted = kernels.cache.admit_layer_ids(
            int(layer), ids.astype(np.int64, copy=False), *self.kernel_state(), self.kernel_keep(keep))
        if not ok:
            raise ValueError(f"expert_ids: expected ids in [0, {self.n_experts}), got [{ids.min()}, {ids.max()}]")
        pairs = np.stack([evicted // self.n_experts, evicted % self.n_experts], axis=1)
        return LayerAdmit(hit_ids=hit_ids, admitted_ids=admitted_ids, streamed_ids=streamed_ids, evicted=pairs,
                          hits=int(hit_ids.size), misses=int(admitted_ids.size + streamed_ids.size),
                          evictions=int(evicted.size), streamed=int(streamed_ids.size))

    # ------------------------------------------------------------------ look-ahead
    def prefetch(self, mask: np.ndarray, keep: np.ndarray | None = None) -> AdmitResult:
        """Copy the experts of ``mask`` (``[L, E]`` bool) that are not resident into slots ahead of
        their use, as far as slots allow: free ones, then those of the evictable experts with the
        lowest ``(keep, score)`` whose ``keep`` is below the prefetched expert's own. Nothing is
        counted as a hit or a miss (``prefetched`` counts the copies); the result's
        ``admitted_mask`` holds the experts copied and ``evicted_mask`` those whose slots they took.
        Prefetched experts count as touched now; resident ones in ``mask`` too (``moe-infinity``:
        a copy is not counted, its counts stay the demand fetches)."""
        mask = self._check_mask("mask", mask)
        keep_arg = self.kernel_keep(keep)
        zeros, empty = np.zeros(self.n_layers, dtype=np.int64), np.zeros_like(mask)
        if self.capacity == 0:
            return AdmitResult(zeros, zeros, zeros, zeros, empty, empty, empty, empty)
        counts = np.zeros((4, self.n_layers), dtype=np.int64)
        admitted, evicted = (np.zeros((self.n_layers, self._words), dtype=np.uint64) for _ in range(2))
        kernels.cache.prefetch_items(mask, *self.kernel_state(), keep_arg, counts, admitted, evicted)
        admitted_mask = kernels.bitsets.unpack(admitted, self.n_experts)
        self.prefetched += admitted_mask.sum(axis=1)
        return AdmitResult(hits=zeros, misses=zeros, evictions=counts[2], streamed=zeros, hit_mask=empty,
                           admitted_mask=admitted_mask, evicted_mask=kernels.bitsets.unpack(evicted, self.n_experts),
                           streamed_mask=empty)

    def _check_mask(self, name: str, mask) -> np.ndarray:
        mask = np.asarray(mask)
        if mask.shape != (self.n_layers, self.n_experts) or mask.dtype != np.bool_:
            raise ValueError(f"{name}: expected a bool array of shape {(self.n_layers, self.n_experts)}, got "
                             f"{mask.dtype} {mask.shape}")
        return mask

    def kernel_keep(self, keep) -> np.ndarray:
        """``keep`` validated, as the kernels take it after :meth:`kernel_state`'s arrays: float64
        [L, E], or the empty array for none."""
        if keep is None:
            return kernels.cache.NO_KEEP
        keep = np.ascontiguousarray(keep, dtype=np.float64)
        if keep.shape != (self.n_layers, self.n_experts) or not np.isfinite(keep).all() or (keep < 0).any():
            raise ValueError(f"keep: expected finite non-negative priorities of shape "
                             f"{(self.n_layers, self.n_experts)}, got {keep.shape}")
        return keep
