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
- Look-ahead (optional, :mod:`specfit.experts.lookahead` computes it): ``keep[layer, expert]``, a
  non-negative priority (e.g. the probability that the draft's next tokens need the expert);
  victims are the evictable experts with the lowest ``(keep, score)``, and when not every miss
  finds a slot the admitted ones are those with the highest ``keep`` (ties: ascending id), so
  ``keep = 0`` everywhere is the plain policy. ``prefetch(mask, keep)`` makes experts resident before they are asked for
  (counted in ``prefetched``, not as hits or misses) by the same rules, taking no slot from an
  expert whose ``keep`` is above the prefetched one's.
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
        self.prefetched = np.zeros(self.n_layers, dtype=np.int64)   # experts copied by prefetch()

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
    def admit(self, union: np.ndarray, keep: np.ndarray | None = None) -> AdmitResult:
        """Make a cycle's union (``[L, E]`` bool) resident as far as capacity allows; ``keep``
        (float ``[L, E]``, optional) orders the victims before the policy's scores do."""
        union = np.asarray(union)
        if union.shape != self._resident.shape or union.dtype != np.bool_:
            raise ValueError(f"union: expected a bool array of shape {self._resident.shape}, got {union.dtype} {union.shape}")
        keep = self._check_keep(keep)
        if self.mode == "per_layer":
            result = self._admit_per_layer(union, keep)
        else:
            result = self._admit_global(union, keep)
        self.hits += result.hits
        self.misses += result.misses
        self.evictions += result.evictions
        self.streamed += result.streamed
        return result

    # ------------------------------------------------------------------ look-ahead
    def prefetch(self, mask: np.ndarray, keep: np.ndarray | None = None) -> AdmitResult:
        """Copy the experts of ``mask`` (``[L, E]`` bool) that are not resident into slots ahead of
        their use, as far as slots allow: free ones, then those of the evictable experts with the
        lowest ``(keep, score)`` whose ``keep`` is below the prefetched expert's own. Nothing is
        counted as a hit or a miss (``prefetched`` counts the copies); the result's
        ``admitted_mask`` holds the experts copied and ``evicted_mask`` those whose slots they took.
        Prefetched experts count as touched now; resident ones in ``mask`` too."""
        mask = np.asarray(mask)
        if mask.shape != self._resident.shape or mask.dtype != np.bool_:
            raise ValueError(f"mask: expected a bool array of shape {self._resident.shape}, got {mask.dtype} "
                             f"{mask.shape}")
        keep = self._check_keep(keep)
        if self.capacity == 0:
            zeros, empty = np.zeros(self.n_layers, dtype=np.int64), np.zeros_like(mask)
            return AdmitResult(zeros, zeros, zeros, zeros, empty, empty, empty, empty)
        want = mask & ~self._resident
        if keep is not None:
            # an expert only displaces experts it outranks: drop the prefetches that would have to
            # evict something at least as valuable (the cheapest victim set is the lowest keeps)
            want &= self._worth_a_slot(want, mask, keep)
        union = want | (mask & self._resident)
        result = self._admit_per_layer(union, keep) if self.mode == "per_layer" else self._admit_global(union, keep)
        self.evictions += result.evictions
        self.prefetched += result.admitted_mask.sum(axis=1)
        n_layers = self.n_layers
        zeros = np.zeros(n_layers, dtype=np.int64)
        return AdmitResult(hits=zeros, misses=zeros, evictions=result.evictions, streamed=zeros,
                           hit_mask=np.zeros_like(mask), admitted_mask=result.admitted_mask,
                           evicted_mask=result.evicted_mask, streamed_mask=np.zeros_like(mask))

    def _worth_a_slot(self, want: np.ndarray, mask: np.ndarray, keep: np.ndarray) -> np.ndarray:
        """The wanted experts whose keep beats the keep of the slot they would take (free slots
        first, then the resident experts outside ``mask`` in ascending keep), per layer or over
        the whole cache."""
        per_layer = self.mode == "per_layer"
        rows = [slice(layer, layer + 1) for layer in range(self.n_layers)] if per_layer else [slice(None)]
        ok = np.zeros_like(want)
        for r in rows:
            w, res, k, m = want[r].ravel(), self._resident[r].ravel(), keep[r].ravel(), mask[r].ravel()
            free = self.capacity - int(res.sum())
            cand = np.flatnonzero(w)
            cand = cand[np.argsort(-k[cand], kind="stable")]          # most valuable first
            victims = np.sort(k[res & ~m])                            # cheapest slot first
            n = min(cand.size, free + victims.size)
            take = np.zeros(cand.size, dtype=bool)
            for i in range(n):
                take[i] = i < free or k[cand[i]] > victims[i - free]
            flat = np.zeros(w.size, dtype=bool)
            flat[cand[take]] = True
            ok[r] = flat.reshape(ok[r].shape)
        return ok

    def _check_keep(self, keep) -> np.ndarray | None:
        if keep is None:
            return None
        keep = np.asarray(keep, dtype=np.float64)
        if keep.shape != self._resident.shape or not np.isfinite(keep).all() or (keep < 0).any():
            raise ValueError(f"keep: expected finite non-negative priorities of shape {self._resident.shape}, got "
                             f"{keep.shape}")
        return keep

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

    def _admit_per_layer(self, union: np.ndarray, keep: np.ndarray | None = None) -> AdmitResult:
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
        if keep is None:
            admitted = miss_mask & (np.cumsum(miss_mask, axis=1) <= n_admit[:, None])
        else:   # the misses the look-ahead values most stay (ties: ascending id)
            order = np.lexsort((np.broadcast_to(np.arange(E), (L, E)), np.where(miss_mask, -keep, np.inf)), axis=1)
            rank = np.empty_like(order)
            np.put_along_axis(rank, order, np.arange(E)[None, :], axis=1)
            admitted = miss_mask & (rank < n_admit[:, None])
        evicted = np.zeros_like(resident)
        victim = np.zeros_like(valid)
        if n_evict.any():
            rows = np.arange(L)[:, None]
            held = np.where(valid, slot_expert, 0)
            evictable = valid & ~union[rows, held]
            score = np.where(evictable, self._score[rows, held], np.iinfo(np.int64).max)
            if keep is None:
                order = np.argsort(score, axis=1)           # scores are unique: no ties to break
            else:                                           # look-ahead priority first, then the score
                order = np.lexsort((score, np.where(evictable, keep[rows, held], np.inf)), axis=1)
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

    def _admit_global(self, union: np.ndarray, keep: np.ndarray | None = None) -> AdmitResult:
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
                if keep is None:
                    victims = flat[np.argsort(self._score.ravel()[flat], kind="stable")[:n_evict]]
                else:
                    victims = flat[np.lexsort((self._score.ravel()[flat], keep.ravel()[flat]))[:n_evict]]
                ev = np.zeros(L * E, dtype=bool)
                ev[victims] = True
                ev = ev.reshape(L, E)
                resident &= ~ev
                masks["evicted"] |= ev
                out["evictions"] += ev.sum(axis=1)  # charged to the layer that lost the expert
            admitted = np.zeros(E, dtype=bool)
            if keep is not None:    # the misses the look-ahead values most stay (ties: ascending id)
                miss_ids = miss_ids[np.argsort(-keep[layer, miss_ids], kind="stable")]
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
