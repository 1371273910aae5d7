"""The cycle-time fit's forward selection compiled: the normal equations of one choice of fitted
and held terms, and a candidate's score in them (:class:`specfit.calibrate.fit.CycleTimeFitter`).

The fit's physical terms are few (five), so each score is a handful of small products: in numpy,
tens of calls. The online refit runs one forward selection (about fifteen scores) every other
refit inside a live decode; compiled, such a refit takes about half its time in numpy
(``benchmarks/RESULTS.md``, "Stop 35: the learning after the cycles compiled further";
``benchmarks/bench_learning.py``).

A choice is ``free`` (the terms fitted on their own, as indices into the physical terms),
``group`` (the held terms, at ``held_at``) and ``speed`` (whether the group is scaled by one fitted
factor: its prior contribution is then one more column). ``held_fixed`` holds the fixed terms'
values (0 elsewhere).
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["system", "score"]


@njit(cache=True)
def system(G, g, bb, free, group, speed, held_at, held_fixed):
    """(normal matrix [k, k], right-hand side [k], what the held part leaves of ``b @ b``) of a
    choice, from the weighted normal equations of every term (``G = A.T A``, ``g = A.T b``,
    ``bb = b @ b``): design columns ``A @ M``, a free term its own column, the speed factor the
    held group's prior contribution."""
    p = G.shape[0]
    with_speed = speed and group.size > 0
    k = free.size + (1 if with_speed else 0)
    M = np.zeros((p, k))
    for i in range(free.size):
        M[free[i], i] = 1.0
    v = held_fixed.copy()
    for j in group:
        if with_speed:
            M[j, k - 1] = held_at[j]
        else:
            v[j] = held_at[j]
    GM = G @ M
    Gv = G @ v
    return M.T @ GM, M.T @ (g - Gv), bb - 2.0 * (v @ g) + v @ Gv


@njit(cache=True)
def score(G, g, free, group, speed, held_at, held_fixed, c, prior_value, visible, sigma2, shrink, prior_spread,
          refuted, collinear_condition):
    """(score, estimate, distance from the prior in standard errors) of column ``c`` of a choice:
    the smaller of its standard error over the prior's uncertainty and ``refuted`` standard errors
    over its distance from the prior; ``inf`` for a singular or collinear column."""
    Gk, rhs, _ = system(G, g, 0.0, free, group, speed, held_at, held_fixed)
    try:
        inv = np.linalg.inv(Gk)        # LAPACK's getrf / getri, as numpy's
    except Exception:                  # singular
        return np.inf, 0.0, 0.0
    if not (Gk[c, c] > 0 and inv[c, c] > 0 and 1.0 / (Gk[c, c] * inv[c, c]) > 1.0 / collinear_condition):
        return np.inf, 0.0, 0.0
    estimate = 0.0
    for t in range(rhs.size):
        estimate += inv[c, t] * rhs[t]
    se = np.sqrt(sigma2 * shrink * inv[c, c])
    prior_sd = prior_spread * max(prior_value, visible)
    shift = abs(estimate - prior_value)
    return min(se / prior_sd, refuted * se / max(shift, 1e-300)), estimate, (shift / se if se > 0 else 0.0)
