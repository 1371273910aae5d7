"""Counterfactual replay: a hand-computed trace, consistency with the reference output on the
sample trace, the policies' ordering, and the ``specfit simulate`` command."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from specfit import CostModel, ExpertCache, kernels
from specfit.calibrate.presets import SHAPES, preset_profile
from specfit.cli import app
from specfit.costmodel import expert_union
from specfit.errors import SpecFitError
from specfit.policies import Observation, SpecFitPolicy, make_policy
from specfit.simulate.replay import prepare, prepare_trace, replay
from specfit.simulate.sweep import Scenario, run_sweep
from specfit.simulate.whatif import parse_overrides, scale_h2d
from specfit.traces.format import Trace, read_trace

from trace_helpers import SAMPLE_OLMOE, SAMPLE_QWEN3, hand_trace

# base 1, per node 0.1, hit 0.01, miss 0.5, draft level 0.2 (seconds): easy sums by hand
HAND_COST = CostModel(base_s=1.0, per_node_s=0.1, hit_s=0.01, miss_s=0.5, draft_level_s=0.2, expert_bytes=1000)


def _hand_replay(spec: str):
    trace = hand_trace()
    prep = prepare("hand", trace, trace.true_experts)
    cache = ExpertCache(1, 4, capacity=1, expert_bytes=1000)
    return replay(prep, make_policy(spec), cache, HAND_COST)


def test_hand_trace_ar():
    # one token per cycle; each root's expert (e0, e1, e3) is new to a one-slot cache: a miss
    log = _hand_replay("ar")
    c = log.columns
    assert c["position"].tolist() == [0, 1, 2]
    assert c["committed_tokens"].tolist() == [1, 1, 1]
    assert c["hits"].tolist() == [0, 0, 0] and c["misses"].tolist() == [1, 1, 1]
    np.testing.assert_allclose(c["charged_time_s"], [1.6, 1.6, 1.6])   # 1 + 0.1 + 0.5
    assert c["bytes_h2d"].tolist() == [1000, 1000, 1000]
    assert log.committed[0].tolist() == [11, 12, 13]


def test_a_replay_counts_bytes_at_the_expert_size_its_cost_model_charges():
    # the demo replays the tiny model's trace with Qwen3-sized misses: each miss moves the cost
    # model's expert, not the traced one; a cost model without a size falls back to the trace's
    trace = hand_trace()
    prep = prepare("hand", trace, trace.true_experts)
    for cost_bytes, expected in ((50_000, 50_000), (0, trace.expert_bytes)):
        cache = ExpertCache(1, 4, capacity=1, expert_bytes=trace.expert_bytes)
        log = replay(prep, make_policy("ar"), cache, HAND_COST.replace(expert_bytes=cost_bytes))
        assert log.columns["misses"].tolist() == [1, 1, 1]
        assert log.columns["bytes_h2d"].tolist() == [expected] * 3
    scenario = Scenario("big experts", HAND_COST.replace(expert_bytes=50_000))
    cycles, summary = run_sweep([prep], ["ar"], [1], [scenario])
    assert cycles["bytes_h2d"].tolist() == [50_000] * 3
    assert summary["bytes_per_token"].tolist() == [50_000]


def test_hand_trace_chain1():
    # position 0: root + A, both accepted (11), bonus 12 -> 2 tokens; e0 and e1 miss;
    #   time 0.2 (1 level) + 1 + 0.2 (2 nodes) + 2 * 0.5 = 2.4; the one slot keeps e0 (lowest id)
    # position 2: root + 50 (rejected); e3 misses, e0 hits; bonus 13 -> 1 token;
    #   time 0.2 + 1 + 0.2 + 0.01 + 0.5 = 1.91
    log = _hand_replay("chain:1")
    c = log.columns
    assert c["position"].tolist() == [0, 2]
    assert c["committed_tokens"].tolist() == [2, 1]
    assert c["nodes_verified"].tolist() == [2, 2]
    assert c["draft_levels"].tolist() == [1, 1]
    assert c["hits"].tolist() == [0, 1] and c["misses"].tolist() == [2, 1]
    np.testing.assert_allclose(c["charged_time_s"], [2.4, 1.91])
    np.testing.assert_allclose(c["predicted_tokens"], [1.9, 1.4])
    assert log.committed[0].tolist() == [11, 12, 13]


def test_hand_trace_oracle_takes_the_whole_accepted_path():
    # the accepted path root-A-C: prefixes give 1/1.6, 2/2.4 and 3/3.2 tokens per second; the
    # last is best: one cycle commits 11 12 13 with three misses, time 0.4 + 1 + 0.3 + 1.5 = 3.2
    log = _hand_replay("oracle")
    c = log.columns
    assert c["committed_tokens"].tolist() == [3]
    assert c["misses"].tolist() == [3] and c["hits"].tolist() == [0]
    np.testing.assert_allclose(c["charged_time_s"], [3.2])
    assert log.committed[0].tolist() == [11, 12, 13]


def test_charged_union_equals_the_cost_models_union():
    trace = hand_trace()
    tree = trace.tree(0)
    union = expert_union(trace.true_experts[trace.rows(0)].astype(np.int64), [0, 1, 3], 4)
    assert union[0].tolist() == [True, True, False, True]
    assert tree.accepted_path(trace.verdict[trace.rows(0)], nodes=[0, 1]).tolist() == [0, 1]


@pytest.fixture(scope="module")
def sample():
    trace = read_trace(SAMPLE_QWEN3)
    return prepare("qwen3", trace, trace.true_experts)


ALL_POLICIES = ["ar", "chain:4", "eagle3", "eagle3-nocache", "static:auto", "specfit", "oracle"]


@pytest.fixture(scope="module")
def sample_sweep(sample):
    scenarios = [Scenario(p, preset_profile(p, SHAPES["qwen3-30b-a3b"]).cost) for p in ("pcie4", "gh200")]
    return run_sweep([sample], ALL_POLICIES, [0, 32], scenarios)


def test_every_policy_commits_the_reference_output(sample):
    cost = preset_profile("pcie5", SHAPES["qwen3-30b-a3b"]).cost
    for spec in ["ar", "chain:4", "eagle3", "static:6", "specfit", "oracle"]:
        log = replay(sample, make_policy(spec), ExpertCache(48, 128, 16), cost)
        for got, want in zip(log.committed, sample.reference):
            np.testing.assert_array_equal(got, want, err_msg=spec)


def test_oracle_commits_the_longest_accepted_path_when_drafting_is_free(sample):
    free = CostModel(base_s=1e-3, per_node_s=1e-5, hit_s=0.0, miss_s=0.0, draft_level_s=0.0)
    log = replay(sample, make_policy("oracle"), ExpertCache(48, 128, 0), free)
    start = sample.first_cycles[log.columns["sequence"]] + log.columns["position"]
    longest = np.array([sample.accepted_path(c).size for c in start])
    np.testing.assert_array_equal(log.columns["committed_tokens"], longest)


def test_oracle_never_commits_more_than_the_accepted_path(sample_sweep):
    cycles, _ = sample_sweep
    assert (cycles["committed_tokens"] >= 1).all()
    oracle = cycles[cycles["policy"] == "oracle"]
    assert (oracle["predicted_tokens"] == oracle["committed_tokens"]).all()


def test_specfit_with_true_experts_is_not_below_eagle3(sample_sweep):
    _, summary = sample_sweep
    rate = summary.set_index(["profile", "cache_experts", "policy"])["tokens_per_s"]
    for profile in ("pcie4", "gh200"):
        for cache in (0, 32):
            assert rate[profile, cache, "specfit"] >= rate[profile, cache, "eagle3"] * (1 - 1e-9), (profile, cache)
            assert rate[profile, cache, "oracle"] >= rate[profile, cache, "specfit"] * (1 - 1e-9), (profile, cache)


def test_sweep_summary_columns_and_baselines(sample_sweep):
    cycles, summary = sample_sweep
    assert len(summary) == 2 * 2 * len(ALL_POLICIES)
    for col in ("policy", "cache_experts", "tokens", "cycles", "time_s", "tokens_per_s", "tokens_per_cycle",
                "bytes_h2d", "hit_rate", "speedup_vs_ar", "speedup_vs_eagle3", "union_precision"):
        assert col in summary
    ar = summary[summary.policy == "ar"]
    np.testing.assert_allclose(ar["speedup_vs_ar"], 1.0)
    assert (summary["tokens"] == summary["tokens"].iloc[0]).all()   # same output, every policy
    nocache = summary[summary.policy == "eagle3-nocache"]
    assert (nocache["hit_rate"] == 0).all()
    auto = summary[summary.policy == "static:auto"]
    assert auto["static_n"].notna().all()
    # per-cycle rows add up to the summary
    grouped = cycles.groupby(["profile", "cache_experts", "policy"])["committed_tokens"].sum()
    assert (grouped == summary["tokens"].iloc[0]).all()
    # with the true experts, the union the policy priced is the one charged
    assert (summary[summary.policy != "eagle3-nocache"]["union_precision"] == 1.0).all()


def test_static_auto_is_the_best_fixed_size(sample):
    cost = preset_profile("gh200", SHAPES["qwen3-30b-a3b"]).cost
    _, summary = run_sweep([sample], ["static:auto", "static:2", "static:8", "static:32"], [16], [Scenario("g", cost)])
    rate = summary.set_index("policy")["tokens_per_s"]
    assert rate["static:auto"] >= rate[["static:2", "static:8", "static:32"]].max()


def test_a_setting_changed_after_construction_reaches_the_compiled_rules():
    """The compiled rules read SpecFit's settings from its configuration array: a setting changed
    on the policy object (as ``run_sweep(price_uncertainty=False)`` does) must change that array."""
    d = kernels.decide
    policy = SpecFitPolicy(max_levels=5)
    conf = policy.state[0]
    assert (policy.price_uncertainty, policy.lookahead, policy.first_level_test, policy.max_levels) == \
        ("observed", "expected", True, 5)
    policy.price_uncertainty, policy.lookahead, policy.first_level_test, policy.min_observed = False, "optimistic", 0, 3
    assert (conf[d.PRICE], conf[d.LOOKAHEAD], conf[d.FIRST_LEVEL_TEST], conf[d.MIN_OBSERVED]) == \
        (d.NO_PRICE, d.OPTIMISTIC, 0, 3)
    assert (policy.price_uncertainty, policy.lookahead, policy.first_level_test) == ("none", "optimistic", False)
    with pytest.raises(ValueError, match="price_uncertainty"):
        policy.price_uncertainty = "sometimes"
    # end to end: with a predictor that gets experts wrong, pricing them changes what SpecFit does
    trace = read_trace(SAMPLE_QWEN3)
    parent = prepare_trace("qwen3", trace, predictor="parent")
    scenarios = [Scenario("pcie4", preset_profile("pcie4", SHAPES["qwen3-30b-a3b"]).cost)]
    runs = {priced: run_sweep([parent], ["specfit"], [0], scenarios, price_uncertainty=priced)[0]
            for priced in (True, False)}
    assert not runs[True]["nodes_verified"].equals(runs[False]["nodes_verified"])


def test_whatif_h2d_scale_and_overrides():
    cost = CostModel(base_s=1.0, per_node_s=0.1, hit_s=0.01, miss_s=0.51)
    assert scale_h2d(cost, 2.0).miss_s == pytest.approx(0.26)
    assert parse_overrides("base_s=2,miss_s=1e-3") == {"base_s": 2.0, "miss_s": 1e-3}
    with pytest.raises(SpecFitError, match="--cost: expected NAME=VALUE"):
        parse_overrides("base_s")


def test_a_bandwidth_what_if_and_a_rescale_keep_the_fixed_latency_of_a_copy(tmp_path):
    """A measured profile's transfer is a copy's fixed latency (its H2D fit's intercept) plus bytes
    over the bandwidth; ``--h2d-scale`` and ``--rescale`` scaled the latency with the bandwidth."""
    from specfit.calibrate.profile import ModelShape, Profile
    from specfit.simulate.scenarios import build_scenario

    shape = SHAPES["olmoe-1b-7b"]
    hit_s, transfer_s, latency_s = 1e-4, 2e-4, 5e-5
    cost = CostModel(base_s=1e-2, per_node_s=1e-4, hit_s=hit_s, miss_s=hit_s + transfer_s, expert_bytes=shape.expert_bytes)
    fit = {"h2d": {"gbps": 40.0, "overhead_s": latency_s, "r2": 1.0}}
    path = Profile(cost=cost, shape=shape, fit=fit).save(tmp_path / "p.json")
    bandwidth_s = transfer_s - latency_s
    faster = build_scenario(str(path), shape, h2d_scale=2.0).cost
    assert faster.miss_s == pytest.approx(hit_s + latency_s + bandwidth_s / 2)
    larger = ModelShape("olmoe-2x", shape.n_layers, shape.n_experts, shape.top_k, 2 * shape.expert_bytes,
                        shape.hidden_size)
    rescaled = build_scenario(str(path), larger, rescale=True).cost
    assert rescaled.miss_s == pytest.approx(hit_s + latency_s + bandwidth_s * 2)
    assert rescaled.expert_bytes == 2 * shape.expert_bytes
    # a preset's transfer is bytes over a published bandwidth, all of it scaled
    preset = preset_profile("pcie4", shape).cost
    assert build_scenario("pcie4", shape, h2d_scale=2.0).cost.transfer_s == pytest.approx(preset.transfer_s / 2)


def test_cli_json_is_only_a_list(tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ["simulate", "--trace", str(SAMPLE_OLMOE), "--policies", "ar,eagle3,specfit",
                            "--cache-experts", "8,16", "--profile", "pcie4", "--predictor", "affinity", "--json",
                            "--out", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    records = json.loads(r.stdout)
    assert isinstance(records, list) and len(records) == 6
    for key in ("policy", "cache_experts", "tokens", "cycles", "time_s", "tokens_per_s", "tokens_per_cycle",
                "bytes_h2d", "hit_rate"):
        assert key in records[0]
    cycles = pd.read_parquet(tmp_path / "out" / "cycles.parquet")
    assert {"nodes_verified", "draft_levels", "union_size", "hits", "misses", "bytes_h2d", "predicted_time_s",
            "charged_time_s", "predicted_tokens", "committed_tokens"} <= set(cycles.columns)
    # the CSV twins hold the same values as the Parquet files
    for name in ("cycles", "summary"):
        parquet = pd.read_parquet(tmp_path / "out" / f"{name}.parquet")
        csv = pd.read_csv(tmp_path / "out" / f"{name}.csv", keep_default_na=False, na_values=[""], engine="pyarrow")
        assert csv.columns.tolist() == parquet.columns.tolist() and len(csv) == len(parquet)
        for column in parquet.columns:
            if pd.api.types.is_numeric_dtype(parquet[column]):
                np.testing.assert_array_equal(csv[column].to_numpy(dtype=np.float64),
                                              parquet[column].to_numpy(dtype=np.float64, na_value=np.nan),
                                              err_msg=f"{name}.csv {column}")
            elif parquet[column].dtype == object and len(parquet) and hasattr(parquet[column].iloc[0], "__len__") \
                    and not isinstance(parquet[column].iloc[0], str):
                assert [json.loads(v) for v in csv[column]] == [list(v) for v in parquet[column]], column
            else:
                assert csv[column].fillna("").astype(str).tolist() == parquet[column].fillna("").astype(str).tolist(), column
    # an affinity predictor is fitted on the other sequence: imperfect, but better than chance
    assert 0.3 < records[1]["union_precision"] < 1.0
    # rows written: the per-layer columns filled, one entry per layer, and the per-layer errors with them
    assert all(len(v) == 16 for v in cycles["predicted_misses_per_layer"])
    assert all(r["union_layer_mape"] is not None and r["misses_layer_mape"] is not None for r in records)


def test_cli_table_and_bad_input(tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ["simulate", "--trace", str(SAMPLE_OLMOE), "--policies", "ar,eagle3,specfit+cache+prefetch",
                            "--cache-experts", "16", "--profile", "gh200", "--h2d-scale", "2", "--cost", "base_s=0.004"])
    assert r.exit_code == 0, r.output
    assert "gh200 x2 H2D (base_s=0.004)" in r.output and "eagle3" in r.output
    # printed to a pipe, a policy's name and its cells stay whole (rich's 80 columns cut them with "…")
    assert "specfit+cache+prefetch" in r.output and "…" not in r.output
    for args, message in [
        (["--policies", "ar,warp"], "--policies"),
        (["--cache-experts", "a,b"], "--cache-experts"),
        (["--cache-experts", "0,,4"], "--cache-experts: an empty entry"),
        (["--profile", "nosuch"], "--profile"),
        (["--predictor", "psychic"], "--predictor"),
        (["--cost", "base_s=x"], "--cost: base_s must be a number"),
    ]:
        r = runner.invoke(app, ["simulate", "--trace", str(SAMPLE_OLMOE), *args])
        assert r.exit_code == 2, (args, r.output)
        assert message in r.output and "Traceback" not in r.output
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"machine": {}}))
    r = runner.invoke(app, ["simulate", "--trace", str(SAMPLE_OLMOE), "--profile", str(profile)])
    assert r.exit_code == 2 and "p.json" in r.output


def test_the_cache_mode_takes_per_layer_spelled_as_the_other_options_values_are(tmp_path):
    """``--cache-mode per-layer`` (as ``--cache-policy moe-infinity`` is spelled) is per_layer: the
    same rows, named per_layer; a sweep spec's ``cache_mode`` alike."""
    from specfit.simulate.grid import parse_spec

    rows = {}
    for mode in ("per_layer", "per-layer"):
        r = CliRunner().invoke(app, ["simulate", "--trace", str(SAMPLE_OLMOE), "--policies", "ar", "--cache-experts",
                                     "8", "--cache-mode", mode, "--json"])
        assert r.exit_code == 0, r.output
        rows[mode] = json.loads(r.stdout)
    assert rows["per-layer"] == rows["per_layer"] and rows["per-layer"][0]["cache_mode"] == "per_layer"
    spec = parse_spec({"traces": [str(SAMPLE_OLMOE)], "cache_mode": ["per-layer", "global"]})
    assert spec.axes["cache_mode"] == ["per_layer", "global"]
    with pytest.raises(SpecFitError, match=r"field 'cache_mode' lists a value twice: \['per_layer', 'per_layer'\]"):
        parse_spec({"traces": [str(SAMPLE_OLMOE)], "cache_mode": ["per_layer", "per-layer"]})


def test_predictor_router_without_model_is_refused_before_any_trace_is_read(tmp_path, monkeypatch):
    import specfit.traces.format as trace_format

    garbled = tmp_path / "garbled.parquet"
    garbled.write_bytes(b"not a parquet file")
    monkeypatch.setattr(trace_format, "read_trace", lambda *a, **k: pytest.fail("trace read"))
    r = CliRunner().invoke(app, ["simulate", "--trace", str(garbled), "--predictor", "router"])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert r.output.strip() == ("error: --predictor router: needs the target's weights; pass --model DIR (the "
                                "trace's model)")


def test_a_model_without_the_router_predictor_is_refused_not_ignored(tmp_path):
    r = CliRunner().invoke(app, ["simulate", "--trace", str(SAMPLE_OLMOE), "--predictor", "affinity", "--model",
                                 str(tmp_path)])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert r.output.strip() == (f"error: --model {tmp_path}: only --predictor router reads the target's weights; "
                                f"--predictor is affinity")


# --------------------------------------------------------------------------- levers in the replay
def test_hand_trace_chain1_prefetch_copies_the_roots_expert_while_drafting():
    # a draft level of 1 s carries 1 / 0.49 = 2.04 transfers: before level 1 of each cycle the
    # root's expert (need 1) is copied. Position 0: e0 prefetched, then {root, A}: e0 hits, e1
    # misses and is streamed (e0 holds the one slot); time 1 + 1 + 0.2 + 0.01 + 0.5 = 2.71.
    # Position 2: e3 prefetched over e0 (need 1 > 0), then {root, 50}: e3 hits, e0 misses: 2.71.
    # Without prefetch: 1 + 1 + 0.2 + 1.0 = 3.2 and (e0 kept) 1 + 1 + 0.2 + 0.01 + 0.5 = 2.71.
    trace = hand_trace()
    prep = prepare("hand", trace, trace.true_experts)
    cost = HAND_COST.replace(draft_level_s=1.0)
    log = replay(prep, make_policy("chain:1+prefetch"), ExpertCache(1, 4, capacity=1, expert_bytes=1000), cost)
    c = log.columns
    assert c["prefetched"].tolist() == [1, 1]
    assert c["hits"].tolist() == [1, 1] and c["misses"].tolist() == [1, 1]
    np.testing.assert_allclose(c["charged_time_s"], [2.71, 2.71])
    assert c["bytes_h2d"].tolist() == [2000, 2000]        # the prefetched copies are bytes too
    # deciding with the true experts, the bytes it predicts are what moved: the prefetched ones included
    from specfit.accounting import replay_frame
    rows = replay_frame(c, 1000)
    assert rows["predicted_bytes_h2d"].tolist() == [2000, 2000] and rows["charged_bytes_h2d"].tolist() == [2000, 2000]
    plain = replay(prep, make_policy("chain:1"), ExpertCache(1, 4, capacity=1, expert_bytes=1000), cost).columns
    np.testing.assert_allclose(plain["charged_time_s"], [3.2, 2.71])
    assert log.committed[0].tolist() == [11, 12, 13]


@pytest.mark.parametrize("spec", ["ar+usage", "chain:2+cache+prefetch", "static:4+cache", "specfit+cache+prefetch",
                                  "specfit+online", "specfit+cache+prefetch+online"])
def test_levers_keep_the_reference_output(sample, spec):
    cost = preset_profile("gh200", SHAPES["qwen3-30b-a3b"]).cost
    log = replay(sample, make_policy(spec), ExpertCache(48, 128, 32), cost)
    for got, want in zip(log.committed, sample.reference):
        np.testing.assert_array_equal(got, want, err_msg=spec)
    assert (log.columns["hits"] + log.columns["misses"] == log.columns["union_size"]).all()


def test_prefetch_never_moves_more_than_the_drafted_levels_carry(sample):
    cost = preset_profile("gh200", SHAPES["qwen3-30b-a3b"]).cost
    log = replay(sample, make_policy("specfit+cache+prefetch"), ExpertCache(48, 128, 32), cost)
    c = log.columns
    per_level = cost.draft_level_s / (cost.miss_s - cost.hit_s)
    assert (c["prefetched"] <= np.floor(c["draft_levels"] * per_level + 1e-9)).all()
    assert c["prefetched"].sum() > 0


@pytest.mark.parametrize("spec", ["specfit+cache+prefetch", "specfit+usage+prefetch", "chain:2+cache+prefetch",
                                  "static:6+cache+prefetch", "ar+usage"])
@pytest.mark.parametrize("predictor", ["true", "poor"])
def test_compiled_lever_replay_equals_the_loop_through_the_lever_objects(spec, predictor):
    """The compiled levers (kernels.levers in the replay kernels) and the Python loop that runs the
    DraftLookahead / DraftPrefetch objects (``compiled=False``) give the same columns (the
    prefetched copies included), committed tokens, recorded unions, cache state and counters,
    advisor use record, prefetch carry and policy state, with a cache small enough that keep and
    prefetch both act."""
    trace = read_trace(SAMPLE_OLMOE)
    experts = trace.true_experts if predictor == "true" else np.roll(trace.true_experts, 1, axis=0)
    prep = prepare("oracle" if predictor == "true" else "parent", trace, experts)
    cost = preset_profile("gh200", SHAPES.get(trace.model["name"])).cost
    runs = []
    for python_loop in (False, True):
        policy = make_policy(spec)
        policy.observe(Observation(predicted_slots=100, predicted_slots_right=60, resident_share=0.25))
        cache = ExpertCache(trace.n_layers, trace.n_experts, 16)
        log = replay(prep, policy, cache, cost, record_unions=True, compiled=not python_loop, per_layer=True)
        runs.append((log, cache, policy))
    (a, cache_a, pol_a), (b, cache_b, pol_b) = runs
    assert len(a) == len(b) > 0
    for name, column in a.columns.items():
        np.testing.assert_array_equal(column, b.columns[name], err_msg=name)
    for x, y in zip(a.committed, b.committed):
        np.testing.assert_array_equal(x, y)
    assert len(a.unions) == len(b.unions) == len(a)
    for x, y in zip(a.unions, b.unions):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(cache_a.kernel_state(), cache_b.kernel_state()):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(cache_a.prefetched, cache_b.prefetched)
    np.testing.assert_array_equal(pol_a.cache_advisor.usage_, pol_b.cache_advisor.usage_)
    if pol_a.prefetcher is not None:
        assert pol_a.prefetcher._carry == pol_b.prefetcher._carry
        assert a.columns["prefetched"].sum() == cache_a.prefetched.sum() > 0
    for x, y in zip(getattr(pol_a, "state", ()), getattr(pol_b, "state", ())):
        np.testing.assert_array_equal(x, y)
    # the keep priorities acted: the same run without the advisor evicts differently
    plain = make_policy(spec.split("+")[0] + ("+prefetch" if pol_a.prefetcher is not None else ""))
    plain.observe(Observation(predicted_slots=100, predicted_slots_right=60, resident_share=0.25))
    other = replay(prep, plain, ExpertCache(trace.n_layers, trace.n_experts, 16), cost)
    assert not np.array_equal(other.columns["misses"][:len(a)], a.columns["misses"][:len(other)])


@pytest.mark.parametrize("mode", ["per_layer", "global"])
@pytest.mark.parametrize("spec", ["ar", "chain:4", "specfit", "specfit+cache+prefetch"])
def test_moe_infinitys_eviction_replays_alike_compiled_and_through_the_objects(spec, mode):
    """MoE-Infinity's eviction forgets its counts as each sequence's decoding begins, and its
    prompt passes evict nothing: the compiled replay (in the kernel) and the Python loop (through
    ``ExpertCache.begin_prompt`` / ``begin_decode``) leave the same columns and cache state, the
    layer-ahead recount rebuilds the same cache, and the rule is not LFU's (a different run)."""
    from specfit.experts.layer_ahead import recount

    trace = with_prompt_passes(read_trace(SAMPLE_OLMOE), 2, 12, seed=1)
    assert len(np.unique(trace.sequence)) > 1
    prep = prepare("parent", trace, np.roll(trace.true_experts, 1, axis=0))
    cost = preset_profile("pcie4", SHAPES.get(trace.model["name"])).cost
    capacity = 16 if mode == "per_layer" else 16 * trace.n_layers
    runs = {}
    for eviction, compiled in (("moe-infinity", True), ("moe-infinity", False), ("lfu", True)):
        policy = make_policy(spec)
        cache = ExpertCache(trace.n_layers, trace.n_experts, capacity, mode=mode, policy=eviction)
        runs[eviction, compiled] = (replay(prep, policy, cache, cost, record_unions=True, compiled=compiled), cache)
    (a, cache_a), (b, cache_b) = runs["moe-infinity", True], runs["moe-infinity", False]
    if "+" not in spec:        # a recount rebuilds the cache of a policy without levers
        recount(trace, a, capacity, cost, mode=mode, policy="moe-infinity")
    for name, column in a.columns.items():
        np.testing.assert_array_equal(column, b.columns[name], err_msg=name)
    for x, y in zip(cache_a.kernel_state(), cache_b.kernel_state()):
        np.testing.assert_array_equal(x, y)
    lfu = runs["lfu", True][0]
    n = min(len(a), len(lfu))
    assert not np.array_equal(lfu.columns["misses"][:n], a.columns["misses"][:n])


@pytest.mark.parametrize("build", [
    lambda: make_policy("specfit"),
    lambda: SpecFitPolicy(8, price_uncertainty="precision", lookahead="optimistic"),
    lambda: SpecFitPolicy(3, price_uncertainty="none", lookahead="none", first_level_test=False),
    lambda: SpecFitPolicy(8, overhead_level_s=2e-4),
], ids=["default", "precision-optimistic", "plain-3-levels", "overhead"])
def test_specfit_compiled_replay_equals_its_policy_driven_level_by_level(build):
    """The compiled SpecFit replay (kernels.replay.decide_cycle over kernels.decide's rules) and the loop
    that drives the policy object level by level (``choose``, as live; ``compiled=False``)
    decide alike, cycle for cycle, and leave the policy in the same state, with predicted experts
    and a cache, so that the observed price and the level-0 test both act."""
    trace = read_trace(SAMPLE_OLMOE)
    prep = prepare("parent", trace, np.roll(trace.true_experts, 1, axis=0))   # a poor prediction
    cost = preset_profile("pcie4", SHAPES.get(trace.model["name"])).cost
    logs, states = [], []
    for python_loop in (False, True):
        policy = build()
        policy.observe(Observation(predicted_slots=100, predicted_slots_right=60, resident_share=0.25))
        log = replay(prep, policy, ExpertCache(trace.n_layers, trace.n_experts, 16), cost, record_unions=True,
                     compiled=not python_loop, per_layer=True)
        logs.append(log)
        states.append([a.copy() for a in policy.state])
    assert len(logs[0]) == len(logs[1]) > 0
    for name, column in logs[0].columns.items():
        np.testing.assert_array_equal(column, logs[1].columns[name], err_msg=name)
    for x, y in zip(logs[0].unions, logs[1].unions, strict=True):
        np.testing.assert_array_equal(x, y)
    for a, b in zip(states[0], states[1]):
        np.testing.assert_array_equal(a, b)
    # the rules acted: drafting happened and the observed price was learned
    assert logs[0].columns["draft_levels"].max() > 0
    assert states[0][2][kernels.decide.N_OBSERVED] > 0 or states[0][0][kernels.decide.PRICE] != kernels.decide.OBSERVED


def test_a_noisy_oracle_at_full_precision_replays_as_the_true_experts_and_a_worse_one_differs():
    """``--predictor noisy:P``: at P = 1 SpecFit decides exactly as with the true experts; at P = 0.5
    its predicted unions are wrong, the replay still commits the reference output."""
    trace = read_trace(SAMPLE_QWEN3)
    scenarios = [Scenario("pcie4", preset_profile("pcie4", SHAPES["qwen3-30b-a3b"]).cost)]
    runs = {p: run_sweep([prepare_trace("qwen3", trace, predictor=p)], ["specfit+cache+prefetch"], [32], scenarios)[0]
            for p in ("oracle", "noisy:1", "noisy:0.5")}
    for column in ("nodes_verified", "committed_tokens", "hits", "misses", "charged_time_s"):
        np.testing.assert_array_equal(runs["noisy:1"][column], runs["oracle"][column], err_msg=column)
    assert not runs["noisy:0.5"]["nodes_verified"].equals(runs["oracle"]["nodes_verified"])
    half = prepare_trace("qwen3", trace, predictor="noisy:0.5")
    log = replay(half, make_policy("specfit+cache+prefetch"), ExpertCache(48, 128, 32), scenarios[0].cost)
    for got, want in zip(log.committed, half.reference):
        np.testing.assert_array_equal(got, want)


def test_a_speedup_that_rounds_to_one_keeps_its_sign():
    from specfit.console import speedup_text

    assert [speedup_text(v) for v in (1.374, 0.9989, 1.0041, 1.0, 0.995)] == ["1.37x", "0.999x", "1.004x", "1.00x", "0.99x"]
    assert speedup_text(float("nan")) == "-" and speedup_text(None, "–") == "–"


def test_a_figure_without_a_value_prints_as_a_dash():
    import numpy as np

    from specfit.console import figure_text

    assert [figure_text(v, ".2f") for v in (1.234, float("nan"), None, np.float32("nan"))] == ["1.23", "-", "-", "-"]
    assert figure_text(0.125, ".0%") == "12%" and figure_text(float("nan"), ".0%", "–") == "–"


def test_a_trace_changed_in_memory_is_validated_before_the_compiled_replay():
    # the replay indexes by depth without bounds checks: one wrong depth crashed the process
    trace = read_trace(SAMPLE_OLMOE)
    depth = trace.depth.copy()
    depth[1] = 7
    trace.depth = depth
    with pytest.raises(SpecFitError, match="'depth' must equal the parent's depth"):
        prepare("changed", trace, trace.true_experts)
    unread = read_trace(SAMPLE_OLMOE, validate=False)
    unread.offsets = unread.offsets[::-1].copy()
    with pytest.raises(SpecFitError, match="cycle offsets"):
        prepare("unread", unread, unread.true_experts)


@pytest.mark.parametrize("change, message", [
    ({"policies": []}, "policies: expected at least one"),
    ({"cache_sizes": []}, "cache_sizes: expected at least one"),
    ({"policies": ["ar", "ar"]}, "policies: ar twice"),
    ({"scenarios": [Scenario("same", HAND_COST), Scenario("same", HAND_COST)]}, "scenarios: same twice"),
    ({"scenarios": [Scenario("a dict", {"base_s": 1.0})]}, "expected a CostModel, got dict"),
])
def test_run_sweep_refuses_a_grid_without_cells_or_with_colliding_rows_before_any_replay(change, message):
    trace = hand_trace()
    grid = {"prepared": [prepare("hand", trace, trace.true_experts)], "policies": ["ar"], "cache_sizes": [1],
            "scenarios": [Scenario("hand", HAND_COST)], **change}
    with pytest.raises(ValueError, match=message):
        run_sweep(**grid)


def test_speedups_divide_by_the_baseline_row_of_the_same_setting():
    """The one speed-up of simulate, sweep and plan: over the baseline's row with the same keys,
    NaN where the setting has none."""
    from specfit.accounting import with_speedups

    frame = pd.DataFrame({"policy": ["ar", "specfit", "eagle3", "specfit", "specfit"],
                          "trace": ["a", "a", "a", "b", "a"], "cache_experts": [0, 0, 0, 0, 4],
                          "tokens_per_s": [100.0, 150.0, 120.0, 90.0, 180.0]})
    got = with_speedups(frame, ["trace", "cache_experts"])
    np.testing.assert_allclose(got["speedup_vs_ar"], [1.0, 1.5, 1.2, np.nan, np.nan])
    np.testing.assert_allclose(got["speedup_vs_eagle3"], [100 / 120, 150 / 120, 1.0, np.nan, np.nan])
    assert "speedup_vs_ar" not in frame                     # the caller's frame is left as it was


def test_a_prepared_trace_is_read_only_as_a_ray_worker_receives_it_so_its_kernels_compile_once(sample):
    """A sweep's workers get the prepared arrays read-only (zero-copy from Ray's object store), and
    numba compiles a kernel once per argument types: a prepared trace that is writable in the
    driver made every worker compile the replay again (minutes each). Its arrays are read-only
    (the oracle's experts still shared), and a read-only copy adds no kernel signature."""
    import dataclasses

    arrays = {f.name: getattr(sample, f.name) for f in dataclasses.fields(sample)
              if isinstance(getattr(sample, f.name), np.ndarray)}
    assert arrays and not any(a.flags.writeable for a in arrays.values())
    assert sample.predicted_is_true
    cost = preset_profile("pcie5", SHAPES["qwen3-30b-a3b"]).cost
    for spec in ("chain:4", "specfit"):
        replay(sample, make_policy(spec), ExpertCache(48, 128, 16), cost)
    signatures = (len(kernels.replay.replay_compiled.signatures), len(kernels.replay.replay_specfit.signatures))

    def shipped(a):                       # what a worker holds: a copy in read-only memory
        copy = a.copy()
        copy.flags.writeable = False
        return copy

    worker = dataclasses.replace(sample, **{k: shipped(a) for k, a in arrays.items() if k != "predicted_experts"},
                                 predicted_experts=None, _trees={})
    worker.predicted_experts = worker.true_experts
    for spec in ("chain:4", "specfit"):
        replay(worker, make_policy(spec), ExpertCache(48, 128, 16), cost)
    assert (len(kernels.replay.replay_compiled.signatures), len(kernels.replay.replay_specfit.signatures)) == signatures


def with_prompt_passes(trace, passes: int, size: int, seed: int):
    """``trace`` with ``passes`` recorded prompt passes per sequence (``size`` random experts per
    layer each; one pass in the old format, without pass counts), as a live recording holds them."""
    import copy

    rng = np.random.default_rng(seed)
    sequences = sorted({int(s) for s in trace.sequence})
    trace.meta = copy.deepcopy(trace.meta)
    recording = trace.meta["recording"]
    recording["prefill_sequences"] = sequences
    recording["prefill_experts"] = [
        [sorted(rng.choice(trace.n_experts, size, replace=False).tolist()) for _ in range(trace.n_layers)]
        for _ in range(passes * len(sequences))]
    if passes > 1:
        recording["prefill_pass_counts"] = [passes] * len(sequences)
    return trace


@pytest.mark.parametrize("passes", [1, 3])
def test_every_replay_path_starts_each_sequence_with_its_recorded_prompt_pass(passes):
    """A live recording's prompt passes are admitted before each sequence's first cycle by the
    compiled replays (fixed policies and specfit) and the Python loop alike: the same columns, and
    first cycles that hit what the prompt passes made resident. A prompt recorded in several passes
    (one per chunk; the old format's one entry per sequence with ``passes`` 1) has them admitted in
    order: its cache is not the one its passes' union leaves in a cache smaller than that union."""
    import copy

    from specfit.policies import Observation

    trace = with_prompt_passes(read_trace(SAMPLE_OLMOE), passes, 12, seed=0)
    recording = trace.meta["recording"]
    sequences = recording["prefill_sequences"]
    warm = prepare("parent", trace, np.roll(trace.true_experts, 1, axis=0))
    cold_trace, union_trace = copy.copy(trace), copy.copy(trace)
    cold_trace.meta, union_trace.meta = copy.deepcopy(trace.meta), copy.deepcopy(trace.meta)
    del cold_trace.meta["recording"]["prefill_sequences"], cold_trace.meta["recording"]["prefill_experts"]
    cold_trace.meta["recording"].pop("prefill_pass_counts", None)
    union_trace.meta["recording"].pop("prefill_pass_counts", None)
    union_trace.meta["recording"]["prefill_experts"] = [
        [sorted(set().union(*(recording["prefill_experts"][s * passes + p][layer] for p in range(passes))))
         for layer in range(trace.n_layers)] for s in range(len(sequences))]
    cold = prepare("parent", cold_trace, np.roll(trace.true_experts, 1, axis=0))
    union = prepare("parent", union_trace, np.roll(trace.true_experts, 1, axis=0))
    assert warm.has_prefill.all() and not cold.has_prefill.any()
    assert warm.prefill_bits.shape[0] == warm.prefill_offsets[-1] == passes * len(sequences)
    cost = preset_profile("pcie4", SHAPES[trace.model["name"]]).cost
    for spec in ("ar", "chain:2+cache+prefetch", "specfit", "specfit+cache+prefetch"):
        logs = {}
        for name, prep, compiled in (("warm", warm, True), ("warm", warm, False), ("cold", cold, True),
                                     ("union", union, True)):
            policy = make_policy(spec)
            policy.observe(Observation(predicted_slots=100, predicted_slots_right=60, resident_share=0.25))
            logs[name, compiled] = replay(prep, policy, ExpertCache(trace.n_layers, trace.n_experts, 16), cost,
                                          compiled=compiled)
        for column, values in logs["warm", True].columns.items():
            np.testing.assert_array_equal(values, logs["warm", False].columns[column], err_msg=f"{spec} {column}")
        def first_hits(log):
            return log.columns["hits"][np.r_[True, np.diff(log.columns["sequence"]) != 0]].sum()

        assert first_hits(logs["warm", True]) > first_hits(logs["cold", True]), spec
        # one pass: its union is itself; three of 12 experts a layer through a 16-slot cache leave
        # the last pass's experts resident, not those the eviction keeps of the passes' union
        same = all(np.array_equal(values, logs["union", True].columns[column])
                   for column, values in logs["warm", True].columns.items())
        assert same == (passes == 1), spec


def test_the_recorded_command_runs_as_typed_when_started_as_python_dash_m(tmp_path):
    import os
    import subprocess
    import sys

    out = tmp_path / "sim"
    subprocess.run([sys.executable, "-m", "specfit", "simulate", "--trace", str(SAMPLE_OLMOE), "--policies", "ar",
                    "--cache-experts", "0", "--out", str(out), "--json"], check=True, capture_output=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    command = json.loads((out / "run.json").read_text())["command"]
    assert command.startswith("specfit simulate --trace "), command


def test_the_recorded_command_names_the_options_given_and_leaves_out_those_at_their_default(tmp_path):
    """run.json's command line holds what the user changed (a value different from the option's
    default) and not every option at its default value."""
    out = tmp_path / "sim"
    result = CliRunner().invoke(app, ["simulate", "--trace", str(SAMPLE_OLMOE), "--policies", "ar",
                                      "--cache-experts", "0", "--predictor", "oracle", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    words = json.loads((out / "run.json").read_text())["command"].split()
    assert words[:2] == ["specfit", "simulate"]
    assert words[words.index("--policies") + 1] == "ar"            # given, not the default
    assert words[words.index("--cache-experts") + 1] == "0"        # given, not the default
    assert "--predictor" not in words                               # given, but equal to its default (oracle)


def test_the_recorded_command_keeps_an_option_turned_off_that_is_on_by_default(tmp_path):
    # left out, the command run again from run.json priced the uncertainty again
    out = tmp_path / "sim"
    result = CliRunner().invoke(app, ["simulate", "--trace", str(SAMPLE_OLMOE), "--policies", "ar", "--cache-experts", "0",
                                      "--no-price-uncertainty", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    words = json.loads((out / "run.json").read_text())["command"].split()
    assert "--no-price-uncertainty" in words and "--price-uncertainty" not in words




def two_sequence_trace() -> Trace:
    """The hand trace as sequence 0 (trees of 4, 2 and 2 nodes at positions 0, 1, 2) and a
    sequence 1 of one position: root 30 (e2) -> 35 (e1, p .6), rejected (the target says 31)."""
    h = hand_trace()
    edge = np.r_[np.exp(h.draft_logprob.astype(float)), [1.0, 0.6]]
    return Trace(meta=h.meta, offsets=np.r_[h.offsets, 10], sequence=np.array([0, 0, 0, 1], dtype=np.int32),
                 position=np.array([0, 1, 2, 0], dtype=np.int32),
                 parent=np.r_[h.parent, [-1, 0]].astype(np.int16), depth=np.r_[h.depth, [0, 1]].astype(np.int16),
                 token=np.r_[h.token, [30, 35]].astype(np.int32), draft_logprob=np.log(edge).astype(np.float32),
                 path_prob=np.r_[h.path_prob, [1.0, 0.6]], verdict=np.r_[h.verdict, [31, 7]].astype(np.int32),
                 true_experts=np.r_[h.true_experts.ravel(), [2, 1]].astype(np.int16).reshape(10, 1, 1))


def test_nodes_drafted_is_read_from_each_sequences_own_trees():
    # eagle3:60:1 drafts one level everywhere: sequence 0 at position 0 has root + A + B within one
    # level (3 nodes), at position 2 root + 50 (2); sequence 1's only tree has root + 35 (2), not
    # the 3 of sequence 0's position-0 tree (a chain drafts a node per level whatever the tree)
    trace = two_sequence_trace()
    prep = prepare("two", trace, trace.true_experts)
    for compiled in (True, False):
        log = replay(prep, make_policy("eagle3:60:1"), ExpertCache(1, 4, capacity=1, expert_bytes=1000), HAND_COST,
                     compiled=compiled)
        c = log.columns
        assert c["sequence"].tolist() == [0, 0, 1] and c["position"].tolist() == [0, 2, 0]
        assert c["draft_levels"].tolist() == [1, 1, 1]
        assert c["nodes_drafted"].tolist() == [3, 2, 2]
        assert [x.tolist() for x in log.committed] == [[11, 12, 13], [31]]


def test_nodes_drafted_counts_the_levels_drafted_not_the_deepest_node_selected():
    # eagle3:2:2 drafts two levels and keeps the two most probable nodes: at position 0 the whole
    # 4-node tree is drafted while only root + A (depth 1) are verified; at position 2 the tree has
    # one level: root + 50, both verified
    trace = hand_trace()
    prep = prepare("hand", trace, trace.true_experts)
    for compiled in (True, False):
        c = replay(prep, make_policy("eagle3:2:2"), ExpertCache(1, 4, capacity=1, expert_bytes=1000), HAND_COST,
                   compiled=compiled).columns
        assert c["position"].tolist() == [0, 2]
        assert c["draft_levels"].tolist() == [2, 1]
        assert c["deepest_selected"].tolist() == [1, 1]
        assert c["nodes_verified"].tolist() == [2, 2]
        assert c["nodes_drafted"].tolist() == [4, 2]


def test_a_cache_reused_across_replays_keeps_counting_its_prefetched_copies():
    # chain:1+prefetch on the hand trace copies one expert ahead in each of its two cycles (see
    # test_hand_trace_chain1_prefetch_copies_the_roots_expert_while_drafting); the cache's
    # per-layer counter adds up over the replays it serves, compiled or through the Python loop
    trace = hand_trace()
    prep = prepare("hand", trace, trace.true_experts)
    cost = HAND_COST.replace(draft_level_s=1.0)
    for compiled in (True, False):
        cache = ExpertCache(1, 4, capacity=1, expert_bytes=1000)
        totals = []
        for _ in range(2):
            log = replay(prep, make_policy("chain:1+prefetch"), cache, cost, compiled=compiled)
            assert log.columns["prefetched"].tolist() == [1, 1]
            totals.append(int(cache.prefetched.sum()))
        assert totals == [2, 4], compiled


def test_the_oracle_with_a_cache_lever_replays_as_its_lever_objects_run_it():
    """The oracle drafts, in hindsight, only the levels it verifies; with the look-ahead cache
    advisor its keep is taken on those levels, as the Python loop runs it: ``replay`` (which
    chooses the path) and ``compiled=False`` give the same columns, unions and cache state."""


    trace = read_trace(SAMPLE_OLMOE)
    prep = prepare("parent", trace, np.roll(trace.true_experts, 1, axis=0))
    cost = preset_profile("gh200", SHAPES.get(trace.model["name"])).cost
    runs = []
    for compiled in (True, False):
        policy = make_policy("oracle+cache")
        policy.observe(Observation(predicted_slots=100, predicted_slots_right=60, resident_share=0.25))
        cache = ExpertCache(trace.n_layers, trace.n_experts, 16)
        runs.append((replay(prep, policy, cache, cost, record_unions=True, compiled=compiled), cache))
    (a, cache_a), (b, cache_b) = runs
    assert len(a) == len(b) > 0
    for name, column in a.columns.items():
        np.testing.assert_array_equal(column, b.columns[name], err_msg=name)
    for x, y in zip(a.unions, b.unions, strict=True):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(cache_a.kernel_state(), cache_b.kernel_state()):
        np.testing.assert_array_equal(x, y)


def test_the_oracles_prediction_is_the_truth_in_its_union_columns_whatever_the_predictor():
    # the predictor says e0 for every node; the oracle decides with the true experts, so its
    # predicted union is the true one: at position 0 it verifies root-A-C (true experts e0, e1,
    # e3, HAND_COST: 3 / 3.2 beats 2 / 2.4 and 1 / 1.6), a union of 3 that its prediction
    # overlaps in all 3, with 3 predicted misses in the one-slot cache that starts empty
    trace = hand_trace()
    prep = prepare("e0", trace, np.zeros_like(trace.true_experts))
    for compiled in (True, False):
        c = replay(prep, make_policy("oracle"), ExpertCache(1, 4, capacity=1, expert_bytes=1000), HAND_COST,
                   compiled=compiled).columns
        assert c["nodes_verified"].tolist() == [3]
        assert c["union_size"].tolist() == [3]
        assert c["predicted_union_size"].tolist() == [3]
        assert c["union_overlap"].tolist() == [3], compiled
        assert c["predicted_misses"].tolist() == [3] and c["misses"].tolist() == [3]


def test_the_python_loop_reports_each_cycles_own_verdicts_to_the_policy():
    # a policy the kernels do not run (a subclass) is driven by the Python loop, which reports
    # what each cycle revealed: chain:1 on the hand trace verifies root + A at position 0 (the
    # target says 11 after the root, 12 after A) and root + 50 at position 2 (13, then 7)
    from specfit.policies import ChainPolicy

    class Recording(ChainPolicy):
        def __init__(self):
            super().__init__(1)
            self.seen = []

        def observe(self, obs):
            self.seen.append(obs)
            return super().observe(obs)

    trace = hand_trace()
    prep = prepare("hand", trace, trace.true_experts)
    policy = Recording()
    log = replay(prep, policy, ExpertCache(1, 4, capacity=1, expert_bytes=1000), HAND_COST)
    assert log.columns["position"].tolist() == [0, 2]
    assert [o.verified.tolist() for o in policy.seen] == [[0, 1], [0, 1]]
    assert [np.asarray(o.verdicts).tolist() for o in policy.seen] == [[11, 12], [13, 7]]
    assert [o.draft_levels for o in policy.seen] == [1, 1]
    assert [o.misses for o in policy.seen] == [2, 1]


def test_run_json_records_the_traces_and_cost_models_the_figures_were_made_from(tmp_path):
    """Two runs of the same command line whose figures differ (a profile changed under its name,
    a preset's figures changed in the code) are told apart by their run.json."""
    from specfit.runinfo import source_digest
    from specfit.simulate.grid import file_digest

    infos = []
    for h2d, out in ((1.0, tmp_path / "a"), (0.8, tmp_path / "b")):
        r = CliRunner().invoke(app, ["simulate", "--trace", str(SAMPLE_OLMOE), "--profile", "pcie4", "--policies", "ar",
                                     "--cache-experts", "0", "--h2d-scale", str(h2d), "--out", str(out)])
        assert r.exit_code == 0, r.output
        infos.append(json.loads((out / "run.json").read_text()))
    a, b = infos
    name = next(iter(a["inputs"]["traces"]))
    assert a["inputs"]["traces"][name] == {"path": str(SAMPLE_OLMOE.resolve()), "digest": file_digest(SAMPLE_OLMOE)}
    cost = preset_profile("pcie4", SHAPES["olmoe-1b-7b"]).cost
    (label_a, cost_a), = a["inputs"]["cost_models"][name].items()
    assert label_a == "pcie4" and cost_a["miss_s"] == pytest.approx(cost.miss_s)
    (_, cost_b), = b["inputs"]["cost_models"][name].items()
    assert cost_b["miss_s"] - cost_b["hit_s"] == pytest.approx((cost.miss_s - cost.hit_s) / 0.8)
    assert a["versions"]["specfit_source"] == source_digest() and len(source_digest()) == 16


# (per-cycle total, per-layer column) pairs of the schema
PER_LAYER_TOTALS = (("hits", "hits_per_layer"), ("misses", "misses_per_layer"), ("union_size", "union_per_layer"),
                    ("predicted_union_size", "predicted_union_per_layer"),
                    ("predicted_misses", "predicted_misses_per_layer"))


@pytest.mark.parametrize("path", [SAMPLE_OLMOE, SAMPLE_QWEN3], ids=["olmoe", "qwen3"])
@pytest.mark.parametrize("cache_mode", ["per_layer", "global"])
def test_a_replays_per_layer_columns_sum_to_its_cycle_totals_in_both_loops(path, cache_mode):
    """With ``per_layer`` every policy's replay fills the per-layer columns, which sum to the
    cycle's totals; the Python loop (``compiled=False``) gives the same ones; and the other
    columns are those of the replay without them. A poor prediction, so the predicted union is
    not the true one."""
    trace = read_trace(path)
    prep = prepare("parent", trace, np.roll(trace.true_experts, 1, axis=0))
    cost = preset_profile("gh200", SHAPES.get(trace.model["name"])).cost
    capacity = 16 if cache_mode == "per_layer" else 8 * trace.n_layers
    hit = mispredicted = False
    for spec in ["ar", "chain:4", "eagle3", "static:6", "specfit", "oracle", "specfit+cache+prefetch", "ar+usage"]:
        logs = []
        for compiled, per_layer in ((True, True), (False, True), (True, False)):
            policy = make_policy(spec)
            policy.observe(Observation(predicted_slots=100, predicted_slots_right=60, resident_share=0.25))
            logs.append(replay(prep, policy, ExpertCache(trace.n_layers, trace.n_experts, capacity, mode=cache_mode),
                               cost, compiled=compiled, per_layer=per_layer))
        (a, python, plain) = logs
        c = a.columns
        for total, column in PER_LAYER_TOTALS:
            assert c[column].shape == (len(a), trace.n_layers), (spec, column)
            np.testing.assert_array_equal(c[column].sum(axis=1), c[total], err_msg=f"{spec} {column}")
            np.testing.assert_array_equal(c[column], python.columns[column], err_msg=f"{spec} {column}")
        assert (c["misses_per_layer"] > 0).any(), spec
        hit |= (c["hits_per_layer"] > 0).any()
        mispredicted |= not np.array_equal(c["predicted_misses_per_layer"], c["misses_per_layer"])
        assert set(plain.columns) == set(c) - {column for _, column in PER_LAYER_TOTALS}
        for name, column in plain.columns.items():
            np.testing.assert_array_equal(column, c[name], err_msg=f"{spec} {name}")
        for x, y in zip(a.committed, plain.committed, strict=True):
            np.testing.assert_array_equal(x, y)
    assert hit and mispredicted


def root_trace(true_roots: list) -> Trace:
    """A two-layer, four-expert trace of one sequence whose trees are their roots alone, one per
    position: token 10 + position, the target saying the next one; ``true_roots[p][layer]`` the
    root's true experts (the same number in every layer)."""
    experts = np.array(true_roots, dtype=np.int16)
    n = len(true_roots)
    return Trace(
        meta={"model": {"name": "hand", "n_layers": 2, "n_experts": 4, "top_k": experts.shape[2], "expert_bytes": 1000},
              "drafter": {"name": "hand"}, "workload": "test",
              "recording": {"kind": "synthetic", "position_indexed": True, "full_verification": True},
              "provenance": {"real": [], "synthesised": ["everything"]}},
        offsets=np.arange(n + 1), sequence=np.zeros(n, dtype=np.int32), position=np.arange(n, dtype=np.int32),
        parent=np.full(n, -1, dtype=np.int16), depth=np.zeros(n, dtype=np.int16),
        token=np.arange(10, 10 + n, dtype=np.int32), draft_logprob=np.zeros(n, dtype=np.float32),
        path_prob=np.ones(n), verdict=np.arange(11, 11 + n, dtype=np.int32), true_experts=experts)


def test_a_two_cycle_replays_per_layer_columns_by_hand():
    # top-2, a cache of 2 experts per layer that starts empty; ar verifies each root alone
    # cycle 0: true L0 {0, 1}, L1 {2, 3}, all missing; predicted L0 {0, 1}, L1 {1, 2}, all missing
    # cycle 1: true L0 {0, 2} (0 resident), L1 {2, 3} (both resident); predicted L0 {1, 3} (1
    #   resident), L1 {0, 1} (neither)
    trace = root_trace([[[0, 1], [2, 3]], [[0, 2], [2, 3]]])
    predicted = np.array([[[0, 1], [1, 2]], [[1, 3], [0, 1]]], dtype=np.int16)
    for compiled in (True, False):
        c = replay(prepare("hand", trace, predicted), make_policy("ar"), ExpertCache(2, 4, capacity=2), HAND_COST,
                   compiled=compiled, per_layer=True).columns
        assert c["hits_per_layer"].tolist() == [[0, 0], [1, 2]]
        assert c["misses_per_layer"].tolist() == [[2, 2], [1, 0]]
        assert c["union_per_layer"].tolist() == [[2, 2], [2, 2]]
        assert c["predicted_union_per_layer"].tolist() == [[2, 2], [2, 2]]
        assert c["predicted_misses_per_layer"].tolist() == [[2, 2], [1, 2]]
        assert c["misses"].tolist() == [4, 1] and c["predicted_misses"].tolist() == [4, 3]


def test_in_global_mode_a_layers_misses_are_the_admits_an_earlier_layers_admit_evicted_its_expert():
    # top-1, three slots for both layers, LRU: after cycle 0 (L0 e0, L1 e1) and cycle 1 (L0 e2,
    # L1 e3: e0, the oldest, makes room for L1's e3) L1's e1 is resident but the oldest; cycle 2's
    # L0 e0 takes its slot before L1's admit asks for it: two misses, one per layer
    trace = root_trace([[[0], [1]], [[2], [3]], [[0], [1]]])
    for compiled in (True, False):
        c = replay(prepare("hand", trace, trace.true_experts), make_policy("ar"),
                   ExpertCache(2, 4, capacity=3, mode="global"), HAND_COST, compiled=compiled, per_layer=True).columns
        assert c["misses"].tolist() == [2, 2, 2]
        assert c["misses_per_layer"].tolist() == [[1, 1], [1, 1], [1, 1]]
        assert c["hits_per_layer"].tolist() == [[0, 0], [0, 0], [0, 0]]
        # the prediction (the truth) is priced against the residency the selection saw: e1 resident
        assert c["predicted_misses_per_layer"].tolist() == [[1, 1], [1, 1], [1, 0]]


def test_a_sweeps_summary_has_per_layer_errors_only_when_its_rows_are_kept(sample):
    scenario = Scenario("pcie4", preset_profile("pcie4", SHAPES["qwen3-30b-a3b"]).cost)
    for per_layer in (True, False):
        cycles, summary = run_sweep([sample], ["ar", "eagle3", "specfit"], [16], [scenario], per_layer=per_layer)
        if per_layer:
            assert np.isfinite(summary["union_layer_mape"]).all() and np.isfinite(summary["misses_layer_mape"]).all()
            assert all(len(v) == 48 for v in cycles["union_per_layer"])
            totals = np.array([sum(v) for v in cycles["misses_per_layer"]])
            np.testing.assert_array_equal(totals, cycles["misses"])
        else:
            assert summary["union_layer_mape"].isna().all()
            assert all(len(v) == 0 for v in cycles["union_per_layer"])


def test_a_narrow_terminal_keeps_every_figure_and_policy_name_whole(monkeypatch):
    from rich.console import Console

    import specfit.console

    args = ["simulate", "--trace", str(SAMPLE_OLMOE), "--policies", "ar,static:auto,specfit+cache+prefetch",
            "--cache-experts", "16", "--profile", "pcie5"]
    records = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout)
    monkeypatch.setattr(specfit.console, "table_console", lambda: Console(width=60))     # a 60-column terminal
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    rows = [line for line in r.output.splitlines() if line.startswith("│")]
    assert len(rows) == len(records), r.output       # one line per row: no cell folded onto the next
    for record, row in zip(records, rows):
        cells = [cell.strip() for cell in row.strip("│").split("│")]
        assert cells[1].startswith(record["policy"]), row
        assert f"{record['tokens_per_s']:.2f}" in cells and f"{record['bytes_per_token'] / 1e6:.1f}" in cells, row
    assert "…" not in r.output


def test_a_bracketed_out_directory_is_printed_verbatim_not_read_as_markup(tmp_path):
    out = tmp_path / "run[/]3"       # "[/]" closes no tag: rich would raise MarkupError after the files were written
    r = CliRunner().invoke(app, ["simulate", "--trace", str(SAMPLE_OLMOE), "--policies", "ar", "--cache-experts", "16",
                                 "--out", str(out)])
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    assert f"written to {out}/ " in r.output.replace("\n", " ")


def test_simulate_leaves_nothing_on_a_stderr_that_is_not_a_terminal():
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "specfit", "simulate", "--trace", str(SAMPLE_OLMOE), "--policies", "ar",
                          "--cache-experts", "16"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "ar" in run.stdout and run.stderr == ""      # no blank line from a transient progress bar


@pytest.mark.parametrize("mode", ["per_layer", "global"])
def test_moe_infinitys_counts_start_after_each_prompts_passes_in_every_replay(mode):
    """MoE-Infinity's counts are cleared when a request's decoding begins, after its prompt has
    run: each replay (compiled fixed policies, compiled specfit, the Python loop) gives the hits
    and misses of a cache driven by hand through the same unions: ``begin_prompt``, each
    sequence's prompt passes (which evict nothing under this rule), then ``begin_decode``, then its
    cycles. (The shipped traces record no prompt pass, so a count
    cleared before the passes instead of after them passed every other replay test.)"""
    trace = with_prompt_passes(read_trace(SAMPLE_OLMOE), 3, 24, seed=5)
    prep = prepare("parent", trace, np.roll(trace.true_experts, 1, axis=0))
    assert prep.has_prefill.all()
    cost = preset_profile("pcie4", SHAPES[trace.model["name"]]).cost
    L, E = trace.n_layers, trace.n_experts
    capacity = 16 if mode == "per_layer" else 16 * L
    for spec, compiled in (("ar", True), ("chain:2", True), ("specfit", True), ("specfit", False)):
        cache = ExpertCache(L, E, capacity, mode=mode, policy="moe-infinity")
        log = replay(prep, make_policy(spec), cache, cost, record_unions=True, compiled=compiled)
        by_hand = ExpertCache(L, E, capacity, mode=mode, policy="moe-infinity")
        hits, misses = [], []
        sequence = log.columns["sequence"]
        for row, items in enumerate(log.unions):
            if row == 0 or sequence[row] != sequence[row - 1]:
                by_hand.begin_prompt()
                for pass_items in log.prefill_unions[int(sequence[row])]:
                    by_hand.admit(np.isin(np.arange(L * E), pass_items).reshape(L, E))
                by_hand.begin_decode()
            result = by_hand.admit(np.isin(np.arange(L * E), items).reshape(L, E))
            hits.append(result.total_hits)
            misses.append(result.total_misses)
        where = f"{spec} compiled={compiled}"
        assert log.columns["hits"].tolist() == hits, where
        assert log.columns["misses"].tolist() == misses, where
        assert np.array_equal(cache.resident(), by_hand.resident()), where
        assert np.array_equal(cache.kernel_state()[2], by_hand.kernel_state()[2]), where   # the counts
