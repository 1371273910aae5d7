"""The report's pieces on their own: escaping in the page, the live section's heat map, rates and early stopping, the calibration figure, grouped bars."""

from __future__ import annotations

import html
import re

import numpy as np
import pandas as pd
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from specfit.accounting import read_cycles
from specfit import CostModel
from specfit.calibrate.profile import ModelShape, Profile
from specfit.report.calibration import _h2d, calibration_section
from specfit.report.build import classify
from specfit.report.html import Page
from specfit.report.live import _layer_heat_map, _per_policy, _stopping, live_section
from specfit.report.plots import bars, grouped_bars, policy_styles
from specfit.report.simulation import _throughput_vs_cache, _tree_sizes, simulation_section

EVIL = '<script>alert("x")</script>&'


class _Figures(Page):
    """A page that keeps its figures as figures, to look into them."""

    def figure(self, fig, caption: str = ""):
        self.parts.append(fig)
        return self


def test_page_heading_text_is_escaped_in_the_heading_and_the_navigation():
    page = Page(title="t").heading(EVIL)
    text = page.render()
    assert "<script>" not in text
    assert text.count("&lt;script&gt;alert(") == 2          # the heading and its nav link


def test_page_facts_escape_labels_and_values():
    text = Page(title="t").facts({EVIL: EVIL}).render()
    assert "<script>" not in text
    assert text.count("&lt;script&gt;alert(") == 2


def test_page_table_cells_are_escaped():
    text = Page(title="t").table(pd.DataFrame({"name": [EVIL], EVIL: [1.0]})).render()
    assert "<script>" not in text
    assert text.count("&lt;script&gt;alert(") == 2


def test_page_bias_columns_are_signed_percentages_and_other_shares_unsigned():
    df = pd.DataFrame({"time bias": [0.031, -0.02], "time MAPE": [0.031, 0.02]})
    text = Page(title="t").table(df, percent=("time bias", "time MAPE")).render()
    assert "+3.1%" in text and "-2.0%" in text
    assert ">3.1%<" in text and ">2.0%<" in text and "+2.0%" not in text


def _rows(policy, levels, n=4, predicted=True):
    return [{"policy": policy, "cycle": i, "draft_levels": int(lv), "nodes_verified": 1 + int(lv), "hits": 10,
             "misses": 5, "bytes_h2d": 5000, "cycle_time_s": 0.01, "predicted_time_s": 0.0105 if predicted else np.nan,
             "draft_time_s": 0.002 * int(lv), "predicted_tokens": 1.5, "committed_tokens": 2}
            for i, lv in zip(range(n), levels)]


def test_live_heat_map_shows_the_share_of_each_layers_union_that_missed():
    cycles = pd.DataFrame({"policy": ["a", "a", "b"],
                           "misses_per_layer": [np.array([1, 0, 3]), np.array([1, 2, 0]), np.array([0, 4, 4])],
                           "hits_per_layer": [np.array([3, 2, 1]), np.array([3, 0, 0]), np.array([4, 0, 4])]})
    fig = _layer_heat_map(cycles)
    shares = np.asarray(fig.axes[0].images[0].get_array())
    np.testing.assert_allclose(shares, [[2 / 8, 2 / 4, 3 / 4], [0.0, 1.0, 0.5]])


def test_live_per_policy_predicted_rate_is_missing_when_some_cycles_were_not_predicted():
    rows = _rows("ar", [0] * 4)
    rows[1]["predicted_time_s"] = np.nan
    table = _per_policy(read_cycles(pd.DataFrame(rows + _rows("b", [0] * 4))))
    assert np.isnan(table.loc[0, "tokens/s (predicted)"])
    assert table.loc[1, "tokens/s (predicted)"] == 1.5 / 0.0105


def test_live_early_stopping_counts_only_cycles_with_fewer_levels_than_eagle3():
    cycles = read_cycles(pd.DataFrame(_rows("specfit", [4, 4, 2, 2]) + _rows("eagle3", [4, 4, 4, 4])))
    page = Page(title="t")
    _stopping(page, cycles)
    text = page.render()
    assert "cycles where specfit drafted fewer levels than eagle3 (4)</th><td>50% of 4</td>" in text


def test_early_stoppings_bars_read_as_their_legend_and_not_by_colour_alone():
    """eagle3's bars on the left are its legend's first entry, hatched; specfit's on the right plain
    (the legend listed specfit first, over bars told apart by colour alone)."""
    page = _Figures(title="t")
    _stopping(page, read_cycles(pd.DataFrame(_rows("specfit", [4, 4, 2, 2]) + _rows("eagle3", [4, 4, 4, 4]))))
    ax = page.parts[-1].axes[0]
    handles, labels = ax.get_legend_handles_labels()
    assert labels == ["eagle3", "specfit"]
    (left, right) = (bars.patches for bars in handles)
    assert all(p.get_x() < q.get_x() for p, q in zip(left, right))
    assert {p.get_hatch() for p in left} == {"//"} and not any(p.get_hatch() for p in right)


def test_calibration_h2d_figure_draws_each_memory_kind_with_its_own_fit():
    rows = [{"bytes": b, "pinned": p, "seconds": (1e-5 + b / 20e9) if p else (3e-5 + b / 5e9)}
            for p in (True, False) for b in (1e6, 2e6, 4e6)]
    fit = {"h2d": {"gbps": 20.0, "overhead_s": 1e-5}, "h2d_pageable": {"gbps": 5.0, "overhead_s": 3e-5}}
    page = _Figures(title="t")
    _h2d(page, pd.DataFrame(rows), fit)
    _, labels = page.parts[0].axes[0].get_legend_handles_labels()
    assert "fit: 20 GB/s + 10 µs" in labels
    assert "fit: 5 GB/s + 30 µs" in labels
    assert "pinned" in labels and "pageable" in labels


def test_grouped_bars_center_each_labels_series_on_its_tick():
    fig = grouped_bars(["a", "b", "c"], {"x": [1, 2, 3], "y": [3, 2, 1]}, "v")
    ax = fig.axes[0]
    centres = np.array([p.get_x() + p.get_width() / 2 for p in ax.patches]).reshape(2, 3)   # [series, label]
    np.testing.assert_allclose(centres.mean(axis=0), ax.get_xticks(), atol=1e-9)
    np.testing.assert_allclose(centres[0], np.arange(3) - 0.2, atol=1e-9)
    np.testing.assert_allclose(centres[1], np.arange(3) + 0.2, atol=1e-9)


def _bar_series(ax) -> list[tuple[str, tuple, str, bool]]:
    """Each bar series of ``ax`` as its legend names it: (label, colour, hatch, filled), one look
    for all its bars, and the legend's patch drawn in that look."""
    handles, labels = ax.get_legend_handles_labels()
    series = []
    for label, bars, shown in zip(labels, handles, ax.get_legend().get_patches()):
        looks = {(tuple(p.get_facecolor()), p.get_hatch() or "") for p in bars.patches}
        assert len(looks) == 1, label
        (face, hatch), = looks
        assert (tuple(shown.get_facecolor()), shown.get_hatch() or "") == (face, hatch), label
        series.append((label, face, hatch, face[:3] != (1.0, 1.0, 1.0)))
    return series


def test_grouped_bars_tell_their_series_apart_by_hatch_as_well_as_colour():
    """A greyscale print or a reader who cannot tell the colours apart had the cache sizes' bars by
    colour alone: each series its own hatch too (the first six all different), and no two of a
    figure's series one colour and one hatch."""
    for n in (2, 6, 14):
        fig = grouped_bars(["ar", "specfit"], {f"{c} cached": [1.0 + c, 2.0] for c in range(n)}, "tokens / s")
        series = _bar_series(fig.axes[0])
        assert len(series) == n
        assert len({hatch for _, _, hatch, _ in series[:6]}) == min(n, 6)
        assert len({(face, hatch) for _, face, hatch, _ in series}) == n


def test_union_per_layer_bars_read_in_greyscale_policy_by_hatch_true_filled_predicted_hollow():
    """The policies' bars were told apart by colour alone and predicted from true by one hatch all
    shared: each policy has its hatch on both its bars, its true bars filled and its predicted
    ones hollow, so no two series look alike without their colours."""
    from specfit.report.live import _union_per_layer

    policies = ["ar", "chain:2", "eagle3", "specfit"]
    cycles = pd.DataFrame([{"policy": p, "union_per_layer": [4 + k, 5], "predicted_union_per_layer": [5, 4 + k]}
                           for k, p in enumerate(policies) for _ in range(2)])
    series = _bar_series(_union_per_layer(cycles, policies).axes[0])
    assert [label for label, *_ in series] == [f"{p} {kind}" for p in policies for kind in ("true", "predicted")]
    assert len({(hatch, filled) for _, _, hatch, filled in series}) == len(series)
    for (_, _, true_hatch, true_filled), (_, _, predicted_hatch, predicted_filled) in zip(series[::2], series[1::2]):
        assert true_hatch == predicted_hatch and true_filled and not predicted_filled


def test_calibration_h2d_figure_marks_pinned_and_pageable_points_apart_each_fit_in_its_kinds_colour():
    """Both kinds' points were circles, told apart by colour alone (and each fit line a third and a
    fourth colour): each kind its marker, and its fit its colour and its own line style."""
    rows = [{"bytes": b, "pinned": p, "seconds": (1e-5 + b / 20e9) if p else (3e-5 + b / 5e9)}
            for p in (True, False) for b in (1e6, 2e6, 4e6)]
    fit = {"h2d": {"gbps": 20.0, "overhead_s": 1e-5}, "h2d_pageable": {"gbps": 5.0, "overhead_s": 3e-5}}
    page = _Figures(title="t")
    _h2d(page, pd.DataFrame(rows), fit)
    lines = dict(zip(*reversed(page.parts[0].axes[0].get_legend_handles_labels())))
    pinned, pageable = lines["pinned"], lines["pageable"]
    assert pinned.get_marker() != pageable.get_marker()
    for points, line in ((pinned, lines["fit: 20 GB/s + 10 µs"]), (pageable, lines["fit: 5 GB/s + 30 µs"])):
        assert line.get_color() == points.get_color()
    assert lines["fit: 20 GB/s + 10 µs"].get_linestyle() != lines["fit: 5 GB/s + 30 µs"].get_linestyle()


# a decode table with some cycles unmeasured is still a decode (any measured cycle says so)
def test_a_cycle_table_with_one_measured_cycle_is_a_live_run(tmp_path):
    pd.DataFrame({"measured_time_s": [0.1, np.nan, 0.2]}).to_parquet(tmp_path / "cycles.parquet")
    assert classify(tmp_path) == ["live"]


# two cache sizes are enough for the throughput-vs-cache figure
def test_two_cache_sizes_draw_the_throughput_vs_cache_figure():
    rows = [{"trace": "t", "profile": "pcie4", "cache_experts": c, "policy": p, "tokens_per_s": tps,
             "speedup_vs_ar": tps / base, "bytes_per_token": 1e6}
            for c, base in ((0, 10.0), (16, 20.0)) for p, tps in (("ar", base), ("specfit", 2 * base))]
    page = Page("t")
    simulation_section(page, pd.DataFrame(rows), None, "run")
    assert "Throughput vs expert-cache size" in page.render()


def test_nodes_verified_histogram_bars_are_shares_of_each_policys_cycles():
    """Drawn with density=True on log-spaced bins, a policy verifying 58 nodes every cycle stood at
    0.07 on the 'share of cycles' axis. Each policy's bars sum to 1, one bar per cycle size."""
    cycles = pd.DataFrame({"policy": ["eagle3"] * 6 + ["specfit"] * 4, "nodes_verified": [58] * 6 + [1, 1, 1, 16]})
    ax = _tree_sizes(cycles, policy_styles(cycles["policy"].unique())).axes[0]
    # a step outline goes (left, h), (middle, h), (right, h) for each bin: every third point holds a bin's height
    heights = {outline.get_label(): outline.get_ydata()[2:-1:3] for outline in ax.get_lines()}
    assert {policy: h.sum() for policy, h in heights.items()} == {"eagle3": pytest.approx(1), "specfit": pytest.approx(1)}
    assert sorted(heights["eagle3"][heights["eagle3"] > 0]) == [pytest.approx(1.0)]
    assert sorted(heights["specfit"][heights["specfit"] > 0]) == [pytest.approx(0.25), pytest.approx(0.75)]


def test_simulation_line_plots_keep_their_legend_off_the_data():
    """Inside the axes, the throughput-vs-cache legend sat on the oracle line (lines climbing to the
    top right) and the histogram's on eagle3's bar: both legends are right of the axes."""
    summary = pd.DataFrame([{"policy": p, "cache_experts": c, "tokens_per_s": tps * (1 + c / 16)}
                            for p, tps in (("ar", 90), ("eagle3", 50), ("specfit", 110), ("oracle", 155)) for c in (0, 16)])
    cycles = pd.DataFrame({"policy": ["ar"] * 3 + ["eagle3"] * 3, "nodes_verified": [1, 1, 1, 58, 58, 58]})
    styles = policy_styles(summary["policy"].unique())
    for fig in (_throughput_vs_cache(summary, styles), _tree_sizes(cycles, styles)):
        ax = fig.axes[0]
        renderer = FigureCanvasAgg(fig).get_renderer()
        assert ax.get_legend().get_window_extent(renderer).x0 >= ax.get_window_extent(renderer).x1


def _refit_profile(held: dict, fitted: list) -> Profile:
    errors = {"mape": 0.1, "max_ape": 0.2, "max_abs_err": 1e-4, "n": 3}
    return Profile(cost=CostModel(base_s=1e-3, per_node_s=1e-4, hit_s=38.2e-6, miss_s=1e-4, draft_level_s=2e-4),
                   shape=ModelShape("m", 4, 16, 4, 1000), kind="refit", source="refit", machine={},
                   fit={"fitted": fitted, "held": held, "refit": {"n_cycles": 10, "before": errors, "after": errors}},
                   probes={"h2d": [{"bytes": b, "pinned": False, "seconds": 1e-6 + b / 1e10} for b in (1e3, 4e3)],
                           "expert_compute": [{"tokens": t, "seconds": 2e-5 + 1e-6 * t} for t in (1, 4, 16)]})


def _calibration_page(profile: Profile) -> str:
    page = Page("t")
    calibration_section(page, profile, "p")
    return html.unescape(page.render())


def test_a_refitted_profiles_calibration_figures_say_what_they_draw():
    """A refit's fit has no H2D line, yet the caption spoke of 'the fitted bandwidth'; its hit_s,
    held at the prior times a speed factor, was labelled 'fitted hit_s' above every probe point
    while the facts above said held. Each caption and legend now says what is drawn."""
    held = {"hit_s": {"value": 38.2e-6, "at": "prior x speed factor 1.15", "reason": "not determined by the data"}}
    text = _calibration_page(_refit_profile(held, ["draft_level_s"]))
    assert "fitted bandwidth" not in text and "fitted hit_s" not in text
    assert "as probed; this profile holds no fit of them (a refit on decode cycles" in text
    assert "<!-- hit_s = 38.2 µs, held at prior x speed factor 1.15 -->" in text
    assert "dashed: the profile's hit_s, held at prior x speed factor 1.15, not fitted: not determined by the data" in text
    fitted = _calibration_page(_refit_profile({}, ["draft_level_s", "hit_s"]))
    assert "<!-- hit_s = 38.2 µs, fitted on the decode cycles -->" in fitted


def test_a_refitted_profiles_probe_passes_say_whose_predictions_they_show():
    """The probe passes' predictions are the calibration's own fit's; a refit's terms come from decode
    cycles since (they would put these passes 17 % high on the demo's profile), and the figure
    did not say whose predictions it drew."""
    from dataclasses import replace

    row = {"capacity": 0, "tree": "random", "n_nodes": 8, "hits": 0, "misses": 48, "draft_levels": 0,
           "seconds": 3.2e-3, "predicted_s": 3.1e-3}
    refitted = _refit_profile({}, ["draft_level_s"])
    refitted = replace(refitted, probes={**refitted.probes, "cycles": [row, {**row, "n_nodes": 4, "seconds": 2e-3}]})
    assert "Predicted by the calibration's own fit, before the refit" in _calibration_page(refitted)
    measured = replace(refitted, kind="measured", fit={"fitted": [], "held": {}})
    text = _calibration_page(measured)
    assert "Verification passes over random trees" in text and "before the refit" not in text


def test_a_page_of_many_policies_gives_each_its_own_colour():
    """The page-wide colours wrapped after ten: a decode's two policies after a ten-policy sweep
    drew in one colour."""
    page = Page("t")
    sweep = page.policy_colors([f"p{i}" for i in range(10)])
    decode = page.policy_colors(["ar", "specfit+online"])
    assert len(set(sweep.values()) | {decode["ar"], decode["specfit+online"]}) == 12


def test_the_tallest_bars_label_sits_inside_the_axes():
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = bars(["ar", "eagle3", "specfit"], [1.7, 1.75, 1.4], "MB H2D / committed token",
               ["372 MB total", "375 MB total", "295 MB total"])
    FigureCanvasAgg(fig).draw()
    ax = fig.axes[0]
    top = ax.get_window_extent().y1
    assert max(text.get_window_extent().y1 for text in ax.texts) < top


def test_the_live_per_policy_figures_are_two_tables_each_whole_on_the_page():
    from specfit.report.live import live_section

    page = Page(title="t")
    live_section(page, pd.DataFrame(_rows("specfit", [2, 2, 1, 1]) + _rows("eagle3", [4] * 4)), "run")
    text = page.render()
    tables = [t for t in text.split("<h3>")[1:] if t.startswith("Per policy")]
    headers = [re.findall(r"<th>([^<]*)</th>", t[:t.index("</thead>")]) for t in tables]
    assert len(tables) == 2 and all(len(h) <= 12 for h in headers)
    every = _per_policy(read_cycles(pd.DataFrame(_rows("specfit", [2, 2, 1, 1])))).columns
    assert sorted(set(headers[0] + headers[1])) == sorted(every)       # every column still shown, once
    assert headers[0][0] == headers[1][0] == "policy"


def test_a_wide_table_is_set_denser_its_headers_break_and_short_names_do_not_wrap():
    wide = pd.DataFrame({"trace": ["demo trace"], "path": ["/a/very/long/path/to/a/trace/file.parquet"],
                         **{f"column {i}": [float(i)] for i in range(11)}, "draft_levels_per_cycle": [1.0]})
    text = Page(title="t").table(wide).render()
    assert 'class="dataframe dense"' in text
    assert "<th>draft_<wbr>levels_<wbr>per_<wbr>cycle</th>" in text          # a field name breaks at its underscores
    assert "#t0 td:nth-child(1), #t0 th:nth-child(1) { white-space: nowrap; }" in text     # the short names
    assert "nth-child(2) { white-space: nowrap" not in text and "nth-child(2) { text-align: left" in text
    narrow = Page(title="t").table(pd.DataFrame({"a": [1.0], "b": [2.0]})).render()
    assert "dataframe dense" not in narrow


def test_a_partial_sweeps_page_lists_the_cells_with_no_result_yet():
    """A partial sweep's page said "cells finished 3 of 8" and no more: which settings were missing
    had to be worked out from sweep.json by hand."""
    from specfit.report.sweep import sweep_section

    cells = [{"cell_id": f"{trace}-{policy}-{cache}", "trace": trace, "profile_source": "pcie4", "h2d_scale": 1.0,
              "policy": policy, "cache_experts": cache}
             for trace in ("chat",) for policy in ("ar", "specfit") for cache in (0, 8, 16, 32)]
    done = [c for c in cells if c["policy"] == "ar" and c["cache_experts"] < 32]
    results = pd.DataFrame([{**c, "profile": "pcie4", "tokens_per_s": 10.0 + c["cache_experts"], "speedup_vs_ar": 1.0,
                             "link_gbps": 25.0, "hit_rate": 0.5, "nodes_per_cycle": 1.0, "bytes_per_token": 1e6}
                            for c in done])
    page = Page("t")
    sweep_section(page, results, "run", {"cells": cells})
    text = page.render()
    assert "cells finished</th><td>3 of 8" in text
    assert "The 5 cells of the grid with no result yet" in text
    cells_text = re.sub(r"\s+", "", text)
    rows = re.findall(r"<tr><td>chat</td><td>pcie4</td><td>1</td><td>(\w+)</td><td>([0-9,]+)</td></tr>", cells_text)
    assert rows == [("ar", "32"), ("specfit", "0,8,16,32")]
    # a finished sweep lists none
    page = Page("t")
    sweep_section(page, results, "run", {"cells": done})
    assert "no result yet" not in page.render()
    # cells apart on another axis of the grid (the predictor) stay apart: the oracle's cache 0 is done
    two = [{**c, "cell_id": c["cell_id"] + "-" + predictor, "predictor": predictor}
           for c in cells if c["policy"] == "ar" and c["cache_experts"] == 0 for predictor in ("oracle", "router")]
    page = Page("t")
    finished = pd.DataFrame([{**results.iloc[0].to_dict(), **two[0]}])
    sweep_section(page, finished, "run", {"cells": two})
    flat = re.sub(r"\s+", "", page.render())
    assert "<td>ar</td><td>router</td><td>0</td>" in flat and "<td>oracle</td>" not in flat


def test_a_long_runs_lines_mark_every_kth_cycle_each_policy_its_own_cycles(monkeypatch):
    """A marker on every one of 2,000 cycles is a smear: the cycle-time and error lines of a long
    run carry about MARKS_PER_LINE markers each, those of lines that lie on one another (one per
    policy) on other cycles."""
    from specfit.report.plots import MARKS_PER_LINE

    n = 2000
    rows = pd.DataFrame(_rows("eagle3", [4] * n, n=n) + _rows("specfit", [2] * n, n=n))
    rows = rows.assign(prior_predicted_time_s=rows["predicted_time_s"] * 1.2,
                       online_predicted_time_s=rows["predicted_time_s"])
    figures = []
    monkeypatch.setattr(Page, "figure", lambda page, fig, caption: figures.append(fig) or page)
    live_section(Page("t"), rows, "run")
    lines = [line for fig in figures for ax in fig.axes for line in ax.get_lines() if len(line.get_xdata()) == n]
    assert len(lines) == 8                 # measured and predicted, profile and online: of each of two policies
    marked = {}
    for line in lines:
        assert line.get_marker() not in ("None", "", None), line.get_label()
        start, step = line.get_markevery()
        cycles = range(start, n, step)
        assert MARKS_PER_LINE / 2 <= len(cycles) <= MARKS_PER_LINE, (line.get_label(), len(cycles))
        marked.setdefault(line.get_label().split(" ")[0], set()).add(cycles[0])
    assert not marked["eagle3"] & marked["specfit"]


def test_a_lines_marks_are_at_most_marks_per_line_every_point_up_to_it_and_policies_differ_in_each_style():
    from specfit.report.plots import (MARKS_PER_LINE, POLICY_LINESTYLES, POLICY_MARKERS, POLICY_PALETTE,
                                      PolicyStyle)

    style = PolicyStyle("C0", "o", "-")
    for points in range(1, 5 * MARKS_PER_LINE + 2):
        start, step = style.marked(points)["markevery"]
        marks = len(range(start, points, step))
        assert marks <= MARKS_PER_LINE and (marks == points if points <= MARKS_PER_LINE else marks > MARKS_PER_LINE / 2)
    n = min(len(POLICY_PALETTE), len(POLICY_MARKERS), len(POLICY_LINESTYLES))
    styles = list(policy_styles([f"p{i}" for i in range(n)]).values())
    for part in ("color", "marker", "linestyle"):
        assert len({getattr(s, part) for s in styles}) == n, part
