"""A sweep's spec, cells and dataset without Ray: profile files beside the spec and in the cell
ids, routing entries' sequences and drafter presets, duplicate sources, the dataset's grid order
and current cells, the slowest chunks first."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from specfit.calibrate.presets import preset_profile
from specfit.errors import SpecFitError
from specfit.simulate.dataset import fill_speedups, read_results, write_part, write_sweep_file
from specfit.simulate.distributed import _chunks, _import_task, _routing_log, resolve_inputs, run_grid
from specfit.simulate.grid import expand, parse_spec
from specfit.traces.importers import import_routing, model_for_log
from specfit.traces.routing_logs import RoutingLog
from specfit.traces.synth import WORKLOADS

from trace_helpers import SAMPLE_OLMOE

BASE = SAMPLE_OLMOE.parent
TRACE = SAMPLE_OLMOE.name


def spec_of(**fields):
    return parse_spec({"traces": [TRACE], **fields}, source="spec.toml", base=BASE)


# a specfit policy's per-level state is [D + 2, ranks]: 10**12 levels ended the sweep in a MemoryError
def test_more_draft_levels_than_a_trace_can_record_are_refused():
    with pytest.raises(SpecFitError, match="spec.toml: field 'max_levels': expected values from 1 to 32767, got 1e"):
        spec_of(max_levels=[8, 10 ** 12])


# a value listed twice would make two cells with one id
def test_an_axis_listing_a_value_twice_is_refused():
    with pytest.raises(SpecFitError, match="twice"):
        spec_of(cache_experts=[0, 16, 0])


# a sweep loads no model: the router predictor (the target's router weights) is refused in the
# spec, not on a worker after Ray started with a hint at an option sweeps do not have
def test_the_router_predictor_is_refused_in_a_sweep_spec():
    with pytest.raises(SpecFitError, match="spec.toml: field 'predictor': router needs the target's weights"):
        spec_of(predictor=["oracle", "router"])


# a negative cache size is refused naming the field
def test_a_negative_cache_size_is_refused():
    with pytest.raises(SpecFitError, match="cache_experts"):
        spec_of(cache_experts=[-1])


# a changed profile JSON changes the cells that replay with it (and only those)
def test_a_profile_jsons_digest_is_part_of_its_cells_identity():
    spec = spec_of(profiles=["pcie4", "mine.json"], cache_experts=[0], policies=["ar"])
    a = {(c.profile_source): c.cell_id for c in expand(spec, {"mine.json": "aaaa"})}
    b = {(c.profile_source): c.cell_id for c in expand(spec, {"mine.json": "bbbb"})}
    assert a["pcie4"] == b["pcie4"] and a["mine.json"] != b["mine.json"]


# a preset's figures are the code's: changed (as a hit's were in stop 62), its cells are new cells,
# so a sweep resumed across the change replays them rather than mixing rows of the two
def test_a_presets_figures_are_part_of_its_cells_identity(monkeypatch):
    from specfit.calibrate import presets

    spec = spec_of(profiles=["pcie4", "gh200"], cache_experts=[0], policies=["ar"])
    before = {c.profile_source: c.cell_id for c in expand(spec)}
    assert before == {c.profile_source: c.cell_id for c in expand(spec)}
    monkeypatch.setitem(presets.PRESETS, "gh200", (300.0, presets.PRESETS["gh200"][1]))
    after = {c.profile_source: c.cell_id for c in expand(spec)}
    assert after["pcie4"] == before["pcie4"] and after["gh200"] != before["gh200"]
    monkeypatch.setattr(presets, "_LAUNCH_S", 2 * presets._LAUNCH_S)
    assert {c.profile_source: c.cell_id for c in expand(spec)}["pcie4"] != before["pcie4"]


# a/profile.json and b/profile.json would both be labelled "profile": one profile in the results
def test_profiles_of_the_same_name_in_two_folders_are_refused():
    with pytest.raises(SpecFitError, match=r"spec.toml: field 'profiles': a/profile.json, b/profile.json would all "
                                           r"be labelled 'profile' in the results"):
        spec_of(profiles=["pcie4", "a/profile.json", "b/profile.json"])


# each link speed gets its own cost model
def test_each_h2d_scale_replays_under_its_own_cost_model():
    spec = spec_of(h2d_scale=[1, 2], cache_experts=[0], policies=["ar"])
    cells = expand(spec)
    inputs = resolve_inputs(spec, cells)
    miss = {c.h2d_scale: inputs.scenarios[c.scenario_key].cost.miss_s for c in cells}
    hit = inputs.scenarios[cells[0].scenario_key].cost.hit_s
    assert miss[2.0] - hit == pytest.approx((miss[1.0] - hit) / 2)


# a routing entry without drafters is imported with the chat preset
def test_a_routing_entry_without_drafters_uses_the_chat_preset():
    spec = parse_spec({"routing": [{"log": TRACE}]}, source="spec.toml", base=BASE)
    assert [s.name for s in spec.sources] == [f"{SAMPLE_OLMOE.stem}:chat"]
    assert spec.sources[0].drafter == "chat"


# a routing source's trees are made with its drafter preset's figures and the options' defaults,
# which the code may change: changed, its cells are new cells, so a resumed sweep replays them
def test_a_drafter_presets_figures_and_the_import_defaults_are_part_of_its_cells_identity(monkeypatch):
    from dataclasses import replace

    def ids(**entry):
        spec = parse_spec({"routing": [{"log": TRACE, "drafters": ["chat", "code"], **entry}], "cache_experts": [0],
                          "policies": ["ar"]}, source="spec.toml", base=BASE)
        return {c.trace.split(":")[1]: c.cell_id for c in expand(spec)}

    before = ids()
    assert before == ids()
    # an option left out is hashed at the value the import uses for it
    assert ids(sibling_reuse=0.3, seed=0) == before and ids(seed=1) != before
    monkeypatch.setitem(WORKLOADS, "code", replace(WORKLOADS["code"], top1_prob=0.8))
    after = ids()
    assert after["chat"] == before["chat"] and after["code"] != before["code"]


# the same source twice is refused (its cells would share ids)
def test_the_same_routing_source_twice_is_refused():
    with pytest.raises(SpecFitError, match="same name"):
        parse_spec({"routing": [{"log": TRACE, "drafters": ["chat"]}, {"log": TRACE, "drafters": ["chat"]}]},
                   source="spec.toml", base=BASE)


# a routing entry's options are refused in the spec with `traces import-routing`'s own checks,
# naming the entry and its field, not on a Ray worker after part of the grid ran
@pytest.mark.parametrize("key, value, option", [("seed", -1, "--seed"), ("sibling_reuse", 5.0, "--sibling-reuse"),
                                                ("sequences", 0, "--sequences"), ("max_tokens", -3, "--max-tokens")])
def test_a_routing_entrys_options_out_of_range_are_refused_as_the_import_command_refuses_them(tmp_path, key, value,
                                                                                               option):
    from typer.testing import CliRunner

    from specfit.cli import app

    entry = {"log": TRACE, "drafters": ["chat"], key: value}
    with pytest.raises(SpecFitError) as spec_error:
        parse_spec({"traces": [TRACE], "routing": [{"log": TRACE}, entry]}, source="spec.toml", base=BASE)
    where = f"spec.toml: routing[1]: field {key!r}: "
    assert str(spec_error.value).startswith(where)
    r = CliRunner().invoke(app, ["traces", "import-routing", str(SAMPLE_OLMOE), option, str(value),
                                 "--out", str(tmp_path / "t.parquet")])
    assert r.exit_code == 2 and f"error: {option}: {str(spec_error.value).removeprefix(where)}" in r.output, r.output


def test_the_same_trace_file_spelt_two_ways_is_refused():
    # "t.parquet" and "./x/../t.parquet": one file, two traces of other names, every cell replayed twice
    other = f"./../{BASE.name}/{TRACE}"
    with pytest.raises(SpecFitError, match=r"field 'traces' lists .* \(the same file\) twice"):
        parse_spec({"traces": [TRACE, other]}, source="spec.toml", base=BASE)


# chunking covers every pending cell exactly once, whatever the chunk size
@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 100])
def test_chunks_hold_every_cell_once(size):
    spec = spec_of(cache_experts=[0, 16, 32], predictor=["oracle", "affinity"], policies=["ar", "specfit", "static:auto"])
    cells = expand(spec)
    chunks = _chunks(cells, size)
    ids = [c.cell_id for ch in chunks for c in ch]
    assert sorted(ids) == sorted(c.cell_id for c in cells)
    assert all(len({c.prepared_key for c in ch}) == 1 and len(ch) <= size for ch in chunks)


# a sweep whose cells are all done reports them skipped (no task runs)
def test_a_finished_sweep_counts_every_cell_as_skipped(tmp_path):
    spec = spec_of(cache_experts=[0, 16], policies=["ar"])
    cells = expand(spec)

    class NoRay:
        def cluster_resources(self):
            return {"CPU": 2}

    run = run_grid(spec, cells, None, tmp_path, {c.cell_id for c in cells}, ray=NoRay())
    assert (run.total, run.skipped, run.computed, run.chunks) == (2, 2, 0, 0)


# a sweep into a plan's directory removes the plan's recommendation, which ranked another grid
# (a report would present it as this sweep's)
def test_a_sweep_into_a_plans_directory_removes_its_plan_json(tmp_path):
    from specfit.simulate.distributed import execute
    from specfit.simulate.plan import PLAN_FILE

    spec = spec_of(cache_experts=[0], policies=["ar"])
    cells = expand(spec)
    (tmp_path / "results").mkdir()
    write_part(tmp_path, [{"cell_id": c.cell_id, "trace": c.trace} for c in cells])    # every cell done: no Ray
    (tmp_path / PLAN_FILE).write_text('{"memory": {}, "best": {}}')
    run = execute(spec, tmp_path, show_progress=False)
    assert run.skipped == len(cells) and not (tmp_path / PLAN_FILE).exists()
    assert (tmp_path / "sweep.json").is_file()


def _log(n_sequences=3, per=5):
    rng = np.random.default_rng(0)
    n = n_sequences * per
    experts = np.stack([rng.permutation(16)[:2] for _ in range(n * 2)]).reshape(n, 2, 2)
    return RoutingLog(experts=experts, tokens=rng.integers(0, 100, n), sequence=np.repeat(np.arange(n_sequences), per),
                      source="test")


# `sequences = N` keeps the first N sequences of a routing log
def test_a_routing_entrys_sequences_keep_that_many_sequences():
    from specfit.simulate.grid import TraceSource
    log = _log()
    src = TraceSource(name="x:chat", path="x", resolved=Path("x"), drafter="chat", import_options={"sequences": 2})
    assert np.unique(_routing_log(log, src).sequence).tolist() == [0, 1]


def _real_log(tokens_per_sequence=12):
    """The sample trace's real routing (its reference tokens' experts), each sequence cut short."""
    from specfit.traces.format import read_trace
    trace = read_trace(SAMPLE_OLMOE)
    roots = trace.offsets[:-1]
    keep = np.concatenate([np.flatnonzero(trace.sequence == s)[:tokens_per_sequence]
                           for s in np.unique(trace.sequence)[:2]])
    return RoutingLog(experts=trace.true_experts[roots[keep]].astype(np.int64),
                      tokens=trace.token[roots[keep]].astype(np.int64),
                      sequence=trace.sequence[keep].astype(np.int64), source="sample")


# a sweep imports a routing log as `specfit traces import-routing` does by default
def test_the_sweeps_import_uses_the_import_commands_defaults():
    log = _real_log()
    model = model_for_log(log, None)
    ours = _import_task(log, model, "chat", {})
    ref = import_routing(log, model, workload="chat", drafter=WORKLOADS["chat"])
    for field in ("token", "parent", "path_prob", "true_experts", "verdict"):
        assert np.array_equal(getattr(ours, field), getattr(ref, field)), field


# a routing entry's shape that is not the log's is refused before Ray starts, naming the entry,
# not on a worker after the grid's other traces ran
def test_a_routing_entrys_shape_the_log_is_not_of_is_refused_before_any_task(tmp_path):
    log = _real_log()
    np.savez(tmp_path / "log.npz", expert_ids=log.experts, sequence_id=log.sequence, token_id=log.tokens)
    entries = [{"log": "log.npz", "drafters": ["chat"]}, {"log": "log.npz", "drafters": ["code"], "shape": "qwen3-30b-a3b"}]
    spec = parse_spec({"routing": entries, "policies": ["ar"]}, source=str(tmp_path / "spec.toml"), base=tmp_path)
    with pytest.raises(SpecFitError) as error:
        resolve_inputs(spec, expand(spec))
    assert str(error.value).startswith(f"{tmp_path / 'spec.toml'}: routing[1]: field 'shape': ")
    assert "16 layers x top-8, the model shape 'qwen3-30b-a3b' expects 48 MoE layers x top-8" in str(error.value)
    entries[1]["shape"] = "olmoe-1b-7b"       # the log's own shape named explicitly is taken
    spec = parse_spec({"routing": entries, "policies": ["ar"]}, source=str(tmp_path / "spec.toml"), base=tmp_path)
    assert [model["name"] for _, model in resolve_inputs(spec, expand(spec)).data.values()] == ["olmoe-1b-7b"] * 2


def _row(cell_id, policy, cache, tps):
    return {"cell_id": cell_id, "trace": "t", "policy": policy, "cache_experts": cache, "tokens_per_s": tps}


# read_results refuses a cell in two parts, keeps grid order and the current grid's cells
def test_read_results_keeps_grid_order_and_the_current_cells_and_refuses_duplicates(tmp_path):
    (tmp_path / "results").mkdir()
    write_sweep_file(tmp_path, {}, [{"cell_id": "c1"}, {"cell_id": "c2"}, {"cell_id": "c3"}])
    write_part(tmp_path, [_row("c3", "eagle3", 0, 3.0)])
    write_part(tmp_path, [_row("c1", "ar", 0, 1.0), _row("c2", "eagle3", 16, 2.0)])
    write_part(tmp_path, [_row("old", "ar", 16, 9.0)])          # a cell of an earlier spec
    assert read_results(tmp_path)["cell_id"].tolist() == ["c1", "c2", "c3"]
    assert set(read_results(tmp_path, current_only=False)["cell_id"]) == {"c1", "c2", "c3", "old"}
    write_part(tmp_path, [_row("c2", "eagle3", 16, 2.0), _row("c9", "ar", 0, 1.0)])
    with pytest.raises(SpecFitError, match="two part files"):
        read_results(tmp_path)


# a speed-up divides by the baseline of the same cache size
def test_speedups_compare_with_the_baseline_at_the_same_cache_size():
    frame = pd.DataFrame([_row("a", "ar", 0, 1.0), _row("b", "ar", 16, 2.0), _row("c", "eagle3", 0, 3.0),
                          _row("d", "eagle3", 16, 8.0)])
    out = fill_speedups(frame).set_index("cell_id")
    assert out.loc["c", "speedup_vs_ar"] == pytest.approx(3.0)
    assert out.loc["d", "speedup_vs_ar"] == pytest.approx(4.0)


# a profile JSON in `profiles` is relative to the spec file, not to the working directory
def test_a_profile_json_is_found_beside_the_spec(tmp_path, monkeypatch):
    from specfit.calibrate.presets import OLMOE_1B_7B
    preset_profile("pcie5", OLMOE_1B_7B).save(tmp_path / "mine.json")
    spec = parse_spec({"traces": [TRACE], "profiles": ["mine.json"], "cache_experts": [0], "policies": ["ar"],
                       "rescale": True}, source=str(tmp_path / "spec.toml"), base=BASE)
    monkeypatch.chdir(BASE)
    cells = expand(spec)
    inputs = resolve_inputs(spec, cells)
    assert inputs.scenarios[cells[0].scenario_key].cost.miss_s == pytest.approx(
        preset_profile("pcie5", OLMOE_1B_7B).cost.miss_s)


# a profile of another shape is allowed in a spec by its field `rescale` (a sweep has no --rescale)
def test_a_profile_of_another_shape_names_the_specs_rescale_field(tmp_path):
    from specfit.calibrate.presets import QWEN3_30B_A3B
    preset_profile("pcie5", QWEN3_30B_A3B).save(tmp_path / "qwen.json")
    raw = {"traces": [str(SAMPLE_OLMOE)], "profiles": ["qwen.json"], "cache_experts": [0], "policies": ["ar"]}
    spec = parse_spec(raw, source=str(tmp_path / "spec.toml"), base=tmp_path)
    with pytest.raises(SpecFitError) as error:
        resolve_inputs(spec, expand(spec))
    assert str(error.value).startswith(f"{tmp_path / 'spec.toml'}: field 'profiles': ")
    assert "set rescale = true in the spec to map" in str(error.value) and "--rescale" not in str(error.value)
    spec = parse_spec({**raw, "rescale": True}, source=str(tmp_path / "spec.toml"), base=tmp_path)
    assert resolve_inputs(spec, expand(spec)).scenarios        # the field it names does allow it


# rows come back in grid order whatever order the part files list in
def test_read_results_returns_rows_in_grid_order_not_part_file_order(tmp_path):
    from specfit.simulate.dataset import part_files
    (tmp_path / "results").mkdir()
    for i in range(4):
        write_part(tmp_path, [_row(f"c{i}", "ar", i, 1.0)])
    in_files = [pd.read_parquet(p)["cell_id"].iloc[0] for p in part_files(tmp_path)]
    grid = in_files[::-1]                                      # a grid order the files do not follow
    write_sweep_file(tmp_path, {}, [{"cell_id": c} for c in grid])
    assert read_results(tmp_path)["cell_id"].tolist() == grid


# the slowest policies are scheduled first (the sweep does not end waiting on one long chunk)
def test_chunks_put_the_slowest_policies_first():
    spec = spec_of(cache_experts=[0], policies=["ar", "specfit", "static:auto", "eagle3"])
    chunks = _chunks(expand(spec), 1)
    assert [ch[0].policy for ch in chunks][:2] == ["static:auto", "specfit"]


# layer_ahead, simulate --layer-ahead as an axis: cells without it keep the ids they had (a
# dataset of before the axis is resumed, not replayed again), a recounted cell's row is simulate's
def test_a_layer_ahead_axis_keeps_the_ids_of_cells_without_it_and_gives_simulates_row():
    from specfit.simulate.grid import run_cell
    from specfit.simulate.replay import prepare_trace
    from specfit.simulate.scenarios import build_scenario
    from specfit.simulate.sweep import run_sweep
    from specfit.traces.format import read_trace

    plain = expand(spec_of(cache_experts=[16], policies=["ar", "specfit"], profiles=["gh200"]))
    both = expand(spec_of(cache_experts=[16], policies=["ar", "specfit"], profiles=["gh200"],
                          layer_ahead=["none", "eam"]))
    assert [c.cell_id for c in both if c.layer_ahead == "none"] == [c.cell_id for c in plain]
    eam = [c for c in both if c.layer_ahead == "eam"]
    assert len(eam) == 2 and not {c.cell_id for c in eam} & {c.cell_id for c in plain}
    with pytest.raises(SpecFitError, match="field 'layer_ahead': expected none or one of ceiling"):
        spec_of(layer_ahead=["psychic"])
    trace = read_trace(SAMPLE_OLMOE)
    from specfit.calibrate.profile import ModelShape

    scenario = build_scenario("gh200", ModelShape.from_trace_meta(trace.model))
    prepared = prepare_trace(eam[0].trace, trace, "oracle", "calibrated")
    _, summary = run_sweep([prepared], ["ar"], [16], [scenario], layer_ahead="eam")
    row = run_cell(prepared, eam[0], scenario)
    assert row["policy"] == "ar" and row["layer_ahead"] == "eam"
    assert row["layer_ahead_tokens_per_s"] == pytest.approx(summary["layer_ahead_tokens_per_s"].iloc[0], rel=1e-12)
    assert "layer_ahead_tokens_per_s" not in run_cell(prepared, plain[0], scenario)


# parts written before the axis read as not recounted, beside parts that have it, and each
# setting's speed-up is taken within its own layer_ahead value
def test_read_results_fills_a_missing_layer_ahead_and_takes_speedups_across_it(tmp_path):
    """A part written before the axis reads as ``none``; a recount changes no replay figure, so a
    speed-up's baseline is the setting's ``ar`` whatever its layer_ahead (here only ``none``'s)."""
    (tmp_path / "results").mkdir()
    write_sweep_file(tmp_path, {}, [{"cell_id": c} for c in ("a", "b", "c", "d")])
    write_part(tmp_path, [_row("a", "ar", 0, 2.0), _row("b", "eagle3", 0, 3.0)])
    write_part(tmp_path, [{**_row("c", "eagle3", 16, 8.0), "layer_ahead": "eam"},
                          {**_row("d", "eagle3", 0, 3.0), "layer_ahead": "eam"}])
    out = read_results(tmp_path).set_index("cell_id")
    assert out["layer_ahead"].tolist() == ["none", "none", "eam", "eam"]
    assert out.loc["b", "speedup_vs_ar"] == out.loc["d", "speedup_vs_ar"] == pytest.approx(1.5)
    assert np.isnan(out.loc["c", "speedup_vs_ar"])           # another cache size: no baseline


# a setting's cells apart only in layer_ahead are one row of the tables, each recount a column
def test_layer_ahead_wide_makes_one_row_per_setting():
    from specfit.simulate.dataset import layer_ahead_wide

    rows = [{**_row("a", "ar", 0, 1.0), "layer_ahead": "none"},
            {**_row("b", "ar", 0, 1.0), "layer_ahead": "eam", "layer_ahead_tokens_per_s": 1.5},
            {**_row("c", "ar", 0, 1.0), "layer_ahead": "ceiling", "layer_ahead_tokens_per_s": 2.0},
            {**_row("d", "specfit+cache", 0, 3.0), "layer_ahead": "none"},
            {**_row("e", "specfit+cache", 0, 3.0), "layer_ahead": "eam", "layer_ahead_tokens_per_s": np.nan},
            {**_row("f", "ar", 16, 4.0), "layer_ahead": "eam", "layer_ahead_tokens_per_s": 5.0}]
    wide, added = layer_ahead_wide(pd.DataFrame(rows))
    assert added == ["+LA eam tokens/s", "+LA ceiling tokens/s"]
    assert wide["cell_id"].tolist() == ["a", "d", "f"] and "layer_ahead" not in wide
    assert wide["+LA eam tokens/s"].tolist()[0] == 1.5 and np.isnan(wide["+LA eam tokens/s"].tolist()[1])
    assert wide["+LA eam tokens/s"].tolist()[2] == 5.0 and wide["+LA ceiling tokens/s"].tolist()[0] == 2.0
    plain, none = layer_ahead_wide(pd.DataFrame([{**_row("a", "ar", 0, 1.0), "layer_ahead": "none"}]))
    assert none == [] and plain["cell_id"].tolist() == ["a"]


def test_a_dataset_written_before_the_layer_ahead_axis_reads_as_none(tmp_path):
    (tmp_path / "results").mkdir()
    write_sweep_file(tmp_path, {}, [{"cell_id": "a"}, {"cell_id": "b"}])
    write_part(tmp_path, [_row("a", "ar", 0, 1.0), _row("b", "eagle3", 0, 3.0)])
    assert read_results(tmp_path)["layer_ahead"].tolist() == ["none", "none"]
