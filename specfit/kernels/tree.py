"""A draft tree's validation, depths and probability clipping in one compiled pass: the checks
:class:`specfit.tree.DraftTree` makes (which words the error when this reports one)."""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["check_tree"]


@njit(cache=True)
def check_tree(parents, probs, slack):
    """(ok, depths) of a tree given as int64 ``parents`` (root -1, ``0 <= parents[v] < v``) and
    float64 ``probs`` (finite, in [0, 1], the root's 1, never above the parent's by more than
    ``slack``), ``ok`` False when any of these fails; ``probs`` is clipped in place to each parent's
    value as given."""
    n = parents.size
    depth = np.zeros(n, dtype=np.int64)
    given = probs.copy()
    ok = parents[0] == -1 and probs[0] == 1.0
    for v in range(n):
        p = given[v]
        if not (np.isfinite(p) and 0.0 <= p <= 1.0):
            ok = False
    for v in range(1, n):
        u = parents[v]
        if u < 0 or u >= v:
            return False, depth
        if given[v] > given[u] + slack:
            ok = False
        probs[v] = min(given[v], given[u])
        depth[v] = depth[u] + 1
    return ok, depth
