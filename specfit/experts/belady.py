"""Belady's offline optimum for the expert cache: the ceiling a cache policy can reach on a known
sequence of cycle unions.

A replay knows every cycle's union of experts in advance, so the fewest misses any eviction rule
could have had on that sequence can be computed offline. The model is the cache's own
(:mod:`specfit.experts.cache`): at cycle t the union ``U_t`` is needed; experts resident at the start of
the cycle are hits, the others misses (copied, whatever is done with them afterwards); after the
cycle any ``capacity`` experts of ``R_t | U_t`` may stay resident (per layer, or in all in global
mode). Keeping the ``capacity`` experts whose next use comes first (Belady's MIN with bypass:
experts never used again, or used later than every kept one, are not kept) minimises the total
number of misses: the usual exchange argument, since the choice of what to keep costs nothing and
only the next use of each expert matters. ``tests/test_belady.py`` checks it against a dynamic
program over every residency set on small sequences.

A request that is served but not counted (a sequence's prompt pass, which the replay admits before
the sequence's first cycle and charges nothing for) makes its experts resident for free: keeping an
expert until such a request is worth nothing, so its next use is the next *counted* request only when
no uncounted one comes first (:func:`belady_of_log` builds a replay's requests so; the dynamic
program checks this too).

In per-layer mode a layer's union is used at once, so the optimum is achievable. In global mode the
layers of one cycle run in order and a real cache may have to evict an expert that a later layer of
the same cycle needs; the cycle-level model ignores that, so its count is a lower bound on the
misses (still a ceiling, possibly not a reachable one).
"""

from __future__ import annotations

import numpy as np

__all__ = ["belady_counts", "belady_of_log", "request_matrix"]

_NEVER = np.iinfo(np.int32).max


def request_matrix(unions: list[np.ndarray], n_items: int) -> np.ndarray:
    """bool [cycles, n_items] from each cycle's flat item ids (``layer * n_experts + expert``)."""
    req = np.zeros((len(unions), n_items), dtype=bool)
    for t, items in enumerate(unions):
        req[t, np.asarray(items, dtype=np.int64)] = True
    return req


def belady_counts(unions: list[np.ndarray], n_layers: int, n_experts: int, capacity: int,
                  mode: str = "per_layer", resident: np.ndarray | None = None,
                  counted: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(hits, misses), int64 [cycles] each, of the optimal cache on the cycle ``unions`` (flat item
    ids per cycle), starting from ``resident`` (bool [L, E], default empty; at most ``capacity``
    per layer, or in all). ``counted`` (bool per union) marks the cycles to count: the others
    (a prompt's pass) are requests the cache serves, and plans for, without a hit or miss counted;
    the counts are then of the counted ones alone."""
    if mode not in ("per_layer", "global"):
        raise ValueError(f"mode: expected 'per_layer' or 'global', got {mode!r}")
    if capacity < 0:
        raise ValueError(f"capacity: expected a non-negative number of experts, got {capacity}")
    n_items = n_layers * n_experts
    req = request_matrix(unions, n_items)
    T = req.shape[0]
    charged = np.ones(T, dtype=bool) if counted is None else np.asarray(counted, dtype=bool)
    # next_use[t, i]: the first cycle after t that needs item i (_NEVER if none, or if that request
    # is not counted: the item comes back for free there, so keeping it until then is worth nothing)
    next_use = np.empty((T, n_items), dtype=np.int32)
    upcoming = np.full(n_items, _NEVER, dtype=np.int32)
    for t in range(T - 1, -1, -1):
        next_use[t] = upcoming
        upcoming[req[t]] = t if charged[t] else _NEVER
    shape = (n_layers, n_experts) if mode == "per_layer" else (1, n_items)
    cap = min(int(capacity), shape[1])
    held = np.zeros(shape, dtype=bool)
    if resident is not None:
        held[:] = np.asarray(resident, dtype=bool).reshape(shape)
        if (held.sum(axis=1) > cap).any():
            raise ValueError(f"resident: more experts than the capacity ({cap}) allows")
    hits = np.zeros(T, dtype=np.int64)
    misses = np.zeros(T, dtype=np.int64)
    for t in range(T):
        need = req[t].reshape(shape)
        n_hit = int(np.count_nonzero(need & held))
        hits[t] = n_hit
        misses[t] = int(np.count_nonzero(need)) - n_hit
        if cap == 0:
            continue
        key = np.where(held | need, next_use[t].reshape(shape), _NEVER)
        if cap >= shape[1]:
            held = key < _NEVER
            continue
        keep = np.argpartition(key, cap - 1, axis=1)[:, :cap]
        held = np.zeros(shape, dtype=bool)
        np.put_along_axis(held, keep, np.take_along_axis(key, keep, axis=1) < _NEVER, axis=1)
    if counted is not None:
        return hits[charged], misses[charged]
    return hits, misses


def belady_of_log(log, n_layers: int, n_experts: int, capacity: int, mode: str = "per_layer") -> tuple[np.ndarray, np.ndarray]:
    """(hits, misses) per cycle of a replay's :class:`~specfit.simulate.replay.CycleLog` (recorded
    with ``record_unions``) under the optimal cache, its sequences' prompt passes served where the
    replay admitted them (before each one's first cycle): the same requests the replay's cache saw."""
    sequence = np.asarray(log.columns["sequence"], dtype=np.int64)
    if np.any(np.diff(sequence) < 0):
        raise ValueError("log: expected its cycles sequence by sequence, as a replay makes them")
    prefills = log.prefill_unions or {}
    requests, counted = [], []
    # a sequence without a cycle (its output ended at the prompt's token) still had its prompt's pass
    for s in sorted(set(prefills) | set(sequence.tolist())):
        if s in prefills:
            requests.extend(prefills[s])
            counted.extend([False] * len(prefills[s]))
        lo, hi = np.searchsorted(sequence, s), np.searchsorted(sequence, s, side="right")
        requests.extend(log.unions[lo:hi])
        counted.extend([True] * (hi - lo))
    return belady_counts(requests, n_layers, n_experts, capacity, mode, counted=np.array(counted, dtype=bool))
