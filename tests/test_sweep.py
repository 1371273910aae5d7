"""``specfit sweep``: the spec and its cells, the resumable dataset, and a small sweep on a local
Ray instance (2 CPUs) whose every row is checked against the same setting run with ``simulate``;
an interrupted sweep (SIGINT, then SIGKILL) resumes with no cell lost or computed twice."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from process_helpers import default_sigint
from trace_helpers import ROOT, SAMPLE_OLMOE
from typer.testing import CliRunner

from specfit.cli import app
from specfit.errors import SpecFitError
from specfit.simulate.dataset import (
    done_cell_ids,
    part_files,
    read_results,
    remove_stale_temporaries,
    write_part,
)
from specfit.simulate.grid import expand, load_spec
from specfit.traces.format import read_trace

# 2 x 2 x 2 x 4 = 32 cells: two link speeds, two cache sizes, two predictors, four policies
GRID_TOML = """
traces = ["{trace}"]
profiles = "pcie4"
h2d_scale = [1, 2]
cache_experts = [0, 16]
predictor = ["oracle", "affinity"]
policies = ["ar", "eagle3", "specfit", "static:auto"]
"""
GRID_YAML = """
traces: ["{trace}"]
profiles: pcie4
h2d_scale: [1, 2]
cache_experts: [0, 16]
predictor: [oracle, affinity]
policies: [ar, eagle3, specfit, static:auto]
"""
SIMULATE_COLUMNS = ("trace", "profile", "cache_experts", "policy", "predictor", "slot_precision", "tokens", "cycles",
                    "time_s", "tokens_per_s", "tokens_per_cycle", "bytes_h2d", "bytes_per_token", "hit_rate",
                    "nodes_per_cycle", "draft_levels_per_cycle", "wasted_draft_levels", "predicted_tokens_per_cycle",
                    "tokens_bias", "time_bias", "time_mape", "union_mape", "union_precision", "union_recall",
                    "miss_count_error", "miss_count_abs_error", "static_n", "speedup_vs_ar", "speedup_vs_eagle3")


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _grid_spec(tmp_path: Path, fmt: str = "toml", trace: Path = SAMPLE_OLMOE) -> Path:
    if not (tmp_path / "olmoe.parquet").exists():
        shutil.copy(trace, tmp_path / "olmoe.parquet")
    return _write(tmp_path / f"grid.{fmt}", (GRID_TOML if fmt == "toml" else GRID_YAML).format(trace="olmoe.parquet"))


def _routing_log(path: Path, tokens_per_sequence: int) -> Path:
    """The sample trace's real routing (its reference tokens' experts) as a routing log, each
    sequence cut to its first tokens."""
    trace = read_trace(SAMPLE_OLMOE)
    roots = trace.offsets[:-1]
    keep = np.concatenate([np.flatnonzero(trace.sequence == s)[:tokens_per_sequence] for s in np.unique(trace.sequence)])
    np.savez(path, expert_ids=trace.true_experts[roots[keep]].astype(np.int64),
             sequence_id=trace.sequence[keep].astype(np.int64), token_id=trace.token[roots[keep]].astype(np.int64))
    return path


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory) -> Path:
    """A two-sequence trace of 2 x 47 positions on the sample's real routing (a quick replay)."""
    folder = tmp_path_factory.mktemp("small")
    out = folder / "olmoe-small.parquet"
    r = CliRunner().invoke(app, ["traces", "import-routing", str(_routing_log(folder / "routing.npz", 48)),
                                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    return out


# ------------------------------------------------------------------ the spec and its cells (no Ray)
def test_toml_and_yaml_specs_give_the_same_cells(tmp_path):
    toml_cells = expand(load_spec(_grid_spec(tmp_path, "toml")))
    yaml_cells = expand(load_spec(_grid_spec(tmp_path, "yaml")))
    assert toml_cells == yaml_cells
    assert len(toml_cells) == 32
    # every combination once, scalars taken as one-value axes
    combos = {(c.h2d_scale, c.cache_experts, c.predictor, c.policy) for c in toml_cells}
    assert len(combos) == 32 and {c.profile_source for c in toml_cells} == {"pcie4"}
    ids = [c.cell_id for c in toml_cells]
    assert len(set(ids)) == 32


def test_cell_ids_follow_parameters_and_file_contents(tmp_path):
    spec = _grid_spec(tmp_path)
    first = [c.cell_id for c in expand(load_spec(spec))]
    assert first == [c.cell_id for c in expand(load_spec(spec))]          # stable across runs
    # a file with the same name but other bytes is another input: every id changes
    data = (tmp_path / "olmoe.parquet").read_bytes()
    (tmp_path / "olmoe.parquet").write_bytes(data + b"\0")
    assert not set(first) & {c.cell_id for c in expand(load_spec(spec))}


def test_bad_specs_name_the_file_and_field(tmp_path):
    shutil.copy(SAMPLE_OLMOE, tmp_path / "olmoe.parquet")
    cases = [
        ('traces = ["olmoe.parquet"]\npolicy = ["ar"]', "unknown field(s) ['policy']"),
        ('traces = ["olmoe.parquet"]\npolicies = ["ar", "warp"]', "field 'policies'"),
        ('traces = ["olmoe.parquet"]\ncache_experts = [8, "x"]', "field 'cache_experts' must hold int"),
        ('traces = ["olmoe.parquet"]\ncache_experts = [8, 8]', "lists a value twice"),
        ('traces = ["olmoe.parquet"]\npredictor = "psychic"', "field 'predictor'"),
        ('traces = ["olmoe.parquet"]\ncost = "base_s=x"', "field 'cost'"),
        ('traces = ["nosuch.parquet"]', "'nosuch.parquet' (relative to"),
        ('policies = ["ar"]', "no traces"),
        ('routing = [{log = "olmoe.parquet", drafters = ["poetry"]}]', "field 'drafters'"),
        ('routing = [{log = "olmoe.parquet", drafters = [{name = "chat"}]}]', "field 'drafters'"),
        ('traces = ["olmoe.parquet"', "not valid TOML"),
        ('traces = ["olmoe.parquet"]\nh2d_scale = [1, 0]', "field 'h2d_scale': expected values finite and > 0, got 0"),
        ('traces = ["olmoe.parquet"]\ncache_experts = [8, -4]', "field 'cache_experts': expected values >= 0, got -4"),
    ]
    for text, message in cases:
        with pytest.raises(SpecFitError) as err:
            load_spec(_write(tmp_path / "bad.toml", text))
        assert "bad.toml" in str(err.value) and message in str(err.value), (text, str(err.value))
    with pytest.raises(SpecFitError, match="unknown spec format"):
        load_spec(_write(tmp_path / "spec.ini", "x=1"))
    with pytest.raises(SpecFitError) as err:                 # one line, with where the parser stopped
        load_spec(_write(tmp_path / "bad.yaml", "traces: [\n"))
    assert "bad.yaml: not valid YAML at line 2" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(SpecFitError, match="unknown field\\(s\\) \\['1'\\]"):   # a key YAML reads as a number
        load_spec(_write(tmp_path / "keys.yaml", 'traces: ["olmoe.parquet"]\n1: a\n'))
    (tmp_path / "latin1.toml").write_bytes('traces = ["olmoe.parquet"] # caf\xe9'.encode("latin-1"))
    with pytest.raises(SpecFitError, match="latin1.toml: not a readable sweep spec"):
        load_spec(tmp_path / "latin1.toml")


def test_sweep_without_ray_is_one_line_and_exit_2(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)       # `import ray` raises ImportError
    r = CliRunner().invoke(app, ["sweep", str(_grid_spec(tmp_path)), "--out", str(tmp_path / "out")])
    assert r.exit_code == 2
    assert r.output.strip() == "error: specfit sweep needs Ray: pip install 'specfit[sweep]'"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("option", ["--num-cpus", "--chunk-cells", "--top"])
@pytest.mark.parametrize("value", ["0", "-1"])
def test_sweep_counts_below_one_are_one_line_before_ray_starts(tmp_path, option, value):
    r = CliRunner().invoke(app, ["sweep", str(_grid_spec(tmp_path)), "--out", str(tmp_path / "out"), option, value])
    assert r.exit_code == 2
    assert r.output.strip() == f"error: {option}: expected a positive number, got {value}"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("field, value, needle", [
    ("profiles", '"no-such-preset"', "field 'profiles': 'no-such-preset'"),
    ("profiles", '"empty.json"', "field 'profiles': "),
    ("traces", '["truncated.parquet"]', "not a Parquet trace file"),
    # a cost term out of range is found with the profile it overrides: named by its own field
    ("cost", '"base_s=-1"', "field 'cost': CostModel.base_s: expected a finite non-negative number"),
])
def test_a_spec_naming_a_bad_profile_or_trace_is_one_line_and_leaves_nothing(tmp_path, field, value, needle):
    """The inputs are checked before the grid is recorded: no sweep.json or run.json that a report
    would take for an empty sweep, and no directory the run created."""
    (tmp_path / "empty.json").write_text("{}")
    (tmp_path / "truncated.parquet").write_bytes(SAMPLE_OLMOE.read_bytes()[:1000])
    text = GRID_TOML.format(trace="olmoe.parquet")
    text = (text.replace(f"{field} = ", f"{field} = {value}\n# was: ", 1) if f"{field} = " in text
            else f"{field} = {value}\n{text}")
    shutil.copy(SAMPLE_OLMOE, tmp_path / "olmoe.parquet")
    spec = _write(tmp_path / "bad.toml", text)
    r = CliRunner().invoke(app, ["sweep", str(spec), "--out", str(tmp_path / "out"), "--num-cpus", "1"])
    lines = [line for line in r.output.splitlines() if line.startswith("error: ")]
    assert r.exit_code == 2 and len(lines) == 1 and needle in lines[0], r.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("shape, needle", [
    (None, "no known model shape has 3 layers x top-2; give routing[0] in {spec} a 'shape' field"),
    ("olmo", "{spec}: routing[0]: field 'shape': unknown model shape 'olmo'"),
])
def test_a_routing_log_of_no_known_shape_names_the_spec_field_to_set(tmp_path, shape, needle):
    """The sweep has no --shape or --model option: the error says which field of the spec to set."""
    experts = np.tile(np.arange(2, dtype=np.int16), (6, 3, 1))
    np.savez(tmp_path / "log.npz", expert_ids=experts, sequence_id=np.zeros(6, dtype=np.int32))
    entry = 'log = "log.npz", drafters = ["chat"]' + (f', shape = "{shape}"' if shape else "")
    spec = _write(tmp_path / "routing.toml", f'routing = [{{{entry}}}]\nprofiles = "pcie4"\npolicies = ["ar"]\n')
    r = CliRunner().invoke(app, ["sweep", str(spec), "--out", str(tmp_path / "out"), "--num-cpus", "1"])
    lines = [line for line in r.output.splitlines() if line.startswith("error: ")]
    assert r.exit_code == 2 and len(lines) == 1 and needle.format(spec=spec) in lines[0], r.output
    assert "--shape" not in lines[0] and not (tmp_path / "out").exists()


def test_an_address_nothing_answers_on_is_one_line(tmp_path):
    import socket

    with socket.socket() as sock:       # a port that was free a moment ago: nothing listens on it
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    r = CliRunner().invoke(app, ["sweep", str(_grid_spec(tmp_path)), "--out", str(tmp_path / "out"), "--address",
                                 f"127.0.0.1:{port}"])
    assert r.exit_code == 2
    assert r.output.startswith(f"error: --address 127.0.0.1:{port}: no Ray head answers there")


def test_parts_are_whole_files_and_temporaries_are_removed(tmp_path):
    rows = [{"cell_id": f"c{i}", "policy": "ar", "tokens_per_s": float(i), "static_n": None} for i in range(3)]
    write_part(tmp_path, rows[:2])
    write_part(tmp_path, rows[2:])
    stale = tmp_path / "results" / ".part-x.parquet.abc.tmp"
    stale.write_bytes(b"half a parquet file")
    assert done_cell_ids(tmp_path) == {"c0", "c1", "c2"}              # a temporary is never a part
    assert remove_stale_temporaries(tmp_path) == 1 and not stale.exists()
    write_part(tmp_path, rows[1:2])                                   # c1 twice: refused on read
    with pytest.raises(SpecFitError, match="appears in two part files"):
        read_results(tmp_path)


def test_a_figure_missing_from_a_whole_part_reads_back_as_numbers(tmp_path):
    """A chunk of cache-lever policies has no layer-ahead recount: its part stores the figures as
    a column of nulls, which beside another part's numbers once read back as text (the report
    then printed it unformatted); a text column stays text."""
    figures = {"layer_ahead_tokens_per_s": 12.3456789, "layer_ahead_precision": 0.25}
    write_part(tmp_path, [{"cell_id": "a", "policy": "ar", "note": "x", **figures}])
    write_part(tmp_path, [{"cell_id": "b", "policy": "specfit+cache", "note": None,
                           **dict.fromkeys(figures)}])
    frame = read_results(tmp_path).set_index("cell_id")
    for column, value in figures.items():
        assert frame[column].dtype == np.float64 and frame.at["a", column] == value and np.isnan(frame.at["b", column])
    assert frame["note"].dtype == object and frame.at["a", "note"] == "x"


def test_a_speedup_takes_its_baseline_whatever_the_baselines_layer_ahead(tmp_path):
    """A recount changes no replay figure: a grid whose ``ar`` cell is in the dataset only without
    the recount still gives the recounted ``specfit`` cell its speed-up (it was blank until the
    ``ar`` cell of the same layer_ahead came)."""
    base = {"trace": "t", "profile": "p", "cache_experts": 0}
    write_part(tmp_path, [{**base, "cell_id": "a", "policy": "ar", "layer_ahead": "none", "tokens_per_s": 10.0},
                          {**base, "cell_id": "b", "policy": "specfit", "layer_ahead": "eam", "tokens_per_s": 12.0,
                           "layer_ahead_tokens_per_s": 13.0}])
    frame = read_results(tmp_path).set_index("cell_id")
    assert frame.at["b", "speedup_vs_ar"] == pytest.approx(1.2)


# ------------------------------------------------------------------ on Ray
@pytest.fixture(scope="module")
def grid_sweep(ray_local, small_trace, tmp_path_factory):
    """The 32-cell grid swept once on the local Ray instance (CLI, JSON output)."""
    folder = tmp_path_factory.mktemp("grid")
    spec = _grid_spec(folder, trace=small_trace)
    r = CliRunner().invoke(app, ["sweep", str(spec), "--out", str(folder / "out"), "--json"])
    assert r.exit_code == 0, r.output
    return folder, spec, pd.read_json(__import__("io").StringIO(r.stdout), orient="records")


def _simulate_reference(folder: Path, predictor: str, h2d_scale: float) -> pd.DataFrame:
    out = folder / f"sim-{predictor}-{h2d_scale:g}"
    r = CliRunner().invoke(app, ["simulate", "--trace", str(folder / "olmoe.parquet"), "--profile", "pcie4",
                                 "--h2d-scale", str(h2d_scale), "--cache-experts", "0,16", "--predictor", predictor,
                                 "--policies", "ar,eagle3,specfit,static:auto", "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    return pd.read_parquet(out / "summary.parquet")


def _same(a, b) -> bool:
    if pd.isna(a) and pd.isna(b):
        return True
    return a == b


def test_every_row_equals_the_same_cell_run_with_simulate(grid_sweep):
    folder, spec, rows = grid_sweep
    results = read_results(folder / "out")                  # full precision, from the Parquet parts
    assert len(results) == 32 and results["cell_id"].is_unique
    assert set(results["cell_id"]) == {c.cell_id for c in expand(load_spec(spec))}
    assert len(rows) == 32 and set(SIMULATE_COLUMNS) <= set(rows.columns)
    for col in ("h2d_scale", "cache_mode", "cache_policy", "acceptance", "max_levels", "link_gbps", "replay_s"):
        assert col in results.columns
    # a part stores no speed-ups (its baseline may be in another part): reading computes every one
    parts = pd.concat(pd.read_parquet(p) for p in part_files(folder / "out"))
    assert not {"speedup_vs_ar", "speedup_vs_eagle3"} & set(parts.columns)
    assert results["speedup_vs_ar"].notna().all() and results["speedup_vs_eagle3"].notna().all()
    keys = ["profile", "cache_experts", "policy", "predictor"]
    for predictor in ("oracle", "affinity"):
        for h2d in (1.0, 2.0):
            reference = _simulate_reference(folder, predictor, h2d).set_index(keys)
            mine = results[(results["predictor"] == predictor) & (results["h2d_scale"] == h2d)].set_index(keys)
            assert len(mine) == len(reference) == 8
            for key, ref_row in reference.iterrows():
                row = mine.loc[key]
                for col in SIMULATE_COLUMNS:
                    if col in keys:
                        continue
                    assert _same(row[col], ref_row[col]), (key, col, row[col], ref_row[col])
            assert np.allclose(mine["link_gbps"], 25.0 * h2d)       # pcie4 is 25 GB/s


def test_resume_recomputes_only_missing_cells(grid_sweep, tmp_path):
    folder, spec, _ = grid_sweep
    out = tmp_path / "out"
    shutil.copytree(folder / "out", out)
    before = read_results(out)
    removed = part_files(out)[:3]
    lost = set(pd.concat(pd.read_parquet(p) for p in removed)["cell_id"])
    for p in removed:
        p.unlink()
    r = CliRunner().invoke(app, ["sweep", str(spec), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert f"{len(lost)} cells replayed now, {32 - len(lost)} already in the dataset" in r.output
    after = read_results(out)
    cols = [c for c in before.columns if c != "replay_s"]
    pd.testing.assert_frame_equal(after[cols], before[cols])


def test_report_of_a_sweep_has_a_heat_map_panel_per_policy(grid_sweep, tmp_path):
    folder, _, _ = grid_sweep
    r = CliRunner().invoke(app, ["report", str(folder / "out"), "--out", str(tmp_path / "report")])
    assert r.exit_code == 0, r.output
    page = (tmp_path / "report" / "index.html").read_text()
    assert "Sweep: " in page and "cells finished</th><td>32 of 32" in page
    # one figure for the one trace: cache size x link speed per policy, best over the predictors
    assert page.count("<figure>") == 1
    assert "by expert-cache size (experts per layer) and host-to-device bandwidth, per policy; each square is the " \
           "best over predictor." in page
    assert "The 20 fastest cells" in page


def test_routing_logs_with_drafter_presets_equal_import_then_simulate(ray_local, tmp_path):
    _routing_log(tmp_path / "routing.npz", 64)
    spec = _write(tmp_path / "routing.yaml", "routing:\n  - {log: routing.npz, drafters: [chat, code], max_tokens: 96}\n"
                                              "profiles: gh200\ncache_experts: 16\npolicies: [ar, specfit]\n")
    r = CliRunner().invoke(app, ["sweep", str(spec), "--out", str(tmp_path / "out"), "--json"])
    assert r.exit_code == 0, r.output
    results = read_results(tmp_path / "out")
    assert sorted(results["trace"].unique()) == ["routing:chat", "routing:code"]
    assert set(results["drafter"]) == {"chat", "code"}
    for drafter in ("chat", "code"):
        imported = tmp_path / f"routing-{drafter}.parquet"
        r = CliRunner().invoke(app, ["traces", "import-routing", str(tmp_path / "routing.npz"), "--out", str(imported),
                                     "--workload", drafter, "--max-tokens", "96"])
        assert r.exit_code == 0, r.output
        r = CliRunner().invoke(app, ["simulate", "--trace", str(imported), "--profile", "gh200", "--cache-experts", "16",
                                     "--policies", "ar,specfit", "--out", str(tmp_path / f"sim-{drafter}")])
        assert r.exit_code == 0, r.output
        reference = pd.read_parquet(tmp_path / f"sim-{drafter}" / "summary.parquet").set_index("policy")
        mine = results[results["drafter"] == drafter].set_index("policy")
        for policy in ("ar", "specfit"):
            for col in ("tokens", "cycles", "time_s", "bytes_h2d", "hit_rate", "nodes_per_cycle"):
                assert mine.loc[policy, col] == reference.loc[policy, col], (drafter, policy, col)
    # the drafter decides the trees: the code preset accepts more per cycle
    spec_rows = results[results["policy"] == "specfit"].set_index("drafter")
    assert spec_rows.loc["code", "tokens_per_cycle"] > spec_rows.loc["chat", "tokens_per_cycle"]


def _sweep_process(spec: Path, out: Path, address: str) -> subprocess.Popen:
    """A sweep in its own process (and process group) that joins the test's Ray instance."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "specfit", "sweep", str(spec), "--out", str(out), "--address",
                             address, "--chunk-cells", "1"], env=env, cwd=str(spec.parent), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True, preexec_fn=default_sigint)


def _wait_for_parts(proc: subprocess.Popen, out: Path, more_than: int, timeout_s: float = 300) -> int:
    # a guard against a hung sweep only: beside two CPU-bound processes on 2 cores, its first part
    # took over 120 s (the process, its Ray workers and their kernels start on a third of a core)
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        n = len(part_files(out)) if (out / "results").exists() else 0
        if n > more_than or proc.poll() is not None:
            return n
        time.sleep(0.02)
    raise AssertionError(f"the sweep wrote no part file in {timeout_s:.0f} s")


def _no_temporaries(out: Path) -> bool:
    return not list(out.rglob("*.tmp"))


@pytest.mark.slow
def test_sigint_then_sigkill_then_resume_loses_and_repeats_no_cell(ray_local, tmp_path):
    # the whole sample trace: its cells take long enough (the compiled replay runs a 94-position
    # trace's cell in milliseconds) for the signals to land while cells are still running
    spec = _grid_spec(tmp_path)
    out = tmp_path / "out"
    address = ray_local.get_runtime_context().gcs_address
    # 1. Ctrl-C: the driver cancels its tasks, keeps every finished chunk and exits 130
    proc = _sweep_process(spec, out, address)
    _wait_for_parts(proc, out, more_than=0)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr.decode()
    assert b"run the same command again to resume" in stderr
    after_sigint = done_cell_ids(out)
    assert 0 < len(after_sigint) < 32 and _no_temporaries(out)
    # 1b. a kill's SIGTERM stops it the same way, status 143 (Ray's driver handler would exit 15 at once)
    proc = _sweep_process(spec, out, address)
    _wait_for_parts(proc, out, more_than=len(part_files(out)))
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr.decode()
    assert b"run the same command again to resume" in stderr and b"SIGTERM received" not in stderr
    after_sigint = done_cell_ids(out)
    assert len(after_sigint) < 32 and _no_temporaries(out)
    # 2. kill -9 while it writes
    proc = _sweep_process(spec, out, address)
    n = _wait_for_parts(proc, out, more_than=len(part_files(out)))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    after_kill = done_cell_ids(out)
    assert after_sigint < after_kill and n <= len(after_kill) < 32     # a part may land before the kill
    for part in part_files(out):
        pd.read_parquet(part)                                    # every part is a whole file
    # 3. resume: only the missing cells run, each cell is in the dataset exactly once
    r = CliRunner().invoke(app, ["sweep", str(spec), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert f"{32 - len(after_kill)} cells replayed now, {len(after_kill)} already in the dataset" in r.output
    results = read_results(out)
    assert len(results) == 32 and results["cell_id"].is_unique and _no_temporaries(out)
    r = CliRunner().invoke(app, ["sweep", str(spec), "--out", str(tmp_path / "reference")])
    assert r.exit_code == 0, r.output
    reference = read_results(tmp_path / "reference").set_index("cell_id")
    cols = [c for c in SIMULATE_COLUMNS]
    pd.testing.assert_frame_equal(results.set_index("cell_id")[cols], reference.loc[results["cell_id"], cols])


def test_sweep_tells_each_policy_the_share_of_a_layer_its_cache_holds(monkeypatch):
    from specfit.costmodel import CostModel
    from specfit.policies import make_policy
    from specfit.simulate import sweep
    from specfit.simulate.prepared import prepare

    from trace_helpers import hand_trace

    shares = []

    def recording_policy(spec, **kwargs):
        policy = make_policy(spec, **kwargs)
        observe = policy.observe

        def spy(observation):
            if observation.resident_share is not None:
                shares.append(observation.resident_share)
            return observe(observation)

        policy.observe = spy
        return policy

    monkeypatch.setattr(sweep, "make_policy", recording_policy)
    trace = hand_trace()                                   # 4 experts per layer
    cost = CostModel(base_s=1.0, per_node_s=0.1, hit_s=0.01, miss_s=0.5, draft_level_s=0.2, expert_bytes=1000)
    sweep.run_sweep([prepare("hand", trace, trace.true_experts)], ["specfit"], [1, 2], [sweep.Scenario("hand", cost)])
    assert sorted(shares) == [0.25, 0.5]                   # what the uncertainty price weighs misses by


def test_link_bandwidths_are_written_as_they_are_not_rounded_to_whole_gb_per_s(capsys, tmp_path):
    """A sweep at --h2d-scale 0.5 and 0.25 of pcie4 (25 GB/s) printed links of 12 and 6 GB/s, in
    the terminal's table and the heat map's ticks alike (f"{gbps:.0f}"; 0.4 GB/s read 0)."""
    from types import SimpleNamespace

    import pandas as pd

    from specfit.report.sweep import heat_map_grid
    from specfit.simulate.sweep_commands import _print_sweep

    results = pd.DataFrame({"trace": "t", "profile": "pcie4", "cache_mode": "per_layer", "cache_policy": "lru",
                            "policy": "ar", "cache_experts": [0, 0, 0, 16, 16, 16], "predictor": "oracle",
                            "acceptance": "calibrated", "max_levels": 8, "price_uncertainty": True,
                            "link_gbps": [6.25, 12.5, 0.4] * 2, "tokens_per_s": [1.0, 2.0, 0.5, 3.0, 4.0, 1.5],
                            "speedup_vs_ar": 1.0, "hit_rate": 0.5, "nodes_per_cycle": 1.0})
    fig, _ = heat_map_grid(results, "t")
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["0.4", "6.25", "12.5"]
    _print_sweep(results, SimpleNamespace(computed=6, skipped=0, wall_s=1.0, workers=1), tmp_path, top=6)
    lines = capsys.readouterr().out.splitlines()
    column = [c.strip() for c in next(line for line in lines if "link GB/s" in line).split("┃")].index("link GB/s")
    cells = [line.split("│")[column].strip() for line in lines if line.count("│") > column]
    assert sorted(cells) == ["0.4", "0.4", "12.5", "12.5", "6.25", "6.25"]
