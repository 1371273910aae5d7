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
table and the routers' columns and do the whole step in one call (gather, GEMM, scale, top-k).
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["row_scales", "top_k_experts", "count_right", "host_logits", "predict_host", "count_host"]


@njit(cache=True)
def row_scales(x, c):
    """float64 [n]: ``|x[i]| / max(|c[i]|, 1e-12)`` (the context's rescaling to the embedding)."""
    n = x.shape[0]
    out = np.empty(n)
    for i in range(n):
        xs = 0.0
        cs = 0.0
        for j in range(x.shape[1]):
            xs += np.float64(x[i, j]) * np.float64(x[i, j])
            cs += np.float64(c[i, j]) * np.float64(c[i, j])
        out[i] = np.sqrt(xs) / max(np.sqrt(cs), 1e-12)
    return out


@njit(cache=True, inline="always")
def _select(row, k, out, best):
    """The ``k`` largest entries of ``row`` (ids, descending; ties: the lower id) into ``out``,
    by insertion into a sorted list of the best so far (``best``: scratch of ``k`` values), one
    pass over the row: a row of E experts costs about E comparisons, not k E."""
    e = row.size
    for s in range(k):
        out[s] = s
        best[s] = row[s]
    for s in range(1, k):                    # sort the first k (ties: the lower id first)
        v, x = best[s], out[s]
        t = s
        while t > 0 and best[t - 1] < v:
            best[t], out[t] = best[t - 1], out[t - 1]
            t -= 1
        best[t], out[t] = v, x
    for x in range(k, e):
        v = row[x]
        if v > best[k - 1]:                  # strictly: an equal value keeps the lower id
            t = k - 1
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


@njit(cache=True)
def host_logits(embed, columns, tokens, context):
    """(token logits, context logits, row scales) from host weights: ``embed`` float32 [V, H],
    ``columns`` float32 [H, L * E] (every layer's router, norm folded in), the nodes' ``tokens``
    and their drafter ``context`` float32 [n, H] (no rows: none)."""
    x = np.empty((tokens.size, embed.shape[1]), dtype=embed.dtype)
    for i in range(tokens.size):
        x[i] = embed[tokens[i]]
    token_logits = np.dot(x, columns)
    if context.shape[0] == 0:
        return token_logits, np.empty((0, 0), dtype=columns.dtype), np.empty(0)
    return token_logits, np.dot(context, columns), row_scales(x, context)


@njit(cache=True)
def predict_host(embed, columns, tokens, context, layer_weight, last, layer_bonus, k):
    """:func:`top_k_experts` of :func:`host_logits`: the router predictor's whole step."""
    token_logits, context_logits, scale = host_logits(embed, columns, tokens, context)
    return top_k_experts(token_logits, context_logits, scale, layer_weight, last, layer_bonus, k)


@njit(cache=True)
def count_host(embed, columns, tokens, context, layer_weight, last, layer_bonus, weight_candidates, bonus_candidates,
               true, right_weight, right_bonus):
    """:func:`count_right` of :func:`host_logits`."""
    token_logits, context_logits, scale = host_logits(embed, columns, tokens, context)
    count_right(token_logits, context_logits, scale, layer_weight, last, layer_bonus, weight_candidates,
                bonus_candidates, true, right_weight, right_bonus)
