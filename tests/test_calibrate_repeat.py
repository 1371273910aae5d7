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
