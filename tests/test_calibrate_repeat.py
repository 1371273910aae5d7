"""Calibration that survives a noisy machine: probes repeated in rounds, medians, the spread, busy
warnings, the probes' own timings in the profile."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from specfit.assets import tiny_moe_dir, tiny_moe_eagle3_dir
from specfit.calibrate.calibrate_job import CalibrationPlan, calibrate
from specfit.calibrate.repeat import busy_warnings, machine_noise, repeat_rounds
from specfit.errors import SpecFitError


def scripted(values_by_round):
    """A probe whose round r returns rows with the seconds values_by_round[r]."""
    calls = iter(values_by_round)

    def probe():
        return [{"tokens": i, "seconds": s} for i, s in enumerate(next(calls))]

    return probe


def test_the_median_of_the_rounds_drops_a_disturbed_sample():
    rows, timing = repeat_rounds({"p": scripted([[1.0, 2.0, 3.0], [1.1, 9.0, 3.0], [0.9, 2.2, 3.0]])}, rounds=3,
                                 warmup_rounds=0)
    got = rows["p"]
    assert [r["seconds"] for r in got] == [1.0, 2.2, 3.0]
    assert got[1]["seconds_rounds"] == [2.0, 9.0, 2.2]
    assert got[1]["spread"] == pytest.approx((9.0 - 2.0) / 2.2)
    assert got[2]["spread"] == 0.0
    assert len(timing["p"]["wall_s"]) == 3


def test_rounds_that_measure_different_work_are_refused():
    calls = iter([[{"n_nodes": 4, "hits": 3, "seconds": 1.0}], [{"n_nodes": 4, "hits": 5, "seconds": 1.0}]])
    with pytest.raises(SpecFitError, match="hits: 3 vs 5"):
        repeat_rounds({"cycles": lambda: next(calls)}, rounds=2, warmup_rounds=0)


def test_a_cold_first_pass_is_run_untimed_before_the_rounds():
    # a process's first pass over a probe pays one-off costs (kernels loaded, allocations): on the
    # bundled model it took up to 1.7x the median, which alone read as a busy machine
    cold_then_steady = [[5.0, 50.0], [1.0, 10.0], [1.0, 10.0], [1.0, 10.0]]
    rows, timing = repeat_rounds({"p": scripted(cold_then_steady), "q": scripted(cold_then_steady)}, rounds=3)
    for probe in ("p", "q"):
        assert [r["seconds"] for r in rows[probe]] == [1.0, 10.0]
        assert [r["spread"] for r in rows[probe]] == [0.0, 0.0]
        assert len(timing[probe]["wall_s"]) == 3              # the untimed pass is not in the timing
    # without the untimed pass the cold one is a round like the others: the spread says "busy"
    rows, _ = repeat_rounds({"p": scripted(cold_then_steady)}, rounds=3, warmup_rounds=0)
    assert rows["p"][0]["spread"] == pytest.approx(4.0)


def test_a_busy_machine_is_reported():
    def sleepy():                       # wall time the process does not spend computing
        time.sleep(0.02)
        return [{"tokens": 1, "seconds": 0.02}]

    rows, timing = repeat_rounds({"p": sleepy}, rounds=2)
    noise = machine_noise(rows, timing, "cpu", threads=1)
    assert noise["cpu_share"] < 0.5
    assert any("of a CPU core" in w for w in busy_warnings(noise))
    # a CUDA probe waits on the device: its CPU share says nothing
    assert machine_noise(rows, timing, "cuda", threads=1)["cpu_share"] is None
    noisy = {**noise, "cpu_share": 1.0, "spread_median": 0.4, "load_average": 0.5, "cpu_count": 2}
    assert len(busy_warnings(noisy)) == 1 and "varied by 40%" in busy_warnings(noisy)[0]
    assert "--quick" not in busy_warnings(noisy)[0]
    # a quick calibration's few short passes jitter on an idle machine too: the warning says so
    assert "--quick probes are few and short" in busy_warnings({**noisy, "quick": True})[0]
    quiet = {**noisy, "spread_median": 0.03}
    assert busy_warnings(quiet) == []
    assert "load average 5.0 on 2" in busy_warnings({**quiet, "load_average": 5.0})[0]


def test_calibrate_keeps_every_rounds_timing_and_fits_the_medians(monkeypatch):
    torch.set_num_threads(1)
    plan = CalibrationPlan(model_dir=tiny_moe_dir(), drafter_dir=tiny_moe_eagle3_dir(), quick=True)
    ticks = []
    profile = calibrate(plan, progress=lambda: ticks.append(1))
    assert len(ticks) == plan.n_steps             # the progress bar counts the untimed pass too
    assert profile.fit["probe_noise"]["warmup_rounds"] == plan.warmup_rounds == 1
    cycles = profile.probes["cycles"]
    stars = len({n for n in plan.node_counts if n > 1} | {2 * max(plan.node_counts)})
    assert len(cycles) == len(plan.capacity_fractions) * (len(plan.node_counts) * plan.repeats + stars)
    assert sum(r["tree"] == "star" for r in cycles) == len(plan.capacity_fractions) * stars
    # the stars' slope per node is the value per_node_s is held at when the passes cannot identify it
    assert profile.fit["prior"]["per_node_s"] >= 0
    for row in cycles:
        assert len(row["seconds_rounds"]) == plan.rounds
        assert row["seconds"] == pytest.approx(float(np.median(row["seconds_rounds"])))
    for name in ("h2d", "expert_compute"):
        assert all(len(r["seconds_rounds"]) == plan.rounds for r in profile.probes[name])
    noise = profile.fit["probe_noise"]
    assert noise["rounds"] == plan.rounds and noise["spread_median"] >= 0
    assert isinstance(profile.fit["warnings"], list)
    cost = profile.cost
    assert cost.miss_s >= cost.hit_s
    # the fit says which terms it fitted and which it held, and every term is one or the other
    assert set(profile.fit["fitted"]) | set(profile.fit["held"]) | {"draft_level_s"} == \
        {"draft_level_s", "base_s", "per_node_s", "hit_s", "transfer_s"}


def test_a_star_trees_union_is_that_of_two_nodes_at_every_size():
    """The star trees the cycle probes add (identical children) route every child alike, so the
    experts a pass uses do not grow with the node count, while a random tree's do."""
    from specfit.calibrate.cycles import random_tree, star_tree
    from specfit.runtime.loader import load_model
    from specfit.runtime.model import causal_mask
    from specfit.runtime.offload import ExpertOffload

    torch.set_num_threads(1)
    model = load_model(tiny_moe_dir())
    host = model.offload.host
    model.setup_kv_cache(64)
    model.attach_offload(ExpertOffload(host, host.n_experts, device=model.device))
    context = np.arange(8)

    def union(tree):
        model(context, np.arange(8), causal_mask(0, 8))
        out = model(tree.tokens, tree.positions(8), tree.attention_mask(prefix_len=8))
        return out.offload.total_hits + out.offload.total_misses

    with torch.inference_mode():
        stars = [union(star_tree(np.random.default_rng(3), n, model.config.vocab_size)) for n in (2, 5, 17, 33)]
        randoms = [union(random_tree(np.random.default_rng(3), n, model.config.vocab_size)) for n in (2, 33)]
    assert len(set(stars)) == 1 and stars[0] <= 2 * host.n_layers * model.config.top_k
    assert randoms[1] > stars[0]
    tree = star_tree(np.random.default_rng(3), 5, 96)
    assert list(tree.parents) == [-1, 0, 0, 0, 0] and len(set(tree.tokens[1:])) == 1


def test_the_star_passes_slope_is_the_cost_of_a_node():
    """Theil-Sen on the star rows, their experts' cost taken off: the slope survives a disturbed
    pass and stars that route differently; without stars of two sizes there is nothing to say."""
    from specfit.calibrate.cycles import star_node_cost

    rng = np.random.default_rng(0)
    rows = []
    for capacity in (0, 8, 16):
        for n in (2, 4, 8, 16, 32):
            union = int(rng.integers(16, 32))
            misses = union * (16 - capacity) // 16
            seconds = 3e-3 + 9e-5 * n + 1e-4 * union + 2e-5 * misses
            rows.append({"tree": "star", "n_nodes": n, "hits": union - misses, "misses": misses, "seconds": seconds})
    rows.append({"tree": "random", "n_nodes": 32, "hits": 60, "misses": 0, "seconds": 1.0})   # not a star
    rows[3]["seconds"] *= 3                                                                    # a disturbed pass
    assert star_node_cost(rows, hit_s=1e-4, transfer_s=2e-5) == pytest.approx(9e-5, rel=1e-6)
    assert star_node_cost([r for r in rows if r["n_nodes"] == 8]) is None
    assert star_node_cost([]) is None


def test_star_passes_that_get_faster_with_more_nodes_give_a_node_cost_of_zero_not_a_negative_one():
    """A node never costs negative time: stars whose passes shrink with their size (a machine that
    sped up) put the node cost at 0."""
    from specfit.calibrate.cycles import star_node_cost

    rows = [{"tree": "star", "n_nodes": n, "hits": 4, "misses": 0, "seconds": 1e-2 - 1e-4 * n} for n in (2, 4, 8, 16)]
    assert star_node_cost(rows) == 0.0


def test_probed_cache_sizes_are_clipped_to_the_experts_and_to_the_device_budget():
    """Cache sizes beyond the expert count are the expert count; with a budget, each size is cut to
    the largest whose slots (one per layer) and two staging buffers fit in it, a fit exactly at the
    budget included."""
    from specfit.calibrate.cycles import fit_capacities

    # 4 layers, 8 experts of 1 byte: capacity c < 8 holds 4c + 2 bytes (slots + 2 staging buffers), c = 8 holds 32
    assert fit_capacities([2, 6, 100], n_layers=4, n_experts=8, expert_bytes=1, budget_bytes=None) == [2, 6, 8]
    assert fit_capacities([2, 6, 8], n_layers=4, n_experts=8, expert_bytes=1, budget_bytes=22) == [2, 5]   # 4*5+2 = 22
    assert fit_capacities([2, 6, 8], n_layers=4, n_experts=8, expert_bytes=1, budget_bytes=21) == [2, 4]
    assert fit_capacities([1, 8], n_layers=4, n_experts=8, expert_bytes=1, budget_bytes=32) == [1, 8]
    with pytest.raises(SpecFitError, match="staging buffers"):
        fit_capacities([2], n_layers=4, n_experts=8, expert_bytes=1, budget_bytes=1)


def test_cycle_rows_become_features_with_hits_and_misses_in_their_own_columns():
    """The probes' rows priced by a cost model whose miss costs more than a hit: a row of 5 hits and
    2 misses is 5 hits and 2 misses, not the other way round."""
    from specfit.calibrate.cycles import cycles_features
    from specfit.costmodel import CostModel

    rows = [{"draft_levels": 0, "n_nodes": 3, "hits": 5, "misses": 2, "seconds": 0.25},
            {"draft_levels": 1, "n_nodes": 1, "hits": 0, "misses": 7, "seconds": 0.5}]
    X, y = cycles_features(rows)
    np.testing.assert_array_equal(X, [[0, 1, 3, 5, 2], [1, 1, 1, 0, 7]])
    np.testing.assert_array_equal(y, [0.25, 0.5])
    cost = CostModel(base_s=1e-3, per_node_s=1e-4, hit_s=1e-5, miss_s=1e-3, draft_level_s=0.0)
    # 1e-3 + 3 * 1e-4 + 5 * 1e-5 + 2 * 1e-3 = 3.35e-3
    assert X[0] @ cost.params == pytest.approx(3.35e-3)


def test_the_drafter_level_probe_leaves_its_warm_up_tree_out_of_the_timings(monkeypatch):
    """The first tree only warms up: its slow levels must not enter the medians. A scripted clock
    makes every level of the warm-up tree take 100 s and every later level 1 s (level l: l s more)."""
    from specfit.calibrate import cycles
    from specfit.runtime.loader import drafter_capture_layers, load_drafter, load_model

    torch.set_num_threads(1)
    capture = drafter_capture_layers(tiny_moe_eagle3_dir(), load_model(tiny_moe_dir()).config)
    model = load_model(tiny_moe_dir(), cache_experts=16, capture_layers=capture)
    drafter = load_drafter(tiny_moe_eagle3_dir(), model)
    levels, repeats = 3, 1
    spans = iter([100.0] * levels + [float(level) for level in range(1, levels + 1)] * repeats)
    clock = {"now": 0.0, "calls": 0}

    def fake_now(device):
        clock["calls"] += 1
        if clock["calls"] % 2 == 0:                      # the end of a level: its scripted span
            clock["now"] += next(spans)
        return clock["now"]

    monkeypatch.setattr(cycles, "device_now", fake_now)
    rows = cycles.probe_drafter_levels(model, drafter, top_k=2, levels=levels, repeats=repeats)
    assert [r["level"] for r in rows] == [1, 2, 3]
    assert [r["seconds"] for r in rows] == [1.0, 2.0, 3.0]
    assert all(np.isfinite(r["width"]) and r["width"] >= 1 for r in rows)


def test_zero_rounds_of_probes_is_one_clear_error():
    with pytest.raises(SpecFitError, match="at least 1 round"):
        repeat_rounds({"p": lambda: [{"tokens": 1, "seconds": 1.0}]}, rounds=0, warmup_rounds=0)


def test_a_copy_probes_bandwidth_is_recomputed_in_decimal_gigabytes_per_second_from_the_median():
    """2e9 bytes copied in a median of 0.5 s is 4 GB/s (1 GB = 1e9 bytes, as the presets' published
    PCIe figures are), whatever the first round's own figure said."""
    seconds = iter([0.4, 0.5, 2.0])
    rows, _ = repeat_rounds({"h2d": lambda: [{"bytes": 2_000_000_000, "seconds": next(seconds), "gbps": 5.0}]},
                            rounds=3, warmup_rounds=0)
    assert rows["h2d"][0]["seconds"] == 0.5
    assert rows["h2d"][0]["gbps"] == pytest.approx(4.0)


def test_a_random_probe_tree_is_never_deeper_than_its_max_depth():
    """Each node's parent is no deeper than max_depth - 1, so no node is deeper than max_depth; a
    large tree reaches that depth."""
    from specfit.calibrate.cycles import random_tree

    for seed in range(5):
        tree = random_tree(np.random.default_rng(seed), 200, 50, max_depth=3)
        assert int(tree.depth.max()) == 3
        assert np.all(np.diff(tree.depth) >= 0)                   # level order


def test_a_machine_loaded_below_its_core_count_gets_no_load_warning():
    quiet = {"rounds": 3, "spread_median": 0.01, "cpu_share": None, "cpu_count": 4}
    assert busy_warnings({**quiet, "load_average": 3.5}) == []
    assert busy_warnings({**quiet, "load_average": 4.5}) == ["load average 4.5 on 4 CPU cores during calibration"]
