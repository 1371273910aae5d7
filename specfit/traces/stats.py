"""Routing and acceptance statistics of expert sets and traces.

The same functions measure real routing logs, synthetic routing and traces, so the generator's
targets, its checks and ``specfit traces inspect`` agree on what a statistic means. Expert sets
are ``int [tokens, layers, top_k]`` arrays.
"""

from __future__ import annotations

import numpy as np

from .. import kernels
from ..experts.cache import ExpertCache

__all__ = ["popularity", "top_quarter_share", "set_overlap", "pair_overlap", "consecutive_reuse", "same_token_reuse",
           "lru_hit_rates", "acceptance_by_depth", "accepted_lengths", "edge_calibration"]


def popularity(experts: np.ndarray, n_experts: int) -> np.ndarray:
    """[layers, n_experts] share of each layer's routing slots that go to each expert."""
    T, L, k = experts.shape
    flat = (experts.astype(np.int64) + np.arange(L)[None, :, None] * n_experts).ravel()
    counts = np.bincount(flat, minlength=L * n_experts).reshape(L, n_experts).astype(np.float64)
    return counts / np.maximum(counts.sum(axis=1, keepdims=True), 1.0)


def top_quarter_share(pop: np.ndarray) -> np.ndarray:
    """[layers] share of routing slots taken by the most popular quarter of the experts
    (0.25 when popularity is uniform): the popularity skew."""
    E = pop.shape[1]
    return np.sort(pop, axis=1)[:, ::-1][:, : max(1, E // 4)].sum(axis=1)


def set_overlap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[m, layers] fraction of the top-k experts that sets ``a[i, l]`` and ``b[i, l]`` share."""
    k = a.shape[2]
    return (a[:, :, :, None] == b[:, :, None, :]).any(axis=3).sum(axis=2) / k


def pair_overlap(experts: np.ndarray, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """[pairs, layers] :func:`set_overlap` of rows ``i`` and ``j`` of ``experts``, in one compiled
    pass (no copies of the rows, no k x k comparison array)."""
    counts = kernels.bitsets.shared_slots(np.ascontiguousarray(experts), np.asarray(i, dtype=np.int64),
                                          np.asarray(j, dtype=np.int64))
    return counts / experts.shape[2]


def consecutive_reuse(experts: np.ndarray, sequence: np.ndarray | None = None) -> np.ndarray:
    """[layers] mean fraction of a token's experts that the previous token of the same sequence
    also used, at the same layer."""
    T = experts.shape[0]
    i = np.arange(1, T)
    if sequence is not None:
        i = i[sequence[1:] == sequence[:-1]]
    if i.size == 0:
        return np.full(experts.shape[1], np.nan)
    return pair_overlap(experts, i - 1, i).mean(axis=0)


def same_token_reuse(experts: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """[layers] mean overlap between two occurrences of the same token id that are not adjacent
    (each occurrence paired with the previous one): how much routing follows the token itself."""
    order = np.argsort(tokens, kind="stable")
    t = tokens[order]
    pair = np.flatnonzero(t[1:] == t[:-1])
    i, j = order[pair], order[pair + 1]
    keep = np.abs(j - i) > 1
    if not keep.any():
        return np.full(experts.shape[1], np.nan)
    return pair_overlap(experts, i[keep], j[keep]).mean(axis=0)


def lru_hit_rates(experts: np.ndarray, n_experts: int, capacities, policy: str = "lru") -> dict[int, float]:
    """Hit rate of a per-layer cache of each capacity when the tokens are decoded one at a time
    (autoregressive decode: each token's experts are one cycle's union)."""
    T, L, k = experts.shape
    onehot = np.zeros((T, L, n_experts), dtype=bool)
    np.put_along_axis(onehot, experts.astype(np.int64), True, axis=2)
    out = {}
    for c in capacities:
        cache = ExpertCache(L, n_experts, int(c), policy=policy)
        for t in range(T):
            cache.admit(onehot[t])
        out[int(c)] = cache.hit_rate
    return out


# --------------------------------------------------------------------------- acceptance
def accepted_lengths(trace) -> np.ndarray:
    """[cycles] draft tokens on the accepted path of each full tree (the most any policy can
    accept at that cycle)."""
    return np.array([trace.tree(c).accepted_path(trace.verdict[trace.rows(c)]).size - 1
                     for c in range(trace.n_cycles)], dtype=np.int64)


def acceptance_by_depth(trace) -> dict[int, float]:
    """Per depth d: of the trees whose accepted path reaches depth d - 1, the share that reaches
    depth d (acceptance rate of a level given the previous one was accepted)."""
    lengths = accepted_lengths(trace)
    depth = int(trace.depth.max(initial=0))
    return {d: float((lengths >= d).sum() / max(1, (lengths >= d - 1).sum())) for d in range(1, depth + 1)}


def edge_calibration(trace, bins: int = 10) -> list[dict]:
    """Drafter calibration: nodes binned by draft probability (exp(draft_logprob)); per bin the
    mean draft probability and the share of nodes that equal the target's verdict at their
    parent. A calibrated drafter has the two equal."""
    parent_row = trace.parent_rows
    mask = (parent_row >= 0)
    mask[mask] = trace.verdict[parent_row[mask]] >= 0
    q = np.exp(trace.draft_logprob[mask].astype(np.float64))
    hit = trace.token[mask] == trace.verdict[parent_row[mask]]
    edges = np.linspace(0, 1, bins + 1)
    which = np.clip(np.digitize(q, edges) - 1, 0, bins - 1)
    rows = []
    for b in range(bins):
        sel = which == b
        if sel.any():
            rows.append({"bin": f"{edges[b]:.1f}-{edges[b + 1]:.1f}", "nodes": int(sel.sum()),
                         "draft_prob": float(q[sel].mean()), "accept_rate": float(hit[sel].mean())})
    return rows
