"""The router predictor's selection compiled: each layer's top-k experts of a node's estimated
residual, and the online count of which context weight would have predicted the verified nodes.

The routers' logits come in two parts per node, both ``[n, L * E]`` (layer-major columns): of the
token's embedding ``x`` and of the drafter's context ``c`` unscaled. The logits at context weight
``w`` are ``token + w * (|x| / |c|) * context`` (the context rescaled to the embedding's norm;
the scale is one factor per row, so it is applied here rather than to ``c`` before the GEMM).
Then the experts of the most recent routing known (``last``: the token before the cycle's root;
consecutive tokens share experts) get ``bonus * sd`` more, ``sd`` the spread of the node's logits
at that layer, so the bonus is in units the router's own scale sets. Ties between experts go to
the lower id, as the order of a stable sort would have them.

With the weights on the host, :func:`predict_host` and :func:`count_host` take the embedding
table and the routers (one row per expert) and do the whole step in one call (gather, products,
scale, top-k).
Where every token's router logits fit in memory (:func:`token_table`, computed once) the token's
part is a row read instead of a product: only the context's product is left per call.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["row_scales", "top_k_experts", "count_right", "project", "token_table", "host_logits", "predict_host",
           "count_host"]


@njit(cache=True)
def _norm(x, i):
    """``|x[i]|`` in float64."""
    s = 0.0
    for j in range(x.shape[1]):
        s += np.float64(x[i, j]) * np.float64(x[i, j])
    return np.sqrt(s)


@njit(cache=True)
def row_scales(x, c):
    """float64 [n]: ``|x[i]| / max(|c[i]|, 1e-12)`` (the context's rescaling to the embedding)."""
    out = np.empty(x.shape[0])
    for i in range(x.shape[0]):
        out[i] = _norm(x, i) / max(_norm(c, i), 1e-12)
    return out


@njit(cache=True, inline="always")
def _select(row, k, out, best):
    """The ``k`` largest entries of ``row`` (ids, descending; ties: the lower id) into ``out``,
    by insertion into a sorted list of the best so far (``best``: scratch of ``k`` values), one
    pass over the row: a row of E experts costs about E comparisons, not k E."""
    m = 0
    for x in range(row.size):
        v = row[x]
        if m < k:
            t = m
            m += 1
        elif v > best[k - 1]:                # strictly: an equal value keeps the lower id
            t = k - 1
        else:
            continue
        while t > 0 and best[t - 1] < v:
            best[t], out[t] = best[t - 1], out[t - 1]
            t -= 1
        best[t], out[t] = v, x


@njit(cache=True, inline="always")
def _mix(token_logits, context_logits, i, base, w, row):
    """A node's logits at one layer (columns ``base ..``) into ``row``: the token's, plus ``w``
    times the context's (``w`` already scaled to the node's row)."""
    n_experts = row.size
    if context_logits.shape[0] > 0:
        for x in range(n_experts):
            row[x] = token_logits[i, base + x] + w * context_logits[i, base + x]
    else:
        for x in range(n_experts):
            row[x] = token_logits[i, base + x]


@njit(cache=True, inline="always")
def _spread(row):
    """The standard deviation of ``row`` (two passes: the mean, then the squares about it)."""
    n_experts = row.size
    mean = 0.0
    for x in range(n_experts):
        mean += row[x]
    mean /= n_experts
    var = 0.0
    for x in range(n_experts):
        var += (row[x] - mean) ** 2
    return np.sqrt(var / n_experts)


@njit(cache=True, inline="always")
def _raise(row, last, i, layer, add):
    """``add`` to the row's entry of each expert of ``last[i, layer]`` (an id below 0: unknown)."""
    n_experts = row.size
    for t in range(last.shape[2]):
        e = last[i, layer, t]
        if 0 <= e < n_experts:
            row[e] += add


@njit(cache=True, inline="always")
def _row(token_logits, context_logits, i, base, w, last, bonus, layer, row):
    """:func:`_mix`, plus ``bonus`` standard deviations of the row for each expert of
    ``last[i, layer]``."""
    _mix(token_logits, context_logits, i, base, w, row)
    if bonus != 0.0 and last.shape[0] > 0:
        _raise(row, last, i, layer, bonus * _spread(row))


@njit(cache=True)
def top_k_experts(token_logits, context_logits, scale, layer_weight, last, layer_bonus, k):
    """int64 [n, L, k]: per node and layer, the top-``k`` experts of ``token + layer_weight[l] *
    scale[i] * context`` (``context_logits`` with no rows: the token's logits alone) with
    ``layer_bonus[l]`` for the experts of ``last[i, l]`` (int [n, L, k'], or no rows: none)."""
    n = token_logits.shape[0]
    n_layers = layer_weight.size
    n_experts = token_logits.shape[1] // n_layers
    with_context = context_logits.shape[0] > 0
    out = np.empty((n, n_layers, k), dtype=np.int64)
    row = np.empty(n_experts)
    best = np.empty(k)
    for i in range(n):
        for layer in range(n_layers):
            w = layer_weight[layer] * scale[i] if with_context else 0.0
            _row(token_logits, context_logits, i, layer * n_experts, w, last, layer_bonus[layer], layer, row)
            _select(row, k, out[i, layer], best)
    return out


@njit(cache=True, inline="always")
def _named(true, i, layer, chosen):
    """How many of ``true[i, layer]`` the ids ``chosen`` name."""
    k = true.shape[2]
    hits = 0
    for s in range(chosen.size):
        for t in range(k):
            if true[i, layer, t] == chosen[s]:
                hits += 1
                break
    return hits


@njit(cache=True)
def count_right(token_logits, context_logits, scale, layer_weight, last, layer_bonus, weight_candidates,
                bonus_candidates, true, right_weight, right_bonus):
    """The online choice's counts, one coordinate at a time: add to ``right_weight[c, l]`` how many
    of the nodes' true experts (``true`` int [n, L, k], -1 for an unknown slot) the top-k names at
    context weight ``weight_candidates[c]`` with each layer's current bonus, and to
    ``right_bonus[c, l]`` the same at bonus ``bonus_candidates[c]`` with each layer's current
    context weight (their rows differ only by the bonus: one mix and one spread for all of them)."""
    n, n_layers, k = true.shape
    n_experts = token_logits.shape[1] // n_layers
    with_context = context_logits.shape[0] > 0
    with_last = last.shape[0] > 0
    row = np.empty(n_experts)
    mixed = np.empty(n_experts)
    chosen = np.empty(k, dtype=np.int64)
    best = np.empty(k)
    for i in range(n):
        for layer in range(n_layers):
            base = layer * n_experts
            for c in range(weight_candidates.size):
                w = weight_candidates[c] * scale[i] if with_context else 0.0
                _row(token_logits, context_logits, i, base, w, last, layer_bonus[layer], layer, row)
                _select(row, k, chosen, best)
                right_weight[c, layer] += _named(true, i, layer, chosen)
            w = layer_weight[layer] * scale[i] if with_context else 0.0
            _mix(token_logits, context_logits, i, base, w, mixed)
            sd = _spread(mixed) if with_last else 0.0
            for c in range(bonus_candidates.size):
                for x in range(n_experts):
                    row[x] = mixed[x]
                bonus = bonus_candidates[c]
                if bonus != 0.0 and with_last:
                    _raise(row, last, i, layer, bonus * sd)
                _select(row, k, chosen, best)
                right_bonus[c, layer] += _named(true, i, layer, chosen)


@njit(cache=True, fastmath=True)
def project(x, rows, out):
    """``out[i, c] = x[i] . rows[c]`` (float32 ``x`` [n, H], ``rows`` [m, H]: the routers'
    columns as rows, so each product reads two contiguous vectors), four outputs per pass over
    ``x[i]``. At the router predictor's sizes (16 x 128 by 128 x 64) this loop is faster than
    numba's ``np.dot`` (``benchmarks/RESULTS.md``, "The router predictor's step"); the same loop fills
    :func:`token_table`, so a row of the table equals the product for its token computed here."""
    n, m = x.shape[0], rows.shape[0]
    h = x.shape[1]
    for i in range(n):
        c = 0
        while c + 4 <= m:
            s0 = np.float32(0.0)
            s1 = np.float32(0.0)
            s2 = np.float32(0.0)
            s3 = np.float32(0.0)
            for j in range(h):
                v = x[i, j]
                s0 += v * rows[c, j]
                s1 += v * rows[c + 1, j]
                s2 += v * rows[c + 2, j]
                s3 += v * rows[c + 3, j]
            out[i, c], out[i, c + 1], out[i, c + 2], out[i, c + 3] = s0, s1, s2, s3
            c += 4
        while c < m:
            s0 = np.float32(0.0)
            for j in range(h):
                s0 += x[i, j] * rows[c, j]
            out[i, c] = s0
            c += 1


@njit(cache=True)
def token_table(embed, rows):
    """(float32 [V, m] every token's router logits, float64 [V] every embedding's norm): what
    :func:`host_logits` would compute for each token, computed once."""
    table = np.empty((embed.shape[0], rows.shape[0]), dtype=np.float32)
    project(embed, rows, table)
    norms = np.empty(embed.shape[0])
    for v in range(embed.shape[0]):
        norms[v] = _norm(embed, v)
    return table, norms


@njit(cache=True)
def host_logits(embed, rows, table, norms, tokens, context):
    """(token logits, context logits, row scales) from host weights: ``embed`` float32 [V, H],
    ``rows`` float32 [L * E, H] (every layer's router, norm folded in, one row per expert), the
    nodes' ``tokens`` and their drafter ``context`` float32 [n, H] (no rows: none). With a
    :func:`token_table` (``table``, ``norms``; no rows: none) a token's logits and norm are read
    from it."""
    n, m = tokens.size, rows.shape[0]
    token_logits = np.empty((n, m), dtype=np.float32)
    x_norm = np.empty(n)
    if table.shape[0] > 0:
        for i in range(n):
            token_logits[i] = table[tokens[i]]
            x_norm[i] = norms[tokens[i]]
    else:
        x = np.empty((n, embed.shape[1]), dtype=embed.dtype)
        for i in range(n):
            x[i] = embed[tokens[i]]
            x_norm[i] = _norm(x, i)
        project(x, rows, token_logits)
    if context.shape[0] == 0:
        return token_logits, np.empty((0, 0), dtype=np.float32), np.empty(0)
    context_logits = np.empty((n, m), dtype=np.float32)
    project(context, rows, context_logits)
    scale = np.empty(n)
    for i in range(n):
        scale[i] = x_norm[i] / max(_norm(context, i), 1e-12)
    return token_logits, context_logits, scale


@njit(cache=True)
def predict_host(embed, rows, table, norms, tokens, context, layer_weight, last, layer_bonus, k):
    """:func:`top_k_experts` of :func:`host_logits`: the router predictor's whole step."""
    token_logits, context_logits, scale = host_logits(embed, rows, table, norms, tokens, context)
    return top_k_experts(token_logits, context_logits, scale, layer_weight, last, layer_bonus, k)


@njit(cache=True)
def count_host(embed, rows, table, norms, tokens, context, layer_weight, last, layer_bonus, weight_candidates,
               bonus_candidates, true, right_weight, right_bonus):
    """:func:`count_right` of :func:`host_logits`."""
    token_logits, context_logits, scale = host_logits(embed, rows, table, norms, tokens, context)
    count_right(token_logits, context_logits, scale, layer_weight, last, layer_bonus, weight_candidates,
                bonus_candidates, true, right_weight, right_bonus)
