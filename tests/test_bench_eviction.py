"""The eviction benchmark's rows: each entry is the replay it names (the cache's mode and rule
as asked), the best fixed setting is the best of the fixed ones, and Belady's optimum bounds AR
under every rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench_helpers import bench_module
from specfit.calibrate.presets import resolve_profile
from specfit.calibrate.profile import ModelShape
from specfit.experts.cache import ExpertCache
from specfit.policies import Observation, make_policy
from specfit.simulate.replay import prepare_trace, replay
from specfit.traces.format import read_trace

SAMPLE = Path(__file__).resolve().parents[1] / "traces" / "olmoe-1b-7b-real-routing.parquet"


@pytest.fixture(scope="module")
def bench():
    return bench_module("bench_eviction")


@pytest.mark.parametrize("mode, capacity", [("per_layer", 16), ("global", 16 * 16)])
def test_a_settings_row_is_the_replays_it_names(bench, mode, capacity):
    trace = read_trace(SAMPLE)
    prep = prepare_trace("sample", trace, "oracle", "calibrated")
    cost = resolve_profile("pcie4", ModelShape.from_trace_meta(trace.model)).cost
    row = bench.run_setting(prep, capacity, mode, ["lru", "moe-infinity"], cost, max_nodes=4)
    for eviction in ("lru", "moe-infinity"):
        for spec in ("ar", "chain:2", "specfit+cache+prefetch"):
            # what bench_policy.py tells a policy before a replay
            cache = ExpertCache(trace.n_layers, trace.n_experts, capacity, mode=mode, policy=eviction)
            policy = make_policy(spec)
            policy.observe(Observation(predicted_slots=prep.info["predicted_slots"],
                                       predicted_slots_right=prep.info["predicted_slots_right"],
                                       resident_share=cache.capacity_share))
            log = replay(prep, policy, cache, cost)
            assert row[spec, eviction] == pytest.approx(log.columns["committed_tokens"].sum()
                                                        / log.columns["charged_time_s"].sum(), rel=1e-12)
        assert row["best fixed", eviction] == max(row[s, eviction] for s in bench.bp.FIXED)
        assert row[row["best fixed name", eviction], eviction] == row["best fixed", eviction]
        assert row["ar belady"] >= row["ar", eviction]
    # the rules differ on this trace: MoE-Infinity's keeps more of what AR needs than LRU
    assert row["ar", "moe-infinity"] != row["ar", "lru"]


def test_bad_arguments_exit_with_one_line(bench, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["bench_eviction.py", "--evictions", "lru,random"])
    with pytest.raises(SystemExit, match="--evictions"):
        bench.main()
