"""MoE-Infinity's activation-aware prefetcher (specfit.experts.eam): against a line-by-line
transcription of its tracer and predictor, by hand, and recharged on the shipped trace under its
cache's rule."""

import json
from collections import Counter

import numpy as np
import pytest
import torch

from specfit import ExpertCache
from specfit.calibrate.presets import SHAPES, preset_profile
from specfit.experts.eam import EAMRanker, activation_matrices
from specfit.experts.layer_ahead import layer_ahead
from specfit.policies import Observation, make_policy
from specfit.simulate.replay import prepare, replay
from specfit.traces.format import read_trace

from bench_helpers import bench_module
from test_simulate import with_prompt_passes
from trace_helpers import SAMPLE_OLMOE


def _moe_infinity_priorities(collection: np.ndarray, matrix: np.ndarray, layer_idx: int) -> list[tuple[int, int]]:
    """MoE-Infinity's ``ExpertTracer.find_most_similar`` + ``ExpertPredictor.predict`` +
    ``ExpertPrefetcher.prefetch_experts``, transcribed step by step (on the CPU): the (layer,
    expert) queue, highest priority first."""
    trace_collection = torch.from_numpy(collection.copy())
    capacity, num_layers, num_experts = collection.shape
    trace_collection_copy = trace_collection.clone()
    trace_collection_copy[:, : (layer_idx + 1), :] = 1e-9
    trace_collection_copy /= torch.sum(trace_collection_copy, dim=2, keepdims=True)
    matrix_copy = torch.from_numpy(matrix.copy())
    matrix_copy /= torch.sum(matrix_copy, dim=1, keepdims=True)
    replicated_matrix_copy = torch.concat([matrix_copy[None, ...]] * capacity, dim=0)
    replicated_matrix_copy = torch.nan_to_num(replicated_matrix_copy)
    cos_sim = torch.nn.CosineSimilarity(dim=2, eps=1e-6)(replicated_matrix_copy, trace_collection_copy)
    cos_dist = 1 - torch.mean(cos_sim, dim=1)
    min_idx = torch.argmin(cos_dist).item()
    expert_matrix = trace_collection[min_idx].numpy().copy()
    expert_matrix[:layer_idx, :] = 0
    for l in range(layer_idx, num_layers):
        expert_matrix[l] = (expert_matrix[l] + 1e-8) * (-1 / (num_layers + 1) * (l - layer_idx) + 1)
    expert_list = [((i, j), expert_matrix[i, j]) for i in range(layer_idx, num_layers) for j in range(num_experts)
                   if expert_matrix[i, j] > 0]
    return [x[0] for x in sorted(expert_list, key=lambda x: x[1], reverse=True)], min_idx


def _random_collection(rng, entries, n_layers, n_experts, k, tokens):
    if tokens == 0:
        return np.zeros((entries, n_layers, n_experts))
    popularity = rng.dirichlet(np.full(n_experts, 0.3), size=n_layers) + 1e-3
    popularity /= popularity.sum(axis=1, keepdims=True)
    experts = np.stack([np.stack([rng.choice(n_experts, k, replace=False, p=popularity[layer])
                                  for layer in range(n_layers)]) for _ in range(entries * tokens)])
    return activation_matrices(experts.reshape(entries * tokens, n_layers, k), np.repeat(np.arange(entries), tokens),
                               n_experts)


@pytest.mark.parametrize("seed", range(8))
def test_matches_and_order_equal_moe_infinitys_own_steps(seed):
    rng = np.random.default_rng(seed)
    n_layers, n_experts, k = int(rng.integers(2, 7)), int(rng.integers(4, 17)), 2
    collection = _random_collection(rng, int(rng.integers(1, 7)), n_layers, n_experts, k, int(rng.integers(1, 9)))
    ranker = EAMRanker(collection, k)
    for _ in range(5):
        history = _random_collection(rng, 1, n_layers, n_experts, k, int(rng.integers(0, 6)))[0] \
            if rng.random() < 0.8 else np.zeros((n_layers, n_experts))
        matches = ranker.matches(history)
        ids, chance = ranker.rank(history)
        for layer in range(n_layers - 1):
            # the current token's rows up to `layer` are in the tracer's matrix; they change nothing
            current = history.copy()
            current[: layer + 1] += _random_collection(rng, 1, n_layers, n_experts, k, 1)[0][: layer + 1]
            queue, chosen = _moe_infinity_priorities(collection, current, layer)
            assert matches[layer] == chosen
            # the next layer's part of the queue, in order: the ranker's row
            assert ids[layer].tolist() == [e for (l, e) in queue if l == layer + 1]
            row = collection[chosen, layer + 1]
            np.testing.assert_allclose(chance[layer], np.minimum(row[ids[layer]] / max(row.sum() / k, 1e-300), 1.0)
                                       if row.sum() else 0.0)


def test_by_hand():
    # 3 layers, 3 experts, one expert a token; two past requests of two tokens each
    a = np.array([[2, 0, 0], [0, 2, 0], [0, 0, 2]], dtype=float)          # always 0, 1, 2
    b = np.array([[0, 2, 0], [1, 0, 1], [2, 0, 0]], dtype=float)
    ranker = EAMRanker(np.stack([a, b]), 1)
    # the request's earlier tokens went 1, (0 or 2), 0: like b at layers 1 and 2
    history = np.array([[0, 1, 0], [1, 0, 0], [1, 0, 0]], dtype=float)
    # routed layer 0: layers 1-2 decide (b: cos 1/sqrt(2) + 1; a: 0 + 0) -> b; routed layer 1:
    # layer 2 alone (b) -> b
    np.testing.assert_array_equal(ranker.matches(history), [1, 1])
    ids, chance = ranker.rank(history)
    np.testing.assert_array_equal(ids, [[0, 2, 1], [0, 1, 2]])            # b's layer 1 (tie: lower id), layer 2
    np.testing.assert_allclose(chance, [[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    np.testing.assert_allclose(ranker.rank(history, nodes=2)[1][0], [0.75, 0.75, 0.0])
    # nothing known of the request: every entry ties, the first wins
    np.testing.assert_array_equal(ranker.matches(np.zeros((3, 3))), [0, 0])


def test_activation_matrices_count_each_requests_tokens():
    experts = np.array([[[0, 1], [2, -1]], [[0, 2], [2, 1]], [[1, 2], [0, 1]]])
    m = activation_matrices(experts, np.array([0, 1, 0]), 3)
    np.testing.assert_array_equal(m[0], [[1, 2, 1], [1, 1, 1]])
    np.testing.assert_array_equal(m[1], [[1, 0, 1], [0, 1, 1]])
    assert Counter(map(int, experts[experts >= 0].ravel())).total() == m.sum()


def test_bad_collections_are_refused():
    with pytest.raises(ValueError, match="EAMRanker.collection"):
        EAMRanker(np.zeros((0, 2, 3)), 1)
    with pytest.raises(ValueError, match="EAMRanker.top_k"):
        EAMRanker(np.ones((1, 2, 3)), 0)


@pytest.mark.parametrize("prompt_passes", [0, 2])
@pytest.mark.parametrize("mode,capacity", [("per_layer", 16), ("global", 256)])
def test_the_recharge_under_moe_infinitys_rule_keeps_the_replays_cache_and_time(mode, capacity, prompt_passes):
    """On the shipped OLMoE trace (two sequences; with recorded prompt passes too), `ar`'s unions
    replayed with MoE-Infinity's eviction, recounted request by request as the replay served them
    (prompt passes admitted, then decoding begun), give the replay's hits, misses and time; the EAM
    prefetcher hides time and never more than the true misses; without the requests' boundaries,
    or without the prompt passes, the recount differs."""
    trace = read_trace(SAMPLE_OLMOE)
    if prompt_passes:
        trace = with_prompt_passes(trace, prompt_passes, 24, seed=3)
    prep = prepare("oracle", trace, trace.true_experts)
    cost = preset_profile("gh200", SHAPES.get(trace.model["name"])).cost
    policy = make_policy("ar")
    policy.observe(Observation(predicted_slots=0, predicted_slots_right=0, resident_share=0.25))
    cache = ExpertCache(trace.n_layers, trace.n_experts, capacity, mode=mode, policy="moe-infinity")
    log = replay(prep, policy, cache, cost, record_unions=True)
    c = log.columns
    assert len(log.prefill_unions) == (2 if prompt_passes else 0)
    args = (log.unions, c["nodes_verified"], c["draft_levels"], trace.n_layers, trace.n_experts, capacity, cost)
    kw = {"policy": "moe-infinity", "mode": mode}
    perfect = layer_ahead(*args, sequence=c["sequence"], prefill_unions=log.prefill_unions, **kw)
    np.testing.assert_array_equal(perfect.hits, c["hits"])
    np.testing.assert_array_equal(perfect.misses, c["misses"])
    np.testing.assert_allclose(perfect.time_s, c["charged_time_s"], rtol=1e-12)
    ranker = EAMRanker(activation_matrices(trace.true_experts[trace.offsets[:-1]], np.zeros(trace.n_cycles, int),
                                           trace.n_experts), trace.true_experts.shape[2])
    ranked = layer_ahead(*args, sequence=c["sequence"], prefill_unions=log.prefill_unions,
                         rank=lambda t, u: ranker.rank(np.zeros_like(u, float)), **kw)
    assert (ranked.hidden_s <= perfect.hidden_s + 1e-12).all() and ranked.hidden_s.sum() > 0
    assert not np.array_equal(layer_ahead(*args, **kw).misses, c["misses"])
    if prompt_passes:
        assert not np.array_equal(layer_ahead(*args, sequence=c["sequence"], **kw).misses, c["misses"])
    with pytest.raises(ValueError, match="sequence"):
        layer_ahead(*args, sequence=c["sequence"][::-1], **kw)
    with pytest.raises(ValueError, match="prefill_unions needs sequence"):
        layer_ahead(*args, prefill_unions={0: [np.array([0])]}, **kw)


def test_the_benchmark_compares_specfit_with_moe_infinity(capsys):
    """benchmarks/bench_moe_infinity.py on the shipped OLMoE trace, two settings: every column
    measured, the ceiling above MoE-Infinity's prefetcher, and the summary's rows."""
    bench = bench_module("bench_moe_infinity")
    rows = bench.main(["--traces", "olmoe-sample", "--profiles", "gh200", "--caches", "0.25", "--modes",
                       "per_layer,global"])
    assert [(r["cache"], r["mode"]) for r in rows] == [(16, "per_layer"), (16, "global")]
    for r in rows:
        assert r["ar+ceiling"] >= r["moe-infinity"] > 0 and r["specfit+ceiling"] >= r["specfit+eam"] > 0
        assert 0 < r["ar eam precision"] <= 1
        assert r["moe-infinity"] == r["ar+eam"] and r["ar+ceiling"] > r["ar"] and r["specfit+ceiling"] > r["specfit"]
    out = capsys.readouterr().out
    assert "| `specfit+cache+prefetch` (LRU) / MoE-Infinity |" in out
    with pytest.raises(SystemExit, match="--caches"):
        bench.main(["--traces", "olmoe-sample", "--caches", "1.5"])


def test_simulates_layer_ahead_what_if_is_the_recount_of_each_replay():
    """run_sweep(layer_ahead=...): each row's layer-ahead figures are the recount of that replay
    (computed here from a replay of its own); the ceiling at least any prefetcher; a policy with
    cache levers has none; the tuned family and a policy with its own cache size are recounted."""
    from specfit.experts.layer_ahead import CrossFitRankers, recount
    from specfit.simulate.sweep import Scenario, run_sweep

    trace = read_trace(SAMPLE_OLMOE)
    prep = prepare("oracle", trace, trace.true_experts)
    cost = preset_profile("gh200", SHAPES.get(trace.model["name"])).cost
    policies = ["ar", "chain:2", "static:auto", "eagle3-nocache", "specfit+cache"]
    rows = {}
    for prefetcher in ("ceiling", "transition", "eam"):
        _, summary = run_sweep([prep], policies, [16], [Scenario("gh200", cost)], cache_mode="global",
                               cache_policy="moe-infinity", layer_ahead=prefetcher)
        rows[prefetcher] = summary.set_index("policy")
        assert (summary["layer_ahead"] == prefetcher).all()
    for prefetcher, s in rows.items():
        assert np.isnan(s.loc["specfit+cache", "layer_ahead_tokens_per_s"])
        for spec in ("ar", "chain:2", "static:auto", "eagle3-nocache"):
            assert s.loc[spec, "layer_ahead_tokens_per_s"] > s.loc[spec, "tokens_per_s"] * (0.9 if prefetcher != "ceiling" else 1)
            assert s.loc[spec, "layer_ahead_tokens_per_s"] <= rows["ceiling"].loc[spec, "layer_ahead_tokens_per_s"] + 1e-9
    # ar's row by hand: its replay, recounted with MoE-Infinity's matching
    policy = make_policy("ar")
    policy.observe(Observation(predicted_slots=prep.info["predicted_slots"],
                               predicted_slots_right=prep.info["predicted_slots_right"], resident_share=16 / 1024))
    log = replay(prep, policy, ExpertCache(trace.n_layers, trace.n_experts, 16, mode="global", policy="moe-infinity",
                                           expert_bytes=trace.expert_bytes), cost, record_unions=True)
    la = recount(trace, log, 16, cost, "eam", CrossFitRankers(prep), "global", "moe-infinity")
    assert rows["eam"].loc["ar", "layer_ahead_tokens_per_s"] == pytest.approx(
        log.columns["committed_tokens"].sum() / la.time_with_overlap_s.sum(), rel=1e-12)
    assert rows["eam"].loc["ar", "layer_ahead_hidden_share"] == pytest.approx(la.hidden_s.sum() / la.time_s.sum())
    assert rows["eam"].loc["ar", "layer_ahead_precision"] == pytest.approx(la.precision)
    # a log of a policy with cache levers is refused by the recount itself
    lever = make_policy("specfit+cache")
    lever.observe(Observation(predicted_slots=0, predicted_slots_right=0, resident_share=0.25))
    log = replay(prep, lever, ExpertCache(trace.n_layers, trace.n_experts, 4), cost, record_unions=True)
    with pytest.raises(ValueError, match="recount"):
        recount(trace, log, 4, cost, "ceiling")


def test_simulate_layer_ahead_on_the_command_line(tmp_path):
    from cli_helpers import invoke, one_line_error

    r = invoke("simulate", "--trace", SAMPLE_OLMOE, "--policies", "ar,specfit+cache+prefetch", "--cache-experts", "16",
               "--profile", "gh200", "--layer-ahead", "eam", "--json", "--out", tmp_path / "run")
    assert r.exit_code == 0, r.output
    # the report shows the what-if's table, a lever policy's cells empty
    r2 = invoke("report", tmp_path / "run", "--out", tmp_path / "report")
    assert r2.exit_code == 0, r2.output
    page = (tmp_path / "report" / "index.html").read_text()
    assert "Layer-ahead what-if" in page and "tokens / s with them" in page
    records = {x["policy"]: x for x in json.loads(r.stdout)}
    assert records["ar"]["layer_ahead"] == "eam" and records["ar"]["layer_ahead_tokens_per_s"] > 0
    assert records["specfit+cache+prefetch"]["layer_ahead_tokens_per_s"] is None
    r = invoke("simulate", "--trace", SAMPLE_OLMOE, "--policies", "ar,specfit+cache", "--cache-experts", "16",
               "--profile", "gh200", "--layer-ahead", "ceiling")
    assert r.exit_code == 0 and "+LA tokens/s" in r.output and "the true misses" in r.output, r.output
    r = invoke("simulate", "--trace", SAMPLE_OLMOE, "--policies", "ar", "--json")
    assert "layer_ahead_tokens_per_s" not in json.loads(r.stdout)[0]
    one_line_error(invoke("simulate", "--trace", SAMPLE_OLMOE, "--layer-ahead", "psychic"),
                   "--layer-ahead: expected none or one of ceiling, transition, eam, got 'psychic'")
