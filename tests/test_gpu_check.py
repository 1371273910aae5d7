"""benchmarks/gpu_check.py and the GPU checks' benchmarks keep working without a GPU: they run on
the CPU with tiny shapes."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from bench_helpers import bench_module
from runtime_fixtures import torch_single_thread  # noqa: F401  (autouse: one intra-op thread)


def _gpu_check():
    return bench_module("gpu_check")


def test_gpu_check_runs_on_the_cpu_with_tiny_shapes(capsys, tmp_path):
    out_path = tmp_path / "gpu_check.json"
    summaries = _gpu_check().main(["--device", "cpu", "--shape", "tiny", "--layers", "2", "--prompts", "1",
                                   "--prompt-tokens", "8", "--new-tokens", "6", "--draft-vocab", "256",
                                   "--out", str(out_path), "--profile-out", str(tmp_path / "profile.json"),
                                   "--run-dir", str(tmp_path / "run")])
    assert [s["policy"] for s in summaries] == ["ar", "eagle3", "static:auto", "specfit"]
    for s in summaries:
        assert s["cycles"] > 0 and s["time_per_cycle_s"] > 0 and math.isfinite(s["predicted_time_per_cycle_s"])
        assert s["stall_s_per_cycle"] >= 0 and s["predicted_transfer_s_per_cycle"] >= 0
        assert s["h2d_gbps"] > 0 and s["h2d_of_probe"] > 0
    assert summaries[1]["nodes_per_cycle"] > summaries[0]["nodes_per_cycle"] == 1.0
    out = capsys.readouterr().out
    assert "H2D" in out and "measured vs predicted" in out and "pageable" in out
    record = json.loads(out_path.read_text())
    assert record["device"] == "cpu" and record["pinned_bytes"] == 0
    first_use = record["drafter_first_use"]
    assert first_use["lengths"] == list(range(1, 25))
    assert len(first_use["first_s"]) == len(first_use["again_s"]) == 24
    assert min(first_use["first_s"] + first_use["again_s"]) > 0
    assert record["host_expert_bytes"] == 2 * 16 * record["expert_bytes"]
    assert set(record["profile"]["measures"]) >= {"h2d", "expert_compute", "cycles"}
    assert [p["policy"] for p in record["policies"]] == ["ar", "eagle3", "static:auto", "specfit"]
    # every cycle's row: the bytes the copies moved are the misses' experts, the cycles counted
    for p in record["policies"]:
        rows = [c for c in record["cycles"] if c["policy"] == p["policy"]]
        assert len(rows) == p["cycles"]
        assert all(c["bytes_h2d"] == c["misses"] * record["expert_bytes"] for c in rows)
        assert all(c["union_size"] == c["hits"] + c["misses"] for c in rows)
    assert set(record["seconds"]) == {"build", "calibrate", "ar", "eagle3", "static:auto", "specfit"}
    saved = json.loads((tmp_path / "profile.json").read_text())
    assert saved["cost"] == record["profile"]["cost"]
    # a stand-in's draft level is timed on real trees of a random EAGLE-3 head (top-4: the root's
    # children, then 4 expanded nodes per level), priced as a level beyond the first
    levels = saved["probes"]["draft"]
    assert [r["level"] for r in levels] == [1, 2, 3, 4] and [r["width"] for r in levels] == [1, 4, 4, 4]
    assert saved["cost"]["draft_level_s"] == pytest.approx(float(np.median([r["seconds"] for r in levels[1:]])))
    # the run directory reads back as a decode run's, the same cycles in it
    from specfit.runtime.run_dir import read_decode_cycles

    kept = read_decode_cycles(tmp_path / "run")
    assert len(kept) == len(record["cycles"]) and list(kept["time_s"]) == [c["time_s"] for c in record["cycles"]]
    assert json.loads((tmp_path / "run" / "profile.json").read_text())["cost"] == saved["cost"]


def test_gpu_check_reports_what_a_prefetching_policy_copied_while_drafting(capsys, tmp_path):
    """gpu_check.sh runs eagle3+prefetch beside the other policies: its prefetches land in the
    stand-in's cache (built, and reallocated by the calibration, inside inference mode) and the
    summary says how many experts a cycle prefetched, their copy time and the pass's wait."""
    out_path = tmp_path / "gpu_check.json"
    summaries = _gpu_check().main(["--device", "cpu", "--shape", "tiny", "--layers", "2", "--prompts", "1",
                                   "--prompt-tokens", "8", "--new-tokens", "6", "--draft-vocab", "256",
                                   "--policies", "eagle3,eagle3+prefetch", "--out", str(out_path)])
    plain, prefetching = summaries
    assert plain["prefetched_per_cycle"] == 0 == plain["prefetch_copy_s_per_cycle"]
    # how much it prefetches is the online cost model's call: on a loaded CPU it can fit a copy at
    # no more than a hit and prefetch nothing (seen in a loaded suite); whatever it copied is timed
    assert (prefetching["prefetched_per_cycle"] > 0) == (prefetching["prefetch_copy_s_per_cycle"] > 0)
    assert 0 <= prefetching["prefetch_wait_s_per_cycle"]
    record = json.loads(out_path.read_text())
    rows = [c for c in record["cycles"] if c["policy"] == "eagle3+prefetch"]
    moved = sum(c["bytes_h2d"] - c["misses"] * record["expert_bytes"] for c in rows) / record["expert_bytes"]
    assert moved == pytest.approx(prefetching["prefetched_per_cycle"] * len(rows))
    out = capsys.readouterr().out
    assert "eagle3+prefetch: prefetched" in out and "eagle3: prefetched" not in out


def test_gpu_check_rejects_a_device_it_cannot_use(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _gpu_check().main(["--device", "tpu"])
    assert exit_info.value.code == 2
    assert "--device 'tpu': expected cpu, cuda or cuda:N" in capsys.readouterr().err


@pytest.mark.parametrize("spec", ["sequoia:4", "sequoia:auto"])
def test_gpu_check_refuses_sequoias_tree_it_has_no_acceptance_rates_for(capsys, spec):
    """Refused before the model is built (it once failed after calibrating, or decoded
    ``sequoia:auto`` as static:2's rerank under Sequoia's name)."""
    with pytest.raises(SystemExit) as exit_info:
        _gpu_check().main(["--device", "cpu", "--policies", f"ar,{spec}"])
    assert exit_info.value.code == 2
    assert f"--policies: {spec}: needs positional acceptance rates" in capsys.readouterr().err


def test_bench_first_use_times_every_length_twice_on_the_cpu(capsys):
    times = bench_module("bench_first_use").main(["--device", "cpu", "--shape", "tiny", "--layers", "2", "--max-n", "3", "--warm", "3"])
    for model in ("target", "drafter"):
        for round_ in ("first", "again"):
            assert len(times[model][round_]) == 3 and min(times[model][round_]) > 0
    out = capsys.readouterr().out
    assert "first pass over n entries" in out and "warm-up over 1..3" in out


def test_attention_reading_the_cache_in_place_equals_the_repeated_cache(capsys):
    """bench_attention.py --quick: the target's and the drafter's attention as they are agree with
    the repeated-cache versions they replaced (the benchmark's references), on the CPU."""
    rows = bench_module("bench_attention").main(["--quick"])
    assert {r["model"].split(":")[0] for r in rows} == {"drafter", "target"}
    for r in rows:
        assert r["repeated_ms"] > 0 and r["in_place_ms"] > 0
        assert r["max_diff"] < 1e-4, r
    assert "read in place vs repeated" in capsys.readouterr().out


def test_a_committed_pass_with_the_newest_logits_alone_matches_every_rows(capsys):
    rows = bench_module("bench_drafter_commit").main(["--quick"])
    assert [r["n"] for r in rows] == [1, 4]
    assert all(r["max_logit_diff"] < 1e-4 and r["every_ms"] > 0 and r["newest_ms"] > 0 for r in rows)


def test_mla_with_kv_b_proj_absorbed_matches_every_latent_expanded(capsys):
    """bench_mla.py --quick: the absorbed MLA layer agrees with the expanded one (the benchmark
    times both forms of the same layer) and a decode step over cached latents picks it."""
    rows = bench_module("bench_mla").main(["--quick"])
    assert [(r["cached"], r["T"], r["picks"]) for r in rows] == [(64, 1, "absorbed")]
    assert all(r["max_diff"] < 1e-4 and r["expanded_ms"] > 0 and r["absorbed_ms"] > 0 for r in rows)
    assert "kv_b_proj absorbed" in capsys.readouterr().out


def test_the_demo_whatif_benchmark_replays_a_recorded_trace_with_and_without_its_predictions(capsys, tmp_path):
    """bench_demo_whatif.py on a full-tree recording of the bundled model (as `specfit demo` makes
    one): the fixed trees (Sequoia's among them) once, SpecFit with the recorded predictions, without the price and with
    the true experts, each over `ar` in every setting."""
    from specfit.assets import demo_prompts_path, tiny_moe_dir, tiny_moe_eagle3_dir
    from specfit.runtime.decode_job import DecodePlan, run_decode

    trace = tmp_path / "trace.parquet"
    run_decode(DecodePlan(model_dir=tiny_moe_dir(), drafter_dir=tiny_moe_eagle3_dir(), prompts_path=demo_prompts_path(),
                          policies=["ar"], profile="pcie4", max_new_tokens=12, cache_experts=4, device="cpu",
                          record=trace, record_full=True, max_levels=3))
    rows = bench_module("bench_demo_whatif").main([str(trace), "--profiles", "pcie4,gh200", "--caches", "0,4"])
    settings = {(r["profile"], r["cache_experts"]) for r in rows}
    assert settings == {(p, c) for p in ("pcie4-qwen3", "gh200-qwen3") for c in (0, 4)}
    for setting in settings:
        got = sorted((r["policy"], r["experts"]) for r in rows if (r["profile"], r["cache_experts"]) == setting)
        assert got == [("eagle3", "(a fixed tree)"), ("sequoia:auto", "(a fixed tree)"), ("specfit", "recorded"),
                       ("specfit", "recorded, no price"), ("specfit", "true experts"), ("static:auto", "(a fixed tree)")]
    assert all(math.isfinite(r["speedup_vs_ar"]) and r["speedup_vs_ar"] > 0 for r in rows)
    assert "with the experts the policies decide with" in capsys.readouterr().out
