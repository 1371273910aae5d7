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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["ExpertCache", "AdmitResult", "LayerCounts", "EVICTION_POLICIES"]

EVICTION_POLICIES = ("lru", "lfu", "fifo")


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
        total = self.total_hits + self.total_misses
        return self.total_hits / total if total else 0.0


@dataclass
class AdmitResult(LayerCounts):
    """Per-layer outcome of one ``admit``; counts are int64 [L], masks bool [L, E]."""

    hits: np.ndarray
    misses: np.ndarray
    evictions: np.ndarray
    streamed: np.ndarray
    hit_mask: np.ndarray
    admitted_mask: np.ndarray
    evicted_mask: np.ndarray
    streamed_mask: np.ndarray


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

    def __init__(self, n_layers: int, n_experts: int, capacity: int, mode: str = "per_layer",
                 policy: str = "lru", expert_bytes: int = 0):
        if n_layers <= 0 or n_experts <= 0:
            raise ValueError(f"ExpertCache: expected positive n_layers and n_experts, got {n_layers}, {n_experts}")
        if mode not in ("per_layer", "global"):
            raise ValueError(f"ExpertCache.mode: expected 'per_layer' or 'global', got {mode!r}")
        if policy not in EVICTION_POLICIES:
            raise ValueError(f"ExpertCache.policy: expected one of {EVICTION_POLICIES}, got {policy!r}")
        limit = n_experts if mode == "per_layer" else n_layers * n_experts
        if not 0 <= int(capacity):
            raise ValueError(f"ExpertCache.capacity: expected a non-negative number of experts, got {capacity}")
        self.n_layers, self.n_experts = int(n_layers), int(n_experts)
        self.capacity = min(int(capacity), limit)
        self.mode, self.policy, self.expert_bytes = mode, policy, int(expert_bytes)
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        shape = (self.n_layers, self.n_experts)
        self._resident = np.zeros(shape, dtype=bool)
        self._score = np.zeros(shape, dtype=np.int64)   # eviction order key (smallest goes first)
        self._count = np.zeros(shape, dtype=np.int64)   # touches, for lfu
        self._clock = 0
        # per-layer mode: the expert held by each of a layer's slots (-1: free)
        self._slot_expert = np.full((self.n_layers, self.capacity if self.mode == "per_layer" else 0), -1,
                                    dtype=np.int64)
        self.hits = np.zeros(self.n_layers, dtype=np.int64)
        self.misses = np.zeros(self.n_layers, dtype=np.int64)
        self.evictions = np.zeros(self.n_layers, dtype=np.int64)
        self.streamed = np.zeros(self.n_layers, dtype=np.int64)

    def resident(self) -> np.ndarray:
        """[L, E] bool copy of what is resident now."""
        return self._resident.copy()

    def warm(self, resident: np.ndarray) -> None:
        """Start from ``resident`` (e.g. a prefill's experts) without counting hits or misses;
        when more are given than fit, the first in ascending (layer, expert) order are kept, and
        they count as touched in that order."""
        resident = np.asarray(resident, dtype=bool)
        if resident.shape != self._resident.shape:
            raise ValueError(f"resident: expected shape {self._resident.shape}, got {resident.shape}")
        self.reset()
        if self.mode == "per_layer":
            keep = resident & (np.cumsum(resident, axis=1) <= self.capacity)
            target = np.arange(self.capacity)[None, :] < np.count_nonzero(keep, axis=1)[:, None]
            self._slot_expert[target] = np.nonzero(keep)[1]
        else:
            keep = resident & (np.cumsum(resident.ravel()).reshape(resident.shape) <= self.capacity)
        self._resident[:] = keep
        order = np.arange(keep.size, dtype=np.int64).reshape(keep.shape) - keep.size  # before any admit
        np.copyto(self._score, order, where=keep)
        np.copyto(self._count, 1, where=keep)

    @property
    def capacity_share(self) -> float:
        """The share of the experts that can be resident at once (per layer or overall)."""
        limit = self.n_experts if self.mode == "per_layer" else self.n_layers * self.n_experts
        return self.capacity / limit

    @property
    def bytes_h2d(self) -> int:
        return int(self.misses.sum()) * self.expert_bytes

    # ------------------------------------------------------------------ admit
    def admit(self, union: np.ndarray) -> AdmitResult:
        """Make a cycle's union (``[L, E]`` bool) resident as far as capacity allows."""
        union = np.asarray(union)
        if union.shape != self._resident.shape or union.dtype != np.bool_:
            raise ValueError(f"union: expected a bool array of shape {self._resident.shape}, got {union.dtype} {union.shape}")
        if self.mode == "per_layer":
            result = self._admit_per_layer(union)
        else:
            result = self._admit_global(union)
        self.hits += result.hits
        self.misses += result.misses
        self.evictions += result.evictions
        self.streamed += result.streamed
        return result

    def _touch_keys(self, t: int, layer, is_miss: np.ndarray, expert_ids: np.ndarray) -> np.ndarray:
        # a total order: cycle, then layer (global mode), then hits before misses, then expert id
        return ((t * (self.n_layers + 1) + layer) * 2 + is_miss) * self.n_experts + expert_ids

    def _apply_touch(self, mask: np.ndarray, keys: np.ndarray, admitted: np.ndarray) -> None:
        """Update scores of touched experts (``mask``); ``admitted`` marks the new arrivals."""
        np.copyto(self._count, 0, where=admitted)
        self._count += mask
        if self.policy == "lru":
            np.copyto(self._score, keys, where=mask)
        elif self.policy == "fifo":
            np.copyto(self._score, keys, where=admitted)
        else:  # lfu: count first, recency second
            span = np.int64(1) << 40
            np.copyto(self._score, self._count * span + keys % span, where=mask)

    def _admit_per_layer(self, union: np.ndarray) -> AdmitResult:
        # Eviction works on the [L, C] slot table rather than on [L, E]: sorting C candidates per
        # layer instead of E is what makes a 48 x 128 admit cheap enough for trace replay.
        L, E, C = self.n_layers, self.n_experts, self.capacity
        self._clock += 1
        resident = self._resident
        hit_mask = union & resident
        miss_mask = union & ~resident
        n_hit = np.count_nonzero(hit_mask, axis=1)
        n_miss = np.count_nonzero(miss_mask, axis=1)
        slot_expert = self._slot_expert
        valid = slot_expert >= 0
        n_admit = np.minimum(n_miss, C - n_hit)            # after evicting every non-union expert
        n_evict = np.maximum(0, n_admit - (C - np.count_nonzero(valid, axis=1)))
        # admitted misses: the first n_admit misses of each layer in ascending id
        admitted = miss_mask & (np.cumsum(miss_mask, axis=1) <= n_admit[:, None])
        evicted = np.zeros_like(resident)
        victim = np.zeros_like(valid)
        if n_evict.any():
            rows = np.arange(L)[:, None]
            held = np.where(valid, slot_expert, 0)
            evictable = valid & ~union[rows, held]
            score = np.where(evictable, self._score[rows, held], np.iinfo(np.int64).max)
            order = np.argsort(score, axis=1)               # scores are unique: no ties to break
            np.put_along_axis(victim, order, np.arange(C)[None, :] < n_evict[:, None], axis=1)
            evicted[np.nonzero(victim)[0], slot_expert[victim]] = True
        # admitted experts take the free and the freed slots, in slot order
        target = ~valid | victim
        target &= np.cumsum(target, axis=1) <= n_admit[:, None]
        slot_expert[target] = np.nonzero(admitted)[1]
        resident &= ~evicted
        resident |= admitted
        keys = self._touch_keys(self._clock, 0, miss_mask.astype(np.int64), np.arange(E)[None, :])
        self._apply_touch(hit_mask | admitted, keys, admitted)
        return AdmitResult(
            hits=n_hit.astype(np.int64), misses=n_miss.astype(np.int64), evictions=n_evict.astype(np.int64),
            streamed=(n_miss - n_admit).astype(np.int64), hit_mask=hit_mask, admitted_mask=admitted,
            evicted_mask=evicted, streamed_mask=miss_mask & ~admitted,
        )

    def _admit_global(self, union: np.ndarray) -> AdmitResult:
        L, E, C = self.n_layers, self.n_experts, self.capacity
        self._clock += 1
        resident = self._resident
        out = {k: np.zeros(L, dtype=np.int64) for k in ("hits", "misses", "evictions", "streamed")}
        masks = {k: np.zeros((L, E), dtype=bool) for k in ("hit", "admitted", "evicted", "streamed")}
        ids = np.arange(E)
        for layer in range(L):
            row = union[layer]
            hit = row & resident[layer]
            miss = row & ~resident[layer]
            miss_ids = np.flatnonzero(miss)
            # protect this layer's union; anything else resident may be evicted
            evictable = resident.copy()
            evictable[layer] &= ~row
            free = C - int(resident.sum())
            n_evictable = int(evictable.sum())
            n_admit = min(miss_ids.size, free + n_evictable)
            n_evict = max(0, n_admit - free)
            if n_evict:
                flat = np.flatnonzero(evictable.ravel())
                victims = flat[np.argsort(self._score.ravel()[flat], kind="stable")[:n_evict]]
                ev = np.zeros(L * E, dtype=bool)
                ev[victims] = True
                ev = ev.reshape(L, E)
                resident &= ~ev
                masks["evicted"] |= ev
                out["evictions"] += ev.sum(axis=1)  # charged to the layer that lost the expert
            admitted = np.zeros(E, dtype=bool)
            admitted[miss_ids[:n_admit]] = True
            resident[layer] |= admitted
            touched = np.zeros((L, E), dtype=bool)
            touched[layer] = hit | admitted
            new = np.zeros((L, E), dtype=bool)
            new[layer] = admitted
            keys = np.zeros((L, E), dtype=np.int64)
            keys[layer] = self._touch_keys(self._clock, layer, miss.astype(np.int64), ids)
            self._apply_touch(touched, keys, new)
            out["hits"][layer] = hit.sum()
            out["misses"][layer] = miss.sum()
            out["streamed"][layer] = miss_ids.size - n_admit
            masks["hit"][layer] = hit
            masks["admitted"][layer] = admitted
            masks["streamed"][layer] = miss & ~admitted
        return AdmitResult(
            hits=out["hits"], misses=out["misses"], evictions=out["evictions"], streamed=out["streamed"],
            hit_mask=masks["hit"], admitted_mask=masks["admitted"], evicted_mask=masks["evicted"],
            streamed_mask=masks["streamed"],
        )

    # ------------------------------------------------------------------ admit, one layer
    def admit_layer(self, layer: int, expert_ids: np.ndarray) -> "LayerAdmit":
        """``admit`` of a union with only row ``layer`` set, given as that layer's expert ids.

        The effect on residency, scores, slots and counters is exactly ``admit``'s (the touch
        clock advances once per call). In per-layer mode only row ``layer`` of the state is read
        or written; global mode may evict other layers' experts, so it looks at every resident
        expert when it must evict.
        """
        if not 0 <= int(layer) < self.n_layers:
            raise ValueError(f"layer: expected 0..{self.n_layers - 1}, got {layer}")
        ids = np.asarray(expert_ids, dtype=np.int64).reshape(-1)
        if ids.size > 1 and not (ids[1:] > ids[:-1]).all():     # the offload passes them sorted already
            ids = np.unique(ids)
        if ids.size and (ids[0] < 0 or ids[-1] >= self.n_experts):
            raise ValueError(f"expert_ids: expected ids in [0, {self.n_experts}), got {ids[0]}..{ids[-1]}")
        layer = int(layer)
        self._clock += 1
        if self.mode == "per_layer":
            return self._admit_layer_slots(layer, ids)
        return self._admit_layer_global(layer, ids)

    def _admit_layer_slots(self, layer: int, ids: np.ndarray) -> "LayerAdmit":
        C = self.capacity
        resident, slots = self._resident[layer], self._slot_expert[layer]   # views of this layer's rows
        in_cache = resident[ids]
        hit_ids, miss_ids = ids[in_cache], ids[~in_cache]
        valid = slots >= 0
        n_admit = min(miss_ids.size, C - hit_ids.size)        # after evicting every non-union expert
        n_evict = max(0, n_admit - (C - int(np.count_nonzero(valid))))
        admitted, streamed = miss_ids[:n_admit], miss_ids[n_admit:]
        victim = np.zeros(C, dtype=bool)
        if n_evict:
            in_union = np.zeros(self.n_experts, dtype=bool)
            in_union[ids] = True
            held = np.where(valid, slots, 0)
            evictable = valid & ~in_union[held]
            key = np.where(evictable, self._score[layer][held], _NEVER)
            victim[np.argsort(key, kind="stable")[:n_evict]] = True     # scores are unique
        evicted_ids = np.sort(slots[victim])
        # admitted experts take the free and the freed slots, in slot order
        slots[np.flatnonzero(~valid | victim)[:n_admit]] = admitted
        resident[evicted_ids] = False
        resident[admitted] = True
        self._touch_row(layer, 0, hit_ids, admitted)
        self.hits[layer] += hit_ids.size
        self.misses[layer] += miss_ids.size
        self.evictions[layer] += n_evict
        self.streamed[layer] += streamed.size
        evicted = np.empty((evicted_ids.size, 2), dtype=np.int64)
        evicted[:, 0], evicted[:, 1] = layer, evicted_ids
        return LayerAdmit(hit_ids=hit_ids, admitted_ids=admitted, streamed_ids=streamed, evicted=evicted,
                          hits=int(hit_ids.size), misses=int(miss_ids.size), evictions=int(n_evict),
                          streamed=int(streamed.size))

    def _admit_layer_global(self, layer: int, ids: np.ndarray) -> "LayerAdmit":
        E, C = self.n_experts, self.capacity
        resident = self._resident
        in_cache = resident[layer][ids]
        hit_ids, miss_ids = ids[in_cache], ids[~in_cache]
        n_resident = int(np.count_nonzero(resident))
        free = C - n_resident
        # this layer's union is protected; any other resident expert may be evicted
        n_admit = min(miss_ids.size, free + n_resident - hit_ids.size)
        n_evict = max(0, n_admit - free)
        victims = np.zeros(0, dtype=np.int64)
        if n_evict:
            evictable = resident.copy()
            evictable[layer, ids] = False
            flat = np.flatnonzero(evictable.ravel())
            victims = np.sort(flat[np.argsort(self._score.ravel()[flat], kind="stable")[:n_evict]])
            resident.reshape(-1)[victims] = False
            np.add.at(self.evictions, victims // E, 1)      # charged to the layer that lost the expert
        admitted, streamed = miss_ids[:n_admit], miss_ids[n_admit:]
        resident[layer, admitted] = True
        self._touch_row(layer, layer, hit_ids, admitted)
        self.hits[layer] += hit_ids.size
        self.misses[layer] += miss_ids.size
        self.streamed[layer] += streamed.size
        return LayerAdmit(hit_ids=hit_ids, admitted_ids=admitted, streamed_ids=streamed,
                          evicted=np.stack([victims // E, victims % E], axis=1),
                          hits=int(hit_ids.size), misses=int(miss_ids.size), evictions=int(n_evict),
                          streamed=int(streamed.size))

    def _touch_row(self, layer: int, key_layer: int, hit_ids: np.ndarray, admitted: np.ndarray) -> None:
        """:meth:`_apply_touch` restricted to row ``layer``: hits and new arrivals are touched."""
        score, count = self._score[layer], self._count[layer]
        touched = np.concatenate([hit_ids, admitted])
        is_miss = np.concatenate([np.zeros(hit_ids.size, dtype=np.int64), np.ones(admitted.size, dtype=np.int64)])
        keys = self._touch_keys(self._clock, key_layer, is_miss, touched)
        count[admitted] = 0
        count[touched] += 1                                  # ids are distinct
        if self.policy == "lru":
            score[touched] = keys
        elif self.policy == "fifo":
            score[admitted] = keys[hit_ids.size:]
        else:  # lfu: count first, recency second
            span = np.int64(1) << 40
            score[touched] = count[touched] * span + keys % span


_NEVER = np.iinfo(np.int64).max    # the eviction key of a slot that must not be chosen


@dataclass
class LayerAdmit:
    """Outcome of :meth:`ExpertCache.admit_layer` at one layer.

    ``hit_ids``, ``admitted_ids`` (misses that took a slot) and ``streamed_ids`` (misses with no
    slot) are int64, ascending; ``evicted`` is int64 [m, 2] of (layer, expert) pairs, ascending
    (global mode may evict other layers' experts). Counts are ints.
    """

    hit_ids: np.ndarray
    admitted_ids: np.ndarray
    streamed_ids: np.ndarray
    evicted: np.ndarray
    hits: int
    misses: int
    evictions: int
    streamed: int
