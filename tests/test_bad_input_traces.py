"""Bad input to the trace commands (``traces synth | import-routing | validate | inspect`` and the
readers behind ``--trace``): one line naming the file, field or option and what was expected
(exit code 2), having written nothing."""

from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cli_helpers import invoke, one_line_error

from specfit.errors import SpecFitError
from specfit.traces.format import METADATA_KEY, read_trace, validate_trace, write_trace
from trace_helpers import hand_trace


@pytest.fixture(autouse=True)
def in_tmp_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def trace_readers(path) -> dict[str, list]:
    return {"traces validate": ["traces", "validate", path], "traces inspect": ["traces", "inspect", path],
            "simulate --trace": ["simulate", "--trace", path, "--policies", "ar", "--cache-experts", 2]}


def routing_log(path, tokens: int = 6):
    """A flat npz routing log of one sequence: 16 layers x top-8 of 64 experts (olmoe's shape)."""
    np.savez(path, expert_ids=np.tile(np.arange(8), (tokens, 16, 1)), sequence_id=np.zeros(tokens, np.int32))
    return path


def token_records(**overrides) -> list[dict]:
    """Per-token JSONL records of one sequence (2 layers x top-2); ``overrides[i]`` replaces fields of record i."""
    records = [{"sequence_id": 0, "token_index": i, "experts": [[0, 1], [2, 3]]} for i in range(4)]
    for i, fields in overrides.items():
        records[int(i)].update(fields)
    return records


def write_jsonl(path, records: list[dict]):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# ----------------------------------------------------------------- trace files
def test_a_trace_with_damaged_data_under_a_valid_footer_is_one_line(tmp_path):
    good = write_trace(hand_trace(), tmp_path / "good.parquet")
    data = bytearray(good.read_bytes())
    footer = int.from_bytes(data[-8:-4], "little")
    pages_end = len(data) - 8 - footer
    data[4:pages_end] = b"\xff" * (pages_end - 4)       # every page overwritten, footer intact
    bad = tmp_path / "damaged.parquet"
    bad.write_bytes(bytes(data))
    assert pq.ParquetFile(bad).metadata.num_rows == 8   # the footer still reads
    for argv in trace_readers(bad).values():
        one_line_error(invoke(*argv), str(bad), "damaged Parquet data")


@pytest.mark.parametrize("meta, kind", [([1, 2], "a list"), ("text", "'text'"), (3, "3")])
def test_trace_metadata_that_is_json_but_no_object_is_one_line(tmp_path, meta, kind):
    table = pq.read_table(write_trace(hand_trace(), tmp_path / "good.parquet"))
    bad = tmp_path / "meta.parquet"
    pq.write_table(table.replace_schema_metadata({METADATA_KEY: json.dumps(meta).encode()}), bad)
    for argv in trace_readers(bad).values():
        one_line_error(invoke(*argv), str(bad), METADATA_KEY.decode(), f"must be a JSON object, got {kind}")


@pytest.mark.parametrize("raw", [b"\xff\xfe not UTF-8", b"{not json"])
def test_trace_metadata_that_is_not_json_text_is_one_line(tmp_path, raw):
    table = pq.read_table(write_trace(hand_trace(), tmp_path / "good.parquet"))
    bad = tmp_path / "meta.parquet"
    pq.write_table(table.replace_schema_metadata({METADATA_KEY: raw}), bad)
    for argv in trace_readers(bad).values():
        one_line_error(invoke(*argv), str(bad), METADATA_KEY.decode(), "is not valid JSON")


def test_trace_recording_metadata_that_is_no_object_is_one_line(tmp_path):
    trace = hand_trace()
    table = pq.read_table(write_trace(trace, tmp_path / "good.parquet"))
    meta = dict(trace.meta, schema_version=1, recording=["synthetic"])
    bad = tmp_path / "recording.parquet"
    pq.write_table(table.replace_schema_metadata({METADATA_KEY: json.dumps(meta).encode()}), bad)
    for argv in trace_readers(bad).values():
        one_line_error(invoke(*argv), str(bad), "'recording' must be a JSON object, got a list")


@pytest.mark.parametrize("section, key, value, expected", [
    ("model", "expert_bytes", True, "model.expert_bytes must be a non-negative integer, got true (a boolean)"),
    ("model", "n_layers", True, "model.n_layers must be a positive integer, got true (a boolean)"),
    ("model", "n_experts", 10 ** 12, "model.n_experts is 1000000000000; expected at most 32768"),
    ("model", "hidden_size", None, "model.hidden_size must be a non-negative integer, got null"),
    ("model", "shared_expert_bytes", 1.5, "model.shared_expert_bytes must be a non-negative integer, got 1.5"),
    ("model", "vocab_size", "2048", "model.vocab_size must be a positive integer, got '2048'"),
    ("provenance", "real", [7], "provenance.real must be a list of strings, got a list holding 7"),
    ("provenance", "synthesised", None, "provenance.synthesised must be a list of strings, got null"),
    ("recording", "unfittable_predictors", None, "recording.unfittable_predictors must be a list of strings, got null"),
    ("recording", "position_indexed", "false", "recording.position_indexed must be true or false, got 'false'"),
])
def test_trace_metadata_of_the_wrong_kind_is_one_line_where_the_trace_is_read(tmp_path, section, key, value, expected):
    """A metadata value a reader takes as it is (a profile's shape, a list `traces inspect` joins,
    the predictors a trace cannot fit) is checked where the trace is read: a boolean is no count,
    a count past int16 ids is no expert count."""
    trace = hand_trace()
    table = pq.read_table(write_trace(trace, tmp_path / "good.parquet"))
    meta = dict(trace.meta, schema_version=1, **{section: {**trace.meta[section], key: value}})
    bad = tmp_path / "meta.parquet"
    pq.write_table(table.replace_schema_metadata({METADATA_KEY: json.dumps(meta).encode()}), bad)
    for argv in trace_readers(bad).values():
        one_line_error(invoke(*argv), str(bad), f"metadata {expected}")



@pytest.mark.parametrize("prefill", [
    {"prefill_sequences": [0], "prefill_experts": []},                     # lists of different lengths
    {"prefill_sequences": [0], "prefill_experts": [[[0], [1]]]},            # two layers' lists for a 1-layer trace
    {"prefill_sequences": [0], "prefill_experts": [[[7]]]},                 # an expert id out of range
    {"prefill_sequences": [0], "prefill_experts": "nothing"},
    {"prefill_sequences": [0], "prefill_experts": [[[0]], [[1]]]},            # two passes, no pass counts
    {"prefill_sequences": [0], "prefill_experts": [[[0]], [[1]]], "prefill_pass_counts": [3]},   # counts past the passes
    {"prefill_sequences": [0], "prefill_experts": [], "prefill_pass_counts": [0]},                # a sequence of no pass
    {"prefill_sequences": [0], "prefill_experts": [[[0]]], "prefill_pass_counts": [True]},
    {"prefill_sequences": [0, 1], "prefill_experts": [[[0]], [[1]]], "prefill_pass_counts": [2]},  # one count, two ids
    {"prefill_sequences": [0], "prefill_experts": [[[0]], [[7]]], "prefill_pass_counts": [2]},     # pass 1 out of range
    {"prefill_sequences": [0], "prefill_experts": [[[0]], None], "prefill_pass_counts": [2]},      # a pass missing
    {"prefill_pass_counts": [1]},                                                                 # counts of nothing
    {"prefill_sequences": [0], "prefill_experts": [[[-1]]]},                # a negative expert id (numpy's last)
    {"prefill_sequences": ["0"], "prefill_experts": [[[0]]]},               # a sequence id that is no integer
])
def test_a_recorded_prompt_pass_that_is_malformed_is_one_line(tmp_path, prefill):
    """A live recording's prompt passes warm the replay's cache: a malformed entry is refused
    where the trace is read, naming the fields."""
    trace = hand_trace()
    table = pq.read_table(write_trace(trace, tmp_path / "good.parquet"))
    meta = dict(trace.meta, schema_version=1, recording={**trace.meta["recording"], **prefill})
    bad = tmp_path / "prefill.parquet"
    pq.write_table(table.replace_schema_metadata({METADATA_KEY: json.dumps(meta).encode()}), bad)
    for argv in trace_readers(bad).values():
        one_line_error(invoke(*argv), str(bad), "recording.prefill_sequences / prefill_experts")


def test_prompt_passes_are_read_pass_by_pass_and_an_unrecorded_one_is_passed_over():
    """Each sequence's passes in order, one mask per pass; a sequence whose prompt pass an older
    SpecFit did not record (its entry null) has none; a bad chunk's pass is named by its index."""
    from specfit.traces.validate import prompt_passes

    trace = hand_trace()
    recording = {"prefill_sequences": [0, 1], "prefill_experts": [[[0, 2]], [[1]], None], "prefill_pass_counts": [2, 1]}
    passes = prompt_passes(dataclasses.replace(trace, meta={**trace.meta, "recording": recording}), "t.parquet")
    assert list(passes) == [0]
    assert passes[0].tolist() == [[[True, False, True, False]], [[False, True, False, False]]]
    recording = {"prefill_sequences": [0], "prefill_experts": [[[0]], [[4]]], "prefill_pass_counts": [2]}
    with pytest.raises(SpecFitError, match=r"t\.parquet: .*: sequence 0's pass 1 must hold 1 lists \(one per layer\) "
                                           r"of expert ids in \[0, 4\)"):
        prompt_passes(dataclasses.replace(trace, meta={**trace.meta, "recording": recording}), "t.parquet")


# ----------------------------------------------------------------- drafter trees
def test_trees_wider_than_sixteen_alternatives_are_drafted(tmp_path):
    out = tmp_path / "wide.parquet"
    result = invoke("traces", "synth", "--shape", "olmoe-1b-7b", "--tokens", 3, "--tree-width", 20, "--tree-depth", 2,
                    "--out", out, "--json")
    assert result.exit_code == 0, result.output
    nodes = pq.read_table(out, columns=["cycle", "depth"]).to_pandas()
    assert (nodes.groupby("cycle").size() == 1 + 20 + 20 * 20).all()
    assert invoke("traces", "validate", out).exit_code == 0
    routed = invoke("traces", "import-routing", routing_log(tmp_path / "log.npz"), "--tree-width", 20,
                    "--tree-depth", 2, "--out", tmp_path / "imported.parquet", "--json")
    assert routed.exit_code == 0, routed.output


@pytest.mark.parametrize("width, depth", [(16, 200), (300, 7), (182, 2)])
def test_trees_with_more_nodes_than_int16_ids_are_refused_before_any_work(tmp_path, width, depth):
    log = routing_log(tmp_path / "log.npz")
    for command in (["traces", "synth", "--shape", "olmoe-1b-7b", "--tokens", 4],
                    ["traces", "import-routing", log]):
        line = one_line_error(invoke(*command, "--tree-width", width, "--tree-depth", depth, "--out",
                                     tmp_path / "t.parquet"), "--tree-width", "--tree-depth", "at most 32768")
        assert str(1 + width + (depth - 1) * width ** 2) in line
    assert not (tmp_path / "t.parquet").exists()


def test_the_largest_tree_that_int16_ids_number_is_accepted():
    from specfit.traces.drafter import MAX_TREE_NODES, DrafterParams

    assert DrafterParams(width=1, depth=MAX_TREE_NODES - 1).tree_nodes == MAX_TREE_NODES
    with pytest.raises(ValueError, match="--tree-depth"):
        DrafterParams(width=1, depth=MAX_TREE_NODES)


# ----------------------------------------------------------------- options
@pytest.mark.parametrize("command", ["synth", "import-routing"])
def test_a_negative_seed_is_refused_naming_the_option(tmp_path, command):
    argv = ["traces", "synth", "--shape", "olmoe-1b-7b", "--tokens", 4] if command == "synth" else \
        ["traces", "import-routing", routing_log(tmp_path / "log.npz")]
    one_line_error(invoke(*argv, "--seed", -1, "--out", tmp_path / "t.parquet"),
                   "--seed: expected a non-negative integer, got -1")
    assert not (tmp_path / "t.parquet").exists()


@pytest.mark.parametrize("max_tokens", [0, -1])
def test_import_max_tokens_below_one_is_refused_naming_the_option(tmp_path, max_tokens):
    one_line_error(invoke("traces", "import-routing", routing_log(tmp_path / "log.npz"), "--max-tokens", max_tokens,
                          "--out", tmp_path / "t.parquet"), f"--max-tokens: expected >= 1 position, got {max_tokens}")
    assert invoke("traces", "import-routing", tmp_path / "log.npz", "--max-tokens", 1, "--json",
                  "--out", tmp_path / "t.parquet").exit_code == 0


# ----------------------------------------------------------------- routing logs
def test_a_directory_given_as_routing_log_is_named_a_directory(tmp_path):
    (tmp_path / "logs").mkdir()
    one_line_error(invoke("traces", "import-routing", tmp_path / "logs", "--out", tmp_path / "t.parquet"),
                   str(tmp_path / "logs"), "a directory, expected a routing log file")


@pytest.mark.parametrize("sequence_id, shown", [(np.array(["a", "a", "b", "b"]), "'a' in row 0"),
                                                (np.array([0, 0, 1.5, 1.5]), "1.5 in row 2"),
                                                (np.array([0, 0, np.nan, 1]), "null (NaN) in row 2")])
def test_npz_sequence_ids_that_are_not_integers_are_one_line(tmp_path, sequence_id, shown):
    log = tmp_path / "log.npz"
    np.savez(log, expert_ids=np.tile(np.arange(8), (4, 16, 1)), sequence_id=sequence_id)
    one_line_error(invoke("traces", "import-routing", log, "--out", tmp_path / "t.parquet"), str(log),
                   "array 'sequence_id' must hold integer sequence ids", shown)


def test_npz_token_indices_that_are_not_integers_are_one_line(tmp_path):
    log = tmp_path / "log.npz"
    np.savez(log, expert_ids=np.tile(np.arange(8), (4, 16, 1)), sequence_id=np.zeros(4, np.int32),
             generated_token_index=np.array([0, 1, np.nan, 3]))
    one_line_error(invoke("traces", "import-routing", log, "--out", tmp_path / "t.parquet"), str(log),
                   "array 'generated_token_index' must hold integer token indices", "null (NaN) in row 2")


@pytest.mark.parametrize("field, value, expected", [
    ("token_index", float("nan"), "field 'token_index' must hold integer token indices, got null (NaN) in row 2"),
    ("token_index", 2.5, "field 'token_index' must hold integer token indices, got 2.5 in row 2"),
    ("sequence_id", None, "field 'sequence_id' must hold integer sequence ids, got null (NaN) in row 2"),
    ("sequence_id", "x", "field 'sequence_id' must hold integer sequence ids, got 'x' in row 2"),
    # pandas would read these as 0 and 2 in a column of numbers
    ("sequence_id", "0", "field 'sequence_id' must hold integer sequence ids, got '0' in row 2"),
    ("token_index", True, "field 'token_index' must hold integer token indices, got True in row 2"),
])
def test_jsonl_ids_that_are_null_nan_or_not_integers_are_named(tmp_path, field, value, expected):
    log = write_jsonl(tmp_path / "log.jsonl", token_records(**{"2": {field: value}}))
    result = invoke("traces", "import-routing", log, "--out", tmp_path / "t.parquet")
    one_line_error(result, str(log), expected)
    assert "RuntimeWarning" not in result.output and "skips" not in result.output


def test_a_missing_layer_record_names_sequence_and_token_as_plain_numbers(tmp_path):
    records = [{"sequence_id": 0, "token_index": t, "layer": layer, "experts": [0, 1]}
               for t in range(6) for layer in range(2) if (t, layer) != (5, 1)]
    log = write_jsonl(tmp_path / "log.jsonl", records)
    line = one_line_error(invoke("traces", "import-routing", log, "--out", tmp_path / "t.parquet"), str(log),
                          "sequence 0, token 5 has 1 layer records; expected 2")
    assert "np." not in line


def test_whole_float_ids_are_still_read(tmp_path):
    log = write_jsonl(tmp_path / "log.jsonl", token_records(**{"0": {"token_index": 0.0}}))
    from specfit.traces.routing_logs import read_routing_log

    read = read_routing_log(log)
    assert read.sequence.dtype == np.int64 and read.sequence.tolist() == [0, 0, 0, 0]


def test_validation_names_parent_for_a_node_that_is_its_own_parent():
    t = hand_trace()
    parent = t.parent.copy()
    parent[3] = 3                       # cycle 0, node 3 points at itself
    with pytest.raises(SpecFitError, match="column 'parent' must point to an earlier node"):
        validate_trace(dataclasses.replace(t, parent=parent))


def test_validation_refuses_router_weights_where_the_experts_are_unknown():
    t = hand_trace()
    meta = copy.deepcopy(t.meta)
    meta["recording"]["position_indexed"] = False      # a live trace: unknown experts are allowed
    true = t.true_experts.copy()
    true[7] = -1
    weights = np.ones(true.shape, dtype=np.float32)     # ... but not a weight for them
    with pytest.raises(SpecFitError, match="true_expert_weights' is set where 'true_experts' is unknown"):
        validate_trace(dataclasses.replace(t, meta=meta, true_experts=true, true_expert_weights=weights))


@pytest.mark.parametrize("value", [np.inf, -np.inf, -0.25, np.nan])
@pytest.mark.parametrize("slot", [(0, 0), (1, 3), (-1, -1)])
def test_validation_refuses_a_known_rows_weight_that_is_not_finite_and_non_negative(value, slot):
    """Any slot of a row with a weight set: not only the first (an unknown row is NaN in every
    slot). A NaN in the first slot of a row whose others are set is refused too (the row was taken
    as unknown by its first slot, passed, and a rewrite lost its weights)."""
    from specfit.traces.drafter import DrafterParams
    from specfit.traces.synth import synthesize

    t = synthesize("olmoe-1b-7b", "chat", 6, seed=0, sequence_tokens=6, drafter=DrafterParams(width=2, depth=2))
    weights = np.full(t.true_experts.shape, 0.125, dtype=np.float32)
    validate_trace(dataclasses.replace(t, true_expert_weights=weights))
    if slot == (0, 0) and np.isnan(value):
        whole = weights.copy()
        whole[4] = np.nan                                       # the whole row unknown: allowed
        validate_trace(dataclasses.replace(t, true_expert_weights=whole))
    weights[4][slot] = value
    with pytest.raises(SpecFitError, match="'true_expert_weights' must hold finite, non-negative router weights"):
        validate_trace(dataclasses.replace(t, true_expert_weights=weights))


def test_validation_requires_each_sequence_to_start_at_position_0():
    t = hand_trace()
    with pytest.raises(SpecFitError, match="must list positions 0, 1, 2"):
        validate_trace(dataclasses.replace(t, sequence=np.array([0, 0, 1], dtype=np.int32),
                                           position=np.array([0, 1, 1], dtype=np.int32)))


def test_validation_refuses_an_accepted_token_past_the_reference():
    t = hand_trace()
    verdict = t.verdict.copy()
    verdict[6] = 50                     # the last position accepts its draft 50; no reference token follows
    with pytest.raises(SpecFitError, match="cycle 2 accepts 1 draft tokens but only 0 reference tokens"):
        validate_trace(dataclasses.replace(t, verdict=verdict))


def test_validation_refuses_a_prefill_expert_id_equal_to_n_experts():
    t = hand_trace()
    meta = copy.deepcopy(t.meta)
    meta["recording"].update(prefill_sequences=[0], prefill_experts=[[[4]]])   # 4 experts: ids 0..3
    with pytest.raises(SpecFitError, match="prefill_experts"):
        validate_trace(dataclasses.replace(t, meta=meta))


def test_a_gap_in_the_cycle_numbers_is_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from specfit.traces.format import read_trace, write_trace

    table = pq.read_table(write_trace(hand_trace(), tmp_path / "good.parquet"))
    cycle = table.column("cycle").to_numpy()
    table = table.set_column(table.column_names.index("cycle"), "cycle",
                             pa.array(np.where(cycle >= 1, cycle + 1, cycle).astype(np.int32)))   # 0, 2, 3
    pq.write_table(table, tmp_path / "gap.parquet")
    with pytest.raises(SpecFitError, match="column 'cycle' must number cycles 0, 1, 2"):
        read_trace(tmp_path / "gap.parquet")


def test_validation_finds_a_repeated_expert_in_a_model_of_more_than_128_experts():
    t = hand_trace()
    meta = copy.deepcopy(t.meta)
    meta["model"].update(n_experts=200, top_k=2)
    first = t.true_experts[..., 0].astype(np.int64)
    true = np.stack([first + 150, first + 160], axis=-1).astype(np.int16)     # [8, 1, 2], ids above 128
    validate_trace(dataclasses.replace(t, meta=meta, true_experts=true))         # distinct: valid
    true[5, 0, 1] = true[5, 0, 0]
    with pytest.raises(SpecFitError, match=r"repeats an expert within one layer's top-k \(cycle 1, node 1\)"):
        validate_trace(dataclasses.replace(t, meta=meta, true_experts=true))


def test_node_ids_that_do_not_number_each_cycle_from_the_root_are_refused(tmp_path):
    table = pq.read_table(write_trace(hand_trace(), tmp_path / "good.parquet"))
    node = table.column("node").to_numpy().copy()
    node[1], node[2] = node[2], node[1]                 # cycle 0 numbered 0, 2, 1, 3
    table = table.set_column(table.column_names.index("node"), "node", pa.array(node.astype(np.int16)))
    pq.write_table(table, tmp_path / "swapped.parquet")
    with pytest.raises(SpecFitError, match="column 'node' must number each cycle's rows"):
        read_trace(tmp_path / "swapped.parquet")


def _damaged(tmp_path, name: str, make):
    """The hand trace's file with column ``name`` replaced by ``make(table)`` (added where absent)."""
    table = pq.read_table(write_trace(hand_trace(), tmp_path / "good.parquet"))
    column = make(table)
    if name in table.column_names:
        table = table.set_column(table.column_names.index(name), name, column)
    else:
        table = table.append_column(name, column)
    path = tmp_path / f"bad-{name}.parquet"
    pq.write_table(table, path)
    return path


def _with(table, name, index, value, dtype):
    values = table.column(name).to_numpy().astype(dtype)
    values[index] = value
    return pa.array(values)


def _experts_with(table, value):
    lists = table.column("true_experts").combine_chunks()
    values = lists.values.to_numpy(zero_copy_only=False).astype(np.int32)
    values[0] = value
    return pa.FixedSizeListArray.from_arrays(pa.array(values), lists.type.list_size)


def _experts_with_a_null_slot(table, row):
    lists = table.column("true_experts").combine_chunks()
    values = lists.values.to_numpy(zero_copy_only=False)
    slot = row * lists.type.list_size
    return pa.FixedSizeListArray.from_arrays(pa.array(values, mask=np.arange(values.size) == slot), lists.type.list_size)


@pytest.mark.parametrize("name, make, needle", [
    # wider integers than the reader's types: wrapped, 65536 read as parent 0 and was accepted
    ("parent", lambda t: _with(t, "parent", 3, 65536, np.int32),
     "column 'parent' holds 65536; expected values from -32768 to 32767 (int16)"),
    ("token", lambda t: _with(t, "token", 1, 2 ** 32 + 11, np.int64), "column 'token' holds 4294967307"),
    ("true_experts", lambda t: _experts_with(t, 65537), "column 'true_experts' holds 65537"),
    # a written row whose first id is negative read as an unknown row, its other ids unchecked
    ("true_experts", lambda t: _experts_with(t, -1), "column 'true_experts' holds a negative expert id in row 0"),
    # a null slot in a written row read as expert 0, and was accepted
    ("true_experts", lambda t: _experts_with_a_null_slot(t, 2),
     "column 'true_experts' has a null slot in row 2, a row that is not null"),
    # a per-cycle column read from the cycle's first row: a second value on another row went unseen
    ("sequence", lambda t: _with(t, "sequence", 1, 3, np.int32),
     "column 'sequence' differs between the rows of cycle 0; expected one value per cycle"),
    # optional columns of another type: a raw pyarrow or numpy exception, or NaN taken as a time
    ("measured_time_s", lambda t: pa.array(["1.5"] * t.num_rows), "column 'measured_time_s' must hold numbers, got string"),
    ("measured_time_s", lambda t: pa.array([float("nan")] * t.num_rows),
     "column 'measured_time_s' holds 8 null or non-finite value(s)"),
    ("verified", lambda t: pa.array(np.ones(t.num_rows, dtype=np.int64)), "column 'verified' must hold booleans, got int64"),
])
def test_a_trace_column_the_reader_would_misread_is_one_line(tmp_path, name, make, needle):
    bad = _damaged(tmp_path, name, make)
    with pytest.raises(SpecFitError, match=None) as refused:
        read_trace(bad)
    assert str(bad) in str(refused.value) and needle in str(refused.value)
    one_line_error(invoke("traces", "validate", bad), str(bad), needle)


def test_a_traces_nodes_frame_marks_unknown_verdicts():
    trace = hand_trace()
    trace.verdict[1] = -1
    frame = trace.nodes_frame()
    assert frame["verdict"].isna().tolist() == (~trace.verdict_known).tolist() and frame["verdict"].isna().iloc[1]
    assert frame["verdict"].dropna().tolist() == trace.verdict[trace.verdict_known].tolist()


def test_a_routing_logs_token_past_the_models_vocabulary_is_named_before_any_work(tmp_path):
    # the import drew off-path tokens from the log's wider range, then the writer refused its own
    # trace, naming a synthesised node instead of the log's row
    log = tmp_path / "log.npz"
    tokens = np.arange(6) + 100
    tokens[4] = 60000                                  # olmoe-1b-7b's vocab_size is 50304
    np.savez(log, expert_ids=np.tile(np.arange(8), (6, 16, 1)), sequence_id=np.zeros(6, np.int32), token_id=tokens)
    one_line_error(invoke("traces", "import-routing", log, "--out", tmp_path / "t.parquet"), str(log),
                   "token id 60000 (sequence 0, its token 4) is not below the vocab_size 50304")
    assert not (tmp_path / "t.parquet").exists()
