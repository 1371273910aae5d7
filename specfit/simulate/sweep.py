"""What-if sweeps: every policy on every trace, cache size and cost model, summarised.

Policy specs are those of :func:`specfit.policies.make_policy` plus two simulator baselines:

- ``eagle3-nocache``: EAGLE-3's default tree with no expert cache (every expert streamed), the
  "vanilla" offloaded setup; listed in every cache-size group;
- ``static:auto``: the fixed-size rerank tree ``static:N`` with the N that is best on this trace,
  cache size and cost model (a strong baseline that knows the trace); ``static_n`` says which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pandas as pd

from ..costmodel import CostModel
from ..errors import SpecFitError
from ..experts.cache import ExpertCache
from ..policies import SpecFitPolicy, make_policy
from ..search import uncertainty_price_s
from .replay import CycleLog, PreparedTrace, replay

__all__ = ["Scenario", "run_sweep", "summarise", "STATIC_AUTO_SIZES", "DEFAULT_POLICIES", "check_policies"]

DEFAULT_POLICIES = ("ar", "chain:4", "eagle3", "eagle3-nocache", "static:auto", "specfit", "oracle")
STATIC_AUTO_SIZES = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
SUMMARY_KEYS = ("trace", "profile", "cache_experts", "policy")


@dataclass(frozen=True)
class Scenario:
    """One cost model to replay under (a preset or profile, possibly with what-if changes)."""

    label: str
    cost: CostModel


def check_policies(specs: list[str], max_levels: int) -> None:
    """Fail early, with the CLI's wording, on a policy spec that cannot be built."""
    for spec in specs:
        if spec in ("eagle3-nocache", "static:auto"):
            continue
        try:
            make_policy(spec, max_levels=max_levels)
        except ValueError as exc:
            raise SpecFitError(f"--policies: {exc}; or eagle3-nocache, static:auto") from None


def _run(prep: PreparedTrace, spec: str, capacity: int, cost: CostModel, cache_mode: str, cache_policy: str,
         max_levels: int, price_uncertainty: bool = True) -> CycleLog:
    cache = ExpertCache(prep.trace.n_layers, prep.trace.n_experts, capacity, mode=cache_mode,
                        policy=cache_policy, expert_bytes=prep.trace.expert_bytes)
    policy = make_policy(spec, max_levels=max_levels)
    if price_uncertainty and isinstance(policy, SpecFitPolicy):
        # the search sees predicted experts; price what the predictor gets wrong per draft node
        policy.draft_node_s = uncertainty_price_s(cost, prep.trace.n_layers, prep.trace.top_k,
                                                  prep.info["slot_precision"], resident_share=cache.capacity_share)
    return replay(prep, policy, cache, cost)


def run_sweep(prepared: list[PreparedTrace], policies: list[str], cache_sizes: list[int], scenarios: list[Scenario],
              cache_mode: str = "per_layer", cache_policy: str = "lru", max_levels: int = 8,
              progress: Callable[[str], None] | None = None,
              price_uncertainty: bool = True) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Replay every combination; returns ``(cycles, summary)`` DataFrames (one row per cycle,
    one row per (trace, profile, cache size, policy)). ``price_uncertainty``: the specfit policy
    prices, per draft node, the experts its predictor gets wrong (the predictor's slot precision
    on the trace)."""
    check_policies(policies, max_levels)
    cycle_frames, rows = [], []
    for prep in prepared:
        max_nodes = max(int(t[-1].n_nodes) for t in prep.level_trees)
        static_sizes = [n for n in STATIC_AUTO_SIZES if n <= max_nodes] or [max_nodes]
        for scenario in scenarios:
            nocache: CycleLog | None = None
            for capacity in cache_sizes:
                for spec in policies:
                    extra = {}
                    if spec == "eagle3-nocache":
                        if nocache is None:
                            nocache = _run(prep, "eagle3", 0, scenario.cost, cache_mode, cache_policy, max_levels)
                        log = nocache
                    elif spec == "static:auto":
                        best = None
                        for n in static_sizes:
                            cand = _run(prep, f"static:{n}", capacity, scenario.cost, cache_mode, cache_policy, max_levels)
                            rate = cand.columns["committed_tokens"].sum() / cand.columns["charged_time_s"].sum()
                            if best is None or rate > best[0]:
                                best = (rate, n, cand)
                        log, extra = best[2], {"static_n": best[1]}
                    else:
                        log = _run(prep, spec, capacity, scenario.cost, cache_mode, cache_policy, max_levels,
                                   price_uncertainty)
                    keys = {"trace": prep.name, "profile": scenario.label, "cache_experts": capacity, "policy": spec}
                    frame = pd.DataFrame(log.columns)
                    frame.insert(0, "cycle", np.arange(len(frame)))
                    for name, value in reversed(keys.items()):
                        frame.insert(0, name, value)
                    cycle_frames.append(frame)
                    rows.append({**keys, "predictor": prep.predictor, "slot_precision": prep.info["slot_precision"],
                                 **summarise(log), **extra})
                    if progress is not None:
                        progress(f"{prep.name} {scenario.label} cache={capacity} {spec}")
    summary = pd.DataFrame(rows)
    if "static_n" not in summary:
        summary["static_n"] = np.nan
    summary["static_n"] = summary["static_n"].astype("Int64")
    for base in ("ar", "eagle3"):
        ref = summary[summary["policy"] == base].set_index(["trace", "profile", "cache_experts"])["tokens_per_s"]
        idx = pd.MultiIndex.from_frame(summary[["trace", "profile", "cache_experts"]])
        summary[f"speedup_vs_{base}"] = summary["tokens_per_s"].to_numpy() / ref.reindex(idx).to_numpy()
    return pd.concat(cycle_frames, ignore_index=True), summary


def summarise(log: CycleLog) -> dict:
    """Totals and prediction quality of one replay."""
    c = log.columns
    tokens = int(c["committed_tokens"].sum())
    time_s = float(c["charged_time_s"].sum())
    cycles = len(log)
    union = int(c["union_size"].sum())
    predicted_union = int(c["predicted_union_size"].sum())
    overlap = int(c["union_overlap"].sum())
    return {
        "tokens": tokens, "cycles": cycles, "time_s": time_s,
        "tokens_per_s": tokens / time_s if time_s > 0 else float("inf"),
        "tokens_per_cycle": tokens / cycles if cycles else 0.0,
        "bytes_h2d": int(c["bytes_h2d"].sum()),
        "bytes_per_token": float(c["bytes_h2d"].sum() / tokens) if tokens else 0.0,
        "hit_rate": float(c["hits"].sum() / union) if union else 0.0,
        "nodes_per_cycle": float(c["nodes_verified"].mean()),
        "draft_levels_per_cycle": float(c["draft_levels"].mean()),
        # levels drafted below the deepest selected node: draft time spent on nothing
        "wasted_draft_levels": float((c["draft_levels"] - c["deepest_selected"]).clip(min=0).mean()),
        "predicted_tokens_per_cycle": float(c["predicted_tokens"].mean()),
        "tokens_prediction_error": float(c["predicted_tokens"].sum() / tokens - 1) if tokens else 0.0,
        "time_prediction_error": float(c["predicted_time_s"].sum() / time_s - 1) if time_s else 0.0,
        "union_precision": overlap / predicted_union if predicted_union else 1.0,
        "union_recall": overlap / union if union else 1.0,
        "miss_count_error": float(np.mean(c["predicted_misses"] - c["misses"])),
        "miss_count_abs_error": float(np.mean(np.abs(c["predicted_misses"] - c["misses"]))),
    }
