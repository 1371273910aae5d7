"""``specfit decode`` with a drafter: several policies, per-cycle output, traces that replay in the
simulator, interrupted runs, refits, bad drafter checkpoints."""

from __future__ import annotations

import errno
import html
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from process_helpers import default_sigint
from runtime_fixtures import VOCAB, make_tiny_model
from runtime_fixtures import torch_single_thread  # noqa: F401  (autouse: one intra-op thread)
from speculative_fixtures import make_drafter
from specfit.accounting import CYCLE_COLUMNS, KEY_COLUMNS
from specfit.calibrate.calibrate_job import RUN_CYCLE_COLUMNS
from specfit.cli import app
from specfit.costmodel import CostModel
from specfit.errors import Interrupted, SpecFitError, interrupted
from specfit.experts.cache import ExpertCache
from specfit.policies import make_policy
from specfit.runtime.decode_job import DecodePlan, run_decode
from specfit.runtime.run_dir import read_decode_cycles, read_decode_summaries
from specfit.simulate.replay import prepare, replay
from specfit.traces.format import read_trace

runner = CliRunner()
NEW_TOKENS = 12
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [50, 60, 70, 80, 90, 11, 12]]


@pytest.fixture(autouse=True)
def in_tmp_dir(tmp_path, monkeypatch):
    """Without --profile, decode calibrates this machine into ./calibrate/: keep that out of the repo."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def quiet_machine(monkeypatch):
    """A quick calibration the machine disturbed is not kept in the cache: for the tests that check
    what is kept, the probes' checks find the (shared) test machine quiet."""
    from specfit.calibrate import repeat

    monkeypatch.setattr(repeat, "machine_busy", lambda noise: False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode_command")
    model_dir = make_tiny_model("qwen3_moe", root / "model", seed=7)
    drafter_dir = make_drafter(model_dir, root / "drafter", hidden_size=256, fit_prompts=PROMPTS, new_tokens=NEW_TOKENS)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    return model_dir, drafter_dir, prompts


def decode(checkpoint, *args):
    model_dir, drafter_dir, prompts = checkpoint
    argv = ["decode", "--model", str(model_dir), "--drafter", str(drafter_dir), "--prompts", str(prompts),
            "--cache-experts", "3", "--device", "cpu", "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos", *args]
    return runner.invoke(app, argv)


def test_several_policies_decode_identically_and_write_measured_vs_predicted(checkpoint, tmp_path):
    out = tmp_path / "run"
    result = decode(checkpoint, "--policies", "ar,eagle3:12:4,specfit", "--profile", "pcie4", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "greedy outputs identical across policies: yes" in result.stdout
    assert "pcie4" in result.stdout

    records = [json.loads(line) for line in (out / "decode.jsonl").read_text().splitlines()]
    assert [(r["policy"], r["index"]) for r in records] == [(p, i) for p in ("ar", "eagle3:12:4", "specfit") for i in range(3)]
    cycles = pd.read_parquet(out / "cycles.parquet")
    # the one per-cycle schema, the same columns a replay writes
    assert list(cycles.columns) == [*KEY_COLUMNS, *(c.name for c in CYCLE_COLUMNS)]
    assert set(RUN_CYCLE_COLUMNS) <= set(cycles.columns)
    per_prompt = cycles.groupby(["policy", "sequence"])["committed_tokens"].sum()
    assert (per_prompt == NEW_TOKENS - 1).all()
    assert cycles.groupby("policy")["cycle"].count()["ar"] == 3 * (NEW_TOKENS - 1)
    eagle = cycles[cycles.policy == "eagle3:12:4"]
    assert eagle["committed_tokens"].mean() > 1.5 and (eagle["draft_levels"] == 4).mean() > 0.5
    assert np.all(cycles["predicted_time_s"] > 0)
    # strict JSON (no NaN / Infinity, which JavaScript's and jq's parsers refuse): no value is null
    summary = json.loads((out / "summary.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in summary.json"))
    assert [s["policy"] for s in summary] == ["ar", "eagle3:12:4", "specfit"]
    assert summary[0]["prediction_precision"] is None            # ar predicts no experts
    assert np.isnan(read_decode_summaries(out)[0]["prediction_precision"])
    assert summary[1]["tokens_per_cycle"] == pytest.approx(eagle["committed_tokens"].mean())

    # each policy decided with the model refitted on its own cycles; the profile's prediction is kept
    assert (cycles["online_predicted_time_s"] == cycles["predicted_time_s"]).all()
    assert cycles["prior_predicted_time_s"].notna().all()
    assert all(s["online_model"]["cycles_seen"] >= 1 for s in summary)
    assert (cycles["charged_bytes_h2d"] == cycles["bytes_h2d"]).all()

    # the refit reads these cycles
    refit = runner.invoke(app, ["calibrate", "--refit", str(out), "--profile", "pcie4", "--out", str(tmp_path / "refit.json"),
                                "--json"])
    assert refit.exit_code == 0, refit.output
    assert json.loads(refit.stdout)["comparison"]["n_cycles"] == len(cycles)


def test_interleaved_policies_take_the_prompts_in_turn_and_decode_the_same_tokens(checkpoint, tmp_path):
    """--interleave: each prompt with every policy, the order rotating; the same greedy tokens and
    cycles per prompt as policy after policy, one summary per policy."""
    runs = {}
    for mode in ("sequential", "interleaved"):
        out = tmp_path / mode
        args = ["--policies", "ar,eagle3:12:4,specfit", "--profile", "pcie4", "--out", str(out), "--frozen-profile"]
        result = decode(checkpoint, *args, *(["--interleave"] if mode == "interleaved" else []))
        assert result.exit_code == 0, result.output
        assert "greedy outputs identical across policies: yes" in result.stdout
        runs[mode] = ([json.loads(line) for line in (out / "decode.jsonl").read_text().splitlines()],
                      pd.read_parquet(out / "cycles.parquet"), json.loads((out / "summary.json").read_text()))
    records, cycles, summary = runs["interleaved"]
    names = ["ar", "eagle3:12:4", "specfit"]
    assert [(r["index"], r["policy"]) for r in records] == [(i, names[(i + k) % 3]) for i in range(3) for k in range(3)]
    assert [s["policy"] for s in summary] == names
    before = {(r["policy"], r["index"]): r["output_ids"] for r in runs["sequential"][0]}
    assert {(r["policy"], r["index"]): r["output_ids"] for r in records} == before
    # the same trees verified for ar and eagle3 (what they verify does not depend on the cache)
    for policy in ("ar", "eagle3:12:4"):
        a = cycles[cycles.policy == policy].sort_values(["sequence", "cycle"])
        b = runs["sequential"][1][runs["sequential"][1].policy == policy].sort_values(["sequence", "cycle"])
        assert list(a["cycle"]) == list(b["cycle"]) and list(a["nodes_verified"]) == list(b["nodes_verified"])


def test_interleaved_policies_with_their_own_caches_hit_and_miss_as_policy_after_policy(checkpoint, tmp_path):
    """--interleave --cache-per-policy: the prompts in turn, yet each policy's cache is its own,
    so what ar and eagle3 verify (which does not depend on timing) hits and misses cycle by cycle
    as in the sequential run; with one shared cache it does not."""
    runs = {}
    for mode, extra in (("sequential", []), ("own", ["--interleave", "--cache-per-policy"]),
                        ("shared", ["--interleave"])):
        out = tmp_path / mode
        args = ["--policies", "ar,eagle3:12:4,specfit", "--profile", "pcie4", "--out", str(out), "--frozen-profile"]
        result = decode(checkpoint, *args, *extra)
        assert result.exit_code == 0, result.output
        assert "greedy outputs identical across policies: yes" in result.stdout
        runs[mode] = ({(r["policy"], r["index"]): r["output_ids"]
                       for r in map(json.loads, (out / "decode.jsonl").read_text().splitlines())},
                      pd.read_parquet(out / "cycles.parquet"))
    assert runs["own"][0] == runs["sequential"][0]
    columns = ["sequence", "cycle", "nodes_verified", "hits", "misses", "bytes_h2d"]

    def per_cycle(mode, policy):
        cycles = runs[mode][1]
        return cycles[cycles.policy == policy].sort_values(["sequence", "cycle"])[columns].to_numpy()

    for policy in ("ar", "eagle3:12:4"):
        assert np.array_equal(per_cycle("own", policy), per_cycle("sequential", policy)), policy
    assert any(not np.array_equal(per_cycle("shared", p), per_cycle("sequential", p)) for p in ("ar", "eagle3:12:4"))


def test_cache_per_policy_needs_interleave(checkpoint):
    result = decode(checkpoint, "--policies", "ar", "--profile", "pcie4", "--cache-per-policy")
    assert result.exit_code != 0
    assert "--cache-per-policy: only with --interleave" in result.output
    assert "Traceback" not in result.output


def test_a_frozen_profile_decides_every_cycle_with_the_profile(checkpoint, tmp_path):
    out = tmp_path / "frozen"
    result = decode(checkpoint, "--policies", "chain:2,specfit", "--profile", "pcie4", "--frozen-profile", "--out",
                    str(out))
    assert result.exit_code == 0, result.output
    cycles = pd.read_parquet(out / "cycles.parquet")
    assert cycles["online_predicted_time_s"].isna().all()
    chain, spec = cycles[cycles["policy"] == "chain:2"], cycles[cycles["policy"] == "specfit"]
    assert len(chain) and len(spec)
    np.testing.assert_allclose(chain["predicted_time_s"], chain["prior_predicted_time_s"])
    # SpecFit adds the time of its own decisions (learned per level) to the profile's, nothing else
    assert (spec["predicted_time_s"] >= spec["prior_predicted_time_s"] * (1 - 1e-9)).all()
    assert "online_model" not in json.loads((out / "summary.json").read_text())[0]


@pytest.mark.usefixtures("quiet_machine")
def test_without_profile_a_quick_calibration_is_saved_in_the_user_cache_and_named(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    result = decode(checkpoint, "--policy", "chain:2")
    assert result.exit_code == 0, result.output
    cache = tmp_path / "user-cache" / "specfit" / "profiles"
    saved = list(cache.glob("*.json"))
    assert len(saved) == 1 and f"profile: {saved[0]}" in result.stdout.replace("\n", "")
    assert f"onewascalibratednow(quick)andsavedto{saved[0]}" in "".join(result.output.split())
    mtime = saved[0].stat().st_mtime_ns
    assert not (tmp_path / "calibrate").exists()             # nothing written into the current directory
    again = decode(checkpoint, "--policy", "chain:2")      # found this time, not re-measured
    assert again.exit_code == 0 and f"profile: {saved[0]}" in again.stdout.replace("\n", "")
    assert saved[0].stat().st_mtime_ns == mtime
    # a project's own calibrate/ directory comes first (there, names carry no dtype)
    assert saved[0].name.endswith("-float32.json")
    project_name = saved[0].name.removesuffix("-float32.json") + ".json"
    (tmp_path / "calibrate").mkdir()
    (tmp_path / "calibrate" / project_name).write_text(saved[0].read_text())
    mine = decode(checkpoint, "--policy", "chain:2")
    assert f"profile: calibrate/{project_name}" in mine.stdout.replace("\n", "")
    # the same model in another dtype: neither float32 profile is used (their expert bytes differ);
    # a profile of its own is calibrated and kept beside the first
    other = decode(checkpoint, "--policy", "chain:2", "--dtype", "bfloat16")
    assert other.exit_code == 0, other.output
    mine_bf16 = cache / (project_name.removesuffix(".json") + "-bfloat16.json")
    assert sorted(cache.glob("*.json")) == sorted([saved[0], mine_bf16])
    text = "".join(other.output.split())
    assert f"note:calibrate/{project_name}:madefor" in text and "inbfloat16:notused" in text
    assert f"profile:{mine_bf16}" in text
    bf16_mtime = mine_bf16.stat().st_mtime_ns
    again = decode(checkpoint, "--policy", "chain:2", "--dtype", "bfloat16")     # found this time, not re-measured
    assert f"profile:{mine_bf16}" in "".join(again.output.split()) and mine_bf16.stat().st_mtime_ns == bf16_mtime


@pytest.mark.usefixtures("quiet_machine")
def test_a_profile_cache_that_cannot_be_written_or_read_does_not_stop_a_decode(checkpoint, tmp_path, monkeypatch):
    # the cache's place is a file: the quick calibration decides this run, and the note says why it
    # was not kept; a damaged cached profile is calibrated again and replaced
    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not-a-dir"))
    result = decode(checkpoint, "--policy", "chain:2")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "could not be saved to the cache" in text and "profile:" not in text
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert decode(checkpoint, "--policy", "chain:2").exit_code == 0
    (saved,) = (tmp_path / "cache" / "specfit" / "profiles").glob("*.json")
    saved.write_text(saved.read_text()[:100])
    result = decode(checkpoint, "--policy", "chain:2")
    assert result.exit_code == 0, result.output
    assert "not used" in " ".join(result.output.split())
    assert json.loads(saved.read_text())["shape"]                  # replaced by a whole profile


def test_full_trace_replays_in_the_simulator_to_the_same_tokens(checkpoint, tmp_path):
    trace_path = tmp_path / "full.parquet"
    result = decode(checkpoint, "--policy", "ar", "--record", str(trace_path), "--record-full", "--max-levels", "3",
                    "--profile", "pcie4", "--json")
    assert result.exit_code == 0, result.output
    outputs = [json.loads(line)["output_ids"] for line in result.stdout.splitlines()]
    trace = read_trace(trace_path)                     # validated: position-indexed, every node verified
    assert trace.position_indexed and trace.n_cycles == 3 * (NEW_TOKENS - 1)
    assert trace.tree_sizes.max() == 1 + 4 + 2 * 16 and (trace.verified.all())
    prep = prepare("full", trace, trace.predicted_experts)
    for seq, output in enumerate(outputs):
        assert prep.reference[seq].tolist() == output[1:]
    for spec in ("ar", "chain:3", "eagle3:12:3", "specfit", "oracle"):
        cache = ExpertCache(trace.n_layers, trace.n_experts, 3, expert_bytes=trace.expert_bytes)
        log = replay(prep, make_policy(spec, max_levels=3), cache, CostModel(2e-3, 5e-5, 2e-5, 2e-4, 3e-4))
        assert [c.tolist() for c in log.committed] == [o[1:] for o in outputs], spec
        if spec == "eagle3:12:3":
            assert log.columns["committed_tokens"].mean() > 1.5


def test_live_trace_records_the_policys_cycles(checkpoint, tmp_path):
    trace_path = tmp_path / "live.parquet"
    out = tmp_path / "run"
    result = decode(checkpoint, "--policy", "eagle3:12:4", "--record", str(trace_path), "--profile", "pcie5", "--out", str(out))
    assert result.exit_code == 0, result.output
    trace = read_trace(trace_path)
    cycles = pd.read_parquet(out / "cycles.parquet")
    assert trace.n_cycles == len(cycles) and not trace.position_indexed
    assert np.array_equal(trace.tree_sizes, cycles["nodes_drafted"])
    verified = np.add.reduceat(trace.verified, trace.offsets[:-1])
    assert np.array_equal(verified, cycles["nodes_verified"])
    assert trace.verdict_known.sum() == trace.verified.sum() == trace.true_known.sum()
    np.testing.assert_allclose(trace.measured["measured_time_s"], cycles["measured_time_s"])
    assert trace.meta["recording"]["policy"] == "eagle3:12:4"


def _numba_interrupt():
    """What numba's dispatcher raises when a Ctrl-C lands in a compiled call."""
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt as cause:
        raise SystemError("CPUDispatcher(<function decide_level>) returned a result with an exception set") from cause


def _keyboard_interrupt():
    raise KeyboardInterrupt


def test_only_a_ctrl_c_counts_as_an_interrupt():
    for raiser in (_keyboard_interrupt, _numba_interrupt):
        with pytest.raises(BaseException) as caught:
            raiser()
        assert interrupted(caught.value)
    assert not interrupted(SystemError("a real internal error"))
    try:
        try:
            raise ValueError("a bug in a kernel")
        except ValueError as cause:
            raise SystemError("returned a result with an exception set") from cause
    except SystemError as exc:
        assert not interrupted(exc)


@pytest.mark.parametrize("interrupt", [_keyboard_interrupt, _numba_interrupt], ids=["python", "in-a-kernel"])
def test_an_interrupted_run_keeps_every_completed_cycle(checkpoint, tmp_path, interrupt):
    model_dir, drafter_dir, prompts = checkpoint
    out = tmp_path / "run"
    plan = DecodePlan(model_dir=model_dir, prompts_path=prompts, cache_experts=3, policies=["ar", "specfit"],
                      drafter_dir=drafter_dir, profile="pcie4", max_new_tokens=NEW_TOKENS, device="cpu", out_dir=out,
                      ignore_eos=True)
    seen = []

    def stop_after_two(record):
        seen.append(record)
        if len(seen) == 2:
            interrupt()

    with pytest.raises(Interrupted, match="kept every complete cycle"):
        run_decode(plan, on_record=stop_after_two)
    cycles = pd.read_parquet(out / "cycles.parquet")
    assert sorted(set(cycles["sequence"])) == [0, 1] and len(cycles) == 2 * (NEW_TOKENS - 1)
    assert len((out / "decode.jsonl").read_text().splitlines()) == 2
    # summary.json covers every policy cycles.parquet holds: ar's two prompts, marked incomplete
    summary = json.loads((out / "summary.json").read_text())
    assert [(s["policy"], s["prompts"], s["complete"]) for s in summary] == [("ar", 2, False)]
    assert summary[0]["tokens"] == int(cycles["committed_tokens"].sum())
    assert not [p for p in out.iterdir() if p.name.startswith(".") and p.name != ".lock"]   # no temporary file left


def test_a_policy_stopped_after_its_last_prompt_is_not_called_cut_short(checkpoint, tmp_path):
    """A stop after a policy's last prompt but before its summary: the summary written for it
    counts every prompt and is not marked incomplete."""
    model_dir, drafter_dir, prompts = checkpoint
    n_prompts = len(prompts.read_text().splitlines())
    plan = DecodePlan(model_dir=model_dir, prompts_path=prompts, cache_experts=3, policies=["ar", "specfit"],
                      drafter_dir=drafter_dir, profile="pcie4", max_new_tokens=NEW_TOKENS, device="cpu",
                      out_dir=tmp_path / "run", ignore_eos=True)
    seen = []

    def stop_after_ars_last(record):
        seen.append(record)
        if len(seen) == n_prompts:
            raise KeyboardInterrupt

    with pytest.raises(Interrupted):
        run_decode(plan, on_record=stop_after_ars_last)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert [(s["policy"], s["prompts"], s.get("complete", True)) for s in summary] == [("ar", n_prompts, True)]


def test_an_interrupted_full_recording_says_it_wrote_no_trace(checkpoint, tmp_path):
    """--record-full records its trees in a pass after the decoding: stopped before it, the run
    keeps its cycles and says that no trace was written, and why."""
    model_dir, drafter_dir, prompts = checkpoint
    plan = DecodePlan(model_dir=model_dir, prompts_path=prompts, cache_experts=3, policies=["ar"],
                      drafter_dir=drafter_dir, profile="pcie4", max_new_tokens=NEW_TOKENS, device="cpu",
                      out_dir=tmp_path / "run", record=tmp_path / "t.parquet", record_full=True, ignore_eos=True)

    def stop(record):
        raise KeyboardInterrupt

    with pytest.raises(Interrupted, match=r"no trace in .*t\.parquet \(--record-full records in a pass after the "
                                          r"decoding, which recorded no cycle before the stop\)"):
        run_decode(plan, on_record=stop)
    assert not (tmp_path / "t.parquet").exists() and (tmp_path / "run" / "cycles.parquet").exists()


def _watch_cycles(monkeypatch, stop_in_second_prompt_at=None):
    """The cycles every prompt's decode completes, in order (``[[stats, ...] per prompt]``); with
    ``stop_in_second_prompt_at`` a Ctrl-C before that cycle of the second prompt completes."""
    from specfit.runtime.decoder import Decoder

    generate, learn = Decoder.generate, Decoder._learn
    prompts_begun = []

    def counting_generate(self, *args, **kwargs):
        prompts_begun.append([])
        return generate(self, *args, **kwargs)

    def learn_then_maybe_stop(self, stats):
        if len(prompts_begun) == 2 and len(prompts_begun[-1]) == stop_in_second_prompt_at:
            raise KeyboardInterrupt
        learn(self, stats)
        prompts_begun[-1].append(stats)

    monkeypatch.setattr(Decoder, "generate", counting_generate)
    monkeypatch.setattr(Decoder, "_learn", learn_then_maybe_stop)
    return prompts_begun


def _assert_rows_of(rows: pd.DataFrame, prompts_begun: list):
    """Each row is its cycle's, in order, numbered within its prompt."""
    completed = [stats for prompt in prompts_begun for stats in prompt]
    assert len(rows) == len(completed)
    assert rows["sequence"].tolist() == [i for i, prompt in enumerate(prompts_begun) for _ in prompt]
    assert rows["cycle"].tolist() == [c for prompt in prompts_begun for c in range(len(prompt))]
    assert rows["position"].tolist() == [stats.position for stats in completed]
    assert rows["nodes_verified"].tolist() == [int(stats.verification.nodes.size) for stats in completed]
    np.testing.assert_allclose(rows["measured_time_s"], [stats.cycle_time_s for stats in completed])


def test_the_untimed_warm_up_teaches_the_measured_policy_nothing(checkpoint, monkeypatch):
    """The warm-up decodes a few tokens of the first prompt, which the run then decodes: it runs on
    a copy of the policy (as on a copy of the predictor), so the measured run starts from the state
    a run without it would have."""
    from specfit.runtime.decoder import Decoder

    model_dir, drafter_dir, prompts = checkpoint
    seen, generate = [], Decoder.generate

    def spy(self, *args, **kwargs):
        seen.append((self.policy, self.policy.overhead_level_s))
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(Decoder, "generate", spy)
    plan = DecodePlan(model_dir=model_dir, prompts_path=prompts, cache_experts=3, policies=["specfit"],
                      drafter_dir=drafter_dir, profile="pcie4", max_new_tokens=NEW_TOKENS, device="cpu",
                      ignore_eos=True, warmup=True, online_refit=False)
    run_decode(plan)
    (warm, _), (measured, learned_before), *rest = seen
    # the warm-up's policy learned its overhead per decision (no online refit); the measured one had not
    assert warm is not measured and warm.overhead_level_s > 0
    assert learned_before == 0.0 and all(policy is measured for policy, _ in rest)


def test_a_ctrl_c_inside_a_prompt_keeps_the_rows_of_its_complete_cycles(checkpoint, tmp_path, monkeypatch):
    """With an --out directory each cycle's row is journaled as it completes: a run stopped in the
    middle of a prompt (here before the second prompt's third cycle completes) writes a row for
    each cycle that completed, and each row is its cycle's."""
    model_dir, drafter_dir, prompts = checkpoint
    out = tmp_path / "run"
    plan = DecodePlan(model_dir=model_dir, prompts_path=prompts, cache_experts=3, policies=["specfit"],
                      drafter_dir=drafter_dir, profile="pcie4", max_new_tokens=NEW_TOKENS, device="cpu",
                      out_dir=out, ignore_eos=True, warmup=False)
    prompts_begun = _watch_cycles(monkeypatch, stop_in_second_prompt_at=2)
    with pytest.raises(Interrupted, match="kept every complete cycle") as stopped:
        run_decode(plan)
    first = len(prompts_begun[0])
    assert first >= 2 and len(prompts_begun[1]) == 2
    assert f"every complete cycle, {first + 2} of them" in str(stopped.value)
    _assert_rows_of(pd.read_parquet(out / "cycles.parquet"), prompts_begun)


@pytest.mark.parametrize("with_files", [True, False], ids=["journal", "no-files"])
def test_a_stop_just_after_a_cycle_became_a_row_keeps_it_once(checkpoint, tmp_path, monkeypatch, with_files):
    """A Ctrl-C (or SIGTERM) that lands after a cycle's row was added, before its pending entry was
    dropped, kept that cycle twice (a real-process SIGTERM test saw cycle 7 twice): each complete
    cycle is one row, in order."""
    import specfit.runtime.decode_job as decode_job

    model_dir, drafter_dir, prompts = checkpoint
    plan = DecodePlan(model_dir=model_dir, prompts_path=prompts, cache_experts=3, policies=["ar"],
                      profile="pcie4", max_new_tokens=NEW_TOKENS, device="cpu",
                      out_dir=tmp_path / "run" if with_files else None, ignore_eos=True, warmup=False)
    prompts_begun = _watch_cycles(monkeypatch)
    add_cycle, added = decode_job.DecodeOutputs.add_cycle, []

    def add_then_stop(self, row):
        add_cycle(self, row)
        added.append(row)
        if len(added) == NEW_TOKENS + 1:        # in the second prompt (ar: NEW_TOKENS - 1 cycles each)
            raise KeyboardInterrupt

    monkeypatch.setattr(decode_job.DecodeOutputs, "add_cycle", add_then_stop)
    rows = []
    monkeypatch.setattr(decode_job, "_keep_partial", lambda plan, outputs, recorder, *why: rows.extend(outputs.cycles) or "")
    with pytest.raises(Interrupted):
        run_decode(plan)
    keys = [(r["sequence"], r["cycle"]) for r in rows]
    assert len(keys) == len(set(keys)) >= NEW_TOKENS + 1
    _assert_rows_of(pd.DataFrame(rows), [p[:sum(1 for r in rows if r["sequence"] == i)]
                                         for i, p in enumerate(prompts_begun)])


def test_a_run_without_files_makes_its_rows_after_each_prompt(checkpoint, monkeypatch):
    """Without --out the rows are made once a prompt's decode returns, outside its cycles: none
    while a prompt is decoded, and then the same rows, each its cycle's, numbered within its prompt."""
    import specfit.runtime.decode_job as decode_job
    from specfit.runtime.decoder import Decoder

    model_dir, drafter_dir, prompts = checkpoint
    plan = DecodePlan(model_dir=model_dir, prompts_path=prompts, cache_experts=3, policies=["specfit"],
                      drafter_dir=drafter_dir, profile="pcie4", max_new_tokens=NEW_TOKENS, device="cpu",
                      ignore_eos=True, warmup=False)
    prompts_begun = _watch_cycles(monkeypatch)
    watched_generate, add_cycle = Decoder.generate, decode_job.DecodeOutputs.add_cycle
    rows, rows_when_a_decode_ends = [], []

    def generate_then_count(self, *args, **kwargs):
        result = watched_generate(self, *args, **kwargs)
        rows_when_a_decode_ends.append(len(rows))
        return result

    def counting_add_cycle(self, row):
        rows.append(row)
        add_cycle(self, row)

    monkeypatch.setattr(Decoder, "generate", generate_then_count)
    monkeypatch.setattr(decode_job.DecodeOutputs, "add_cycle", counting_add_cycle)
    run = run_decode(plan)
    assert len(prompts_begun) >= 2 and run.cycles == rows
    assert rows_when_a_decode_ends == [sum(map(len, prompts_begun[:i])) for i in range(len(prompts_begun))]
    _assert_rows_of(pd.DataFrame(run.cycles), prompts_begun)


def test_a_rerun_stopped_early_keeps_none_of_the_last_runs_files(checkpoint, tmp_path):
    """A decode into the directory of a finished one, stopped after its first prompt: what is
    there is this run's (one prompt of ar, no summary yet), not the last run's cycles or summary."""
    model_dir, drafter_dir, prompts = checkpoint
    out = tmp_path / "run"
    plan = DecodePlan(model_dir=model_dir, prompts_path=prompts, cache_experts=3, policies=["ar", "specfit"],
                      drafter_dir=drafter_dir, profile="pcie4", max_new_tokens=NEW_TOKENS, device="cpu", out_dir=out,
                      ignore_eos=True)
    run = run_decode(plan)
    assert (out / "summary.json").is_file()
    # what the predictions were made with: a preset's figures (no file)
    info = json.loads((out / "run.json").read_text())
    assert info["profile"] == "pcie4 (preset)" and info["profile_file"] is None
    # how acceptance was priced (the drafter's raw probabilities, greedy), and the terminal's notes
    # after its tables, which the report says too, from the run's summaries
    assert info["acceptance"] is None and info["temperature"] == 0
    from specfit.report.build import build_report
    from specfit.runtime.commands import raw_acceptance_notes

    said = [line.removeprefix("note: ") for line in run.notes + raw_acceptance_notes(run.summaries)]
    assert said                                    # raw probabilities are far off on the test's checkpoint
    page = build_report([out], tmp_path / "first").read_text()
    assert all(html.escape(note) in page for note in said)
    assert info["cost_model"]["base_s"] == pytest.approx(5e-3) and info["cost_model"]["hit_s"] > 0
    # and the drafter its levels were drafted with (a refit's draft level is that drafter's)
    from specfit.calibrate.calibrate_job import drafter_identity

    assert info["drafter"] == drafter_identity(drafter_dir)

    def stop(record):
        raise KeyboardInterrupt

    with pytest.raises(Interrupted, match="kept every complete cycle"):
        run_decode(plan, on_record=stop)
    cycles = read_decode_cycles(out)
    assert set(cycles["policy"]) == {"ar"} and set(cycles["sequence"]) == {0} and len(cycles) == NEW_TOKENS - 1
    assert len((out / "decode.jsonl").read_text().splitlines()) == 1
    # its summary is this run's: ar's one prompt, cut short (not the last run's two finished policies)
    summary = json.loads((out / "summary.json").read_text())
    assert [(s["policy"], s["prompts"], s["complete"]) for s in summary] == [("ar", 1, False)]
    # its run.json says that it stopped, and its report says so above the tables
    n_prompts = len(prompts.read_text().splitlines())
    said = (f"the run stopped before its end (interrupted): it holds the {NEW_TOKENS - 1} cycle(s) completed before "
            f"it; 1 of its {2 * n_prompts} (policy, prompt) runs finished")
    assert json.loads((out / "run.json").read_text())["notes"] == [said]
    from specfit.report.build import build_report

    notes = []
    page = build_report([out], tmp_path / "report", say=notes.append)
    assert f"note: {said}" in notes and said in page.read_text()


@pytest.mark.parametrize("failure", [SpecFitError("target model: NaN logits"), KeyboardInterrupt()])
def test_a_rerun_that_fails_before_its_first_cycle_leaves_the_last_run_as_it_was(checkpoint, tmp_path, monkeypatch,
                                                                               failure):
    """Bad input found at the first pass (NaN weights), or a Ctrl-C while loading: the last run's
    cycles, records, summary and run.json stay, byte for byte, and nothing of this run is added."""
    from specfit.runtime.decoder import Decoder

    model_dir, drafter_dir, prompts = checkpoint
    out = tmp_path / "run"
    plan = DecodePlan(model_dir=model_dir, prompts_path=prompts, cache_experts=3, policies=["ar"],
                      drafter_dir=drafter_dir, profile="pcie4", max_new_tokens=NEW_TOKENS, device="cpu", out_dir=out,
                      ignore_eos=True, warmup=False)
    run_decode(plan)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert {"cycles.parquet", "decode.jsonl", "summary.json", "run.json"} <= set(before)

    def fail(self, *args, **kwargs):
        raise failure

    monkeypatch.setattr(Decoder, "prefill", fail)
    with pytest.raises((SpecFitError, Interrupted)):
        run_decode(plan)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_a_full_disk_mid_run_is_one_error_naming_the_journal_and_what_was_kept(checkpoint, tmp_path, monkeypatch):
    """ENOSPC names no file: the error names the journal being written and how many cycles were
    complete, and the complete cycles still reach the disk as far as it lets them."""
    import errno

    import specfit.runtime.run_dir as run_dir

    model_dir, drafter_dir, prompts = checkpoint
    out = tmp_path / "run"
    plan = DecodePlan(model_dir=model_dir, prompts_path=prompts, cache_experts=3, policies=["ar"],
                      drafter_dir=drafter_dir, profile="pcie4", max_new_tokens=NEW_TOKENS, device="cpu", out_dir=out,
                      ignore_eos=True, warmup=False)
    dumps, written = run_dir.strict_dumps, []

    def fill_up(row):
        if len(written) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(row)
        return dumps(row)

    monkeypatch.setattr(run_dir, "strict_dumps", fill_up)
    with pytest.raises(SpecFitError) as info:
        run_decode(plan)
    assert str(info.value) == (f"{out / 'cycles.jsonl'}: No space left on device (after 4 complete cycle(s); those "
                               f"that reached the disk before it are in {out})")
    # the journal's three lines; cycles.parquet then took all four (this disk had room for it)
    assert len(read_decode_cycles(out)) == 4 and len(written) == 3


def test_a_profile_measured_on_another_kind_of_device_is_noted(checkpoint, tmp_path):
    """An H200's profile on a CPU run: its times are another machine's, which the run says."""
    example = json.loads((Path(__file__).resolve().parents[1] / "calibrate" / "examples" /
                          "vm-x86-64-tiny-moe.json").read_text())
    assert example["machine"]["device"] == "cpu"
    same = tmp_path / "cpu.json"
    same.write_text(json.dumps(example))
    other = tmp_path / "h200.json"
    other.write_text(json.dumps({**example, "machine": {**example["machine"], "device": "cuda",
                                                         "device_name": "NVIDIA H200"}}))
    said = "was measured on cuda (NVIDIA H200), this run decodes on cpu"
    result = decode(checkpoint, "--policy", "ar", "--profile", str(other), "--rescale")
    assert result.exit_code == 0 and f"note: {other} {said}" in " ".join(result.output.split()), result.output
    result = decode(checkpoint, "--policy", "ar", "--profile", str(same), "--rescale")
    assert result.exit_code == 0 and "was measured on" not in result.output, result.output
    result = decode(checkpoint, "--policy", "ar", "--profile", "pcie4")       # a preset is a what-if by design
    assert result.exit_code == 0 and "was measured on" not in result.output, result.output


def _stop_recording_after(monkeypatch, n_cycles):
    """Ctrl-C right after the recorder has taken its ``n_cycles``-th cycle (mid-sequence)."""
    from specfit.runtime.record import TraceRecorder

    add = TraceRecorder.add_cycle

    def add_then_stop(self, stats):
        add(self, stats)
        if len(self) == n_cycles:
            raise KeyboardInterrupt

    monkeypatch.setattr(TraceRecorder, "add_cycle", add_then_stop)


def test_an_interrupted_live_recording_keeps_its_cycles_in_the_trace(checkpoint, tmp_path, monkeypatch):
    model_dir, drafter_dir, prompts = checkpoint
    out, trace_path = tmp_path / "run", tmp_path / "live.parquet"
    plan = DecodePlan(model_dir=model_dir, prompts_path=prompts, cache_experts=3, policies=["eagle3:12:4"],
                      drafter_dir=drafter_dir, profile="pcie5", max_new_tokens=NEW_TOKENS, device="cpu", out_dir=out,
                      ignore_eos=True, record=trace_path)
    _stop_recording_after(monkeypatch, 5)
    with pytest.raises(Interrupted, match=f"and the 5 recorded cycle\\(s\\) as a trace in {trace_path}"):
        run_decode(plan)
    trace = read_trace(trace_path)                      # validated
    cycles = pd.read_parquet(out / "cycles.parquet")
    assert trace.n_cycles == 5 and len(cycles) >= 4      # the fifth cycle's row may not have been kept yet
    np.testing.assert_allclose(trace.measured["measured_time_s"][: len(cycles)], cycles["measured_time_s"][:5])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]     # no temporary file left


def test_an_interrupted_full_recording_ends_its_open_sequence_where_it_stopped(checkpoint, tmp_path, monkeypatch):
    """A full trace cuts each tree to the reference tokens after its position: a sequence stopped
    after three cycles has four output tokens, and its trees reach no further."""
    model_dir, drafter_dir, prompts = checkpoint
    runs = {}
    for name, stop in (("whole", None), ("stopped", NEW_TOKENS - 1 + 3)):
        path = tmp_path / f"{name}.parquet"
        plan = DecodePlan(model_dir=model_dir, prompts_path=prompts, cache_experts=3, policies=["ar"],
                          drafter_dir=drafter_dir, profile="pcie4", max_new_tokens=NEW_TOKENS, device="cpu",
                          ignore_eos=True, record=path, record_full=True, max_levels=3)
        if stop is None:
            run_decode(plan)
        else:
            _stop_recording_after(monkeypatch, stop)
            with pytest.raises(Interrupted, match="recorded cycle"):
                run_decode(plan)
        trace = read_trace(path)                        # validated: position-indexed, every node verified
        runs[name] = prepare(name, trace, trace.predicted_experts)
    whole, stopped = runs["whole"], runs["stopped"]
    assert stopped.reference[0].tolist() == whole.reference[0].tolist()
    assert stopped.reference[1].tolist() == whole.reference[1][:3].tolist()
    assert len(stopped.reference) == 2


def test_a_full_recording_holds_the_runs_predictor_and_every_level_its_policies_draft(checkpoint, tmp_path):
    """The full trees were drafted --max-levels deep by a decoder with the default router predictor,
    whatever --predictor said (and the trace's metadata named): a replay of eagle3 or chain:K
    (their own depth) saw trees cut short, and replayed predictions no live policy decided with."""
    model_dir, drafter_dir, prompts = checkpoint
    path = tmp_path / "full.parquet"
    plan = DecodePlan(model_dir=model_dir, prompts_path=prompts, cache_experts=3, policies=["chain:4"],
                      drafter_dir=drafter_dir, profile="pcie4", max_new_tokens=NEW_TOKENS, device="cpu",
                      ignore_eos=True, record=path, record_full=True, max_levels=2, predictor="parent")
    run_decode(plan)
    trace = read_trace(path)
    assert trace.meta["drafter"]["max_levels"] == 4 and int(trace.depth.max()) == 4
    assert trace.meta["recording"]["predictor"] == "parent"
    # the parent predictor: every node of a cycle routes like the token before its root, the
    # previous cycle's root (one token committed per cycle)
    checked = 0
    for c in range(1, trace.n_cycles):
        if trace.sequence[c] != trace.sequence[c - 1]:
            continue
        before = np.sort(trace.true_experts[trace.offsets[c - 1]], axis=-1)
        nodes = np.sort(trace.predicted_experts[trace.offsets[c]:trace.offsets[c + 1]], axis=-1)
        assert (nodes == before[None]).all(), c
        checked += 1
    assert checked > 10


@pytest.mark.parametrize("where", ["cycles.parquet", "trace"])
def test_a_ctrl_c_while_the_last_files_are_written_keeps_and_notes_every_cycle(checkpoint, tmp_path, monkeypatch,
                                                                                where):
    """After the last prompt the run still writes cycles.parquet and the trace: a Ctrl-C there keeps
    every cycle in both, notes the stop in run.json and says what was kept, not that no cycle ran."""
    from specfit.runinfo import read_run_info
    from specfit.runtime import decode_job
    from specfit.runtime.run_dir import DecodeOutputs

    owner, name = (DecodeOutputs, "close") if where == "cycles.parquet" else (decode_job, "_write_recording")
    original, calls = getattr(owner, name), []

    def stop_the_first_time(*args):
        calls.append(args)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return original(*args)

    monkeypatch.setattr(owner, name, stop_the_first_time)
    out, trace_path = tmp_path / "run", tmp_path / "live.parquet"
    result = decode(checkpoint, "--policy", "eagle3:12:4", "--profile", "pcie4", "--out", str(out),
                    "--record", str(trace_path))
    assert result.exit_code == 130, result.output
    said = " ".join(result.output.split())
    assert "no cycle was decoded" not in said and "kept every complete cycle" in said, said
    cycles = pd.read_parquet(out / "cycles.parquet")
    assert sorted(set(cycles["sequence"])) == list(range(len(PROMPTS)))
    assert read_trace(trace_path).n_cycles == len(cycles)
    assert (out / "summary.json").is_file() and not (out / "cycles.jsonl").exists()
    assert any("interrupted" in note for note in read_run_info(out)["notes"])


def test_a_recording_without_a_decode_cycle_is_one_error_and_the_other_outputs_are_written(checkpoint, tmp_path,
                                                                                             monkeypatch):
    """Every output ending at the prompt pass's token (a first token that is EOS) leaves nothing to
    record: one line naming --record, no trace file, and decode.jsonl and summary.json written."""
    from specfit.runtime.record import TraceRecorder

    monkeypatch.setattr(TraceRecorder, "add_cycle", lambda self, stats: None)    # as if no cycle ran
    out, trace_path = tmp_path / "run", tmp_path / "live.parquet"
    result = decode(checkpoint, "--policy", "eagle3:12:4", "--profile", "pcie4", "--out", str(out),
                    "--record", str(trace_path))
    assert result.exit_code == 2, result.output
    assert f"--record {trace_path}: no decode cycle ran" in " ".join(result.stderr.split()), result.stderr
    assert "Traceback" not in result.output and len(result.stderr.strip().splitlines()) == 1
    assert not trace_path.exists()
    assert (out / "summary.json").is_file() and len((out / "decode.jsonl").read_text().splitlines()) == len(PROMPTS)


# --------------------------------------------------------------------------- bad input
def _corrupt(drafter_dir, tmp_path, change):
    bad = tmp_path / "bad_drafter"
    bad.mkdir()
    tensors = load_file(drafter_dir / "model.safetensors")
    config = json.loads((drafter_dir / "config.json").read_text())
    change(tensors, config)
    save_file(tensors, str(bad / "model.safetensors"))
    (bad / "config.json").write_text(json.dumps(config))
    return bad


def test_a_drafter_that_fails_mid_run_is_named_and_the_cycles_before_it_are_kept(checkpoint, tmp_path):
    """NaN drafter weights surface at specfit's first draft, after ar has decoded every prompt: one
    line naming the drafter's directory and what was kept, and the run directory readable."""
    model_dir, drafter_dir, prompts = checkpoint
    bad = _corrupt(drafter_dir, tmp_path, lambda t, c: t.update({"fc.weight": torch.full_like(t["fc.weight"], float("nan"))}))
    out = tmp_path / "run"
    result = runner.invoke(app, ["decode", "--model", str(model_dir), "--drafter", str(bad), "--prompts", str(prompts),
                                 "--cache-experts", "3", "--device", "cpu", "--max-new-tokens", str(NEW_TOKENS),
                                 "--ignore-eos", "--profile", "pcie4", "--policies", "ar,specfit", "--out", str(out)])
    assert result.exit_code == 2, result.output
    line = " ".join(result.output.split())
    kept = len(PROMPTS) * (NEW_TOKENS - 1)
    assert f"drafter {bad}: NaN probabilities" in line and "Traceback" not in result.output
    assert f"(before it: kept every complete cycle, {kept} of them, in {out})" in line
    cycles = pd.read_parquet(out / "cycles.parquet")
    assert len(cycles) == kept and set(cycles["policy"]) == {"ar"}
    assert not (out / "cycles.jsonl").exists() and len((out / "decode.jsonl").read_text().splitlines()) == len(PROMPTS)


@pytest.mark.parametrize("change, message", [
    (lambda t, c: c.update(vocab_size=VOCAB + 4), "'vocab_size' is 100, but the target model has vocab_size 96"),
    (lambda t, c: t.update(d2t=t["d2t"] + VOCAB), "outside the target vocabulary"),
    (lambda t, c: t.update(t2d=torch.zeros(VOCAB, dtype=torch.bool)), "disagree"),
    (lambda t, c: (c.update(target_hidden_size=32), t.update({"fc.weight": torch.zeros(256, 96)})),
     "3 x target_hidden_size = 3 x 32 features, but the target model has hidden_size 64"),
    (lambda t, c: t.update({"fc.weight": torch.zeros(256, 96)}), "built for a target with hidden size 32"),
    # a width that is no multiple of 3 was built for no target: no fractional hidden size is named
    (lambda t, c: t.update({"fc.weight": torch.zeros(256, 100)}),
     "tensor 'fc.weight' has shape [256, 100], expected [256, 192]"),
    (lambda t, c: c.update(eagle_aux_hidden_state_layer_ids=[0, 1, 5]), "but the target has 2 layers"),
])
def test_bad_drafter_checkpoint_is_one_clear_error(checkpoint, tmp_path, change, message):
    model_dir, drafter_dir, prompts = checkpoint
    bad = _corrupt(drafter_dir, tmp_path, change)
    result = runner.invoke(app, ["decode", "--model", str(model_dir), "--drafter", str(bad), "--prompts", str(prompts),
                                 "--cache-experts", "2", "--policy", "eagle3", "--profile", "pcie4"])
    assert result.exit_code == 2, result.output
    assert message in result.stderr.replace("\n", " ")
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert not re.search(r"hidden size \d+\.\d", result.stderr)         # no target has a fractional width


@pytest.mark.parametrize("args, message", [
    (["--policy", "specfit", "--temperature", "0.5", "--record", "t.parquet"], "--record: traces describe greedy"),
    (["--policies", "ar,specfit", "--record", "t.parquet"], "--record: records the cycles of one policy"),
    (["--record-full"], "--record-full: pass --record TRACE"),
    (["--record", "t.parquet", "--max-new-tokens", "1"], "--record: --max-new-tokens 1 ends every output"),
    (["--policies", "ar,ar"], "names a policy twice"),
    (["--policy", "oracle"], "--policy oracle: knows the target's verdicts in advance"),
    (["--policies", "ar,static:auto"], "--policies static:auto: only a replay can run it"),
    (["--policies", "ar,sequoia:auto"], "--policies sequoia:auto: only a replay can run it"),
    (["--temperature", "-1"], "--temperature: expected a non-negative number"),
    (["--tree-top-k", "0"], "--tree-top-k: expected at least 1"),
    (["--policy", "specfit", "--tree-top-k", "5000"], "--tree-top-k: expected at most the drafter's vocabulary"),
    (["--seed", "-1"], "--seed: expected a non-negative integer, got -1"),
    (["--profile", "nowhere.json"], "nowhere.json: no such profile file"),
    (["--acceptance", "nowhere.parquet"], "--acceptance nowhere.parquet: no such trace file"),
])
def test_bad_options_are_one_clear_error(checkpoint, args, message):
    result = decode(checkpoint, *args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_an_unreadable_acceptance_trace_is_named_before_the_model_loads_or_a_profile_is_measured(checkpoint, tmp_path,
                                                                                                  monkeypatch):
    import specfit.runtime.loader as loader

    garbled = tmp_path / "garbled.parquet"
    garbled.write_bytes(b"not a parquet file")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    loaded = []
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: loaded.append(a) or pytest.fail("model loaded"))
    result = decode(checkpoint, "--policy", "eagle3:12:3", "--acceptance", str(garbled))
    assert result.exit_code == 2, result.output
    assert str(garbled) in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not loaded and not (tmp_path / "cache").exists()


def test_an_acceptance_trace_of_another_model_is_refused_before_the_model_loads(checkpoint, monkeypatch):
    """The calibration learns how often the trace's target accepted its drafter's tokens: another
    model's trace would price this model's trees with that model's acceptance."""
    import specfit.runtime.loader as loader
    from trace_helpers import SAMPLE_QWEN3

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    result = decode(checkpoint, "--policy", "specfit", "--profile", "pcie4", "--acceptance", str(SAMPLE_QWEN3))
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert f"--acceptance {SAMPLE_QWEN3}: 48 MoE layers x 128 experts, top-8" in result.stderr, result.stderr
    assert "a trace of another model" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def _one_union_per_prompt(trace):
    """``trace`` with each sequence's prompt passes recorded as one union of their experts (a
    recording without the passes' order): what a replay that admits the prompt at once sees."""
    import copy

    trace = copy.copy(trace)
    trace.meta = copy.deepcopy(trace.meta)
    recording = trace.meta["recording"]
    counts, experts = recording.pop("prefill_pass_counts"), recording["prefill_experts"]
    ends = np.cumsum(counts)
    recording["prefill_experts"] = [[sorted(set().union(*(p[layer] for p in experts[end - n:end])))
                                     for layer in range(trace.n_layers)] for n, end in zip(counts, ends)]
    return trace


@pytest.mark.parametrize("mode, eviction, capacity, chunk", [
    ("per_layer", "lru", 3, 512), ("per_layer", "lfu", 3, 512), ("global", "lru", 10, 512), ("global", "lfu", 10, 512),
    # prompts of 5, 3 and 7 tokens in passes of 2: each pass's union admitted in turn
    ("per_layer", "lru", 3, 2), ("global", "lfu", 10, 2), ("global", "moe-infinity", 10, 2),
    ("per_layer", "moe-infinity", 3, 512)])
def test_a_live_run_and_a_replay_of_its_trace_count_the_same_hits_misses_and_bytes(checkpoint, tmp_path, mode,
                                                                                     eviction, capacity, chunk):
    """The cache is shared code: re-charging the recorded cycles through a fresh cache with the live
    run's settings gives the live run's per-cycle traffic exactly, for every eviction policy and mode,
    a prompt run in chunks too (its passes admitted in the order they ran, not as one union)."""
    from specfit.simulate.recorded import recharge

    trace_path, out = tmp_path / "live.parquet", tmp_path / "run"
    model_dir, drafter_dir, prompts = checkpoint
    result = runner.invoke(app, ["decode", "--model", str(model_dir), "--drafter", str(drafter_dir), "--prompts",
                                 str(prompts), "--cache-experts", str(capacity), "--cache-mode", mode, "--cache-policy",
                                 eviction, "--device", "cpu", "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos",
                                 "--policy", "eagle3:12:3", "--profile", "pcie4", "--record", str(trace_path),
                                 "--out", str(out), "--prefill-chunk", str(chunk)])
    assert result.exit_code == 0, result.output
    live = pd.read_parquet(out / "cycles.parquet")
    trace = read_trace(trace_path)
    counts = trace.meta["recording"]["prefill_pass_counts"]
    assert counts == ([1, 1, 1] if chunk > 7 else [3, 2, 4])

    def recharged(trace):
        return recharge(trace, ExpertCache(trace.n_layers, trace.n_experts, capacity, mode=mode, policy=eviction,
                                           expert_bytes=trace.expert_bytes))

    replayed = recharged(trace)
    assert len(replayed) == len(live) and live["misses"].sum() > 0 and live["hits"].sum() > 0
    for column in ("hits", "misses", "bytes_h2d"):
        np.testing.assert_array_equal(replayed[column].to_numpy(), live[column].to_numpy(), err_msg=column)
    # the passes' order matters: one union per prompt leaves another cache (where prompt passes
    # evict: moe-infinity's fill free slots only)
    if chunk < 7 and eviction != "moe-infinity":
        assert (recharged(_one_union_per_prompt(trace))["hits"].to_numpy() != live["hits"].to_numpy()).any()
    # without a cache the same cycles copy every expert of their unions: the cache did the saving
    streamed = recharge(trace, ExpertCache(trace.n_layers, trace.n_experts, 0, mode=mode))
    assert (streamed["hits"] == 0).all() and streamed["misses"].sum() > live["misses"].sum()


def test_a_decode_whose_outputs_end_at_the_prefill_token_reports_no_cycles(checkpoint, tmp_path):
    """--max-new-tokens 1 (or a first token that is EOS): no cycle runs; the run still writes its
    outputs and its summary (0 cycles, rates NaN) instead of failing on an empty cycle table."""
    model_dir, drafter_dir, prompts = checkpoint
    out = tmp_path / "run"
    result = runner.invoke(app, ["decode", "--model", str(model_dir), "--drafter", str(drafter_dir), "--prompts",
                                 str(prompts), "--cache-experts", "3", "--device", "cpu", "--max-new-tokens", "1",
                                 "--policies", "ar,specfit", "--profile", "pcie4", "--out", str(out)])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert [s["cycles"] for s in summary] == [0, 0] and all(s["tokens"] == 0 for s in summary)
    records = [json.loads(line) for line in (out / "decode.jsonl").read_text().splitlines()]
    assert len(records) == 2 * len(PROMPTS) and all(len(r["output_ids"]) == 1 for r in records)
    assert not (out / "cycles.parquet").exists() and "cycles.parquet" not in result.output
    # the figures no cycle gives (tokens/s, times, errors, hit rates) print as "-", as every empty cell does
    rows = [line for line in result.stdout.splitlines() if line.startswith(("│ ar ", "│ specfit "))]
    assert len(rows) == 2 * len(PROMPTS) + 2, result.stdout
    assert not any(re.search(r"\bnan\b", row, re.IGNORECASE) for row in rows), result.stdout
    assert all(" - " in row for row in rows), result.stdout


def test_decode_refuses_an_unknown_cache_policy_before_loading(checkpoint):
    result = decode(checkpoint, "--cache-policy", "mru")
    assert result.exit_code == 2 and "--cache-policy" in result.output


@pytest.mark.parametrize("predictor", ["affinity", "parent"])
def test_every_live_predictor_decodes_losslessly_and_is_scored(checkpoint, tmp_path, predictor):
    out = tmp_path / "run"
    result = decode(checkpoint, "--policies", "ar,specfit", "--profile", "gh200", "--predictor", predictor,
                    "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "greedy outputs identical across policies: yes" in result.stdout
    cycles = pd.read_parquet(out / "cycles.parquet")
    specfit = cycles[cycles.policy == "specfit"]
    # the predictions the search used were checked against the verified nodes' true experts
    assert (specfit["predicted_union_size"] > 0).all() and specfit["union_overlap"].sum() > 0


def test_router_predictor_in_replay_routes_like_the_live_one(checkpoint, tmp_path):
    """A replay has no drafter state: the router predictor routes each node's embedding, with the
    most recent known routing (the token before the cycle's root) raised, as the live one does."""
    from specfit.experts.predictors import NodeBatch, last_known_experts
    from specfit.experts.router import RouterPredictor
    from specfit.runtime.loader import load_model
    from specfit.simulate.replay import prepare_trace

    model_dir = checkpoint[0]
    trace_path = tmp_path / "full.parquet"
    result = decode(checkpoint, "--policy", "ar", "--record", str(trace_path), "--record-full", "--max-levels", "2",
                    "--profile", "pcie4")
    assert result.exit_code == 0, result.output
    trace = read_trace(trace_path)
    prep = prepare_trace("full", trace, predictor="router", acceptance="raw", model_dir=model_dir)
    model = load_model(model_dir)
    sizes = np.diff(trace.offsets)
    last = np.repeat(last_known_experts(trace), sizes, axis=0)
    assert (last[:, 0, 0] >= 0).mean() > 0.5                    # the recent routing is known for most nodes
    live = RouterPredictor(model).predict(NodeBatch(trace.token, last))
    np.testing.assert_array_equal(prep.predicted_experts, live)
    assert not np.array_equal(live, RouterPredictor(model, recent_bonus=0.0).predict(
        NodeBatch(trace.token, np.full(trace.true_experts.shape, -1))))
    with pytest.raises(SpecFitError, match="--model"):
        prepare_trace("full", trace, predictor="router")


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM", "SIGKILL"])
def test_a_run_stopped_mid_prompt_keeps_every_complete_cycle(checkpoint, tmp_path, signal_name):
    """A real process, stopped while a prompt is being decoded: Ctrl-C (or a kill's SIGTERM) saves
    every complete cycle into cycles.parquet and the recording, and says so; a SIGKILL leaves them
    in the journal, which the readers use."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from specfit.calibrate.calibrate_job import read_run_cycles
    from specfit.runtime.run_dir import JOURNAL_FILE, read_decode_cycles

    model_dir, drafter_dir, _ = checkpoint
    prompts = tmp_path / "long.jsonl"
    prompts.write_text(json.dumps({"input_ids": [3, 1, 4]}) + "\n")
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    process = subprocess.Popen([sys.executable, "-m", "specfit", "decode", "--model", str(model_dir), "--drafter",
                                str(drafter_dir), "--prompts", str(prompts), "--cache-experts", "3", "--policy", "specfit",
                                "--profile", "pcie4", "--max-new-tokens", "200", "--ignore-eos", "--out", str(out),
                                "--record", str(tmp_path / "rec.parquet")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               preexec_fn=default_sigint)
    journal = out / JOURNAL_FILE
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and (not journal.is_file() or len(journal.read_text().splitlines()) < 5):
        time.sleep(0.1)
    assert process.poll() is None, process.communicate()
    process.send_signal(getattr(signal, signal_name))
    _, stderr = process.communicate(timeout=60)
    kept = read_decode_cycles(out)
    assert len(kept) >= 5 and kept["sequence"].eq(0).all()      # cycles of the prompt that never finished
    assert list(kept["cycle"]) == list(range(len(kept)))
    assert len(read_run_cycles(out)) == len(kept)                # a refit reads them too
    if signal_name != "SIGKILL":
        assert process.returncode == {"SIGINT": 130, "SIGTERM": 143}[signal_name], stderr[-3000:]
        assert f"kept every complete cycle, {len(kept)} of them" in stderr and str(out) in stderr
        assert len(pd.read_parquet(out / "cycles.parquet")) == len(kept) and not journal.exists()
        assert read_trace(tmp_path / "rec.parquet").n_cycles >= len(kept) > 0
    else:
        assert process.returncode == -signal.SIGKILL and journal.exists()
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_a_predictor_fitted_on_a_recorded_trace_decodes_losslessly(checkpoint, tmp_path):
    from specfit.runtime.decode_job import _fitted_predictor
    from specfit.runtime.loader import load_model

    trace_path = tmp_path / "full.parquet"
    result = decode(checkpoint, "--policy", "ar", "--record", str(trace_path), "--record-full", "--max-levels", "2",
                    "--profile", "pcie4")
    assert result.exit_code == 0, result.output
    ar = decode(checkpoint, "--policy", "ar", "--profile", "pcie4", "--json")
    fitted = decode(checkpoint, "--policy", "specfit", "--predictor", "learned", "--predictor-trace", str(trace_path),
                    "--profile", "pcie4", "--json")
    assert fitted.exit_code == 0, fitted.output

    def outputs(r):
        return [json.loads(line)["output_ids"] for line in r.stdout.splitlines()]

    assert outputs(ar) and outputs(fitted) == outputs(ar)
    # the fitted predictor predicts before it has seen a verified token (an unfitted one cannot)
    model = load_model(checkpoint[0])
    plan = DecodePlan(model_dir=checkpoint[0], prompts_path=checkpoint[2], cache_experts=3, policies=["ar"],
                      predictor="affinity", predictor_trace=trace_path)
    trace = read_trace(trace_path)
    from specfit.experts.predictors import NodeBatch, make_predictor

    batch = NodeBatch(trace.token[:4], np.full((4,) + trace.true_experts.shape[1:], -1))
    assert _fitted_predictor(plan, model.config).predict(batch).shape == (4,) + trace.true_experts.shape[1:]
    with pytest.raises(SpecFitError, match="not fitted"):
        make_predictor("affinity").predict(batch)


@pytest.mark.parametrize("args, message", [
    (["--predictor", "router", "--predictor-trace", "{trace}"], "learns nothing from a trace"),
    (["--predictor", "learned", "--predictor-trace", "{missing}"], "no such trace file"),
    (["--predictor", "affinity", "--predictor-trace", "{other}"], "a trace of another model"),
    (["--predictor", "affinity", "--router-fixed"], "fixes the router predictor's context weight"),
])
def test_a_bad_predictor_trace_is_one_line(checkpoint, tmp_path, monkeypatch, args, message):
    """Each is refused before the model loads (a trace of another model too: the fit needs the trace alone)."""
    import specfit.runtime.loader as loader
    from trace_helpers import SAMPLE_QWEN3

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    paths = {"trace": str(SAMPLE_QWEN3), "missing": str(tmp_path / "nope.parquet"), "other": str(SAMPLE_QWEN3)}
    result = decode(checkpoint, "--policy", "specfit", "--profile", "pcie4", *[a.format(**paths) for a in args])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert message in result.output and result.output.strip().count("\n") == 0


def test_a_run_on_raw_draft_probabilities_that_mispredict_says_how_to_calibrate():
    from specfit.runtime.commands import raw_acceptance_notes

    summaries = [{"policy": "ar", "tokens_per_cycle": 1.0, "predicted_tokens_per_cycle": 1.0},
                 # the bundled drafter's raw probabilities on EAGLE-3's trees (specfit decode, no --acceptance)
                 {"policy": "eagle3", "tokens_per_cycle": 3.55, "predicted_tokens_per_cycle": 1.54},
                 {"policy": "specfit", "tokens_per_cycle": 1.36, "predicted_tokens_per_cycle": 1.19},   # -12.5 %
                 {"policy": "specfit+online", "tokens_per_cycle": 1.9, "predicted_tokens_per_cycle": 3.0},
                 {"policy": "chain:2", "tokens_per_cycle": 2.0, "predicted_tokens_per_cycle": 2.5},
                 {"policy": "specfit:4", "tokens_per_cycle": 2.0, "predicted_tokens_per_cycle": 1.5}]
    notes = raw_acceptance_notes(summaries)
    assert len(notes) == 3
    assert notes[0].startswith("note: eagle3:") and "1.54 tokens per cycle where 3.55" in notes[0]
    assert "(-57%)" in notes[0] and "--acceptance TRACE" in notes[0] and "--record-full" in notes[0]
    assert notes[1].startswith("note: chain:2:") and "(+25%)" in notes[1]
    # a fixed tree drafts the same whatever the probabilities say: only its predictions use them
    assert all("the predicted tokens and times use them" in n and "SpecFit decides" not in n for n in notes[:2])
    assert notes[2].startswith("note: specfit:4:") and "(-25%); SpecFit decides with them. Record" in notes[2]
    # calibrated online, or no decision (ar), or no cycles: nothing to say
    assert raw_acceptance_notes([{"policy": "specfit", "tokens_per_cycle": float("nan"),
                                  "predicted_tokens_per_cycle": 2.0}]) == []
    # a small error, but SpecFit ran below ar (a README decode without --acceptance: 111.6 against 148.3)
    rates = [{"policy": "ar", "tokens_per_cycle": 1.0, "predicted_tokens_per_cycle": 1.0, "tokens_per_s": 148.3},
             {"policy": "specfit", "tokens_per_cycle": 1.39, "predicted_tokens_per_cycle": 1.23, "tokens_per_s": 111.6},
             {"policy": "eagle3", "tokens_per_cycle": 2.0, "predicted_tokens_per_cycle": 1.9, "tokens_per_s": 67.9}]
    notes = raw_acceptance_notes(rates)
    assert len(notes) == 1 and notes[0].startswith("note: specfit: 111.6 tokens/s, below ar's 148.3; the drafter's raw")
    assert "(-12%); SpecFit decides with them. Record" in notes[0]
    rates[1]["tokens_per_s"] = 150.0                  # ahead of ar: the error alone decides (under 15 %)
    assert raw_acceptance_notes(rates) == []


def test_the_bundled_model_decodes_in_bfloat16_on_the_cpu(tmp_path):
    """bfloat16 on the CPU: the drafter's hidden states reach the router predictor as float32
    arrays (numpy has no bfloat16), and greedy decoding stays lossless."""
    from specfit import assets

    root = Path(assets.__file__).parent
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text((root / "prompts.jsonl").read_text().splitlines()[0] + "\n")
    result = runner.invoke(app, ["decode", "--model", str(root / "tiny-moe"), "--drafter", str(root / "tiny-moe-eagle3"),
                                 "--prompts", str(prompts), "--cache-experts", "8", "--policies", "ar,specfit,eagle3",
                                 "--device", "cpu", "--dtype", "bfloat16", "--max-new-tokens", "16", "--ignore-eos",
                                 "--profile", "pcie4", "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    assert "greedy outputs identical across policies: yes" in result.stdout
    cycles = pd.read_parquet(tmp_path / "run" / "cycles.parquet")
    assert (cycles[cycles.policy == "eagle3"]["draft_levels"] > 0).all()


def test_the_journal_is_strict_json_and_reads_back_as_the_rows_were(tmp_path):
    """A killed run's cycles are read from its journal: the journal holds strict JSON (a figure
    without a value as null, which jq and JavaScript read), read back as NaN in a float column."""
    from specfit.runtime.run_dir import JOURNAL_FILE, DecodeOutputs, read_decode_cycles

    outputs = DecodeOutputs(tmp_path / "run")
    rows = [{"policy": "specfit", "sequence": 0, "position": 3 + i, "cycle": i, "time_s": 0.01 * (i + 1),
             "online_predicted_time_s": float("nan") if i == 0 else 0.02, "layer_misses": [1, 2]} for i in range(2)]
    for row in rows:
        outputs.add_cycle(row)
    lines = (tmp_path / "run" / JOURNAL_FILE).read_text().splitlines()
    parsed = [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in the journal")) for line in lines]
    assert parsed[0]["online_predicted_time_s"] is None and parsed[1]["online_predicted_time_s"] == 0.02
    kept = read_decode_cycles(tmp_path / "run")            # as after a SIGKILL: no cycles.parquet yet
    assert kept["online_predicted_time_s"].dtype == np.float64
    assert np.isnan(kept["online_predicted_time_s"][0]) and kept["online_predicted_time_s"][1] == 0.02
    assert list(kept["cycle"]) == [0, 1] and list(kept["layer_misses"][1]) == [1, 2]


@pytest.mark.usefixtures("quiet_machine")
def test_float16_decodes_as_ar_does_and_uses_a_profile_calibrated_in_float16(checkpoint, tmp_path, monkeypatch):
    """`specfit calibrate --dtype float16` writes a float16 profile: decode runs in float16 too (its
    greedy output the target's own in that dtype) and finds that profile, not a float32 one."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    ar = decode(checkpoint, "--policies", "ar,specfit", "--dtype", "float16", "--json")
    assert ar.exit_code == 0, ar.output
    rows = [json.loads(line) for line in ar.stdout.splitlines()]
    by_prompt = {}
    for row in rows:
        by_prompt.setdefault(row["index"], {})[row["policy"]] = row["output_ids"]
    assert len(by_prompt) == len(PROMPTS) and all(p["ar"] == p["specfit"] for p in by_prompt.values())
    saved = list((tmp_path / "user-cache" / "specfit" / "profiles").glob("*.json"))
    assert len(saved) == 1 and saved[0].name.endswith("-float16.json")
    from specfit.calibrate.profile import ModelShape
    from specfit.runtime.config import ModelConfig

    half = ModelShape.from_config(ModelConfig.from_dir(checkpoint[0]), torch.float16, "x").expert_bytes
    assert json.loads(saved[0].read_text())["shape"]["expert_bytes"] == half      # experts in 2 bytes a weight
    wrong = decode(checkpoint, "--policy", "ar", "--dtype", "float64")
    assert wrong.exit_code == 2 and "--dtype: expected one of float32, bfloat16, float16, got 'float64'" in wrong.output


@pytest.mark.parametrize("mode, capacity, chunk", [("per_layer", 3, 512), ("global", 10, 512), ("per_layer", 3, 2),
                                                   ("global", 10, 2)])
def test_a_replay_of_a_full_recording_counts_the_live_runs_hits_and_misses_cycle_for_cycle(checkpoint, tmp_path, mode,
                                                                                           capacity, chunk):
    """A fixed policy decides the same in a replay as live, and the replay's cache starts each
    sequence as the live one did: holding the experts of its prompt's passes (recorded in the trace,
    one per chunk, admitted in the order they ran), so every cycle's hits and misses are the live
    run's, compiled and Python replay alike."""
    trace_path, out = tmp_path / "full.parquet", tmp_path / "run"
    policies = ("ar", "eagle3:12:3")
    result = decode(checkpoint, "--policies", ",".join(policies), "--cache-mode", mode, "--cache-experts",
                    str(capacity), "--max-levels", "3", "--profile", "pcie4", "--frozen-profile", "--record",
                    str(trace_path), "--record-full", "--out", str(out), "--prefill-chunk", str(chunk))
    assert result.exit_code == 0, result.output
    live = pd.read_parquet(out / "cycles.parquet")
    trace = read_trace(trace_path)
    prep = prepare("full", trace, trace.true_experts)
    assert prep.has_prefill.all()
    assert np.diff(prep.prefill_offsets).tolist() == ([1, 1, 1] if chunk > 7 else [3, 2, 4])
    one_union = prepare("one union", _one_union_per_prompt(trace), trace.true_experts)
    cost = CostModel(2e-3, 5e-5, 2e-5, 2e-4, 3e-4)

    def replayed(prep, spec, compiled=True):
        cache = ExpertCache(trace.n_layers, trace.n_experts, capacity, mode=mode, expert_bytes=trace.expert_bytes)
        return replay(prep, make_policy(spec, max_levels=3), cache, cost, compiled=compiled)

    differs = False
    for spec in policies:
        ran = live[live["policy"] == spec].reset_index(drop=True)
        for compiled in (True, False):
            log = replayed(prep, spec, compiled)
            for column in ("position", "nodes_drafted", "nodes_verified", "committed_tokens", "hits", "misses"):
                np.testing.assert_array_equal(log.columns[column], ran[column].to_numpy(),
                                              err_msg=f"{spec} {column} compiled={compiled}")
        assert ran["hits"].sum() > 0 and ran["misses"].sum() > 0
        differs |= bool((replayed(one_union, spec).columns["hits"] != ran["hits"].to_numpy()).any())
    assert differs == (chunk < 7)     # the passes' order matters: one union per prompt leaves another cache


@pytest.mark.parametrize("stop", ["bad input", "Ctrl-C"])
def test_a_decode_stopped_while_loading_leaves_no_folder_it_made(checkpoint, tmp_path, monkeypatch, stop):
    """The --out lock is taken before loading (creating --out and any missing parents): bad input
    or a Ctrl-C before the first cycle removes every folder the run made, and nothing of a folder
    that was there."""
    from specfit.runtime import loader

    def fails(*args, **kwargs):
        if stop == "Ctrl-C":
            raise KeyboardInterrupt
        raise SpecFitError("model.safetensors: a tensor is missing")

    monkeypatch.setattr(loader, "load_model", fails)
    result = decode(checkpoint, "--policy", "ar", "--profile", "pcie4", "--out", str(tmp_path / "a" / "b" / "run"))
    assert result.exit_code == (130 if stop == "Ctrl-C" else 2), result.output
    assert not (tmp_path / "a").exists()
    there = tmp_path / "there"
    there.mkdir()
    (there / "notes.txt").write_text("mine")
    result = decode(checkpoint, "--policy", "ar", "--profile", "pcie4", "--out", str(there / "run"))
    assert result.exit_code in (2, 130) and [p.name for p in there.iterdir()] == ["notes.txt"]


def test_a_decode_that_crashes_mid_run_still_writes_its_complete_cycles(checkpoint, tmp_path, monkeypatch):
    """An error that is neither bad input nor a stop (out of device memory, a torch error) goes on
    as it is, but the cycles completed before it are in cycles.parquet, as after a stop."""
    from specfit.runtime.decoder import Decoder

    model_dir, drafter_dir, prompts = checkpoint
    out = tmp_path / "run"
    plan = DecodePlan(model_dir=model_dir, prompts_path=prompts, cache_experts=3, policies=["ar"], profile="pcie4",
                      max_new_tokens=NEW_TOKENS, device="cpu", out_dir=out, ignore_eos=True, warmup=False)
    generate, calls = Decoder.generate, []

    def second_prompt_crashes(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(Decoder, "generate", second_prompt_crashes)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        run_decode(plan)
    kept = pd.read_parquet(out / "cycles.parquet")
    assert len(kept) == NEW_TOKENS - 1 and (kept["sequence"] == 0).all()     # the first prompt's cycles
    assert not (out / "cycles.jsonl").exists()


def test_a_cycle_cut_short_by_eos_reports_the_tokens_that_reached_the_output(checkpoint, tmp_path):
    """A cycle whose accepted path holds EOS before its end commits only the tokens up to EOS: its row
    in cycles.parquet counts those, so each sequence's rows add up to its output after the prefill's
    token (tokens per cycle and tokens/s are computed from them)."""
    import shutil

    model_dir, drafter_dir, prompts = checkpoint

    def run(model, out, *args):
        result = runner.invoke(app, ["decode", "--model", str(model), "--drafter", str(drafter_dir), "--prompts",
                                     str(prompts), "--cache-experts", "3", "--device", "cpu", "--max-new-tokens",
                                     str(NEW_TOKENS), "--policies", "chain:4", "--profile", "pcie4", "--out", str(out),
                                     *args])
        assert result.exit_code == 0, result.output
        records = [json.loads(line) for line in (out / "decode.jsonl").read_text().splitlines()]
        return records, read_decode_cycles(out)

    records, cycles = run(model_dir, tmp_path / "all", "--ignore-eos")
    # a token committed inside a multi-token cycle, not at its end, seen nowhere earlier in its sequence
    cut = None
    for row in cycles.sort_values(["sequence", "cycle"]).itertuples():
        output = records[row.sequence]["output_ids"]
        for j in range(row.committed_tokens - 1):
            at = row.position + 1 + j
            if output[at] not in output[:at]:
                cut = (row.sequence, at, output[at])
                break
        if cut is not None:
            break
    assert cut is not None, "no multi-token cycle to cut: the drafter accepts nothing"
    sequence, at, eos = cut

    eos_model = tmp_path / "eos_model"
    shutil.copytree(model_dir, eos_model)
    (eos_model / "generation_config.json").write_text(json.dumps({"eos_token_id": int(eos)}))
    records, cycles = run(eos_model, tmp_path / "eos")
    assert records[sequence]["stop_reason"] == "eos" and records[sequence]["output_ids"][-1] == eos
    assert len(records[sequence]["output_ids"]) == at + 1
    for record in records:
        rows = cycles[cycles["sequence"] == record["index"]]
        assert rows["committed_tokens"].sum() == len(record["output_ids"]) - 1, record["index"]


def test_a_single_policy_run_makes_no_claim_about_outputs_across_policies(checkpoint):
    """'Identical across policies' compares several policies' greedy outputs: one policy has
    nothing to compare with, so the line is left out rather than answered 'yes'."""
    result = decode(checkpoint, "--policy", "ar", "--profile", "pcie4")
    assert result.exit_code == 0, result.output
    assert "identical across policies" not in result.stdout
    both = decode(checkpoint, "--policies", "ar,eagle3:12:4", "--profile", "pcie4")
    assert both.exit_code == 0, both.output
    assert "greedy outputs identical across policies: yes" in both.stdout


def test_sampling_specfit_learns_its_acceptance_from_the_sampled_outcomes(checkpoint, tmp_path):
    """At a temperature above 0, `specfit` runs as `specfit+online` (named so, with a note saying why),
    and its online acceptance learns from the target's probabilities of the drafted tokens: soft
    outcomes, not the greedy verdicts' 0 / 1."""
    from specfit.runtime.decode_job import DecodePlan, run_decode

    model_dir, drafter_dir, prompts = checkpoint
    result = decode(checkpoint, "--policies", "ar,specfit", "--temperature", "0.8", "--profile", "pcie4",
                    "--out", str(tmp_path / "run"))
    assert result.exit_code == 0, result.output
    assert "note: --temperature 0.8: specfit+online learn(s) acceptance online" in result.output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    names = [s["policy"] for s in (summary if isinstance(summary, list) else summary["policies"])]
    assert names == ["ar", "specfit+online"]
    run = run_decode(DecodePlan(model_dir=model_dir, drafter_dir=drafter_dir, prompts_path=prompts, cache_experts=3,
                                policies=["specfit"], max_new_tokens=NEW_TOKENS, device="cpu", ignore_eos=True,
                                profile="pcie4", temperature=0.8))
    acceptance = run.policies[0].acceptance
    _, outcomes = acceptance._window()          # the outcomes it learned from
    assert outcomes.size > 0 and np.all((outcomes >= 0) & (outcomes <= 1))
    assert np.any((outcomes > 0) & (outcomes < 1))             # probabilities, not verdicts
    # greedy decoding keeps specfit as named (its acceptance comes from a trace or the drafter)
    greedy = DecodePlan(model_dir=model_dir, drafter_dir=drafter_dir, prompts_path=prompts, cache_experts=3,
                        policies=["specfit"], max_new_tokens=NEW_TOKENS, device="cpu", profile="pcie4").validate()
    assert greedy[0].name == "specfit" and greedy[0].acceptance is None


def test_sampling_refuses_specfit_named_beside_the_specfit_online_it_becomes(checkpoint):
    result = decode(checkpoint, "--policies", "specfit,specfit+online", "--temperature", "0.8", "--profile", "pcie4")
    assert result.exit_code != 0
    assert "--policies: when sampling (--temperature > 0) specfit learns its acceptance online" in result.output


def test_a_rerun_that_crashes_before_its_first_cycle_keeps_a_killed_runs_cycles(checkpoint, tmp_path, monkeypatch):
    """A crash that is no bad input (out of device memory) at a rerun's first pass: the journal of the
    SIGKILLed last run, its only copy of its cycles, stays."""
    from specfit.runtime.decoder import Decoder

    model_dir, drafter_dir, prompts = checkpoint
    out = tmp_path / "run"
    out.mkdir()
    (out / "cycles.jsonl").write_text('{"policy": "ar", "cycle": 0}\n{"policy": "ar", "cycle": 1}\n')
    plan = DecodePlan(model_dir=model_dir, prompts_path=prompts, cache_experts=3, policies=["ar"], profile="pcie4",
                      max_new_tokens=NEW_TOKENS, device="cpu", out_dir=out, ignore_eos=True, warmup=False)

    def oom(self, *args, **kwargs):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(Decoder, "prefill", oom)
    with pytest.raises(SpecFitError, match=r"^out of device memory: CUDA out of memory; .* \(after 0 complete cycle"):
        run_decode(plan)
    assert len(read_decode_cycles(out)) == 2


def _ar_plan(checkpoint, out):
    model_dir, drafter_dir, prompts = checkpoint
    return DecodePlan(model_dir=model_dir, prompts_path=prompts, cache_experts=3, policies=["ar"], profile="pcie4",
                      max_new_tokens=NEW_TOKENS, device="cpu", out_dir=out, ignore_eos=True, warmup=False)


@pytest.mark.parametrize("peer", [BrokenPipeError(errno.EPIPE, "Broken pipe"),
                                  ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")])
def test_a_reader_that_went_away_mid_decode_is_not_blamed_on_the_run_directory(checkpoint, tmp_path, peer):
    """A peer's error (a `| head` reader closing, a network) met while a record is handed on goes on
    as itself: it is no full disk, so no SpecFitError naming the run directory."""
    def gone(record):
        raise peer

    with pytest.raises(type(peer)):
        run_decode(_ar_plan(checkpoint, tmp_path / "run"), on_record=gone)


def test_an_os_error_without_out_goes_on_as_itself(checkpoint):
    """Without --out nothing was written: an OSError is not turned into "those that reached the disk
    before it are in None"."""
    def full(record):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as info:
        run_decode(_ar_plan(checkpoint, None), on_record=full)
    assert not isinstance(info.value, SpecFitError) and "None" not in str(info.value)


def test_the_cli_lets_a_peers_error_through_not_as_an_error_line(monkeypatch, tmp_path):
    """The CLI turns a file's OSError into one 'error:' line, but a peer's (a reset connection, a
    timeout) goes on as itself."""
    from cli_helpers import invoke
    import specfit.report.build as build

    for exc in (ConnectionResetError(errno.ECONNRESET, "reset"), TimeoutError("timed out")):
        def raise_it(*args, **kwargs):
            raise exc
        monkeypatch.setattr(build, "build_report", raise_it)
        result = invoke("report", tmp_path, "--out", tmp_path / "r")
        assert isinstance(result.exception, type(exc)) and "error:" not in result.output, result.output


def test_a_run_stopped_by_bad_input_mid_run_notes_the_error_not_an_interrupt(checkpoint, tmp_path):
    """NaN drafter weights stop the run at specfit's first draft, after ar has decoded every prompt:
    run.json's note says it stopped on that error (no Ctrl-C), with the cycles and runs it kept."""
    model_dir, drafter_dir, prompts = checkpoint
    bad = _corrupt(drafter_dir, tmp_path, lambda t, c: t.update({"fc.weight": torch.full_like(t["fc.weight"], float("nan"))}))
    out = tmp_path / "run"
    plan = DecodePlan(model_dir=model_dir, prompts_path=prompts, cache_experts=3, policies=["ar", "specfit"],
                      drafter_dir=bad, profile="pcie4", max_new_tokens=NEW_TOKENS, device="cpu", out_dir=out,
                      ignore_eos=True, warmup=False)
    with pytest.raises(SpecFitError, match="NaN probabilities") as info:
        run_decode(plan)
    error = str(info.value).split(" (before it: kept ")[0]
    assert error.startswith(f"drafter {bad}: NaN probabilities")
    kept = len(PROMPTS) * (NEW_TOKENS - 1)
    said = (f"the run stopped before its end ({error}): it holds the {kept} cycle(s) completed before it; "
            f"{len(PROMPTS)} of its {2 * len(PROMPTS)} (policy, prompt) runs finished")
    notes = json.loads((out / "run.json").read_text())["notes"]
    assert notes == [said] and "interrupted" not in notes[0]


@pytest.mark.parametrize("failure, where", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.11 GiB total capacity)"),
     "device"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to "
                  "allocate 4294967296 bytes."), "host"),
    (MemoryError(), "host")])
def test_out_of_memory_mid_run_is_one_error_saying_what_was_kept(checkpoint, tmp_path, monkeypatch, failure, where):
    """An allocation that failed mid-run (a cache too big for the device) ended in torch's traceback;
    it is one line saying which memory ran out, what needs less, and the complete cycles kept."""
    from specfit.cli import app
    from specfit.runtime.decoder import Decoder
    from typer.testing import CliRunner

    model_dir, drafter_dir, prompts = checkpoint
    out = tmp_path / "run"
    verify, cycles = Decoder.verify, []

    def runs_out(self, *args, **kwargs):
        if len(cycles) == 8:             # some cycles in (a warm-up decode runs first)
            raise failure
        cycles.append(1)
        return verify(self, *args, **kwargs)

    monkeypatch.setattr(Decoder, "verify", runs_out)
    result = CliRunner().invoke(app, ["decode", "--model", str(model_dir), "--prompts", str(prompts), "--cache-experts",
                                      "3", "--policies", "ar", "--profile", "pcie4", "--max-new-tokens",
                                      str(NEW_TOKENS), "--ignore-eos", "--out", str(out)])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and "Traceback" not in result.output, result.output
    assert lines[0].startswith(f"error: out of {where} memory") and "--cache-experts" in lines[0]
    kept = len(read_decode_cycles(out))
    assert kept > 0 and lines[0].endswith(f"(after {kept} complete cycle(s); they are in {out})")


def test_sequoia_decodes_live_with_rates_from_its_acceptance_trace_and_replays_as_it_ran(checkpoint, tmp_path):
    """``decode --policy sequoia:N`` fits Sequoia's positional acceptance rates on the
    ``--acceptance`` trace, drafts the levels its tree reaches, decodes as AR does, and a replay
    of the run's full recording with the same rates makes the same choices cycle for cycle."""
    from specfit.policies import SequoiaPolicy
    from specfit.sequoia import shape_depth, trace_rates

    first = tmp_path / "first.parquet"
    assert decode(checkpoint, "--policy", "ar", "--record", str(first), "--record-full", "--max-levels", "3",
                  "--profile", "pcie4").exit_code == 0
    refused = decode(checkpoint, "--policies", "ar,sequoia:6", "--profile", "pcie4")
    assert refused.exit_code == 2
    assert "--policies sequoia:6: fixes its tree from positional acceptance rates" in refused.stderr
    assert "pass --acceptance TRACE" in refused.stderr

    rates = trace_rates(read_trace(first))
    depth = shape_depth(rates, 6, 3)
    trace_path, out = tmp_path / "full.parquet", tmp_path / "run"
    result = decode(checkpoint, "--policies", "ar,sequoia:6", "--acceptance", str(first), "--max-levels", "3",
                    "--profile", "pcie4", "--frozen-profile", "--record", str(trace_path), "--record-full",
                    "--out", str(out))
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "greedy outputs identical across policies: yes" in text
    shown = ", ".join(f"{r:.3f}" for r in rates)
    assert f"sequoia:6: positional acceptance rates {shown}" in text and f"a tree of 6 nodes, {depth} levels" in text
    live = pd.read_parquet(out / "cycles.parquet")
    ran = live[live["policy"] == "sequoia:6"].reset_index(drop=True)
    assert (ran["draft_levels"] == depth).mean() > 0.5 and ran["draft_levels"].max() == depth
    assert ran["nodes_verified"].max() == 6 and ran["committed_tokens"].mean() > 1.2
    trace = read_trace(trace_path)
    prep = prepare("full", trace, trace.true_experts)
    for compiled in (True, False):
        cache = ExpertCache(trace.n_layers, trace.n_experts, 3, expert_bytes=trace.expert_bytes)
        log = replay(prep, SequoiaPolicy(6, 3, rates=rates), cache, CostModel(2e-3, 5e-5, 2e-5, 2e-4, 3e-4),
                     compiled=compiled)
        for column in ("position", "draft_levels", "nodes_verified", "committed_tokens", "hits", "misses"):
            np.testing.assert_array_equal(log.columns[column], ran[column].to_numpy(),
                                          err_msg=f"{column} compiled={compiled}")


def test_a_policy_recording_with_calibrated_acceptance_keeps_the_drafters_path_probabilities(checkpoint, tmp_path):
    """The trace schema's ``path_prob`` is the drafter's probability of the path: a run that decides
    with probabilities calibrated on ``--acceptance`` records the drafter's, not the calibrated ones
    (which, clipped to their parents, tie siblings the drafter ranks apart)."""
    first, second = tmp_path / "first.parquet", tmp_path / "second.parquet"
    assert decode(checkpoint, "--policy", "ar", "--record", str(first), "--record-full", "--max-levels", "3",
                  "--profile", "pcie4").exit_code == 0
    result = decode(checkpoint, "--policy", "eagle3:12:3", "--acceptance", str(first), "--record", str(second),
                    "--profile", "pcie4")
    assert result.exit_code == 0, result.output
    trace = read_trace(second)
    parents = trace.parent_rows
    cum = np.zeros(trace.n_nodes)
    for d in range(1, int(trace.depth.max()) + 1):
        at = np.flatnonzero(trace.depth == d)
        cum[at] = cum[parents[at]] + trace.draft_logprob[at].astype(np.float64)
    assert trace.depth.max() == 3
    np.testing.assert_allclose(trace.path_prob, np.exp(cum), rtol=1e-6)    # draft_logprob is float32
