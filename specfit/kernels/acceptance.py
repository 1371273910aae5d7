"""The acceptance calibration's maps, compiled: a drafted edge's acceptance probability and a path's
depth-corrected probability (the rules and their fits are in
:class:`specfit.experts.calibration.AcceptanceCalibrator`, which calls these on a trace's edges,
and the live drafter calls :func:`calibrate_level` on each level it drafts).

The parameters come as flat arrays: the isotonic edge map's thresholds ``x`` / ``y``; ``edge_coef``
the confidence refinement's four weights (empty: off); ``depth_coef`` the depth correction's
``(a, b, c, e)`` (empty: off), fitted up to ``max_depth``."""

from __future__ import annotations

import math

import numpy as np
from numba import njit

__all__ = ["LOGIT_EPS", "logit", "logits", "features", "confidence_features", "edge_prob", "path_prob", "edge_probs",
           "path_probs", "calibrate_level"]

LOGIT_EPS = 1e-4        # probabilities are clipped to [eps, 1 - eps] before a logit


@njit(cache=True)
def logit(p):
    p = min(max(p, LOGIT_EPS), 1.0 - LOGIT_EPS)
    return math.log(p) - math.log1p(-p)


@njit(cache=True)
def logits(p):
    """:func:`logit` of every probability (float [n])."""
    out = np.empty(p.size)
    for i in range(p.size):
        out[i] = logit(p[i])
    return out


@njit(cache=True)
def features(q, top, x, y):
    """The confidence refinement's features of an edge: the logit of its isotonic probability,
    whether it is its parent's top child, and (for a runner-up) the logit of the top sibling's
    probability; the map increases with ``q`` for either kind of child."""
    is_top = 1.0 if q >= top else 0.0
    return logit(np.interp(q, x, y)), is_top, (1.0 - is_top) * logit(top)


@njit(cache=True)
def confidence_features(q, top, x, y):
    """:func:`features` of every edge (float [n, 3]: what the refinement is fitted on)."""
    out = np.empty((q.size, 3))
    for i in range(q.size):
        out[i, 0], out[i, 1], out[i, 2] = features(q[i], top[i], x, y)
    return out


@njit(cache=True)
def edge_prob(q, top, x, y, edge_coef, min_prob):
    """Acceptance probability of an edge of draft probability ``q`` whose largest sibling
    probability (itself included) is ``top``."""
    if edge_coef.size == 0:
        return np.interp(q, x, y)
    f0, f1, f2 = features(q, max(top, q), x, y)
    z = edge_coef[0] + (f0 * edge_coef[1] + f1 * edge_coef[2] + f2 * edge_coef[3])
    return max(1.0 / (1.0 + math.exp(-z)), min_prob)


@njit(cache=True)
def path_prob(product, depth, depth_coef, max_depth):
    """A path's probability from the product of its calibrated edges, at ``depth`` (>= 1)."""
    if depth_coef.size == 0:
        return product
    d = min(float(depth), float(max_depth))
    z = depth_coef[0] + (depth_coef[1] + depth_coef[3] * d) * logit(product) + depth_coef[2] * d
    return 1.0 / (1.0 + math.exp(-z))


@njit(cache=True)
def edge_probs(q, top, x, y, edge_coef, min_prob):
    """:func:`edge_prob` of every edge (float [n])."""
    out = np.empty(q.size)
    for i in range(q.size):
        out[i] = edge_prob(q[i], top[i], x, y, edge_coef, min_prob)
    return out


@njit(cache=True)
def path_probs(product, depth, depth_coef, max_depth):
    """:func:`path_prob` of every path (float [n])."""
    out = np.empty(product.size)
    for i in range(product.size):
        out[i] = path_prob(product[i], depth[i], depth_coef, max_depth)
    return out


@njit(cache=True)
def calibrate_level(edge_lp, width, new, parents, depth, edge_product, path_prob_out, x, y, edge_coef, min_prob,
                    depth_coef, max_depth):
    """One drafted level in place: nodes ``new`` (children of ``parents``, ``width`` per expanded
    node, each node's first child its top) with drafter log-probabilities ``edge_lp`` get their
    calibrated edge products and path probabilities, never above their parent's."""
    for i in range(new.size):
        q = math.exp(edge_lp[i])
        top = math.exp(edge_lp[i - i % width])
        v, u = new[i], parents[i]
        edge_product[v] = edge_product[u] * edge_prob(q, top, x, y, edge_coef, min_prob)
        p = path_prob(edge_product[v], depth[v], depth_coef, max_depth)
        path_prob_out[v] = path_prob_out[u] if p > path_prob_out[u] else p      # NaN stays NaN
