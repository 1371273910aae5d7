"""The acceptance calibration's maps, compiled: a drafted edge's acceptance probability and a path's
depth-corrected probability (the rules and their fits are in
:class:`specfit.experts.calibration.AcceptanceCalibrator`, which calls these on a trace's edges,
and the live drafter calls :func:`calibrate_level` on each level it drafts), and the online
calibration's (:class:`specfit.experts.acceptance_online.OnlineAcceptance`): a tree's edge
features, its calibrated edge and path probabilities, and the penalised Newton refit.

The parameters come as flat arrays: the isotonic edge map's thresholds ``x`` / ``y``; ``edge_coef``
the confidence refinement's four weights (empty: off); ``depth_coef`` the depth correction's
``(a, b, c, e)`` (empty: off), fitted up to ``max_depth``."""

from __future__ import annotations

import math

import numpy as np
from numba import njit

__all__ = ["LOGIT_EPS", "clipped_logit", "logit", "logits", "features", "confidence_features", "edge_prob", "path_prob", "edge_probs",
           "path_probs", "calibrate_level", "ONLINE_EPS", "N_ONLINE_FEATURES", "online_features", "online_probs",
           "online_refit"]

LOGIT_EPS = 1e-4        # probabilities are clipped to [eps, 1 - eps] before a logit


@njit(cache=True)
def clipped_logit(p, eps):
    """The logit of ``p`` clipped to ``[eps, 1 - eps]``."""
    p = min(max(p, eps), 1.0 - eps)
    return math.log(p) - math.log1p(-p)


@njit(cache=True)
def logit(p):
    return clipped_logit(p, LOGIT_EPS)


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


# the online calibration clips conditional probabilities to [ONLINE_EPS, 1 - ONLINE_EPS] before a
# logit (|logit| <= 8): a calibrated tree may carry 0s and 1s, and an unbounded feature lets a few
# edges swing the fit
ONLINE_EPS = 3e-4
N_ONLINE_FEATURES = 8


@njit(cache=True)
def online_features(parents, path_probs, depth):
    """(q [n], features [n, 8]) of every node's edge (row 0, the root's, is unused): ``q`` the
    node's conditional probability ``p_v / p_parent`` clipped to ``ONLINE_EPS``, and the features
    ``[1, logit q, logit^2 q / 10, depth, depth logit q / 4, logit q1, q1 - q2, rank]``, where ``q1``
    and ``q2`` are the two largest conditionals among the node's siblings (itself included; q2 is 0
    for an only child) and ``rank`` its place among them (ties: the smaller node first). Parents
    come before their children (a :class:`~specfit.tree.DraftTree`'s order)."""
    n = parents.size
    q = np.empty(n)
    q[0] = 1.0 - ONLINE_EPS
    for v in range(1, n):
        u = parents[v]
        c = path_probs[v] / max(path_probs[u], 1e-300) if path_probs[u] > 0 else 0.0
        q[v] = min(max(c, ONLINE_EPS), 1.0 - ONLINE_EPS)
    # siblings grouped by parent (counting sort: within a group in node order)
    count = np.zeros(n + 1, dtype=np.int64)
    for v in range(1, n):
        count[parents[v] + 1] += 1
    for u in range(n):
        count[u + 1] += count[u]
    members = np.empty(max(n - 1, 0), dtype=np.int64)
    fill = count[:n].copy()
    for v in range(1, n):
        u = parents[v]
        members[fill[u]] = v
        fill[u] += 1
    q1 = np.zeros(n)
    q2 = np.zeros(n)
    rank = np.zeros(n)
    for u in range(n):
        lo, hi = count[u], count[u + 1]
        top1 = 0.0
        top2 = 0.0
        for i in range(lo, hi):
            c = q[members[i]]
            if i == lo or c > top1:
                if i > lo:
                    top2 = top1
                top1 = c
            elif i == lo + 1 or c > top2:
                top2 = c
        for i in range(lo, hi):
            v = members[i]
            r = 0
            for j in range(lo, hi):
                w = members[j]
                if q[w] > q[v] or (q[w] == q[v] and w < v):
                    r += 1
            rank[v] = r
            q1[v] = top1
            q2[v] = top2
    x = np.empty((n, N_ONLINE_FEATURES))
    for v in range(n):
        lq = clipped_logit(q[v], ONLINE_EPS)
        d = float(depth[v])
        x[v, 0] = 1.0
        x[v, 1] = lq
        x[v, 2] = lq * lq / 10.0
        x[v, 3] = d
        x[v, 4] = d * lq / 4.0
        x[v, 5] = clipped_logit(q1[v], ONLINE_EPS)
        x[v, 6] = q1[v] - q2[v]
        x[v, 7] = rank[v]
    return q, x


@njit(cache=True)
def online_probs(parents, path_probs, depth, coef):
    """(q [n], features [n, 8], edge [n], path [n]): :func:`online_features`, each node's acceptance
    probability given its parent by the logistic model ``coef`` on them (``coef`` empty: the
    clipped conditional ``q``; the root's is 1), and the path probabilities, their products from
    the root."""
    q, x = online_features(parents, path_probs, depth)
    n = parents.size
    edge = np.empty(n)
    path = np.empty(n)
    edge[0] = 1.0
    path[0] = 1.0
    for v in range(1, n):
        if coef.size == 0:
            e = q[v]
        else:
            z = 0.0
            for f in range(coef.size):
                z += x[v, f] * coef[f]
            e = 1.0 / (1.0 + math.exp(-min(max(z, -30.0), 30.0)))
        edge[v] = e
        path[v] = path[parents[v]] * e
    return q, x, edge, path


@njit(cache=True)
def _online_loss(x, y, w, prior, l2, z, e):
    """The penalised negative log-likelihood: sum of log(1 + e^z) - y z over the rows (z = x w;
    ``y`` in [0, 1], a soft label where the outcome is a probability) plus l2 / 2 |w - prior|^2.
    Leaves each row's ``z`` and ``e = exp(-|z|)`` in the arrays of those names (the next Newton
    step's probabilities come from them)."""
    total = 0.0
    for i in range(x.shape[0]):
        zi = 0.0
        for f in range(w.size):
            zi += x[i, f] * w[f]
        ei = math.exp(-abs(zi))
        z[i], e[i] = zi, ei
        total += max(zi, 0.0) + math.log1p(ei) - y[i] * zi
    penalty = 0.0
    for f in range(w.size):
        penalty += (w[f] - prior[f]) ** 2
    return total + 0.5 * l2 * penalty


_E30 = math.exp(-30.0)


@njit(cache=True)
def online_refit(x, y, w, prior, l2, steps):
    """Damped Newton steps on :func:`_online_loss` from ``w`` (each halved until the loss falls,
    at most 20 times, else the fit stops: plain Newton can overshoot on nearly separable edges);
    stops once no weight moves by 1e-6 (a step below that is taken whole). The probabilities ``1 / (1 + e^-z)`` (z clipped to
    +-30) come from the loss's ``exp(-|z|)``. Returns the weights."""
    n_rows, n_f = x.shape[0], w.size
    w = w.copy()
    z, e = np.empty(n_rows), np.empty(n_rows)
    z_trial, e_trial = np.empty(n_rows), np.empty(n_rows)
    loss = _online_loss(x, y, w, prior, l2, z, e)
    for _ in range(steps):
        grad = np.zeros(n_f)
        hess = np.zeros((n_f, n_f))
        for i in range(n_rows):
            ei = max(e[i], _E30)
            p = 1.0 / (1.0 + ei) if z[i] >= 0 else ei / (1.0 + ei)
            r = p - y[i]
            s = p * (1.0 - p)
            for f in range(n_f):
                grad[f] += r * x[i, f]
                sf = s * x[i, f]
                for g in range(f + 1):
                    hess[f, g] += sf * x[i, g]
        for f in range(n_f):
            grad[f] += l2 * (w[f] - prior[f])
            hess[f, f] += l2
            for g in range(f):
                hess[g, f] = hess[f, g]
        step = np.linalg.solve(hess, grad)
        if np.abs(step).max() < 1e-6:
            # converged: a step this small changes the loss by less than its rounding, which the
            # halving below would chase 20 times for nothing
            return w - step
        fell = False
        trial = loss
        for _ in range(20):
            trial = _online_loss(x, y, w - step, prior, l2, z_trial, e_trial)
            if trial <= loss:
                fell = True
                break
            step = step / 2
        if not fell:
            break
        w = w - step
        loss = trial
        z, z_trial = z_trial, z
        e, e_trial = e_trial, e
        if np.abs(step).max() < 1e-6:
            break
    return w
