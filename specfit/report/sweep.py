"""The sweep and plan sections: what ``specfit sweep`` and ``specfit plan`` wrote, as figures.

A sweep is shown as heat maps of tokens/s over (expert-cache size x host-link bandwidth), one
panel per policy and one figure per trace, on one colour scale so the panels compare; where other
axes of the grid vary too (predictor, eviction policy, ...), each square shows the best of them.
A panel small enough to read prints each square's tokens/s in it.
A plan adds its frontier: the best tokens/s reachable with a given device memory.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from ..simulate.dataset import LAYER_AHEAD_COLUMNS, LAYER_AHEAD_ROWS, layer_ahead_wide
from .html import Page
from .plots import new_axes, policy_styles
from .simulation import _policy_rank, cache_unit

__all__ = ["sweep_section", "plan_section", "heat_map_grid", "frontier"]

# a panel with more squares than this shows colours only (a number in each would be unreadable,
# and a grid of tens of thousands of cells made the page megabytes of glyphs); its ticks are thinned
# to about MAX_TICKS per axis
LABELLED_SQUARES = 150
MAX_TICKS = 16

# axes of a grid besides trace, policy, cache size and link speed
_OTHER_AXES = ("drafter", "profile_source", "cost_overrides", "cache_mode", "cache_policy", "predictor", "acceptance",
               "max_levels", "price_uncertainty", "layer_ahead")


def heat_map_grid(results: pd.DataFrame, trace: str) -> tuple[Figure, list[str]] | None:
    """Tokens/s of ``trace``'s cells, one panel per policy: rows cache sizes, columns link
    bandwidths. Returns the figure and the axes the squares take the best over (None when the
    grid has a single cache size and link speed: nothing to map)."""
    g = results[results["trace"] == trace]
    caches = sorted(g["cache_experts"].unique())
    links = sorted(g["link_gbps"].unique())
    if len(caches) < 2 and len(links) < 2:
        return None
    squares = g.groupby(["policy", "cache_experts", "link_gbps"])
    # an axis matters to a square when the square's cells differ in it (a profile that sets the
    # link speed does not)
    # (the layer-ahead what-if changes no cell's tokens/s: its cells are the same squares)
    varying = [a for a in _OTHER_AXES if a in g and a != "layer_ahead"
               and squares[a].agg(lambda v: v.astype(str).nunique()).max() > 1]
    best = squares["tokens_per_s"].max()
    policies = sorted(g["policy"].unique(), key=_policy_rank)
    cols = min(len(policies), 3)
    rows = math.ceil(len(policies) / cols)
    fig = Figure(figsize=(3.3 * cols + 1.2, 0.6 + (0.35 * len(caches) + 1.3) * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    vmin, vmax = float(best.min()), float(best.max())
    image = None
    for ax, policy in zip(axes.flat, policies):
        grid = np.full((len(caches), len(links)), np.nan)
        for (c, link), value in best[policy].items():
            grid[caches.index(c), links.index(link)] = value
        image = ax.imshow(grid, aspect="auto", origin="lower", cmap="viridis", vmin=vmin, vmax=vmax)
        if grid.size <= LABELLED_SQUARES:
            for i in range(len(caches)):
                for j in range(len(links)):
                    if np.isfinite(grid[i, j]):
                        ax.text(j, i, f"{grid[i, j]:.3g}", ha="center", va="center", fontsize=7,
                                color="white" if grid[i, j] < (vmin + vmax) / 2 else "black")
        x, y = _ticks(len(links)), _ticks(len(caches))
        ax.set_xticks(x, [f"{links[j]:.4g}" for j in x], fontsize=7)
        ax.set_yticks(y, [str(caches[i]) for i in y], fontsize=7)
        ax.set_title(str(policy), fontsize=9)
        ax.set_xlabel("link GB/s", fontsize=8)
        ax.set_ylabel("cached experts", fontsize=8)
    for ax in list(axes.flat)[len(policies):]:
        ax.set_visible(False)
    fig.colorbar(image, ax=axes.ravel().tolist(), label="tokens / s")
    return fig, varying


def _ticks(n: int) -> list[int]:
    """Every square's index up to :data:`MAX_TICKS` of them, else every k-th (the last included)."""
    step = math.ceil(n / MAX_TICKS)
    return sorted({*range(0, n, step), n - 1})


def frontier(settings: pd.DataFrame, budget_bytes: float, best: dict, styles: dict | None = None):
    """Tokens/s vs device memory for every setting the plan ran, with the frontier (the best
    tokens/s within each memory size) and the budget; each policy (its name before a ':') in its
    colour and marker of ``styles``, by default one of its own."""
    fig, ax = new_axes(7.0, 4.0)
    heads = settings["policy"].str.split(":").str[0]
    names = _heads(settings)
    styles = styles or policy_styles(names)
    for head in names:
        s = settings[heads == head]
        ax.scatter(s["device_bytes"] / 1e9, s["tokens_per_s"], s=18, label=head, alpha=0.8, color=styles[head].color,
                   marker=styles[head].marker)
    order = settings.sort_values(["device_bytes", "tokens_per_s"], ascending=[True, False])
    running = np.maximum.accumulate(order["tokens_per_s"].to_numpy())
    ax.step(order["device_bytes"] / 1e9, running, where="post", color="black", lw=1.2, label="frontier")
    ax.axvline(budget_bytes / 1e9, color="#c03030", ls="--", lw=1, label="budget")
    ax.scatter([best["device_bytes"] / 1e9], [best["tokens_per_s"]], s=120, facecolors="none", edgecolors="#c03030",
               lw=1.5, label="recommended")
    ax.set(xlabel="device memory (GB)", ylabel="tokens / s")
    ax.legend(fontsize=7, ncol=2)
    return fig


def _heads(settings: pd.DataFrame) -> list[str]:
    """The policies of a plan's settings, each once: their names before a ':' (static:8's static)."""
    return sorted(settings["policy"].str.split(":").str[0].unique(), key=_policy_rank)


def sweep_section(page: Page, results: pd.DataFrame, name: str, spec: dict | None = None) -> None:
    page.heading(f"Sweep: {name}")
    if results.empty:
        page.paragraph("No cell of this sweep has finished yet.", css="note")
        return
    total = len((spec or {}).get("cells", [])) or len(results)
    page.facts({"cells finished": f"{len(results)} of {total}", "traces": ", ".join(sorted(results["trace"].unique())),
                "profiles": ", ".join(dict.fromkeys(results["profile"])),
                "policies": ", ".join(sorted(results["policy"].unique(), key=_policy_rank)),
                "replay time (sum)": f"{results['replay_s'].sum():.1f} s" if "replay_s" in results else "–"})
    _missing_cells(page, results, (spec or {}).get("cells") or [])
    for trace in dict.fromkeys(results["trace"]):
        made = heat_map_grid(results, trace)
        if made is None:
            continue
        fig, varying = made
        note = f"; each square is the best over {', '.join(varying)}" if varying else ""
        unit = cache_unit(results[results["trace"] == trace])
        page.figure(fig, f"{trace}: committed tokens per second by expert-cache size (experts {unit}) and "
                         f"host-to-device bandwidth, per policy{note}.")
    wide, ahead = layer_ahead_wide(results)
    cols = ["trace", "profile", "link_gbps", "cache_experts", "policy", *[a for a in _OTHER_AXES if a in wide
            and wide[a].astype(str).nunique() > 1 and a != "profile_source"], "tokens_per_s", "speedup_vs_ar",
            "hit_rate", "nodes_per_cycle", "bytes_per_token", *ahead]
    top = wide.sort_values("tokens_per_s", ascending=False, kind="stable").head(20)
    page.table(top[[c for c in dict.fromkeys(cols) if c in top]],
               caption=f"The 20 fastest {LAYER_AHEAD_ROWS}. {LAYER_AHEAD_COLUMNS}" if ahead else "The 20 fastest cells")


def _missing_cells(page: Page, results: pd.DataFrame, cells: list) -> None:
    """Which cells of the grid (``sweep.json``'s) have no result yet: per trace, profile source,
    bandwidth factor and policy, the cache sizes missing (a resume of the same command replays
    them)."""
    done = set(results["cell_id"]) if "cell_id" in results else set()
    missing = pd.DataFrame([c for c in cells if isinstance(c, dict) and c.get("cell_id") not in done])
    # and every other axis of the grid that varies (a predictor, a cache mode...): cells apart on it stay apart
    grid = pd.DataFrame([c for c in cells if isinstance(c, dict)])
    keys = [k for k in ("trace", "profile_source", "h2d_scale", "policy") if k in missing]
    keys += [k for k in _OTHER_AXES if k in missing and k not in keys and k != "profile_source"
             and grid[k].astype(str).nunique() > 1]
    if missing.empty or not keys or "cache_experts" not in missing:
        return
    table = (missing.groupby(keys, sort=False)["cache_experts"]
             .agg(lambda sizes: ", ".join(map(str, sorted(set(sizes))))).reset_index()
             .rename(columns={"profile_source": "profile", "h2d_scale": "link x", "cache_experts": "cache sizes missing"}))
    page.table(table.head(_MISSING_ROWS), caption=(
        f"The {len(missing)} cells of the grid with no result yet" + (f" (the first {_MISSING_ROWS} of {len(table)} "
                                                                          "groups)" if len(table) > _MISSING_ROWS else "")
        + ": the same sweep command, run again, replays them"))


_MISSING_ROWS = 30


def plan_section(page: Page, plan: dict, name: str) -> None:
    page.heading(f"Plan: {name}")
    mem, best = plan["memory"], plan["best"]
    page.paragraph(f"{mem['model']} in {mem['device_bytes'] / 1e9:g} GB of device memory: dense weights "
                   f"{mem['dense_bytes'] / 1e9:.2f} GB, KV cache {mem['kv_bytes_per_token'] * mem['context_tokens'] / 1e9:.2f}"
                   f" GB for {mem['context_tokens']} tokens, "
                   + (f"the prompt's pass ({mem['prompt_tokens']} tokens"
                      + (f" in chunks of {mem['prefill_chunk']}" if mem.get("prefill_chunk") else "")
                      + f") {mem['prompt_pass_bytes'] / 1e9:.2f} GB, a "
                      f"drafter {mem['drafter_bytes'] / 1e9:.2f} GB, " if "prompt_pass_bytes" in mem else "")
                   + f"reserve {mem['reserve_bytes'] / 1e9:.2f} GB, one cached "
                   f"expert per layer {mem['slot_bytes'] / 1e9:.3f} GB. Recommended: {best['policy']} with "
                   f"{best['cache_experts']} cached experts per layer, {best['tokens_per_s']:.2f} tokens/s predicted "
                   f"on {', '.join(plan['traces'])} ({plan['profile']}).")
    settings = pd.DataFrame(plan["settings"])
    page.figure(frontier(settings, mem["device_bytes"], best, page.policy_styles(_heads(settings))),
                "Every candidate setting (policy x expert-cache size): predicted tokens/s against the device memory it "
                "needs; the line is the best reachable within each memory size, the dashed line the budget.")
    table = pd.DataFrame([best, *plan["runners_up"]])
    table.insert(0, "rank", ["best", *[f"#{i + 2}" for i in range(len(table) - 1)]])
    for col in ("device_bytes", "expert_cache_bytes", "kv_bytes"):
        table[col.replace("_bytes", " GB")] = table[col] / 1e9
    page.table(table[["rank", "policy", "cache_experts", "tokens_per_s", "speedup_vs_ar", "tree_tokens", "device GB",
                      "expert_cache GB", "kv GB"]], caption="The recommendation and the runners-up, with their memory")
