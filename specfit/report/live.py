"""The live-run section: what ``specfit decode --out DIR`` measured, cycle by cycle."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.ticker import MaxNLocator

from ..accounting import read_cycles, summarise, waiting_note
from ..runtime.commands import raw_acceptance_notes
from .html import Page
from .plots import BAR_HANDLE, bars, identity_scatter, legend_outside, new_axes, policy_styles

__all__ = ["live_section"]


def live_section(page: Page, cycles: pd.DataFrame, name: str, summaries: list | None = None,
                 notes: list[str] = (), run_info: dict | None = None) -> None:
    """``name``: the run's directory; ``summaries``: its ``summary.json``; ``notes`` and
    ``run_info``: its ``run.json``'s notes and the rest of it."""
    page.heading(f"Live decoding: {name}")
    for note in notes:                       # what the run said its readers should know (e.g. that it stopped early)
        page.note(note)
    for note in _summary_notes(summaries or [], run_info or {}):
        page.note(note)
    cycles = read_cycles(cycles)
    policies = list(dict.fromkeys(cycles["policy"])) if "policy" in cycles else ["run"]
    if "policy" not in cycles:
        cycles = cycles.assign(policy="run")
    styles = page.policy_styles(policies)
    colors = page.policy_colors(policies)               # for the bars, which have no marker
    table = _per_policy(cycles)
    # two tables of a dozen columns or fewer, each whole on the page: one of twenty ran past its edge
    page.table(table[list(_TIME_COLUMNS)], percent=_SHARES, caption=(
        "Per policy: measured vs predicted time and tokens. tokens/s: committed tokens over the sum of measured cycle "
        "times (as in summary.json and the terminal), predicted: the predicted tokens over the sum of predicted cycle "
        "times; MAPE: mean over cycles of |predicted - measured| / measured; "
        "bias: sum(predicted) / sum(measured) - 1. Cycles waited for CPU: the share of cycles whose decoding "
        "thread spent over a tenth of the cycle not running (its wall time minus its CPU time: another process "
        "had the core; recorded on a CPU with one torch thread), which no prediction made before the cycle can "
        "foresee; time MAPE, others: the time MAPE over the remaining cycles (with most cycles waiting, not the "
        "model's alone either: the online model follows the machine's speed, waits included)."))
    page.table(table[[c for c in table.columns if c not in _TIME_COLUMNS or c == "policy"]], percent=_SHARES,
               caption="Per policy: host-to-device traffic, measured vs predicted, expert cache and trees. "
                       "MB H2D/cycle (predicted): the predicted misses and prefetches, as the terminal's KB H2D/cycle "
                       "in brackets; bytes MAPE: of each cycle's predicted bytes against the bytes moved, over the cycles that moved bytes; charged = "
                       "moved bytes: whether the bytes the cache bookkeeping charged the true experts are the bytes "
                       "moved, cycle by cycle (a prefetch's copies while drafting are on both sides: it checks the "
                       "verification pass's own copies); union MAPE: of the predicted expert union's size "
                       "against the experts the verified nodes routed to (per layer: each layer's); draft levels and "
                       "nodes verified: mean per cycle.")

    if cycles["predicted_time_s"].notna().any():
        fig = identity_scatter(cycles["measured_time_s"] * 1e3, cycles["predicted_time_s"] * 1e3, "measured cycle (ms)",
                               "predicted cycle (ms)", groups=cycles["policy"], group_styles=styles)
        page.figure(fig, "Predicted vs measured cycle time (draft + verify + learn), with the identity line.")

    fig, ax = new_axes(7.5, 3.4)
    for k, policy in enumerate(policies):
        g = cycles[cycles["policy"] == policy]
        marked = styles[policy].marked(len(g), k, len(policies))
        ax.plot(np.arange(len(g)), g["measured_time_s"] * 1e3, lw=1, ms=4, label=f"{policy} measured", **marked)
        if g["predicted_time_s"].notna().any():
            ax.plot(np.arange(len(g)), g["predicted_time_s"] * 1e3, lw=1, ms=4, ls="--", label=f"{policy} predicted",
                    **marked)
    ax.set(xlabel="cycle", ylabel="ms")
    ax.legend(fontsize=7, ncol=2)
    page.figure(fig, "Cycle time over the run.")
    errors = _errors_over_time(cycles, policies, styles)
    if errors is not None:
        page.figure(errors, f"Cycle-time error over the run: |predicted - measured| / measured, a rolling mean over "
                            f"{_ROLLING} cycles, of the profile's prediction (the prior, dashed) and of the model "
                            f"refitted online on the run's own cycles, which the policy decided with (solid). Each "
                            f"online prediction was made before its cycle was measured.")
    union = _union_per_layer(cycles, policies, styles)
    if union is not None:
        page.figure(union, "Expert union per layer, true (what the verified nodes routed to; filled) and predicted "
                           "(from the expert predictor; hollow, outlined), mean per cycle, each policy in its colour "
                           "and hatch; the union is what the cycle-time prediction prices.")

    if "bytes_h2d" in cycles:
        per = cycles.groupby("policy", sort=False).agg(bytes=("bytes_h2d", "sum"), tokens=("committed_tokens", "sum"))
        page.figure(bars(per.index, per["bytes"] / per["tokens"] / 1e6, "MB H2D / committed token",
                         [f"{b / 1e6:.3g} MB total" for b in per["bytes"]], colors=[colors[p] for p in per.index]),
                    "Host-to-device bytes per committed token, per policy.")
    heat = _layer_heat_map(cycles)
    if heat is not None:
        page.figure(heat, "Expert-cache misses per layer and policy (share of the layer's union that had to be copied).")

    fig, ax = new_axes()
    top = int(cycles["committed_tokens"].max())
    for policy in policies:
        counts = np.bincount(cycles.loc[cycles["policy"] == policy, "committed_tokens"], minlength=top + 1)[1:]
        # the lines lie on one another where shares are equal (at 0): each in its policy's line style too
        ax.plot(np.arange(1, top + 1), counts / max(counts.sum(), 1), label=str(policy), ls=styles[policy].linestyle,
                **styles[policy].marked(top))
    ax.set(xlabel="tokens committed in a cycle", ylabel="share of cycles")
    ax.legend(fontsize=8)
    page.figure(fig, "Committed tokens per cycle.")
    _stopping(page, cycles)
    online = _online_models(summaries or [])
    if online is not None:
        page.table(online, caption="The cost model each policy decided with at the end of the run (refitted online on "
                   "its own cycles). Its terms (ms); the fit's speed factor: the one factor it scaled a group of the "
                   "profile's terms by, where its cycles could not tell them apart; the speed tracker's factor on top "
                   "of the fit (the recent cycles' measured over fitted time, which multiplied every term of a "
                   "prediction); the drafter-pace slope; and the terms its cycles could not determine: the value each "
                   "is held at (the profile's, or the profile's times the fit's speed factor) and why.")


def _summary_notes(summaries: list, info: dict) -> list[str]:
    """The notes the terminal said after the run's tables, from its summaries: a policy whose
    thread waited for a CPU, and, for a greedy run that priced acceptance with the drafter's raw
    probabilities (``run.json``: no ``acceptance``, ``temperature`` 0; a run recorded before it said
    neither has none of these), a policy whose predicted tokens were far off or that ran below ar."""
    notes = [note for note in map(waiting_note, summaries) if note]
    # a run that stopped before its end: a policy cut short covers fewer prompts than the others
    short = [f"{s.get('policy', '?')} ({s.get('prompts', '?')} prompt(s) finished)" for s in summaries
             if isinstance(s, dict) and s.get("complete") is False]
    if short:
        notes.append("The run stopped before these policies finished: " + ", ".join(short) + "; their figures are over "
                     "the cycles they completed, and a comparison with another policy is over other prompts.")
    if "acceptance" in info and info["acceptance"] is None and info.get("temperature") == 0:
        notes += [note.removeprefix("note: ") for note in raw_acceptance_notes(summaries)]
    return notes


_TERMS = (("base_s", "base (ms)"), ("per_node_s", "per node (ms)"), ("hit_s", "hit (ms)"), ("miss_s", "miss (ms)"),
          ("draft_level_s", "per draft level (ms)"))


def _online_models(summaries: list) -> pd.DataFrame | None:
    """One row per policy whose summary has the online model's final state (``summary.json``)."""
    rows = []
    for summary in summaries:
        state = summary.get("online_model") if isinstance(summary, dict) else None
        if not isinstance(state, dict) or not isinstance(state.get("params"), dict):
            continue
        params = state["params"]
        held = state.get("held") or {}
        rows.append({
            "policy": summary.get("policy", "?"),
            **{label: 1e3 * float(params[name]) for name, label in _TERMS if name in params},
            "fit's speed factor (x profile)": float(state.get("speed_factor", float("nan"))),
            "tracked speed (x fit)": float(state.get("tracked_speed", float("nan"))),
            "pace slope": float(state.get("pace_slope", float("nan"))),
            "cycles (refits)": f"{state.get('cycles_seen', '?')} ({state.get('refits', '?')})",
            "held terms: at (why)": "; ".join(f"{term}: {h.get('at', '?')} ({h.get('reason', '')})"
                                              for term, h in held.items()) or "–",
        })
    return pd.DataFrame(rows) if rows else None


# the per-policy table's columns of the first table (time and tokens); the second has the rest
_TIME_COLUMNS = ("policy", "cycles", "tokens", "tokens/s (measured)", "tokens/s (predicted)", "tokens/cycle",
                 "pred. tokens/cycle", "time MAPE", "profile's time MAPE", "time bias",
                 "share of cycles that waited for CPU", "time MAPE, others")
# the per-policy table's columns of shares (errors, biases, the share of cycles that waited)
_SHARES = ("time MAPE", "profile's time MAPE", "time bias", "share of cycles that waited for CPU", "time MAPE, others",
           "bytes MAPE", "union MAPE", "union/layer MAPE")


def _per_policy(cycles: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for policy, g in cycles.groupby("policy", sort=False):
        s = summarise(g)
        rows.append({"policy": policy, "cycles": s["cycles"], "tokens": s["tokens"],
                     "tokens/s (measured)": s["tokens_per_s"],
                     "tokens/s (predicted)": (g["predicted_tokens"].sum() / g["predicted_time_s"].sum()
                                              if g["predicted_time_s"].notna().all() else np.nan),
                     "tokens/cycle": s["tokens_per_cycle"], "pred. tokens/cycle": s["predicted_tokens_per_cycle"],
                     "time MAPE": s["time_mape"], "profile's time MAPE": s.get("prior_time_mape", np.nan),
                     "time bias": s["time_bias"],
                     # the cycles whose thread waited for a CPU (another process had it) and the
                     # time error over the others (CPU runs with one thread; empty elsewhere)
                     "share of cycles that waited for CPU": s["waited_cycles"], "time MAPE, others": s["running_time_mape"],
                     "MB H2D/cycle (measured)": s["bytes_per_cycle"] / 1e6,
                     "MB H2D/cycle (predicted)": s["predicted_bytes_per_cycle"] / 1e6, "bytes MAPE": s["bytes_mape"],
                     "charged = moved bytes": _charged_matches(g), "hit rate": s["hit_rate"],
                     "union MAPE": s["union_mape"], "union/layer MAPE": s.get("union_layer_mape", np.nan),
                     "draft levels": s["draft_levels_per_cycle"], "nodes verified": s["nodes_per_cycle"]})
    return pd.DataFrame(rows)


_ROLLING = 16


def _charged_matches(g: pd.DataFrame) -> str:
    """Whether the bytes the cache bookkeeping gives the true experts are the bytes moved, per cycle."""
    if "charged_bytes_h2d" not in g or (g["charged_bytes_h2d"] < 0).all():
        return "-"
    known = g[g["charged_bytes_h2d"] >= 0]
    same = int((known["charged_bytes_h2d"] == known["bytes_h2d"]).sum())
    return "yes" if same == len(known) else f"{same} of {len(known)} cycles"


def _errors_over_time(cycles: pd.DataFrame, policies, styles: dict | None = None):
    if "prior_predicted_time_s" not in cycles or cycles["prior_predicted_time_s"].isna().all():
        return None
    styles = styles or policy_styles(policies)
    fig, ax = new_axes(7.5, 3.4)
    for k, policy in enumerate(policies):
        g = cycles[cycles["policy"] == policy]
        measured = g["measured_time_s"].to_numpy(dtype=float)
        for column, style in (("prior_predicted_time_s", "--"), ("online_predicted_time_s", "-")):
            predicted = g[column].to_numpy(dtype=float)
            if not np.isfinite(predicted).any():
                continue
            ape = pd.Series(np.abs(predicted - measured) / measured).rolling(_ROLLING, min_periods=1).mean()
            label = f"{policy} {'profile' if column.startswith('prior') else 'online'}"
            ax.plot(np.arange(len(g)), ape * 100, lw=1, ms=4, ls=style, label=label,
                    **styles[policy].marked(len(g), k, len(policies)))
    ax.set(xlabel="cycle of the policy", ylabel="rolling APE (%)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, ncol=2)
    return fig


def _union_per_layer(cycles: pd.DataFrame, policies, styles: dict | None = None):
    if "union_per_layer" not in cycles:
        return None
    styles = styles or policy_styles(policies)
    rows = {}
    for policy in policies:
        g = cycles[cycles["policy"] == policy]
        true = [u for u in g["union_per_layer"] if len(u)]
        predicted = [u for u in g["predicted_union_per_layer"] if len(u)]
        if true and predicted and len(true) == len(predicted):
            rows[policy] = (np.mean(np.stack(predicted), axis=0), np.mean(np.stack(true), axis=0))
    if not rows:
        return None
    fig, ax = new_axes(7.5, 3.4)
    n_layers = len(next(iter(rows.values()))[1])
    width = 0.8 / (2 * len(rows))
    x = np.arange(n_layers)
    # each policy its hatch; true filled in its colour (the hatch in white), predicted hollow (the
    # hatch and outline in its colour): the bars were told apart by colour alone, and predicted
    # from true by a hatch all policies shared, so a greyscale print matched a bar to nothing
    for i, (policy, (predicted, true)) in enumerate(rows.items()):
        pos = x - 0.4 + width * (2 * i + 0.5)
        style = styles[policy]
        ax.bar(pos, true, width=width * 0.95, label=f"{policy} true", color=style.color, hatch=style.hatch,
               edgecolor="white")
        ax.bar(pos + width, predicted, width=width * 0.95, color="white", hatch=style.hatch, edgecolor=style.color,
               label=f"{policy} predicted")
    ax.set(xlabel="layer", ylabel="experts in the union per cycle")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    legend_outside(ax, fontsize=7, **BAR_HANDLE)       # inside, it sat on the tallest layers' bars
    return fig


def _layer_heat_map(cycles: pd.DataFrame):
    if "misses_per_layer" not in cycles or "hits_per_layer" not in cycles:
        return None
    policies, rows = [], []
    for policy in dict.fromkeys(cycles["policy"]):
        g = cycles[cycles["policy"] == policy]
        misses = np.sum(np.stack(g["misses_per_layer"].to_numpy()), axis=0)
        hits = np.sum(np.stack(g["hits_per_layer"].to_numpy()), axis=0)
        if misses.size:                     # a run recorded before the per-layer columns has none
            policies.append(policy)
            rows.append(misses / np.maximum(misses + hits, 1))
    if not rows:
        return None
    fig, ax = new_axes(7.5, 0.6 + 0.45 * len(policies))
    im = ax.imshow(np.array(rows), aspect="auto", cmap="magma", vmin=0, vmax=1)
    ax.set_yticks(range(len(policies)), policies)
    ax.set(xlabel="layer")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(False)
    fig.colorbar(im, ax=ax, label="miss share")
    return fig


def _stopping(page: Page, cycles: pd.DataFrame) -> None:
    """Where SpecFit stopped drafting earlier than EAGLE-3 did, and what that saved or cost."""
    names = list(dict.fromkeys(cycles["policy"]))

    def plain_or_first(base: str):
        # the plain policy where the run has it, else its first variant in the run's order (not a
        # set's, whose order changes from one process to the next: the page compared another tree
        # each time); a sampled run's SpecFit is specfit+online
        return base if base in names else next((p for p in names if str(p).startswith(base)), None)

    eagle, ours = plain_or_first("eagle3"), plain_or_first("specfit")
    if ours is None or eagle is None or "draft_levels" not in cycles:
        return
    s, e = cycles[cycles["policy"] == ours], cycles[cycles["policy"] == eagle]
    depth = int(e["draft_levels"].max())
    earlier = s["draft_levels"] < depth
    per_level = (e["draft_time_s"].sum() / max(e["draft_levels"].sum(), 1)) if "draft_time_s" in e else np.nan
    facts = {
        f"cycles where {ours} drafted fewer levels than {eagle} ({depth})": f"{earlier.mean():.0%} of {len(s)}",
        f"mean draft levels ({ours} / {eagle})": f"{s['draft_levels'].mean():.2f} / {e['draft_levels'].mean():.2f}",
        "draft time saved per cycle (measured)": (f"{(e['draft_time_s'].mean() - s['draft_time_s'].mean()) * 1e3:.3g} ms"
                                                  if "draft_time_s" in s else "–"),
        f"measured time of one draft level ({eagle}'s: drafter pass, expert predictions, decision)":
            f"{per_level * 1e3:.3g} ms" if np.isfinite(per_level) else "–",
        f"tokens per cycle ({ours} / {eagle})": f"{s['committed_tokens'].mean():.2f} / {e['committed_tokens'].mean():.2f}",
        f"tokens per second ({ours} / {eagle})": f"{s['committed_tokens'].sum() / s['time_s'].sum():.3g} / "
                                                f"{e['committed_tokens'].sum() / e['time_s'].sum():.3g}",
    }
    page.heading("Early stopping: SpecFit vs EAGLE-3", level=3)
    page.facts(facts)
    colors = page.policy_colors([ours, eagle])
    fig, ax = new_axes()
    top = int(max(s["draft_levels"].max(), depth))
    # left to right as the legend reads top to bottom, and each bar hatched as its entry: colour is not all
    for (label, g), offset, hatch in (((eagle, e), -0.2, "//"), ((ours, s), 0.2, "")):
        counts = np.bincount(g["draft_levels"], minlength=top + 1)
        ax.bar(np.arange(top + 1) + offset, counts / counts.sum(), width=0.4, label=label, color=colors[label],
               hatch=hatch, edgecolor="white")
    ax.set(xlabel="draft levels in a cycle", ylabel="share of cycles")
    ax.legend()
    page.figure(fig, f"Draft levels per cycle ({eagle} left, hatched; {ours} right): SpecFit stops when another level "
                     f"does not pay for itself.")
