"""The KV cache compiled: moving the accepted path's entries to the slots after the committed
tokens, on the host, in place."""

from __future__ import annotations

from numba import njit

__all__ = ["compact", "OK", "NOT_ASCENDING", "OUT_OF_RANGE"]

OK, NOT_ASCENDING, OUT_OF_RANGE = 0, 1, 2


@njit(cache=True)
def compact(rows, cache_len, keep):
    """Move the new entries ``keep`` (ascending indices of the last pass's tokens, which sit at
    slots ``cache_len + keep[i]``) to slots ``cache_len + i``, in place; the ones already in
    their slot (a prefix of ``keep``) stay. ``rows`` is the cache as bytes, uint8 [rows, slots,
    bytes per slot] (any element type: one compiled kernel). The accepted path moves towards the
    front, so copying in order never overwrites an entry before it is read. Returns OK, or
    NOT_ASCENDING / OUT_OF_RANGE (and moves nothing)."""
    n = keep.size
    for i in range(n):
        if i > 0 and keep[i] <= keep[i - 1]:
            return NOT_ASCENDING
    if n and (keep[0] < 0 or cache_len < 0 or cache_len + keep[n - 1] >= rows.shape[1]):
        return OUT_OF_RANGE
    width = rows.shape[2]
    for r in range(rows.shape[0]):
        for i in range(n):
            s = cache_len + keep[i]
            d = cache_len + i
            if s != d:
                for j in range(width):
                    rows[r, d, j] = rows[r, s, j]
    return OK
