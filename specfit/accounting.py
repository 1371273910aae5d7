"""Predicted against what happened: the one per-cycle schema of live and simulated decoding, the
summary of a policy's cycles, and the error measures.

Both drivers describe a cycle with the same columns (:data:`CYCLE_COLUMNS`). What only a live run
measures (wall-clock times) is NaN / empty in a replay; what happened is in both: the committed
tokens, the true union's hits and misses (per layer too, in a replay's rows written to a file; a
sweep's summary goes without them), the bytes moved, and ``charged_time_s``, the cost model applied
to them (in a replay, the simulator's "measurement").
``time_s`` is the cycle's time as the driver knows it: measured live, charged in a replay; a
policy's throughput is committed tokens over the sum of ``time_s``, in the summary, the terminal
and the report alike.

Errors of a prediction ``p`` of a quantity ``a`` over cycles (:func:`prediction_errors`):

- ``mape``: mean of |p - a| / a, how far one cycle's prediction is on average;
- ``median_ape``: the median of the same, robust to a few disturbed cycles;
- ``bias``: sum(p) / sum(a) - 1, the error of the total (what a throughput prediction inherits).

:func:`summarise` reports all three for time, bytes, committed tokens and union size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from . import kernels
from .costmodel import CostModel

if TYPE_CHECKING:       # pandas is imported where a frame is built: the CLI starts without it
    import pandas as pd

__all__ = ["Column", "CYCLE_COLUMNS", "KEY_COLUMNS", "prediction_errors", "live_row", "replay_frame", "summarise",
           "ERROR_QUANTITIES", "read_cycles", "waiting_note", "WAITED_CYCLE", "with_speedups"]


@dataclass(frozen=True)
class Column:
    name: str
    kind: str            # "int", "float" or "list"
    live_only: bool
    description: str


KEY_COLUMNS = ("policy", "sequence", "position", "cycle")

CYCLE_COLUMNS = tuple(Column(*c) for c in (
    ("draft_levels", "int", False, "levels drafted this cycle"),
    ("nodes_drafted", "int", False, "nodes of the drafted tree, root included"),
    ("nodes_verified", "int", False, "nodes the target verified, root included"),
    ("deepest_selected", "int", False, "depth of the deepest verified node"),
    ("committed_tokens", "int", False, "tokens the cycle added to the output (accepted + bonus)"),
    ("predicted_tokens", "float", False, "expected committed tokens of the selection (1 + path probabilities)"),
    ("time_s", "float", False, "the cycle's time: measured live, charged in a replay"),
    ("predicted_time_s", "float", False, "the time the policy decided with: the cost model's for the selection "
                                          "with predicted experts (the online model's when it refits)"),
    ("prior_predicted_time_s", "float", False, "the profile's (the prior's) time for the same selection"),
    ("online_predicted_time_s", "float", True, "the online-refitted model's time for the selection (empty when frozen)"),
    ("charged_time_s", "float", False, "the cost model's time for what happened (the true union's hits and misses)"),
    ("measured_time_s", "float", True, "wall-clock time of the cycle: draft + verify + learn"),
    ("union_size", "int", False, "experts of the verified nodes' true union, summed over layers"),
    ("predicted_union_size", "int", False, "experts of the predicted union of the verified nodes"),
    ("union_overlap", "int", False, "experts in both unions"),
    ("hits", "int", False, "true union experts already resident"),
    ("misses", "int", False, "true union experts copied host-to-device"),
    ("predicted_hits", "int", False, "predicted union experts the search saw resident"),
    ("predicted_misses", "int", False, "predicted union experts the search saw missing"),
    ("bytes_h2d", "int", False, "bytes copied host-to-device"),
    ("prefetched", "int", False, "experts copied ahead of their pass, in the link time of drafted levels"),
    ("predicted_bytes_h2d", "float", False, "predicted misses, plus the experts prefetched before the selection, "
                                           "times the bytes of one expert"),
    ("charged_bytes_h2d", "int", False, "bytes the expert cache's bookkeeping gives the true experts from the "
                                        "residency the selection saw, plus the prefetched experts (the cost model's "
                                        "view of what moved)"),
    ("prediction_precision", "float", False, "share of the verified draft nodes' predicted expert slots that were right"),
    ("draft_time_s", "float", True, "from the cycle's start to the selection"),
    ("verify_time_s", "float", True, "from the selection to the committed tokens"),
    ("target_time_s", "float", True, "the target's verification pass"),
    ("transfer_time_s", "float", True, "how long the target pass waited for host-to-device copies (the exposed stall)"),
    ("drafter_time_s", "float", True, "the drafter's forward passes"),
    ("search_time_s", "float", True, "the policy's decisions"),
    ("predict_time_s", "float", True, "expert predictions for the drafted nodes"),
    ("learn_time_s", "float", True, "after the commit: policy and predictor learn (in the cycle; the cost model sees it as the next starts)"),
    ("update_time_s", "float", True, "at the cycle's start (in draft_time_s): the online cost model's update, "
                                     "whose expected time the cycle's predicted time holds"),
    ("cpu_time_s", "float", True, "CPU time of the decoding thread over the cycle (wall time minus waiting, "
                                  "e.g. for other processes, on a CPU device with one thread)"),
    ("waited_s", "float", True, "wall time the decoding thread did not run (measured minus CPU time, less its "
                                "wait for prefetch copies: it waited for a CPU another process had), on a CPU "
                                "device with one torch thread; empty elsewhere, where other threads or the device "
                                "do part of the work"),
    ("hits_per_layer", "list", False, "hits per MoE layer"),
    ("misses_per_layer", "list", False, "misses per MoE layer"),
    ("union_per_layer", "list", False, "experts of the verified nodes' true union, per MoE layer"),
    ("predicted_union_per_layer", "list", False, "experts of the predicted union of the verified nodes, per layer"),
    ("predicted_misses_per_layer", "list", False, "predicted union experts the search saw missing, per layer"),
))
# (label, predicted column, actual column) of the errors the summary reports
ERROR_QUANTITIES = (("time", "predicted_time_s", "time_s"), ("prior_time", "prior_predicted_time_s", "time_s"),
                    ("online_time", "online_predicted_time_s", "time_s"),
                    ("bytes", "predicted_bytes_h2d", "bytes_h2d"), ("charged_bytes", "charged_bytes_h2d", "bytes_h2d"),
                    ("tokens", "predicted_tokens", "committed_tokens"), ("union", "predicted_union_size", "union_size"),
                    ("misses", "predicted_misses", "misses"))


def prediction_errors(predicted, actual) -> dict:
    """``n``, ``mape``, ``median_ape``, ``max_ape``, ``bias`` and ``max_abs_err`` of predictions
    against what happened, over the cycles where both are finite. The relative errors (``n``,
    ``mape``, ``median_ape``, ``max_ape``) skip the cycles whose actual value is 0 (a cycle that
    moved no bytes has no relative error); ``bias`` is sum(predicted) / sum(actual) - 1 and
    ``max_abs_err`` the largest absolute error over every such cycle."""
    p = np.asarray(predicted, dtype=np.float64)
    a = np.asarray(actual, dtype=np.float64)
    ok = np.isfinite(p) & np.isfinite(a)
    p, a = p[ok], a[ok]
    rel = a > 0
    nan = float("nan")
    if not rel.any():
        return {"n": 0, "mape": nan, "median_ape": nan, "max_ape": nan, "bias": nan, "max_abs_err": nan}
    ape = np.abs(p[rel] - a[rel]) / a[rel]
    return {"n": int(rel.sum()), "mape": float(ape.mean()), "median_ape": float(np.median(ape)),
            "max_ape": float(ape.max()), "bias": float(p.sum() / a.sum() - 1.0) if a.sum() > 0 else nan,
            "max_abs_err": float(np.abs(p - a).max())}


_NAN = float("nan")
WAITED_CYCLE = 0.1      # a cycle whose thread waited for a CPU more than this share of its time "waited"
WAITED_NOTE = 0.05      # waited cycles from which a run's summary says so (waiting_note)

# --------------------------------------------------------------------------- rows
def live_row(stats, cost: CostModel | None, expert_bytes: int) -> dict:
    """The schema's row of one live cycle (a :class:`~specfit.runtime.decoder.CycleStats`) of a
    model whose experts are ``expert_bytes`` each; ``cost`` is the
    profile the run started from (the prior of an online refit). It is built inside the next
    cycle's measured time, so each per-layer array is turned into a list once and the totals are
    summed from it (a numpy reduction of a few ints costs several times a Python sum of them)."""
    draft, verification, offload = stats.draft, stats.verification, stats.verification.offload
    sel = draft.selection
    nan = _NAN
    hits_per_layer, misses_per_layer = offload.hits.tolist(), offload.misses.tolist()
    hits, misses = sum(hits_per_layer), sum(misses_per_layer)
    union_per_layer = [h + m for h, m in zip(hits_per_layer, misses_per_layer)]
    predicted_union, predicted_misses = [], []
    predicted_union_size = overlap = -1
    counts = stats.union_counts
    if counts is not None:
        e = kernels.evaluate
        predicted_union, predicted_misses = counts[e.PREDICTED_UNION].tolist(), counts[e.PREDICTED_MISSES].tolist()
        predicted_union_size, overlap = sum(predicted_union), int(counts[e.OVERLAP].sum())
    charged = stats.charged_misses_per_layer
    n_verified = int(verification.nodes.size)
    time_s = stats.cycle_time_s
    row = {
        "draft_levels": draft.draft_levels,
        "nodes_drafted": draft.tree.n_nodes,
        "nodes_verified": n_verified,
        "deepest_selected": int(draft.tree.depth[verification.nodes].max()),
        "committed_tokens": stats.committed_tokens,
        "predicted_tokens": sel.expected_tokens if sel else nan,
        "time_s": time_s,
        "predicted_time_s": sel.time_s if sel else nan,
        "prior_predicted_time_s": (cost.time_s(sel.draft_levels, sel.n_nodes, sel.hits, sel.misses)
                                   if sel is not None and cost else nan),
        "online_predicted_time_s": sel.time_s if sel is not None and stats.online else nan,
        "charged_time_s": cost.time_s(draft.draft_levels, n_verified, hits, misses) if cost else nan,
        "measured_time_s": time_s,
        "union_size": hits + misses,
        "predicted_union_size": predicted_union_size,
        "union_overlap": overlap,
        "hits": hits,
        "misses": misses,
        "predicted_hits": sel.hits if sel else -1,
        "predicted_misses": sel.misses if sel else -1,
        "bytes_h2d": offload.total_bytes_h2d + draft.prefetched * expert_bytes,
        "prefetched": draft.prefetched,
        # the prefetched experts were copied before the selection: known, not predicted, and moved
        "predicted_bytes_h2d": (sel.misses + draft.prefetched) * expert_bytes if sel else nan,
        "charged_bytes_h2d": (int(charged.sum()) + draft.prefetched) * expert_bytes if charged is not None else -1,
        "prediction_precision": stats.predicted_slots_right / stats.predicted_slots if stats.predicted_slots else nan,
        "draft_time_s": stats.draft_time_s,
        "verify_time_s": stats.verify_time_s,
        "target_time_s": verification.target_time_s,
        "transfer_time_s": verification.transfer_time_s,
        "drafter_time_s": draft.drafter_time_s,
        "search_time_s": draft.search_time_s,
        "predict_time_s": draft.predict_time_s,
        "learn_time_s": stats.learn_time_s,
        "update_time_s": stats.update_time_s,
        "cpu_time_s": stats.cpu_time_s,
        "waited_s": stats.waited_s,
        "hits_per_layer": hits_per_layer,
        "misses_per_layer": misses_per_layer,
        "union_per_layer": union_per_layer,
        "predicted_union_per_layer": predicted_union,
        "predicted_misses_per_layer": predicted_misses,
    }
    return row


def replay_frame(columns: dict[str, np.ndarray], expert_bytes: int) -> "pd.DataFrame":
    """The schema's rows of a replay (``CycleLog.columns`` of :func:`specfit.simulate.replay.replay`):
    what the simulator knows, the live-only columns empty, and the per-layer ones (``[cycles, L]``
    arrays) as lists where the replay recorded them (``per_layer``), else empty."""
    import pandas as pd

    n = len(columns["committed_tokens"])
    out = {"sequence": columns["sequence"], "position": columns["position"]}
    for col in CYCLE_COLUMNS:
        if col.name in columns:
            out[col.name] = columns[col.name].tolist() if col.kind == "list" else columns[col.name]
        elif col.kind == "list":
            # the empty tuple is one object: a list per cycle (millions in a sweep) fed the cyclic
            # garbage collector: 1.25 s of a 25k-token simulate, 0.07 s now
            out[col.name] = [()] * n
        else:
            out[col.name] = np.full(n, np.nan if col.kind == "float" else -1)
    out["time_s"] = columns["charged_time_s"]
    # a replay decides with its scenario's cost model, and charges the true experts through the cache
    out["prior_predicted_time_s"] = columns["predicted_time_s"]
    out["charged_bytes_h2d"] = columns["bytes_h2d"]
    out["predicted_hits"] = np.asarray(columns["predicted_union_size"]) - np.asarray(columns["predicted_misses"])
    out["predicted_bytes_h2d"] = (np.asarray(columns["predicted_misses"], dtype=np.float64)
                                  + np.asarray(columns.get("prefetched", 0))) * expert_bytes
    if "prediction_precision" not in columns:
        out["prediction_precision"] = np.full(n, np.nan)
    return pd.DataFrame(out)


def read_cycles(frame: "pd.DataFrame") -> "pd.DataFrame":
    """A ``cycles.parquet`` frame in this schema: files written before it (``cycle_time_s``,
    ``prompt``) are renamed, columns they lack are added empty."""
    renames = {"cycle_time_s": "measured_time_s", "prompt": "sequence"}
    frame = frame.rename(columns={k: v for k, v in renames.items() if k in frame and v not in frame})
    if "time_s" not in frame:
        frame["time_s"] = frame["measured_time_s"] if "measured_time_s" in frame else frame["charged_time_s"]
    for col in CYCLE_COLUMNS:
        if col.name not in frame:
            frame[col.name] = [()] * len(frame) if col.kind == "list" else \
                (float("nan") if col.kind == "float" else -1)
    return frame


# --------------------------------------------------------------------------- summaries
def with_speedups(frame: "pd.DataFrame", keys, bases=("ar", "eagle3")) -> "pd.DataFrame":
    """``frame`` (rows of ``policy`` and ``tokens_per_s``) with ``speedup_vs_<base>``: each row's
    tokens per second over the ``base`` policy's row with the same ``keys`` (NaN where the setting
    has no such row; the first where it has several). The one speed-up of ``simulate``, ``sweep``
    and ``plan``."""
    if "tokens_per_s" not in frame:
        return frame
    import pandas as pd

    frame = frame.copy()
    group = pd.MultiIndex.from_frame(frame[list(keys)].astype(str))
    tokens_per_s = frame["tokens_per_s"].to_numpy(dtype=np.float64)
    for base in bases:
        is_base = (frame["policy"] == base).to_numpy()
        ref = pd.Series(tokens_per_s[is_base], index=group[is_base])
        ref = ref[~ref.index.duplicated()]
        frame[f"speedup_vs_{base}"] = tokens_per_s / ref.reindex(group).to_numpy()
    return frame


def summarise(cycles: "pd.DataFrame") -> dict:
    """Totals and prediction quality of one policy's cycles (rows of :data:`CYCLE_COLUMNS`); with
    no cycles (an output that ended at the prefill's token) the counts are 0 and the rates NaN."""
    c = cycles
    if c.empty and "committed_tokens" not in c:
        import pandas as pd

        c = read_cycles(pd.DataFrame({"time_s": np.zeros(0)}))
    tokens = int(c["committed_tokens"].sum())
    time_s = float(c["time_s"].sum())
    n = len(c)
    nan = float("nan")
    union = int(c["union_size"].clip(lower=0).sum())
    predicted_union = int(c["predicted_union_size"].clip(lower=0).sum())
    overlap = int(c["union_overlap"].clip(lower=0).sum())
    hits, misses = int(c["hits"].sum()), int(c["misses"].sum())
    priced = c["predicted_misses"] >= 0                 # -1: the cycle had no prediction (no cost model)
    miss_error = (c["predicted_misses"] - c["misses"])[priced]
    out = {
        "tokens": tokens, "cycles": n, "time_s": time_s,
        "tokens_per_s": tokens / time_s if time_s > 0 else (nan if n == 0 else float("inf")),
        "tokens_per_cycle": tokens / n if n else nan,
        "time_per_cycle_s": time_s / n if n else nan,
        "predicted_time_per_cycle_s": float(c["predicted_time_s"].mean()) if n else nan,
        "bytes_h2d": int(c["bytes_h2d"].sum()),
        "bytes_per_token": float(c["bytes_h2d"].sum() / tokens) if tokens else nan,
        "bytes_per_cycle": float(c["bytes_h2d"].mean()) if n else nan,
        "predicted_bytes_per_cycle": float(c["predicted_bytes_h2d"].mean()) if n else nan,
        "hit_rate": hits / (hits + misses) if hits + misses else nan,
        "nodes_per_cycle": float(c["nodes_verified"].mean()) if n else nan,
        "draft_levels_per_cycle": float(c["draft_levels"].mean()) if n else nan,
        # levels drafted below the deepest selected node: draft time spent on nothing
        "wasted_draft_levels": float((c["draft_levels"] - c["deepest_selected"]).clip(lower=0).mean()) if n else nan,
        "predicted_tokens_per_cycle": float(c["predicted_tokens"].mean()) if n else nan,
        "union_precision": overlap / predicted_union if predicted_union else 1.0,
        "union_recall": overlap / union if union else 1.0,
        "miss_count_error": float(np.mean(miss_error)) if len(miss_error) else nan,
        "miss_count_abs_error": float(np.mean(np.abs(miss_error))) if len(miss_error) else nan,
        "prediction_precision": float(np.nanmean(c["prediction_precision"])) if c["prediction_precision"].notna().any()
        else nan,
    }
    for label, predicted, actual in ERROR_QUANTITIES:
        if predicted not in c or actual not in c:
            continue
        err = _known_errors(c, predicted, actual)
        for measure in ("mape", "median_ape", "bias"):
            out[f"{label}_{measure}"] = err[measure]
    out.update(_waiting(c))
    out["union_layer_mape"] = _per_layer_error(c, "predicted_union_per_layer", "union_per_layer")
    out["misses_layer_mape"] = _per_layer_error(c, "predicted_misses_per_layer", "misses_per_layer")
    measured = c["measured_time_s"].notna().any() if "measured_time_s" in c else False
    if measured:
        total = float(c["measured_time_s"].sum())
        models = float((c["drafter_time_s"] + c["target_time_s"]).sum())
        out["search_share"] = float(c["search_time_s"].sum() / total) if total > 0 else nan
        # everything but the models' own passes: the policy, predictions, bookkeeping
        out["overhead_share"] = 1.0 - models / total if total > 0 else nan
        out["transfer_time_per_cycle_s"] = float(c["transfer_time_s"].mean())
    return out


def _waiting(c: "pd.DataFrame") -> dict:
    """How much of a live run the decoding thread waited for a CPU (``waited_s``: recorded on a
    CPU device with one torch thread), and the time error over the cycles that did not wait: a
    cycle prediction is made before the cycle runs and cannot know that another process will take
    the core. ``waited_share``: waited seconds over measured seconds; ``waited_cycles``: the share of
    cycles that waited more than :data:`WAITED_CYCLE` of their time; ``running_time_mape``: the
    ``time`` MAPE (the model the policy decided with) over the others. NaN without the column's
    values (a replay, a GPU, several threads)."""
    nan = float("nan")
    out = {"waited_share": nan, "waited_cycles": nan, "running_time_mape": nan}
    if "waited_s" not in c or "measured_time_s" not in c:
        return out
    known = c["waited_s"].notna() & c["measured_time_s"].notna() & (c["measured_time_s"] > 0)
    if not known.any():
        return out
    waited, measured = c.loc[known, "waited_s"], c.loc[known, "measured_time_s"]
    out["waited_share"] = float(waited.sum() / measured.sum())
    waiting = waited > WAITED_CYCLE * measured
    out["waited_cycles"] = float(waiting.mean())
    out["running_time_mape"] = _known_errors(c.loc[known][~waiting], "predicted_time_s", "time_s")["mape"]
    return out


def _known_errors(c: "pd.DataFrame", predicted: str, actual: str) -> dict:
    """:func:`prediction_errors` over the cycles where both columns are known (-1: not known)."""
    valid = (c[actual] >= 0) & (c[predicted] >= 0)
    return prediction_errors(c.loc[valid, predicted], c.loc[valid, actual])


def waiting_note(summary: dict) -> str | None:
    """A sentence for a policy whose decoding thread waited for a CPU in :data:`WAITED_NOTE` of its
    cycles or more (None otherwise): its time error then mixes the model's error with the machine's.
    (The error over the cycles that did not wait is in the summary and the report; it is not the
    model's alone either: the online model follows the machine's speed with the waits in it.)"""
    share = summary.get("waited_cycles", _NAN)
    if not share >= WAITED_NOTE:
        return None
    return (f"{summary['policy']}: the decoding thread waited for a CPU in {share:.0%} of its cycles "
            f"({summary['waited_share']:.0%} of its time): another process had the core, and the cycle-time error "
            f"({summary['time_mape']:.0%}) is the machine's as much as the model's; measure the model on a quieter "
            f"machine")


def _per_layer_error(c: "pd.DataFrame", predicted: str, actual: str) -> float:
    """MAPE over every (cycle, layer) of two per-layer list columns (NaN where none is recorded)."""
    if predicted not in c or actual not in c:
        return float("nan")
    pairs = [(p, a) for p, a in zip(c[predicted], c[actual]) if len(p) and len(p) == len(a)]
    if not pairs:
        return float("nan")
    return prediction_errors(np.concatenate([p for p, _ in pairs]), np.concatenate([a for _, a in pairs]))["mape"]
