"""The simulation section: what ``specfit simulate --out DIR`` wrote, as figures and tables."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..errors import SpecFitError
from .html import Page
from .plots import grouped_bars, legend_outside, log_x, new_axes

__all__ = ["simulation_section"]

_POLICY_ORDER = ("ar", "chain", "static", "eagle3-nocache", "eagle3", "specfit", "oracle")


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
    groups = summary.groupby(["trace", "profile"], sort=False)
    for (trace, profile), group in groups:
        page.heading(f"{trace} on {profile}", level=3)
        caches = sorted(group["cache_experts"].unique())
        policies = sorted(group["policy"].unique(), key=_policy_rank)
        table = group.set_index(["cache_experts", "policy"])
        labels = [_label([table.loc[(c, p)] for c in caches]) if p == "static:auto" else p for p in policies]
        series = {f"{c} cached": [table.loc[(c, p), "tokens_per_s"] for p in policies] for c in caches}
        notes = {f"{c} cached": [f"{table.loc[(c, p), 'speedup_vs_ar']:.2f}x" for p in policies] for c in caches}
        page.figure(grouped_bars(labels, series, "tokens / s", notes, title=f"{trace} on {profile}"),
                    "Committed tokens per second of charged cycle time, per policy and expert-cache size "
                    "(experts per layer); labels: speed-up vs ar at the same cache size.")
        if len(caches) > 1:
            page.figure(_throughput_vs_cache(group), "Throughput vs expert-cache size, per policy.")
        page.figure(grouped_bars(labels, {f"{c} cached": [table.loc[(c, p), "bytes_per_token"] / 1e6 for p in policies]
                                          for c in caches}, "MB H2D / token"),
                    "Host-to-device traffic per committed token, per policy and expert-cache size.")
    if cycles is not None and not cycles.empty:
        page.figure(_tree_sizes(cycles), "Nodes verified per cycle: how large a subtree each policy chose, as a share "
                                         "of the policy's cycles over every trace, profile and cache size of the run.")
    cols = ["trace", "profile", "cache_experts", "policy", "predictor", "tokens_per_s", "tokens_per_cycle",
            "bytes_per_token", "hit_rate", "nodes_per_cycle", "draft_levels_per_cycle", "wasted_draft_levels",
            "speedup_vs_ar", "speedup_vs_eagle3"]
    page.table(summary[[c for c in cols if c in summary.columns]], caption="Summary per trace, profile, cache size and policy")
    quality = [c for c in ("union_precision", "union_recall", "union_mape", "miss_count_error", "miss_count_abs_error",
                           "predicted_tokens_per_cycle", "tokens_per_cycle", "tokens_bias", "time_mape", "time_bias")
               if c in summary.columns]
    if quality:
        page.table(summary[["trace", "profile", "cache_experts", "policy", "predictor", *quality]],
                   caption="Prediction quality: the expert predictor (union precision / recall, union-size MAPE, "
                           "miss-count error) and the acceptance estimate (predicted vs committed tokens per cycle). "
                           "MAPE: mean of |predicted - actual| / actual per cycle; bias: sum(predicted) / sum(actual) - 1. "
                           "The actual time is the cost model on the true union (the simulator's measurement).")


def _label(rows) -> str:
    """``static:auto`` with the tree size it picked at each cache size, in the bars' order
    (``N=16/6``), or once where every size picked the same."""
    sizes = [str(int(n)) for n in (row.get("static_n") for row in rows) if pd.notna(n)]
    if not sizes:
        return "static:auto"
    return f"static:auto (N={sizes[0] if len(set(sizes)) == 1 else '/'.join(sizes)})"


def _throughput_vs_cache(group: pd.DataFrame):
    fig, ax = new_axes()
    for policy, g in sorted(group.groupby("policy"), key=lambda kv: _policy_rank(kv[0])):
        g = g.sort_values("cache_experts")
        ax.plot(g["cache_experts"], g["tokens_per_s"], "o-", label=str(policy))
    ax.set(xlabel="cached experts per layer", ylabel="tokens / s")
    legend_outside(ax)
    return fig


def _tree_sizes(cycles: pd.DataFrame):
    fig, ax = new_axes()
    policies = sorted(cycles["policy"].unique(), key=_policy_rank)
    top = int(cycles["nodes_verified"].max())
    edges = np.unique(np.round(np.geomspace(1, max(top, 2) + 1, 16))) - 0.5
    for policy in policies:
        nodes = cycles.loc[cycles["policy"] == policy, "nodes_verified"]
        # each cycle weighs 1 / cycles: a bar is the share of the policy's cycles (density=True divided
        # it by the log-spaced bin's width: 58 nodes every cycle was drawn at 0.07)
        ax.hist(nodes, bins=edges, histtype="step", lw=1.5, label=str(policy),
                weights=np.full(len(nodes), 1 / len(nodes)))
    log_x(ax)
    ax.set(xlabel="nodes verified in a cycle", ylabel="share of cycles")
    legend_outside(ax)
    return fig
