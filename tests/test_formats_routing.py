"""Routing-log layouts of issue 16 for ``specfit traces import-routing``: per-sequence npz logs
without token ids, router weights kept in the trace, JSONL and Parquet logs with one record per
token and layer (either order) or per token, sequence boundaries and generated-token indices."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner
from core_helpers import find_shared_data

from specfit.cli import app
from specfit.errors import SpecFitError
from specfit.traces.drafter import DrafterParams
from specfit.traces.format import read_trace, validate_trace, write_trace
from specfit.traces.importers import import_routing, model_for_log, model_from_config, read_routing_log

L, K, E = 16, 8, 64                      # OLMoE-1B-7B's routing shape: the importer infers its model shape
SMALL_DRAFTER = DrafterParams(width=2, depth=3)
OLMOE_LOG = find_shared_data("olmoe-1b-7b-routing-general-coding.npz")
runner = CliRunner()


def _routing(n_tokens: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(E)[:K] for _ in range(n_tokens * L)]).reshape(n_tokens, L, K)


def _weights(experts: np.ndarray, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = np.sort(rng.dirichlet(np.ones(E), size=experts.shape[:2])[..., :K], axis=-1)[..., ::-1]
    return w.astype(np.float16)      # what the OLMoE recorder stores


LENGTHS = {"problem0": 9, "problem2": 6, "problem10": 7}   # numeric, not lexical, order: 0, 2, 10


@pytest.fixture()
def per_sequence_npz(tmp_path):
    arrays = {key: _routing(n, seed).astype(np.int8) for seed, (key, n) in enumerate(LENGTHS.items())}
    path = tmp_path / "routing.npz"
    np.savez(path, **{key: arrays[key] for key in ("problem10", "problem0", "problem2")})
    return path, arrays


# ----------------------------------------------------------------------------- per-sequence npz
def test_per_sequence_npz_without_token_ids_imports_directly(per_sequence_npz):
    path, arrays = per_sequence_npz
    log = read_routing_log(path)
    assert log.layout == "npz-per-sequence" and not log.token_ids_known and log.weights is None
    expected = np.concatenate([arrays[k] for k in ("problem0", "problem2", "problem10")]).astype(np.int64)
    np.testing.assert_array_equal(log.experts, expected)
    np.testing.assert_array_equal(np.unique(log.sequence, return_index=True)[0], [0, 2, 10])
    model = model_for_log(log, None)
    assert model["name"] == "olmoe-1b-7b"
    trace = import_routing(log, model, drafter=SMALL_DRAFTER)
    validate_trace(trace, source="imported")
    assert trace.n_cycles == sum(n - 1 for n in LENGTHS.values())
    recording = trace.meta["recording"]
    assert recording["token_ids"] == "synthesised" and recording["unfittable_predictors"] == ["affinity"]
    assert "reference tokens (the log has no token ids)" in trace.meta["provenance"]["synthesised"]
    assert "reference tokens" not in trace.meta["provenance"]["real"]
    # the committed path is the log's real routing, sequence by sequence
    roots = trace.offsets[:-1]
    starts = np.r_[0, np.cumsum([n for n in (9, 6, 7)])]
    for s, key in enumerate(("problem0", "problem2", "problem10")):
        mine = roots[trace.sequence == s]
        np.testing.assert_array_equal(trace.true_experts[mine], arrays[key][:-1])
        assert mine.size == LENGTHS[key] - 1 and starts[s + 1] - starts[s] == LENGTHS[key]


def test_cli_imports_a_per_sequence_log_and_says_what_cannot_be_fitted(per_sequence_npz, tmp_path):
    path, _ = per_sequence_npz
    out = tmp_path / "trace.parquet"
    result = runner.invoke(app, ["traces", "import-routing", str(path), "--out", str(out), "--tree-width", "2",
                                 "--tree-depth", "2"])
    assert result.exit_code == 0, result.output
    assert "no token ids" in result.stdout and "(affinity) cannot be fitted" in result.stdout
    assert "3 sequences of the log, numbered 0-2 in the trace" in result.stdout
    trace = read_trace(out)
    assert trace.meta["recording"]["layout"] == "npz-per-sequence"
    assert trace.meta["recording"]["source_sequence_ids"] == [0, 2, 10]


def test_an_import_shows_its_sibling_reuse_target_and_says_when_it_is_not_reached(per_sequence_npz, tmp_path):
    """The table's target column held nothing for an import (its targets were not stored), and a
    --sibling-reuse the routing model cannot reach passed without a word."""
    import re

    path, _ = per_sequence_npz
    noted = []
    for target in ("0.0", "0.3", "1.0"):
        result = runner.invoke(app, ["traces", "import-routing", str(path), "--out", str(tmp_path / f"{target}.parquet"),
                                     "--tree-width", "2", "--tree-depth", "2", "--sibling-reuse", target])
        assert result.exit_code == 0, result.output
        row = next(line for line in result.stdout.splitlines() if "sibling_reuse" in line and "│" in line)
        assert f"{float(target):.3f}" in row
        measured = float(re.findall(r"\d\.\d{3}", row)[-1])
        assert ("note: sibling_reuse measured" in result.stdout) == (abs(measured - float(target)) > 0.05), measured
        noted.append("note: sibling_reuse measured" in result.stdout)
    assert noted[0] or noted[2]                 # 0 or 1 is beyond what any shape's routing reaches


def test_model_config_gives_the_shape_of_moe_layers(per_sequence_npz, tmp_path):
    path, _ = per_sequence_npz
    config = {"architectures": ["Qwen2MoeForCausalLM"], "hidden_size": 64, "num_hidden_layers": 17,
              "num_attention_heads": 4, "num_key_value_heads": 4, "num_experts": E, "num_experts_per_tok": K, "moe_intermediate_size": 32,
              "shared_expert_intermediate_size": 48, "intermediate_size": 80, "mlp_only_layers": [3],
              "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 256, "vocab_size": 500}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = model_from_config(tmp_path / "config.json")
    assert (model["n_layers"], model["n_experts"], model["top_k"]) == (L, E, K)    # 17 layers, one dense
    assert model["expert_bytes"] == 3 * 32 * 64 * 2 and model["vocab_size"] == 500
    out = tmp_path / "t.parquet"
    result = runner.invoke(app, ["traces", "import-routing", str(path), "--out", str(out), "--model", str(tmp_path),
                                 "--tree-width", "2", "--tree-depth", "2", "--json"])
    assert result.exit_code == 0, result.output
    assert read_trace(out).model["name"] == tmp_path.name
    both = runner.invoke(app, ["traces", "import-routing", str(path), "--out", str(out), "--model", str(tmp_path),
                               "--shape", "olmoe-1b-7b"])
    assert both.exit_code == 2 and "pass --shape or --model, not both" in both.output
    # experts offloaded in float32 (a CPU decode) are twice bf16's bytes
    fp32 = runner.invoke(app, ["traces", "import-routing", str(path), "--out", str(out), "--model", str(tmp_path),
                               "--dtype", "float32", "--tree-width", "2", "--tree-depth", "2", "--json"])
    assert fp32.exit_code == 0, fp32.output
    assert read_trace(out).model["expert_bytes"] == 2 * model["expert_bytes"]
    bad = runner.invoke(app, ["traces", "import-routing", str(path), "--out", str(out), "--dtype", "float32"])
    assert bad.exit_code == 2 and "--dtype" in bad.output and "without --model" in bad.output


def _valid(tokens, layers, k):
    """Routing that names each expert once per token and layer."""
    return np.broadcast_to(np.arange(k, dtype=np.int8), (tokens, layers, k)).copy()


@pytest.mark.parametrize("arrays,message", [
    ({"problem0": _valid(3, L, K), "problem1": _valid(3, L, 4)}, "disagree on \\[layers, top_k\\]"),
    ({"problem0": -np.ones((3, L, K), np.int8)}, "negative expert id"),
    ({"problem0": np.zeros((3, L), np.int8)}, "must be integers \\[tokens, layers, top_k\\]"),
    ({"problem0": np.zeros((3, L, K), np.int8), "answer1": np.zeros((3, L, K), np.int8)}, "one shared prefix"),
    ({"problem0": _valid(3, L, K), "problem0_weights": np.ones((3, L, K)),
      "problem1": _valid(3, L, K)}, "recorded for some sequences only"),
    ({"problem1": _valid(3, L, K), "problem01": _valid(2, L, K)}, "'problem01' and 'problem1' are both sequence 1"),
    # a sequence saved as floats, or an array of another name, would otherwise be dropped without a word
    ({"problem0": _valid(3, L, K), "problem1": _valid(3, L, K).astype(np.float32)},
     "array 'problem1' must be integers \\[tokens, layers, top_k\\], got float32"),
    ({"problem0": _valid(3, L, K), "other": _valid(3, L, K)}, "array 'other' is neither a sequence \\(problem<N>\\)"),
    ({"problem0": _valid(3, L, K), "problem1_router_weights": np.ones((3, L, K))}, "array 'problem1_router_weights' is "
     "neither"),
])
def test_bad_per_sequence_npz_is_one_error(tmp_path, arrays, message):
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(SpecFitError, match=message) as info:
        read_routing_log(path)
    assert str(path) in str(info.value)


# ----------------------------------------------------------------------------- router weights
def _flat_log(tmp_path, with_weights=True) -> tuple[Path, dict]:
    experts = np.concatenate([_routing(8, 1), _routing(6, 2)]).astype(np.int16)
    arrays = {"expert_ids": experts, "sequence_id": np.repeat([7, 3], [8, 6]).astype(np.int32),
              "generated_token_index": np.r_[np.arange(8), np.arange(6)].astype(np.int32),
              "token_id": np.random.default_rng(3).integers(0, 1000, 14).astype(np.int32)}
    if with_weights:
        arrays["router_weights"] = _weights(experts, 4)
    # rows out of decode order within sequence 7: the generated-token index puts them back
    order = np.r_[[1, 0], np.arange(2, 14)]
    path = tmp_path / "flat.npz"
    np.savez(path, **{k: v[order] for k, v in arrays.items()})
    return path, arrays


def test_router_weights_are_kept_on_the_reference_path(tmp_path):
    path, arrays = _flat_log(tmp_path)
    log = read_routing_log(path)
    np.testing.assert_array_equal(log.experts, arrays["expert_ids"])
    np.testing.assert_array_equal(log.weights, arrays["router_weights"].astype(np.float32))
    trace = import_routing(log, model_for_log(log, None), drafter=SMALL_DRAFTER)
    out = write_trace(trace, tmp_path / "w.parquet")
    back = read_trace(out)
    assert back.meta["recording"]["router_weights"] and back.meta["recording"]["token_ids"] == "real"
    np.testing.assert_array_equal(back.true_expert_weights, trace.true_expert_weights)
    weights = back.true_expert_weights
    known = ~np.isnan(weights[:, 0, 0])
    roots = back.offsets[:-1]
    assert known[roots].all() and (~known).any()          # off-path nodes' experts are synthesised
    # every node with weights is a reference token: position + depth of its tree, same row as its experts
    log_rows = {0: np.arange(8), 1: 8 + np.arange(6)}     # sequence 7 first: first seen in the file
    cycle = back.cycle_of_node
    for node in np.flatnonzero(known):
        row = log_rows[int(back.sequence[cycle[node]])][int(back.position[cycle[node]]) + int(back.depth[node])]
        np.testing.assert_array_equal(back.true_experts[node], arrays["expert_ids"][row])
        np.testing.assert_array_equal(weights[node], arrays["router_weights"][row].astype(np.float32))
    assert known.sum() > roots.size                       # accepted draft nodes carry them too


def test_a_trace_without_weights_has_no_weight_column(tmp_path):
    path, _ = _flat_log(tmp_path, with_weights=False)
    log = read_routing_log(path)
    trace = import_routing(log, model_for_log(log, None), drafter=SMALL_DRAFTER)
    back = read_trace(write_trace(trace, tmp_path / "nw.parquet"))
    assert back.true_expert_weights is None and not back.meta["recording"]["router_weights"]


def test_replays_read_a_trace_without_its_router_weights_and_replay_it_the_same(tmp_path):
    path, _ = _flat_log(tmp_path)
    log = read_routing_log(path)
    written = write_trace(import_routing(log, model_for_log(log, None), drafter=SMALL_DRAFTER), tmp_path / "w.parquet")
    full, lean = read_trace(written), read_trace(written, weights=False)
    assert full.true_expert_weights is not None and lean.true_expert_weights is None
    for name in ("offsets", "parent", "depth", "token", "verdict", "true_experts", "path_prob", "draft_logprob"):
        np.testing.assert_array_equal(getattr(lean, name), getattr(full, name))
    assert lean.meta == full.meta


def test_a_flat_npz_of_interleaved_sequences_reads_each_sequence_in_file_order(tmp_path):
    # a batched decode writes its sequences' tokens in turn; without a token index each
    # sequence's rows keep the file's order, sequences in the order first seen
    a, b = _routing(5, 1), _routing(3, 2)
    rows = [("a", 0), ("b", 0), ("a", 1), ("a", 2), ("b", 1), ("a", 3), ("b", 2), ("a", 4)]
    experts = np.stack([{"a": a, "b": b}[s][i] for s, i in rows])
    seq = np.array([{"a": 9, "b": 4}[s] for s, _ in rows])
    tokens = np.array([{"a": 100, "b": 200}[s] + i for s, i in rows])
    path = tmp_path / "interleaved.npz"
    np.savez(path, expert_ids=experts, sequence_id=seq, token_id=tokens)
    log = read_routing_log(path)
    np.testing.assert_array_equal(log.sequence, [9] * 5 + [4] * 3)
    np.testing.assert_array_equal(log.experts, np.concatenate([a, b]))
    np.testing.assert_array_equal(log.tokens, np.r_[100 + np.arange(5), 200 + np.arange(3)])


def test_import_routing_writes_a_parquet_trace_and_never_over_its_own_log(tmp_path):
    path, arrays = _flat_log(tmp_path)
    log = tmp_path / "log.parquet"
    _records(arrays, "token").to_parquet(log)
    before = log.read_bytes()
    runner = CliRunner()
    same = runner.invoke(app, ["traces", "import-routing", str(log), "--out", str(log)])
    assert same.exit_code == 2 and "is the routing log being imported" in same.output
    assert log.read_bytes() == before
    txt = runner.invoke(app, ["traces", "import-routing", str(path), "--out", str(tmp_path / "t.txt")])
    assert txt.exit_code == 2 and "expected a .parquet file name" in txt.output and not (tmp_path / "t.txt").exists()
    synth = runner.invoke(app, ["traces", "synth", "--shape", "olmoe-1b-7b", "--tokens", "4", "--out",
                                str(tmp_path / "s.pq")])
    assert synth.exit_code == 2 and "expected a .parquet file name" in synth.output


def test_a_negative_token_index_is_an_error_in_every_layout(tmp_path):
    experts = _routing(4, 0)
    path = tmp_path / "negative.npz"
    np.savez(path, expert_ids=experts, sequence_id=np.zeros(4, np.int32), generated_token_index=np.arange(-2, 2))
    with pytest.raises(SpecFitError, match="'generated_token_index' must hold non-negative token indices, got -2 in row 0"):
        read_routing_log(path)
    _, arrays = _flat_log(tmp_path)
    records = tmp_path / "negative.jsonl"
    frame = _records(arrays, "token")
    frame.assign(generated_token_index=frame["generated_token_index"] - 3).to_json(records, orient="records", lines=True)
    with pytest.raises(SpecFitError, match="field 'token_index' must hold non-negative token indices, got -3 in row 0"):
        read_routing_log(records)


def test_flat_npz_with_a_gap_in_generated_token_index_is_an_error(tmp_path):
    experts = _routing(4, 0)
    path = tmp_path / "gap.npz"
    np.savez(path, expert_ids=experts, sequence_id=np.zeros(4, np.int32), generated_token_index=np.array([0, 1, 3, 4]))
    with pytest.raises(SpecFitError, match="skips from token index 1 to 3"):
        read_routing_log(path)


# ----------------------------------------------------------------------------- JSONL / Parquet
def _records(arrays: dict, per: str) -> pd.DataFrame:
    rows = []
    seq, index = arrays["sequence_id"], arrays["generated_token_index"]
    for i in range(seq.size):
        base = {"sequence_id": int(seq[i]), "generated_token_index": int(index[i]), "token_id": int(arrays["token_id"][i])}
        if per == "token":
            rows.append({**base, "experts": arrays["expert_ids"][i].tolist(),
                         "router_weights": arrays["router_weights"][i].astype(float).tolist()})
        else:
            rows += [{**base, "layer": layer, "experts": arrays["expert_ids"][i, layer].tolist(),
                      "router_weights": arrays["router_weights"][i, layer].astype(float).tolist()} for layer in range(L)]
    frame = pd.DataFrame(rows)
    if per == "layer-major":      # all tokens of layer 0, then layer 1, ...
        frame = frame.sort_values("layer", kind="stable")
    return frame


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
@pytest.mark.parametrize("per", ["token-major", "layer-major", "token"])
def test_record_logs_read_like_the_npz_layout(tmp_path, suffix, per):
    npz, arrays = _flat_log(tmp_path)
    reference = read_routing_log(npz)
    frame = _records(arrays, per)
    path = tmp_path / f"log{suffix}"
    if suffix == ".jsonl":
        frame.to_json(path, orient="records", lines=True)
    else:
        frame.to_parquet(path)
    log = read_routing_log(path)
    np.testing.assert_array_equal(log.experts, reference.experts)
    np.testing.assert_array_equal(log.tokens, reference.tokens)
    np.testing.assert_array_equal(log.sequence, reference.sequence)
    np.testing.assert_allclose(log.weights, reference.weights, rtol=0, atol=1e-7)
    assert log.layout == suffix[1:] + ("-per-token" if per == "token" else "-per-layer")


@pytest.mark.parametrize("edit,message", [
    (lambda f: f.drop(columns=["sequence_id"]), "records miss field\\(s\\) \\['sequence_id'\\]"),
    (lambda f: f[f.index != 3], "has 15 layer records; expected 16"),
    (lambda f: f.assign(generated_token_index=f["generated_token_index"] * 2), "skips from token index 0 to 2"),
    (lambda f: f.assign(experts=[e[:-1] if i == 5 else e for i, e in enumerate(f["experts"])]), "same length"),
    (lambda f: f.assign(token_id=-1), "field 'token_id' must hold non-negative token ids, got -1 in row 0"),
    (lambda f: f.assign(token_id=[None if i == 16 else t for i, t in enumerate(f["token_id"])]),
     "field 'token_id' must hold integer token ids, got null \\(NaN\\) in row 1"),
    # token 0 of the first sequence: its layer-5 record says layer 3 (16 records, one layer twice)
    (lambda f: f.assign(layer=[3 if i == 5 else v for i, v in enumerate(f["layer"])]),
     "sequence 7, token 0 lists layer\\(s\\) \\[3\\] twice and none for layer\\(s\\) \\[5\\]"),
    (lambda f: f.assign(router_weights=[[None, *w[1:]] if i == 18 else w for i, w in enumerate(f["router_weights"])]),
     "router weights, got nan for token row 1, layer 2, rank 0"),
    (lambda f: f.assign(layer=f["layer"] + 1), "field 'layer' must cover 0..L-1"),
])
def test_bad_record_log_is_one_error(tmp_path, edit, message):
    _, arrays = _flat_log(tmp_path)
    path = tmp_path / "bad.jsonl"
    edit(_records(arrays, "token-major")).to_json(path, orient="records", lines=True)
    with pytest.raises(SpecFitError, match=message) as info:
        read_routing_log(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_unknown_suffix_and_unreadable_files(tmp_path):
    (tmp_path / "log.csv").write_text("a,b\n")
    with pytest.raises(SpecFitError, match="expected a .npz, .jsonl or .parquet file"):
        read_routing_log(tmp_path / "log.csv")
    (tmp_path / "log.parquet").write_text("not parquet")
    with pytest.raises(SpecFitError, match="not a readable Parquet file"):
        read_routing_log(tmp_path / "log.parquet")


# ----------------------------------------------------------------------------- the real log
@pytest.mark.skipif(OLMOE_LOG is None, reason="olmoe-1b-7b-routing-general-coding.npz not found in ../shared/data "
                    "(relative to the repository); the real-log check needs it")
def test_real_olmoe_log_keeps_its_router_weights(tmp_path):
    log = read_routing_log(OLMOE_LOG)
    assert log.weights is not None and log.weights.shape == log.experts.shape
    first = np.unique(log.sequence)[:2]
    log = log.select(np.flatnonzero(np.isin(log.sequence, first)))
    trace = import_routing(log, model_for_log(log, None), drafter=SMALL_DRAFTER, max_tokens=40)
    back = read_trace(write_trace(trace, tmp_path / "olmoe.parquet"))
    roots = back.offsets[:-1]
    rows = np.flatnonzero(log.sequence == log.sequence[0])[:10]
    np.testing.assert_array_equal(back.true_expert_weights[roots[:10]], log.weights[rows])
    # OLMoE does not renormalise its top-8: each token's weights sum to below 1, descending
    sums = back.true_expert_weights[roots].sum(axis=-1)
    assert np.all(sums < 1.0 + 1e-3) and np.all(np.diff(back.true_expert_weights[roots], axis=-1) <= 1e-3)


def test_the_simulator_refuses_a_predictor_the_imported_trace_cannot_fit(per_sequence_npz):
    from specfit.errors import SpecFitError
    from specfit.simulate.replay import prepare_trace

    path, _ = per_sequence_npz
    log = read_routing_log(path)
    trace = import_routing(log, model_for_log(log, None), drafter=SMALL_DRAFTER)
    with pytest.raises(SpecFitError, match="--predictor affinity: the trace cannot fit it"):
        prepare_trace("imported", trace, predictor="affinity")
    assert prepare_trace("imported", trace, predictor="parent").n_cycles == trace.n_cycles


def test_an_expert_listed_twice_for_one_token_and_layer_is_refused_wherever_it_sits_in_the_top_k(tmp_path):
    """A router's top-k names each expert once: expert 3 at ranks 0 and 2 (not side by side) of
    token 1, layer 0 is as wrong as at ranks 0 and 1."""
    experts = np.array([[[0, 1, 2], [4, 5, 6]],
                        [[3, 1, 3], [4, 5, 6]]])
    path = tmp_path / "log.npz"
    np.savez(path, expert_ids=experts, sequence_id=np.array([0, 0]))
    with pytest.raises(SpecFitError, match="lists expert 3 twice for token 1 at layer 0"):
        read_routing_log(path)
    experts[1, 0] = [3, 1, 2]                             # distinct: read as given
    np.savez(path, expert_ids=experts, sequence_id=np.array([0, 0]))
    np.testing.assert_array_equal(read_routing_log(path).experts, experts)


def test_three_interleaved_sequences_are_grouped_in_the_order_first_seen(tmp_path):
    """Sequences first seen in the order 7, 2, 5 (neither ascending nor a swap of two) come out as
    7, 2, 5, each in the file's order of its rows, with or without a token index."""
    rows = [(7, 0), (2, 0), (5, 0), (2, 1), (7, 1), (5, 1), (5, 2)]
    experts = np.stack([[[s % 4, 4 + i]] for s, i in rows])                    # [tokens, 1 layer, top-2]
    seq = np.array([s for s, _ in rows])
    tokens = np.array([10 * s + i for s, i in rows])
    path = tmp_path / "three.npz"
    np.savez(path, expert_ids=experts, sequence_id=seq, token_id=tokens)
    log = read_routing_log(path)
    np.testing.assert_array_equal(log.sequence, [7, 7, 2, 2, 5, 5, 5])
    np.testing.assert_array_equal(log.tokens, [70, 71, 20, 21, 50, 51, 52])
    np.savez(path, expert_ids=experts, sequence_id=seq, token_id=tokens,
             generated_token_index=np.array([i for _, i in rows]))
    log = read_routing_log(path)
    np.testing.assert_array_equal(log.sequence, [7, 7, 2, 2, 5, 5, 5])
    np.testing.assert_array_equal(log.tokens, [70, 71, 20, 21, 50, 51, 52])


def test_a_negative_router_weight_is_refused_with_its_place(tmp_path):
    """Router weights are softmax outputs: a negative one is a corrupt log, named by its row,
    layer and rank, not a weight kept in the trace."""
    experts = np.array([[[0, 1]], [[2, 3]]])
    weights = np.array([[[0.75, 0.25]], [[0.5, -0.25]]], dtype=np.float32)
    path = tmp_path / "log.npz"
    np.savez(path, expert_ids=experts, sequence_id=np.array([0, 0]), router_weights=weights)
    with pytest.raises(SpecFitError, match="non-negative router weights, got -0.25 for token row 1, layer 0, rank 1"):
        read_routing_log(path)
    weights[1, 0, 1] = 0.0
    np.savez(path, expert_ids=experts, sequence_id=np.array([0, 0]), router_weights=weights)
    np.testing.assert_array_equal(read_routing_log(path).weights, weights)


def test_an_expert_id_out_of_the_shapes_range_is_refused_with_its_place():
    """The error named the range only; a user looking for the bad row in a log of millions of
    tokens gets its sequence, token, layer and id."""
    from specfit.traces.importers import check_log_fits
    from specfit.traces.routing_logs import RoutingLog

    experts = np.zeros((6, 2, 2), dtype=np.int64)
    experts[:, :, 1] = 1
    experts[4, 1, 1] = 9                                   # sequence 7's token 1, layer 1
    log = RoutingLog(experts=experts, tokens=None, sequence=np.array([3, 3, 3, 7, 7, 7]), source="log.npz")
    model = {"name": "tiny", "n_layers": 2, "top_k": 2, "n_experts": 8}
    with pytest.raises(SpecFitError, match=r"^--shape: expert ids must be in \[0, 8\) for 'tiny'; got 9 at sequence 7, "
                                           r"its token 1, layer 1$"):
        check_log_fits(log, model, "--shape")
    with pytest.raises(SpecFitError, match="the log has 2 layers x top-2, the model shape 'tiny' expects 3 MoE layers"):
        check_log_fits(log, {**model, "n_layers": 3}, "--shape")
