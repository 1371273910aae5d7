"""``specfit plan``: the memory model against the runtime's own tensors, and on a shipped trace a
recommendation that is the best cell of the exhaustive grid the plan ran (and that ``simulate``
reproduces)."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pandas as pd
import pytest
import torch
from trace_helpers import SAMPLE_OLMOE
from typer.testing import CliRunner

from specfit.calibrate.standin import SHAPE_CONFIGS, shape_config
from specfit.cli import app
from specfit.errors import SpecFitError
from specfit.runtime.footprint import PeakBytes
from specfit.runtime.model import MoETransformer
from specfit.runtime.offload import ExpertOffload, HostExperts
from specfit.simulate.dataset import read_results
from specfit.simulate.plan import (
    DEFAULT_CANDIDATES,
    MemoryBudget,
    MemoryModel,
    rank_settings,
    tree_tokens,
)
from specfit.traces.format import read_trace

TINY_PROFILE = SAMPLE_OLMOE.parent.parent / "calibrate" / "examples" / "vm-x86-64-tiny-moe.json"   # a tiny-moe profile
TINY_CONFIG = SAMPLE_OLMOE.parent.parent / "specfit" / "assets" / "tiny-moe" / "config.json"

GB = 1e9


def _meta_model_params(config) -> int:
    """Every parameter the runtime's model holds on the device (its experts live in the offload)."""
    with torch.device("meta"):
        model = MoETransformer(config)
    return sum(p.numel() for p in model.parameters())


def _kv_bytes(config, tokens: int, dtype=torch.bfloat16) -> int:
    """The bytes of the KV caches the runtime allocates for ``tokens`` slots in every layer."""
    with torch.device("meta"):
        model = MoETransformer(config)
    caches = [layer.self_attn.make_kv_cache(tokens, dtype, "meta") for layer in model.layers]
    return sum(t.nbytes for cache in caches for t in cache.buffers())


@pytest.mark.parametrize("name", sorted(SHAPE_CONFIGS))
def test_dense_weights_and_kv_cache_are_the_runtimes(name):
    config = shape_config(name)
    memory = MemoryModel(name, config, MemoryBudget(80 * GB, context_tokens=1000, reserve_bytes=0))
    with torch.device("meta"):
        tensors = MoETransformer(config).state_dict()
    # bfloat16, but DeepSeek's routers, which the loader keeps in float32
    assert memory.dense_bytes == sum(t.numel() * (4 if config.router_float32 and key.endswith("moe.gate.weight") else 2)
                                     for key, t in tensors.items())
    assert memory.dense_bytes > 2 * _meta_model_params(config) or not config.router_float32
    assert memory.kv_bytes(24) == _kv_bytes(config, 1024)
    assert memory.expert_bytes == 3 * config.hidden_size * config.expert_intermediate_size * 2


def test_qwen3_30b_a3b_dense_weights_are_about_3_gb():
    # 30.5 B parameters of which 48 x 128 experts x 4.72 M are routed experts (REFERENCE.md)
    memory = MemoryModel("qwen3-30b-a3b", shape_config("qwen3-30b-a3b"), MemoryBudget(24 * GB))
    total = memory.dense_bytes / 2 + 48 * 128 * 3 * 2048 * 768
    assert 30.0e9 < total < 31.0e9
    assert memory.slot_bytes == 48 * 9_437_184


def test_expert_slots_and_staging_are_the_offloads():
    config = shape_config("tiny")
    host = HostExperts(config.n_layers, config.n_experts, config.hidden_size, config.expert_intermediate_size,
                       torch.float32)
    memory = MemoryModel("tiny", config, MemoryBudget(1 * GB, dtype="float32"))
    for capacity in (0, 3, config.n_experts):
        offload = ExpertOffload(host, capacity, device=torch.device("cpu"))
        assert capacity * memory.slot_bytes + memory.staging_bytes(capacity) == offload.device_bytes


def test_a_model_with_dense_layers_caches_and_traces_over_its_moe_layers_only():
    from types import SimpleNamespace

    from specfit.calibrate.profile import ModelShape
    from specfit.simulate.plan import _check_trace_matches

    config = shape_config("deepseek-v2-lite")        # 27 layers, the first dense: 26 hold experts
    assert (config.n_layers, config.n_moe_layers) == (27, 26)
    memory = MemoryModel("deepseek-v2-lite", config, MemoryBudget(80 * GB))
    assert memory.slot_bytes == 26 * memory.expert_bytes
    shape = ModelShape.from_config(config, torch.bfloat16, "deepseek-v2-lite")     # what a synthesised trace holds
    trace = SimpleNamespace(model={"n_layers": shape.n_layers, "n_experts": shape.n_experts, "top_k": shape.top_k,
                                   "expert_bytes": shape.expert_bytes})
    _check_trace_matches(trace, config, 2, "trace.parquet")
    with pytest.raises(SpecFitError, match="differs from --model-shape"):
        _check_trace_matches(SimpleNamespace(model={**trace.model, "n_layers": 27}), config, 2, "trace.parquet")


def test_largest_cache_that_fits_by_brute_force():
    config = shape_config("olmoe-1b-7b")
    dense, E = 2 * _meta_model_params(config), config.n_experts
    expert = 3 * config.hidden_size * config.expert_intermediate_size * 2
    for budget_gb in (2.5, 3.3, 4.0, 9.0, 40.0):
        memory = MemoryModel("olmoe", config, MemoryBudget(budget_gb * GB, context_tokens=4096, reserve_bytes=0.5 * GB,
                                                           prompt_tokens=256))
        # the drafter and the passes' workspace: test_plans_estimate_holds_what_a_decode_allocates
        drafting = memory.drafter_bytes(58) + memory.workspace_bytes(58)
        fits = [c for c in range(E + 1) if dense + _kv_bytes(config, 4096 + 58) + c * config.n_layers * expert
                + (2 * expert if c < E else 0) + drafting + 0.5 * GB <= budget_gb * GB]
        assert memory.max_cache_experts_for(58) == max(fits)
    # 2.3 GB holds the dense weights, the KV cache and the drafter but not the staging buffers,
    # the workspace and the reserve
    memory = MemoryModel("olmoe", config, MemoryBudget(2.3 * GB, context_tokens=4096, reserve_bytes=0.5 * GB,
                                                       prompt_tokens=256))
    with pytest.raises(SpecFitError, match="--device-memory-gb 2.3: olmoe needs 2.41 GB with no cached expert"):
        memory.max_cache_experts_for(58)


def test_settings_over_several_traces_are_ranked_by_total_tokens_over_total_time():
    memory = MemoryModel("olmoe", shape_config("olmoe-1b-7b"), MemoryBudget(8 * GB))
    rows = pd.DataFrame({"policy": ["ar", "ar", "chain:1", "chain:1", "ar", "chain:1"],
                         "cache_experts": [0, 0, 0, 0, 8, 8], "trace": ["a", "b", "a", "b", "a", "a"],
                         "tokens": [10, 30, 10, 30, 10, 10], "time_s": [1.0, 1.0, 0.5, 3.0, 0.5, 0.5]})
    ranked = rank_settings(rows, memory, np.array([1, 4, 10]), ["ar", "chain:1"])
    by = ranked.set_index(["policy", "cache_experts"])["tokens_per_s"]
    assert by[("ar", 0)] == 20.0 and by[("chain:1", 0)] == 40 / 3.5 and by[("ar", 8)] == 20.0
    # ar at 0 and ar at 8 tie: the one with less device memory ranks first
    assert list(zip(ranked["policy"], ranked["cache_experts"]))[:2] == [("ar", 0), ("ar", 8)]
    assert ranked.loc[1, "device_bytes"] - ranked.loc[0, "device_bytes"] == 8 * memory.slot_bytes


def test_plan_errors_are_one_line_before_ray_starts_or_anything_is_written(tmp_path):
    runner = CliRunner()
    bad_profile = tmp_path / "no_cost.json"
    bad_profile.write_text("{}")
    trace = ["--trace", str(SAMPLE_OLMOE)]
    shape = ["--model-shape", "olmoe-1b-7b"]
    for args, message in [
        (trace + ["--device-memory-gb", "1"], "--device-memory-gb 1: olmoe-1b-7b needs"),
        (trace + ["--device-memory-gb", "8", "--policies", "ar,static:auto"], "simulator baselines"),
        (trace + ["--device-memory-gb", "8", "--policies", "ar,oracle"], "['oracle'] run only in a replay"),
        (trace + ["--device-memory-gb", "24", "--model-shape", "qwen3-30b-a3b"], "differs from --model-shape"),
        (trace + ["--device-memory-gb", "8", "--prompt-tokens", "4097"], "--prompt-tokens: expected 1..4096"),
        (trace + ["--device-memory-gb", "8", "--prefill-chunk", "-1"],
         "--prefill-chunk: expected a number of tokens >= 0"),
        (trace + ["--device-memory-gb", "8", "--dtype", "float8"], "--dtype"),
        (trace + ["--device-memory-gb", "inf"], "--device-memory-gb: expected a positive, finite size, got inf"),
        (trace + ["--device-memory-gb", "8", "--context-tokens", "0"], "--context-tokens: expected >= 1, got 0"),
        (trace + ["--device-memory-gb", "8", "--reserve-gb", "-1"], "--reserve-gb: expected >= 0, got -1"),
        (trace + ["--device-memory-gb", "8", "--cache-steps", "0"], "--cache-steps: expected >= 1, got 0"),
        (trace + ["--device-memory-gb", "8", "--top", "-1"], "--top: expected a number of runners-up >= 0, got -1"),
        (trace + ["--device-memory-gb", "8", "--profile", str(bad_profile)], str(bad_profile)),
        (shape + ["--device-memory-gb", "24", "--tokens", "0"], "--tokens: expected >= 1"),
        # the synthesised traces move bfloat16 experts: float32 would size one expert and move another
        (shape + ["--device-memory-gb", "80", "--dtype", "float32"], "--dtype float32: experts of 25165824 bytes"),
        (trace + ["--device-memory-gb", "8", "--predictor", "router"], "--predictor: router needs the target's"),
        (shape + ["--device-memory-gb", "24", "--workload", "poetry"], "--workload"),
        (shape + ["--device-memory-gb", "24", "--h2d-scale", "-1"], "--h2d-scale: expected values finite and > 0, got -1"),
        # a profile of another shape is refused before any trace is synthesised
        (shape + ["--device-memory-gb", "24", "--profile", str(TINY_PROFILE)], "not for olmoe-1b-7b"),
        (["--model-shape", str(TINY_CONFIG), "--device-memory-gb", "24"],
         f"--model-shape {TINY_CONFIG}: traces can be synthesised only for the shapes"),
    ]:
        out = tmp_path / "plan"
        r = runner.invoke(app, ["plan", *args, "--out", str(out), "--num-cpus", "1"])
        assert r.exit_code == 2, (args, r.output)
        assert r.output.startswith("error: ") and message in r.output and len(r.output.strip().splitlines()) == 1, \
            (args, r.output)
        assert not out.exists(), args


# a trace, workload or policy given twice is refused naming its option, before Ray starts or a
# trace is synthesised (not as a spec's field after both)
@pytest.mark.parametrize("args, message", [
    (["--trace", str(SAMPLE_OLMOE), "--trace", str(SAMPLE_OLMOE.parent / ".." / SAMPLE_OLMOE.parent.name
                                                  / SAMPLE_OLMOE.name)], f"--trace: lists {SAMPLE_OLMOE} and "),
    (["--model-shape", "olmoe-1b-7b", "--workload", "chat,code,chat"], "--workload: lists chat twice"),
    (["--trace", str(SAMPLE_OLMOE), "--policies", "ar,chain:2,chain:2"], "--policies: lists chain:2 twice"),
])
def test_a_plan_input_given_twice_is_one_line_naming_its_option_before_ray_starts(tmp_path, monkeypatch, args, message):
    import specfit.simulate.distributed as distributed

    def ray_session(*args, **kwargs):
        raise AssertionError("Ray started")
    monkeypatch.setattr(distributed, "ray_session", ray_session)
    out = tmp_path / "plan"
    r = CliRunner().invoke(app, ["plan", *args, "--device-memory-gb", "24", "--tokens", "16", "--out", str(out)])
    assert r.exit_code == 2 and r.output.startswith(f"error: {message}"), r.output
    assert len(r.output.strip().splitlines()) == 1 and not out.exists()


# a budget that holds AR's one-token tree but not a candidate's largest tree plans with the
# candidates that fit, naming those left out, instead of failing after Ray started
def test_a_candidate_whose_tree_does_not_fit_the_budget_is_left_out_with_a_note(tmp_path, monkeypatch, capsys):
    import specfit.simulate.distributed as distributed
    from specfit.simulate.plan import run_plan

    class Ran(Exception):
        pass

    def execute(spec, out_dir, **kwargs):
        raise Ran(spec.axes["policies"], kwargs["extra"]["plan"]["candidates"])

    @contextlib.contextmanager
    def no_ray(*args):
        yield None
    monkeypatch.setattr(distributed, "execute", execute)
    monkeypatch.setattr(distributed, "ray_session", no_ray)
    probe = MemoryModel("olmoe-1b-7b", shape_config("olmoe-1b-7b"), MemoryBudget(80 * GB))
    budget = MemoryBudget(probe.device_bytes(0, 3))           # chain:2's tree of 3 tokens, not specfit's
    with pytest.raises(Ran) as ran:
        run_plan(budget, None, [SAMPLE_OLMOE], [], 0, "pcie4", policies="ar,chain:2,specfit", out_dir=tmp_path / "p",
                 show_progress=False)
    assert ran.value.args == (["ar", "chain:2"], ["ar", "chain:2"])
    note = capsys.readouterr().err
    assert "left out specfit (" in note and "chain:2" not in note, note


# ------------------------------------------------------------------ on Ray
def _tree_tokens(policy: str, trace) -> int:
    """Nodes a policy verifies at most on ``trace`` (root included), from the policy's definition."""
    name, _, rest = policy.partition(":")
    args = [int(a) for a in rest.split(":")] if rest else []
    deepest = int(trace.depth.max())

    def within(levels):              # the largest recorded tree cut at ``levels`` draft levels
        return max(int((trace.depth[trace.offsets[c]:trace.offsets[c + 1]] <= levels).sum()) for c in range(trace.n_cycles))

    if name == "ar":
        return 1
    if name == "chain":
        return min(args[0], deepest) + 1
    if name == "static":             # the plan drafts up to 8 levels
        return min(args[0], within(8))
    if name == "eagle3":             # eagle3:N:D drafts D levels
        return min(args[0], within(args[1]))
    return within(args[0])


def test_plan_recommends_the_best_cell_of_its_exhaustive_grid(ray_local, tmp_path, monkeypatch):
    budget_gb, reserve_gb = 4.0, 1.0
    r = CliRunner().invoke(app, ["plan", "--trace", str(SAMPLE_OLMOE), "--device-memory-gb", str(budget_gb),
                                 "--prompt-tokens", "256", "--profile", "pcie5", "--out", str(tmp_path / "plan"), "--json"])
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    trace = read_trace(SAMPLE_OLMOE)
    config = shape_config("olmoe-1b-7b")
    dense = 2 * _meta_model_params(config)
    expert = 3 * config.hidden_size * config.expert_intermediate_size * 2
    E, L = config.n_experts, config.n_layers
    # the drafter and the passes' workspace: test_plans_estimate_holds_what_a_decode_allocates
    memory = MemoryModel("olmoe-1b-7b", config, MemoryBudget(budget_gb * GB, prompt_tokens=256))

    def drafting(tree):
        return memory.drafter_bytes(tree) + memory.workspace_bytes(tree)

    def device_bytes(policy, cache):
        tree = _tree_tokens(policy, trace)
        return (dense + _kv_bytes(config, 4096 + tree) + cache * L * expert
                + (2 * expert if cache < E else 0) + drafting(tree) + reserve_gb * GB)

    # the cache sizes: none up to the most that fits next to the largest candidate tree, 4 steps
    largest = max(_tree_tokens(p, trace) for p in DEFAULT_CANDIDATES)
    most = max(c for c in range(E + 1) if dense + _kv_bytes(config, 4096 + largest) + c * L * expert
               + (2 * expert if c < E else 0) + drafting(largest) + reserve_gb * GB <= budget_gb * GB)
    sizes = sorted({round(most * i / 4) for i in range(5)})
    assert plan["cache_sizes"] == sizes and most > 0
    # the grid is exhaustive: every candidate policy at every size, once
    results = read_results(tmp_path / "plan")
    assert sorted(zip(results["policy"], results["cache_experts"])) == sorted(
        (p, c) for p in DEFAULT_CANDIDATES for c in sizes)
    assert plan["cells"] == len(results) == len(DEFAULT_CANDIDATES) * len(sizes)
    # the best cell, by the test's own ranking: fastest, then least device memory
    mem = {(p, c): device_bytes(p, c) for p, c in zip(results["policy"], results["cache_experts"])}
    assert all(m <= budget_gb * GB for m in mem.values())
    fastest = results["tokens_per_s"].max()
    tied = results[results["tokens_per_s"] == fastest]
    expected = min(zip(tied["policy"], tied["cache_experts"]), key=lambda pc: mem[pc])
    best = plan["best"]
    assert (best["policy"], best["cache_experts"]) == expected
    assert best["tokens_per_s"] == fastest and best["device_bytes"] == mem[expected]
    ranked = [plan["best"], *plan["runners_up"]]
    assert all(a["tokens_per_s"] >= b["tokens_per_s"] for a, b in zip(ranked, ranked[1:]))
    # the recommendation holds when the setting is replayed on its own
    r = CliRunner().invoke(app, ["simulate", "--trace", str(SAMPLE_OLMOE), "--profile", "pcie5", "--policies",
                                 best["policy"], "--cache-experts", str(best["cache_experts"]), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)[0]["tokens_per_s"] == pytest.approx(best["tokens_per_s"], rel=1e-9)
    # the report shows the plan (its frontier) and the sweep behind it
    r = CliRunner().invoke(app, ["report", str(tmp_path / "plan"), "--out", str(tmp_path / "report")])
    assert r.exit_code == 0, r.output
    page = (tmp_path / "report" / "index.html").read_text()
    assert f"Recommended: {best['policy']} with {best['cache_experts']} cached experts per layer" in page
    assert "the line is the best reachable within each memory size" in page and "Sweep: " in page
    # a rerun for another budget that stopped before ranking: the plan.json beside its sweep is an
    # earlier plan's, which the report leaves out (and a rerun removes when it starts)
    sweep_file = tmp_path / "plan" / "sweep.json"
    sweep = json.loads(sweep_file.read_text())
    sweep["spec"]["plan"]["device_bytes"] = 2 * budget_gb * GB
    sweep_file.write_text(json.dumps(sweep))
    r = CliRunner().invoke(app, ["report", str(tmp_path / "plan"), "--out", str(tmp_path / "report2")])
    assert r.exit_code == 0, r.output
    page = (tmp_path / "report2" / "index.html").read_text()
    assert "Recommended: " not in page and "written by an earlier plan (device_bytes" in page and "Sweep: " in page
    r = CliRunner().invoke(app, ["plan", "--trace", str(SAMPLE_OLMOE), "--device-memory-gb", "0.5",
                                 "--profile", "pcie5", "--out", str(tmp_path / "plan")])
    assert r.exit_code == 2 and (tmp_path / "plan" / "plan.json").is_file()     # refused before it starts: kept
    import specfit.simulate.distributed as distributed

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(distributed, "execute", stopped)
    r = CliRunner().invoke(app, ["plan", "--trace", str(SAMPLE_OLMOE), "--device-memory-gb", "8",
                                 "--profile", "pcie5", "--out", str(tmp_path / "plan")])
    assert r.exit_code == 130 and not (tmp_path / "plan" / "plan.json").exists(), r.output


def test_plan_notes_candidates_deeper_than_the_traces_trees_as_simulate_does(ray_local, tmp_path):
    # the sample's trees are 7 levels deep: chain:9 and eagle3:60:8 are replayed on 7 levels, with
    # fewer nodes and less draft time than a live run of them; static:4 (3 levels) is not
    policies = "ar,chain:9,eagle3:60:8,static:4"
    r = CliRunner().invoke(app, ["plan", "--trace", str(SAMPLE_OLMOE), "--device-memory-gb", "4", "--profile", "pcie5",
                                 "--prompt-tokens", "256", "--policies", policies, "--cache-steps", "1", "--out", str(tmp_path / "plan"), "--json"])
    assert r.exit_code == 0, r.output
    said = " ".join(r.stderr.split())
    assert f"note: chain:9, eagle3:60:8 draft more levels than {SAMPLE_OLMOE}'s deepest tree (7)" in said, said
    plan = json.loads(r.stdout)
    setting = {s["policy"]: s for s in plan["settings"] if s["cache_experts"] == 0}
    assert setting["chain:9"]["tree_tokens"] == 8 and setting["eagle3:60:8"]["tree_tokens"] == 58
    # plan.json keeps the note and marks the settings it names, whichever it recommends
    assert [" ".join(n.split()) for n in plan["notes"]] == [said[said.index("note: chain:9"):]]
    assert {p: s["deeper_than_traces"] for p, s in setting.items()} == {"ar": False, "chain:9": True,
                                                                        "eagle3:60:8": True, "static:4": False}
    table = CliRunner().invoke(app, ["plan", "--trace", str(SAMPLE_OLMOE), "--device-memory-gb", "4", "--profile",
                                     "pcie5", "--prompt-tokens", "256", "--policies", policies, "--cache-steps", "1", "--out",
                                     str(tmp_path / "plan"), "--top", "8"])
    assert table.exit_code == 0, table.output
    assert "chain:9 *" in table.stdout and "static:4 *" not in table.stdout, table.stdout
    assert "* drafts more levels than the traces' trees hold" in " ".join(table.stdout.split())
    # the same note, and the same figures, from simulate
    r = CliRunner().invoke(app, ["simulate", "--trace", str(SAMPLE_OLMOE), "--profile", "pcie5", "--policies", policies,
                                 "--cache-experts", "0", "--json"])
    assert r.exit_code == 0, r.output
    assert "note: chain:9, eagle3:60:8 draft more levels" in " ".join(r.stderr.split())
    for row in json.loads(r.stdout):
        assert row["tokens_per_s"] == pytest.approx(setting[row["policy"]]["tokens_per_s"], rel=1e-9)


def test_plan_for_a_model_shape_synthesises_each_workload_once(ray_local, tmp_path):
    args = ["plan", "--model-shape", "olmoe-1b-7b", "--workload", "chat,code", "--tokens", "24", "--device-memory-gb",
            "3.5", "--prompt-tokens", "256", "--policies", "ar,specfit:4", "--cache-steps", "1", "--out",
            str(tmp_path / "plan"), "--json"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    traces = sorted((tmp_path / "plan" / "traces").glob("*.parquet"))
    assert [t.name for t in traces] == ["olmoe-1b-7b-chat-24.parquet", "olmoe-1b-7b-code-24.parquet"]
    results = read_results(tmp_path / "plan")
    assert len(results) == 2 * 2 * 2                 # workloads x policies x (none, most that fits)
    for setting in [plan["best"], *plan["runners_up"]]:
        rows = results[(results["policy"] == setting["policy"]) & (results["cache_experts"] == setting["cache_experts"])]
        assert len(rows) == 2
        assert setting["tokens_per_s"] == pytest.approx(rows["tokens"].sum() / rows["time_s"].sum(), rel=1e-12)
    stamps = [t.stat().st_mtime_ns for t in traces]
    r = CliRunner().invoke(app, args)                 # a rerun reuses the traces and every cell
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["best"] == plan["best"]
    assert [t.stat().st_mtime_ns for t in traces] == stamps


class _InProcessRay:
    """Runs the Ray tasks in the test's process."""

    def remote(self, task):
        return type("Remote", (), {"remote": staticmethod(lambda *args: _Ref(task(*args)))})()

    def get(self, ref):
        return ref.value


class _Ref:
    def __init__(self, value):
        self.value = value


# a kept trace is reused only while it is what its preset makes now: after a preset's figures
# change (they are the code's), a rerun ranks on a trace synthesised again, and says so
def test_a_kept_trace_is_synthesised_again_when_its_workload_preset_changed(tmp_path, monkeypatch, capsys):
    from dataclasses import replace

    from specfit.simulate.plan import _synthesised_traces
    from specfit.traces.synth import WORKLOADS

    folder = tmp_path / "traces"
    paths, _ = _synthesised_traces(_InProcessRay(), "olmoe-1b-7b", ["chat", "code"], 8, folder)
    stamps = [p.stat().st_mtime_ns for p in paths]
    _synthesised_traces(_InProcessRay(), "olmoe-1b-7b", ["chat", "code"], 8, folder)
    assert [p.stat().st_mtime_ns for p in paths] == stamps and capsys.readouterr().err == ""
    monkeypatch.setitem(WORKLOADS, "code", replace(WORKLOADS["code"], top1_prob=0.8))
    _, [chat, code] = _synthesised_traces(_InProcessRay(), "olmoe-1b-7b", ["chat", "code"], 8, folder)
    assert paths[0].stat().st_mtime_ns == stamps[0] and paths[1].stat().st_mtime_ns != stamps[1]
    assert code.meta["drafter"]["top1_prob"] == 0.8 and read_trace(paths[1]).meta["drafter"]["top1_prob"] == 0.8
    err = capsys.readouterr().err
    assert err == (f"plan: {paths[1]} was synthesised with other settings than the 'code' preset's now; "
                   "synthesising it again\n")


def test_a_plan_stopped_while_it_synthesises_its_traces_says_nothing_was_kept(ray_local, tmp_path, monkeypatch):
    import specfit.simulate.plan as plan_module

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(plan_module, "_synthesised_traces", stopped)
    r = CliRunner().invoke(app, ["plan", "--model-shape", "olmoe-1b-7b", "--workload", "chat", "--tokens", "24",
                                 "--device-memory-gb", "24", "--out", str(tmp_path / "plan")])
    assert r.exit_code == 130, r.output
    assert "interrupted before the sweep's first cell: nothing was kept" in r.output and "resumes" not in r.output


# without --out, a plan stopped says what its default directory holds: nothing before the
# sweep recorded its grid, every finished cell after
@pytest.mark.parametrize("stop_in", ["synthesis", "sweep"])
def test_a_plan_stopped_without_out_says_what_its_default_directory_kept(tmp_path, monkeypatch, stop_in):
    import specfit.simulate.distributed as distributed
    import specfit.simulate.plan as plan_module

    def stopped(*args, **kwargs):
        if stop_in == "sweep":                # the grid recorded, no cell finished yet
            (args[1] / "sweep.json").parent.mkdir(parents=True)
            (args[1] / "sweep.json").write_text("{}")
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def no_ray(*args):
        yield None
    monkeypatch.setattr(distributed, "ray_session", no_ray)
    monkeypatch.setattr(plan_module, "_synthesised_traces", stopped)
    monkeypatch.setattr(distributed, "execute", stopped)
    monkeypatch.chdir(tmp_path)
    source = (["--model-shape", "olmoe-1b-7b", "--tokens", "16"] if stop_in == "synthesis"
              else ["--trace", str(SAMPLE_OLMOE)])
    r = CliRunner().invoke(app, ["plan", *source, "--device-memory-gb", "24"])
    assert r.exit_code == 130, r.output
    if stop_in == "synthesis":
        assert "interrupted before the sweep's first cell: nothing was kept" in r.output, r.output
    else:
        assert "the dataset in runs/plan-olmoe-1b-7b-24gb keeps every cell finished before it" in r.output, r.output


def test_plan_counts_the_root_in_a_chain_tree():
    from specfit.simulate.plan import tree_tokens

    by_levels = np.array([1, 3, 7, 12, 20, 30])          # largest trees within 0..5 levels
    assert tree_tokens("ar", by_levels) == 1
    assert tree_tokens("chain:4", by_levels) == 5        # the root and 4 drafted tokens
    assert tree_tokens("chain:9", by_levels) == 6        # at most as deep as the traces
    assert tree_tokens("chain:4+cache+prefetch", by_levels) == 5     # levers change no tree (a traceback, before)
    assert tree_tokens("specfit:2+online", by_levels) == 7


def test_a_specfit_level_cap_takes_the_largest_tree_within_that_many_levels():
    by_levels = np.array([1, 3, 7, 12, 20, 30])          # largest trees within 0..5 levels
    assert tree_tokens("specfit:2", by_levels) == 7
    assert tree_tokens("specfit:4", by_levels) == 20
    assert tree_tokens("specfit:9", by_levels) == 30     # capped at the traces' depth
    assert tree_tokens("specfit", by_levels) == 30       # no cap: the deepest


def test_a_fixed_tree_is_sized_within_the_levels_it_drafts():
    by_levels = np.array([1, 3, 7, 12, 20, 30])          # largest trees within 0..5 levels
    assert tree_tokens("eagle3:16:1", by_levels) == 3    # one level holds 3 nodes, not 16
    assert tree_tokens("eagle3:16:2", by_levels) == 7
    assert tree_tokens("eagle3:8:3", by_levels) == 8
    assert tree_tokens("eagle3", by_levels) == 30        # 60 nodes of 8 levels, on traces of 5
    assert tree_tokens("static:2", by_levels) == 2       # one level: the root and its best child
    assert tree_tokens("static:60", by_levels) == 30


def test_a_budget_that_exactly_holds_every_expert_caches_every_expert():
    config = shape_config("olmoe-1b-7b")
    E = config.n_experts
    probe = MemoryModel("olmoe", config, MemoryBudget(80e9, context_tokens=4096, reserve_bytes=0.5e9))
    exact = probe.device_bytes(E, 58)
    memory = MemoryModel("olmoe", config, MemoryBudget(exact, context_tokens=4096, reserve_bytes=0.5e9))
    assert memory.max_cache_experts_for(58) == E
    # a byte less and the full cache no longer fits (the staging buffers return below E)
    less = MemoryModel("olmoe", config, MemoryBudget(exact - 1, context_tokens=4096, reserve_bytes=0.5e9))
    assert less.max_cache_experts_for(58) < E


def test_the_largest_tree_within_d_levels_counts_every_node_at_depth_d():
    from trace_helpers import hand_trace

    from specfit.simulate.plan import _max_nodes_by_levels

    # hand_trace: cycle 0 has depths 0, 1, 1, 2; cycles 1 and 2 have depths 0, 1
    assert _max_nodes_by_levels([hand_trace()]).tolist() == [1, 3, 4]


def _plan_result(memory, policies=("ar", "specfit:4", "specfit:8")):
    from pathlib import Path

    from specfit.simulate.plan import PlanResult

    rows = pd.DataFrame({"policy": list(policies) * 2, "cache_experts": [0] * len(policies) + [16] * len(policies),
                         "trace": "chat", "tokens": 100, "time_s": np.linspace(1.0, 2.0, 2 * len(policies))})
    ranked = rank_settings(rows, memory, np.array([1, 6, 20, 40, 58]), list(policies))
    ranked["deeper_than_traces"] = False
    return PlanResult(memory, ["chat"], "pcie5", ranked, Path("runs/plan"), cache_sizes=[0, 16], cells=len(rows))


def test_a_narrow_terminal_keeps_plans_policy_names_and_figures_whole(monkeypatch, capsys):
    from rich.console import Console

    import specfit.console
    from specfit.simulate.sweep_commands import _print_plan

    result = _plan_result(MemoryModel("olmoe-1b-7b", shape_config("olmoe-1b-7b"), MemoryBudget(8 * GB)))
    monkeypatch.setattr(specfit.console, "table_console", lambda: Console(width=50))
    _print_plan(result, top=5)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("│")]
    assert len(rows) == len(result.ranked)
    for setting, row in zip(result.ranked.itertuples(), rows):
        cells = [cell.strip() for cell in row.strip("│").split("│")]
        assert cells[1] == setting.policy and f"{setting.tokens_per_s:.2f}" in cells, row
        assert f"{setting.device_bytes / GB:.2f}" in cells, row


def test_plans_memory_line_adds_up_to_each_rows_device_gb(capsys):
    import re

    from specfit.simulate.sweep_commands import _print_plan

    memory = MemoryModel("olmoe-1b-7b", shape_config("olmoe-1b-7b"), MemoryBudget(8 * GB))
    result = _plan_result(memory, policies=("ar", "eagle3:60:7"))
    _print_plan(result, top=5)
    out = capsys.readouterr().out
    line = " ".join(out.split("┏")[0].split())               # the memory line, as one line
    gb = {name: float(re.search(rf"{name}[^;,]*? ([0-9.]+) GB", line).group(1))
          for name in ("dense weights", "KV cache", "staging", "workspace", "reserve", "one cached expert per layer")}
    kv_per_token_gb = float(re.search(r"\+ ([0-9.]+) MB per tree token", line).group(1)) / 1e3
    rows = [[c.strip() for c in row.strip("│").split("│")] for row in out.splitlines() if row.startswith("│")]
    assert {int(r[2]) for r in rows} == {0, 16}
    drafter_gb = float(re.search(r"the drafter [^;,]*? ([0-9.]+) GB", line).group(1))
    for _, policy, cache, _, _, tree, device_gb, expert_cache_gb, workspace_gb in rows:
        staging = gb["staging"] if int(cache) < memory.config.n_experts else 0.0
        drafter = drafter_gb if policy != "ar" else 0.0
        if policy == "ar":         # the prompt's pass, as the line says
            assert float(workspace_gb) == gb["workspace"]
        total = (gb["dense weights"] + gb["KV cache"] + int(tree) * kv_per_token_gb + float(expert_cache_gb)
                 + staging + drafter + float(workspace_gb) + gb["reserve"])
        assert total == pytest.approx(float(device_gb), abs=0.011), (policy, cache, line)


@pytest.mark.parametrize("chunk", [0, 128, 512])
def test_plans_estimate_holds_what_a_decode_allocates(chunk):
    """A decode as ``specfit decode`` builds it (a stand-in of the tiny shape and its stand-in
    EAGLE-3 head, the policy drafting its largest tree, the prompt in one pass, in chunks of 128
    and within the default chunk) holds its weights, drafter, expert slots and staging, and at its
    peak the KV caches and the largest pass's tensors: plan's estimate for the same shape, cache,
    policy, context and chunk is that peak, within the pieces it leaves to the reserve (the MLP
    blocks' activations)."""
    from specfit.calibrate.presets import resolve_profile
    from specfit.calibrate.profile import ModelShape
    from specfit.calibrate.standin import random_drafter, random_model
    from specfit.experts.predictors import make_predictor
    from specfit.policies import RerankPolicy
    from specfit.runtime.decoder import Decoder
    from specfit.runtime.drafting import Proposer, tree_capacity

    config, cache, prompt_tokens, new_tokens = shape_config("tiny"), 4, 400, 12
    model = random_model(config, torch.device("cpu"), torch.float32, cache_experts=cache)
    drafter = random_drafter(model)
    levels = 3
    policy = RerankPolicy(tree_capacity(4, levels), levels, name="full")        # the whole drafted tree, verified
    cost = resolve_profile("pcie5", ModelShape.from_config(config, torch.float32, "tiny")).cost
    decoder = Decoder(model, Proposer(drafter, 4), policy, cost, predictor=make_predictor("router", model=model),
                      eos_token_ids=[], online_refit=False, prefill_chunk=chunk)
    offload = model.offload
    held = [*model.parameters(), *drafter.parameters(), *drafter.buffers(), offload.slot_gate_up, offload.slot_down,
            offload.staging_gate_up, offload.staging_down]
    resident = sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in held}.values())
    prompt = np.random.default_rng(0).integers(0, config.vocab_size, prompt_tokens).tolist()
    with PeakBytes(held + offload.host.gate_up + offload.host.down) as live:            # the KV caches and every pass's tensors
        result = decoder.generate(prompt, new_tokens, ignore_eos=True)
    tree = max(int(c.verification.nodes.size) for c in result.cycles)
    assert tree == tree_capacity(4, levels)
    actual = resident + live.peak

    memory = MemoryModel("tiny", config, MemoryBudget(1 * GB, context_tokens=prompt_tokens + new_tokens,
                                                      reserve_bytes=0, dtype="float32", prompt_tokens=prompt_tokens,
                                                      prefill_chunk=chunk))
    estimate = memory.device_bytes(cache, tree)
    assert actual * 0.97 <= estimate <= actual * 1.03, (estimate, actual)


def test_plans_synthesised_traces_are_as_deep_as_its_deepest_candidate():
    """The plan synthesised the presets' 7-level trees, so eagle3:60:8 and specfit:8 were replayed a
    level short (and the plan printed the note saying so)."""
    from specfit.simulate.plan import PLAN_MAX_LEVELS, _synth_task

    trace = _synth_task("olmoe-1b-7b", "chat", 8)
    assert int(trace.depth.max()) == PLAN_MAX_LEVELS == 8
