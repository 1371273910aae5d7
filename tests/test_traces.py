"""Trace format (round trip, validation errors), synthetic traces and the routing-log importer."""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from specfit.cli import app
from specfit.errors import SpecFitError
from specfit.traces.drafter import DrafterParams
from specfit.traces.format import METADATA_KEY, read_trace, validate_trace, write_trace
from specfit.traces.importers import dump_jsonl, import_routing, model_for_log, read_routing_log
from specfit.traces.stats import consecutive_reuse, lru_hit_rates, set_overlap
from specfit.traces.synth import RoutingParams, synthesize

from trace_helpers import SAMPLE_QWEN3, hand_trace

ROOT = Path(__file__).resolve().parents[1]
OLMOE_LOG = ROOT.parent / "shared" / "data" / "olmoe-1b-7b-routing-general-coding.npz"
SMALL_DRAFTER = DrafterParams(width=3, depth=4)


@pytest.fixture(scope="module")
def small_synth():
    return synthesize("olmoe-1b-7b", "chat", 48, seed=3, sequence_tokens=24, drafter=SMALL_DRAFTER)


def test_round_trip_preserves_every_array(tmp_path, small_synth):
    path = write_trace(small_synth, tmp_path / "t.parquet")
    back = read_trace(path)
    for name in ("offsets", "sequence", "position", "parent", "depth", "token", "draft_logprob", "path_prob",
                 "verdict", "true_experts"):
        np.testing.assert_array_equal(getattr(back, name), getattr(small_synth, name), err_msg=name)
    assert back.meta["model"] == small_synth.meta["model"]
    assert back.meta["schema_version"] == 1
    # one row per node, readable as a plain table
    table = pq.read_table(path)
    assert table.num_rows == small_synth.n_nodes
    assert table.schema.field("true_experts").type.list_size == 16 * 8


@pytest.mark.parametrize("batch", [1, 5, 64, 1 << 13])
def test_per_slot_columns_read_a_batch_at_a_time_equal_what_was_written(tmp_path, small_synth, monkeypatch, batch):
    """Expert ids, predicted ids and router weights go into their arrays record batch by record
    batch; unknown rows (nulls) on either side of a batch's edge come back as -1 / NaN."""
    import specfit.traces.format as trace_format

    n = small_synth.n_nodes
    true = small_synth.true_experts.copy()
    unknown = np.zeros(n, dtype=bool)
    unknown[[0, 4, 5, 63, 64, n - 1]] = True
    true[unknown] = -1
    predicted = np.roll(small_synth.true_experts, 1, axis=0)
    predicted[[1, 5, 6]] = -1
    weights = np.random.default_rng(0).random(true.shape).astype(np.float32)
    weights[unknown] = np.nan
    meta = copy.deepcopy(small_synth.meta)
    meta["recording"]["position_indexed"] = False         # a recorded trace: unknown true experts allowed
    trace = replace(small_synth, meta=meta, true_experts=true, predicted_experts=predicted, true_expert_weights=weights)
    path = write_trace(trace, tmp_path / "t.parquet")
    monkeypatch.setattr(trace_format, "_BATCH", batch)
    back = read_trace(path, validate=False)
    np.testing.assert_array_equal(back.true_experts, true)
    np.testing.assert_array_equal(back.predicted_experts, predicted)
    np.testing.assert_array_equal(back.true_expert_weights, weights)        # NaN rows equal NaN rows
    assert back.true_experts.dtype == np.int16 and back.true_expert_weights.dtype == np.float32
    assert read_trace(path, weights=False).true_expert_weights is None


def test_unknown_values_round_trip_as_nulls(tmp_path):
    trace = hand_trace()
    trace.meta["recording"]["position_indexed"] = False
    trace.verdict[2] = -1
    trace.true_experts[2] = -1
    trace.predicted_experts = trace.true_experts.copy()
    trace.measured = {"measured_time_s": np.array([0.1, 0.2, 0.3])}
    back = read_trace(write_trace(trace, tmp_path / "t.parquet"))
    assert back.verdict[2] == -1 and not back.true_known[2] and back.true_known[[0, 1, 3]].all()
    np.testing.assert_array_equal(back.predicted_experts, trace.predicted_experts)
    np.testing.assert_allclose(back.measured["measured_time_s"], [0.1, 0.2, 0.3])
    assert pq.read_table(tmp_path / "t.parquet").column("verdict").null_count == 1


def test_metadata_is_strict_json_when_a_statistic_has_no_value(tmp_path):
    """A one-position trace has no consecutive pair: its reuse statistic is NaN in memory, null in
    the file (strict JSON readers refuse a bare NaN)."""
    trace = synthesize("olmoe-1b-7b", "chat", n_tokens=1, seed=0)
    assert np.isnan(trace.meta["statistics"]["consecutive_reuse"])
    write_trace(trace, tmp_path / "one.parquet")
    raw = pq.read_schema(tmp_path / "one.parquet").metadata[METADATA_KEY].decode()
    meta = json.loads(raw, parse_constant=lambda name: pytest.fail(f"{name} in the metadata"))
    assert meta["statistics"]["consecutive_reuse"] is None
    assert read_trace(tmp_path / "one.parquet").n_cycles == 1


def test_write_is_atomic_and_leaves_no_temp_files(tmp_path, small_synth):
    target = tmp_path / "t.parquet"
    write_trace(small_synth, target)
    bad = replace(small_synth, parent=small_synth.parent.copy())
    bad.parent[1] = 5   # a forward parent: invalid, nothing may be written
    with pytest.raises(SpecFitError):
        write_trace(bad, target)
    assert [p.name for p in tmp_path.iterdir()] == ["t.parquet"]
    assert read_trace(target).n_nodes == small_synth.n_nodes


def _rewrite(path: Path, out: Path, edit_table=None, edit_meta=None) -> Path:
    table = pq.read_table(path)
    meta = json.loads(table.schema.metadata[METADATA_KEY])
    if edit_meta:
        edit_meta(meta)
    if edit_table:
        table = edit_table(table)
    pq.write_table(table.replace_schema_metadata({METADATA_KEY: json.dumps(meta).encode()}), out)
    return out


def test_other_schema_version_is_one_clear_error(tmp_path, small_synth):
    src = write_trace(small_synth, tmp_path / "t.parquet")
    bad = _rewrite(src, tmp_path / "v2.parquet", edit_meta=lambda m: m.update(schema_version=2))
    with pytest.raises(SpecFitError, match=r"v2.parquet: schema_version 2 is not supported; expected 1"):
        read_trace(bad)
    unversioned = _rewrite(src, tmp_path / "none.parquet", edit_meta=lambda m: m.pop("schema_version"))
    with pytest.raises(SpecFitError, match=r"none.parquet: field 'schema_version' is missing; expected 1"):
        read_trace(unversioned)


def test_simulating_a_trace_that_is_not_position_indexed_names_its_file(tmp_path, small_synth):
    src = write_trace(small_synth, tmp_path / "t.parquet")
    bad = _rewrite(src, tmp_path / "live-only.parquet",
                   edit_meta=lambda m: m["recording"].update(position_indexed=False))
    r = CliRunner().invoke(app, ["simulate", "--trace", str(bad), "--policies", "ar", "--cache-experts", "4"])
    assert r.exit_code == 2 and r.output.strip().count("\n") == 0, r.output
    assert r.output.startswith(f"error: {bad}: counterfactual replay needs a position-indexed trace"), r.output


def test_missing_column_is_named(tmp_path, small_synth):
    src = write_trace(small_synth, tmp_path / "t.parquet")
    bad = _rewrite(src, tmp_path / "nov.parquet", edit_table=lambda t: t.drop_columns(["verdict"]))
    with pytest.raises(SpecFitError, match=r"nov.parquet: missing column\(s\) \['verdict'\]"):
        read_trace(bad)


def test_not_a_trace_and_missing_file(tmp_path):
    plain = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"x": [1, 2]}), plain)
    with pytest.raises(SpecFitError, match="missing the 'specfit.trace' metadata"):
        read_trace(plain)
    with pytest.raises(SpecFitError, match="no such trace file"):
        read_trace(tmp_path / "absent.parquet")
    (tmp_path / "folder.parquet").mkdir()
    with pytest.raises(SpecFitError, match="folder.parquet: a directory, expected a trace file"):
        read_trace(tmp_path / "folder.parquet")


@pytest.mark.parametrize("field, edit, message", [
    ("parent", lambda t: t.parent.__setitem__(1, 3), "must point to an earlier node"),
    ("depth", lambda t: t.depth.__setitem__(1, 2), "must equal the parent's depth"),
    ("path_prob", lambda t: t.path_prob.__setitem__(3, 0.99), "must not exceed the parent's path_prob"),
    ("true_experts", lambda t: t.true_experts.__setitem__((1, 0, 0), 9), r"expert ids in \[0, 4\)"),
    ("verdict", lambda t: t.verdict.__setitem__(0, 77), "must equal the root token of the next position"),
    ("token", lambda t: t.token.__setitem__(2, 11), "repeats a token among siblings"),
])
def test_validation_names_the_field(field, edit, message):
    trace = hand_trace()
    edit(trace)
    with pytest.raises(SpecFitError, match=message):
        validate_trace(trace, source="hand")


@pytest.mark.parametrize("field", ["token", "verdict"])
def test_ids_past_the_models_vocabulary_are_no_tokens_of_it(field):
    trace = hand_trace()
    vocab = int(max(trace.token.max(), trace.verdict.max())) + 1
    trace.meta["model"]["vocab_size"] = vocab
    validate_trace(trace, source="hand")                     # every id below it
    getattr(trace, field)[1] = vocab
    with pytest.raises(SpecFitError, match=f"hand: column '{field}' must hold token ids below the model's vocab_size "
                                           f"{vocab} \\(cycle 0, node 1\\)"):
        validate_trace(trace, source="hand")


def test_validation_names_the_node_that_repeats_an_expert_and_allows_equal_tokens_across_cycles():
    import copy

    trace = hand_trace()
    # a sibling group is one parent's children: the same (local parent, token) in two cycles is fine
    trace.token[5] = 11
    validate_trace(trace, source="hand")
    wide = copy.deepcopy(hand_trace())
    wide.meta["model"]["top_k"] = 2
    wide.true_experts = np.concatenate([wide.true_experts, (wide.true_experts + 1) % 4], axis=2)
    wide.predicted_experts = wide.true_experts.copy()
    validate_trace(wide, source="hand")
    wide.predicted_experts[5, 0, 1] = wide.predicted_experts[5, 0, 0]
    with pytest.raises(SpecFitError, match=r"'predicted_experts' repeats an expert .*\(cycle 1, node 1\)"):
        validate_trace(wide, source="hand")
    wide.true_experts[6, 0, 1] = 7     # an id out of range is reported before a repeat in another row
    with pytest.raises(SpecFitError, match=r"'true_experts' must hold expert ids in \[0, 4\) \(cycle 2, node 0\)"):
        validate_trace(wide, source="hand")


def test_synthetic_statistics_match_their_targets(small_synth):
    stats = small_synth.meta["statistics"]
    targets = small_synth.meta["parameters"]["targets"]
    assert abs(stats["consecutive_reuse"] - targets["consecutive_reuse"]) < 0.08
    assert abs(stats["popularity_skew"] - targets["popularity_skew"]) < 0.08
    assert abs(stats["sibling_reuse"] - targets["sibling_reuse"]) < 0.08
    # consecutive reuse claims slots first; token affinity gets what is left (see routing.py)
    assert 0.5 < stats["token_affinity"] <= targets["token_affinity"] + 0.05
    assert 1.5 < stats["full_tree_accepted_tokens"] < 3.5
    assert small_synth.meta["provenance"]["real"] == []


def test_sample_trace_is_eagle3_sized_with_modest_acceptance():
    trace = read_trace(SAMPLE_QWEN3)
    assert (trace.n_layers, trace.n_experts, trace.top_k) == (48, 128, 8)
    assert 55 <= trace.tree_sizes.mean() <= 65
    assert 2.0 <= trace.meta["statistics"]["full_tree_accepted_tokens"] <= 3.0   # EAGLE-3 on Qwen3-30B-A3B


def test_synth_is_deterministic_per_seed():
    a = synthesize("mixtral-8x7b", "code", 12, seed=5, sequence_tokens=12, drafter=SMALL_DRAFTER)
    b = synthesize("mixtral-8x7b", "code", 12, seed=5, sequence_tokens=12, drafter=SMALL_DRAFTER)
    np.testing.assert_array_equal(a.true_experts, b.true_experts)
    np.testing.assert_array_equal(a.token, b.token)


def test_synth_rejects_unknown_shape_and_workload():
    with pytest.raises(SpecFitError, match="--shape: unknown model shape 'gpt2'"):
        synthesize("gpt2", "chat", 10)
    with pytest.raises(SpecFitError, match="--workload: unknown workload 'poetry'"):
        synthesize("olmoe-1b-7b", "poetry", 10)


def test_jsonl_log_reads_like_the_npz_layout(tmp_path):
    rng = np.random.default_rng(0)
    experts = np.stack([rng.permutation(64)[:8] for _ in range(2 * 16 * 6)]).reshape(12, 16, 8)
    from specfit.traces.importers import RoutingLog

    log = RoutingLog(experts, rng.integers(0, 1000, 12), np.repeat([4, 2], 6), "mem")
    dump_jsonl(log, tmp_path / "log.jsonl")
    back = read_routing_log(tmp_path / "log.jsonl")
    np.testing.assert_array_equal(back.experts, experts)
    np.testing.assert_array_equal(back.sequence, log.sequence)
    trace = import_routing(back, model_for_log(back, None), drafter=SMALL_DRAFTER)
    assert trace.n_cycles == 10   # two sequences of 6 tokens: 5 positions each
    (tmp_path / "bad.jsonl").write_text('{"sequence_id": 0, "layer": 0}\n')
    with pytest.raises(SpecFitError, match="records miss field"):
        read_routing_log(tmp_path / "bad.jsonl")


@pytest.mark.skipif(not OLMOE_LOG.exists(), reason="the shared OLMoE routing log is not available")
def test_importer_keeps_real_experts_on_the_reference_path():
    log = read_routing_log(OLMOE_LOG)
    first = np.unique(log.sequence)[:2]
    log = log.select(np.flatnonzero(np.isin(log.sequence, first)))
    trace = import_routing(log, model_for_log(log, None), drafter=SMALL_DRAFTER, max_tokens=60)
    validate_trace(trace, source="imported")
    assert trace.model["name"] == "olmoe-1b-7b"
    assert "experts of the reference tokens" in trace.meta["provenance"]["real"][1]
    roots = trace.offsets[:-1]
    rows = np.flatnonzero(log.sequence == first[0])
    np.testing.assert_array_equal(trace.true_experts[roots[:10]], log.experts[rows[:10]])
    np.testing.assert_array_equal(trace.token[roots[:10]], log.tokens[rows[:10]])
    # the off-path nodes' routing is calibrated to the log's own temporal reuse
    real = float(np.mean(consecutive_reuse(log.experts, log.sequence)))
    assert abs(trace.meta["statistics"]["consecutive_reuse"] - real) < 0.1


@pytest.mark.skipif(not OLMOE_LOG.exists(), reason="the shared OLMoE routing log is not available")
def test_synthetic_routing_is_close_to_real_routing_in_lru_hit_rate():
    log = read_routing_log(OLMOE_LOG)
    rows = np.flatnonzero(np.isin(log.sequence, np.unique(log.sequence)[:8]))
    real = lru_hit_rates(log.experts[rows], 64, [16, 32])
    trace = synthesize("olmoe-1b-7b", "chat", 8 * 64, seed=0, sequence_tokens=64, drafter=DrafterParams(width=1, depth=1))
    synth = lru_hit_rates(trace.true_experts[trace.offsets[:-1]].astype(np.int64), 64, [16, 32])
    for c in (16, 32):
        assert abs(real[c] - synth[c]) < 0.1, (c, real[c], synth[c])


def test_set_overlap_counts_shared_experts():
    a = np.array([[[1, 2, 3, 4]]])
    b = np.array([[[4, 3, 9, 8]]])
    assert set_overlap(a, b)[0, 0] == 0.5


def test_cli_synth_validate_inspect(tmp_path):
    runner = CliRunner()
    out = tmp_path / "s.parquet"
    r = runner.invoke(app, ["traces", "synth", "--shape", "olmoe-1b-7b", "--tokens", "12", "--sequence-tokens", "12",
                            "--tree-width", "2", "--tree-depth", "3", "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    assert "consecutive_reuse" in json.loads(r.stdout)
    r = runner.invoke(app, ["traces", "validate", str(out)])
    assert r.exit_code == 0 and "valid schema-1 position-indexed trace, 12 cycles" in r.stdout
    r = runner.invoke(app, ["traces", "inspect", str(out), "--json"])
    summary = json.loads(r.stdout)
    assert summary["cycles"] == 12 and summary["by_depth"][0]["union_experts_per_layer"] == 8.0


def test_cli_bad_input_is_one_line_and_exit_code_2(tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ["traces", "validate", str(tmp_path / "absent.parquet")])
    assert r.exit_code == 2
    assert r.output.strip().count("\n") == 0 and "no such trace file" in r.output
    r = runner.invoke(app, ["traces", "synth", "--shape", "bert", "--tokens", "4", "--out", str(tmp_path / "x.parquet")])
    assert r.exit_code == 2 and "Traceback" not in r.output and "unknown model shape" in r.output


def test_synth_help_gives_each_workloads_drafter_defaults():
    from typer.testing import CliRunner

    from specfit.cli import app
    from specfit.traces.synth import WORKLOADS

    text = " ".join(CliRunner().invoke(app, ["traces", "synth", "--help"], terminal_width=200).output.split())
    for name, params in WORKLOADS.items():
        assert f"{name} {params.top1_prob:g}" in text and f"{name} {params.depth_decay:g}" in text
    assert {p.calibration_exponent for p in WORKLOADS.values()} == {1.15} and "default 1.15" in text


def test_a_trace_of_more_than_256_experts_round_trips(tmp_path):
    from specfit.traces.format import read_trace, write_trace

    t = hand_trace()
    meta = copy.deepcopy(t.meta)
    meta["model"]["n_experts"] = 300
    true = (t.true_experts + 296).astype(np.int16)          # ids 296..299 need 9 bits
    back = read_trace(write_trace(dataclasses.replace(t, meta=meta, true_experts=true), tmp_path / "t.parquet"))
    np.testing.assert_array_equal(back.true_experts, true)


def test_synthetic_nodes_on_the_reference_path_route_like_the_reference_tokens():
    from specfit.experts.calibration import accepted_nodes
    from specfit.traces.drafter import DrafterParams
    from specfit.traces.synth import synthesize

    trace = synthesize("olmoe-1b-7b", "chat", 48, seed=3, sequence_tokens=24, drafter=DrafterParams(width=3, depth=4))
    on = np.flatnonzero(accepted_nodes(trace) & (trace.parent >= 0))
    assert on.size > 20
    cycle, depth = trace.cycle_of_node[on], trace.depth[on].astype(np.int64)
    # a position-indexed trace: the node d levels down the accepted path is the root d positions on
    np.testing.assert_array_equal(trace.true_experts[on], trace.true_experts[trace.offsets[cycle + depth]])


@pytest.mark.parametrize("dtype", [np.int16, np.int64])
def test_pair_overlap_equals_the_overlap_of_the_gathered_rows(dtype):
    """The compiled count against set_overlap's comparison of every slot pair, unknown (-1) rows
    and repeated pairs included."""
    from specfit.traces.stats import pair_overlap

    rng = np.random.default_rng(4)
    experts = np.stack([rng.permutation(16)[:4] for _ in range(300)]).reshape(100, 3, 4).astype(dtype)
    experts[[5, 17]] = -1
    i, j = rng.integers(0, 100, 250), rng.integers(0, 100, 250)
    i[:3], j[:3] = 5, 17
    np.testing.assert_array_equal(pair_overlap(experts, i, j), set_overlap(experts[i], experts[j]))
    assert pair_overlap(experts, i[:0], j[:0]).shape == (0, 3)


def test_a_zipf_exponent_of_zero_is_uniform_and_allowed_but_a_negative_one_is_refused():
    params = RoutingParams(popularity_zipf=0.0, token_zipf=0.0)
    assert params.popularity_zipf == 0.0 and params.token_zipf == 0.0
    for name in ("popularity_zipf", "token_zipf"):
        with pytest.raises(SpecFitError, match="Zipf exponent"):
            RoutingParams(**{name: -0.1})


def test_positions_beyond_the_last_full_sequence_form_a_shorter_last_sequence():
    trace = synthesize("olmoe-1b-7b", "chat", 7, seed=1, sequence_tokens=3, drafter=SMALL_DRAFTER)
    assert trace.n_cycles == 7                                   # every position has its cycle
    assert trace.sequence.tolist() == [0, 0, 0, 1, 1, 1, 2]      # 3 + 3 + 1
    assert trace.position.tolist() == [0, 1, 2, 0, 1, 2, 0]


class _MarkerRouting:
    """A routing model whose next-token experts are all 7 and whose sibling experts are the true next
    token's plus 1000, so each node's experts say which rule of build_trees routed it, from what."""

    def next_token(self, previous, tokens, rng):
        return np.full((len(tokens),) + previous.shape[1:], 7, dtype=np.int64)

    def sibling(self, true_next, tokens, rng):
        return np.asarray(true_next, dtype=np.int64) + 1000


def test_a_node_carrying_its_parents_true_next_token_routes_like_it_and_other_off_path_nodes_as_siblings():
    from specfit.traces.routing import TokenSampler
    from specfit.traces.synth import build_trees

    rng = np.random.default_rng(0)
    tokens = TokenSampler(6, 1.0, rng)                  # a tiny vocabulary: drafts often hit the verdict
    ref_tok = [tokens.sample(13, rng)]
    ref_exp = [np.repeat(100 + np.arange(13), 2).reshape(13, 2, 1)]   # position t's reference experts: 100 + t
    arrays = build_trees(ref_tok, ref_exp, _MarkerRouting(), DrafterParams(width=3, depth=4), tokens, rng)
    parent, depth, token, verdict = arrays["parent"], arrays["depth"], arrays["token"], arrays["verdict"]
    experts = arrays["true_experts"][:, 0, 0].astype(np.int64)
    offsets = arrays["offsets"]
    seen = {"on_path": 0, "next_of_off_path_parent": 0, "sibling_at_on_path_parent": 0, "sibling": 0}
    for c in range(offsets.size - 1):
        lo, pos = int(offsets[c]), int(arrays["position"][c])
        assert experts[lo] == 100 + pos                                   # the root: the reference's
        for v in range(lo + 1, int(offsets[c + 1])):
            p = lo + int(parent[v])
            p_on_path = 100 <= experts[p] < 1000
            true_next = 100 + pos + depth[v] if p_on_path else 7          # the true next token's experts at p
            if token[v] == verdict[p]:                                    # v carries the true next token
                assert experts[v] == true_next, (c, v)
                seen["on_path" if p_on_path else "next_of_off_path_parent"] += 1
            else:                                                         # a sibling of the true next token
                assert experts[v] == true_next + 1000, (c, v)
                seen["sibling_at_on_path_parent" if p_on_path else "sibling"] += 1
    assert min(seen.values()) > 0, seen                                   # every rule was exercised


@pytest.mark.parametrize("n_tokens, sequence_tokens, option", [(4, 0, "--sequence-tokens"), (0, 4, "--tokens")])
def test_synthesis_refuses_sequences_of_no_position_naming_the_option(n_tokens, sequence_tokens, option):
    with pytest.raises(SpecFitError, match=f"^{option}: expected at least 1 position"):
        synthesize("olmoe-1b-7b", "chat", n_tokens, sequence_tokens=sequence_tokens, drafter=SMALL_DRAFTER)


def test_synthesis_makes_sequences_of_one_position_as_an_import_does():
    t = synthesize("olmoe-1b-7b", "chat", 4, sequence_tokens=1, drafter=SMALL_DRAFTER)
    assert t.sequence.tolist() == [0, 1, 2, 3] and t.position.tolist() == [0, 0, 0, 0]


def test_expert_ids_above_127_of_a_model_with_up_to_256_experts_round_trip(tmp_path):
    t = hand_trace()
    meta = copy.deepcopy(t.meta)
    meta["model"].update(n_experts=256, top_k=2)
    first = t.true_experts[..., 0].astype(np.int64)
    true = np.stack([first + 200, first + 252], axis=-1).astype(np.int16)    # ids 200..255
    t = dataclasses.replace(t, meta=meta, true_experts=true)
    back = read_trace(write_trace(t, tmp_path / "wide.parquet"))
    np.testing.assert_array_equal(back.true_experts, true)


def test_unknown_router_weight_rows_read_back_as_nan(tmp_path):
    t = hand_trace()
    weights = np.full(t.true_experts.shape, 0.5, dtype=np.float32)
    weights[[2, 7]] = np.nan                            # two nodes whose router weights were not logged
    back = read_trace(write_trace(dataclasses.replace(t, true_expert_weights=weights), tmp_path / "w.parquet"))
    assert np.isnan(back.true_expert_weights[[2, 7]]).all()
    np.testing.assert_array_equal(np.delete(back.true_expert_weights, [2, 7], axis=0), np.full((6, 1, 1), 0.5))


def test_inspect_and_synth_print_a_bracketed_file_name_verbatim(tmp_path):
    trace = tmp_path / "chat[v2].parquet"       # "[v2]" would be read as a rich tag and vanish
    r = CliRunner().invoke(app, ["traces", "synth", "--shape", "olmoe-1b-7b", "--tokens", "64", "--out", str(trace)])
    assert r.exit_code == 0, r.output
    assert f"{trace.name}: 64 positions" in r.output
    r = CliRunner().invoke(app, ["traces", "inspect", str(trace)])
    assert r.exit_code == 0, r.output
    assert trace.name in r.output


def test_inspect_shows_the_trees_behind_each_acceptance_rate_and_whole_numbers_whole(tmp_path):
    from specfit.traces.stats import accepted_lengths

    trace = read_trace(SAMPLE_QWEN3)
    lengths = accepted_lengths(trace)
    r = CliRunner().invoke(app, ["traces", "inspect", str(SAMPLE_QWEN3)])
    assert r.exit_code == 0, r.output
    rows = {}
    for line in r.output.split("By draft depth")[1].splitlines():
        cells = [c.strip() for c in line.strip("│").split("│")]
        if line.startswith("│") and cells[0].isdigit():
            rows[int(cells[0])] = cells
    assert sorted(rows) == list(range(int(trace.depth.max()) + 1))
    for d, (_, _, trees, rate, _) in rows.items():
        reached = int((lengths >= d - 1).sum()) if d else trace.n_cycles
        assert int(trees) == reached
        if d:
            assert rate == f"{(lengths >= d).sum() / max(1, reached):.3f}"
    nodes = next(line for line in r.output.splitlines() if "│ nodes_per_tree" in line).split("│")[2].strip()
    mean = trace.tree_sizes.mean()
    assert nodes == (str(int(mean)) if float(mean).is_integer() else f"{mean:.3f}")
