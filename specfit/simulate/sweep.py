"""What-if sweeps: every policy on every trace, cache size and cost model, summarised.

Policy specs are those of :func:`specfit.policies.make_policy`. Two kinds only a replay can run:
a policy that imposes its own cache size (``eagle3-nocache``: no cache, listed in every cache-size
group) and a tuned family (``static:auto``, ``sequoia:auto``: every candidate ``static:N`` or
``sequoia:N`` is replayed and the best on this trace, cache size and cost model is kept;
``static_n`` says which N, for either family).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pandas as pd

from ..accounting import replay_frame, summarise, with_speedups
from ..costmodel import CostModel
from ..errors import SpecFitError
from ..experts.cache import ExpertCache
from ..policies import DEFAULT_POLICIES, Observation, Policy, TunedPolicy, make_policy
from ..specfit_policy import MAX_LEVELS
from .replay import CycleLog, PreparedTrace, replay

__all__ = ["Scenario", "run_sweep", "DEFAULT_POLICIES", "check_policies"]

@dataclass(frozen=True)
class Scenario:
    """One cost model to replay under (a preset or profile, possibly with what-if changes)."""

    label: str
    cost: CostModel
    copy_latency_s: float = 0.0        # the fixed latency of a copy in a miss's transfer (the profile's)


def check_policies(specs: list[str], max_levels: int) -> None:
    """Fail early, with the CLI's wording, on a policy spec that cannot be built."""
    if not specs:
        raise SpecFitError("--policies: expected at least one policy, e.g. ar,eagle3,specfit")
    if max_levels < 1:
        raise SpecFitError(f"--max-levels: expected >= 1 draft levels, got {max_levels}")
    if max_levels > MAX_LEVELS:
        raise SpecFitError(f"--max-levels: expected at most {MAX_LEVELS} draft levels (a trace records a node's depth "
                           f"in int16), got {max_levels}")
    for spec in specs:
        try:
            make_policy(spec, max_levels=max_levels)
        except ValueError as exc:
            raise SpecFitError(f"--policies: {exc}") from None


def _run(prep: PreparedTrace, policy: Policy, capacity: int, cost: CostModel, cache_mode: str,
         cache_policy: str, per_layer: bool = False, record_unions: bool = False) -> CycleLog:
    capacity = _capacity(policy, capacity)
    cache = ExpertCache(prep.trace.n_layers, prep.trace.n_experts, capacity, mode=cache_mode,
                        policy=cache_policy, expert_bytes=prep.trace.expert_bytes)
    # the trace's predictions are made up front: the policy learns their precision before the first cycle
    policy.observe(Observation(predicted_slots=prep.info["predicted_slots"],
                               predicted_slots_right=prep.info["predicted_slots_right"],
                               resident_share=cache.capacity_share))
    return replay(prep, policy, cache, cost, per_layer=per_layer, record_unions=record_unions)


def _capacity(policy: Policy, capacity: int) -> int:
    """The cache size ``policy`` replays with: its own where it imposes one (``eagle3-nocache``)."""
    return capacity if policy.cache_capacity is None else policy.cache_capacity


def _layer_ahead_columns(prep: PreparedTrace, rankers, log: CycleLog, policy: Policy, capacity: int, cost: CostModel,
                         prefetcher: str, cache_mode: str, cache_policy: str) -> dict:
    """The summary's layer-ahead what-if of one replay (:func:`specfit.experts.layer_ahead.recount`):
    its committed tokens per second with the windows' hidden time taken off, the share of its time
    hidden, and the share of the copies made that were needed; NaN for a policy whose cache levers
    (look-ahead eviction, draft-time prefetch) a recount cannot rebuild."""
    from ..experts.layer_ahead import recount

    columns = {"layer_ahead": prefetcher, "layer_ahead_tokens_per_s": np.nan, "layer_ahead_hidden_share": np.nan,
               "layer_ahead_precision": np.nan}
    if policy.cache_advisor is not None or policy.prefetcher is not None:
        return columns
    try:
        la = recount(prep.trace, log, capacity, cost, prefetcher, rankers, cache_mode, cache_policy)
    except ValueError as exc:
        raise SpecFitError(f"--layer-ahead: {policy.name}: {exc}") from None
    time_s = float(la.time_s.sum())
    columns.update(layer_ahead_tokens_per_s=float(log.columns["committed_tokens"].sum()) / float(
        la.time_with_overlap_s.sum()), layer_ahead_hidden_share=float(la.hidden_s.sum()) / time_s if time_s else 0.0,
        layer_ahead_precision=la.precision)
    return columns


def _check_grid(prepared, policies, cache_sizes, scenarios) -> None:
    """One clear error, before any replay, for a grid that has no cell or whose rows would collide."""
    for name, values in (("prepared", prepared), ("policies", policies), ("cache_sizes", cache_sizes),
                         ("scenarios", scenarios)):
        if len(values) == 0:
            raise ValueError(f"{name}: expected at least one, got none")
    for name, keys in (("policies", list(policies)), ("cache_sizes", [int(c) for c in cache_sizes]),
                       ("scenarios", [s.label for s in scenarios])):
        repeated = sorted({str(k) for k in keys if keys.count(k) > 1})
        if repeated:
            raise ValueError(f"{name}: {', '.join(repeated)} twice; expected distinct ones (their rows would collide)")
    for s in scenarios:
        if not isinstance(s.cost, CostModel):
            raise ValueError(f"scenarios: {s.label!r}: expected a CostModel, got {type(s.cost).__name__}")


def run_sweep(prepared: list[PreparedTrace], policies: list[str], cache_sizes: list[int], scenarios: list[Scenario],
              cache_mode: str = "per_layer", cache_policy: str = "lru", max_levels: int = 8,
              progress: Callable[[str], None] | None = None,
              price_uncertainty: bool = True, per_layer: bool = False,
              layer_ahead: str | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Replay every combination; returns ``(cycles, summary)`` DataFrames (one row per cycle in
    :data:`specfit.accounting.CYCLE_COLUMNS`, one :func:`specfit.accounting.summarise` row per
    (trace, profile, cache size, policy)). ``price_uncertainty``: the specfit policy
    prices, per draft node, the experts its predictor gets wrong (the predictor's slot precision
    on the trace). ``per_layer``: the cycles' per-layer columns are filled (and the summary's
    per-layer errors with them), for rows that are written out; without it they are empty, which
    keeps a sweep free of a list per cycle and column. ``layer_ahead``: one of
    :data:`specfit.experts.layer_ahead.PREFETCHERS`, each replay also recounted with that
    prefetcher's copies of the next layer's experts while a layer computes (the summary's
    ``layer_ahead_*`` columns, :func:`_layer_ahead_columns`); ``None`` or ``"none"``: not."""
    from ..experts.layer_ahead import CrossFitRankers
    from .scenarios import check_layer_ahead

    check_policies(policies, max_levels)
    _check_grid(prepared, policies, cache_sizes, scenarios)
    layer_ahead = None if layer_ahead in (None, "none") else layer_ahead
    if layer_ahead is not None:
        check_layer_ahead(layer_ahead)
    record = layer_ahead is not None

    def build(spec: str) -> Policy:
        policy = make_policy(spec, max_levels=max_levels)
        if not price_uncertainty and hasattr(policy, "price_uncertainty"):
            policy.price_uncertainty = "none"
        return policy

    cycle_frames, rows = [], []
    for prep in prepared:
        max_nodes = prep.max_nodes
        # the ceiling needs no predictor
        rankers = CrossFitRankers(prep) if record and layer_ahead != "ceiling" else None
        for scenario in scenarios:
            imposed: dict[str, CycleLog] = {}     # policies with their own cache size run once per scenario
            imposed_ahead: dict[str, dict] = {}   # ... and are recounted once
            for capacity in cache_sizes:
                for spec in policies:
                    extra = {}
                    policy = build(spec)
                    ran = policy
                    if isinstance(policy, TunedPolicy):
                        best = None
                        for cand in policy.candidates(max_nodes):
                            log = _run(prep, cand, capacity, scenario.cost, cache_mode, cache_policy, per_layer, record)
                            rate = log.columns["committed_tokens"].sum() / log.columns["charged_time_s"].sum()
                            if best is None or rate > best[0]:
                                best = (rate, cand.total_nodes, log, cand)
                        log, extra, ran = best[2], {"static_n": best[1]}, best[3]
                    elif policy.cache_capacity is not None:
                        if spec not in imposed:
                            imposed[spec] = _run(prep, policy, capacity, scenario.cost, cache_mode, cache_policy,
                                                 per_layer, record)
                        log = imposed[spec]
                    else:
                        log = _run(prep, policy, capacity, scenario.cost, cache_mode, cache_policy, per_layer, record)
                    if record:
                        if policy.cache_capacity is not None and spec in imposed_ahead:
                            columns = imposed_ahead[spec]
                        else:
                            columns = _layer_ahead_columns(prep, rankers, log, ran, _capacity(policy, capacity),
                                                           scenario.cost, layer_ahead, cache_mode, cache_policy)
                            if policy.cache_capacity is not None:
                                imposed_ahead[spec] = columns
                        extra.update(columns)
                    keys = {"trace": prep.name, "profile": scenario.label, "cache_experts": capacity, "policy": spec}
                    frame = replay_frame(log.columns, scenario.cost.bytes_per_miss(prep.trace.expert_bytes))
                    frame.insert(2, "cycle", np.arange(len(frame)))
                    for name, value in reversed(keys.items()):
                        frame.insert(0, name, value)
                    cycle_frames.append(frame)
                    # cache_mode: what a cache size counts (experts per layer, or in all), for the report
                    rows.append({**keys, "predictor": prep.predictor, "cache_mode": cache_mode,
                                 "slot_precision": prep.info["slot_precision"],
                                 **summarise(frame), **extra})
                    if progress is not None:
                        progress(f"{prep.name} {scenario.label} cache={capacity} {spec}")
    summary = pd.DataFrame(rows)
    if "static_n" not in summary:
        summary["static_n"] = np.nan
    summary["static_n"] = summary["static_n"].astype("Int64")
    return pd.concat(cycle_frames, ignore_index=True), with_speedups(summary, ["trace", "profile", "cache_experts"])
