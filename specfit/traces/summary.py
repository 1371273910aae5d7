"""What a trace contains, in numbers: the summary behind ``specfit traces inspect`` and the
statistics a synthetic or imported trace is checked against."""

from __future__ import annotations

import numpy as np

from .. import kernels
from .stats import acceptance_by_depth, accepted_lengths, consecutive_reuse, edge_calibration, popularity, \
    pair_overlap, same_token_reuse, top_quarter_share

__all__ = ["trace_statistics", "summarise_trace"]


def trace_statistics(trace) -> dict:
    """The statistics a synthetic trace is checked against (layer means)."""
    roots = trace.offsets[:-1]
    ref = trace.true_experts[roots].astype(np.int64)
    parent_row = trace.parent_rows
    # sibling pairs: consecutive children of the same parent, neither carrying the true next token
    off = (parent_row >= 0) & trace.true_known
    off[off] &= trace.token[off] != trace.verdict[parent_row[off]]
    rows = np.flatnonzero(off)
    i = np.flatnonzero(parent_row[rows[:-1]] == parent_row[rows[1:]])
    a, b = rows[i], rows[i + 1]
    sib = float(pair_overlap(trace.true_experts, a, b).mean()) if a.size else float("nan")
    lengths = accepted_lengths(trace)
    return {
        "popularity_skew": float(top_quarter_share(popularity(ref, trace.n_experts)).mean()),
        "consecutive_reuse": _layer_mean(consecutive_reuse(ref, trace.sequence)),
        "token_affinity": _layer_mean(same_token_reuse(ref, trace.token[roots])),
        "sibling_reuse": sib,
        "full_tree_accepted_tokens": float(lengths.mean() + 1),
        "acceptance_by_depth": {str(d): round(r, 4) for d, r in acceptance_by_depth(trace).items()},
    }



def _layer_mean(values: np.ndarray) -> float:
    """Mean over layers; NaN when the statistic is undefined (e.g. no token repeats)."""
    return float(values.mean()) if np.all(np.isfinite(values)) else float("nan")


def _union_by_depth(trace) -> np.ndarray:
    """[depth + 1] mean union size per layer (true experts) of the tree cut at each depth: the
    known nodes within that depth, over every cycle (a cycle with none counts 0)."""
    max_depth = int(trace.depth.max(initial=0))
    totals = kernels.bitsets.union_sizes_by_depth(np.ascontiguousarray(trace.offsets, dtype=np.int64),
                                                  np.ascontiguousarray(trace.depth, dtype=np.int64),
                                                  np.ascontiguousarray(trace.true_known),
                                                  np.ascontiguousarray(trace.true_experts, dtype=np.int16),
                                                  trace.n_experts, max_depth)
    return totals / max(trace.n_cycles, 1) / trace.n_layers


def summarise_trace(trace) -> dict:
    """A JSON-able summary: shape, provenance, tree sizes, acceptance and routing statistics."""
    stats = trace_statistics(trace)
    depth_counts = np.bincount(trace.depth.astype(np.int64)) / trace.n_cycles
    unions = _union_by_depth(trace)
    by_depth = acceptance_by_depth(trace)
    lengths = accepted_lengths(trace)
    model = trace.model
    return {
        "model": f"{model['name']} ({trace.n_layers} layers x {trace.n_experts} experts, top-{trace.top_k}, "
                 f"{trace.expert_bytes / 1e6:.2f} MB/expert)",
        "workload": trace.meta.get("workload"),
        "recording": trace.meta["recording"].get("kind"),
        "provenance_real": ", ".join(trace.meta["provenance"].get("real", [])) or "nothing",
        "provenance_synthesised": ", ".join(trace.meta["provenance"].get("synthesised", [])) or "nothing",
        "cycles": trace.n_cycles,
        "sequences": int(np.unique(trace.sequence).size),
        "nodes_per_tree": float(trace.tree_sizes.mean()),
        "max_depth": int(trace.depth.max(initial=0)),
        **{k: v for k, v in stats.items() if k != "acceptance_by_depth"},
        "by_depth": [{"depth": d, "nodes_per_tree": float(depth_counts[d]),
                      "acceptance_rate": float(by_depth.get(d, 1.0)) if d else 1.0,
                      # the trees the rate is a share of: those whose accepted path reaches depth d - 1
                      "trees": int((lengths >= d - 1).sum()) if d else trace.n_cycles,
                      "union_experts_per_layer": float(unions[d])} for d in range(depth_counts.size)],
        "calibration": edge_calibration(trace),
    }
