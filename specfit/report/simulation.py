"""The simulation section: what ``specfit simulate --out DIR`` wrote, as figures and tables."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..console import speedup_text
from ..errors import SpecFitError
from ..policies import is_tuned
from .html import Page
from .plots import grouped_bars, legend_outside, log_x, new_axes

__all__ = ["simulation_section", "cache_unit"]

_POLICY_ORDER = ("ar", "chain", "static", "sequoia", "eagle3-nocache", "eagle3", "specfit", "oracle")


def _policy_rank(policy: str) -> tuple[int, str]:
    head = str(policy).split(":")[0]
    return (_POLICY_ORDER.index(head) if head in _POLICY_ORDER else len(_POLICY_ORDER), str(policy))


def simulation_section(page: Page, summary: pd.DataFrame, cycles: pd.DataFrame | None, name: str,
                       notes: list[str] = ()) -> None:
    if summary.empty:
        raise SpecFitError(f"{name}: summary.parquet has no rows; expected one per trace, profile, cache size and "
                           "policy that `specfit simulate --out` replayed")
    page.heading(f"Simulation: {name}")
    page.paragraph("Every policy replays the same position-indexed traces with the same expert cache and cost "
                   "model; a policy decides with the predicted experts and each cycle is charged with the true "
                   "ones. Greedy decoding is lossless, so all policies commit the same tokens and only the "
                   "number of cycles and their cost differ.")
    for note in notes:                       # what the run said its readers should know
        page.note(note)
    unit = cache_unit(summary)
    groups = summary.groupby(["trace", "profile"], sort=False)
    for (trace, profile), group in groups:
        page.heading(f"{trace} on {profile}", level=3)
        caches = sorted(group["cache_experts"].unique())
        policies = sorted(group["policy"].unique(), key=_policy_rank)
        table = group.set_index(["cache_experts", "policy"])
        labels = [_label(p, [table.loc[(c, p)] for c in caches]) if is_tuned(p) else p for p in policies]
        series = {f"{c} cached": [table.loc[(c, p), "tokens_per_s"] for p in policies] for c in caches}
        # as the terminal writes them: a loss is never rounded to 1.00x, and a run without ar has no label
        notes = {f"{c} cached": [speedup_text(table.loc[(c, p), "speedup_vs_ar"], missing="") for p in policies]
                 for c in caches}
        page.figure(grouped_bars(labels, series, "tokens / s", notes, title=f"{trace} on {profile}"),
                    "Committed tokens per second of charged cycle time, per policy and expert-cache size "
                    f"(experts {unit}); labels: speed-up vs ar at the same cache size (none where ar was not "
                    "replayed).")
        if len(caches) > 1:
            page.figure(_throughput_vs_cache(group, page.policy_styles(policies), unit),
                        "Throughput vs expert-cache size, per policy.")
        page.figure(grouped_bars(labels, {f"{c} cached": [table.loc[(c, p), "bytes_per_token"] / 1e6 for p in policies]
                                          for c in caches}, "MB H2D / token"),
                    "Host-to-device traffic per committed token, per policy and expert-cache size.")
    if cycles is not None and not cycles.empty:
        page.figure(_tree_sizes(cycles, page.policy_styles(sorted(cycles["policy"].unique(), key=_policy_rank))),
                    "Nodes verified per cycle: how large a subtree each policy chose, as a share of the policy's "
                    "cycles over every trace, profile and cache size of the run.")
    summary = summary.assign(bytes_per_token=summary["bytes_per_token"] / 1e6)     # MB, as in the figures
    page.table(_shown(summary, _SUMMARY), percent=("hit rate",), caption=(
        f"Summary per trace, profile, cache size and policy. cached experts: experts the cache holds {unit}; "
        "tokens / s: committed tokens per second of charged cycle time; MB H2D / token: host-to-device megabytes "
        "(10^6 bytes) per committed token; hit rate: share of the verified union's experts found in the cache; "
        "nodes / cycle: draft-tree nodes verified per cycle; draft levels / cycle: drafter passes per cycle; "
        "wasted draft levels / cycle: levels drafted below the deepest verified node (draft time spent on "
        "nothing); speed-up vs ar / eagle3: tokens / s over that policy's at the same trace, profile and cache "
        "size."))
    quality = [c for c in _QUALITY if c in summary.columns]
    if quality:
        page.table(_shown(summary, {**_KEYS, **_QUALITY}), percent=_QUALITY_SHARES, caption=(
            "Prediction quality: the expert predictor and the acceptance estimate. union precision / recall: "
            "share of the predicted union of experts that the cycles used / of the used union that was predicted "
            "(over all cycles); union-size MAPE: mean over cycles of |predicted - actual| / actual union size, per "
            "layer: the same over each cycle's layers (likewise the misses' MAPE per layer; recorded only by a "
            "replay that writes its rows, simulate --out); "
            "miss-count error: mean over cycles of predicted minus actual cache misses (positive: the search "
            "expected more misses than the cycle had), |error| its mean absolute value; predicted vs committed "
            "tokens / cycle: the acceptance estimate of the chosen tree against the tokens the cycle committed; "
            "bias: sum(predicted) / sum(actual) - 1; time MAPE and bias: the predicted cycle time against the "
            "cost model on the true union (the simulator's measurement)."))
    if "layer_ahead_tokens_per_s" in summary.columns:
        page.table(_shown(summary, {**_KEYS, "tokens_per_s": "tokens / s", **_AHEAD}),
                   percent=("time hidden", "copies needed"), caption=(
            "Layer-ahead what-if (simulate --layer-ahead): each replay recounted with copies of the next layer's "
            "experts made while a layer computes, in link time the pass leaves idle. prefetcher: ceiling (the true "
            "misses), transition (a next-layer transition table) or eam (MoE-Infinity's activation-matrix "
            "matching), fitted on other sequences (a lone sequence: on its other half; a trace of one cycle: on nothing); tokens / s "
            "with them: the same cycles with the hidden time taken off; time hidden: its share of the charged time (negative "
            "where wasted copies still under way at a window's close delayed the next layer's own copies more than the "
            "useful ones hid); copies needed: share of the copies made that the next "
            "layer missed. Residency, hits and misses are the replay's; none for a policy with cache levers, whose "
            "evictions and prefetches a recount does not rebuild."))


# the summary's columns each table shows, under a header with its unit
_KEYS = {"trace": "trace", "profile": "profile", "cache_experts": "cached experts", "policy": "policy",
         "predictor": "predictor"}
_SUMMARY = {**_KEYS, "tokens_per_s": "tokens / s", "tokens_per_cycle": "tokens / cycle",
            "bytes_per_token": "MB H2D / token", "hit_rate": "hit rate", "nodes_per_cycle": "nodes / cycle",
            "draft_levels_per_cycle": "draft levels / cycle", "wasted_draft_levels": "wasted draft levels / cycle",
            "speedup_vs_ar": "speed-up vs ar", "speedup_vs_eagle3": "speed-up vs eagle3"}
_QUALITY = {"union_precision": "union precision", "union_recall": "union recall", "union_mape": "union-size MAPE",
            "union_layer_mape": "union-size MAPE per layer", "miss_count_error": "miss-count error",
            "miss_count_abs_error": "miss-count |error|", "misses_layer_mape": "misses MAPE per layer",
            "predicted_tokens_per_cycle": "predicted tokens / cycle", "tokens_per_cycle": "committed tokens / cycle",
            "tokens_bias": "tokens bias", "time_mape": "time MAPE", "time_bias": "time bias"}
_AHEAD = {"layer_ahead": "prefetcher", "layer_ahead_tokens_per_s": "tokens / s with them",
          "layer_ahead_hidden_share": "time hidden", "layer_ahead_precision": "copies needed"}
_QUALITY_SHARES = ("union precision", "union recall", "union-size MAPE", "union-size MAPE per layer",
                   "misses MAPE per layer", "tokens bias", "time MAPE", "time bias")


def cache_unit(frame: pd.DataFrame) -> str:
    """What the cache sizes of ``frame``'s rows count: experts "per layer", or "in all" where every
    row's cache is global (``--cache-mode global``; a summary written before it said its mode is
    per layer, the default)."""
    modes = set(frame["cache_mode"].astype(str)) if "cache_mode" in frame else {"per_layer"}
    if modes == {"global"}:
        return "in all"
    return "per layer" if "global" not in modes else "per layer, or in all where the cache mode is global"


def _shown(frame: pd.DataFrame, columns: dict) -> pd.DataFrame:
    """The ``columns`` of ``frame`` it has, renamed to their headers."""
    return frame[[c for c in columns if c in frame.columns]].rename(columns=columns)

def _label(policy: str, rows) -> str:
    """A tuned ``policy`` (``static:auto``, ``sequoia:auto``) with the tree size it picked at each
    cache size, in the bars' order (``N=16/6``), or once where every size picked the same."""
    sizes = [str(int(n)) for n in (row.get("static_n") for row in rows) if pd.notna(n)]
    if not sizes:
        return policy
    return f"{policy} (N={sizes[0] if len(set(sizes)) == 1 else '/'.join(sizes)})"


def _throughput_vs_cache(group: pd.DataFrame, styles: dict, unit: str = "per layer"):
    fig, ax = new_axes()
    for policy, g in sorted(group.groupby("policy"), key=lambda kv: _policy_rank(kv[0])):
        g = g.sort_values("cache_experts")
        style = styles[str(policy)]
        ax.plot(g["cache_experts"], g["tokens_per_s"], label=str(policy), color=style.color, marker=style.marker)
    ax.set(xlabel=f"cached experts {unit}", ylabel="tokens / s")
    legend_outside(ax)
    return fig


def _tree_sizes(cycles: pd.DataFrame, styles: dict):
    fig, ax = new_axes()
    policies = sorted(cycles["policy"].unique(), key=_policy_rank)
    top = int(cycles["nodes_verified"].max())
    edges = np.unique(np.round(np.geomspace(1, max(top, 2) + 1, 16))) - 0.5
    middles = np.sqrt(edges[:-1] * edges[1:])                  # of a bin on the log axis
    for policy in policies:
        nodes = cycles.loc[cycles["policy"] == policy, "nodes_verified"]
        # a bar is the share of the policy's cycles (density=True divided it by the log-spaced bin's
        # width: 58 nodes every cycle was drawn at 0.07)
        shares = np.histogram(nodes, bins=edges)[0] / len(nodes)
        # the step outline as one line, through each bar's top middle, where the policy's marker
        # sits (on the bars it has): outlines lie on one another at shared edges and heights
        x = np.concatenate([edges[:1], np.column_stack([edges[:-1], middles, edges[1:]]).ravel(), edges[-1:]])
        y = np.concatenate([[0.0], np.repeat(shares, 3), [0.0]])
        style = styles[str(policy)]
        ax.plot(x, y, lw=1.5, label=str(policy), color=style.color, ls=style.linestyle, marker=style.marker,
                markevery=(2 + 3 * np.flatnonzero(shares)).tolist())
    log_x(ax)
    ax.set_ylim(bottom=0)                   # as a bar chart's: the outlines' feet on the axis
    ax.set(xlabel="nodes verified in a cycle", ylabel="share of cycles")
    legend_outside(ax)
    return fig
