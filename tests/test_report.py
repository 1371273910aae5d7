"""HTML reports: built from real simulate / calibrate outputs, escaped, and rendered in Chromium."""

import copy
import html
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from cli_helpers import invoke, one_line_error
from typer.testing import CliRunner

from specfit import CostModel
from specfit.calibrate.profile import ModelShape, Profile
from specfit.cli import app
from specfit.report.build import build_report

REPO = Path(__file__).resolve().parents[1]
SAMPLE_TRACE = REPO / "traces" / "qwen3-30b-a3b-chat.parquet"
EVIL = '<script>alert("x")</script>&'


@pytest.fixture(scope="module")
def sim_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("sim")
    result = CliRunner().invoke(app, ["simulate", "--trace", str(SAMPLE_TRACE), "--profile", "pcie4",
                                      "--cache-experts", "0,32", "--policies", "ar,eagle3,specfit", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture()
def profile_path(tmp_path):
    rng = np.random.default_rng(0)
    cycles = [{"capacity": int(c), "n_nodes": int(n), "hits": int(h), "misses": int(m), "draft_levels": 0,
               "seconds": float(s), "predicted_s": float(s * (1 + 0.05 * rng.standard_normal()))}
              for c, n, h, m, s in zip(rng.integers(0, 16, 30), rng.integers(1, 16, 30), rng.integers(0, 40, 30),
                                       rng.integers(0, 40, 30), rng.uniform(1e-3, 1e-2, 30))]
    prof = Profile(cost=CostModel(base_s=1e-3, per_node_s=1e-4, hit_s=2e-5, miss_s=1e-4, draft_level_s=2e-4),
                   shape=ModelShape(EVIL, 4, 16, 4, 1000), source=EVIL, machine={"device_name": EVIL, "host": "h"},
                   fit={"holdout": {"n": 8, "mape": 0.05, "max_ape": 0.1, "max_abs_err_s": 1e-4},
                        "h2d": {"gbps": 10.0, "overhead_s": 1e-6, "r2": 0.99}},
                   probes={"h2d": [{"bytes": b, "n_experts": 1, "expert_bytes": b, "pinned": False,
                                    "seconds": 1e-6 + b / 1e10, "gbps": 10.0} for b in (1000, 2000, 4000)],
                           "expert_compute": [{"tokens": t, "seconds": 1e-5 * t} for t in (1, 4, 16)],
                           "cycles": cycles, "draft": [{"width": 1, "seconds": 1e-4}]})
    return prof.save(tmp_path / "profile.json")


def test_report_has_the_simulation_and_calibration_sections(sim_dir, profile_path, tmp_path):
    index = build_report([sim_dir, profile_path], tmp_path / "rep")
    text = index.read_text()
    assert text.count("<svg") >= 5          # bars, cache curve, bytes, tree sizes, calibration figures
    assert text.count("<table") >= 4
    assert "Simulation:" in text and "Calibration:" in text
    assert "specfit simulate --trace" in text   # the command that produced the run
    # every policy of the run appears in the summary table
    summary = pd.read_parquet(sim_dir / "summary.parquet")
    for policy in summary["policy"].unique():
        assert f">{policy}<" in text
    # the replay's per-layer errors, from the rows `simulate --out` wrote, in the prediction-quality table
    assert np.isfinite(summary["union_layer_mape"]).all()
    assert "<th>union-size MAPE per layer</th>" in text and "<th>misses MAPE per layer</th>" in text
    # nothing is loaded from outside the file (SVG namespace URIs are names, not loads)
    assert not re.search(r"""(src|href|url)\s*[=(]\s*["']?(https?:)?//""", text)


def test_report_escapes_every_embedded_string(profile_path, tmp_path):
    text = build_report([profile_path], tmp_path / "rep").read_text()
    assert "<script>" not in text
    assert "&lt;script&gt;alert(" in text


# a plot without data is left out, not drawn singular (an unclosed file the garbage collector finds meanwhile,
# such as the pipe readers Ray leaves after tests/test_sweep.py, is not this test's)
@pytest.mark.filterwarnings("error", "ignore::ResourceWarning")
def test_report_of_a_live_run_compares_predicted_and_measured(tmp_path):
    rng = np.random.default_rng(1)
    rows = []
    for policy, levels in (("ar", 0), ("eagle3", 4), ("specfit", 2)):
        for i in range(20):
            t = 0.01 + 0.002 * levels + rng.uniform(0, 0.002)
            rows.append({"policy": policy, "cycle": i, "draft_levels": int(levels if policy != "specfit" else rng.integers(1, 3)),
                         "nodes_verified": 1 + levels, "hits": 10, "misses": 5, "bytes_h2d": 5000,
                         "cycle_time_s": t, "predicted_time_s": t * 1.05, "draft_time_s": 0.002 * levels,
                         "predicted_tokens": 1.5, "committed_tokens": int(rng.integers(1, 3))})
    run = tmp_path / "run"
    run.mkdir()
    pd.DataFrame(rows).to_parquet(run / "cycles.parquet")
    text = build_report([run], tmp_path / "rep").read_text()
    assert "Live decoding" in text and "Early stopping" in text
    assert "MAPE 5.0%" in text       # predicted = 1.05 x measured on every cycle


# a plot without data is left out, not drawn singular (an unclosed file the garbage collector finds meanwhile,
# such as the pipe readers Ray leaves after tests/test_sweep.py, is not this test's)
@pytest.mark.filterwarnings("error", "ignore::ResourceWarning")
def test_live_report_shows_the_profile_and_online_errors_over_time_and_unions_per_layer(tmp_path):
    rows = []
    for i in range(40):
        t = 0.01 if i < 20 else 0.02                     # the machine halves its speed at cycle 20
        online = 0.01 if i < 22 else 0.02                # ... which the online model follows
        rows.append({"policy": "specfit", "cycle": i, "draft_levels": 1, "nodes_verified": 2, "hits": 6, "misses": 2,
                     "bytes_h2d": 2000, "charged_bytes_h2d": 2000, "measured_time_s": t, "predicted_time_s": online,
                     "prior_predicted_time_s": 0.01, "online_predicted_time_s": online, "predicted_tokens": 1.5,
                     "committed_tokens": 1, "union_per_layer": [4, 4], "predicted_union_per_layer": [3, 5]})
    run = tmp_path / "run"
    run.mkdir()
    pd.DataFrame(rows).to_parquet(run / "cycles.parquet")
    text = build_report([run], tmp_path / "rep").read_text()
    assert "Cycle-time error over the run" in text and "Expert union per layer" in text
    cells = re.findall(r"<td>([^<]*)</td>", text[text.index("time MAPE"):])
    header = re.findall(r"<th>([^<]*)</th>", text[text.index("Per policy"):])[:len(cells)]
    row = dict(zip(header, cells))
    # the online model missed 2 cycles by half, the profile 20: MAPE 2.5 % against 25 %
    assert row["time MAPE"] == "2.5%" and row["profile's time MAPE"] == "25.0%"
    assert row["union/layer MAPE"] == "25.0%" and row["charged = moved bytes"] == "yes"


def test_live_report_shows_the_online_model_each_policy_ended_with(tmp_path):
    """From the run's summary.json: the refitted terms, the fit's speed factor and the tracked speed
    (two numbers, named apart), and each held term with the value it is held at (the profile's
    times the speed factor) and its reason (escaped like every string); a run without one has no such table and
    still renders, and one whose summary.json was damaged says so on the page and to the caller."""
    rows = [{"policy": "specfit", "cycle": i, "draft_levels": 2, "nodes_verified": 5, "hits": 6, "misses": 2,
             "measured_time_s": 0.01, "predicted_time_s": 0.01, "predicted_tokens": 2.0, "committed_tokens": 2}
            for i in range(10)]
    run = tmp_path / "run"
    run.mkdir()
    pd.DataFrame(rows).to_parquet(run / "cycles.parquet")
    state = {"cycles_seen": 10, "refits": 2, "speed_factor": 1.31, "tracked_speed": 1.25, "pace_slope": 0.4,
             "params": {"base_s": 2e-3, "per_node_s": 5e-5, "hit_s": 1e-4, "miss_s": 1.5e-4, "draft_level_s": 9e-4},
             "held": {"transfer_s": {"value": 5e-5, "at": "prior x speed factor 1.31",
                                     "reason": "not determined <by> the data"}}}
    (run / "summary.json").write_text(json.dumps([{"policy": "specfit", "online_model": state}, {"policy": "ar"}]))
    text = build_report([run], tmp_path / "rep").read_text()
    table = text[text.index("decided with at the end of the run"):]
    cells = re.findall(r"<td>([^<]*)</td>", table)
    header = re.findall(r"<th>([^<]*)</th>", table)[:len(cells)]
    row = dict(zip(header, cells))
    assert row["policy"] == "specfit" and row["per draft level (ms)"] == "0.9" and row["per node (ms)"] == "0.05"
    assert row["fit's speed factor (x profile)"] == "1.31" and row["tracked speed (x fit)"] == "1.25"
    assert row["cycles (refits)"] == "10 (2)"
    assert row["held terms: at (why)"] == "transfer_s: prior x speed factor 1.31 (not determined &lt;by&gt; the data)"
    assert "<by>" not in text
    (run / "summary.json").unlink()
    assert "decided with at the end" not in build_report([run], tmp_path / "rep2").read_text()
    for damage, needle in (("[{", "not a readable JSON file"), ('{"policy": "ar"}', "expected a list of per-policy")):
        (run / "summary.json").write_text(damage)
        said = []
        text = build_report([run], tmp_path / "rep3", say=said.append).read_text()
        assert "decided with at the end" not in text and "measured" in text       # the cycles' sections are there
        assert len(said) == 1 and str(run / "summary.json") in said[0] and needle in said[0]
        assert html.escape(said[0]) in text


def test_a_stopped_decodes_report_says_which_policies_it_cut_short(tmp_path):
    """A run stopped mid-way writes a summary for a policy it cut short, marked incomplete: the
    report says its figures cover fewer prompts, and says nothing for a run that ended."""
    rows = [{"policy": p, "cycle": i, "draft_levels": 0, "nodes_verified": 1, "hits": 6, "misses": 2,
             "measured_time_s": 0.01, "predicted_time_s": 0.01, "predicted_tokens": 1.0, "committed_tokens": 1}
            for p in ("ar", "eagle3") for i in range(4)]
    text = {}
    for name, eagle3 in (("stopped", {"complete": False}), ("ended", {})):
        run = tmp_path / name
        run.mkdir()
        pd.DataFrame(rows).to_parquet(run / "cycles.parquet")
        (run / "summary.json").write_text(json.dumps([{"policy": "ar", "prompts": 3},
                                                       {"policy": "eagle3", "prompts": 1, **eagle3}]))
        text[name] = build_report([run], tmp_path / f"rep-{name}").read_text()
    assert "The run stopped before these policies finished: eagle3 (1 prompt(s) finished)" in text["stopped"]
    assert "The run stopped before" not in text["ended"]


def test_a_killed_decodes_report_says_the_run_did_not_end(tmp_path):
    """A SIGKILL leaves the cycles journal (a run that ends or stops removes it) and no note in
    run.json: the report shows the journal's cycles and says the run did not end; the same cycles
    from a run that ended say nothing of the kind."""
    rows = [{"policy": "ar", "cycle": i, "draft_levels": 0, "nodes_verified": 1, "hits": 6, "misses": 2,
             "measured_time_s": 0.01, "predicted_time_s": 0.01, "predicted_tokens": 1.0, "committed_tokens": 1}
            for i in range(6)]
    killed, ended = tmp_path / "killed", tmp_path / "ended"
    killed.mkdir()
    ended.mkdir()
    (killed / "cycles.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"policy": "ar", "cyc')
    pd.DataFrame(rows).to_parquet(ended / "cycles.parquet")
    said = []
    text = build_report([killed], tmp_path / "rep", say=said.append).read_text()
    assert len(said) == 1 and str(killed / "cycles.jsonl") in said[0] and "did not end" in said[0], said
    assert "the 6 cycle(s) it completed" in said[0] and html.escape(said[0]) in text
    said = []
    build_report([ended], tmp_path / "rep2", say=said.append)
    assert not said


def test_report_command_errors_are_one_line(tmp_path):
    result = CliRunner().invoke(app, ["report", str(tmp_path), "--out", str(tmp_path / "r")])
    assert result.exit_code == 2
    assert "expected what `specfit calibrate`" in result.output
    assert "Traceback" not in result.output


def test_damaged_run_tables_are_one_line_and_write_no_report(sim_dir, tmp_path):
    """A summary or cycle table without a column the report reads, a live run with no cycles, or
    times stored as text: one error naming the run and what is wrong, and no report directory."""
    cases = {}
    summary = pd.read_parquet(sim_dir / "summary.parquet")
    damaged = tmp_path / "no_tokens_per_s"
    shutil.copytree(sim_dir, damaged)
    summary.drop(columns="tokens_per_s").to_parquet(damaged / "summary.parquet")
    cases[damaged] = "missing column 'tokens_per_s'"
    no_rows = tmp_path / "no_rows"
    shutil.copytree(sim_dir, no_rows)
    summary.iloc[:0].to_parquet(no_rows / "summary.parquet")
    cases[no_rows] = "summary.parquet has no rows"
    live = {"policy": ["ar"] * 3, "cycle": [0, 1, 2], "draft_levels": [0] * 3, "nodes_verified": [1] * 3,
            "hits": [1] * 3, "misses": [1] * 3, "bytes_h2d": [10] * 3, "measured_time_s": ["0.01", "0.02", "0.01"],
            "predicted_time_s": [0.01] * 3, "predicted_tokens": [1.0] * 3, "committed_tokens": [1] * 3}
    text_times = tmp_path / "text_times"
    text_times.mkdir()
    pd.DataFrame(live).to_parquet(text_times / "cycles.parquet")
    cases[text_times] = "wrong type or range"
    empty = tmp_path / "no_cycles"
    empty.mkdir()
    pd.DataFrame({k: v[:0] for k, v in live.items()}).to_parquet(empty / "cycles.parquet")
    cases[empty] = "no decode cycles to report"
    for run, needle in cases.items():
        _refused(run, needle, tmp_path)


class _Document(HTMLParser):
    """What a page's markup holds that a validator checks: every element's tag, attributes and
    ancestors, in order, and each element's text."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.elements, self.open, self.text = [], [], {}
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, dict(attrs), tuple(t for t, _ in self.open)))
        if tag not in ("meta", "br", "wbr", "img", "link", "input"):
            self.open.append((tag, len(self.elements) - 1))

    def handle_startendtag(self, tag, attrs):
        self.elements.append((tag, dict(attrs), tuple(t for t, _ in self.open)))

    def handle_endtag(self, tag):
        while self.open and self.open.pop()[0] != tag:
            pass

    def handle_data(self, data):
        for _, k in self.open:
            self.text[k] = self.text.get(k, "") + data


def _page_problems(text: str) -> list[str]:
    """What makes ``text`` an invalid HTML document: an id given twice, an element or attribute
    of another XML namespace (an SVG's RDF metadata), a link to no element of the page, a
    stylesheet in the body (an SVG's own aside)."""
    doc = _Document(text)
    ids = [a["id"] for _, a, _ in doc.elements if "id" in a]
    problems = [f"id {i!r} {ids.count(i)} times" for i in sorted(set(ids)) if ids.count(i) > 1]
    problems += sorted({f"<{tag}> of another namespace" for tag, _, _ in doc.elements if ":" in tag})
    problems += sorted({f"attribute {name} of another namespace" for _, a, _ in doc.elements for name in a
                        if ":" in name and name != "xmlns:xlink" and not name.startswith("xlink:")})
    targets = [ref[1:] for _, a, _ in doc.elements for key, ref in a.items()
               if key in ("href", "xlink:href") and ref and ref.startswith("#")]
    targets += re.findall(r"url\(#([^)]+)\)", text)
    problems += sorted({f"a link to #{t}, which no element has" for t in targets if t not in ids})
    problems += [f"<style> in <{within[-1]}>" for tag, _, within in doc.elements
                 if tag == "style" and "head" not in within and "svg" not in within]
    return problems


def _accessibility_problems(text: str) -> list[str]:
    """What a reviewer of a page's accessibility finds: no language or title, a figure (an inline
    SVG) or image without a text alternative, a header cell of a table's body that does not say
    what it heads, a heading that skips a level."""
    doc = _Document(text)
    named = {a["id"]: doc.text.get(k, "").strip() for k, (_, a, _) in enumerate(doc.elements) if "id" in a}
    problems = [] if re.match(r'<!DOCTYPE html>\s*<html lang="en">', text) else ["no <html lang>"]
    problems += [] if re.search(r"<title>[^<]+</title>", text) else ["no <title>"]
    for tag, a, within in doc.elements:
        if tag == "svg" and "svg" not in within and not (a.get("role") == "img" and named.get(a.get("aria-labelledby"))):
            problems.append(f"a figure with no text alternative ({a.get('role')}, {a.get('aria-labelledby')})")
        if tag == "img" and not a.get("alt", "").strip():
            problems.append("an image with no alt text")
        if tag == "th" and "thead" not in within and a.get("scope") not in ("row", "col"):
            problems.append("a header cell of a table's body without a scope")
    levels = [int(tag[1]) for tag, _, _ in doc.elements if re.fullmatch(r"h[1-6]", tag)]
    problems += [f"<h{b}> after <h{a}>" for a, b in zip(levels, levels[1:]) if b > a + 1]
    return sorted(set(problems))


@pytest.fixture(scope="module")
def full_page(sim_dir, tmp_path_factory):
    """A page of every kind of section: a simulation, a calibration, a live run (two policies, the
    early-stopping comparison) and a killed decode's journal of one cycle."""
    tmp = tmp_path_factory.mktemp("full")
    rng = np.random.default_rng(3)
    rows = [{"policy": policy, "cycle": i, "draft_levels": levels - i % 2 * (policy == "specfit"), "nodes_verified": 3,
             "hits": 0, "misses": 4, "bytes_h2d": 4000, "charged_bytes_h2d": 4000, "measured_time_s": t,
             "predicted_time_s": t * 1.1, "prior_predicted_time_s": t * 1.2, "online_predicted_time_s": t * 1.1,
             "draft_time_s": 1e-3 * levels, "predicted_tokens": 1.5, "committed_tokens": 1 + i % 2,
             "union_per_layer": [4, 4], "predicted_union_per_layer": [3, 5], "hits_per_layer": [0, 0],
             "misses_per_layer": [2, 2]}
            for policy, levels in (("eagle3", 3), ("specfit", 2)) for i, t in enumerate(rng.uniform(0.01, 0.02, 12))]
    live, killed = tmp / "live", tmp / "killed"
    live.mkdir()
    killed.mkdir()
    pd.DataFrame(rows).to_parquet(live / "cycles.parquet")
    (killed / "cycles.jsonl").write_text(json.dumps(rows[0]) + "\n")
    profile = REPO / "calibrate" / "examples" / "vm-x86-64-tiny-moe.json"
    return build_report([sim_dir, profile, live, killed], tmp / "rep").read_text()


def test_a_page_of_every_section_is_a_valid_html_document(full_page):
    """matplotlib names every figure's parts alike (figure_1, axes_1, glyphs, clip paths) and writes
    RDF metadata into each: a page held thousands of duplicate ids and elements an HTML document
    cannot hold, and each table's column rules in a <style> of the body. Each figure's ids are its own,
    every link lands on an element of the page, and the tables' rules are in the page's head."""
    assert full_page.count("<figure>") >= 10
    assert _page_problems(full_page) == []


def test_every_svg_path_has_its_data_even_a_spaces_glyph():
    """matplotlib draws text as glyph paths and writes a space's, which has no outline, with no d:
    an error per figure of the page to the Nu checker (SVG 1.1 requires it)."""
    from matplotlib.figure import Figure

    from specfit.report.html import svg_of

    fig = Figure()
    fig.add_subplot().set_title("two words")
    paths = re.findall(r"<path [^>]*>", svg_of(fig))
    assert paths and all(len(re.findall(r'\bd="', p)) == 1 for p in paths)      # once: a second d is no SVG
    assert any(re.search(r'\bd="M', p) for p in paths)                 # an outline keeps its data


def test_a_figures_ids_are_its_own_and_a_reference_to_no_id_of_it_is_left_alone():
    from specfit.report.html import _own_ids

    svg = '<g id="a"><use href="#a"/><rect clip-path="url(#a)"/><a href="#top"/><g id="a"/></g>'
    assert _own_ids(svg, "f3-") == ('<g id="f3-a"><use href="#f3-a"/><rect clip-path="url(#f3-a)"/><a href="#top"/>'
                                     '<g id="f3-a-2"/></g>')


def test_a_sweeps_panels_of_equal_tokens_per_second_give_no_id_twice():
    """matplotlib names an image by its pixels' hash: a sweep's heat map whose policies reached the
    same tokens/s in every square drew equal panels, one id four times in one figure."""
    from specfit.report.html import Page
    from specfit.report.sweep import heat_map_grid

    results = pd.DataFrame([{"trace": "t", "policy": policy, "cache_experts": cache, "link_gbps": link,
                             "tokens_per_s": 10.0 + cache + link}
                            for policy in ("ar", "chain", "eagle3", "specfit") for cache in (0, 8) for link in (16, 32)])
    fig, _ = heat_map_grid(results, "t")
    text = Page("t").figure(fig, "Tokens/s per policy").render()
    assert text.count("<image") == 5 and _page_problems(text) == []


def test_a_page_of_every_section_has_a_text_alternative_for_every_figure_and_scoped_headers(full_page):
    """A figure's text (axes, legend) is drawn as paths, which a screen reader reads as nothing, and
    the SVG said neither that it is an image nor what it shows; the facts tables' row headers did
    not say they head their row. Every figure is an image named by its caption."""
    assert full_page.count("<figure>") >= 10
    assert _accessibility_problems(full_page) == []


def test_a_reports_title_names_its_inputs_unless_given_one(sim_dir, profile_path, tmp_path):
    """Every `specfit report` page was titled "SpecFit report", so a browser's tabs and history of
    several reports told them apart by nothing; the default title names the inputs."""
    text = build_report([sim_dir, profile_path], tmp_path / "rep").read_text()
    title = f"SpecFit report: {sim_dir.name}, profile.json"
    assert f"<title>{title}</title>" in text and f"<h1>{title}</h1>" in text
    result = CliRunner().invoke(app, ["report", str(profile_path), "--out", str(tmp_path / "cli"), "--title", "<mine>"])
    assert result.exit_code == 0, result.output
    assert "<title>&lt;mine&gt;</title>" in (tmp_path / "cli" / "index.html").read_text()


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def test_report_renders_in_headless_chromium(sim_dir, profile_path, tmp_path):
    browser = _chromium()
    if browser is None:
        pytest.skip("Chromium is not installed (.ci/run installs Debian's chromium); the browser check is skipped")
    index = build_report([sim_dir, profile_path], tmp_path / "rep")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([browser, *flags, "--dump-dom", index.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    # the browser parsed the page into a DOM with every figure and table in place
    assert dom.stdout.count("<svg") == index.read_text().count("<svg") > 0
    assert dom.stdout.count("<table") >= 4
    shot = tmp_path / "shot.png"
    subprocess.run([browser, *flags, f"--screenshot={shot}", "--window-size=1200,2000", index.as_uri()],
                   capture_output=True, timeout=120, check=True)
    assert shot.stat().st_size > 20_000     # a rendered page, not a blank one


def test_a_page_fits_a_narrow_window_its_figures_narrowed_and_long_names_wrapped(tmp_path):
    """A figure is as wide as matplotlib drew it (a sweep's heat maps over 1,000 px) and a name of
    no spaces (a path) one word: at a phone's width the page scrolled sideways (the demo's at 500 px
    was 758 px wide). Figures narrow with the window and long names wrap. (Headless Chromium's
    narrowest window is 500 px; the script measures the page in a copy.)"""
    browser = _chromium()
    if browser is None:
        pytest.skip("Chromium is not installed (.ci/run installs Debian's chromium); the browser check is skipped")
    from specfit.report.html import Page
    from specfit.report.plots import new_axes

    long = "runs/" + "x" * 200
    fig, ax = new_axes(12, 3)
    ax.plot([0, 1], [0, 1], label=long)
    page = Page(long).heading(f"Simulation: {long}").paragraph(f"note: {long}", css="note").figure(fig, long)
    measured = page.render().replace("</body>", "<script>document.body.dataset.width = "
                                     "document.documentElement.scrollWidth + ' ' + innerWidth;</script></body>")
    (tmp_path / "page.html").write_text(measured)
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}",
             "--window-size=400,900"]
    dom = subprocess.run([browser, *flags, "--dump-dom", (tmp_path / "page.html").as_uri()], capture_output=True,
                         text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    width, window = map(int, re.search(r'data-width="(\d+) (\d+)"', dom.stdout).groups())
    assert window <= 500 and width <= window, (width, window)


def test_damaged_profile_fields_and_journals_are_one_line(profile_path, tmp_path):
    """Fields the calibration section reads, present with the wrong content (a hand-edited profile),
    a run journal that is not UTF-8, and a run.json whose versions are not an object: one error
    line each (or, for run.json, nothing shown from it), never a traceback."""
    raw = json.loads(profile_path.read_text())
    cases = {}
    for name, change, needle in [
        ("mape_text", lambda d: d["fit"]["holdout"].update(mape="low"), "a field holds values of the wrong type"),
        ("h2d_no_pinned", lambda d: [row.pop("pinned") for row in d["probes"]["h2d"]], "missing field 'pinned'"),
        ("draft_no_seconds", lambda d: d["probes"]["draft"][0].pop("seconds"), "missing field 'seconds'"),
    ]:
        damaged = json.loads(json.dumps(raw))
        change(damaged)
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(damaged))
        cases[path] = needle
    journal = tmp_path / "journal"
    journal.mkdir()
    (journal / "cycles.jsonl").write_bytes(b"\xff\xfe not text\n")
    cases[journal] = "cycles.jsonl"
    for run, needle in cases.items():
        _refused(run, needle, tmp_path)


@pytest.mark.filterwarnings("error:Glyph")
def test_a_dollar_in_a_trace_name_is_text_and_every_heading_has_its_own_anchor(sim_dir, profile_path, tmp_path):
    """matplotlib reads $...$ as math: a trace named with dollars (an unbalanced one
    fails to parse) is shown as written, and one in a script the font lacks warns of nothing.
    Two inputs give two sections of each kind, each with its own anchor, so the navigation links
    land on their own section."""
    dollars = tmp_path / "dollars"
    shutil.copytree(sim_dir, dollars)
    for table in ("summary.parquet", "cycles.parquet"):           # the trace's name titles the figures
        frame = pd.read_parquet(dollars / table)
        frame["trace"] = r"cost $5 \frac{$ 缓存"      # as math: an unbalanced brace, a parse error
        frame.to_parquet(dollars / table)
    (dollars / "run.json").write_text(json.dumps({"kind": "simulate", "versions": ["not", "an", "object"]}))
    text = build_report([dollars, sim_dir, profile_path], tmp_path / "rep").read_text()
    assert r"cost $5 \frac{$" in text
    anchors = re.findall(r'<h[23] id="([^"]+)"', text)
    assert len(anchors) == len(set(anchors)) >= 6
    assert set(re.findall(r'<a href="#([^"]+)"', text)) <= set(anchors)


@pytest.mark.filterwarnings("error:Glyph")
@pytest.mark.parametrize("words", ["missing from current font.", "missing from font(s) DejaVu Sans."])
def test_a_missing_glyph_is_silent_in_either_matplotlibs_words(monkeypatch, words):
    """matplotlib before 3.9 warns 'missing from current font', from 3.9 on 'missing from font(s) NAME':
    with the older, every glyph of a CJK trace name warned through the command's output."""
    from matplotlib.figure import Figure

    from specfit.report.html import svg_of

    savefig = Figure.savefig

    def warning_savefig(fig, *args, **kwargs):
        warnings.warn(f"Glyph 32531 (\\N{{CJK UNIFIED IDEOGRAPH-7F13}}) {words}", UserWarning)
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", warning_savefig)
    assert svg_of(Figure()).startswith("<svg")


def test_a_replays_cycles_without_their_summary_are_not_reported_as_a_live_run(sim_dir, tmp_path):
    """A simulation's cycle table has the decode's columns, its measured times empty: without
    summary.parquet and run.json it was rendered as 'Live decoding' of replayed cycles."""
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(sim_dir / "cycles.parquet", bare / "cycles.parquet")
    _refused(bare, "holds replayed cycles (no measured times)", tmp_path)


def _refused(run: Path, needle: str, tmp_path: Path) -> None:
    """``specfit report RUN`` ends in one error line naming the run and ``needle``, writing nothing."""
    out = tmp_path / f"report-{run.name}"
    one_line_error(invoke("report", run, "--out", out), str(run), needle)
    assert not out.exists()


def test_a_report_is_not_written_among_a_runs_files(sim_dir, tmp_path):
    """``report RUN --out RUN`` wrote index.html and inputs.json beside the simulation's files,
    where a rerun of the simulation into RUN left them describing the old run."""
    run = tmp_path / "run"
    shutil.copytree(sim_dir, run)
    held = sorted(p.name for p in run.iterdir())
    one_line_error(invoke("report", run, "--out", run), f"--out {run}", "`specfit simulate` run", "reports/")
    assert sorted(p.name for p in run.iterdir()) == held
    # a demo's directory holds its own report: not a run to protect
    from specfit.runinfo import write_run_info

    demo = tmp_path / "demo"
    shutil.copytree(sim_dir, demo / "simulate")
    write_run_info(demo, "demo")
    assert invoke("report", demo, "--out", demo).exit_code == 0
    assert (demo / "index.html").is_file()


def test_a_demo_directory_without_its_parts_is_refused(tmp_path):
    # a demo stopped before its first step: its run.json and nothing the report reads
    from specfit.runinfo import write_run_info

    demo = tmp_path / "demo"
    demo.mkdir()
    write_run_info(demo, "demo")
    _refused(demo, "a `specfit demo` directory without its decode/", tmp_path)


def test_static_auto_labels_name_the_tree_size_of_every_cache_size():
    # the bars of each cache size are grouped under one label: it names each size's own N
    from specfit.report.simulation import _label

    assert _label("static:auto", [pd.Series({"static_n": 16}), pd.Series({"static_n": 6})]) == "static:auto (N=16/6)"
    assert _label("static:auto", [pd.Series({"static_n": 6}), pd.Series({"static_n": 6})]) == "static:auto (N=6)"
    assert _label("static:auto", [pd.Series({"static_n": float("nan")})]) == "static:auto"
    assert _label("sequoia:auto+cache", [pd.Series({"static_n": 4})]) == "sequoia:auto+cache (N=4)"
    assert _label("sequoia:auto", [pd.Series({"static_n": float("nan")})]) == "sequoia:auto"


def test_a_refitted_profile_says_its_held_out_error_is_over_decode_cycles(profile_path, tmp_path):
    from specfit.calibrate.profile import load_profile

    profile = load_profile(profile_path)
    profile.fit = {**profile.fit, "holdout": {"n": 7, "mape": 0.05, "max_ape": 0.2}}
    refitted = copy.deepcopy(profile)
    held = refitted.fit["holdout"]
    refitted.fit["refit"] = {"n_cycles": 30, "n_holdout": 7, "before": held, "after": held,
                             "before_params": profile.cost.to_dict(), "after_params": profile.cost.to_dict()}
    for prof, unit in ((profile, "over 7 passes"), (refitted, "over 7 decode cycles")):
        path = prof.save(tmp_path / f"{unit.split()[-1]}.json")
        index = build_report([path], tmp_path / f"report-{unit.split()[-1]}")
        assert unit in index.read_text()


def test_a_long_table_caption_is_a_heading_and_small_print():
    from specfit.report.html import Page

    page = Page("t").table(pd.DataFrame({"a": [1]}), caption="Per policy: <x>. tokens/s: what & how")
    text = "".join(page.parts)
    assert "<h3>Per policy: &lt;x&gt;</h3>" in text and '<p class="meta">tokens/s: what &amp; how</p>' in text
    assert "<h3>Short</h3>" in "".join(Page("t").table(pd.DataFrame({"a": [1]}), caption="Short").parts)


def test_the_per_layer_figures_tick_whole_layers():
    from specfit.report.live import _layer_heat_map, _union_per_layer

    layers = 4
    cycles = pd.DataFrame({"policy": ["ar", "ar", "specfit"], "misses_per_layer": [[1] * layers] * 3,
                           "hits_per_layer": [[2] * layers] * 3, "union_per_layer": [[3] * layers] * 3,
                           "predicted_union_per_layer": [[3] * layers] * 3})
    for fig in (_layer_heat_map(cycles), _union_per_layer(cycles, ["ar", "specfit"])):
        ticks = [t for t in fig.axes[0].get_xticks() if -0.5 <= t <= layers - 0.5]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_text_columns_align_left_and_numbers_right():
    from specfit.report.html import Page

    page = Page("t").table(pd.DataFrame({"n": [1.5], "policy": ["ar"], "k": [2]})).table(pd.DataFrame({"x": [1]}))
    text = page.render()
    assert "#t0 td:nth-child(2), #t0 th:nth-child(2) { text-align: left; }" in text      # policy, column 2
    assert "nth-child(1)" not in text and "nth-child(3)" not in text and 'id="t1"' in text
    assert len(page.styles) == 2 and "#t1" not in text.replace('id="t1"', "")   # the all-number table needs no rule


def test_share_columns_show_as_percentages_as_the_terminal_shows_them():
    from specfit.report.html import Page

    frame = pd.DataFrame({"policy": ["ar"], "time MAPE": [0.03059], "time bias": [-0.0015], "union MAPE": [np.nan],
                          "tokens/s": [294.87]})
    cells = "".join(Page("t").table(frame, percent=("time MAPE", "time bias", "union MAPE")).parts)
    assert "<td>3.1%</td>" in cells and "<td>-0.1%</td>" in cells and "<td>–</td>" in cells
    assert "<td>294.9</td>" in cells                       # other numbers as before


def test_a_scatter_of_many_cycles_stays_small_in_the_page():
    """One vector marker per cycle made a 64k-cycle run's page 10 MB: above RASTER_ABOVE points
    the markers are an image inside the SVG (axes and text stay vector); below, markers."""
    from specfit.report.html import svg_of
    from specfit.report.plots import RASTER_ABOVE, identity_scatter

    rng = np.random.default_rng(0)
    sizes = {}
    for n in (RASTER_ABOVE, 30 * RASTER_ABOVE):
        measured = rng.uniform(1e-3, 2e-3, n)
        svg = svg_of(identity_scatter(measured, measured * rng.uniform(0.9, 1.1, n), "measured", "predicted",
                                      groups=np.where(np.arange(n) % 2, "ar", "specfit")))
        sizes[n] = (len(svg), "<image" in svg)
    assert sizes[RASTER_ABOVE][1] is False and sizes[30 * RASTER_ABOVE][1] is True
    assert sizes[30 * RASTER_ABOVE][0] < sizes[RASTER_ABOVE][0] < 1_000_000


def test_the_same_inputs_give_the_same_report_byte_for_byte(sim_dir, profile_path, tmp_path):
    """No date in the figures and no random element ids: a report can be diffed and versioned."""
    first = build_report([sim_dir, profile_path], tmp_path / "one").read_bytes()
    second = build_report([sim_dir, profile_path], tmp_path / "two").read_bytes()
    assert first == second and b"<svg" in first


def test_a_runs_notes_reach_the_page_escaped_and_a_damaged_notes_field_is_ignored(sim_dir, tmp_path):
    import json
    import shutil

    run = tmp_path / "sim"
    shutil.copytree(sim_dir, run)
    info = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**info, "notes": [f"replayed too few cycles {EVIL}", 7]}))
    text = build_report([run], tmp_path / "rep").read_text()
    assert "note: replayed too few cycles &lt;script&gt;" in text and "<script>" not in text
    (run / "run.json").write_text(json.dumps({**info, "notes": "not a list"}))
    assert "note: " not in build_report([run], tmp_path / "rep2").read_text()


def test_only_a_quick_demos_what_if_carries_the_smoke_test_note():
    from types import SimpleNamespace

    from specfit.demo import DemoPlan, _whatif_notes

    trace = SimpleNamespace(n_cycles=30, sequence=np.array([0] * 15 + [1] * 15))
    assert _whatif_notes(DemoPlan(quick=False), trace) == []
    (note,) = _whatif_notes(DemoPlan(quick=True), trace)
    assert "replays 30 cycles of 2 prompts" in note


def _whatif_summary(rates: dict, static_n: int = 12):
    """A what-if summary as the demo's sweep writes it: ``rates[(profile, cache)][policy]`` tokens/s."""
    import pandas as pd

    rows = [{"profile": profile, "cache_experts": cache, "policy": policy, "tokens_per_s": rate,
             "speedup_vs_ar": rate / by_policy["ar"], "static_n": static_n if policy == "static:auto" else pd.NA}
            for (profile, cache), by_policy in rates.items() for policy, rate in by_policy.items()]
    return pd.DataFrame(rows)


def test_where_a_fixed_policy_leads_the_demo_says_what_specfit_reaches_with_the_true_experts():
    from specfit.demo import _leader_notes, _settings_behind

    summary = _whatif_summary({
        ("gh200-qwen3", 0): {"ar": 100.0, "eagle3": 140.0, "static:auto": 150.0, "specfit": 120.0,
                             "specfit+cache+prefetch": 130.0, "oracle": 300.0},
        ("pcie4-qwen3", 0): {"ar": 100.0, "eagle3": 110.0, "static:auto": 115.0, "specfit": 125.0,
                             "specfit+cache+prefetch": 125.0, "oracle": 200.0}})
    # the oracle is no fixed setting: only gh200 trails, against static:auto, and SpecFit's best column there
    assert _settings_behind(summary) == [("gh200-qwen3", 0)]
    truth = _whatif_summary({("gh200-qwen3", 0): {"ar": 100.0, "specfit": 160.0, "specfit+cache+prefetch": 170.0}})
    legend, note = _leader_notes(summary, truth)
    assert "static:auto is static:N" in legend and "oracle knows the target's verdicts" in legend
    assert ("gh200-qwen3, 0 cached: static:auto (N=12) 1.50x, specfit+cache+prefetch 1.30x, 1.70x with the true "
            "experts.") in note
    assert "pcie4" not in note and "leads all of them" in note
    # the true experts do not close the gap: the note counts it
    truth = _whatif_summary({("gh200-qwen3", 0): {"ar": 100.0, "specfit": 125.0, "specfit+cache+prefetch": 140.0}})
    assert "1.40x with the true experts. With the true experts SpecFit leads 0 of these 1" in _leader_notes(summary, truth)[1]
    # a trace without predictions: SpecFit decided with the true experts already
    (_, note) = _leader_notes(summary, None)
    assert "the trace holds no predictions" in note and "x with the true experts" not in note
    # SpecFit ahead everywhere: the legend alone; a what-if without static:auto or the oracle: nothing
    ahead = summary[summary["profile"] == "pcie4-qwen3"]
    assert _settings_behind(ahead) == [] and len(_leader_notes(ahead, None)) == 1
    assert _leader_notes(ahead[~ahead["policy"].isin(["static:auto", "oracle"])], None) == []


def test_sweep_heat_map_squares_show_the_best_cell_of_the_other_axes():
    import pandas as pd

    from specfit.report.sweep import heat_map_grid

    results = pd.DataFrame({"trace": "t", "policy": "specfit", "cache_experts": [8, 8, 16, 16],
                            "link_gbps": 10.0, "predictor": ["a", "b", "a", "b"],
                            "tokens_per_s": [1.0, 3.0, 2.0, 5.0]})
    fig, varying = heat_map_grid(results, "t")
    assert varying == ["predictor"]
    assert sorted(t.get_text() for t in fig.axes[0].texts) == ["3", "5"]


def test_live_report_says_how_many_cycles_were_charged_the_bytes_they_moved():
    import pandas as pd

    from specfit.report.live import _charged_matches

    cycles = pd.DataFrame({"charged_bytes_h2d": [100, 200, -1], "bytes_h2d": [100, 150, 7]})
    assert _charged_matches(cycles) == "1 of 2 cycles"           # -1: not known, left out
    assert _charged_matches(cycles.iloc[[0, 2]]) == "yes"


def test_a_large_sweep_heat_map_shows_colours_without_a_number_per_square_and_thinned_ticks():
    import pandas as pd

    from specfit.report.sweep import LABELLED_SQUARES, MAX_TICKS, heat_map_grid

    def grid(caches, links):
        c, g = np.meshgrid(np.arange(caches), np.arange(links), indexing="ij")
        return pd.DataFrame({"trace": "t", "policy": "ar", "cache_experts": c.ravel(), "link_gbps": 10.0 + g.ravel(),
                             "tokens_per_s": 1.0 + c.ravel() + g.ravel()})

    small, _ = heat_map_grid(grid(4, 3), "t")
    assert len(small.axes[0].texts) == 12 and len(small.axes[0].get_yticks()) == 4
    large, _ = heat_map_grid(grid(64, 20), "t")
    assert 64 * 20 > LABELLED_SQUARES and not large.axes[0].texts
    ticks = large.axes[0].get_yticks()
    assert len(ticks) <= MAX_TICKS + 1 and ticks[0] == 0 and ticks[-1] == 63
    assert [t.get_text() for t in large.axes[0].get_yticklabels()][-1] == "63"


def test_a_report_into_a_directory_holding_another_inputs_report_says_it_replaced_it(sim_dir, profile_path, tmp_path,
                                                                                    monkeypatch):
    """The default --out is reports/<first input's name>: runs/a and other/a share it."""
    monkeypatch.chdir(tmp_path)
    first, second = tmp_path / "runs" / "sim", tmp_path / "other" / "sim"
    shutil.copytree(sim_dir, first)
    shutil.copytree(sim_dir, second)
    result = invoke("report", first)
    assert result.exit_code == 0 and "note:" not in result.output, result.output
    again = invoke("report", Path("runs") / "sim")             # the same input, spelled relative: no note
    assert again.exit_code == 0 and "note:" not in again.output, again.output
    other = invoke("report", second)
    assert other.exit_code == 0, other.output
    assert f"note: {Path('reports') / 'sim'} held the report of runs/sim; it is replaced" in other.output
    assert json.loads((tmp_path / "reports" / "sim" / "inputs.json").read_text()) == [str(second)]
    # an unreadable inputs.json is no earlier report to name
    (tmp_path / "reports" / "sim" / "inputs.json").write_text("{broken")
    assert "note:" not in invoke("report", first).output
    # the same run twice would repeat its sections: one error, spelled alike or not
    one_line_error(invoke("report", first, Path("runs") / "sim", "--out", tmp_path / "twice"),
                   "(the same path) given twice; expected each input once")
    assert not (tmp_path / "twice").exists()
    # "." is named by the directory it is: reports/sim, not reports/ itself
    monkeypatch.chdir(second)
    here = invoke("report", ".")
    assert here.exit_code == 0, here.output
    assert (second / "reports" / "sim" / "index.html").is_file() and not (second / "reports" / "index.html").exists()


def test_each_run_shows_the_versions_it_recorded_and_the_report_its_own(sim_dir, tmp_path):
    """A run made by another version than the report's code: its row says its own versions, and
    the report's version is labelled as the report's (it once stood as the runs' specfit)."""
    import json
    import shutil

    from specfit import __version__

    old, new = tmp_path / "old", tmp_path / "new"
    for run, version in ((old, "0.0.7"), (new, None)):
        shutil.copytree(sim_dir, run)
        if version:
            info = json.loads((run / "run.json").read_text())
            (run / "run.json").write_text(json.dumps({**info, "versions": {"specfit": version, "python": "3.10.2"}}))
    text = build_report([old, new], tmp_path / "rep").read_text()
    assert "specfit 0.0.7, python 3.10.2" in text
    assert f"specfit {__version__}, specfit_source " in text        # the other run's own record
    assert "report built with specfit" in text


def test_log_axes_tick_numbers_not_raw_mathtext(sim_dir, profile_path, tmp_path):
    """The report draws with text.parse_math off (a '$' in a name is text), and matplotlib's log
    ticks are mathtext: the nodes-verified histogram and the cache-hit latency printed
    `$\\mathdefault{10^{0}}$`. Their ticks are plain numbers (SVG keeps each text in a comment)."""
    text = build_report([sim_dir, profile_path], tmp_path / "rep").read_text()
    assert "mathdefault" not in text
    for axis_label in ("nodes verified in a cycle", "tokens through one resident expert"):
        svg = next(fig for fig in text.split("<figure>") if f"<!-- {axis_label} -->" in fig)
        assert "<!-- 10 -->" in svg, axis_label


def test_simulation_tables_have_headers_with_units_bytes_in_mb_and_define_their_columns(sim_dir, tmp_path):
    """The tables showed the summary's field names (bytes_per_token, wasted_draft_levels,
    miss_count_error) and bytes per token in bytes (1.611e+09) under figures in MB; 'wasted' and
    'miss count' were defined nowhere."""
    text = build_report([sim_dir], tmp_path / "rep").read_text()
    headers = set(re.findall(r"<th>([^<]*)</th>", text))
    assert {"MB H2D / token", "tokens / s", "wasted draft levels / cycle", "miss-count error", "hit rate"} <= headers
    assert not headers & {"bytes_per_token", "tokens_per_s", "wasted_draft_levels", "miss_count_error", "hit_rate"}
    summary = pd.read_parquet(sim_dir / "summary.parquet")
    for mb in summary["bytes_per_token"] / 1e6:                 # as the figure above it: MB H2D / token
        assert f"<td>{mb:.4g}</td>" in text
    small_print = html.unescape(" ".join(re.findall(r'<p class="meta">([^<]*)</p>', text)))
    for header in ("MB H2D / token:", "wasted draft levels / cycle: levels drafted below the deepest verified node",
                   "miss-count error: mean over cycles of predicted minus actual cache misses (positive:"):
        assert header in small_print, header


def _legend_colors(page_html: str) -> list[tuple[str, str]]:
    """(label, colour) of every legend entry of every figure: an entry's colour is the first fill or
    stroke its handle is drawn with (the legend's frame and white aside; a hatched patch's, its
    pattern's first, its ground or a hollow bar's hatch), its label the comment that follows."""
    entries = []
    for svg in re.findall(r"<svg.*?</svg>", page_html, re.S):
        legend = re.search(r'<g id="(f\d+_)?legend_1">', svg)
        if legend is None:
            continue
        seen = []
        for token in re.finditer(r"(?:fill|stroke): (#[0-9a-f]{6}|url\(#(\w+)\))|<!-- (.*?) -->", svg[legend.start():]):
            if token.group(2):
                pattern = re.search(rf'<pattern id="{token.group(2)}".*?</pattern>', svg, re.S).group(0)
                seen.append(re.search(r'(?:fill="|fill: |stroke: )(?!#ffffff)(#[0-9a-f]{6})', pattern).group(1))
            elif token.group(1) and token.group(1) not in ("#ffffff", "#cccccc"):
                seen.append(token.group(1))
            elif token.group(3) is not None:
                entries.append((token.group(3), seen[0]))
                seen = []
    return entries


def test_a_policy_keeps_its_colour_in_every_figure_of_the_page():
    """The live figures (scatter, cycle times measured and predicted, errors over time, unions, bytes,
    tokens per cycle, early stopping) and a simulation section after them on the same page: each
    policy one colour, whatever its place among a figure's lines."""
    from specfit.report.html import Page
    from specfit.report.live import live_section
    from specfit.report.simulation import simulation_section

    rows = []
    for policy, levels in (("ar", 0), ("eagle3", 4), ("specfit", 2)):
        for i in range(20):
            t = 0.01 + 0.002 * levels + 0.0001 * i
            rows.append({"policy": policy, "cycle": i, "draft_levels": levels - (i % 2 if levels else 0),
                         "nodes_verified": 1 + levels, "hits": 6, "misses": 2, "bytes_h2d": 2000,
                         "measured_time_s": t, "predicted_time_s": t * 1.05, "prior_predicted_time_s": t * 1.2,
                         "online_predicted_time_s": t * 1.05, "draft_time_s": 0.002 * levels, "predicted_tokens": 1.5,
                         "committed_tokens": 1 + i % 3, "union_per_layer": [4, 4], "predicted_union_per_layer": [3, 5]})
    summary = pd.DataFrame([{"trace": "t", "profile": "pcie4", "cache_experts": c, "policy": p, "tokens_per_s": 10.0 + k,
                             "speedup_vs_ar": 1.0, "bytes_per_token": 1e6}
                            for c in (0, 16) for k, p in enumerate(("ar", "chain", "eagle3", "specfit"))])
    sim_cycles = pd.DataFrame({"policy": ["ar", "chain", "eagle3", "specfit"] * 4, "nodes_verified": [1, 4, 40, 8] * 4})
    page = Page("t")
    live_section(page, pd.DataFrame(rows), "run")
    simulation_section(page, summary, sim_cycles, "sim")
    entries = _legend_colors(page.render())
    colors = {}
    for label, color in entries:
        if not label.endswith(" cached"):               # the bars of a cache size, not of a policy
            colors.setdefault(label.split(" ")[0], set()).add(color)
    assert set(colors) == {"ar", "chain", "eagle3", "specfit"}
    assert len(entries) > 20                             # every figure's entries were read
    assert all(len(c) == 1 for c in colors.values()), colors
    assert len({c for (c,) in colors.values()}) == len(colors)       # and no two policies share one


def _marks(fig, policies) -> list[tuple[str, str, bytes, bool]]:
    """(policy, colour, marker shape, in the legend) of every line and scatter of ``fig`` whose label
    names one of ``policies`` (its first word), and of every legend entry that does (bars aside):
    the shape as the vertices of the marker's path (a line's marker and a scatter's points compare
    alike; no marker is no vertices)."""
    from matplotlib.collections import PathCollection
    from matplotlib.colors import to_hex
    from matplotlib.lines import Line2D
    from matplotlib.markers import MarkerStyle

    def shape(artist) -> bytes:
        if isinstance(artist, Line2D):
            marker = MarkerStyle(artist.get_marker())
            path = marker.get_path().transformed(marker.get_transform())
        else:
            path = artist.get_paths()[0]
        return np.round(path.vertices, 3).tobytes() if len(path.vertices) else b""

    def colour(artist) -> str:
        return to_hex(artist.get_color() if isinstance(artist, Line2D) else np.atleast_2d(artist.get_facecolor())[0],
                      keep_alpha=False)

    marks = []
    for ax in fig.axes:
        legend = ax.get_legend()
        handles = zip(legend.legend_handles, legend.get_texts()) if legend else ()
        drawn = [(a, a.get_label()) for a in [*ax.get_lines(), *ax.collections]]
        for artist, label in [*drawn, *((h, t.get_text()) for h, t in handles)]:
            policy = str(label).split(" ")[0]
            if policy in policies and isinstance(artist, (Line2D, PathCollection)):     # not a bar
                in_legend = legend is not None and artist in legend.legend_handles
                marks.append((policy, colour(artist), shape(artist), in_legend))
    return marks


def test_policies_are_told_apart_by_marker_as_well_as_colour_in_every_figure(sim_dir, tmp_path, monkeypatch):
    """A colour-blind reader (or a greyscale print) matched a line to its policy by nothing: the
    live figures (scatter, cycle times, errors over time, tokens per cycle), the simulation's
    (throughput vs cache, tree sizes) and the plan's frontier drew every policy alike but for its
    colour. Each policy has its marker, the same in every figure of the page and in the legends;
    no two policies of a figure share one."""
    from specfit.report.html import Page
    from specfit.report.sweep import plan_section

    figures = []
    monkeypatch.setattr(Page, "figure", lambda page, fig, caption: figures.append((page, fig)) or page)
    rows = [{"policy": policy, "cycle": i, "draft_levels": levels, "nodes_verified": 1 + levels, "hits": 6,
             "misses": 2, "bytes_h2d": 2000, "measured_time_s": t, "predicted_time_s": t * 1.05,
             "prior_predicted_time_s": t * 1.2, "online_predicted_time_s": t * 1.05, "draft_time_s": 0.002 * levels,
             "predicted_tokens": 1.5, "committed_tokens": 1 + i % 3}
            for policy, levels in (("eagle3", 4), ("specfit", 2), ("ar", 0)) for i, t in enumerate(np.full(300, 0.01))]
    live = tmp_path / "live"
    live.mkdir()
    pd.DataFrame(rows).to_parquet(live / "cycles.parquet")
    build_report([live, sim_dir], tmp_path / "rep")
    settings = [{"policy": policy, "cache_experts": c, "tokens_per_s": 10.0 + c + k, "device_bytes": 1e9 * (1 + c),
                 "speedup_vs_ar": 1.0, "tree_tokens": 8, "expert_cache_bytes": 1e8 * c, "kv_bytes": 1e8}
                for k, policy in enumerate(("ar", "static:8", "eagle3", "specfit")) for c in (0, 4, 8)]
    plan = {"memory": {"model": "m", "device_bytes": 8e9, "dense_bytes": 1e9, "kv_bytes_per_token": 1e4,
                       "context_tokens": 4096, "reserve_bytes": 1e8, "slot_bytes": 1e7},
            "best": settings[-1], "runners_up": settings[-3:-1], "settings": settings, "traces": ["t"], "profile": "p"}
    plan_section(Page("plan"), plan, "plan")
    policies = {"ar", "eagle3", "specfit", "static"}
    drawn = {}                                           # per page: each policy's (colour, marker)
    read = set()
    for page, fig in figures:
        marks = _marks(fig, policies)
        if len({policy for policy, *_ in marks}) < 2:
            continue
        read.add(id(fig))
        shapes = {}
        for policy, color, shape, in_legend in marks:
            assert shape, f"{policy} drawn without a marker"
            shapes.setdefault(policy, set()).add(shape)
            drawn.setdefault(id(page), {}).setdefault(policy, set()).add((color, shape))
        assert all(len(s) == 1 for s in shapes.values()), shapes.keys()
        assert len({s for (s,) in map(tuple, shapes.values())}) == len(shapes), sorted(shapes)
        assert any(in_legend for *_, in_legend in marks)     # the legends were read too
    # the live section's scatter, cycle times, errors and tokens per cycle; the simulation's
    # throughput vs cache and tree sizes; the plan's frontier
    assert len(read) == 7
    for looks in drawn.values():
        assert all(len(look) == 1 for look in looks.values()), looks
        assert len({look for (look,) in map(tuple, looks.values())}) == len(looks)


def test_a_decode_page_says_the_terminals_notes_and_predicted_bytes_next_to_measured(tmp_path):
    """The notes the terminal says after its tables, made by the same functions from the run's
    summary.json: a policy that waited for a CPU, and for a greedy run priced with the drafter's raw
    probabilities (run.json) the policies whose predicted tokens were far off or that ran below ar;
    and the per-policy traffic table has the predicted H2D bytes per cycle beside the measured."""
    from specfit.accounting import waiting_note
    from specfit.runtime.commands import raw_acceptance_notes

    rows = [{"policy": policy, "cycle": i, "draft_levels": 2, "nodes_verified": 5, "hits": 6, "misses": 2,
             "bytes_h2d": 4e6, "predicted_bytes_h2d": 5e6, "measured_time_s": 0.01, "predicted_time_s": 0.01,
             "predicted_tokens": 1.5, "committed_tokens": 3} for policy in ("ar", "eagle3", "specfit") for i in range(4)]
    run = tmp_path / "run"
    run.mkdir()
    pd.DataFrame(rows).to_parquet(run / "cycles.parquet")
    summaries = [{"policy": "ar", "tokens_per_s": 527.1, "tokens_per_cycle": 1.0, "predicted_tokens_per_cycle": 1.0},
                 {"policy": "eagle3", "tokens_per_s": 381.4, "tokens_per_cycle": 3.32, "predicted_tokens_per_cycle": 1.5,
                  "waited_cycles": 0.6, "waited_share": 0.4, "time_mape": 0.3},
                 {"policy": "specfit", "tokens_per_s": 470.7, "tokens_per_cycle": 1.24, "predicted_tokens_per_cycle": 1.13}]
    (run / "summary.json").write_text(json.dumps(summaries))
    terminal = [waiting_note(summaries[1]), *(n.removeprefix("note: ") for n in raw_acceptance_notes(summaries))]
    assert len(terminal) == 3 and "below ar's 527.1" in terminal[2]
    for acceptance, shown in ((None, terminal), ("trace.parquet", terminal[:1])):
        (run / "run.json").write_text(json.dumps({"kind": "decode", "acceptance": acceptance, "temperature": 0.0,
                                                  "notes": ["the profile was measured on another machine"]}))
        said = []
        text = build_report([run], tmp_path / f"rep{acceptance}", say=said.append).read_text()
        assert said == [f"note: {note}" for note in ["the profile was measured on another machine", *shown]]
        assert all(html.escape(note) in text for note in shown)
        assert ("raw probabilities" in text) == (acceptance is None)
    table = text[text.index("Per policy: host-to-device traffic"):]
    header = re.findall(r"<th>([^<]*)</th>", table[:table.index("</thead>")])
    cells = re.findall(r"<td>([^<]*)</td>", table)
    row = dict(zip(header, cells))
    assert row["MB H2D/cycle (measured)"] == "4" and row["MB H2D/cycle (predicted)"] == "5"


def test_simulation_bar_labels_write_speed_ups_as_the_terminal_does():
    """The bars' speed-up labels were ``f"{x:.2f}x"``: a 0.2% loss read 1.00x where simulate's table
    says 0.998x, and a run without ar labelled every bar "nanx"."""
    from specfit.accounting import with_speedups
    from specfit.report.html import Page
    from specfit.report.simulation import simulation_section

    def page_of(policies, rates):
        summary = pd.DataFrame({"trace": "t", "profile": "pcie4", "cache_experts": 0, "policy": policies,
                                "tokens_per_s": rates, "bytes_per_token": 1e6})
        page = Page("t")
        simulation_section(page, with_speedups(summary, ["trace", "profile", "cache_experts"]), None, "run")
        return page.render()

    text = page_of(["ar", "specfit"], [10.0, 9.98])
    assert "<!-- 0.998x -->" in text and "<!-- 1.00x -->" in text
    text = page_of(["eagle3", "specfit"], [5.0, 9.0])
    assert "nanx" not in text and not re.search(r"<!-- [^>]*x -->", text)


def test_a_global_caches_sizes_are_labelled_experts_in_all_not_per_layer(tmp_path):
    """simulate --cache-mode global counts a cache in experts of every layer together; its report
    called 256 cached experts (of 16 x 64) "experts the cache holds per layer", 4x what the model has."""
    trace = REPO / "traces" / "olmoe-1b-7b-real-routing.parquet"
    runs = {}
    for mode in ("per_layer", "global"):
        out = tmp_path / mode
        result = CliRunner().invoke(app, ["simulate", "--trace", str(trace), "--profile", "pcie4", "--policies",
                                          "ar,specfit", "--cache-experts", "0,256" if mode == "global" else "0,16",
                                          "--cache-mode", mode, "--out", str(out)])
        assert result.exit_code == 0, result.output
        runs[mode] = html.unescape(build_report([out], tmp_path / f"rep-{mode}").read_text())
    assert "cached experts: experts the cache holds in all;" in runs["global"]
    assert "(experts in all)" in runs["global"] and "<!-- cached experts in all -->" in runs["global"]
    assert "cached experts: experts the cache holds per layer;" in runs["per_layer"]
    assert "<!-- cached experts per layer -->" in runs["per_layer"]
    # a sweep's heat map of a global cache, likewise
    from specfit.report.html import Page
    from specfit.report.sweep import sweep_section

    page = Page("t")
    sweep_section(page, pd.DataFrame({"trace": "t", "profile": "pcie4", "policy": "ar", "cache_mode": "global",
                                      "cache_experts": [0, 0, 256, 256], "link_gbps": [25.0, 50.0] * 2,
                                      "tokens_per_s": [1.0, 2.0, 3.0, 4.0]}), "sweep")
    assert "by expert-cache size (experts in all)" in html.unescape(page.render())


def test_the_refit_tables_errors_are_percentages_as_the_facts_above_it(profile_path, tmp_path):
    """The refit's table wrote its held-out MAPE and max APE as fractions (0.1012) under the facts'
    "MAPE 9.8%" and calibrate --refit's "10.1%": a reader took a 10% error for 0.1%."""
    from specfit.calibrate.profile import load_profile

    profile = load_profile(profile_path)
    before = {"n": 16, "mape": 0.1012, "max_ape": 0.3243, "max_abs_err": 1e-3}
    after = {"n": 16, "mape": 0.0976, "max_ape": 0.2558, "max_abs_err": 1.1e-3}
    profile.fit = {**profile.fit, "holdout": after,
                   "refit": {"n_cycles": 52, "n_holdout": 16, "before": before, "after": after,
                             "before_params": profile.cost.to_dict(), "after_params": profile.cost.to_dict()}}
    text = build_report([profile.save(tmp_path / "refit.json")], tmp_path / "rep").read_text()
    table = text[text.index("Refit on 52 decode cycles"):]
    for cell in ("10.1%", "32.4%", "9.8%", "25.6%"):
        assert f"<td>{cell}</td>" in table, cell


def test_the_early_stopping_comparison_takes_the_same_eagle3_in_every_process(tmp_path):
    """With two EAGLE-3 trees in a run (eagle3 and eagle3:16:4) the early-stopping facts compared
    SpecFit with whichever a set of the policy names gave first, which changes with the process's
    string hashing: one `specfit report` of a run said eagle3's tokens per cycle, the next the other's."""
    rows = [{"policy": p, "sequence": 0, "position": i, "cycle": i, "draft_levels": levels, "deepest_selected": levels,
             "nodes_verified": 1 + levels, "committed_tokens": tokens, "time_s": 0.01, "measured_time_s": 0.01,
             "draft_time_s": 0.002 * levels}
            for p, levels, tokens in (("ar", 0, 1), ("eagle3:16:4", 4, 2), ("eagle3", 7, 3), ("specfit", 2, 2))
            for i in range(3)]
    path = tmp_path / "cycles.parquet"
    pd.DataFrame(rows).to_parquet(path)
    script = ("import sys, pandas as pd; from specfit.report.html import Page; from specfit.report.live import _stopping; "
              "page = Page('t'); _stopping(page, pd.read_parquet(sys.argv[1])); print(page.render())")
    for seed in range(6):
        out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, check=True,
                             cwd=REPO, env={**os.environ, "PYTHONHASHSEED": str(seed), "PYTHONPATH": str(REPO)}).stdout
        assert "tokens per cycle (specfit / eagle3)</th><td>2.00 / 3.00</td>" in out, seed


def test_a_sampled_runs_early_stopping_is_shown_for_its_specfit_online():
    """A sampled run's SpecFit is named specfit+online: the early-stopping section looked for a policy
    named specfit only, and left the section out."""
    from specfit.report.html import Page
    from specfit.report.live import _stopping

    rows = [{"policy": p, "sequence": 0, "position": i, "cycle": i, "draft_levels": levels, "committed_tokens": tokens,
             "time_s": 0.01, "draft_time_s": 0.002 * levels}
            for p, levels, tokens in (("ar", 0, 1), ("eagle3", 7, 3), ("specfit+online", 2, 2)) for i in range(3)]
    page = Page("t")
    _stopping(page, pd.DataFrame(rows))
    html = page.render()
    assert "tokens per cycle (specfit+online / eagle3)</th><td>2.00 / 3.00</td>" in html
    assert "cycles where specfit+online drafted fewer levels than eagle3 (7)</th><td>100% of 3</td>" in html
