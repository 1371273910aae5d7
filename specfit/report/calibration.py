"""The calibration section: a profile's probe data against its fitted model."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..calibrate.fit import at_bound_text
from ..calibrate.profile import Profile, held_out_unit
from ..calibrate.repeat import rounds_text
from .html import Page
from .plots import POLICY_PALETTE, identity_scatter, log_x, new_axes

__all__ = ["calibration_section"]


def calibration_section(page: Page, profile: Profile, name: str) -> None:
    page.heading(f"Calibration: {name}")
    fit = profile.fit
    held = fit.get("holdout") or {}
    page.facts({
        "kind": profile.kind,
        "source": profile.source,
        "machine": f"{profile.machine.get('device_name', '?')} on {profile.machine.get('host', '?')} "
                   f"(torch {profile.machine.get('torch', '?')})",
        "model shape": f"{profile.shape.name}: {profile.shape.n_layers} layers, {profile.shape.n_experts} experts, "
                       f"top-{profile.shape.top_k}, {profile.shape.expert_bytes:,} B per expert",
        "held-out cycle-time error": f"MAPE {held.get('mape', float('nan')):.1%}, max {held.get('max_ape', float('nan')):.1%} "
                                     f"over {held.get('n', 0)} {held_out_unit(fit)}" if held else "not measured",
        "created": profile.created,
    })
    if profile.kind == "preset":
        page.paragraph("A preset derived from published hardware numbers, not a measurement of a machine.", "note")
    noise = fit.get("probe_noise") or {}
    if noise or fit.get("held"):
        facts = {}
        if noise:
            share = noise.get("cpu_share")
            facts["probe rounds"] = (rounds_text(noise) + f"; spread (max - min) / median {noise['spread_median']:.1%} median, "
                                     f"{noise['spread_p90']:.1%} p90" + (f"; CPU share {share:.0%}" if share is not None else "")
                                     + f"; the machine's load average {noise.get('load_average', float('nan')):.1f} "
                                       f"over its {noise.get('cpu_count')} cores, whatever cores the probes ran on")
        if "fitted" in fit:
            facts["fitted from the data"] = ", ".join(fit["fitted"]) or "-"
        for name, prior in (fit.get("at_bound") or {}).items():
            facts[f"at its bound: {name}"] = at_bound_text(prior)
        for name, term in (fit.get("held") or {}).items():
            facts[f"held: {name}"] = f"{term['value']:.4g} s ({term['at']}): {term['reason']}"
        page.facts(facts)
    for warning in fit.get("warnings") or ():
        page.paragraph(f"Warning: {warning}", "note")
    params = pd.DataFrame({"parameter": list(profile.cost.to_dict()), "value": list(profile.cost.to_dict().values())})
    page.table(params, caption="Fitted cost model (seconds; expert_bytes in bytes)")
    probes = profile.probes
    if probes.get("h2d"):
        _h2d(page, pd.DataFrame(probes["h2d"]), fit)
    if probes.get("expert_compute"):
        df = pd.DataFrame(probes["expert_compute"])
        fig, ax = new_axes()
        ax.plot(df["tokens"], df["seconds"] * 1e6, "o-")
        label, said = _term_status(fit, "hit_s")
        ax.axhline(profile.cost.hit_s * 1e6, ls="--", color="grey",
                   label=f"hit_s = {profile.cost.hit_s * 1e6:.3g} µs" + (f", {label}" if label else ""))
        log_x(ax)
        ax.set(xlabel="tokens through one resident expert", ylabel="µs")
        ax.legend()
        page.figure(fig, "Cache-hit latency: one resident expert run on 1..N tokens (median of repeats); dashed: "
                         f"the profile's hit_s, {said}.")
    if probes.get("cycles"):
        _cycles(page, pd.DataFrame(probes["cycles"]), refitted=bool(fit.get("refit")))
    if probes.get("draft"):
        page.table(pd.DataFrame(probes["draft"]).assign(ms=lambda d: d["seconds"] * 1e3).drop(columns="seconds"),
                   caption="Draft level time by frontier width")
    if "refit" in fit:
        _refit(page, fit["refit"])


def _term_status(fit: dict, name: str) -> tuple[str, str]:
    """How a profile came by its term ``name``: (a legend's few words, "" where the profile does not
    say, and a caption's part of a sentence)."""
    held = (fit.get("held") or {}).get(name)
    if held:
        return f"held at {held['at']}", f"held at {held['at']}, not fitted: {held['reason']}"
    if name in (fit.get("fitted") or ()):
        fitted = f"fitted on the {held_out_unit(fit)}"
        return fitted, f"{fitted}, not on these points"
    return "", "as the profile holds it"


# pinned (or a host copy's one kind) and pageable: colour, marker, the fit's line style
_H2D_LOOK = {True: (POLICY_PALETTE[0], "o", "-"), False: (POLICY_PALETTE[1], "s", "--")}


def _h2d(page: Page, df: pd.DataFrame, fit: dict) -> None:
    fig, ax = new_axes()
    fitted = False
    one_kind = len(df["pinned"].unique()) == 1
    for pinned, group in df.groupby("pinned"):
        label = "pinned" if pinned else ("host copy" if one_kind else "pageable")
        # each kind its colour, marker and line style, its fit in its own: the two kinds' points were
        # one marker, told apart by colour alone, and each fit another colour than its points
        color, marker, linestyle = _H2D_LOOK[bool(pinned) or one_kind]
        ax.plot(group["bytes"] / 1e6, group["seconds"] * 1e3, ls="none", color=color, marker=marker, label=label)
        line = fit.get("h2d") if (pinned or one_kind) else fit.get("h2d_pageable")
        if line and np.isfinite(line.get("gbps", np.nan)) and line["gbps"] > 0:
            x = np.linspace(0, group["bytes"].max(), 50)
            ax.plot(x / 1e6, (line["overhead_s"] + x / (line["gbps"] * 1e9)) * 1e3, color=color, ls=linestyle,
                    label=f"fit: {line['gbps']:.3g} GB/s + {line['overhead_s'] * 1e6:.3g} µs")
            fitted = True
    ax.set(xlabel="MB per copy", ylabel="ms")
    ax.legend()
    page.figure(fig, "Host-to-device transfers of 1..k experts over sizes around one expert, " + (
        "with the fitted bandwidth and per-copy overhead." if fitted else
        "as probed; this profile holds no fit of them" + (" (a refit on decode cycles fits the cycle-time terms, "
                                                          "not the copies)." if fit.get("refit") else ".")))


def _cycles(page: Page, df: pd.DataFrame, refitted: bool = False) -> None:
    """The calibration's timed passes against its fit's predictions (recorded with the probes); a
    refitted profile's terms came from decode cycles since, which hold the decoder's own work, so
    its figures say whose predictions these are."""
    if "predicted_s" not in df:
        return
    fig = identity_scatter(df["seconds"] * 1e3, df["predicted_s"] * 1e3, "measured pass (ms)", "predicted (ms)",
                           color=df["capacity"], color_label="cache slots / layer")
    whose = (" Predicted by the calibration's own fit, before the refit: the refitted terms (above) were "
             "fitted on decode cycles, which hold the decoder's work around the passes too." if refitted else "")
    page.figure(fig, "Verification passes over random trees at several cache sizes: predicted vs measured, "
                     "with the identity line." + whose)
    fig, ax = new_axes()
    rel = (df["predicted_s"] - df["seconds"]) / df["seconds"] * 100
    ax.scatter(df["n_nodes"], rel, s=14, alpha=0.7)
    ax.axhline(0, color="grey", lw=1)
    ax.set(xlabel="nodes in the pass", ylabel="residual (% of measured)")
    page.figure(fig, "Residuals of the fit by node count.")


def _refit(page: Page, comparison: dict) -> None:
    rows = []
    for label in ("before", "after"):
        e = comparison[label]
        rows.append({"": f"{label} refit", "held-out MAPE": e["mape"], "max APE": e["max_ape"],
                     "max abs. error (s)": e.get("max_abs_err", e.get("max_abs_err_s")), "cycles": e["n"]})
    # the errors as percentages, as the facts above and the terminal's refit table write them
    page.table(pd.DataFrame(rows), percent=("held-out MAPE", "max APE"),
               caption=f"Refit on {comparison['n_cycles']} decode cycles (same held-out cycles)")
