"""Bad input, class by class: every command ends in one line naming the file, field or option and
what was expected (exit code 2), having written nothing."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cli_helpers import invoke, one_line_error

from runtime_fixtures import make_tiny_model
from runtime_fixtures import torch_single_thread  # noqa: F401  (autouse: one intra-op thread)
from trace_helpers import SAMPLE_OLMOE

from specfit.errors import SpecFitError


@pytest.fixture(autouse=True)
def in_tmp_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_input")
    model = make_tiny_model("qwen3_moe", root / "model", seed=3)
    (root / "prompts.jsonl").write_text(json.dumps({"input_ids": [3, 1, 4]}) + "\n")
    return model


def files_under(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*")}


# ----------------------------------------------------------------- output paths
def _commands(model_dir: Path, tmp: Path, out_dir: str, out_file: str) -> dict[str, list]:
    prompts = model_dir.parent / "prompts.jsonl"
    decode = ["decode", "--model", model_dir, "--prompts", prompts, "--cache-experts", 2, "--profile", "pcie4",
              "--max-new-tokens", 2]
    return {
        "decode --out": decode + ["--out", out_dir],
        "decode --record": decode + ["--record", out_file],
        "simulate --out": ["simulate", "--trace", SAMPLE_OLMOE, "--policies", "ar", "--cache-experts", 8,
                           "--out", out_dir],
        "report --out": ["report", SAMPLE_OLMOE.parent.parent / "calibrate" / "examples" / "vm-x86-64-tiny-moe.json", "--out",
                         out_dir],
        "demo --out": ["demo", "--quick", "--out", out_dir],
        "calibrate --out": ["calibrate", "--shape", "tiny", "--layers", 1, "--quick", "--out", out_file],
        "calibrate --refit --out": ["calibrate", "--refit", tmp, "--profile", "pcie4", "--out", out_file],
        "calibrate --report": ["calibrate", "--shape", "tiny", "--layers", 1, "--quick", "--out", tmp / "p.json",
                               "--report", out_dir],
        "traces synth --out": ["traces", "synth", "--shape", "olmoe-1b-7b", "--tokens", 16, "--out", out_file],
        "traces import-routing --out": ["traces", "import-routing", tmp / "log.npz", "--out", out_file],
        "sweep --out": ["sweep", tmp / "grid.toml", "--num-cpus", 1, "--out", out_dir],
        "plan --out": ["plan", "--device-memory-gb", 24, "--model-shape", "olmoe-1b-7b", "--tokens", 8, "--num-cpus", 1,
                       "--out", out_dir],
    }


OUTPUT_OPTIONS = {   # command -> what its output option expects
    "decode --out": "dir", "decode --record": "file", "simulate --out": "dir", "report --out": "dir",
    "demo --out": "dir", "calibrate --out": "file", "calibrate --refit --out": "file", "calibrate --report": "dir",
    "traces synth --out": "file",
    "traces import-routing --out": "file", "sweep --out": "dir", "plan --out": "dir"}
# a file where a directory is expected, a directory where a file is, a parent nothing can be created in
CASES = [(command, case) for command, kind in OUTPUT_OPTIONS.items()
         for case in ("the wrong kind", "under /proc", "under a file")]


@pytest.mark.parametrize("command, case", CASES)
def test_every_output_path_is_checked_before_any_work(model_dir, tmp_path, command, case):
    a_file = tmp_path / "a-file"
    a_file.write_text("keep me\n")
    a_dir = tmp_path / "a-dir"
    a_dir.mkdir()
    np.savez(tmp_path / "log.npz", expert_ids=np.tile(np.arange(8), (6, 16, 1)), sequence_id=np.zeros(6, np.int32))
    (tmp_path / "grid.toml").write_text(f'traces = ["{SAMPLE_OLMOE}"]\npolicies = ["ar"]\ncache_experts = [0]\n')
    wrong_kind = a_file if OUTPUT_OPTIONS[command] == "dir" else a_dir
    target = {"the wrong kind": wrong_kind, "under /proc": Path("/proc/specfit-test/x"), "under a file": a_file / "x"}[case]
    before = files_under(tmp_path)
    argv = _commands(model_dir, tmp_path, str(target), str(target))[command]
    one_line_error(invoke(*argv), command.split()[-1], str(target))
    assert files_under(tmp_path) == before and a_file.read_text() == "keep me\n"


def test_an_output_directory_of_another_commands_run_is_refused_not_mixed(model_dir, tmp_path):
    """A decode into a simulation's directory would leave the simulation's summary beside the
    decode's cycles, and a report would read both as one run."""
    sim = tmp_path / "sim"
    simulate = ["simulate", "--trace", SAMPLE_OLMOE, "--policies", "ar", "--cache-experts", 0, "--out", sim]
    assert invoke(*simulate).exit_code == 0
    assert invoke(*simulate).exit_code == 0                    # the same kind of run is rewritten
    before = {p.name: p.stat().st_mtime_ns for p in sim.iterdir()}
    one_line_error(invoke("decode", "--model", model_dir, "--prompts", model_dir.parent / "prompts.jsonl",
                          "--cache-experts", 2, "--profile", "pcie4", "--max-new-tokens", 2, "--out", sim),
                   f"--out {sim}: holds a `specfit simulate` run")
    assert {p.name: p.stat().st_mtime_ns for p in sim.iterdir()} == before
    decoded = tmp_path / "decoded"
    decoded.mkdir()
    (decoded / "run.json").write_text(json.dumps({"kind": "decode (specfit demo)"}))
    one_line_error(invoke(*simulate[:-1], decoded), f"--out {decoded}: holds a `specfit decode` run")
    assert [p.name for p in decoded.iterdir()] == ["run.json"]


# ----------------------------------------------------------------- damaged weights
@pytest.mark.parametrize("damage", ["truncated", "random bytes", "empty"])
def test_damaged_target_weights_are_one_line(model_dir, tmp_path, damage):
    broken = tmp_path / "model"
    broken.mkdir()
    for f in model_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    weights = broken / "model.safetensors"
    raw = weights.read_bytes()
    weights.write_bytes({"truncated": raw[: len(raw) // 2], "random bytes": os.urandom(len(raw)), "empty": b""}[damage])
    result = invoke("decode", "--model", broken, "--prompts", model_dir.parent / "prompts.jsonl", "--cache-experts", 2,
                    "--profile", "pcie4", "--max-new-tokens", 2)
    one_line_error(result, "model.safetensors")


def test_nan_target_weights_are_blamed_on_the_target_not_decoded_into_garbage(model_dir, tmp_path):
    """NaN logits argmax to token 0: without the check the run 'succeeds' with a garbage output."""
    from safetensors.numpy import load_file, save_file

    broken = tmp_path / "model"
    broken.mkdir()
    for f in model_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    tensors = load_file(broken / "model.safetensors")
    name = next(k for k in tensors if k.endswith("lm_head.weight") or k.endswith("norm.weight"))
    tensors[name] = np.full_like(tensors[name], np.nan)
    save_file(tensors, broken / "model.safetensors")
    out = tmp_path / "run"
    result = invoke("decode", "--model", broken, "--prompts", model_dir.parent / "prompts.jsonl", "--cache-experts", 2,
                    "--profile", "pcie4", "--max-new-tokens", 2, "--out", out)
    one_line_error(result, f"target model {broken}:", "NaN or infinite logits")
    assert not out.exists()             # the run failed before any output: not even its run.json is left
    # calibrating it would time passes whose routing collapsed into a profile that means nothing
    profile = tmp_path / "profile.json"
    result = invoke("calibrate", "--model", broken, "--quick", "--out", profile)
    one_line_error(result, f"target model {broken}:", "a calibration pass (random tokens) gave NaN or infinite logits")
    assert not profile.exists()


def test_a_decode_of_no_cycle_gives_no_rates_and_its_report_says_why(model_dir, tmp_path):
    """--max-new-tokens 1: the prompt's pass makes the one token, no cycle runs. Its rates have no
    value (null, not 0: a hit rate of 0 would say every expert missed) and a report says why it has
    nothing to show."""
    out = tmp_path / "run"
    result = invoke("decode", "--model", model_dir, "--prompts", model_dir.parent / "prompts.jsonl", "--cache-experts", 2,
                    "--profile", "pcie4", "--max-new-tokens", 1, "--out", out)
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (out / "decode.jsonl").read_text().splitlines()]
    assert records and all(r["n_cycles"] == 0 and r["tokens_per_s"] is None and r["decode_hit_rate"] is None
                           for r in records)
    summary, = json.loads((out / "summary.json").read_text())
    assert summary["cycles"] == 0 and summary["tokens"] == 0
    assert summary["tokens_per_cycle"] is None and summary["hit_rate"] is None and summary["bytes_per_token"] is None
    one_line_error(invoke("report", out, "--out", tmp_path / "rep"), f"{out}: a `specfit decode` run that decoded no "
                   "cycle", "--max-new-tokens 1")


@pytest.mark.parametrize("column, value", [("union_size", float("inf")), ("committed_tokens", float("inf")),
                                           ("committed_tokens", 1e300), ("bytes_h2d", float("-inf"))])
def test_a_decode_runs_count_that_is_infinite_or_past_int64_is_one_line_in_its_report(model_dir, tmp_path, column, value):
    """A count of a run's cycles.parquet that no integer holds (an edited or damaged file) ended the
    report in an OverflowError traceback; it is the report's one line about a damaged column."""
    out = tmp_path / "run"
    result = invoke("decode", "--model", model_dir, "--prompts", model_dir.parent / "prompts.jsonl", "--cache-experts", 2,
                    "--profile", "pcie4", "--max-new-tokens", 4, "--out", out)
    assert result.exit_code == 0, result.output
    cycles = pd.read_parquet(out / "cycles.parquet")
    cycles[column] = cycles[column].astype(float)
    cycles.loc[0, column] = value
    cycles.to_parquet(out / "cycles.parquet")
    with warnings.catch_warnings(record=True) as raised:      # numpy's cast warning went out before the line
        warnings.simplefilter("always")
        result = invoke("report", out, "--out", tmp_path / "rep")
    one_line_error(result, f"{out}: cycles.parquet / summary.json: a column holds values of the wrong type or range")
    assert not [w for w in raised if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in raised]


# ----------------------------------------------------------------- traces
def test_nan_draft_log_probabilities_fail_validation_not_the_simulator(tmp_path):
    table = pq.read_table(SAMPLE_OLMOE)
    logprob = table.column("draft_logprob").to_numpy().copy()
    logprob[5] = np.nan                                        # a NaN float, not a null
    column = table.schema.get_field_index("draft_logprob")
    bad = tmp_path / "nan.parquet"
    pq.write_table(table.set_column(column, "draft_logprob", pa.array(logprob, type=pa.float32())), bad)
    one_line_error(invoke("traces", "validate", bad), "draft_logprob", "finite")
    one_line_error(invoke("simulate", "--trace", bad, "--policies", "ar,specfit", "--cache-experts", 8,
                          "--acceptance", "calibrated"), "draft_logprob")


def test_routing_logs_with_no_rows_or_repeated_experts_blame_the_log(tmp_path):
    empty = tmp_path / "empty.npz"
    np.savez(empty, expert_ids=np.zeros((0, 16, 8), np.int16), sequence_id=np.zeros(0, np.int32))
    one_line_error(invoke("traces", "import-routing", empty, "--out", tmp_path / "t.parquet"), str(empty), "no tokens")
    repeated = tmp_path / "repeated.npz"
    experts = np.tile(np.arange(8), (6, 16, 1))
    experts[3, 2, 1] = experts[3, 2, 0]
    np.savez(repeated, expert_ids=experts, sequence_id=np.zeros(6, np.int32))
    one_line_error(invoke("traces", "import-routing", repeated, "--out", tmp_path / "t.parquet"), str(repeated),
                   "token 3 at layer 2")
    assert not (tmp_path / "t.parquet").exists()


def test_a_routing_log_that_is_no_zip_and_bad_import_options_are_one_line(tmp_path):
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a zip archive")
    one_line_error(invoke("traces", "import-routing", garbage, "--out", tmp_path / "t.parquet"), str(garbage),
                   "not a readable .npz")
    ok = tmp_path / "ok.npz"
    np.savez(ok, expert_ids=np.tile(np.arange(8), (6, 16, 1)), sequence_id=np.zeros(6, np.int32))
    for option, value in (("--sequences", 0), ("--sibling-reuse", 2)):
        one_line_error(invoke("traces", "import-routing", ok, option, value, "--out", tmp_path / "t.parquet"), option)
    assert not (tmp_path / "t.parquet").exists()


def test_empty_gapped_and_out_of_range_routing_logs_say_what_is_wrong(tmp_path):
    cases = []
    empty_npz = tmp_path / "empty.npz"
    empty_npz.write_bytes(b"")
    cases.append((empty_npz, "not a readable .npz file"))
    empty_jsonl = tmp_path / "empty.jsonl"
    empty_jsonl.write_text("")
    cases.append((empty_jsonl, "the log has no records"))
    gap = tmp_path / "gap.jsonl"
    gap.write_text("".join(json.dumps({"sequence_id": 0, "token_index": i, "experts": [[0, 1]] * 2}) + "\n"
                           for i in (0, 1, 2, 4)))
    cases.append((gap, "sequence 0 skips from token index 2 to 4"))
    out_of_range = tmp_path / "oob.npz"
    experts = np.tile(np.arange(8), (6, 16, 1))
    experts[2, 3, 0] = 99
    np.savez(out_of_range, expert_ids=experts, sequence_id=np.zeros(6, np.int32))
    cases.append((out_of_range, "expert id 99 is out of range for every known model shape with 16 layers x top-8"))
    for path, needle in cases:
        one_line_error(invoke("traces", "import-routing", path, "--out", tmp_path / "t.parquet"), str(path), needle)
    assert not (tmp_path / "t.parquet").exists()


def test_a_refit_of_a_simulate_run_says_its_cycles_are_not_measured(tmp_path):
    sim = tmp_path / "sim"
    assert invoke("simulate", "--trace", SAMPLE_OLMOE, "--policies", "ar", "--cache-experts", 8, "--out",
                  sim).exit_code == 0
    one_line_error(invoke("calibrate", "--refit", sim, "--profile", "pcie4", "--out", tmp_path / "p.json"),
                   str(sim / "cycles.parquet"), "no measured times", "specfit decode --out")
    assert not (tmp_path / "p.json").exists()


def test_a_refit_of_a_run_whose_journal_is_not_text_is_one_line(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "cycles.jsonl").write_bytes(b'{"cycle": 0}\n\xff\xfe\n')
    one_line_error(invoke("calibrate", "--refit", run, "--profile", "pcie4", "--out", tmp_path / "p.json"),
                   str(run / "cycles.jsonl"), "not a readable journal of cycles")
    assert not (tmp_path / "p.json").exists()


def test_a_refit_of_a_file_instead_of_a_run_directory_is_one_line(tmp_path):
    one_line_error(invoke("calibrate", "--refit", SAMPLE_OLMOE, "--profile", "pcie4", "--out", tmp_path / "p.json"),
                   "--refit", "run directory")
    assert not (tmp_path / "p.json").exists()


def test_calibrate_checks_its_default_profile_file_before_any_probe(tmp_path, monkeypatch):
    """Without --out the profile goes to calibrate/<host>-<device>-<model>.json: a ./calibrate that
    is a file is one line naming that path, before the probes (minutes), not after them."""
    from specfit.calibrate import calibrate_job

    monkeypatch.setattr(calibrate_job, "calibrate", lambda *args, **kwargs: pytest.fail("probed before the check"))
    (tmp_path / "calibrate").write_text("not a folder")
    one_line_error(invoke("calibrate", "--shape", "tiny", "--layers", 1, "--quick"), "--out calibrate/",
                   "tiny.json: calibrate is a file")


def test_a_refit_of_the_same_run_twice_is_refused_however_spelled(tmp_path):
    """Its cycles would be fitted twice, and the held-out error measured on cycles whose copies
    were fitted."""
    run = tmp_path / "run"
    (tmp_path / "sub").mkdir()
    run.mkdir()
    for second, named in ((run, f"lists {run} twice"), (f"{run}/./", f"lists {run} twice"),
                          (tmp_path / "sub" / ".." / "run", "(the same run directory)")):
        one_line_error(invoke("calibrate", "--refit", run, "--refit", second, "--profile", "pcie4", "--out",
                              tmp_path / "p.json"), "--refit", named, "expected distinct runs")
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("stand_in, said", [("directory", "a directory"), ("dangling link", "a symbolic link to nothing")])
@pytest.mark.parametrize("command", ["report", "calibrate --refit"])
def test_a_runs_cycles_file_that_is_a_directory_or_a_dangling_link_is_named_so(tmp_path, stand_in, said, command):
    """A decode run whose cycles.parquet is a directory or a link to nothing is not a run that
    "decoded no cycle" (the report said so) nor one whose file is missing (the refit said so)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"kind": "decode"}))
    (run / "decode.jsonl").write_text(json.dumps({"index": 0, "policy": "ar"}) + "\n")
    if stand_in == "directory":
        (run / "cycles.parquet").mkdir()
    else:
        (run / "cycles.parquet").symlink_to(tmp_path / "gone.parquet")
    argv = ["report", run, "--out", tmp_path / "report"] if command == "report" else \
        ["calibrate", "--refit", run, "--profile", "pcie4", "--out", tmp_path / "p.json"]
    one_line_error(invoke(*argv), str(run / "cycles.parquet"), said)


# ----------------------------------------------------------------- configs and profiles
def test_more_experts_per_token_than_experts_is_blamed_on_the_config(model_dir, tmp_path):
    bad = tmp_path / "model"
    bad.mkdir()
    for f in model_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    config = json.loads((bad / "config.json").read_text())
    experts = config.get("num_experts", config.get("num_local_experts"))
    config["num_experts_per_tok"] = experts + 1
    (bad / "config.json").write_text(json.dumps(config))
    for extra in ([], ["--rescale"]):
        result = invoke("decode", "--model", bad, "--prompts", model_dir.parent / "prompts.jsonl", "--cache-experts", 2,
                        "--profile", "pcie4", "--max-new-tokens", 2, *extra)
        one_line_error(result, "config.json", "num_experts_per_tok")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json", "generation_config.json"])
@pytest.mark.parametrize("stand_in, said", [("directory", "a directory"), ("dangling link", "a symbolic link to nothing")])
def test_a_model_file_that_is_a_directory_or_a_dangling_link_is_named_so(model_dir, tmp_path, name, stand_in, said):
    """A model directory's file replaced by a directory, or a link whose target is gone (a partial
    download into a hub cache, whose snapshot files are links), is named as what it is: neither
    "no such file" nor taken for an absent optional file (a tokenizer the prompts then lack, a
    generation config whose end-of-sequence ids are then silently the config's)."""
    bad = tmp_path / "model"
    bad.mkdir()
    for f in model_dir.iterdir():
        (bad / f.name).symlink_to(f)
    (bad / name).unlink(missing_ok=True)
    if stand_in == "directory":
        (bad / name).mkdir()
    else:
        (bad / name).symlink_to(tmp_path / "gone")
    prompts = tmp_path / "prompts.jsonl"      # text needs the tokenizer
    prompts.write_text(json.dumps({"prompt": "a b c"} if name == "tokenizer.json" else {"input_ids": [3, 1, 4]}) + "\n")
    result = invoke("decode", "--model", bad, "--prompts", prompts, "--cache-experts", 2, "--profile", "pcie4",
                    "--max-new-tokens", 2)
    one_line_error(result, str(bad / name), said)


@pytest.mark.parametrize("stand_in, said", [("directory", "a directory"), ("dangling link", "a symbolic link to nothing")])
def test_drafter_weights_that_are_a_directory_or_a_dangling_link_are_named_so(tmp_path, stand_in, said):
    from specfit.assets import tiny_moe_dir, tiny_moe_eagle3_dir

    bad = tmp_path / "drafter"
    bad.mkdir()
    (bad / "config.json").symlink_to(tiny_moe_eagle3_dir() / "config.json")
    if stand_in == "directory":
        (bad / "model.safetensors").mkdir()
    else:
        (bad / "model.safetensors").symlink_to(tmp_path / "gone")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": [3, 1, 4]}) + "\n")
    result = invoke("decode", "--model", tiny_moe_dir(), "--drafter", bad, "--policy", "chain:1", "--prompts", prompts,
                    "--cache-experts", 2, "--max-new-tokens", 2)
    one_line_error(result, str(bad / "model.safetensors"), said)


@pytest.mark.parametrize("changes, needle", [
    ({"vocab_size": 0}, "key 'vocab_size' must be at least 1, got 0"),          # was blamed on eos_token_id
    ({"max_position_embeddings": 0}, "key 'max_position_embeddings' must be at least 1, got 0"),   # on the prompts
    ({"head_dim": 0}, "key 'head_dim' must be at least 1, got 0"),                # on a tensor's shape
    ({"moe_intermediate_size": -1}, "key 'moe_intermediate_size' must be at least 1, got -1"),     # a traceback
    ({"rms_norm_eps": -1e-6}, "key 'rms_norm_eps' must be a finite number >= 0, got -1e-06"),     # on NaN weights
    ({"rms_norm_eps": float("inf")}, "key 'rms_norm_eps' must be a finite number >= 0, got inf"),  # decoded
    ({"rope_theta": None, "rope_parameters": {"rope_theta": 0, "rope_type": "default"}},
     "key 'rope_parameters.rope_theta' must be a finite number > 0, got 0.0"),  # on NaN weights
    ({"rope_theta": float("inf"), "rope_parameters": None}, "key 'rope_theta' must be a finite number > 0, got inf"),
    ({"num_hidden_layers": 10**12}, "key 'num_hidden_layers' must be at most 32768, got 1000000000000"),   # a hang
])
def test_a_config_size_or_constant_out_of_range_is_blamed_on_the_config(model_dir, tmp_path, changes, needle):
    """A config value a later step takes as it is (the eos check takes the vocabulary, the prompt
    check the context, the host buffers the expert width, every norm the epsilon, RoPE theta) is
    refused where the config is read, naming its key."""
    bad = tmp_path / "model"
    bad.mkdir()
    for f in model_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    config = json.loads((bad / "config.json").read_text())
    assert "moe_intermediate_size" in config and "head_dim" in config
    (bad / "config.json").write_text(json.dumps({**config, **changes}))
    result = invoke("decode", "--model", bad, "--prompts", model_dir.parent / "prompts.jsonl", "--cache-experts", 2,
                    "--profile", "pcie4", "--max-new-tokens", 2)
    one_line_error(result, str(bad / "config.json"), needle)


def test_a_refit_onto_a_profile_of_another_shape_is_refused(model_dir, tmp_path):
    run = tmp_path / "run"
    result = invoke("decode", "--model", model_dir, "--prompts", model_dir.parent / "prompts.jsonl",
                    "--cache-experts", 2, "--profile", "pcie4", "--max-new-tokens", 16, "--ignore-eos", "--out", run)
    assert result.exit_code == 0, result.output
    other = tmp_path / "other.json"
    result = invoke("calibrate", "--shape", "tiny", "--layers", 1, "--quick", "--out", other, "--report", tmp_path / "rep")
    assert result.exit_code == 0, result.output
    # --report: the page `specfit report PROFILE` renders, written beside the profile's run
    page = (tmp_path / "rep" / "index.html").read_text()
    assert f"Calibration: {other}" in page and "held-out" in page
    assert json.loads((tmp_path / "rep" / "inputs.json").read_text()) == [str(other)]
    refitted = tmp_path / "refit.json"
    one_line_error(invoke("calibrate", "--refit", run, "--profile", other, "--out", refitted), "--rescale")
    assert not refitted.exists()
    # a preset is built for the run's model, and --rescale maps the other profile onto it
    assert invoke("calibrate", "--refit", run, "--profile", "pcie4", "--out", refitted,
                  "--report", tmp_path / "rep2").exit_code == 0
    assert f"Calibration: {refitted}" in (tmp_path / "rep2" / "index.html").read_text()
    assert json.loads(refitted.read_text())["shape"]["n_experts"] == json.loads((run / "run.json").read_text())["shape"]["n_experts"]
    assert invoke("calibrate", "--refit", run, "--profile", other, "--rescale", "--out", refitted).exit_code == 0


# ----------------------------------------------------------------- options
@pytest.mark.parametrize("argv, needle", [
    (["simulate", "--trace", SAMPLE_OLMOE, "--policies", "chain:0"], "chain:0"),
    (["simulate", "--trace", SAMPLE_OLMOE, "--policies", "static:1"], "static:1"),
    (["simulate", "--trace", SAMPLE_OLMOE, "--policies", "specfit:0"], "specfit:0"),
    (["simulate", "--trace", SAMPLE_OLMOE, "--policies", ","], "--policies: expected at least one policy"),
    (["simulate", "--trace", SAMPLE_OLMOE, "--max-levels", "0"], "--max-levels"),
    # a specfit policy's per-level state is [D + 2, ranks]: 10**12 levels asked for 116 TiB (a MemoryError)
    (["simulate", "--trace", SAMPLE_OLMOE, "--max-levels", "1000000000000"], "--max-levels: expected at most 32767"),
    (["simulate", "--trace", SAMPLE_OLMOE, "--policies", "specfit:32768"], "'specfit:32768': expected D <= 32767"),
    (["simulate", "--trace", SAMPLE_OLMOE, "--cache-experts", "8,0,8"], "--cache-experts: lists 8 twice"),
    (["simulate", "--trace", SAMPLE_OLMOE, "--profile", "pcie4", "--profile", "gh200,pcie4"],
     "--profile: lists pcie4 twice"),
    # two profiles whose rows would carry one label (a ValueError's traceback after preparing the traces, before)
    (["simulate", "--trace", SAMPLE_OLMOE, "--profile", "a/prof.json,b/prof.json"],
     "--profile: a/prof.json, b/prof.json would all be labelled 'prof' in the results"),
    (["simulate", "--trace", SAMPLE_OLMOE, "--profile", "pcie4,x/pcie4.json"], "would all be labelled 'pcie4'"),
    (["simulate", "--trace", SAMPLE_OLMOE, "--h2d-scale", "inf"], "--h2d-scale: expected a finite positive factor"),
    (["simulate", "--trace", SAMPLE_OLMOE, "--policies", "ar,specfit,ar"], "--policies: lists ar twice"),
    (["simulate", "--trace", SAMPLE_OLMOE, "--trace", SAMPLE_OLMOE.parent / ".." / SAMPLE_OLMOE.parent.name /
      SAMPLE_OLMOE.name], "(the same file) twice; expected distinct traces"),
    (["sweep", "."], ".: a directory, expected a .toml or .yaml sweep spec"),
    (["plan", "--device-memory-gb", "24", "--model-shape", "olmoe-1b-7b", "--h2d-scale", "inf"],
     "--h2d-scale: expected values finite and > 0, got inf"),
    (["decode", "--model", "m", "--prompts", "p.jsonl", "--cache-experts", "2", "--policies", ""],
     "--policies: expected at least one policy"),
    (["plan", "--device-memory-gb", "24", "--model-shape", "foo"], "--model-shape 'foo' has no known config"),
    (["traces", "synth", "--shape", "olmoe-1b-7b", "--tokens", "8", "--popularity-zipf", "nan", "--out", "s.parquet"],
     "--popularity-zipf: expected a finite Zipf exponent >= 0, got nan"),
    (["traces", "synth", "--shape", "olmoe-1b-7b", "--tokens", "8", "--consecutive-reuse", "-0.1", "--out",
      "s.parquet"], "--consecutive-reuse: expected a fraction in [0, 1]"),
    (["traces", "synth", "--shape", "olmoe-1b-7b", "--tokens", "8", "--top1-prob", "1.5", "--out", "s.parquet"],
     "drafter field 'top1_prob' (--top1-prob): expected in (0, 1), got 1.5"),
    (["demo", "--cache-experts", "-1"], "--cache-experts"),
    (["demo", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["demo", "--threads", "0"], "--threads"),
    (["calibrate", "--shape", "tiny", "--threads", "0"], "--threads"),
    # options that would be ignored without a word
    (["calibrate", "--model", "m", "--layers", "2"], "--layers 2: sets the depth of a --shape stand-in"),
    # a stand-in of deepseek-v2-lite's first (dense) layer alone would have no expert to probe
    (["calibrate", "--shape", "deepseek-v2-lite", "--layers", "1"],
     "--layers: expected 2..27 for deepseek-v2-lite (its first 1 layer(s) dense"),
    (["calibrate", "--refit", "run", "--profile", "pcie4", "--model", "m", "--quick"],
     "--refit: --model, --quick set(s) what probing measures"),
])
def test_bad_options_are_refused_before_any_work_or_file(tmp_path, argv, needle):
    before = files_under(tmp_path)
    one_line_error(invoke(*argv), needle)
    assert files_under(tmp_path) == before


def test_decode_threads_zero_is_refused(model_dir):
    result = invoke("decode", "--model", model_dir, "--prompts", model_dir.parent / "prompts.jsonl", "--cache-experts",
                    2, "--threads", 0)
    one_line_error(result, "--threads")


def test_a_simulated_cache_larger_than_the_trace_says_every_expert_is_cached(tmp_path):
    result = invoke("simulate", "--trace", SAMPLE_OLMOE, "--policies", "ar", "--cache-experts", "64,100", "--json")
    assert result.exit_code == 0, result.output
    assert f"note: --cache-experts 100 is more than {SAMPLE_OLMOE}'s 64 experts per layer: replayed with every expert " \
           f"cached" in " ".join(result.stderr.split())
    rows = pd.DataFrame(json.loads(result.stdout)).set_index("cache_experts")
    assert (rows.loc[100, ["tokens_per_s", "hit_rate"]] == rows.loc[64, ["tokens_per_s", "hit_rate"]]).all()


def test_a_simulated_policy_deeper_than_the_traces_trees_is_noted():
    # the sample's trees are 7 levels deep; a chain of 9 and eagle3 of 8 levels would be replayed
    # shorter than live, static:4 (3 levels) and specfit (it decides its own depth) are not
    result = invoke("simulate", "--trace", SAMPLE_OLMOE, "--policies", "ar,chain:9,eagle3:60:8,static:4,specfit",
                    "--max-levels", "12", "--cache-experts", "8", "--json")
    assert result.exit_code == 0, result.output
    said = " ".join(result.stderr.split())
    assert f"note: chain:9, eagle3:60:8 draft more levels than {SAMPLE_OLMOE}'s deepest tree (7)" in said, said


def test_a_sequoia_tree_deeper_than_the_traces_trees_is_noted_at_the_depth_its_rates_give():
    # the sample's rates (.451, .092, .054) make sequoia:64 a tree of 8 levels (live it drafts 8, the
    # trees hold 7) and sequoia:16 one of 5, however deep --max-levels lets it go
    result = invoke("simulate", "--trace", SAMPLE_OLMOE, "--policies", "ar,sequoia:16,sequoia:64", "--max-levels",
                    "12", "--cache-experts", "8", "--json")
    assert result.exit_code == 0, result.output
    said = " ".join(result.stderr.split())
    assert f"note: sequoia:64 drafts more levels than {SAMPLE_OLMOE}'s deepest tree (7)" in said, said


def test_simulate_without_a_baseline_prints_no_nan(tmp_path):
    result = invoke("simulate", "--trace", SAMPLE_OLMOE, "--policies", "specfit", "--cache-experts", 8)
    assert result.exit_code == 0, result.output
    assert "nan" not in result.output.lower()
    frame = pd.DataFrame(json.loads(invoke("simulate", "--trace", SAMPLE_OLMOE, "--policies", "specfit",
                                           "--cache-experts", 8, "--json").output))
    assert frame["speedup_vs_ar"].isna().all()


# ----------------------------------------------------------------- interrupted runs
def test_a_simulate_output_killed_while_writing_is_reported_not_crashed_on(tmp_path):
    out = tmp_path / "sim"
    assert invoke("simulate", "--trace", SAMPLE_OLMOE, "--policies", "ar", "--cache-experts", 8, "--out", out).exit_code == 0
    # what a SIGKILL between the files leaves: cycles without the summary, a stale temporary
    (out / "summary.parquet").unlink()
    (out / "summary.csv").unlink()
    (out / ".summary.parquet.x1y2.tmp").write_bytes(b"half")
    one_line_error(invoke("report", out, "--out", tmp_path / "report"), "summary.parquet", "interrupted")
    assert not (tmp_path / "report").exists()
    # the rerun cleans up after the killed one
    assert invoke("simulate", "--trace", SAMPLE_OLMOE, "--policies", "ar", "--cache-experts", 8, "--out", out).exit_code == 0
    assert (out / "summary.parquet").is_file() and not list(out.glob(".*.tmp"))
    assert invoke("report", out, "--out", tmp_path / "report").exit_code == 0


def test_a_ctrl_c_while_files_are_written_waits_for_the_last_of_them(tmp_path):
    """``deferred_interrupt``: the block runs to its end, then the Ctrl-C is raised as an
    ``Interrupted`` that says the files were completed; outside a block a Ctrl-C is immediate."""
    import signal
    import time

    from specfit.errors import Interrupted
    from specfit.io import deferred_interrupt, write_text_atomic

    # Python's own Ctrl-C handler, whatever this process inherited (a shell starts a background job
    # with SIGINT ignored)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(Interrupted, match="completed first"):
            with deferred_interrupt("interrupted while writing: completed first"):
                write_text_atomic(tmp_path / "a.txt", "a")
                os.kill(os.getpid(), signal.SIGINT)              # arrives between the two files
                write_text_atomic(tmp_path / "b.txt", "b")
        assert (tmp_path / "a.txt").read_text() == "a" and (tmp_path / "b.txt").read_text() == "b"
        with pytest.raises(KeyboardInterrupt):                    # the handler is restored
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1.0)
        # a process that ignores Ctrl-C goes on ignoring it inside the block
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with deferred_interrupt("never said"):
            os.kill(os.getpid(), signal.SIGINT)
            write_text_atomic(tmp_path / "c.txt", "c")
        assert (tmp_path / "c.txt").read_text() == "c"
    finally:
        signal.signal(signal.SIGINT, inherited)


@pytest.mark.parametrize("signal_name, status", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_stop_outside_a_commands_own_handling_is_one_line_with_the_stops_status(tmp_path, monkeypatch, signal_name,
                                                                                  status):
    """A Ctrl-C or a kill while decode imports torch, before its run (and its handling of a stop)
    begins: typer's own exit was status 130 without a word, for a SIGTERM too."""
    import signal

    import specfit.runtime.commands as decode_commands

    def stopped_while_importing(threads):
        os.kill(os.getpid(), getattr(signal, signal_name))

    monkeypatch.setattr(decode_commands, "set_cpu_threads", stopped_while_importing)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)   # a background job's is SIG_IGN
    try:
        result = invoke("decode", "--model", tmp_path / "model", "--prompts", tmp_path / "prompts.jsonl",
                        "--cache-experts", 3, "--out", tmp_path / "run")
    finally:
        signal.signal(signal.SIGINT, inherited)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == status and len(lines) == 1, result.output
    assert lines[0].startswith("interrupted before the command could say what it kept") and "Traceback" not in result.output
    assert not (tmp_path / "run").exists()


def test_a_ctrl_c_while_the_command_starts_is_one_line_with_status_130():
    """A Ctrl-C while ``specfit`` imports its commands (torch, numba's kernels: a few tenths of a
    second), before typer and the commands' handling exist: it was a traceback."""
    import subprocess
    import sys

    code = ("import sys\n"
            "class StopAtTheCommands:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'specfit.cli':\n"
            "            raise KeyboardInterrupt\n"
            "sys.meta_path.insert(0, StopAtTheCommands())\n"
            "from specfit.__main__ import main\n"
            "main()\n")
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(root)})
    assert result.returncode == 130, result.stderr
    assert result.stderr == "specfit: interrupted while starting; nothing was run\n" and result.stdout == ""


def test_python_m_specfit_cli_still_runs_the_command():
    """The entry point moved to ``specfit.__main__``; ``python -m specfit.cli`` (what
    ``benchmarks/bench_load.py`` times) then imported the commands and exited 0 having run nothing."""
    import subprocess
    import sys

    from specfit import __version__

    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-m", "specfit.cli", "--version"], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
    assert result.returncode == 0 and result.stdout == f"{__version__}\n", (result.stdout, result.stderr)


def test_a_ctrl_c_while_calibrates_report_is_written_says_the_report_was_completed(tmp_path, monkeypatch, capsys):
    """``calibrate --report``: a Ctrl-C while the report's files are written waits for the last of
    them (``deferred_interrupt``); the command said no report was written beside the finished one."""
    import signal

    import typer
    from rich.console import Console

    import specfit.report.build as build
    from specfit.calibrate.commands import _report

    write = build.write_json_atomic

    def stopped_while_writing(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)           # arrives between the report's two files
        return write(*args, **kwargs)

    monkeypatch.setattr(build, "write_json_atomic", stopped_while_writing)
    profile = Path(__file__).resolve().parents[1] / "calibrate" / "examples" / "vm-x86-64-tiny-moe.json"
    report = tmp_path / "report"
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)   # a background job's is SIG_IGN
    try:
        with pytest.raises(typer.Exit) as stop:
            _report(profile, report, False, Console(stderr=True))
    finally:
        signal.signal(signal.SIGINT, inherited)
    said = capsys.readouterr().err
    assert stop.value.exit_code == 130 and f"the report in {report} was completed first" in said, said
    assert "no report was written" not in said and str(profile) in said
    assert (report / "index.html").is_file() and json.loads((report / "inputs.json").read_text()) == [str(profile)]


def test_a_killed_write_leaves_no_temporary_file_once_the_file_is_written_again(tmp_path):
    from specfit.io import write_text_atomic

    (tmp_path / ".t.parquet.k1l2m3.tmp").write_bytes(b"half")      # what a SIGKILL mid-write leaves
    (tmp_path / ".other.parquet.k1l2m3.tmp").write_bytes(b"half")  # another file's: not this write's to remove
    write_text_atomic(tmp_path / "t.parquet", "whole")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.parquet.k1l2m3.tmp", "t.parquet"]


def test_a_ctrl_c_in_traces_synth_says_nothing_was_written(tmp_path, monkeypatch):
    import specfit.traces.synth as synth

    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(synth, "synthesize", stop)
    result = invoke("traces", "synth", "--shape", "olmoe-1b-7b", "--tokens", 8, "--out", tmp_path / "t.parquet")
    assert result.exit_code == 130 and "interrupted: no trace was written" in result.output, result.output
    assert not (tmp_path / "t.parquet").exists() and "Traceback" not in result.output


def test_a_demo_rerun_first_removes_the_last_runs_report(tmp_path):
    from specfit.demo import _clear_previous

    for name in ("index.html", "inputs.json", "trace.parquet", "profile.json", "simulate/summary.parquet",
                 "decode/cycles.parquet", "run.json"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("last run")
    _clear_previous(tmp_path)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["decode", "decode/cycles.parquet",
                                                                              "run.json"]


# ----------------------------------------------------------------- memory
def test_a_stand_in_that_would_not_fit_in_host_memory_is_refused_before_allocating(monkeypatch, tmp_path):
    """``calibrate --shape qwen3-30b-a3b --layers 4`` on a machine with too little memory free: one
    line with what it needs and what there is, before a single weight is made."""
    import specfit.calibrate.standin as standin
    import specfit.runtime.devices as devices

    monkeypatch.setattr(devices, "available_host_bytes", lambda: 3 * 2**30)
    made = []
    monkeypatch.setattr(standin, "random_model", lambda *a, **k: made.append(1))
    result = invoke("calibrate", "--shape", "qwen3-30b-a3b", "--layers", 4, "--device", "cpu",
                    "--out", tmp_path / "p.json")
    one_line_error(result, "--layers 4", "GiB of host memory", "3.0 GiB are available")
    assert not made and not (tmp_path / "p.json").exists()


def test_stand_in_memory_is_the_experts_in_bf16_plus_the_dense_weights():
    import torch

    from specfit.calibrate.standin import shape_config, standin_bytes

    config = shape_config("qwen3-30b-a3b", 4)
    held = standin_bytes(config, torch.bfloat16)
    assert held["experts"] == 4 * 128 * 3 * 2048 * 768 * 2          # 4.8 GB: what the probe needs
    embed = 151936 * 2048 * 2
    assert 2 * embed < held["dense"] < 2 * embed + 4 * 2048 * 2048 * 16


def test_a_concurrent_writers_temporary_file_is_left_alone(tmp_path):
    """Two processes writing one file (two runs calibrating into one profile cache): neither removes
    the other's temporary file, while a dead writer's is removed."""
    import subprocess
    import sys

    from specfit.io import remove_stale_temporaries, write_text_atomic

    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        live_tmp = tmp_path / f".p.json.{alive.pid}-a1b2.tmp"
        dead_tmp = tmp_path / f".p.json.{dead.pid}-c3d4.tmp"
        for tmp in (live_tmp, dead_tmp):
            tmp.write_bytes(b"half")
        write_text_atomic(tmp_path / "p.json", "{}")
        assert live_tmp.exists() and not dead_tmp.exists()
        dead_tmp.write_bytes(b"half")
        remove_stale_temporaries(tmp_path)
        assert live_tmp.exists() and not dead_tmp.exists()
    finally:
        alive.kill()
        alive.wait()
    remove_stale_temporaries(tmp_path)                     # its writer gone: now it is stale
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]


@pytest.mark.parametrize("argv, option", [
    (["simulate", "--trace", SAMPLE_OLMOE, "--policies", "ar,,specfit"], "--policies"),
    (["simulate", "--trace", SAMPLE_OLMOE, "--profile", "pcie4,"], "--profile"),
    (["simulate", "--trace", SAMPLE_OLMOE, "--cache-experts", "0,8,"], "--cache-experts"),
    (["decode", "--model", "m", "--prompts", "p.jsonl", "--cache-experts", "2", "--policies", "ar,,specfit"],
     "--policies"),
    (["plan", "--device-memory-gb", "24", "--model-shape", "olmoe-1b-7b", "--policies", "ar,,chain:2"], "--policies"),
    (["plan", "--device-memory-gb", "24", "--model-shape", "olmoe-1b-7b", "--workload", "chat,"], "--workload"),
])
def test_every_comma_separated_option_refuses_an_empty_entry_alike(argv, option):
    """One rule for comma-separated options (some skipped an empty entry, one refused it): refused,
    naming the option and the text, before any work."""
    one_line_error(invoke(*argv), f"{option}: an empty entry in")


def test_comma_lists_are_stripped_and_their_errors_worded():
    from specfit.errors import SpecFitError, comma_list

    assert comma_list(" ar , specfit ", "--policies", "policy") == ["ar", "specfit"]
    with pytest.raises(SpecFitError, match=r"^--policies: an empty entry in 'ar,'; expected policies separated by single "
                                           r"commas \(e\.g\. ar,specfit\)$"):
        comma_list("ar,", "--policies", "policy", "ar,specfit")
    with pytest.raises(SpecFitError, match=r"^--cache-experts: expected at least one non-negative integer, comma-separated$"):
        comma_list(" , ", "--cache-experts", "non-negative integer")


def test_prompt_token_id_equal_to_the_vocabulary_size_is_refused(tmp_path):
    from specfit.runtime.prompts import read_prompts

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"input_ids": [1, 99]}) + "\n")
    assert read_prompts(path, vocab_size=100)[0].input_ids == [1, 99]
    path.write_text(json.dumps({"input_ids": [1, 100]}) + "\n")
    with pytest.raises(SpecFitError, match="token id 100 outside the vocabulary"):
        read_prompts(path, vocab_size=100)


@pytest.mark.parametrize("where", ["before anything was written", "while the report was written"])
def test_a_ctrl_c_in_the_demo_says_what_is_there(tmp_path, monkeypatch, where):
    """The demo said "what finished is kept under OUT" when OUT had not been made, and "run specfit
    demo again for the report" when the Ctrl-C had been held until its report was complete."""
    from typer.testing import CliRunner

    import specfit.demo as demo
    import specfit.report.build as build
    from specfit.cli import app
    from specfit.errors import Interrupted

    out = tmp_path / "demo"
    if where == "before anything was written":
        def stop(plan, say=print, progress=None):
            raise KeyboardInterrupt
        monkeypatch.setattr(demo, "run_demo", stop)
    else:
        def run_to_the_report(plan, say=print, progress=None):
            Path(plan.out_dir).mkdir(parents=True)
            return demo._write_report(Path(plan.out_dir))

        def held_until_written(*args, **kwargs):    # what deferred_interrupt raises once the files are whole
            raise Interrupted(f"interrupted while writing: the report in {out} was completed first")
        monkeypatch.setattr(build, "build_report", held_until_written)
        monkeypatch.setattr(demo, "run_demo", run_to_the_report)
    result = CliRunner().invoke(app, ["demo", "--quick", "--out", str(out)])
    assert result.exit_code == 130, result.output
    if where == "before anything was written":
        assert f"nothing was written ({out} was not made)" in result.output and "kept under" not in result.output
    else:
        assert "was completed first; every step of the demo is done" in result.output
        assert "again for the report" not in result.output


def test_out_of_memory_advice_names_the_commands_own_options(monkeypatch, tmp_path):
    """Running out of memory outside decode is one line whose advice is the command's: simulate has
    no --prefill-chunk and no prompts (decode's advice was given for every command)."""
    import specfit.simulate.commands as commands

    def out_of_memory(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(commands, "_simulate", out_of_memory)
    line = one_line_error(invoke("simulate", "--trace", SAMPLE_OLMOE, "--out", tmp_path / "sim"), "out of host memory")
    assert "--prefill-chunk" not in line and "smaller inputs" in line
    from specfit.errors import out_of_memory_text

    assert "--prefill-chunk" in out_of_memory_text(MemoryError(), "decode")
    assert "--layers" in out_of_memory_text(MemoryError(), "calibrate")
