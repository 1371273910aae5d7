"""`specfit calibrate`'s job: the hit prior, the draft level's timing, a stand-in of fewer layers
scaled up to its shape, and a refit's cycles checked (measured time, whole counts)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from runtime_fixtures import torch_single_thread  # noqa: F401  (autouse: one intra-op thread)
from specfit.assets import tiny_moe_dir, tiny_moe_eagle3_dir
from specfit.calibrate import calibrate_job
from specfit.calibrate.calibrate_job import CalibrationPlan, calibrate, probe_prior, read_run_cycles
from specfit.calibrate.standin import shape_config
from specfit.errors import SpecFitError


# a hit's prior is the compute probe's smallest batch (one token), not its largest
def test_the_hit_prior_is_the_smallest_batchs_time():
    rows = [{"tokens": 8, "seconds": 4e-3}, {"tokens": 1, "seconds": 1e-3}, {"tokens": 4, "seconds": 2e-3}]
    assert probe_prior(rows, [], 1000, pinned=False) == {"hit_s": 1e-3}


def _run(tmp_path, measured, **changes):
    n = len(measured)
    frame = pd.DataFrame({"draft_levels": np.ones(n, dtype=int), "nodes_verified": np.full(n, 3),
                          "hits": np.full(n, 5), "misses": np.full(n, 2), "measured_time_s": measured})
    for column, (row, value) in changes.items():
        frame[column] = frame[column].astype(float)
        frame.loc[row, column] = value
    run = tmp_path / "run"
    run.mkdir()
    frame.to_parquet(run / "cycles.parquet")
    return run


# a cycle measured at 0 s is refused as a negative one is
def test_a_cycle_measured_at_zero_seconds_is_refused(tmp_path):
    with pytest.raises(SpecFitError, match="<= 0"):
        read_run_cycles(_run(tmp_path, [0.01, 0.0, 0.02]))


# counts must be whole numbers
def test_a_fractional_count_is_refused(tmp_path):
    with pytest.raises(SpecFitError, match="column 'hits' holds 2.5"):
        read_run_cycles(_run(tmp_path, [0.01, 0.02, 0.02], hits=(1, 2.5)))


# a count past int64 is none a run wrote (1e300 ended the fit in a LinAlgError traceback)
@pytest.mark.parametrize("value", [1e300, 2.0 ** 63])
def test_a_count_past_int64_is_refused(tmp_path, value):
    with pytest.raises(SpecFitError, match=r"column 'nodes_verified' holds .*; expected non-negative whole counts \(int64\)"):
        read_run_cycles(_run(tmp_path, [0.01, 0.02, 0.02], nodes_verified=(1, value)))


# a stand-in of zero layers is refused
@pytest.mark.parametrize("layers", [0, -1, 5])
def test_a_standin_layer_count_out_of_range_is_refused(layers):
    with pytest.raises(SpecFitError, match="--layers"):
        shape_config("tiny", layers)


# the draft level is timed from levels beyond the first (the first has no tree to grow)
def test_the_draft_level_is_the_median_of_the_levels_beyond_the_first(monkeypatch):
    rows = [{"level": 1, "seconds": 10.0}, {"level": 2, "seconds": 1.0}, {"level": 3, "seconds": 2.0}]
    monkeypatch.setattr(calibrate_job, "probe_drafter_levels", lambda model, drafter, seed=0: rows)
    plan = CalibrationPlan(model_dir=tiny_moe_dir(), drafter_dir=tiny_moe_eagle3_dir(), quick=True)
    profile = calibrate(plan)
    assert profile.cost.draft_level_s == pytest.approx(1.5)
    # and the profile says which drafter it timed
    assert profile.probes["drafter"] == calibrate_job.drafter_identity(tiny_moe_eagle3_dir())
    assert profile.probes["drafter"].startswith("tiny-moe-eagle3@")


# a stand-in with fewer layers than its shape grows its per-pass terms by the layers it lacks
def test_a_standin_of_half_the_layers_adds_the_missing_layers_not_a_second_head():
    from specfit.calibrate.cycles import part_line

    profile = calibrate(CalibrationPlan(shape="tiny", layers=2, quick=True))
    probed, rows = profile.fit["probed_params"], profile.probes["layer_parts"]
    assert profile.fit["layers_added"] == {"dense_layer": 0, "moe_layer": 2}
    assert {r["part"] for r in rows} == {"moe_layer"} and {r["tokens"] for r in rows} == {1, 16}
    line = part_line(rows, "moe_layer")
    assert line[0] > 0
    for i, term in enumerate(("base_s", "per_node_s")):
        assert profile.fit["depth_added_s"][term] == pytest.approx(2 * line[i])
        assert getattr(profile.cost, term) == pytest.approx(probed[term] + 2 * line[i])


# DeepSeek-V2's first layer is dense and a stand-in keeps it: only MoE layers are missing
def test_a_deepseek_standin_adds_only_its_missing_moe_layers():
    from specfit.costmodel import CostModel

    rows = [{"part": "moe_layer", "tokens": 1, "seconds": 1.1e-3}, {"part": "moe_layer", "tokens": 16, "seconds": 2.6e-3},
            {"part": "dense_layer", "tokens": 1, "seconds": 2.02e-3},
            {"part": "dense_layer", "tokens": 16, "seconds": 2.32e-3}]
    probed = CostModel(base_s=10e-3, per_node_s=1e-3, hit_s=1e-4, miss_s=1e-3, draft_level_s=5e-4)
    cost, info = calibrate_job.scale_to_depth(probed, rows, shape_config("deepseek-v2-lite", 4),
                                              shape_config("deepseek-v2-lite"))
    # an MoE layer 1 ms + 0.1 ms a token; 23 of the 26 are missing, the one dense layer is there
    assert info["layers_added"] == {"dense_layer": 0, "moe_layer": 23}
    assert info["layer_lines_s"]["moe_layer"] == {"base_s": pytest.approx(1e-3), "per_node_s": pytest.approx(0.1e-3)}
    assert cost.base_s == pytest.approx(10e-3 + 23 * 1e-3)
    assert cost.per_node_s == pytest.approx(1e-3 + 23 * 0.1e-3)
    assert (cost.hit_s, cost.miss_s, cost.draft_level_s) == (probed.hit_s, probed.miss_s, probed.draft_level_s)


def test_a_deepseek_shaped_standin_times_an_moe_layer_without_its_experts(monkeypatch):
    from specfit.calibrate import standin
    from specfit.calibrate.cycles import part_line

    small = {**standin.SHAPE_CONFIGS["deepseek-v2-lite"], "vocab_size": 512, "hidden_size": 64,
             "num_hidden_layers": 6, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "intermediate_size": 128, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
             "v_head_dim": 16, "num_attention_heads": 2, "num_key_value_heads": 2}
    monkeypatch.setitem(standin.SHAPE_CONFIGS, "small-deepseek", small)
    profile = calibrate(CalibrationPlan(shape="small-deepseek", layers=3, quick=True))
    probed, rows = profile.fit["probed_params"], profile.probes["layer_parts"]
    assert profile.fit["layers_added"] == {"dense_layer": 0, "moe_layer": 3}
    assert {r["part"] for r in rows} == {"moe_layer", "dense_layer"}
    moe = part_line(rows, "moe_layer")
    assert moe[0] > 0
    assert profile.cost.base_s == pytest.approx(probed["base_s"] + 3 * moe[0])
    assert profile.cost.per_node_s == pytest.approx(probed["per_node_s"] + 3 * moe[1])


def test_a_refit_leaves_out_the_online_models_own_update(tmp_path):
    """A run that refitted its model as it went has that update in its cycles' times; a model that
    decides with the refitted profile adds its own expected update to the base, so the profile is
    fitted on the cycles without it (the base came out 2.4 % high here, counted twice after)."""
    from specfit.calibrate.profile import ModelShape, Profile
    from specfit.costmodel import CostModel

    rng = np.random.default_rng(1)
    true = CostModel(base_s=0.010, per_node_s=0.001, hit_s=0.0002, miss_s=0.0012, draft_level_s=0.002)
    n = 400
    levels, nodes, hits, misses = rng.integers(0, 5, n), rng.integers(1, 12, n), rng.integers(10, 60, n), rng.integers(0, 30, n)
    work = CostModel.features(levels, nodes, hits, misses) @ true.params * (1 + 0.01 * rng.standard_normal(n))
    update = np.where(np.arange(n) % 8 == 0, 0.004, 0.0002)     # a refit every 8 cycles, an observation otherwise
    run = tmp_path / "run"
    run.mkdir()
    pd.DataFrame({"draft_levels": levels, "nodes_verified": nodes, "hits": hits, "misses": misses,
                  "measured_time_s": work + update, "update_time_s": update}).to_parquet(run / "cycles.parquet")
    profile, _ = calibrate_job.refit(Profile(cost=true, shape=ModelShape("m", 4, 16, 2, 1000)), [run])
    assert profile.cost.base_s == pytest.approx(true.base_s, rel=0.005)


def test_a_refit_names_the_drafter_its_cycles_drafted_with(tmp_path):
    """A refit's draft_level_s is fitted on the runs' drafted levels: the profile then names the
    drafter of those runs (run.json), not the one that timed the profile it refits; when it cannot
    tell (an older run, or several drafters) it names none and says so."""
    import json

    from specfit.calibrate.profile import ModelShape, Profile
    from specfit.costmodel import CostModel

    rng = np.random.default_rng(2)
    true = CostModel(base_s=0.010, per_node_s=0.001, hit_s=0.0002, miss_s=0.0012, draft_level_s=0.002)

    def run(name, drafter="absent", drafting=True, depth=None):
        n = 60
        levels = (np.full(n, depth) if depth else rng.integers(1, 5, n)) if drafting else np.zeros(n, dtype=int)
        nodes, hits, misses = rng.integers(1, 12, n), rng.integers(10, 60, n), rng.integers(0, 30, n)
        d = tmp_path / name
        d.mkdir()
        pd.DataFrame({"draft_levels": levels, "nodes_verified": nodes, "hits": hits, "misses": misses,
                      "measured_time_s": CostModel.features(levels, nodes, hits, misses) @ true.params}
                     ).to_parquet(d / "cycles.parquet")
        if drafter != "absent":
            (d / "run.json").write_text(json.dumps({"kind": "decode", "drafter": drafter}))
        return d

    def refit(*runs):
        prior = Profile(cost=true, shape=ModelShape("m", 4, 16, 2, 1000), probes={"drafter": "stand-in"})
        return calibrate_job.refit(prior, list(runs))[0]

    eagle, other = run("eagle", "eagle@1"), run("other", "other@2")
    refitted = refit(eagle)
    assert refitted.probes["drafter"] == "eagle@1" and "warnings" not in refitted.fit
    assert refit(run("ar", None, drafting=False)).probes["drafter"] == "stand-in"     # no level drafted: kept
    for runs, said in (([run("old")], "does not say which drafter"), ([eagle, other], "eagle@1 and with other@2")):
        refitted = refit(*runs)
        assert "drafter" not in refitted.probes
        assert len(refitted.fit["warnings"]) == 1 and said in refitted.fit["warnings"][0]
        assert "probes.drafter, stand-in, dropped" in refitted.fit["warnings"][0]
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "run.json").write_text(json.dumps({"drafter": 3}))
    with pytest.raises(SpecFitError, match="field 'drafter': expected a string"):
        calibrate_job.run_drafter(tmp_path / "bad")
    # every cycle five levels deep: the levels cannot be told from the base, draft_level_s is held
    # at the prior's (scaled), which is still the stand-in's: the profile keeps naming it
    fixed = refit(run("fixed", "eagle@1", depth=5))
    assert "draft_level_s" in fixed.fit["held"] and fixed.probes["drafter"] == "stand-in"


def test_a_refit_keeps_the_calibrations_copy_fit_and_a_what_if_keeps_its_latency(tmp_path):
    """A refit dropped fit.h2d, so a refitted profile's copy latency read 0 and --h2d-scale scaled it
    with the bandwidth again."""
    from specfit.calibrate.profile import ModelShape, Profile
    from specfit.costmodel import CostModel
    from specfit.simulate.scenarios import build_scenario, link_gbps

    rng = np.random.default_rng(3)
    true = CostModel(base_s=0.010, per_node_s=0.001, hit_s=0.0002, miss_s=0.0012, draft_level_s=0.002,
                     expert_bytes=10**6)
    n = 80
    levels, nodes, hits, misses = (rng.integers(0, 5, n), rng.integers(1, 12, n), rng.integers(10, 60, n),
                                   rng.integers(0, 30, n))
    (tmp_path / "run").mkdir()
    pd.DataFrame({"draft_levels": levels, "nodes_verified": nodes, "hits": hits, "misses": misses,
                  "measured_time_s": CostModel.features(levels, nodes, hits, misses) @ true.params}
                 ).to_parquet(tmp_path / "run" / "cycles.parquet")
    h2d = {"gbps": 1.25, "overhead_s": 2e-4, "r2": 1.0}
    shape = ModelShape("m", 4, 16, 2, 10**6)
    prior = Profile(cost=true, shape=shape, fit={"h2d": h2d})
    refitted = calibrate_job.refit(prior, [tmp_path / "run"])[0]
    assert refitted.fit["h2d"] == h2d and refitted.copy_latency_s == 2e-4
    path = refitted.save(tmp_path / "refit.json")
    faster = build_scenario(str(path), shape, h2d_scale=4.0)
    bandwidth_s = refitted.cost.transfer_s - 2e-4
    assert faster.cost.transfer_s == pytest.approx(2e-4 + bandwidth_s / 4)
    # the link a sweep's table shows: the bandwidth part, four times as fast
    assert link_gbps(faster.cost, faster.copy_latency_s) == pytest.approx(
        4 * link_gbps(refitted.cost, refitted.copy_latency_s))


def test_a_standin_drafter_for_mla_attends_over_the_whole_width(monkeypatch):
    """MLA's head_dim is its rotary part alone; an EAGLE-3 head is a Llama layer of the target's
    width (DeepSeek-V2-Lite: 16 heads x 128, not x 64)."""
    import torch

    from specfit.calibrate import standin

    small = {**standin.SHAPE_CONFIGS["deepseek-v2-lite"], "vocab_size": 512, "hidden_size": 64,
             "num_hidden_layers": 2, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "intermediate_size": 128, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
             "v_head_dim": 16, "num_attention_heads": 2, "num_key_value_heads": 2}
    monkeypatch.setitem(standin.SHAPE_CONFIGS, "small-deepseek", small)
    config = shape_config("small-deepseek")
    assert config.head_dim == 8
    model = standin.random_model(config, torch.device("cpu"), torch.float32)
    drafter = standin.random_drafter(model, draft_vocab_size=64)
    assert drafter.config.head_dim * drafter.config.num_attention_heads == 64


@pytest.fixture
def gpu_host(monkeypatch):
    """A host with two (faked) GPUs, the second one current: torch names each by its index."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: f"NVIDIA GPU {device}")


# a machine record names the device it was measured on: cuda:N is GPU N, cuda the current one
def test_the_machine_record_names_the_gpu_it_measured(gpu_host):
    from specfit.calibrate.profile import machine_info

    assert machine_info("cuda:0")["device_name"] == "NVIDIA GPU 0"
    assert machine_info("cuda")["device_name"] == "NVIDIA GPU 1"
    assert machine_info("cuda:1")["device"] == "cuda"


# on a GPU host, a calibration on the CPU is the CPU's profile: a decode on the GPU does not take it for its own
def test_a_cpu_calibration_on_a_gpu_host_is_not_the_gpus_profile(gpu_host, tmp_path, monkeypatch):
    import types

    import torch

    from specfit.calibrate.presets import preset_profile
    from specfit.calibrate.profile import ModelShape, machine_info
    from specfit.runtime import decode_job
    from specfit.runtime.config import ModelConfig

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cpu = machine_info("cpu")
    assert cpu["device"] == "cpu" and "GPU" not in cpu["device_name"] and "cuda" not in cpu
    config = ModelConfig.from_dir(tiny_moe_dir())
    shape = ModelShape.from_config(config, torch.float32, tiny_moe_dir().name)
    made = preset_profile("pcie4", shape)
    made.machine = cpu                               # as calibrate() records a --device cpu run
    mine = calibrate_job.planned_profile_path(CalibrationPlan(model_dir=tiny_moe_dir(), device="cpu", quick=True))
    made.save(mine)
    made.save(calibrate_job.cached_profile_path(cpu, shape, "float32"))
    monkeypatch.setattr(calibrate_job, "calibrate", lambda plan, model=None: preset_profile("gh200", shape))
    plan = types.SimpleNamespace(profile=None, model_dir=str(tiny_moe_dir()), drafter_dir=None, seed=0, rescale=False,
                                 online_refit=True)
    model = types.SimpleNamespace(config=config, dtype=torch.float32, device=torch.device("cuda:0"))
    profile, path, _ = decode_job._profile(plan, model, lambda message: None)
    assert path == calibrate_job.cached_profile_path(machine_info("cuda:0"), shape, "float32")
    assert "nvidia-gpu-0" in path.name and profile.machine["device"] == "preset"      # calibrated, not the CPU's
    model.device = torch.device("cpu")
    profile, path, _ = decode_job._profile(plan, model, lambda message: None)
    assert path == mine and profile.machine == cpu


# a cached profile whose draft level another drafter timed is used, and the decode says so once
def test_a_profile_timed_with_another_drafter_is_noted(tmp_path, monkeypatch):
    import json
    import types

    import torch

    from specfit.calibrate.presets import preset_profile
    from specfit.calibrate.profile import ModelShape, machine_info
    from specfit.runtime import decode_job
    from specfit.runtime.config import ModelConfig

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    config = ModelConfig.from_dir(tiny_moe_dir())
    shape = ModelShape.from_config(config, torch.float32, tiny_moe_dir().name)
    path = calibrate_job.cached_profile_path(machine_info("cpu"), shape, "float32")
    other = tmp_path / "other-drafter"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**json.loads((tiny_moe_eagle3_dir() / "config.json").read_text()),
                                                   "draft_vocab_size": 7}))
    model = types.SimpleNamespace(config=config, dtype=torch.float32, device=torch.device("cpu"))

    def notes(timed_with, drafter, online_refit=True):
        made = preset_profile("pcie4", shape)
        if timed_with is not None:
            made.probes["drafter"] = timed_with
        made.save(path)
        plan = types.SimpleNamespace(profile=None, model_dir=str(tiny_moe_dir()), drafter_dir=drafter, seed=0,
                                     rescale=False, online_refit=online_refit)
        _, used, said = decode_job._profile(plan, model, lambda message: None)
        assert used == path
        return said

    eagle = calibrate_job.drafter_identity(tiny_moe_eagle3_dir())
    assert notes(eagle, tiny_moe_eagle3_dir()) == []
    assert notes(None, tiny_moe_eagle3_dir()) == []                     # an older profile does not say
    assert notes(eagle, None) == []                                     # an AR decode drafts nothing
    for timed_with, drafter in (("stand-in", tiny_moe_eagle3_dir()), (eagle, other)):
        said = notes(timed_with, drafter)
        assert len(said) == 1 and f"timed with {timed_with}" in said[0]
        assert f"drafts with {calibrate_job.drafter_identity(drafter)}" in said[0] and "online refit" in said[0]
    assert calibrate_job.drafter_identity(other).startswith("other-drafter@")
    # with --frozen-profile no online refit ever replaces the other drafter's draft level
    said = notes("stand-in", tiny_moe_eagle3_dir(), online_refit=False)
    assert len(said) == 1 and "timed with stand-in" in said[0]
    assert "online refit has seen" not in said[0] and "for the whole run" in said[0] and "--frozen-profile" in said[0]


# a profile measured on another kind of device: with --frozen-profile it stays that machine's for the whole run
@pytest.mark.parametrize("online_refit", [True, False])
def test_another_devices_profile_is_noted_as_frozen_or_refitted(tmp_path, online_refit):
    import types

    import torch

    from specfit.calibrate.presets import preset_profile
    from specfit.calibrate.profile import ModelShape
    from specfit.runtime import decode_job
    from specfit.runtime.config import ModelConfig

    config = ModelConfig.from_dir(tiny_moe_dir())
    shape = ModelShape.from_config(config, torch.float32, tiny_moe_dir().name)
    made = preset_profile("pcie4", shape)
    made.kind, made.machine = "measured", {"device": "cuda", "device_name": "NVIDIA H200"}
    path = made.save(tmp_path / "h200.json")
    plan = types.SimpleNamespace(profile=str(path), model_dir=str(tiny_moe_dir()), drafter_dir=None, seed=0,
                                 rescale=False, online_refit=online_refit)
    model = types.SimpleNamespace(config=config, dtype=torch.float32, device=torch.device("cpu"))
    _, used, said = decode_job._profile(plan, model, lambda message: None)
    assert used == path and len(said) == 1
    assert "was measured on cuda (NVIDIA H200), this run decodes on cpu" in said[0]
    assert ("until the online refit has seen this one's" in said[0]) == online_refit
    assert ("for the whole run, as --frozen-profile keeps the profile unchanged" in said[0]) == (not online_refit)


# a CPU profile is found by machine and model, not by torch threads: a decode with another thread count
# than the profile was measured with says so, naming both, however it got the profile
def test_a_cpu_profile_measured_with_other_threads_is_noted(tmp_path, monkeypatch):
    import types

    import torch

    from specfit.calibrate.presets import preset_profile
    from specfit.calibrate.profile import ModelShape, machine_info
    from specfit.runtime import decode_job
    from specfit.runtime.config import ModelConfig

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    measured = machine_info("cpu")
    assert measured["torch_threads"] == 1                     # a calibration records its threads
    config = ModelConfig.from_dir(tiny_moe_dir())
    shape = ModelShape.from_config(config, torch.float32, tiny_moe_dir().name)
    path = calibrate_job.cached_profile_path(measured, shape, "float32")
    made = preset_profile("pcie4", shape)
    made.kind, made.machine = "measured", measured
    made.save(path)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert calibrate_job.cached_profile_path(machine_info("cpu"), shape, "float32") == path    # the same file

    def notes(spec=None, device="cpu", online_refit=True):
        plan = types.SimpleNamespace(profile=spec, model_dir=str(tiny_moe_dir()), drafter_dir=None, seed=0,
                                     rescale=False, online_refit=online_refit)
        model = types.SimpleNamespace(config=config, dtype=torch.float32, device=torch.device(device))
        _, used, said = decode_job._profile(plan, model, lambda message: None)
        assert used == path
        return said

    for said in (notes(), notes(str(path))):
        assert len(said) == 1 and f"{path} was measured with 1 torch thread(s), this run decodes with 2" in said[0]
        assert "until the online refit has seen this run's" in said[0]
    assert "for the whole run" in notes(online_refit=False)[0]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert notes() == [] and notes(str(path)) == []           # the same threads
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    del made.machine["torch_threads"]                           # an older profile does not say
    made.save(path)
    assert notes() == []


def _tiny_shape():
    import torch

    from specfit.calibrate.profile import ModelShape
    from specfit.runtime.config import ModelConfig

    return ModelShape.from_config(ModelConfig.from_dir(tiny_moe_dir()), torch.float32, tiny_moe_dir().name)


def _cache_setup(tmp_path, monkeypatch, made):
    """(plan, model, cached path, calibrate's calls) for ``decode_job._profile`` on the bundled model
    with no profile found: its quick calibration is replaced by ``made()``, counted."""
    import types

    import torch

    from specfit.calibrate.profile import machine_info
    from specfit.runtime.config import ModelConfig

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    shape = _tiny_shape()
    calls = []
    monkeypatch.setattr(calibrate_job, "calibrate", lambda plan, model=None: calls.append(plan) or made(shape))
    plan = types.SimpleNamespace(profile=None, model_dir=str(tiny_moe_dir()), drafter_dir=None, seed=0, rescale=False,
                                 online_refit=True)
    model = types.SimpleNamespace(config=ModelConfig.from_dir(tiny_moe_dir()), dtype=torch.float32,
                                  device=torch.device("cpu"))
    return plan, model, calibrate_job.cached_profile_path(machine_info("cpu"), shape, "float32"), calls


def _measured(shape, noise=None):
    from specfit.calibrate.presets import preset_profile
    from specfit.calibrate.repeat import busy_warnings

    made = preset_profile("pcie4", shape)
    made.kind = "measured"
    if noise is not None:
        made.fit = {**made.fit, "probe_noise": noise, "warnings": busy_warnings(noise)}
    return made


# two decodes without --profile started at once: the second waits for the first one's calibration
# (the cache entry's lock) and decides with the profile it saved, instead of calibrating beside it
def test_a_second_run_waits_for_the_first_ones_calibration_and_decides_with_its_profile(tmp_path, monkeypatch):
    import dataclasses
    import fcntl
    import os
    import threading
    import time

    from specfit.runtime import decode_job

    plan, model, path, calls = _cache_setup(tmp_path, monkeypatch, _measured)
    path.parent.mkdir(parents=True)
    said, out = [], {}
    second = threading.Thread(target=lambda: out.update(result=decode_job._profile(plan, model, said.append)))
    # the first run's lock beside the cached profile (another open of it conflicts as another process's would)
    lock = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        second.start()
        deadline = time.monotonic() + 30
        while not said and time.monotonic() < deadline:
            time.sleep(0.01)
        assert said and "waiting for another specfit run's calibration" in said[0]
        time.sleep(0.2)
        assert second.is_alive() and not calls                    # blocked on the lock, nothing calibrated
        first = _measured(_tiny_shape())
        first.cost = dataclasses.replace(first.cost, base_s=0.123)    # the first run's, told apart
        first.save(path)
    finally:
        os.close(lock)                                               # the first run ends: its lock is gone
    second.join(timeout=30)
    profile, used, notes = out["result"]
    assert used == path and not calls and profile.cost.base_s == 0.123
    assert any("waited for another run's calibration" in note for note in notes)
    # alone, it does not wait and says nothing of it
    _, used, notes = decode_job._profile(plan, model, said.append)
    assert used == path and not any("waited" in note for note in notes)


# a quick calibration the machine disturbed decides the run, its warnings are noted as `specfit
# calibrate` prints them, and it is not kept: every later run would decide with it
def test_a_busy_quick_calibration_is_noted_and_not_saved(tmp_path, monkeypatch):
    from specfit.runtime import decode_job

    busy = {"rounds": 3, "quick": True, "spread_median": 0.61, "cpu_share": 0.5, "load_average": 2.4, "cpu_count": 2}
    plan, model, path, calls = _cache_setup(tmp_path, monkeypatch, lambda shape: _measured(shape, busy))
    profile, used, notes = decode_job._profile(plan, model, lambda message: None)
    assert len(calls) == 1 and used is None and not path.exists()
    assert profile.fit["probe_noise"] == busy                      # this run decides with it
    text = " ".join(notes)
    assert "timings varied by 61%" in text and "got 50% of a CPU core" in text
    assert "machine was busy" in text and "not saved" in text and "next run without --profile calibrates again" in text
    decode_job._profile(plan, model, lambda message: None)
    assert len(calls) == 2 and not path.exists()                   # measured again, not the busy one reused
    # a quick calibration's passes that spread while they had their core: an idle machine's jitter, kept
    jitter = {**busy, "spread_median": 0.3, "cpu_share": 0.99, "load_average": 0.2}
    plan, model, path, calls = _cache_setup(tmp_path, monkeypatch, lambda shape: _measured(shape, jitter))
    _, used, notes = decode_job._profile(plan, model, lambda message: None)
    assert used == path and path.is_file() and not any("machine was busy" in note for note in notes)
    path.unlink()
    # a load average above the cores alone is noted, but the probes had their core and spread little: kept
    loaded = {**busy, "spread_median": 0.05, "cpu_share": 0.99, "load_average": 3.0}
    plan, model, path, calls = _cache_setup(tmp_path, monkeypatch, lambda shape: _measured(shape, loaded))
    _, used, notes = decode_job._profile(plan, model, lambda message: None)
    assert used == path and path.is_file()
    assert any("load average 3.0 on 2 CPU cores" in note for note in notes)
    assert not any("machine was busy" in note for note in notes)


# the XDG Base Directory specification: a relative $XDG_CACHE_HOME is invalid and ignored
def test_a_relative_xdg_cache_home_is_ignored(tmp_path, monkeypatch):
    from specfit.io import user_cache_dir

    home = tmp_path / "home" / ".cache"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    path = calibrate_job.cached_profile_path({"host": "h", "device_name": "cpu"}, _tiny_shape(), "float32")
    assert path == home / "specfit" / "profiles" / "h-cpu-tiny-moe-float32.json"
    for value in ("relative/cache", "", "."):
        monkeypatch.setenv("XDG_CACHE_HOME", value)
        assert user_cache_dir() == home
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert user_cache_dir() == home
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert user_cache_dir() == tmp_path / "xdg"
