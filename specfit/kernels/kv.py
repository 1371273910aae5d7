"""The KV cache compiled: moving the accepted path's entries to the slots after the committed
tokens, on the host, in place."""

from __future__ import annotations

from numba import njit

__all__ = ["compact", "check", "OK", "NOT_ASCENDING", "OUT_OF_RANGE"]

OK, NOT_ASCENDING, OUT_OF_RANGE = 0, 1, 2


@njit(cache=True)
def check(cache_len, keep, n_slots):
    """OK when ``keep`` ascends and its entries' slots ``cache_len + keep[i]`` lie in the cache's
    ``n_slots``; else NOT_ASCENDING or OUT_OF_RANGE (the rule every compaction path applies)."""
    n = keep.size
    for i in range(1, n):
        if keep[i] <= keep[i - 1]:
            return NOT_ASCENDING
    if n and (keep[0] < 0 or cache_len < 0 or cache_len + keep[n - 1] >= n_slots):
        return OUT_OF_RANGE
    return OK


@njit(cache=True)
def compact(rows, cache_len, keep):
    """Move the new entries ``keep`` (ascending indices of the last pass's tokens, which sit at
    slots ``cache_len + keep[i]``) to slots ``cache_len + i``, in place; the ones already in
    their slot (a prefix of ``keep``) stay. ``rows`` is the cache as bytes, uint8 [rows, slots,
    bytes per slot] (any element type: one compiled kernel). The accepted path moves towards the
    front, so copying in order never overwrites an entry before it is read. Returns OK, or
    NOT_ASCENDING / OUT_OF_RANGE (and moves nothing)."""
    status = check(cache_len, keep, rows.shape[1])
    if status != OK:
        return status
    n = keep.size
    width = rows.shape[2]
    for r in range(rows.shape[0]):
        for i in range(n):
            s = cache_len + keep[i]
            d = cache_len + i
            if s != d:
                for j in range(width):
                    rows[r, d, j] = rows[r, s, j]
    return OK
