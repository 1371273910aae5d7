"""Bad profiles, refit runs and calibrate options: every command that reads them ends in one line
naming the file (or option), the field and what was expected (exit code 2), never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from cli_helpers import invoke, one_line_error

from trace_helpers import ROOT, SAMPLE_OLMOE
from specfit.assets import tiny_moe_dir
from specfit.calibrate.profile import load_profile

VALID_PROFILE = ROOT / "calibrate" / "examples" / "vm-x86-64-tiny-moe.json"


@pytest.fixture(autouse=True)
def in_tmp_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def damaged_profile(path: Path, **changes) -> Path:
    """The bundled tiny-moe profile with top-level fields replaced (``"fit.holdout"`` reaches one level down)."""
    profile = json.loads(VALID_PROFILE.read_text())
    for key, value in changes.items():
        section, _, entry = key.partition(".")
        if entry:
            profile[section][entry] = value
        else:
            profile[section] = value
    path.write_text(json.dumps(profile))
    return path


def profile_commands(profile: Path, tmp: Path) -> dict[str, list]:
    """Commands that load --profile / a profile argument (an empty run directory gets a refit as far as the profile)."""
    (tmp / "run").mkdir(exist_ok=True)
    return {
        "simulate": ["simulate", "--trace", SAMPLE_OLMOE, "--policies", "ar", "--cache-experts", 8, "--profile", profile],
        "report": ["report", profile, "--out", tmp / "report"],
        "calibrate --refit": ["calibrate", "--refit", tmp / "run", "--profile", profile, "--out", tmp / "refit.json"],
    }


# ----------------------------------------------------------------- malformed sections
@pytest.mark.parametrize("changes, needle", [
    ({"fit": ["a", "b"]}, "field 'fit': expected a JSON object, got a list"),
    ({"fit": "x"}, "field 'fit': expected a JSON object, got 'x'"),
    ({"probes": [1]}, "field 'probes': expected a JSON object, got a list"),
    ({"machine": None}, "field 'machine': expected a JSON object, got null"),
    ({"source": 3}, "field 'source': expected a string, got 3"),
    ({"fit.holdout": "x"}, "field 'fit.holdout': expected a JSON object, got 'x'"),
    ({"fit.warnings": "busy"}, "field 'fit.warnings': expected a list, got 'busy'"),
    ({"probes.cycles": [1, 2]}, "field 'probes.cycles': expected a list of objects (one per measurement), got a list "
                                "holding 1"),
    # a misspelt term was dropped, and the model read it as 0 s
    ({"cost.draft_level_ms": 2.0}, "field 'cost': unknown cost-model field(s) ['draft_level_ms']; expected base_s, "
                                   "per_node_s, hit_s, miss_s, draft_level_s, expert_bytes"),
])
def test_a_malformed_profile_section_is_one_line_in_every_command(tmp_path, changes, needle):
    bad = damaged_profile(tmp_path / "bad.json", **changes)
    for argv in profile_commands(bad, tmp_path).values():
        one_line_error(invoke(*argv), str(bad), needle)
    assert not (tmp_path / "report").exists() and not (tmp_path / "refit.json").exists()


def test_a_profile_or_cost_that_predicts_cycles_of_no_time_is_one_line(tmp_path):
    """A cost model under which a cycle takes 0 s (tokens per 0 s) is refused where it comes in,
    not met as a traceback of the search mid-replay."""
    cost = json.loads(VALID_PROFILE.read_text())["cost"]
    bad = damaged_profile(tmp_path / "zero.json", cost={**cost, "base_s": 0.0, "per_node_s": 0.0, "hit_s": 0.0})
    for argv in profile_commands(bad, tmp_path).values():
        one_line_error(invoke(*argv), str(bad), "field 'cost': predicts cycles of 0 s")
    zero = "base_s=0,per_node_s=0,hit_s=0,miss_s=0,draft_level_s=0"
    one_line_error(invoke("simulate", "--trace", SAMPLE_OLMOE, "--policies", "ar,specfit", "--cache-experts", 8,
                          "--cost", zero, "--out", tmp_path / "sim"), "--cost: predicts cycles of 0 s")
    assert not (tmp_path / "sim").exists()
    # expert costs alone are a model: every cycle reads the root's experts, cached or copied
    assert invoke("simulate", "--trace", SAMPLE_OLMOE, "--policies", "ar", "--cache-experts", 8,
                  "--cost", "base_s=0,per_node_s=0,hit_s=1e-5").exit_code == 0


def test_a_cost_model_outside_float64s_reach_is_one_line(tmp_path):
    """Terms of 1e-311 s made every policy's tokens/s inf and the search keep the root alone (its
    ratio inf); a scale of 1e-320 overflowed a miss into a traceback. A single tiny term beside
    real ones (a fit's 1e-18) is a model."""
    tiny = "base_s=5e-311,per_node_s=1e-312,hit_s=1e-313,miss_s=1e-311,draft_level_s=1e-312"
    one_line_error(invoke("simulate", "--trace", SAMPLE_OLMOE, "--policies", "ar,specfit", "--cost", tiny),
                   "--cost: every term is below 1e-12 s")
    one_line_error(invoke("simulate", "--trace", SAMPLE_OLMOE, "--policies", "ar", "--cost", "base_s=1e307"),
                   "--cost: base_s 1e+307 s; expected at most 1e+06 s")
    one_line_error(invoke("simulate", "--trace", SAMPLE_OLMOE, "--policies", "ar", "--cache-experts", 8,
                          "--h2d-scale=1e-320"), "--h2d-scale: expected a finite positive factor that leaves a miss finite")
    assert invoke("simulate", "--trace", SAMPLE_OLMOE, "--policies", "ar", "--cache-experts", 8,
                  "--cost", "per_node_s=1e-18").exit_code == 0


def test_a_profile_or_cost_whose_miss_is_cheaper_than_a_hit_is_one_line(tmp_path):
    """A miss is a hit plus the expert's copy: a model that prices it below a hit would make the
    search prefer missing experts (a hand-edited profile, a --cost what-if)."""
    cost = json.loads(VALID_PROFILE.read_text())["cost"]
    bad = damaged_profile(tmp_path / "cheap_miss.json", cost={**cost, "miss_s": cost["hit_s"] / 2})
    for argv in profile_commands(bad, tmp_path).values():
        one_line_error(invoke(*argv), str(bad), "field 'cost': miss_s", "is below hit_s", "expected miss_s >= hit_s")
    one_line_error(invoke("simulate", "--trace", SAMPLE_OLMOE, "--policies", "ar", "--cache-experts", 8,
                          "--profile", "pcie4", "--cost", "miss_s=1e-6"), "--cost: miss_s 1e-06 is below hit_s")
    # equal is a model: every expert resident, or a copy that costs nothing more
    assert invoke("simulate", "--trace", SAMPLE_OLMOE, "--policies", "ar", "--cache-experts", 8,
                  "--cost", f"miss_s={cost['hit_s']}").exit_code == 0


def test_a_profile_that_is_not_utf8_is_one_line_in_every_command(tmp_path):
    bad = tmp_path / "latin1.json"
    bad.write_bytes(b"\xff" + VALID_PROFILE.read_bytes())
    for argv in profile_commands(bad, tmp_path).values():
        one_line_error(invoke(*argv), str(bad), "not UTF-8 JSON")


def test_a_bad_kind_names_the_profile_file(tmp_path):
    bad = damaged_profile(tmp_path / "kind.json", kind="foo")
    for argv in profile_commands(bad, tmp_path).values():
        one_line_error(invoke(*argv), f"{bad}: field 'kind' must be one of", "'foo'")


@pytest.mark.parametrize("value, shown", [(16.5, "16.5"), (True, "true (a boolean)"), ("16", "'16'"), (None, "null")])
def test_a_shape_count_that_is_not_a_whole_number_is_refused_not_truncated(tmp_path, value, shown):
    profile = json.loads(VALID_PROFILE.read_text())
    profile["shape"]["n_experts"] = value
    bad = tmp_path / "shape.json"
    bad.write_text(json.dumps(profile))
    for argv in profile_commands(bad, tmp_path).values():
        one_line_error(invoke(*argv), str(bad), f"field 'shape.n_experts': expected an integer, got {shown}")


def test_a_shape_count_written_as_a_whole_float_still_reads(tmp_path):
    profile = json.loads(VALID_PROFILE.read_text())
    profile["shape"]["n_experts"] = float(profile["shape"]["n_experts"])
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile))
    assert load_profile(path).shape.n_experts == int(profile["shape"]["n_experts"])


def test_the_bundled_profiles_pass_the_checks():
    for path in sorted((ROOT / "calibrate").glob("*.json")):
        load_profile(path)


# ----------------------------------------------------------------- refit runs
def write_run(run: Path, measured_time_s: np.ndarray, run_json: str | None = None) -> Path:
    """A `specfit decode --out` run directory with the cycle columns a refit reads."""
    run.mkdir()
    n = measured_time_s.size
    rng = np.random.default_rng(0)
    pd.DataFrame({"draft_levels": rng.integers(0, 6, n), "nodes_verified": rng.integers(1, 30, n),
                  "hits": rng.integers(0, 200, n), "misses": rng.integers(0, 50, n),
                  "measured_time_s": measured_time_s}).to_parquet(run / "cycles.parquet")
    if run_json is not None:
        (run / "run.json").write_text(run_json)
    return run


def test_a_refit_of_cycles_with_non_positive_times_names_the_cycles_file(tmp_path):
    times = np.full(20, 0.01)
    times[5] = -1.0
    run = write_run(tmp_path / "run", times)
    one_line_error(invoke("calibrate", "--refit", run, "--profile", "pcie4", "--out", tmp_path / "p.json"),
                   str(run / "cycles.parquet"), "'measured_time_s' <= 0", "-1", "positive seconds")
    assert not (tmp_path / "p.json").exists()


def test_a_refit_of_cycles_with_a_negative_count_names_the_cycles_file_and_column(tmp_path):
    run = write_run(tmp_path / "run", np.linspace(0.01, 0.02, 20))
    cycles = pd.read_parquet(run / "cycles.parquet")
    cycles.loc[3, "hits"] = -2
    cycles.to_parquet(run / "cycles.parquet")
    one_line_error(invoke("calibrate", "--refit", run, "--profile", "pcie4", "--out", tmp_path / "p.json"),
                   str(run / "cycles.parquet"), "column 'hits' holds -2 (cycle 3)", "non-negative whole counts")


@pytest.mark.parametrize("run_json, needle", [
    ("{", "not a readable JSON file"),
    ("[1, 2]", "expected a JSON object at the top level"),
    (json.dumps({"kind": "decode", "shape": {"name": "m", "n_layers": 2, "n_experts": 8.5, "top_k": 2,
                                              "expert_bytes": 10}}), "field 'shape.n_experts': expected an integer"),
])
def test_a_refit_of_a_run_with_a_corrupt_run_json_names_it(tmp_path, run_json, needle):
    run = write_run(tmp_path / "run", np.linspace(0.01, 0.02, 20), run_json)
    one_line_error(invoke("calibrate", "--refit", run, "--profile", "pcie4", "--out", tmp_path / "p.json"),
                   str(run / "run.json"), needle)
    assert not (tmp_path / "p.json").exists()


def test_a_refit_of_a_run_without_run_json_still_works(tmp_path):
    run = write_run(tmp_path / "run", np.linspace(0.01, 0.02, 20))
    result = invoke("calibrate", "--refit", run, "--profile", "pcie4", "--out", tmp_path / "p.json")
    assert result.exit_code == 0, result.output
    assert load_profile(tmp_path / "p.json").kind == "refit"


# ----------------------------------------------------------------- calibrate options
@pytest.mark.parametrize("argv, needle", [
    (["--model", tiny_moe_dir(), "--dtype", "int8"], "--dtype: expected one of float32, bfloat16, float16, got 'int8'"),
    (["--shape", "tiny", "--layers", 1, "--dtype", "int8"], "--dtype: expected one of float32, bfloat16, float16"),
    (["--model", tiny_moe_dir(), "--seed", -1], "--seed: expected a non-negative integer, got -1"),
    (["--shape", "tiny", "--layers", 1, "--seed", -1], "--seed: expected a non-negative integer, got -1"),
    (["--refit", ".", "--profile", "pcie4", "--seed", -1], "--seed: expected a non-negative integer, got -1"),
    (["--profile", "pcie5"], "--profile pcie5: a profile to refit goes with --refit RUN_DIR"),
    (["--shape", "tiny", "--profile", "pcie5"], "--profile pcie5: a profile to refit goes with --refit RUN_DIR"),
])
def test_bad_calibrate_options_are_refused_before_any_work(tmp_path, argv, needle):
    one_line_error(invoke("calibrate", "--quick", *argv, "--out", tmp_path / "p.json"), needle)
    assert not (tmp_path / "p.json").exists()


def test_an_error_without_a_value_is_written_as_null_and_read_back_as_nan(tmp_path):
    # strict JSON has no NaN: a held-out error over no cycle is null in the file, NaN in the profile
    profile = load_profile(VALID_PROFILE)
    profile.fit["holdout"] = {**profile.fit["holdout"], "mape": float("nan")}
    profile.fit["probe_noise"] = {**profile.fit["probe_noise"], "spread_median": float("nan"), "cpu_share": None}
    path = profile.save(tmp_path / "p.json")
    raw = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in a profile"))
    assert raw["fit"]["holdout"]["mape"] is None and raw["fit"]["probe_noise"]["spread_median"] is None
    again = load_profile(path)
    assert np.isnan(again.fit["holdout"]["mape"]) and np.isnan(again.fit["probe_noise"]["spread_median"])
    assert again.fit["probe_noise"]["cpu_share"] is None and again.fit["h2d_pageable"] is None  # "not measured"
    assert invoke("report", path, "--out", tmp_path / "r").exit_code == 0
